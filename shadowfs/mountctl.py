"""Running a layer's FUSE mount from a background thread; mount checks and unmounting.

``with Mount(layer, path) as m:`` (or ``shadowfs.fuse.mount(layer, path)``) mounts, starts a
`shadowfs.fuse.Server`'s worker threads, and on exit unmounts (lazily, so a process still
sitting in the mount does not keep it alive) and ends the connection.

While mounted, the layer belongs to whoever holds its lock (`Operations.lock`): the workers'
request handlers hold it while they touch the layer. `Mount.call` runs a function on the
calling thread under that lock (no hop onto a worker) and afterwards, with the lock released,
sends the kernel invalidations the call queued (a restore's): an entry invalidation waits for
the kernel's lock on the directory, which a request in flight may hold until a worker answers
it, so they must never be sent inside a request handler or under the lock. The layer routes its
own `snapshot`, `restore` and path-level methods through `call` when attached, so the booth can
call them from any thread.
Before a snapshot or restore, `call(..., sync=True)` runs syncfs(2) on the mount: with the
writeback cache, data written through still-open files may sit in the kernel's page cache, and a
checkpoint must include it. With zero-message opens the daemon cannot know which files are open
for write, so it always syncs; on a mount with nothing dirty that is one cheap system call.

The mount point may be the base's own path (a booth mounts over the tree): the layer reaches the
base through a directory fd opened before the mount.

``Mount(..., process=True)`` serves from a forked child instead (PR_SET_PDEATHSIG kills it with
its parent). The layer then lives in the child; the parent's layer object forwards its routed
methods there over a socketpair, and the child reopens the store so no sqlite connection is
shared across the fork. Use it when the serving process itself touches the mount in ways that
hold the GIL inside the kernel (page faults on mmap'd files would need a worker, which needs
the GIL: a deadlock), and in tests, where a child that dies takes its FUSE connection with
it instead of leaving the test process blocked on its own mount at exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from shadowfs import mountinfo, sched
from shadowfs.errors import ShadowfsError
from shadowfs.fuse import FSNAME, TIMEOUT, WORKER_SLICE, Operations, Server
from shadowfs.fuse_wire import EXPIRE_ONLY_MINOR, Channel
from shadowfs.layer import Layer
from shadowfs.libc import libc as _libc

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from typing import Any

FSTYPE = "fuse.shadowfs"
PR_SET_PDEATHSIG = 1
MNT_DETACH = 2
_SCHED_PARAM = os.sched_param(0)

class MountError(ShadowfsError):
    pass


def mounts_at(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """(mount id, fstype) of every mount whose mount point is ``path``, oldest first."""
    return [(m.mount_id, m.fstype) for m in mountinfo.mounts_at(path)]


def is_mounted(path: str | os.PathLike[str], fstype: str | None = FSTYPE) -> bool:
    """Whether the top mount at ``path`` is of ``fstype`` (any type when None)."""
    found = mounts_at(path)
    return bool(found) and (fstype is None or found[-1][1] == fstype)


def unmount(path: str | os.PathLike[str], *, lazy: bool = True) -> None:
    """Unmount a FUSE mount: umount2(2) when this process may, else fusermount3, falling back
    to umount; quiet when not mounted."""
    p = os.fspath(path)
    if not mounts_at(p):
        return
    if _libc.umount2(os.fsencode(p), MNT_DETACH if lazy else 0) == 0:
        return
    # Only for a process that may not unmount itself: shutil and subprocess are not imported
    # at the top, where a booth's start would pay for them (docs/benchmarks.md).
    import shutil
    import subprocess

    tools = []
    if shutil.which("fusermount3"):
        tools.append(["fusermount3", "-u", *(["-z"] if lazy else []), p])
    if shutil.which("umount"):
        tools.append(["umount", *(["-l"] if lazy else []), p])
    for argv in tools:
        if subprocess.run(argv, capture_output=True).returncode == 0:
            return
    raise MountError(f"cannot unmount {p}; close the processes using it and run fusermount3 -u")


class Mount:
    """A layer served at ``mountpoint`` from background threads (see the module docstring)."""

    def __init__(
        self,
        layer: Layer,
        mountpoint: str | os.PathLike[str],
        *,
        allow_other: bool | None = None,
        start_timeout: float = 10.0,
        timeout: float = TIMEOUT,
        process: bool = False,
    ) -> None:
        self.layer = layer
        self.mountpoint = os.path.abspath(os.fspath(mountpoint))
        self.process = process
        self._allow_other = allow_other
        self._start_timeout = start_timeout
        self._timeout = timeout
        self._channel: Channel | None = None
        self._server: Server | None = None
        # The thread inside `call` (holding the layer lock), so its nested calls run in place.
        self._caller = -1
        self._pid = 0
        self._conn: Connection | None = None
        # One request at a time on the socket to the child, whichever thread asks.
        self._conn_lock = threading.Lock()
        self._ops: Operations | None = None
        # The mount's root, held open for syncfs.
        self._root_fd = -1

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> Mount:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Mount:
        if self._server is not None or self._pid:
            raise MountError(f"{self.mountpoint} is already served by this Mount; stop it first")
        if self.process:
            return self._start_child()
        allow_other = self._allow_other
        if allow_other is None:
            allow_other = os.geteuid() == 0
        try:
            channel = Channel.open(
                self.mountpoint, fsname=FSNAME, subtype=FSNAME, allow_other=allow_other
            )
        except OSError as exc:
            raise MountError(
                f"cannot mount shadowfs at {self.mountpoint} ({exc.strerror or exc}); "
                "check /dev/fuse, fusermount3 and that the mount point is a directory"
            ) from None
        self._channel = channel
        self._ops = Operations(self.layer, timeout=self._timeout)
        self._server = Server(self._ops, channel)
        try:
            self._server.answer_init()  # see there: spares the start a wait for the workers
        except OSError as exc:
            self.stop()
            raise MountError(
                f"shadowfs mounted at {self.mountpoint} but could not answer the kernel "
                f"({exc.strerror or exc})"
            ) from None
        self._server.start()
        try:
            # Blocks until the kernel's INIT is answered (here above, or by a worker) and a
            # worker answers the root's requests: the workers serve.
            self._root_fd = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            self.stop()
            raise MountError(
                f"shadowfs mounted at {self.mountpoint} but does not answer ({exc.strerror}); "
                "see the log for the worker's error"
            ) from None
        self.layer.attach(self)
        return self

    def _start_child(self) -> Mount:
        # Here, not at the top: a mount served in this process (a booth's) never needs it.
        from multiprocessing.connection import Connection

        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                mine.close()
                _child(self, Connection(theirs.detach()))
                code = 0
            except BaseException:
                import traceback  # only here: linecache, tokenize, textwrap (booth start)

                traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        self._pid = pid
        self._conn = Connection(mine.detach())
        ok = self._conn.poll(self._start_timeout)
        status, detail = self._conn.recv() if ok else ("error", "it did not come up in time")
        if status != "ready":
            self.stop()
            raise MountError(
                f"cannot mount shadowfs at {self.mountpoint} ({detail}); "
                "check /dev/fuse, fusermount3 and that the mount point is a directory"
            )
        self.layer.attach(self)
        return self

    def _stop_child(self) -> None:
        with self._conn_lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + 30.0
        while True:
            done, _ = os.waitpid(self._pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
                break
            time.sleep(0.005)
        self._pid = 0
        if conn is not None:
            conn.close()
        if is_mounted(self.mountpoint):
            unmount(self.mountpoint)

    def stop(self) -> None:
        """Stop serving and unmount. Idempotent."""
        self.layer.detach(self)
        if self._pid:
            self._stop_child()
            return
        server, channel = self._server, self._channel
        if server is None or channel is None:
            return
        fd, self._root_fd = self._root_fd, -1
        if fd >= 0:
            os.close(fd)
        # Detaching the last use of the mount ends the connection; a process still inside it
        # would keep it up, so it is then aborted (its users get ENOTCONN, as when a daemon
        # dies).
        with contextlib.suppress(MountError):
            unmount(self.mountpoint)
        server.join(0.5)
        if server.running:
            channel.abort()
            server.join(10.0)
        server.close_channel()
        self._server = None
        self._channel = None

    @property
    def running(self) -> bool:
        if self._pid:
            return os.waitpid(self._pid, os.WNOHANG)[0] == 0
        return self._server is not None and self._server.running

    # ------------------------------------------------------------------ calls into the loop

    def on_loop(self) -> bool:
        """Whether this thread may touch the layer directly: a worker (its handlers hold the
        layer lock), or a thread already inside `call`."""
        ident = threading.get_ident()
        server = self._server
        return ident == self._caller or (server is not None and ident in server.idents)

    def call_layer(
        self, fn: Callable[..., Any], *args: Any, sync: bool = False, **kwargs: Any
    ) -> Any:
        """``fn(layer, *args, **kwargs)`` where the layer lives (this process or the child)."""
        conn = self._conn
        if conn is None:
            return self.call(fn, self.layer, *args, sync=sync, **kwargs)
        with self._conn_lock:
            conn.send((fn.__name__, args, kwargs, sync))
            status, value = conn.recv()
        if status == "err":
            raise value
        return value

    def call(self, fn: Callable[..., Any], *args: Any, sync: bool = False, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` with the layer to itself and return its result; then send
        the kernel invalidations it queued. ``sync`` first flushes the kernel's dirty pages.

        ``fn`` runs on the calling thread holding the layer lock, which every request handler
        holds while it touches the layer: no request is mid-way through the layer meanwhile,
        without a hop onto a worker and back. ``fn`` must not touch the mount itself: the
        handler serving that would wait for the lock."""
        ident = threading.get_ident()
        if ident == self._caller:
            # Nested in a call: the outer one sends the invalidations, after the lock.
            return fn(*args, **kwargs)
        ops, server = self._ops, self._server
        if ops is None or server is None:
            raise MountError(f"the shadowfs mount at {self.mountpoint} is not running; start it")
        if ident in server.idents:
            with ops.lock:
                result = fn(*args, **kwargs)
                inval = self.layer.take_invalidations()
            self._invalidate(inval, blocking=False)
            return result
        if sync:
            self.sync()
        inval = []
        try:
            with ops.lock:
                self._caller = ident
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._caller = -1
                    inval = self.layer.take_invalidations()
        finally:
            # Outside the lock: each send may wait for requests that need it.
            self._invalidate(inval, blocking=True)

    def sync(self) -> None:
        """Write the kernel's dirty pages for this mount back into the layer."""
        fd = self._root_fd
        if fd < 0 or self.on_loop():
            # On a worker or inside a call, writeback would wait for handlers that wait for
            # this thread.
            return
        # ctypes calls release the GIL, which the workers need to take the written pages.
        _libc.syncfs(fd)
        # The syncfs only queued the writes. None unanswered means they are all in the layer
        # (a worker answers a write after applying it); otherwise this STATFS is answered
        # after them (see `shadowfs.fuse_arrivals`). The count spares a checkpoint after a
        # quiet step the STATFS's round trip, tens of µs spent waking a worker.
        channel = self._channel
        if channel is not None and channel.requests_waiting() == 0:
            return
        os.fstatvfs(fd)

    def _invalidate(self, items: list[tuple[Any, ...]], *, blocking: bool) -> None:
        if not items:
            return
        if not blocking:
            # On a worker: an entry invalidation could wait for a request this thread serves.
            threading.Thread(
                target=self._invalidate, args=(items,), kwargs={"blocking": True}, daemon=True
            ).start()
            return
        channel, server = self._channel, self._server
        if channel is None or server is None:
            return
        # A directory reached by two paths of a restore is queued twice; each send is a write
        # to /dev/fuse.
        items = list(dict.fromkeys(items))
        # Where the kernel only expires entries (`Channel.invalidate_entry`) nothing more is
        # needed. Elsewhere each dropped entry evicts an inode, and the kernel's FORGET for it
        # wakes a worker. Having slept through the call, a worker would preempt this thread on
        # each FORGET (tens of µs apiece on a busy machine); as SCHED_BATCH it does not preempt
        # on wake-up and reads them later in one batch. Any user may switch its own threads
        # between SCHED_OTHER and SCHED_BATCH.
        # A worker's reset-on-fork mark (shadowfs.sched.Boost) goes along both ways: a
        # privileged caller's switch would clear it.
        batched: list[tuple[int, int]] = []
        drops = channel.protocol_minor < EXPIRE_ONLY_MINOR
        if drops and any(it[0] == "entry" for it in items):
            for tid in list(server.tids):
                with contextlib.suppress(OSError):
                    policy = os.sched_getscheduler(tid)
                    mark = policy & os.SCHED_RESET_ON_FORK
                    if policy & ~mark == os.SCHED_OTHER:
                        os.sched_setscheduler(tid, os.SCHED_BATCH | mark, _SCHED_PARAM)
                        batched.append((tid, mark))
        try:
            for it in items:
                # ENOENT: the kernel forgot that inode or entry already; nothing to drop.
                with contextlib.suppress(OSError):
                    if it[0] == "entry":
                        channel.invalidate_entry(it[1], it[2])
                    else:
                        channel.invalidate_inode(it[1], attr_only=it[2])
        finally:
            for tid, mark in batched:
                with contextlib.suppress(OSError):
                    os.sched_setscheduler(tid, os.SCHED_OTHER | mark, _SCHED_PARAM)
                    # Which reset the worker's slice to the default: its own again.
                    sched.short_slice(WORKER_SLICE, tid)

    # ------------------------------------------------------------------ conveniences

    def snapshot(self) -> Any:
        return self.layer.snapshot()

    def restore(self, tree_id: Any) -> None:
        self.layer.restore(tree_id)


def _child(parent: Mount, conn: Connection) -> None:  # pragma: no cover - runs in the child
    """A forked child serving the layer; answers (method, args, kwargs, sync) from the parent."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        return
    layer = parent.layer
    store = layer.store
    reopen = getattr(type(store), "open", None)
    if reopen is not None and hasattr(store, "root"):
        layer.store = reopen(store.root)
    m = Mount(
        layer,
        parent.mountpoint,
        allow_other=parent._allow_other,
        start_timeout=parent._start_timeout,
        timeout=parent._timeout,
    )
    try:
        m.start()
    except BaseException as exc:
        conn.send(("error", str(exc)))
        return
    conn.send(("ready", None))
    try:
        while True:
            try:
                req = conn.recv()
            except EOFError:
                break
            if req is None:
                break
            name, args, kwargs, sync = req
            try:
                fn = getattr(type(layer), name)
                value = m.call(getattr(fn, "__wrapped__", fn), layer, *args, sync=sync, **kwargs)
                conn.send(("ok", value))
            except BaseException as exc:
                # A worker that failed logged it here, where nobody reads it (a forked child's
                # log records go to the copy of its parent's handlers), and ended the connection:
                # the caller would see only the ECONNABORTED or ENOTCONN that followed.
                server = m._server
                if server is not None and server.error is not None and exc is not server.error:
                    exc.add_note(f"the mount's FUSE worker failed first: {server.error!r}")
                conn.send(("err", exc))
    finally:
        m.stop()
        close = getattr(layer.store, "close", None)
        if close is not None and layer.store is not store:
            close()
        sys.stdout.flush()


@contextlib.contextmanager
def mounted(layer: Layer, mountpoint: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``with mounted(layer, path) as m:`` — a started `Mount`, stopped on exit."""
    m = Mount(layer, mountpoint, **kwargs).start()
    try:
        yield m
    finally:
        m.stop()
