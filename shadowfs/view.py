"""A read-only FUSE mount of any tree in a store (``jukebox mount TAPE@N DIR``).

The tree is immutable, so the kernel may cache entries and attributes for as long as it likes
and nothing ever needs invalidating. Inode numbers are handed out lazily, one per path, and kept
for the life of the mount. Small files come from one ``get`` (kept in an LRU cache); a large
(``chunks``) file is read chunk by chunk at the requested offset, never whole.

pyfuse3 keeps one session per process, so ``mounted_view`` serves from a child process:
``python -m shadowfs.view [--foreground] STORE TREE_ID MOUNTPOINT``. Without ``--foreground`` the
command returns once the mount is ready and leaves a daemon serving it; ``fusermount3 -u
MOUNTPOINT`` (or ``umount`` as root) stops it.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio

from shadowfs import mountinfo
from shadowfs.errors import ShadowfsError
from shadowfs.oid import ObjectId
from shadowfs.tree import DIR, FILE, SPECIAL_FMT, SYMLINK, Entry, read_tree

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

# The tree never changes under the mount: let the kernel keep what it learned for a day.
_TIMEOUT = 86400.0
_BLOB_CACHE_BYTES = 64 << 20
_READY_TIMEOUT_S = 20.0
# What /proc/self/mountinfo shows of a view: `jukebox umount` unmounts nothing else.
VIEW_FSNAME = "shadowfs-view"
VIEW_FSTYPE = "fuse.shadowfs"


class ViewError(ShadowfsError):
    pass


class _Node:
    """What the mount knows of one path: its tree entry and, for a directory, its children."""

    __slots__ = ("children", "entry", "ino", "kind_of_oid", "names", "spans")

    def __init__(self, ino: int, entry: Entry) -> None:
        self.ino = ino
        self.entry = entry
        self.children: dict[bytes, Entry] | None = None
        self.names: list[bytes] | None = None
        self.kind_of_oid: str | None = None
        self.spans: tuple[list[int], list[ObjectId]] | None = None


class _BlobCache:
    """Object bytes by id, bounded by total size; ids are content hashes, so never stale."""

    def __init__(self, store: ObjectReader, limit: int = _BLOB_CACHE_BYTES) -> None:
        self.store = store
        self.limit = limit
        self.used = 0
        self.items: OrderedDict[ObjectId, bytes] = OrderedDict()

    def get(self, oid: ObjectId) -> bytes:
        data = self.items.get(oid)
        if data is not None:
            self.items.move_to_end(oid)
            return data
        data = self.store.get(oid)
        if len(data) <= self.limit // 4:
            self.items[oid] = data
            self.used += len(data)
            while self.used > self.limit:
                _, old = self.items.popitem(last=False)
                self.used -= len(old)
        return data


class TreeView(pyfuse3.Operations):
    """pyfuse3 operations serving one tree read-only."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self, store: ObjectReader, tree_id: ObjectId, root_mtime_ns: int | None = None
    ) -> None:
        super().__init__()
        self.store = store
        self.blobs = _BlobCache(store)
        now = time.time_ns() if root_mtime_ns is None else root_mtime_ns
        root = Entry(b"", DIR, 0o755, 0, now, tree_id, None)
        self.nodes: dict[int, _Node] = {pyfuse3.ROOT_INODE: _Node(pyfuse3.ROOT_INODE, root)}
        self.by_path: dict[tuple[int, bytes], int] = {}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.uid = os.getuid()
        self.gid = os.getgid()

    # --- nodes --------------------------------------------------------------------------------

    def _node(self, ino: int) -> _Node:
        node = self.nodes.get(ino)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _children(self, node: _Node) -> dict[bytes, Entry]:
        if node.children is None:
            if node.entry.kind != DIR:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            # a file or directory entry has an oid (only a symlink's is None)
            entries = read_tree(self.store, node.entry.oid)  # type: ignore[arg-type]
            node.children = {e.name: e for e in entries}
            node.names = [e.name for e in entries]
        return node.children

    def _child(self, parent: _Node, entry: Entry) -> _Node:
        key = (parent.ino, entry.name)
        ino = self.by_path.get(key)
        if ino is None:
            ino = self.next_ino
            self.next_ino += 1
            self.by_path[key] = ino
            self.nodes[ino] = _Node(ino, entry)
        return self.nodes[ino]

    def _attr(self, node: _Node) -> pyfuse3.EntryAttributes:
        e = node.entry
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = _TIMEOUT
        a.attr_timeout = _TIMEOUT
        if e.kind == DIR:
            a.st_mode = stat.S_IFDIR | e.mode
            # 1 means "not counted" (as on btrfs): counting sub-directories would decode every
            # child tree during readdirplus, and find(1) then skips its leaf optimisation.
            a.st_nlink = 1
        elif e.kind == SYMLINK:
            a.st_mode = stat.S_IFLNK | e.mode
            a.st_nlink = 1
        else:
            a.st_mode = SPECIAL_FMT.get(e.kind, stat.S_IFREG) | e.mode
            a.st_nlink = 1
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_rdev = e.rdev
        a.st_size = e.size
        a.st_blksize = 1 << 17
        a.st_blocks = (e.size + 511) // 512
        a.st_atime_ns = e.mtime_ns
        a.st_mtime_ns = e.mtime_ns
        a.st_ctime_ns = e.mtime_ns
        return a

    # --- reading ------------------------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        parent = self._node(parent_inode)
        entry = self._children(parent).get(name)
        if entry is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(self._child(parent, entry))

    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        return self._attr(self._node(inode))

    async def readlink(self, inode: int, ctx: Any) -> bytes:
        e = self._node(inode).entry
        if e.kind != SYMLINK:
            raise pyfuse3.FUSEError(errno.EINVAL)
        # a symlink always has a target (Entry.target is None for the other kinds)
        return e.target  # type: ignore[return-value]

    async def opendir(self, inode: int, ctx: Any) -> int:
        self._children(self._node(inode))
        return inode

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        node = self._node(fh)
        children = self._children(node)
        names = node.names or []
        for i in range(start_id, len(names)):
            child = self._child(node, children[names[i]])
            if not pyfuse3.readdir_reply(token, names[i], self._attr(child), i + 1):
                return

    async def releasedir(self, fh: int) -> None:
        return None

    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        node = self._node(inode)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise pyfuse3.FUSEError(errno.EROFS)
        if node.entry.kind != FILE:
            raise pyfuse3.FUSEError(errno.EISDIR if node.entry.kind == DIR else errno.ELOOP)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        node = self._node(fh)
        e = node.entry
        if off >= e.size or size <= 0:
            return b""
        oid = e.oid
        if oid is None:  # only a symlink's is None, and `open` let only files through
            raise pyfuse3.FUSEError(errno.EIO)
        if node.kind_of_oid is None:
            node.kind_of_oid = self.store.kind(oid)
        if node.kind_of_oid != "chunks":
            return self.blobs.get(oid)[off : off + size]
        if node.spans is None:
            node.spans = _chunk_spans(self.store.get(oid))
        starts, oids = node.spans
        end = min(off + size, e.size)
        i = bisect.bisect_right(starts, off) - 1
        parts = []
        pos = off
        while pos < end and i < len(oids):
            data = self.blobs.get(oids[i])
            lo = pos - starts[i]
            piece = data[lo : lo + (end - pos)]
            if not piece:
                break
            parts.append(piece)
            pos += len(piece)
            i += 1
        return b"".join(parts)

    async def release(self, fh: int) -> None:
        return None

    async def forget(self, inode_list: Any) -> None:
        # Inodes are per path and the tree never changes: keeping them costs a little memory and
        # keeps inode numbers stable for the whole mount.
        return None

    async def statfs(self, ctx: Any) -> Any:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 0
        s.f_files = len(self.nodes)
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return []

    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return not mode & os.W_OK

    # --- every write is refused ---------------------------------------------------------------

    async def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _refuse
    write = create = setxattr = removexattr = _refuse

    async def fsync(self, fh: int, datasync: bool) -> None:
        return None  # nothing is ever dirty; refusing would break tools that fsync what they read

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None


def _chunk_spans(data: bytes) -> tuple[list[int], list[ObjectId]]:
    """Start offsets and ids of a `chunks` object's pieces."""
    from shadowfs.store import decode_chunks

    starts: list[int] = []
    oids: list[ObjectId] = []
    pos = 0
    for oid, size in decode_chunks(data):
        starts.append(pos)
        oids.append(oid)
        pos += size
    return starts, oids


def _mounted(mountpoint: str) -> bool:
    return bool(mountinfo.mounts_at(mountpoint))


def is_view(mountpoint: str | os.PathLike[str]) -> bool:
    """Whether the visible mount at ``mountpoint`` is a view (not a booth's layer, nor any
    other file system that happens to be mounted there)."""
    found = mountinfo.mounts_at(os.path.realpath(mountpoint))
    return bool(found) and (found[-1].fstype, found[-1].source) == (VIEW_FSTYPE, VIEW_FSNAME)


def serve_tree(
    store: ObjectReader,
    tree_id: ObjectId,
    mountpoint: str | os.PathLike[str],
    *,
    ready: Callable[[], None] | None = None,
) -> None:
    """Mount ``tree_id`` read-only at ``mountpoint`` and serve it until unmounted (or SIGTERM /
    SIGINT when called from the main thread). ``ready`` runs once the mount is in place."""
    mp = os.path.realpath(mountpoint)
    if not os.path.isdir(mp):
        raise ViewError(f"mount point {mp!r} is not a directory; create it first")
    read_tree(store, tree_id)  # a missing or malformed tree fails here, not on the first ls
    ops = TreeView(store, tree_id, root_mtime_ns=os.stat(mp).st_mtime_ns)
    options = set(pyfuse3.default_options) | {"ro", f"fsname={VIEW_FSNAME}", "subtype=shadowfs"}
    if os.getuid() == 0:
        options.add("allow_other")
    try:
        pyfuse3.init(ops, mp, options)
    except RuntimeError as exc:
        raise ViewError(f"cannot mount the view at {mp!r} ({exc}); check /dev/fuse and that the "
                        "directory is not already a mount point") from None
    try:
        if ready is not None:
            ready()
        trio.run(_main_loop)
    finally:
        pyfuse3.close(unmount=_mounted(mp))


async def _main_loop() -> None:
    if threading.current_thread() is not threading.main_thread():
        await pyfuse3.main()
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


def _store_path(store: Any) -> str:
    path = getattr(store, "path", None) or getattr(store, "root", None)
    if path is None:
        raise ViewError("the store has no path attribute; open it with Store.open(path)")
    fspath: str = os.fspath(path)
    return fspath


def unmount(mountpoint: str | os.PathLike[str]) -> None:
    """Unmount a view (as the daemon's owner or root)."""
    mp = os.path.realpath(mountpoint)
    cmd = ["umount", mp] if os.getuid() == 0 else ["fusermount3", "-u", mp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 and _mounted(mp):
        raise ViewError(f"cannot unmount {mp!r}: {proc.stderr.strip()}; close the files open "
                        "under it and retry")


@contextlib.contextmanager
def mounted_view(
    store: Any, tree_id: ObjectId, mountpoint: str | os.PathLike[str]
) -> Iterator[str]:
    """Serve ``tree_id`` at ``mountpoint`` from a child process for the ``with`` block; yields
    the mount point once mounted, unmounts on exit."""
    mp = os.path.realpath(mountpoint)
    flush = getattr(store, "flush", None)
    if flush is not None:
        flush()  # the child opens the store itself and must see every object
    child = subprocess.Popen(
        [sys.executable, "-m", "shadowfs.view", "--foreground", _store_path(store),
         tree_id.hex(), mp],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not _mounted(mp):
            if child.poll() is not None:
                err = child.stderr.read().decode(errors="replace").strip() if child.stderr else ""
                raise ViewError(f"the view of {tree_id.hex()[:12]} failed to mount at {mp!r}: "
                                f"{err.splitlines()[-1] if err else 'no message'}")
            if time.monotonic() > deadline:
                raise ViewError(f"the view did not mount at {mp!r} within "
                                f"{_READY_TIMEOUT_S:.0f} s; check /dev/fuse")
            time.sleep(0.005)
        yield mp
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if _mounted(mp):
            with contextlib.suppress(ViewError):
                unmount(mp)
        if child.stderr is not None:
            child.stderr.close()


# --- command line ---------------------------------------------------------------------------


def _open_store(path: str) -> Any:
    from shadowfs.store import Store

    return Store.open(path)


def main(argv: list[str]) -> int:
    foreground = "--foreground" in argv
    args = [a for a in argv if a != "--foreground"]
    if len(args) != 3:
        print("usage: python -m shadowfs.view [--foreground] STORE TREE_ID MOUNTPOINT",
              file=sys.stderr)
        return 2
    store_path, tree_hex, mountpoint = args
    try:
        tree_id = ObjectId.from_hex(tree_hex)
    except ValueError as exc:
        print(f"error: {exc}; pass a 64-digit hex tree id", file=sys.stderr)
        return 2
    if foreground:
        return _run(store_path, tree_id, mountpoint, None)
    # Daemon: the parent returns only once the child reports the mount ready (or failed).
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        with os.fdopen(rfd, "rb") as r:
            msg = r.read().decode(errors="replace")
        if msg.startswith("ok"):
            return 0
        print(msg.strip() or "error: the view daemon exited before mounting", file=sys.stderr)
        return 1
    os.close(rfd)
    os.setsid()
    return _run(store_path, tree_id, mountpoint, wfd)


def _run(store_path: str, tree_id: ObjectId, mountpoint: str, report_fd: int | None) -> int:
    def ready() -> None:
        nonlocal report_fd
        if report_fd is not None:
            os.write(report_fd, b"ok\n")
            os.close(report_fd)
            report_fd = None
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)

    try:
        with _open_store(store_path) as store:
            serve_tree(store, tree_id, mountpoint, ready=ready)
    except Exception as exc:  # reported to the waiting parent, then exit
        msg = f"error: {exc}\n"
        if report_fd is not None:
            with contextlib.suppress(OSError):
                os.write(report_fd, msg.encode())
        else:
            sys.stderr.write(msg)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
