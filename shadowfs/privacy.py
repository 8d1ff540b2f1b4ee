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


def tighten(path: str | os.PathLike[str]) -> None:
    """Clears the group and other bits of one file or directory (and a file's execute and
    set-id bits); a symlink, a missing path or one owned by someone else is left alone."""
    try:
        # O_NOFOLLOW + fchmod: a symlink swapped in after a check can never redirect the chmod.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _LEAVE:
            return
        raise
    try:
        mode = os.fstat(fd).st_mode
        keep = PRIVATE_DIR if stat.S_ISDIR(mode) else PRIVATE_FILE
        if stat.S_IMODE(mode) & ~keep:
            os.fchmod(fd, stat.S_IMODE(mode) & keep)
    except OSError as exc:
        if exc.errno not in _LEAVE:
            raise
    finally:
        os.close(fd)


def tighten_tree(directory: str | os.PathLike[str], depth: int = 1) -> None:
    """Tightens ``directory`` and what lies in it, ``depth`` levels down (symlinks skipped)."""
    tighten(directory)
    if depth <= 0:
        return
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            tighten_tree(entry.path, depth - 1)
        elif entry.is_file(follow_symlinks=False):
            tighten(entry.path)
