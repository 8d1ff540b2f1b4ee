"""`jukebox booth abort ID`: free a booth whose FUSE layer no longer answers.

A FUSE request waits for its server without end: an agent (or anything else) blocked on a layer
whose supervisor is stopped, wedged or gone-but-not-reaped stays in the kernel, and even SIGKILL
leaves it in D state. The kernel's way out is the connection's `abort` file in the fusectl file
system (/sys/fs/fuse/connections/N/abort, N being the minor device number of the mount): every
request in flight and every later one fails with ENOTCONN. The file belongs to the user who
mounted, so a booth's own user may abort it.

The connection is found from the supervisor's own mount namespace (/proc/PID/mountinfo), at the
mount point only a booth of that id uses (`scratchdir.layer_mountpoint`, in the tape dir): a
recycled pid cannot lead to somebody else's mount. A connection's number is its mount's device
minor, which the kernel gives to the next FUSE mount once the super block is gone; a booth
ending between the look and the abort would leave its number to another mount. So the number's
fusectl directory is identified (device, inode) before the booth's mount is confirmed to hold
it, and the abort goes only to that directory (`fusectl.abort_connection`, as the supervisor's
own watchdog does): a number that went to another mount meanwhile is refused, not aborted.
Then the supervisor is killed; its relay, the init and the agent follow it (PR_SET_PDEATHSIG),
and the booth is left crashed, for `jukebox booth discard` (its tape keeps everything recorded
up to then).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from jukebox.booth import fusectl, isolation
from jukebox.booth.scratchdir import layer_mountpoint, socket_dir_prefix
from jukebox.booth.supervisor import load_record
from jukebox.errors import UsageError
from jukebox.tape.tapedir import TapeDir


def _booth_mounts(tape_dir: TapeDir, pid: int, booth_id: str) -> list[tuple[str, str, str]]:
    """The mounts in `pid`'s namespace made for booth `booth_id` (its layer's mount point in
    the tape dir, its control socket's in /tmp), or [] when `pid` has no such mount."""
    layer = os.path.realpath(layer_mountpoint(tape_dir, booth_id))
    sockets = os.path.join(isolation.SOCKET_PARENT, socket_dir_prefix(tape_dir.path, booth_id))
    return [m for m in fusectl.mounts(pid) if m[1] == layer or m[1].startswith(sockets)]


def abort_booth(tape_dir: TapeDir, booth_id: str, *, grace: float = 10.0) -> list[int]:
    """Aborts booth `booth_id`'s FUSE connection and kills its supervisor; returns the
    connection numbers aborted (none for an overlay booth, which only gets killed)."""
    record = load_record(tape_dir, booth_id)
    pid = record.pid
    if record.status != "running" or not pid or not os.path.exists(f"/proc/{pid}"):
        raise UsageError(
            f"booth {booth_id} is not running (status {record.status}): nothing to abort; "
            f"`jukebox booth discard {booth_id}` drops it"
        )
    # Each number's identity first, then the booth's mounts: a number still the booth's after
    # its identity was taken was the booth's when it was taken (the super block outlived both).
    seen = fusectl.connections(_booth_mounts(tape_dir, pid, booth_id))
    identities = {number: fusectl.fusectl_identity(number) for number in seen}
    mounts = _booth_mounts(tape_dir, pid, booth_id)
    if not mounts:
        raise UsageError(
            f"process {pid} is not booth {booth_id}'s supervisor any more: nothing to abort; "
            f"`jukebox booth discard {booth_id}` drops it"
        )
    found = [
        (number, identity)
        for number in fusectl.connections(mounts)
        if (identity := identities.get(number)) is not None
    ]
    connections = abort_connections(booth_id, found)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    # The supervisor's (empty) mount points: its namespace died with it.
    isolation.remove_stale_socket_dirs(socket_dir_prefix(tape_dir.path, booth_id))
    with contextlib.suppress(OSError):
        os.rmdir(layer_mountpoint(tape_dir, booth_id))
    return connections


def abort_connections(booth_id: str, found: list[tuple[int, tuple[int, int]]]) -> list[int]:
    """Aborts booth `booth_id`'s FUSE connections, each a (number, fusectl identity) taken
    while the number was the booth's; returns the numbers aborted. UsageError, with nothing
    more aborted, when a number now names another mount's connection."""
    aborted = []
    for number, identity in found:
        try:
            if fusectl.abort_connection(number, identity):
                aborted.append(number)
                continue
        except PermissionError:
            raise UsageError(
                f"cannot abort booth {booth_id}'s FUSE connection {number}: it belongs to "
                "another user; run `jukebox booth abort` as the user who started the booth"
            ) from None
        if fusectl.fusectl_identity(number) is not None:
            raise UsageError(
                f"booth {booth_id}'s FUSE connection {number} ended and its number went to "
                f"another mount: not aborted; run `jukebox booth abort {booth_id}` again"
            )
        # Ended meanwhile, and the number is nobody's: nothing to abort there.
    return aborted


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True
