"""Walking a tree an agent made, however deep, by directory fds: bounded fds, nothing followed.

An agent chooses the shape of what it leaves (a booth's scratch, a `--rw` path): `mkdir d; cd d`
in a loop makes a tree thousands of levels deep, past Python's recursion limit, past PATH_MAX
(4,096 bytes) and past the process's limit of open files. `FdWalk` walks it with an explicit
stack, every step relative to an open directory fd, so:

* no path is ever built for a system call (a name is opened relative to its parent's fd);
* no symlink is ever followed: a directory is opened with O_NOFOLLOW (`DIR_OPEN`), and a
  symlink, to a directory or not, is handed over as a non-directory entry, never entered;
* at most `OPEN_DIRS` directories are held open besides the top, however deep the tree: above
  them a directory's fd is closed, and opened again through its child's ``..`` on the way up,
  where it must be the very inode (device and inode number) it was. An agent racing the walk
  that renames a directory elsewhere meanwhile stops the walk (ESTALE) instead of leading it
  out of the tree.

A subclass says what each step does through its hooks: `enter` (before a directory: open it, or
not), `files` / `file` (each non-directory, symlinks included), `leave` (after a directory's
contents, its fd closed) and `unlisted` (a directory that could not be listed whole). A hook
stops the walk by raising; `walk` closes every fd it opened whatever happens. Users:
`shadowfs.removal.remove_tree`, `shadowfs.privacy.make_private_tree`, and the set-id strip of a
booth's `--rw` paths.
"""

from __future__ import annotations

import errno
import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from collections.abc import Generator, Iterator

__all__ = ["DIR_OPEN", "OPEN_DIRS", "FdWalk"]

DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Open directories at once, at most, besides the top: a 100,000-deep tree takes no 100,000 fds,
# and a walk under a limit of 256 open files (with scandir's own dup besides) still finishes.
OPEN_DIRS = 64


class _Level:
    """One directory of the walk: its fd (-1 once closed, above the window), its name in its
    parent, its device and inode (what its fd opened again through ``..`` must be), and the
    names of its directories still to do."""

    __slots__ = ("dev", "dirs", "fd", "ino", "name")

    def __init__(self, fd: int, name: str, st: os.stat_result) -> None:
        self.fd, self.name, self.dev, self.ino = fd, name, st.st_dev, st.st_ino
        self.dirs: list[str] = []


class FdWalk:
    """Walks what a directory holds, depth first, parents before their children's contents
    (each directory's non-directories before its subdirectories). Override the hooks; each
    gets names relative to an open directory fd, valid only during the call."""

    def __init__(self) -> None:
        self._levels: list[_Level] = []

    # ------------------------------------------------------------------------------ the hooks

    def enter(self, name: str, parent_fd: int) -> int | None:
        """Before the directory ``name`` in ``parent_fd``: returns it opened as a directory
        (the walk owns the fd from then on), or None to leave it out. The default opens it
        with `DIR_OPEN`: a symlink swapped in since the listing fails (ELOOP/ENOTDIR), as
        does anything else, which stops the walk."""
        return os.open(name, DIR_OPEN, dir_fd=parent_fd)

    def files(self, dir_fd: int, entries: Iterator[os.DirEntry[str]]) -> None:
        """Every non-directory in ``dir_fd`` as it is listed, before its subdirectories are
        entered; the default calls `file` on each (an override may batch them, say over
        threads)."""
        for entry in entries:
            self.file(dir_fd, entry)

    def file(self, dir_fd: int, entry: os.DirEntry[str]) -> None:
        """One non-directory in ``dir_fd``: a file, a symlink (never followed), a device..."""

    def leave(self, name: str, parent_fd: int) -> None:
        """After the directory ``name`` was walked whole; its own fd is closed by then."""

    def unlisted(self, error: OSError, dir_fd: int) -> None:
        """Listing ``dir_fd`` failed part way: raise to stop the walk (the default); return
        to go on with what was listed before the error."""
        raise error

    # ------------------------------------------------------------------------------ the walk

    def names(self) -> list[str]:
        """The names from the top down to the directory being walked (during a hook)."""
        return [level.name for level in self._levels[1:]]

    def walk(self, top: int) -> None:
        """Walks what the directory open as ``top`` holds (``top`` itself gets no hook, and
        stays open: the caller's)."""
        levels = self._levels = [_Level(top, "", os.fstat(top))]
        try:
            levels[0].dirs = self._listed(top)
            while True:
                level = levels[-1]
                if level.dirs:
                    name = level.dirs.pop()
                    sub = self.enter(name, level.fd)
                    if sub is None:
                        continue
                    try:
                        sub_st = os.fstat(sub)  # taken here: what `..` must lead back to
                    except OSError:
                        os.close(sub)
                        raise
                    levels.append(_Level(sub, name, sub_st))
                    if len(levels) > OPEN_DIRS + 1:  # the top is never closed: index >= 1
                        above = levels[-OPEN_DIRS - 1]
                        if above.fd >= 0:
                            os.close(above.fd)
                            above.fd = -1
                    levels[-1].dirs = self._listed(sub)
                    continue
                if len(levels) == 1:
                    return
                levels.pop()  # walked whole: closed here, then left in its parent
                parent = levels[-1]
                try:
                    if parent.fd < 0:
                        up = os.open("..", DIR_OPEN, dir_fd=level.fd)
                        parent.fd = up  # closed below should it be another directory
                        up_st = os.fstat(up)
                        if (up_st.st_dev, up_st.st_ino) != (parent.dev, parent.ino):
                            raise OSError(errno.ESTALE, "moved while it was walked", level.name)
                finally:
                    os.close(level.fd)
                self.leave(level.name, parent.fd)
        finally:
            for level in levels[1:]:
                if level.fd >= 0:
                    os.close(level.fd)
            self._levels = []

    def _listed(self, fd: int) -> list[str]:
        """Hands the non-directories in ``fd`` to `files`; returns its directories' names."""
        dirs: list[str] = []
        entries = self._non_dirs(fd, dirs)
        try:
            self.files(fd, entries)
            for _entry in entries:  # what `files` left unread: its directories are still due
                pass
        finally:
            entries.close()
        return dirs

    def _non_dirs(self, fd: int, dirs: list[str]) -> Generator[os.DirEntry[str], None, None]:
        """The non-directories in ``fd`` as they are listed (a directory of a million files
        is never held whole), its directories' names into ``dirs``."""
        try:
            with os.scandir(fd) as listing:
                for entry in listing:
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:  # no d_type and no lstat: the file hook finds out
                        is_dir = False
                    if is_dir:
                        dirs.append(entry.name)
                    else:
                        yield entry
        except OSError as exc:
            self.unlisted(exc, fd)
