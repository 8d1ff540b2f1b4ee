"""The kernel's FUSE control file system (fusectl) and finding a mount's connection.

Connection N of /sys/fs/fuse/connections is the FUSE mount whose device is 0:N; its files
belong to the user who mounted. Devices are read from mountinfo, never by a stat of the mount,
which would itself be a request to a server that may not answer.
"""

from __future__ import annotations

import os

from shadowfs.fuse_wire import abort_connection, fusectl_identity
from shadowfs.mountctl import FSTYPE

__all__ = ["abort_connection", "fusectl_identity"]
from shadowfs.mountinfo import unescape

FUSECTL = "/sys/fs/fuse/connections"


def mounts(pid: int | str) -> list[tuple[str, str, str]]:
    """(major:minor, mount point, fstype) of every mount in process `pid`'s namespace."""
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.readlines()
    except OSError:
        return []
    found = []
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields = head.split(" ")
        if len(fields) >= 5:
            found.append((fields[2], unescape(fields[4]), tail.split(" ", 1)[0]))
    return found


def connections(mounts: list[tuple[str, str, str]]) -> list[int]:
    return [
        int(device.partition(":")[2])
        for device, _, fstype in mounts
        if fstype == FSTYPE and device.startswith("0:")
    ]


def connection_at(mountpoint: str) -> int | None:
    """The FUSE connection of this process's layer mounted at `mountpoint` (read from
    mountinfo: a stat of the mount would be a request to it)."""
    found = connections([m for m in mounts("self") if m[1] == mountpoint])
    return found[-1] if found else None


def waiting(number: int, identity: tuple[int, int] | None = None) -> int:
    """How many requests of FUSE connection `number` wait for an answer (0 when it is gone, or
    when `identity` is given and the number now names another connection)."""
    if identity is not None and fusectl_identity(number) != identity:
        return 0
    try:
        with open(os.path.join(FUSECTL, str(number), "waiting")) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0
