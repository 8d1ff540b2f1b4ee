"""The mounts of this process's mount namespace, as /proc/self/mountinfo lists them."""

from __future__ import annotations

import os
from collections import namedtuple

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import NamedTuple

MOUNTINFO = "/proc/self/mountinfo"


# fstype: "fuse.SUBTYPE" for a FUSE mount; source: a FUSE mount's fsname. At run time the
# collections.namedtuple that typing.NamedTuple makes, without typing (shadowfs.store's _Staged
# says why that matters).
if TYPE_CHECKING:

    class MountEntry(NamedTuple):
        mount_id: int
        mount_point: str
        fstype: str
        source: str

else:
    MountEntry = namedtuple("MountEntry", ("mount_id", "mount_point", "fstype", "source"))


def unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    if "\\" not in field:
        # Nearly every field: the loop below is a Python step per character, and a booth's
        # start and end unescape every mount point of mountinfo two or three times (its mount,
        # its FUSE connection, its unmount).
        return field
    out = []
    i = 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and i + 4 <= len(field):
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_at(path: str | os.PathLike[str]) -> list[MountEntry]:
    """Every mount whose mount point is ``path``, oldest first (the last one is visible)."""
    want = os.path.abspath(os.fspath(path))
    out = []
    with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            fields = head.split(" ")
            if len(fields) < 5 or unescape(fields[4]) != want:
                continue
            fstype, source = [*tail.split(" ", 2), "", ""][:2]
            out.append(MountEntry(int(fields[0]), want, fstype, unescape(source)))
    return out
