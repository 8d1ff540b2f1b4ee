"""Opening a directory by an absolute path without following any symlink on the way.

`open(path, O_NOFOLLOW)` only refuses a symlink in the last component; one planted anywhere
above it is still followed. Walking from / with openat(O_NOFOLLOW | O_DIRECTORY) one component at
a time refuses them all, so the fd is the directory the path names literally, or an error.
"""

from __future__ import annotations

import os

__all__ = ["DIR_FLAGS", "dir_identity", "open_dir_nofollow"]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir_nofollow(path: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> int:
    """An fd of the directory at the absolute ``path``, reached component by component with
    O_NOFOLLOW. Raises OSError (ELOOP or ENOTDIR for a symlink, ENOENT, ...) otherwise; a path
    with `.` or `..` components raises ValueError, since those are resolved by walking back."""
    raw = os.fsencode(path)
    if not raw.startswith(b"/"):
        raise ValueError(f"not an absolute path: {os.fsdecode(raw)!r}")
    parts = [p for p in raw.split(b"/") if p]
    if any(p in (b".", b"..") for p in parts):
        raise ValueError(f"not a canonical path: {os.fsdecode(raw)!r}")
    # Directories on the way are only searched (O_PATH): a 0711 home must not stop the walk.
    fd = os.open(b"/", _PATH_FLAGS if parts else DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            flags = DIR_FLAGS if i == len(parts) - 1 else _PATH_FLAGS
            child = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def dir_identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of an open directory: what names it across renames of its path."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino
