"""Removing a tree an agent made, however deep: fd by fd, without recursion, following nothing.

An agent chooses the depth of what it leaves in a booth's scratch (an overlay's upper dir) and in
a commit's trash: `mkdir d; cd d` in a loop makes a tree thousands of levels deep. Python 3.11's
`shutil.rmtree` and `os.walk` recurse, one frame per level, and raised RecursionError past about
a thousand: the trash's freeing process died at each of its restarts, and a booth's discard left
its scratch behind. `remove_tree` keeps an explicit stack instead, holds at most `OPEN_DIRS`
directories open however deep the tree (above them a directory is opened again through its
child's ``..``, and must be the very inode it left), and never follows a symlink.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable
    from concurrent.futures import Executor

__all__ = ["OPEN_DIRS", "remove_tree"]

_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Open directories at once, at most, besides the top: a 100,000-deep tree takes no 100,000 fds.
OPEN_DIRS = 64
# A directory with this many files or more has them unlinked by the given threads: freeing
# blocks can be slow (shadowfs.trash), and unlinks overlap in the file system, not in Python.
_THREADED_FROM = 64


def remove_tree(
    path: str | bytes | os.PathLike[str] | os.PathLike[bytes],
    *,
    dir_fd: int | None = None,
    keep_top: bool = False,
    threads: Executor | None = None,
) -> None:
    """Removes ``path`` (relative to ``dir_fd`` when given) and everything in it; with
    ``keep_top`` only what it holds. Nothing is followed: a symlink is removed as a name (``path``
    itself included), and every step is relative to a directory fd opened with O_NOFOLLOW. A
    directory on another file system (a mount point inside) is not entered. A directory its
    owner cannot read, enter or write (mode 0: an overlay's work dir, or one the agent made) is
    given its owner's bits back first. What is gone meanwhile is no error; whatever else cannot
    be removed is left, all the rest removed, and the first such OSError raised at the end."""
    try:
        top = _open_dir(path, dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP) or keep_top:
            raise
        error = _unlink(dir_fd, path)  # a file or a symlink: removed as such
        if error is not None:
            raise error from None
        return
    errors: list[OSError] = []
    try:
        _clear(top, errors, threads)
    finally:
        os.close(top)
    if not keep_top:
        try:
            os.rmdir(path, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _open_dir(
    name: str | bytes | os.PathLike[str] | os.PathLike[bytes], dir_fd: int | None
) -> int:
    try:
        fd = os.open(name, _DIR_OPEN, dir_fd=dir_fd)
    except PermissionError:
        # Its owner's bits back, through an O_PATH fd of exactly the directory checked: its
        # /proc link reaches that inode and no other.
        at = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(at)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, "not a directory", name) from None
            os.chmod(f"/proc/self/fd/{at}", stat.S_IMODE(st.st_mode) | 0o700)
            fd = os.open(".", _DIR_OPEN, dir_fd=at)
        finally:
            os.close(at)
    try:
        mode = os.fstat(fd).st_mode
        if mode & 0o700 != 0o700 and os.geteuid() != 0:  # readable, not writable: 0500
            os.fchmod(fd, stat.S_IMODE(mode) | 0o700)
    except OSError:
        os.close(fd)
        raise
    return fd


def _unlink(
    dir_fd: int | None, name: str | bytes | os.PathLike[str] | os.PathLike[bytes]
) -> OSError | None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return exc
    return None


class _Level:
    """One directory of the walk: its fd (-1 once closed, above the window), its name in its
    parent, its inode, and the names of its directories still to do."""

    __slots__ = ("dirs", "fd", "ino", "name")

    def __init__(self, fd: int, name: str, ino: int) -> None:
        self.fd, self.name, self.ino = fd, name, ino
        self.dirs: list[str] = []


def _clear(top: int, errors: list[OSError], threads: Executor | None) -> None:
    """Empties the directory open as ``top`` (the caller closes it)."""
    st = os.fstat(top)
    dev = st.st_dev
    levels = [_Level(top, "", st.st_ino)]
    levels[0].dirs = _files_out(top, errors, threads)
    try:
        while True:
            level = levels[-1]
            if level.dirs:
                name = level.dirs.pop()
                try:
                    sub = _open_dir(name, level.fd)
                except OSError as exc:
                    if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or symlink now
                        error = _unlink(level.fd, name)
                        if error is not None:
                            errors.append(error)
                    elif exc.errno != errno.ENOENT:
                        errors.append(exc)
                    continue
                levels.append(_Level(sub, name, -1))
                sub_st = os.fstat(sub)
                if sub_st.st_dev != dev:  # another file system mounted there: left alone
                    levels.pop()
                    os.close(sub)
                    errors.append(OSError(errno.EXDEV, "another file system inside", name))
                    continue
                levels[-1].ino = sub_st.st_ino
                if len(levels) > OPEN_DIRS + 1:
                    above = levels[-OPEN_DIRS - 1]
                    if above.fd >= 0:
                        os.close(above.fd)
                        above.fd = -1
                levels[-1].dirs = _files_out(sub, errors, threads)
                continue
            if len(levels) == 1:
                return
            levels.pop()  # emptied: closed here, then removed from its parent
            parent = levels[-1]
            try:
                if parent.fd < 0:
                    up = os.open("..", _DIR_OPEN, dir_fd=level.fd)
                    parent.fd = up
                    up_st = os.fstat(up)
                    if (up_st.st_dev, up_st.st_ino) != (dev, parent.ino):
                        raise OSError(errno.ESTALE, "moved while it was removed", level.name)
            finally:
                os.close(level.fd)
            try:
                os.rmdir(level.name, dir_fd=parent.fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                errors.append(exc)
    except OSError as exc:  # the walk itself cannot go on: what is left stays
        errors.append(exc)
    finally:
        for level in levels[1:]:
            if level.fd >= 0:
                os.close(level.fd)


def _files_out(fd: int, errors: list[OSError], threads: Executor | None) -> list[str]:
    """Unlinks every non-directory in the directory open as ``fd``; returns its directories."""
    files: list[str] = []
    dirs: list[str] = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                (dirs if entry.is_dir(follow_symlinks=False) else files).append(entry.name)
    except OSError as exc:
        errors.append(exc)
    found: Iterable[OSError | None]
    if threads is not None and len(files) >= _THREADED_FROM:
        found = threads.map(lambda name: _unlink(fd, name), files)
    else:
        found = (_unlink(fd, name) for name in files)
    errors.extend(error for error in found if error is not None)
    return dirs
