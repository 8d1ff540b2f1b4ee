"""Removing a tree an agent made, however deep: fd by fd, without recursion, following nothing.

An agent chooses the depth of what it leaves in a booth's scratch (an overlay's upper dir) and in
a commit's trash: `mkdir d; cd d` in a loop makes a tree thousands of levels deep. Python 3.11's
`shutil.rmtree` and `os.walk` recurse, one frame per level, and raised RecursionError past about
a thousand: the trash's freeing process died at each of its restarts, and a booth's discard left
its scratch behind. `remove_tree` walks with `shadowfs.fdwalk.FdWalk` instead: an explicit stack
holding at most `fdwalk.OPEN_DIRS` directories open however deep the tree (above them a
directory is opened again through its child's ``..``, and must be the very inode it left), and
never following a symlink.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from shadowfs.fdwalk import DIR_OPEN, FdWalk

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator
    from concurrent.futures import Executor

__all__ = ["remove_quietly", "remove_tree"]

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
        top, top_st = _open_dir(path, dir_fd)
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
        _Removal(top_st.st_dev, errors, threads).walk(top)
    except OSError as exc:  # the walk itself cannot go on: what is left stays
        errors.append(exc)
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


def remove_quietly(path: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> None:
    """`remove_tree` for leftovers that a later opening of the tape dir retires should they stay
    (a booth's scratch, a commit's trash, a kept scratch): removes what it can, raises nothing.
    An empty directory costs one rmdir, the common case of a booth that staged nothing."""
    try:
        os.rmdir(path)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    with contextlib.suppress(OSError):
        remove_tree(path)


def _open_dir(
    name: str | bytes | os.PathLike[str] | os.PathLike[bytes], dir_fd: int | None
) -> tuple[int, os.stat_result]:
    """The directory ``name`` opened (never through a symlink) and its status, its owner's
    bits given back first where they are missing."""
    try:
        fd = os.open(name, DIR_OPEN, dir_fd=dir_fd)
    except PermissionError:
        # Its owner's bits back, through an O_PATH fd of exactly the directory checked: its
        # /proc link reaches that inode and no other.
        at = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(at)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, "not a directory", name) from None
            os.chmod(f"/proc/self/fd/{at}", stat.S_IMODE(st.st_mode) | 0o700)
            fd = os.open(".", DIR_OPEN, dir_fd=at)
        finally:
            os.close(at)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o700 != 0o700 and os.geteuid() != 0:  # readable, not writable: 0500
            os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)
    except OSError:
        os.close(fd)
        raise
    return fd, st


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


class _Removal(FdWalk):
    """Unlinks each non-directory, enters each directory (given its owner's bits back first,
    never one on another file system) and removes it once emptied; what cannot be removed is
    noted in ``errors`` and left, the rest removed."""

    def __init__(self, dev: int, errors: list[OSError], threads: Executor | None) -> None:
        super().__init__()
        self.dev, self.errors, self.threads = dev, errors, threads

    def enter(self, name: str, parent_fd: int) -> int | None:
        try:
            sub, st = _open_dir(name, parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or symlink now
                error = _unlink(parent_fd, name)
                if error is not None:
                    self.errors.append(error)
            elif exc.errno != errno.ENOENT:
                self.errors.append(exc)
            return None
        if st.st_dev != self.dev:  # another file system mounted there: left alone
            os.close(sub)
            self.errors.append(OSError(errno.EXDEV, "another file system inside", name))
            return None
        return sub

    def files(self, dir_fd: int, entries: Iterator[os.DirEntry[str]]) -> None:
        found: Iterable[OSError | None]
        names = [entry.name for entry in entries]  # listed whole first: unlinks then overlap
        if self.threads is not None and len(names) >= _THREADED_FROM:
            found = self.threads.map(lambda name: _unlink(dir_fd, name), names)
        else:
            found = (_unlink(dir_fd, name) for name in names)
        self.errors.extend(error for error in found if error is not None)

    def leave(self, name: str, parent_fd: int) -> None:
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.errors.append(exc)

    def unlisted(self, error: OSError, dir_fd: int) -> None:
        self.errors.append(error)  # what was listed is removed all the same
