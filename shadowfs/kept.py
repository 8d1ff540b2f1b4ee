"""A finished layer's staged files as a second source for a commit's staging.

A pending booth keeps its layer's staged files (``<ino>`` files in its scratch dir, made
private and moved to the tape dir's ``kept/<id>``) until its commit. Most of them hold exactly
what the commit is about to write into the real tree. Moving one there (a link at the staging
name, the kept name unlinked) costs no new inode, no data write and no read from the store;
writing it anew from the store costs all three, and was most of a 50,000-file commit
(docs/benchmarks.md).

The layer writes `MAP_NAME` beside its staged files when it closes keeping them: which tree
path each staged file was at (`write_map`). The commit (`shadowfs.commit.apply`'s ``kept``)
trusts neither the map nor the files: the agent wrote them, and whoever owns the tape dir may
have changed them since. A kept file is used only when, through one fd opened with
O_NOFOLLOW|O_NONBLOCK and held under a read lease (which the kernel grants only while nobody
has the file open for writing, a shared writable mapping included, and which makes any later
open for writing wait until the fd is closed), it is a regular file with a single link, owned
as a file the commit creates would be, on the tree's file system, with no extended attributes,
exactly the size its tree entry says and content whose object id is the entry's (so on a
system that labels every file, SELinux, no kept file is used). That fd is
then linked at the staging name and the kept name unlinked; the file must then have exactly
one link (a name swapped in the kept dir meanwhile was not this file's), and its mode and times
are set through the fd. Anything else, and any error, leaves the staging name free and stages
that path from the store, as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterable, Mapping

from shadowfs.oid import ObjectId, hash_object

__all__ = ["MAP_NAME", "KeptFiles", "open_kept", "write_map"]

MAP_NAME = "paths.json"
_MAP_VERSION = 1
# The map of 50,000 files is about 2.5 MB; a bigger one is not read.
_MAP_MAX = 64 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Kept files up to this size are checked and moved; bigger ones stage from the store.
MAX_SIZE = 1 << 20


def write_map(dir_fd: int, files: Iterable[tuple[bytes, int]]) -> None:
    """Writes the map of ``files`` ((tree path, staged file's inode number) pairs) into the
    scratch dir open as ``dir_fd``. Not synced: a lost map only costs the commit its speed."""
    body = json.dumps(
        {"v": _MAP_VERSION, "files": [[os.fsdecode(p), ino] for p, ino in files]},
        separators=(",", ":"),
    ).encode()
    fd = os.open(MAP_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)  # fmt: skip
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


class KeptFiles:
    """A kept scratch dir, open, and its map: tree path -> name of the staged file there."""

    __slots__ = ("dev", "fd", "names", "off")

    def __init__(self, fd: int, names: Mapping[bytes, bytes]) -> None:
        self.fd = fd
        self.names = names
        self.dev = os.fstat(fd).st_dev
        # Set once a move fails in a way that every other one would (another file system).
        self.off = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> KeptFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_kept(path: str | os.PathLike[str]) -> KeptFiles | None:
    """The kept scratch dir at ``path`` with its map, or None when either is missing or
    unreadable (an overlay booth's, an older version's: the commit stages from the store)."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return None
    try:
        names = _read_map(fd)
    except (OSError, ValueError, TypeError, KeyError):
        names = None
    if not names:
        os.close(fd)
        return None
    return KeptFiles(fd, names)


def _read_map(dir_fd: int) -> dict[bytes, bytes] | None:
    fd = os.open(MAP_NAME, _READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAP_MAX:
            return None
        data = os.read(fd, st.st_size + 1)
    finally:
        os.close(fd)
    doc = json.loads(data)
    if doc.get("v") != _MAP_VERSION:
        return None
    names: dict[bytes, bytes] = {}
    for path, ino in doc["files"]:
        if isinstance(path, str) and type(ino) is int and ino > 0:
            names[os.fsencode(path)] = b"%d" % ino  # only ever a name inside the kept dir
    return names


def stage_from_kept(
    kept: KeptFiles,
    name: bytes,
    dfd: int,
    staged_name: bytes,
    size: int,
    oid: ObjectId,
    mode: int,
    mtime_ns: int,
    owner: tuple[int, int],
) -> bool:
    """Moves kept file ``name`` to ``staged_name`` in the directory ``dfd`` with ``mode`` and
    ``mtime_ns``, if it passes every check in the module's doc; ``owner``: the (uid, gid) a
    file created in ``dfd`` now would get. False when it was not used: the staging name is
    then free, and the kept file as it was (but for its name, when it had another one).

    The move is a link of the checked fd (through /proc: exactly that inode, whatever the
    name holds by then) and an unlink of the kept name, not a rename: a rename into another
    directory takes the file system's rename lock, which queued the threads one behind the
    other (46 µs a file, threads or not). The file must be down to one link again after."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=kept.fd)
    except OSError:
        return False
    try:
        try:
            # Granted only while nobody has the file open for writing (EAGAIN otherwise).
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_nlink != 1
                or st.st_size != size
                or (st.st_uid, st.st_gid) != owner
                or _xattrs(fd)
            ):
                return False
            data = os.read(fd, size + 1)
        except OSError:
            return False
        if len(data) != size or hash_object("blob", data) != oid:
            return False
        try:
            os.link(f"/proc/self/fd/{fd}", staged_name, dst_dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                kept.off = True
            return False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=kept.fd)
            if os.fstat(fd).st_nlink == 1:  # the kept name was this file's, and is gone
                os.fchmod(fd, mode)
                os.utime(fd, ns=(mtime_ns, mtime_ns))
                return True
        except OSError:
            pass
        os.unlink(staged_name, dir_fd=dfd)  # our own link of the checked file
        return False
    finally:
        os.close(fd)  # which ends the lease


def create_owner(dfd: int, dev: int) -> tuple[int, int] | None:
    """The (uid, gid) a file this process creates in directory ``dfd`` gets; None when the
    directory is not on file system ``dev``, or gives the files made in it a default ACL
    (which a file linked there would not get)."""
    st = os.fstat(dfd)
    if st.st_dev != dev:
        return None
    try:
        if "system.posix_acl_default" in _xattrs(dfd):
            return None
    except OSError:
        return None
    gid = st.st_gid if st.st_mode & stat.S_ISGID else os.getegid()
    return os.geteuid(), gid


def _xattrs(fd: int) -> list[str]:
    """The names of the extended attributes of ``fd``; none where the file system has none."""
    try:
        return os.listxattr(fd)
    except OSError as exc:
        if exc.errno == errno.EOPNOTSUPP:
            return []
        raise
