"""Private state on disk: directories 0700, files 0600, and tightening what an older version left.

A store holds every byte an agent wrote, a 0600 ``.env`` included: the copy must be no more
readable than the original. Creation modes go through the umask as usual, so a stricter umask
still wins; tightening only ever clears bits, never sets them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600

# Reasons to leave a path as it is: gone meanwhile, a symlink (never followed), or not ours
# (someone else's tape dir opened read-only: its owner tightens it on their next run).
_LEAVE = (errno.ENOENT, errno.ELOOP, errno.EPERM, errno.EACCES, errno.EROFS, errno.ENOTDIR)


def make_private_dirs(path: str | os.PathLike[str]) -> None:
    """Creates ``path`` and every missing parent with mode 0700 (os.makedirs would give the
    parents the default 0777 minus umask); existing directories keep their modes."""
    path = os.path.abspath(path)
    missing: list[str] = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by a concurrent opener
            os.mkdir(directory, PRIVATE_DIR)


def is_loose(path: str | os.PathLike[str]) -> bool:
    """True when group or others have any permission bit on ``path`` (False when absent)."""
    try:
        return bool(os.lstat(path).st_mode & 0o077)
    except OSError:
        return False


def tighten(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
    """Clears the group and other bits of one regular file or directory (and a file's execute
    and set-id bits). A symlink is never followed and nothing else is opened: a tape dir can
    come from someone else, and its `.jukebox` may point at /etc."""
    tighten_tree(path, 0, dir_fd=dir_fd)


def tighten_tree(
    path: str | os.PathLike[str], depth: int = 1, *, dir_fd: int | None = None
) -> None:
    """Tightens ``path`` and what lies in it, ``depth`` levels down, through file descriptors
    opened with O_NOFOLLOW: a symlink anywhere, even one swapped in meanwhile, is left alone.
    A path that is gone, not ours or not a plain file or directory is left alone too."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _LEAVE:
            return
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            return
        keep = PRIVATE_DIR if stat.S_ISDIR(mode) else PRIVATE_FILE
        if stat.S_IMODE(mode) & ~keep:
            try:
                # An O_PATH fd has no fchmod; its /proc link reaches exactly this inode.
                os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(mode) & keep)
            except OSError as exc:
                if exc.errno not in _LEAVE:
                    raise
        if depth > 0 and stat.S_ISDIR(mode):
            _tighten_children(fd, depth - 1)
    finally:
        os.close(fd)


def _tighten_children(dir_path_fd: int, depth: int) -> None:
    try:
        listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_path_fd)
    except OSError:
        return
    try:
        with os.scandir(listing) as entries:
            names = [e.name for e in entries if not e.is_symlink()]
        for name in names:
            tighten_tree(name, depth, dir_fd=listing)
    finally:
        os.close(listing)
