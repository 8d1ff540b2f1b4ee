"""pyfuse3 + trio operations serving a `shadowfs.layer.Layer` (the shadow booth mount).

Every request is answered from the layer on the trio thread; handlers are plain synchronous layer
calls except for big I/O (reads, writes and copy-ups of at least `THREAD_IO` bytes), which run on
worker threads so one large file never stalls the other processes using the mount.

Handlers hold `Operations.lock` while they touch the layer and release it across every await,
so another thread holding it (`shadowfs.mountctl.Mount.call`: a booth's snapshot or restore)
sees the layer between requests, as code on the trio thread would, without hopping onto it.

Kernel caching. Entry and attribute timeouts are long (`TIMEOUT`): the layer is the only writer,
so the kernel's caches only go stale on a restore, and a restore sends explicit invalidations (see
`shadowfs.mountctl`). The writeback cache is on, so small writes are batched by the kernel; with
it the kernel handles O_APPEND itself and may read pages of a file opened write-only, which is
why handles never carry their own fds: every handle of a node shares one read-write backing fd
(pyfuse3's passthrough example breaks on ``echo x >> f`` for exactly this reason). Opens return
``keep_cache``: content only changes through the kernel, or through a restore that gives the
changed files new inode numbers.

``flush`` is not implemented: the first close gets ENOSYS and the kernel stops sending it, which
saves a round trip per close(2); with the writeback cache the kernel still writes a file's dirty
pages back on close before it would have sent the flush.

``fsync`` is a no-op on purpose: staged files are not a durability boundary (the inode table
lives in memory), snapshots are, through the store's flush. sqlite and git fsync a lot.

Mount options: ``default_permissions`` (the kernel checks modes against the layer's
attributes), ``fsname=shadowfs``, ``subtype=shadowfs``, and ``allow_other`` when running as
root, so an agent running as another user can use the mount.

pyfuse3 keeps one session per process: serve one mount per process (a thread, or a child).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pyfuse3
import trio

from shadowfs.layer import S_IFDIR, S_IFREG, SRC_SCRATCH, Layer, Node

log = logging.getLogger(__name__)

TIMEOUT = 300.0
THREAD_IO = 1024 * 1024
# What pyfuse3 puts in a new EntryAttributes.
_DEFAULT_TIMEOUT = pyfuse3.EntryAttributes().entry_timeout

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
T = TypeVar("T")


def _errors(fn: F) -> F:
    """Run a handler holding the layer lock; turn OSError into the FUSE reply the kernel
    expects (anything else is a bug, logged)."""

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> Any:
        lock = self.lock
        lock.acquire()
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("shadowfs: %s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            lock.release()

    return wrapper  # type: ignore[return-value]


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = True
    enable_acl = False

    def __init__(self, layer: Layer, *, timeout: float = TIMEOUT, thread_io: int = THREAD_IO):
        super().__init__()
        self.layer = layer
        # Whoever touches the layer holds this: a request handler (released across each of its
        # awaits), or another thread running a call through the mount (`Mount.call`), which
        # then needs no hop onto this loop. Reentrant, so a handler may make such a call.
        self.lock = threading.RLock()
        self.timeout = timeout
        self.thread_io = thread_io
        self._copying: dict[int, trio.Event] = {}
        self._dirs: dict[int, tuple[Node, list[tuple[bytes, Node]] | None]] = {}
        self._next_dir = 1
        # Handles opened for write and not yet released. Only they can leave dirty pages in the
        # kernel's writeback cache (see `dirty`).
        self._writers: set[int] = set()

    @property
    def dirty(self) -> bool:
        """Whether the kernel may hold written data the layer has not seen yet.

        False only when no handle is open for write. Pages are dirtied only through a file
        open for write (write(2), or a shared writable mapping, which keeps its file open); the
        kernel writes a file's dirty pages back on every close (before the FLUSH it would send)
        and again before it sends RELEASE, and its writeback needs an open writable file. So
        once every write handle is released, every byte written through it is in the layer.
        Read from any thread: a stale True only costs a needless syncfs."""
        return bool(self._writers)

    # ------------------------------------------------------------------ helpers

    def _attr(self, node: Node) -> pyfuse3.EntryAttributes:
        # Hot: runs for every lookup, getattr and readdirplus entry. A fresh EntryAttributes
        # already holds generation 0, rdev 0 and blksize 4096; only what differs is set.
        if node.stat_base:
            self.layer.attrs(node)
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        timeout = self.timeout
        if timeout != _DEFAULT_TIMEOUT:
            a.entry_timeout = timeout
            a.attr_timeout = timeout
        fmt = node.fmt
        a.st_mode = fmt | node.mode
        if fmt != S_IFDIR:
            a.st_nlink = len(node.links)
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_size = node.size
        a.st_blocks = (
            self.layer.blocks(node)
            if node.src == SRC_SCRATCH and fmt == S_IFREG
            else (node.size + 511) // 512
        )
        a.st_atime_ns = node.atime_ns
        a.st_mtime_ns = node.mtime_ns
        a.st_ctime_ns = node.ctime_ns
        return a

    def _looked_up(self, node: Node) -> pyfuse3.EntryAttributes:
        node.lookups += 1
        return self._attr(node)

    async def _unlocked(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` without the layer lock: a handler must never suspend holding it, or a
        thread waiting for it would block this loop (and a call would wait for the worker)."""
        lock = self.lock
        lock.release()
        try:
            return await aw
        finally:
            lock.acquire()

    async def _copy(self, node: Node, write: bool, keep: int | None = None) -> None:
        """Copy-up (or materialise from the store) once, on a worker thread when big."""
        while (ev := self._copying.get(node.ino)) is not None:
            await self._unlocked(ev.wait())
        layer = self.layer
        if not layer.needs_copy(node, write):
            return
        if node.size < self.thread_io or (keep is not None and keep < self.thread_io):
            layer.copy_up(node, write, keep)
            return
        ev = trio.Event()
        self._copying[node.ino] = ev
        try:
            job = layer.start_copy(node, write, keep)
            try:
                await self._unlocked(trio.to_thread.run_sync(job.run))
            except BaseException:
                layer.abort_copy(job)
                raise
            layer.finish_copy(job)
        finally:
            del self._copying[node.ino]
            ev.set()

    # ------------------------------------------------------------------ lookups and attributes

    @_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> Any:
        return self._looked_up(self.layer.lookup(parent_inode, name))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        forget = self.layer.forget
        with self.lock:
            for ino, n in inode_list:
                try:
                    forget(ino, n)
                except Exception:
                    log.exception("shadowfs: forget(%d) failed", ino)

    @_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Any:
        return self._attr(self.layer.node(inode))

    @_errors
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> Any:
        layer = self.layer
        node = layer.node(inode)
        size = attr.st_size if fields.update_size else None
        if size is not None and node.src != SRC_SCRATCH and node.size != size:
            await self._copy(node, True, size)
        node = layer.setattr(
            inode,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=size,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            pid=ctx.pid,
        )
        return self._attr(node)

    @_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return self.layer.readlink(inode)

    # ------------------------------------------------------------------ directories

    @_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = self.layer.node(inode)
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, "not a directory")
        fh = self._next_dir
        self._next_dir += 1
        self._dirs[fh] = (node, None)
        return fh

    @_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node, listing = self._dirs[fh]
        if listing is None or start_id == 0:
            # A listing is fixed at its first read so offsets stay meaningful while the
            # directory changes under a reader (rm -rf deletes as it lists).
            listing = self.layer.children(node.ino)
            self._dirs[fh] = (node, listing)
        alive = self.layer.alive
        for i in range(start_id, len(listing)):
            name, child = listing[i]
            if not alive(child):
                continue
            if not pyfuse3.readdir_reply(token, name, self._attr(child), i + 1):
                return
            child.lookups += 1

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None

    @_errors
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> Any:
        node = self.layer.mkdir_in(parent_inode, name, mode, ctx.uid, ctx.gid, ctx.pid)
        return self._looked_up(node)

    @_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.layer.rmdir(parent_inode, name, ctx.pid)

    @_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.layer.unlink(parent_inode, name, ctx.pid)

    @_errors
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> Any:
        node = self.layer.symlink(parent_inode, name, target, ctx.uid, ctx.gid, ctx.pid)
        return self._looked_up(node)

    @_errors
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> Any:
        node = self.layer.mknod(parent_inode, name, mode, ctx.uid, ctx.gid, ctx.pid)
        return self._looked_up(node)

    @_errors
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        self.layer.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx.pid)

    @_errors
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> Any:
        return self._looked_up(self.layer.link(inode, new_parent_inode, new_name, ctx.pid))

    # ------------------------------------------------------------------ files

    @_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> Any:
        layer = self.layer
        node = layer.node(inode)
        write = flags & os.O_ACCMODE != os.O_RDONLY or bool(flags & os.O_TRUNC)
        if node.is_dir:
            raise OSError(errno.EISDIR, "is a directory")
        if layer.needs_copy(node, write):
            await self._copy(node, write, 0 if flags & os.O_TRUNC else None)
        h = layer.open_copied(node, flags, ctx.pid)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            self._writers.add(h.fh)
        return pyfuse3.FileInfo(fh=h.fh, keep_cache=True)

    @_errors
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> Any:
        h, node = self.layer.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid, ctx.pid)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            self._writers.add(h.fh)
        return pyfuse3.FileInfo(fh=h.fh, keep_cache=True), self._looked_up(node)

    @_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        layer = self.layer
        h = layer.handle(fh)
        node = h.node
        if node.src != SRC_SCRATCH and layer.needs_copy(node, False):
            await self._copy(node, False)
        if size < self.thread_io:
            return layer.read(h, off, size)
        b = layer.pin(h, False)
        try:
            return await self._unlocked(trio.to_thread.run_sync(os.pread, b.fd, size, off))
        finally:
            b.release()

    @_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        layer = self.layer
        h = layer.handle(fh)
        node = h.node
        if node.src != SRC_SCRATCH:
            await self._copy(node, True)
        if len(buf) < self.thread_io:
            return layer.write(h, off, buf)
        b = layer.pin(h, True)
        try:
            n = await self._unlocked(trio.to_thread.run_sync(os.pwrite, b.fd, buf, off))
        finally:
            b.release()
        layer.wrote(h, off, n)
        return n

    async def fsync(self, fh: int, datasync: bool) -> None:
        return None

    async def release(self, fh: int) -> None:
        with self.lock:
            self._writers.discard(fh)
            try:
                self.layer.release(fh)
            except Exception:
                log.exception("shadowfs: release(%d) failed", fh)

    # ------------------------------------------------------------------ xattrs and statfs

    @_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return self.layer.getxattr(inode, name)

    @_errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Any:
        return self.layer.listxattr(inode)

    @_errors
    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        self.layer.setxattr(inode, name, value, pid=ctx.pid)

    @_errors
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.layer.removexattr(inode, name, pid=ctx.pid)

    @_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> Any:
        s = self.layer.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = s.f_bsize
        out.f_frsize = s.f_frsize
        out.f_blocks = s.f_blocks
        out.f_bfree = s.f_bfree
        out.f_bavail = s.f_bavail
        out.f_files = s.f_files
        out.f_ffree = s.f_ffree
        out.f_favail = s.f_favail
        out.f_namemax = 255
        return out


def mount_options(*, allow_other: bool | None = None, debug: bool = False) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=shadowfs", "subtype=shadowfs"}
    if allow_other if allow_other is not None else os.geteuid() == 0:
        opts.add("allow_other")
    if debug:
        opts.add("debug")
    return opts


def serve(
    layer: Layer,
    mountpoint: str | os.PathLike[str],
    *,
    ready: Callable[[trio.lowlevel.TrioToken], None] | None = None,
    options: set[str] | None = None,
    timeout: float = TIMEOUT,
    ops: Operations | None = None,
) -> None:
    """Mount ``layer`` at ``mountpoint`` and serve it until unmounted or terminated; blocking.

    Runs in any thread (one mount per process). ``ready(token)`` is called on the loop thread
    once requests are being served; ``token`` lets other threads reach the loop
    (``trio.from_thread.run_sync(fn, trio_token=token)``). ``ops``: the operations to serve
    with (made from ``layer`` and ``timeout`` when None). Unmounts (lazily) on return.
    """
    if ops is None:
        ops = Operations(layer, timeout=timeout)
    pyfuse3.init(ops, os.fspath(mountpoint), options if options is not None else mount_options())
    try:
        trio.run(_main, ready)
    finally:
        pyfuse3.close(unmount=True)


async def _main(ready: Callable[[trio.lowlevel.TrioToken], None] | None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_session)
        if ready is not None:
            ready(trio.lowlevel.current_trio_token())


async def _session() -> None:
    await pyfuse3.main()


def mount(layer: Layer, mountpoint: str | os.PathLike[str], **kwargs: Any) -> Any:
    """A `shadowfs.mountctl.Mount`: ``with mount(layer, path) as m: ...`` serves the layer at
    ``path`` from a background thread until the block ends."""
    from shadowfs.mountctl import Mount

    return Mount(layer, mountpoint, **kwargs)
