"""Serving a `shadowfs.layer.Layer` over FUSE (the shadow booth mount).

`Server` reads requests from a `shadowfs.fuse_wire.Channel` on a few worker threads and answers
each from the layer through `Operations`. Handlers are plain synchronous layer calls made holding
`Operations.lock`; big I/O (reads, writes and copy-ups of at least `THREAD_IO` bytes) releases it,
so one large file never stalls the other processes using the mount. Another thread holding the
lock (`shadowfs.mountctl.Mount.call`: a booth's snapshot or restore) sees the layer between
requests. A reply is written before the lock is released, so a restore never slips between a
handler reading the layer and the kernel caching what it read.

One reader at a time. The kernel hands each request to the worker that has waited longest in
read(2), so with every worker reading, each request went to another thread than the one that
answered the last, and that thread then waited for the interpreter lock the other still held:
two wake-ups per request, and on a machine whose cores are busy each wake-up can wait out
another task's slice (milliseconds, about one in a hundred). So the workers take turns: the
one holding the turn reads and serves request after request, and hands the turn on only before
it blocks (the layer lock held by another thread, big I/O and copy-ups without the lock, a
barrier waiting for earlier requests; `Operations.before_block`). The others wait for the turn,
so a slow request still never stalls the mount. The workers also ask for the shortest
scheduler slice (`shadowfs.sched`): woken by a request, one then runs at once instead of
waiting for whatever holds its core. docs/benchmarks.md ("FUSE under load") has the figures.

A raised priority, within a CPU budget. The workers are threads of the process that serves the
mount, so they share its scheduling group (its session, with autogroups) with whatever else
runs there, and at the same nice value the fair scheduler pays every microsecond a worker
serves back to those tasks: the process that sent the request then waits for their slices
before it runs again. fuse-overlayfs escapes that by daemonizing into a session of its own.
Where the process may (CAP_SYS_NICE: a supervisor running as root, at nice 0 or below), the
worker holding the turn runs `WORKER_BOOST` nice steps above the process, so the time it serves
is charged at a tenth of the rate; a worker handing the turn on before big I/O or a wait drops
back to the process's value, and what a worker starts begins at nice 0 (reset-on-fork,
`shadowfs.sched.may_boost`). The agent decides how many requests the workers serve, so the raised
priority has a budget, one for all the workers of a mount: once they have used
`BOOST_BUDGET` seconds of CPU raised within `BOOST_WINDOW`, they run at the process's value for
the rest of that window. An agent keeping the mount busy gets the workers at most half a core
at the raised priority, however it makes them hand the turn on; the rest it gets at the
priority everything else in the session has. Where the process may not raise a
thread's priority (an unprivileged supervisor), or runs at a positive nice value (an operator
asked it to yield), nothing changes.

Zero-message opens. OPEN, OPENDIR and CREATE are answered ENOSYS. The kernel then stops sending
them (and RELEASE, RELEASEDIR and FLUSH), keeps file pages cached across opens and caches
directory listings (``FOPEN_CACHE_DIR`` is its default without opendir). ``grep -r`` costs one
READ per file instead of OPEN, READ, RELEASE; a second walk of a tree or ``git status`` costs no
request at all. Reads and writes name the inode, not a handle, so the layer's node-addressed I/O
serves them (`Layer.read_node`, `Layer.write_node`). Copy-up happens at the first write or
truncation, which is the first moment a change is certain: an open for write that never writes
copies nothing.

Kernel caching. Entry and attribute timeouts are long (`TIMEOUT`): the layer is the only writer,
so the kernel's caches only go stale on a restore, and a restore sends explicit invalidations
(see `shadowfs.mountctl`; a changed directory's listing is dropped with its pages). Missing
names are cached too: a lookup of one is answered with node id 0 and the same timeout, so the
probes of git, Python's imports and pip cost one request per name, not one per probe. Names
the layer adds other than through the kernel (a restore, `Layer.write_file`, `Layer.mkdir`)
have their entries invalidated like changed ones. The
writeback cache is on, so small writes are batched by the kernel; with it the kernel handles
O_APPEND itself and may read pages of a file opened write-only. Data is invalidated only on
request (``EXPLICIT_INVAL_DATA``): content only changes through the kernel or through a restore,
which gives changed files new inode numbers.

A directory listing is fixed when read from offset 0 and offsets index into it, so they stay
meaningful while the directory changes under a reader (``rm -rf`` deletes as it lists); the
generation of the listing is in the offset's high bits, so two readers of one directory never
mix their listings.

``fsync`` is a no-op on purpose: staged files are not a durability boundary (the inode table
lives in memory), snapshots are, through the store's flush. sqlite and git fsync a lot. FSYNC,
FSYNCDIR and SYNCFS are answered ENOSYS, which the kernel takes as success and then stops
sending: an fsync still writes the file's dirty pages back to this server first, without a
round trip of its own (and a checkpoint's syncfs saves one too).

Mount options: ``default_permissions`` (the kernel checks modes against the layer's
attributes), ``allow_other`` when running as root (an agent running as another user can use the
mount), nosuid and nodev, file system name ``shadowfs``, type ``fuse.shadowfs``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator

from shadowfs import fuse_wire as w
from shadowfs import sched
from shadowfs.fuse_arrivals import Arrivals
from shadowfs.layer import S_IFDIR, S_IFREG, SRC_SCRATCH, Layer, Node
from shadowfs.lazylog import LazyLogger

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

log = LazyLogger(__name__)  # logging imported at the first message

TIMEOUT = 300.0
THREAD_IO = 1024 * 1024
WORKERS = 4
# The workers' scheduler slice: the shortest the kernel takes (shadowfs.sched).
WORKER_SLICE = 0.0001
# Nice steps the worker holding the turn runs above the process, where it may, and the CPU it
# may use so raised within a window (see the module docstring).
WORKER_BOOST = 10
BOOST_WINDOW = 0.1
BOOST_BUDGET = 0.05
# Requests served between two looks at the budget (a look is a system call).
BOOST_CHECK_EVERY = 8
MAX_BACKGROUND = 1024
FSNAME = "shadowfs"
# Listings kept for readers part-way through a directory (per mount, most recent).
LISTINGS_KEPT = 1024
_GEN_SHIFT = 32
_INDEX_MASK = (1 << _GEN_SHIFT) - 1
_NS = 1_000_000_000
_U64 = (1 << 64) - 1

Reply = bytes | list[bytes] | None


class Operations:
    """The request handlers: each takes the request's inode, its bytes and the caller's uid,
    gid and pid, and returns the reply body (None: no reply), or raises OSError."""

    def __init__(self, layer: Layer, *, timeout: float = TIMEOUT, thread_io: int = THREAD_IO):
        self.layer = layer
        # Whoever touches the layer holds this: a request handler (released across big I/O),
        # or another thread running a call through the mount (`Mount.call`). Reentrant, so a
        # handler may make such a call.
        self.lock = threading.RLock()
        self.timeout = timeout
        self.thread_io = thread_io
        secs = int(timeout)
        self._valid = (secs, int((timeout - secs) * _NS))
        # The answer to a lookup of a missing name: no node, kept by the kernel as long as an entry.
        self._missing = w.ENTRY_ATTR.pack(0, 0, secs, 0, self._valid[1], 0, *(0,) * 16)
        self._no_entry = w.ENTRY_ATTR.pack(*(0,) * 22)
        self._copying: dict[int, threading.Event] = {}
        # Called before a handler blocks (big I/O, another thread's copy-up): the server hands
        # the reading of /dev/fuse to another worker meanwhile.
        self.before_block: Callable[[], None] = _nothing
        # dir inode -> {generation: listing}; see the module docstring.
        self._listings: dict[int, dict[int, list[tuple[bytes, Node]]]] = {}
        self._next_gen = 1
        self.table: dict[int, Callable[[int, bytes, int, int, int], Reply]] = {
            w.LOOKUP: self.lookup,
            w.GETATTR: self.getattr,
            w.SETATTR: self.setattr,
            w.READLINK: self.readlink,
            w.SYMLINK: self.symlink,
            w.MKNOD: self.mknod,
            w.MKDIR: self.mkdir,
            w.UNLINK: self.unlink,
            w.RMDIR: self.rmdir,
            w.RENAME: self.rename,
            w.RENAME2: self.rename2,
            w.LINK: self.link,
            w.READ: self.read,
            w.WRITE: self.write,
            w.STATFS: self.statfs,
            w.RELEASE: self.nothing,
            w.RELEASEDIR: self.nothing,
            w.SETXATTR: self.setxattr,
            w.GETXATTR: self.getxattr,
            w.LISTXATTR: self.listxattr,
            w.REMOVEXATTR: self.removexattr,
            w.READDIR: self.readdir,
            w.READDIRPLUS: self.readdirplus,
        }

    # ------------------------------------------------------------------ helpers

    def _attr(self, node: Node, packer: struct.Struct = w.ATTR, *head: int) -> bytes:
        """The node's fuse_attr, packed after ``head`` by ``packer`` (the attribute alone, or
        behind an entry or attr_out header: one pack call either way)."""
        # Hot: runs for every lookup, getattr and readdirplus entry.
        if node.stat_base:
            self.layer.attrs(node)
        fmt = node.fmt
        size = node.size
        if fmt == S_IFREG and node.src == SRC_SCRATCH:
            blocks = self.layer.blocks(node)
        else:
            blocks = (size + 511) // 512
        a_s, a_ns = divmod(node.atime_ns, _NS)
        m_s, m_ns = divmod(node.mtime_ns, _NS)
        c_s, c_ns = divmod(node.ctime_ns, _NS)
        return packer.pack(
            *head,
            node.ino,
            size,
            blocks,
            a_s & _U64,
            m_s & _U64,
            c_s & _U64,
            a_ns,
            m_ns,
            c_ns,
            fmt | node.mode,
            self.layer.nlink(node) if fmt == S_IFDIR else len(node.links),
            node.uid,
            node.gid,
            node.rdev,
            4096,
            0,
        )

    def _entry(self, node: Node) -> bytes:
        node.lookups += 1
        s, ns = self._valid
        return self._attr(node, w.ENTRY_ATTR, node.ino, 0, s, s, ns, ns)

    def _attr_out(self, node: Node) -> bytes:
        s, ns = self._valid
        return self._attr(node, w.ATTR_OUT_ATTR, s, ns, 0)

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Let other threads have the layer for a while: never block on I/O or another
        thread holding the lock, or a thread waiting for it would wait for this one."""
        self.before_block()
        lock = self.lock
        lock.release()
        try:
            yield
        finally:
            lock.acquire()

    def _copy(self, node: Node, write: bool, keep: int | None = None) -> None:
        """Copy-up (or materialise from the store) once; big ones without the lock."""
        while (ev := self._copying.get(node.ino)) is not None:
            with self._unlocked():
                ev.wait()
        layer = self.layer
        if not layer.needs_copy(node, write):
            return
        if node.size < self.thread_io or (keep is not None and keep < self.thread_io):
            layer.copy_up(node, write, keep)
            return
        ev = threading.Event()
        self._copying[node.ino] = ev
        try:
            job = layer.start_copy(node, write, keep)
            try:
                with self._unlocked():
                    job.run()
            except BaseException:
                layer.abort_copy(job)
                raise
            layer.finish_copy(job)
        finally:
            del self._copying[node.ino]
            ev.set()

    def nothing(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        return b""

    # ------------------------------------------------------------------ lookups and attributes

    def lookup(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        name, _ = w.name_arg(req, w.IN_HEADER_SIZE)
        node = self.layer.lookup(ino, name, None)
        if node is None:
            return self._missing
        node.last_pid = pid
        return self._entry(node)

    def forget(self, items: list[tuple[int, int]]) -> None:
        forget = self.layer.forget
        for ino, n in items:
            try:
                forget(ino, n)
            except Exception:
                log.exception("shadowfs: forget(%d) failed", ino)

    def getattr(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        return self._attr_out(self.layer.node(ino))

    def setattr(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        (
            valid,
            _,
            _fh,
            size,
            _,
            atime,
            mtime,
            _,
            atimensec,
            mtimensec,
            _,
            mode,
            _,
            new_uid,
            new_gid,
            _,
        ) = w.SETATTR_IN.unpack_from(req, w.IN_HEADER_SIZE)
        layer = self.layer
        node = layer.node(ino)
        if pid:
            node.last_pid = pid
        new_size = size if valid & w.FATTR_SIZE else None
        if new_size is not None and node.src != SRC_SCRATCH and node.size != new_size:
            self._copy(node, True, new_size)
        now = time.time_ns() if valid & (w.FATTR_ATIME_NOW | w.FATTR_MTIME_NOW) else None
        atime_ns = mtime_ns = None
        if valid & w.FATTR_ATIME_NOW:
            atime_ns = now
        elif valid & w.FATTR_ATIME:
            atime_ns = _signed(atime) * _NS + atimensec
        if valid & w.FATTR_MTIME_NOW:
            mtime_ns = now
        elif valid & w.FATTR_MTIME:
            mtime_ns = _signed(mtime) * _NS + mtimensec
        new_mode = mode if valid & w.FATTR_MODE else None
        if valid & w.FATTR_KILL_SUIDGID:
            killed = _without_set_id(node.mode if new_mode is None else new_mode)
            if killed != node.mode:
                new_mode = killed
        node = layer.setattr(
            ino,
            mode=new_mode,
            uid=new_uid if valid & w.FATTR_UID else None,
            gid=new_gid if valid & w.FATTR_GID else None,
            size=new_size,
            atime_ns=atime_ns,
            mtime_ns=mtime_ns,
            pid=pid,
        )
        return self._attr_out(node)

    def readlink(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        return self.layer.readlink(ino)

    # ------------------------------------------------------------------ directories

    def _listing(self, ino: int, off: int) -> tuple[list[tuple[bytes, Node]], int, int]:
        """The listing a read at offset ``off`` continues, its generation and start index."""
        gens = self._listings.get(ino)
        if off:
            gen, index = off >> _GEN_SHIFT, off & _INDEX_MASK
            if gens is not None:
                listing = gens.get(gen)
                if listing is not None:
                    return listing, gen, index
        else:
            index = 0
        # From the start, or a listing already let go: list the directory now.
        node = self.layer.node(ino)
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, "not a directory")
        # `.` and `..` lead, as on every kernel file system; the root's parent lies outside the
        # mount, and the root stands for it (as the kernel's own roots do).
        parent = node.links[0][0] if node.links else node
        listing = [(b".", node), (b"..", parent), *self.layer.children(ino)]
        gen = self._next_gen
        self._next_gen += 1
        if gens is None:
            if len(self._listings) >= LISTINGS_KEPT:
                del self._listings[next(iter(self._listings))]
            gens = self._listings[ino] = {}
        elif len(gens) >= 4:
            del gens[next(iter(gens))]
        gens[gen] = listing
        return listing, gen, index

    def _done_listing(self, ino: int, gen: int) -> None:
        gens = self._listings.get(ino)
        if gens is not None:
            gens.pop(gen, None)
            if not gens:
                del self._listings[ino]

    def readdir(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        return self._list(ino, req, False)

    def readdirplus(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        return self._list(ino, req, True)

    def _list(self, ino: int, req: bytes, plus: bool) -> Reply:
        """Directory entries from the request's offset on, as many as fit; with ``plus``,
        each with its attributes (the kernel then counts a lookup of each)."""
        _, off, size, _ = w.READ_IN.unpack_from(req, w.IN_HEADER_SIZE)
        # Never to the last byte: kernel 6.18 refused (EINVAL) a READDIR reply exactly as long
        # as the size it asked for (32768), while replies a few bytes shorter went through.
        size -= 1
        listing, gen, index = self._listing(ino, off)
        alive = self.layer.alive
        parts: list[bytes] = []
        append = parts.append
        used = 0
        base = gen << _GEN_SHIFT
        s, ns = self._valid
        entry_attr = w.ENTRY_ATTR
        dirent = w.dirent
        attr = self._attr
        extra = entry_attr.size if plus else 0
        for i in range(index, len(listing)):
            name, child = listing[i]
            if not alive(child):
                continue
            child_ino = child.ino
            ent = dirent(child_ino, base | (i + 1), name, child.fmt >> 12)
            used += extra + len(ent)
            if used > size:
                return parts
            if plus:
                if i < 2:
                    # The kernel takes no entry for `.` and `..` (nor counts a lookup).
                    append(self._no_entry)
                else:
                    append(attr(child, entry_attr, child_ino, 0, s, s, ns, ns))
                    child.lookups += 1
            append(ent)
        self._done_listing(ino, gen)
        return parts

    def mkdir(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        mode, _ = w.MKDIR_IN.unpack_from(req, w.IN_HEADER_SIZE)
        name, _ = w.name_arg(req, w.IN_HEADER_SIZE + w.MKDIR_IN.size)
        return self._entry(self.layer.mkdir_in(ino, name, mode, uid, gid, pid))

    def rmdir(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        name, _ = w.name_arg(req, w.IN_HEADER_SIZE)
        self.layer.rmdir(ino, name, pid)
        return b""

    def unlink(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        name, _ = w.name_arg(req, w.IN_HEADER_SIZE)
        self.layer.unlink(ino, name, pid)
        return b""

    def symlink(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        name, at = w.name_arg(req, w.IN_HEADER_SIZE)
        target, _ = w.name_arg(req, at)
        return self._entry(self.layer.symlink(ino, name, target, uid, gid, pid))

    def mknod(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        mode, rdev, _, _ = w.MKNOD_IN.unpack_from(req, w.IN_HEADER_SIZE)
        name, _ = w.name_arg(req, w.IN_HEADER_SIZE + w.MKNOD_IN.size)
        # The kernel let a device through only for a caller with CAP_MKNOD; the mount is nodev,
        # so the node opens nothing here.
        node = self.layer.mknod(ino, name, mode, uid, gid, pid, rdev=rdev)
        node.last_pid = pid
        return self._entry(node)

    def rename(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        (newdir,) = w.U64.unpack_from(req, w.IN_HEADER_SIZE)
        return self._rename(ino, req, newdir, 0, w.IN_HEADER_SIZE + w.U64.size, pid)

    def rename2(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        newdir, flags, _ = w.RENAME2_IN.unpack_from(req, w.IN_HEADER_SIZE)
        return self._rename(ino, req, newdir, flags, w.IN_HEADER_SIZE + w.RENAME2_IN.size, pid)

    def _rename(self, ino: int, req: bytes, newdir: int, flags: int, at: int, pid: int) -> Reply:
        old, at = w.name_arg(req, at)
        new, _ = w.name_arg(req, at)
        self.layer.rename(ino, old, newdir, new, flags, pid)
        return b""

    def link(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        (old,) = w.U64.unpack_from(req, w.IN_HEADER_SIZE)
        name, _ = w.name_arg(req, w.IN_HEADER_SIZE + w.U64.size)
        return self._entry(self.layer.link(old, ino, name, pid))

    # ------------------------------------------------------------------ files

    def read(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        _, off, size, _ = w.READ_IN.unpack_from(req, w.IN_HEADER_SIZE)
        layer = self.layer
        node = layer.node(ino)
        if node.fmt != S_IFREG:
            raise OSError(errno.EISDIR if node.fmt == S_IFDIR else errno.EINVAL, "not a file")
        if pid:
            node.last_pid = pid
        if node.src != SRC_SCRATCH and layer.needs_copy(node, False):
            self._copy(node, False)
        if size < self.thread_io:
            return layer.read_node(node, off, size)
        b = layer.pin_node(node, False)
        try:
            with self._unlocked():
                return os.pread(b.fd, size, off)
        finally:
            b.release()

    def write(self, ino: int, req: Any, uid: int, gid: int, pid: int) -> Reply:
        _, off, size, flags = w.READ_IN.unpack_from(req, w.IN_HEADER_SIZE)
        data = req[w.IN_HEADER_SIZE + w.WRITE_IN_SIZE : w.IN_HEADER_SIZE + w.WRITE_IN_SIZE + size]
        layer = self.layer
        node = layer.node(ino)
        # Pages the kernel writes back on its own come with no process.
        pid = pid or node.last_pid
        if flags & w.WRITE_KILL_SUIDGID and (killed := _without_set_id(node.mode)) != node.mode:
            layer.setattr(ino, mode=killed, pid=pid)
        try:
            if node.src != SRC_SCRATCH:
                # The kernel writes back whole pages, so a small file's append or edit arrives
                # as one write from 0 over all of it: none of the old content needs copying.
                self._copy(node, True, 0 if off == 0 and size >= node.size else None)
            if size < self.thread_io:
                n = layer.write_node(node, off, data, pid, times=False)
            else:
                b = layer.pin_node(node, True)
                try:
                    layer.reserve(node, off + size)
                    with self._unlocked():
                        n = os.pwrite(b.fd, data, off)
                finally:
                    b.release()
                layer.wrote_node(node, off, n, pid, times=False)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT) and layer.on_write_refused is not None:
                layer.on_write_refused(error)
            raise
        return w.WRITE_OUT.pack(n, 0)

    # ------------------------------------------------------------------ xattrs and statfs

    def getxattr(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        size, _ = w.XATTR_IN.unpack_from(req, w.IN_HEADER_SIZE)
        name, _ = w.name_arg(req, w.IN_HEADER_SIZE + w.XATTR_IN.size)
        return _sized(self.layer.getxattr(ino, name), size)

    def listxattr(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        size, _ = w.XATTR_IN.unpack_from(req, w.IN_HEADER_SIZE)
        names = self.layer.listxattr(ino)
        return _sized(b"".join(n + b"\0" for n in names), size)

    def setxattr(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        size, flags = w.XATTR_IN.unpack_from(req, w.IN_HEADER_SIZE)
        name, at = w.name_arg(req, w.IN_HEADER_SIZE + w.XATTR_IN.size)
        self.layer.setxattr(ino, name, req[at : at + size], flags, pid=pid)
        return b""

    def removexattr(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        name, _ = w.name_arg(req, w.IN_HEADER_SIZE)
        self.layer.removexattr(ino, name, pid=pid)
        return b""

    def statfs(self, ino: int, req: bytes, uid: int, gid: int, pid: int) -> Reply:
        s = self.layer.statfs()
        return w.STATFS_OUT.pack(
            s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize, 255, s.f_frsize, 0
        )


def _nothing() -> None:
    pass


def _without_set_id(mode: int) -> int:
    """``mode`` as Linux leaves it after an unprivileged write or truncate, or a chown (the
    kernel says when, ``HANDLE_KILLPRIV_V2``): no set-user-ID, and no set-group-ID if the group
    may execute (without group execute it marks mandatory locking and stays)."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _sized(value: bytes, size: int) -> bytes:
    """A getxattr/listxattr reply: the length alone when asked with size 0, else the bytes."""
    if size == 0:
        return w.XATTR_OUT.pack(len(value), 0)
    if len(value) > size:
        raise OSError(errno.ERANGE, "buffer too small")
    return value


class Server:
    """Worker threads answering one channel's requests with ``ops`` until the connection ends."""

    def __init__(self, ops: Operations, channel: w.Channel, *, workers: int = WORKERS) -> None:
        # More than the kernel's default of 12 background requests: a sync's writeback is
        # queued in the background, and all of it must be handed out before the barrier that
        # follows it (see shadowfs.fuse_arrivals).
        self.ops = ops
        self.channel = channel
        self.workers = workers
        self.idents: set[int] = set()
        self.tids: set[int] = set()
        self._threads: list[threading.Thread] = []
        self.error: BaseException | None = None
        # What has been read and is being served, in the kernel's numbering.
        self._arrivals = Arrivals()
        # Workers not yet returned, and whether the last one out closes the channel.
        self._live = 0
        self._exit_lock = threading.Lock()
        self._close_on_exit = False
        # One worker at a time reads the channel (see the module docstring): it holds _turn,
        # and _leader names it; the others wait for the turn.
        self._turn = threading.Lock()
        self._leader = 0
        # Thread ident -> the raised priority of a worker that may raise it.
        self._boosts: dict[int, sched.Boost] = {}
        self._boost_budget = sched.BoostBudget(BOOST_BUDGET, BOOST_WINDOW)
        ops.before_block = self._yield_turn

    def answer_init(self) -> bool:
        """Answer the kernel's INIT on this thread, before the workers start; False, having
        read nothing, when no request is waiting (the workers then answer it).

        The kernel queues INIT as the mount is made. Left to the workers, the first one
        started answers it while the thread that starts them waits for the interpreter lock
        (Thread.start returns only once the new thread has run), and then for its next start:
        on a busy machine the holder of the lock is preempted in between, and a booth's start
        waited 2-12 ms there for about 1 ms of work. Answered here, each worker starts into an
        empty channel and blocks in its first read at once."""
        fd = self.channel.fd
        import select  # already imported by a booth and a mount's callers: no import cost

        if not select.select([fd], [], [], 0)[0]:
            return False
        # A worker's buffer (see _work): the kernel refuses reads into less than the largest
        # request it may send.
        buf = mmap.mmap(-1, w.BUFFER_SIZE)
        try:
            n = os.readv(fd, [buf])
            (unique,) = w.IN_HEADER_UNIQUE.unpack_from(buf)
            req = bytes(buf[:n])
        finally:
            buf.close()
        self._arrivals.arrived(unique)
        try:
            # INIT in practice; any request is served as a worker would serve it.
            self._serve(req)
        finally:
            self._arrivals.done(unique)
        return True

    def start(self) -> None:
        self._live = self.workers
        for i in range(self.workers):
            t = threading.Thread(target=self._work, name=f"shadowfs-fuse-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout)

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def close_channel(self) -> None:
        """Close the channel's fd now, or when the last worker returns if one still runs. A
        worker reads the fd by its number, which the process gives to the next file it opens
        once the fd is closed: a worker late to leave would read that file (a socket, a store's
        file) as requests, and could end another mount in its failure path."""
        with self._exit_lock:
            if self._live > 0:
                self._close_on_exit = True
                return
        self.channel.close()

    def _yield_turn(self) -> None:
        """Let another worker read the next request: this one is about to block. A no-op on
        a thread not reading (a follower, or a thread outside the server). The worker's
        raised priority drops meanwhile: what it blocks on (big I/O, a copy-up) may take long."""
        me = threading.get_ident()
        if self._leader == me:
            boost = self._boosts.get(me)
            if boost is not None:
                boost.drop()
            self._leader = 0
            self._turn.release()

    def _lock_ops(self) -> None:
        """Take the layer lock; if another thread has it, first hand the reading on."""
        lock = self.ops.lock
        if not lock.acquire(blocking=False):
            self._yield_turn()
            lock.acquire()

    def _work(self) -> None:
        me = threading.get_ident()
        self.idents.add(me)
        self.tids.add(threading.get_native_id())
        # Woken for each request on a busy machine, a worker with the default slice waits for
        # whatever runs on its core to use up its own (milliseconds, about one request in a
        # hundred); with the shortest slice it runs at once (shadowfs.sched).
        # Whether this process may raise the worker's priority (see the module docstring):
        # before the slice, which the reset-on-fork mark set here would reset.
        base = sched.may_boost(WORKER_BOOST)
        boost = None
        if base is not None:
            boost = self._boosts[me] = sched.Boost(base, WORKER_BOOST, self._boost_budget)
        sched.short_slice(WORKER_SLICE)
        served = 0
        # Anonymous memory, not a bytearray: bytearray(n) zero-fills its megabyte, faulting
        # in every page of it (about 1,000 page faults for the four workers, at each mount,
        # which a booth's start waits for); the kernel gives these pages zeroed as a request
        # first reaches them, and most requests are a page or less.
        buf = mmap.mmap(-1, w.BUFFER_SIZE)
        view = memoryview(buf)
        fd = self.channel.fd
        readv = os.readv
        arrivals = self._arrivals
        unique_at = w.IN_HEADER_UNIQUE.unpack_from
        try:
            while True:
                if self._leader != me:
                    self._turn.acquire()
                    self._leader = me
                    if boost is not None:
                        boost.check()
                elif boost is not None:
                    served += 1
                    if served % BOOST_CHECK_EVERY == 0:
                        boost.check()
                try:
                    n = readv(fd, [buf])
                except OSError as exc:
                    # ENOENT: the request was interrupted before it was read.
                    if exc.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                        continue
                    if exc.errno in (errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
                        return
                    raise
                if n == 0:
                    return
                (unique,) = unique_at(buf)
                arrivals.arrived(unique)
                op = buf[4]  # low byte of the opcode: every opcode used here is below 256
                req = view[:n] if op == w.WRITE else bytes(view[:n])
                try:
                    if op == w.STATFS:
                        # STATFS is the mount's barrier (`shadowfs.mountctl.Mount.sync`): its
                        # answer means every request the kernel handed out before it is in
                        # the layer (see shadowfs.fuse_arrivals).
                        arrivals.wait_before(unique, on_wait=self._yield_turn)
                    if self._serve(req):
                        return
                finally:
                    arrivals.done(unique)
        except BaseException as exc:
            # A failure outside the handlers leaves a request unanswered and the server in a
            # state nobody planned for: end the connection, so the mount's users get ENOTCONN
            # instead of waiting for a reply forever.
            self.error = exc
            log.exception("shadowfs: FUSE worker failed; aborting the connection")
            self.channel.abort()
        finally:
            # The next worker reads on and sees the end of the connection too.
            self._yield_turn()
            with contextlib.suppress(KeyError):
                self.idents.remove(me)
            with self._exit_lock:
                self._live -= 1
                close = self._live == 0 and self._close_on_exit
            if close:
                self.channel.close()

    def _serve(self, req: Any) -> bool:
        """Answer one request; True when the connection is over."""
        _, op, unique, ino, uid, gid, pid, _, _ = w.IN_HEADER.unpack_from(req)
        ch = self.channel
        ops = self.ops
        fn = ops.table.get(op)
        if fn is not None:
            lock = ops.lock
            self._lock_ops()
            try:
                try:
                    body = fn(ino, req, uid, gid, pid)
                except OSError as exc:
                    code = exc.errno or errno.EIO
                    _reply(ch, unique, code)
                    return False
                except Exception:
                    log.exception("shadowfs: request %d failed", op)
                    _reply(ch, unique, errno.EIO)
                    return False
                _reply(ch, unique, body)
            finally:
                lock.release()
            return False
        if op == w.FORGET or op == w.BATCH_FORGET:
            if op == w.FORGET:
                items = [(ino, w.U64.unpack_from(req, w.IN_HEADER_SIZE)[0])]
            else:
                count, _ = w.BATCH_FORGET_IN.unpack_from(req, w.IN_HEADER_SIZE)
                start = w.IN_HEADER_SIZE + w.BATCH_FORGET_IN.size
                items = [w.FORGET_ONE.unpack_from(req, start + 16 * i) for i in range(count)]
            self._lock_ops()
            try:
                ops.forget(items)
            finally:
                ops.lock.release()
            return False
        if op == w.INTERRUPT:
            return False  # requests here do not block on anything a signal should cut short
        if op == w.INIT:
            self._init(req, unique)
            return False
        if op == w.DESTROY:
            _reply(ch, unique, b"")
            return True
        # OPEN, OPENDIR, CREATE, FLUSH, ACCESS on purpose (see the module docstring); the rest
        # (locks, fallocate, lseek, ioctl, ...) the kernel then handles itself or refuses.
        _reply(ch, unique, errno.ENOSYS)
        return False

    def _init(self, req: bytes, unique: int) -> None:
        major, minor, max_readahead, flags, _ = w.INIT_IN.unpack_from(req, w.IN_HEADER_SIZE)
        ch = self.channel
        if major != 7 or minor < w.MIN_MINOR:
            log.error("shadowfs: kernel FUSE protocol %d.%d is too old", major, minor)
            ch.reply_error(unique, errno.EPROTO)
            return
        want = (
            w.ASYNC_READ
            | w.BIG_WRITES
            | w.DO_READDIRPLUS
            | w.READDIRPLUS_AUTO
            | w.ASYNC_DIO
            | w.WRITEBACK_CACHE
            | w.PARALLEL_DIROPS
            | w.ABORT_ERROR
            | w.MAX_PAGES
            | w.CACHE_SYMLINKS
            | w.EXPLICIT_INVAL_DATA
            # The server clears set-id bits itself: spares the kernel a GETATTR before each
            # chown (tar and cp -a as root chown every file).
            | w.HANDLE_KILLPRIV_V2
        )
        agreed = min(minor, 38)
        ch.protocol_minor = agreed
        body = w.INIT_OUT.pack(
            7,
            agreed,
            max_readahead,
            flags & want,
            MAX_BACKGROUND,
            MAX_BACKGROUND * 3 // 4,  # congestion threshold
            w.MAX_PAGES_WANTED * 4096,
            1,  # time granularity: nanoseconds
            w.MAX_PAGES_WANTED,
            0,
            0,
        )
        ch.reply(unique, body)


def _reply(ch: w.Channel, unique: int, body: Any) -> None:
    """Send a reply: an errno (int), the parts of one (list), or its bytes."""
    try:
        if isinstance(body, int):
            ch.reply_error(unique, body)
        elif isinstance(body, list):
            ch.reply_parts(unique, body)
        else:
            ch.reply(unique, body)
    except OSError as exc:
        if exc.errno == errno.EINVAL and not isinstance(body, int):
            # The kernel refused the reply's shape and still waits for an answer: its caller
            # gets EIO, and the mount serves on instead of ending the connection.
            log.error("shadowfs: the kernel refused the reply to request %d (EINVAL)", unique)
            _reply(ch, unique, errno.EIO)
            return
        # ENOENT: the request was interrupted and the kernel no longer waits for it.
        if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
            raise


def mount(layer: Layer, mountpoint: str | os.PathLike[str], **kwargs: Any) -> Any:
    """A `shadowfs.mountctl.Mount`: ``with mount(layer, path) as m: ...`` serves the layer at
    ``path`` from background threads until the block ends."""
    from shadowfs.mountctl import Mount

    return Mount(layer, mountpoint, **kwargs)
