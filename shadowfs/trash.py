"""Freeing the files a commit replaced or removed, off the commit's clock.

Freeing a file's blocks can be slow: on an ext4 mounted with ``discard`` every freed extent is
a synchronous discard (2.5-3 ms per small file on a VM's disk, against 78 µs for a rename that
frees nothing). A commit therefore moves the files it replaces or removes into a *trash*
directory on the same file system (a rename, which frees nothing) and frees them after its
commit point, or leaves that to a later moment (`empty_later`).

A trash directory holds only garbage: nothing reads it back, so emptying it may happen at any
time, be interrupted, and be run twice at once. Whoever empties it holds an exclusive flock on
it; `empty` with ``wait=False`` leaves a trash alone while another process is on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from shadowfs.removal import remove_tree

__all__ = ["empty", "empty_later"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Frees overlap in the file system (each waits on the device), not in Python: a few threads.
_THREADS = 8


def empty(
    path: str | bytes | os.PathLike[str] | os.PathLike[bytes],
    *,
    dir_fd: int | None = None,
    wait: bool = True,
    remove: bool = True,
) -> bool:
    """Free everything in the trash directory ``path`` (relative to ``dir_fd`` when given) and,
    with ``remove``, the directory itself. Returns False, having done nothing, when it is gone
    or (``wait=False``) another process is emptying it."""
    try:
        fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            return False
        # However deep the agent nested what the commit threw away (shadowfs.removal).
        with ThreadPoolExecutor(_THREADS, thread_name_prefix="shadowfs-trash") as threads:
            remove_tree(".", dir_fd=fd, keep_top=True, threads=threads)
        if remove:
            with contextlib.suppress(FileNotFoundError, OSError):
                os.rmdir(path, dir_fd=dir_fd)
        return True
    finally:
        os.close(fd)


def empty_later(path: str | os.PathLike[str]) -> bool:
    """Empty and remove the trash directory ``path`` in a detached process, which outlives the
    caller (a command that just committed returns at once). Should it die, the trash stays
    for the next `empty` or `empty_later` of it. False, starting nothing, when the trash is gone
    or a process is emptying it already."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # released: the process takes the lock itself
    subprocess.Popen(
        [sys.executable, "-m", "shadowfs.trash", os.fspath(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=True,
    )
    return True


if __name__ == "__main__":
    os.nice(10)  # garbage: whatever else runs goes first
    for arg in sys.argv[1:]:
        with contextlib.suppress(OSError):
            empty(arg, wait=False)
