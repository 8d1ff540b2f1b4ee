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

from shadowfs.fdwalk import DIR_OPEN, FdWalk

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


def make_private_tree(
    path: str | os.PathLike[str],
    *,
    dir_fd: int | None = None,
    owner: tuple[int, int] | None = None,
) -> None:
    """Makes the whole tree ``path`` private for good, however deep: directories 0700, every
    other file with at most its owner's read and write bits (no execute, no set-id), owned by
    ``owner`` (uid, gid) when given. For garbage that must stay on disk a while (a finished
    booth's kept scratch: files an agent chose the modes and owners of), so where keeping a
    name would not be safe it is removed instead: a non-directory with more than one link
    (its other names may lie outside ``path``) is never changed, only unlinked here.

    Nothing is followed: every step is relative to a directory fd opened with O_NOFOLLOW, a
    symlink is left as it is, and a change is made through an O_PATH fd of exactly the inode
    that was checked. At most `shadowfs.fdwalk.OPEN_DIRS` directories are open at once, so
    no depth runs it out of file descriptors. Another file system mounted inside ``path``
    raises OSError(EXDEV), as does anything else that cannot be made private (a directory
    moved away while it was walked: ESTALE): the caller then removes the tree. Costs one
    fstatat per file that is private already (a FUSE layer's staged files)."""
    top = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(top)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "not a directory", os.fspath(path))
        _make_private_inode(top, st, owner)
        listing = os.open(".", DIR_OPEN, dir_fd=top)
    finally:
        os.close(top)
    try:
        _Private(st.st_dev, owner).walk(listing)
    finally:
        os.close(listing)


def _make_private_inode(fd: int, st: os.stat_result, owner: tuple[int, int] | None) -> None:
    """Through the O_PATH ``fd``: its /proc link reaches exactly this inode."""
    proc = f"/proc/self/fd/{fd}"
    if owner is not None and (st.st_uid, st.st_gid) != owner:
        os.chown(proc, *owner)  # which clears a file's set-id bits too
    # A directory gets its owner's bits back as well: an overlay's work dir, or one the agent
    # made mode 0, must stay walkable and removable.
    keep = PRIVATE_DIR if stat.S_ISDIR(st.st_mode) else stat.S_IMODE(st.st_mode) & PRIVATE_FILE
    if stat.S_IMODE(st.st_mode) != keep:
        os.chmod(proc, keep)


class _Private(FdWalk):
    """Makes each directory private before it is entered, and each non-directory in it (or
    unlinks it, see `make_private_tree`); raises at the first thing it cannot."""

    def __init__(self, dev: int, owner: tuple[int, int] | None) -> None:
        super().__init__()
        self.dev, self.owner = dev, owner

    def enter(self, name: str, parent_fd: int) -> int:
        # Checked and changed through an O_PATH fd, then opened through it: the directory
        # walked is the very inode made private, whatever is renamed in meanwhile.
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        try:
            sub = os.fstat(fd)
            if not stat.S_ISDIR(sub.st_mode) or sub.st_dev != self.dev:
                raise OSError(errno.EXDEV, "not a directory of this file system", name)
            _make_private_inode(fd, sub, self.owner)
            return os.open(".", DIR_OPEN, dir_fd=fd)
        finally:
            os.close(fd)

    def file(self, dir_fd: int, entry: os.DirEntry[str]) -> None:
        if entry.is_symlink():
            return
        st = entry.stat(follow_symlinks=False)
        if st.st_dev != self.dev:
            raise OSError(errno.EXDEV, "another file system inside the tree", entry.name)
        if st.st_nlink > 1:
            os.unlink(entry.name, dir_fd=dir_fd)
            return
        if (self.owner is None or (st.st_uid, st.st_gid) == self.owner) and not (
            stat.S_IMODE(st.st_mode) & ~PRIVATE_FILE
        ):
            return  # private already: the common case
        fd = os.open(entry.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            now = os.fstat(fd)
            if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev) or now.st_nlink > 1:
                raise OSError(errno.EAGAIN, "changed while made private", entry.name)
            _make_private_inode(fd, now, self.owner)
        finally:
            os.close(fd)
