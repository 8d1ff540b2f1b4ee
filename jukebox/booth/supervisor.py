"""One sandboxed run: the booth supervisor, its verdict, and the pending booths it leaves behind.

`run_booth` is the whole life of a booth, in this order:

1. open the store and a new tape; hash the real tree (the base tree); write run_start (argv, cwd,
   image and policy, base tree, host facts, the environment's names — never its values);
2. record the booth in `<tape dir>/.jukebox/booths/<id>.json` (status `running`), so even a crash
   leaves a trace `jukebox booth ls` can show;
3. block the signals it will wait for, then enter a private mount namespace (a user namespace
   too when not root) — before any thread exists, as the kernel demands;
4. mount the copy-on-write layer over the tree's own path (the layer reaches the real tree
   through an fd opened before the mount), start the control socket, start CMD through the
   isolation shim (tape dir hidden, host read-only, capabilities cut, limits set);
5. wait: the first Ctrl-C reaches the agent, a second one kills it; `--checkpoint-every` takes
   automatic checkpoints; checkpoints and rollbacks from inside arrive over the socket;
6. on exit: kill stragglers, snapshot (an `fs` frame), an `exit` frame (status, signal,
   rusage), the verifier inside the booth (a `verify` frame with its output, truncated);
7. unmount, then the verdict: `auto` commits (a `commit` frame) when CMD exited 0 and the
   verifier passed, else rolls back (a `rollback` frame and an alert); `ask` shows the diff and
   asks; `never` — or any interruption — keeps the booth pending for `jukebox booth commit ID`.

The layer is a seam (`BoothLayer`): the FUSE layer and the kernel overlay both fit behind it,
and so can anything else that mounts a snapshot-able view at a path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import json
import os
import select
import signal
import socket
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from jukebox.booth import isolation, procs
from jukebox.booth.cgroups import BoothCgroup
from jukebox.booth.control import (
    CHECKPOINT_LINE,
    SOCKET_ENV,
    ControlServer,
    Peer,
    RequestError,
    quickline_answers,
)
from jukebox.booth.images import Image, load_image
from jukebox.booth.paths import SET_ID_WALK_LIMIT, BoothPaths, strip_set_id
from jukebox.booth.protections import Protections, booth_protections, strict_refusal
from jukebox.booth.record_binding import bound_tape, record_seal
from jukebox.booth.recorded_image import image_record
from jukebox.booth.scratchdir import (
    booth_scratch,
    keep_scratch,
    layer_mountpoint,
    remove_scratch,
    retire_scratch,
    socket_dir_prefix,
)
from jukebox.booth.terminal import AgentTerminal, relayed, send_to_agent
from jukebox.booth.view_denials import OutputTail, StderrTee, view_denials
from jukebox.display.progress import note
from jukebox.errors import CheckFailed, JukeboxError, UsageError
from jukebox.tape.tapedir import (
    TapeDir,
    check_tape_id,
    make_tape_dir,
    remove_unused_tape_dir,
)
from jukebox.trees.basetree import build_base_tree, forget_committed, known_files, read_stats
from shadowfs import wakeups
from shadowfs.oid import ObjectId
from shadowfs.values import Record, Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any, Protocol

    from jukebox.llm.session import LlmOptions
    from shadowfs.objects import ObjectReader, ObjectStore

COMMIT_MODES = ("auto", "ask", "never")
# Not a --commit choice: replays and forks run scratch booths that end discarded, quietly,
# with a `discard` frame (no "kept pending" notice for a booth nobody will ever commit).
DISCARD = "discard"
FS_KINDS = ("fuse", "overlay")
VERIFY_OUTPUT_MAX = 64 * 1024
BOOTH_ID_ENV = "JUKEBOX_BOOTH_ID"
TAPE_ID_ENV = "JUKEBOX_TAPE_ID"
MCP_URL_ENV = "JUKEBOX_MCP_URL"  # the HTTP MCP servers' gateway, its path secret included
BREAKER_GRACE_S = 3.0  # seconds an agent stopped by the circuit breaker gets before SIGKILL
WAITED_SIGNALS = set(isolation.SUPERVISOR_WAITED)
# A SIGCHLD taken by a thread that does not block it (one started before the mask was set, or
# by a library) is discarded, and a wait that trusted it alone would sleep on: the booth's waits
# look at the child again at least this often.
CHILD_POLL_SECONDS = 1.0


class BoothError(JukeboxError):
    pass


# --------------------------------------------------------------------------- the layer seam


if TYPE_CHECKING:

    class BoothLayer(Protocol):
        """What the supervisor needs from a copy-on-write layer mounted over the tree."""

        def mount(self) -> None:
            """Serve base + layer at `LayerContext.mountpoint`, in the current mount namespace."""

        def snapshot(self) -> tuple[ObjectId, ObjectId | None]:
            """(tree id, write-journal blob id or None) of the layer now; objects are in the
            store."""

        def restore(self, tree_id: ObjectId) -> None:
            """Make the mounted view show `tree_id`, while processes keep running."""

        def unmount(self) -> None: ...

        def discard(self, *, keep_files: bool = False) -> None:
            """Remove the layer's scratch state; the real tree is untouched. With ``keep_files``
            the staged files stay in the booth's scratch dir (a pending booth's: see
            `scratchdir.keep_scratch`)."""

        # Optional: `watch_refused_writes(callback)`, for a layer that may refuse a write the
        # kernel had already accepted (see `_FuseBoothLayer`); the supervisor then stops the
        # agent. Optional: `snapshot_answering(answer)`, `snapshot` that calls `answer(tree id,
        # journal id or None)` as soon as they are known, before its own bookkeeping
        # (`_Run.checkpoint_answering`). Optional: `scratch_usage() -> (staged bytes, limit or
        # None)`, for `booth status`.


class LayerContext(Record):
    FIELDS = (
        "fs", "tree", "tree_fd", "store", "scratch", "base_tree", "userns", "scratch_limit",
        "mountpoint",
    )  # fmt: skip
    fs: str
    tree: str  # real path of the tree
    tree_fd: int  # opened before the namespace and the mount
    store: ObjectStore
    scratch: Path  # empty, outside the tree, hidden from the agent
    base_tree: ObjectId
    userns: bool
    # The most the layer may stage (apparent bytes); None: no limit. FUSE layers only.
    scratch_limit: int | None
    # Where the layer is served in the supervisor's namespace; the agent's view puts it at
    # `tree` (ChildSpec.mount_at). None: at `tree` itself.
    mountpoint: str | None

    def __init__(
        self,
        fs: str,
        tree: str,
        tree_fd: int,
        store: Any,
        scratch: Path,
        base_tree: ObjectId,
        userns: bool,
        scratch_limit: int | None = None,
        mountpoint: str | None = None,
    ) -> None:
        self.fs = fs
        self.tree = tree
        self.tree_fd = tree_fd
        self.store = store
        self.scratch = scratch
        self.base_tree = base_tree
        self.userns = userns
        self.scratch_limit = scratch_limit
        self.mountpoint = mountpoint


LayerFactory = Callable[[LayerContext], "BoothLayer"]


class _OverlayBoothLayer:
    def __init__(self, ctx: LayerContext) -> None:
        from shadowfs.overlay import OverlayLayer

        self.mountpoint = ctx.mountpoint or ctx.tree
        self.inner = OverlayLayer(
            ctx.tree, ctx.store, ctx.scratch, ctx.base_tree, userxattr=ctx.userns
        )

    def mount(self) -> None:
        self.inner.mount(self.mountpoint)

    def snapshot(self) -> tuple[ObjectId, ObjectId | None]:
        return self.inner.snapshot(), None

    def restore(self, tree_id: ObjectId) -> None:
        self.inner.restore(tree_id)

    def unmount(self) -> None:
        self.inner.unmount(lazy=True)

    def discard(self, *, keep_files: bool = False) -> None:
        self.inner.discard(keep_files=keep_files)


class _FuseBoothLayer:
    """shadowfs.layer.Layer served by shadowfs.fuse from a background thread."""

    def __init__(self, ctx: LayerContext) -> None:
        from shadowfs.layer import Layer

        self.mountpoint = ctx.mountpoint or ctx.tree
        self.scratch = ctx.scratch
        self.layer = Layer(
            ctx.tree, ctx.store, ctx.scratch, base_tree=ctx.base_tree,
            scratch_limit=ctx.scratch_limit,
        )
        self._mount: Any = None
        self._watchdog: Any = None
        self._quiet: Any = None
        self._connection: int | None = None
        self._fusectl_dir = -1  # the connection's fusectl directory, for the compiled path

    def _waiting_on_layer(self, what: str) -> contextlib.AbstractContextManager[None]:
        watchdog = self._watchdog
        return watchdog.blocking(what) if watchdog is not None else contextlib.nullcontext()

    def scratch_usage(self) -> tuple[int, int | None]:
        # Read without the layer lock: an int the workers replace whole.
        return self.layer.scratch_bytes, self.layer.scratch_limit

    def watch_refused_writes(self, callback: Callable[[OSError], None]) -> None:
        """``callback(error)`` when the mount refuses a write the agent's kernel had already
        taken (the scratch limit, or a full scratch disk). Called on a mount worker under the
        layer lock, so it must hand the work off."""
        self.layer.on_write_refused = callback

    def mount(self) -> None:
        from jukebox.booth.fusectl import FUSECTL, connection_at
        from jukebox.booth.layer_watchdog import LayerWatchdog
        from shadowfs import fuse
        from shadowfs.quiet_fold import QuietFold

        self._mount = fuse.mount(self.layer, self.mountpoint).start()
        self._connection = connection = connection_at(os.path.realpath(self.mountpoint))
        if connection is not None:
            self._watchdog = LayerWatchdog(connection).start()
            # Opened while this mount holds the number: another mount's later is another dir.
            with contextlib.suppress(OSError):
                self._fusectl_dir = os.open(
                    f"{FUSECTL}/{connection}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
                )
        # A checkpoint asked for after the agent's pause finds its step's files stored.
        self._quiet = QuietFold(self.layer, fold=self._fold).start()

    def _fold(self) -> None:
        with self._waiting_on_layer("folding the agent's changes"):
            self.layer.fold()

    def snapshot(self) -> tuple[ObjectId, ObjectId | None]:
        # A group commit (routed to the FUSE thread while mounted): the tape flushes the store
        # before any frame naming these objects is written (GroupTape).
        with self._waiting_on_layer("a snapshot"):
            return self.layer.snapshot(durable=False)

    def snapshot_answering(self, answer: Callable[[ObjectId, ObjectId | None], None]) -> None:
        with self._waiting_on_layer("a snapshot"):
            self.layer.snapshot(durable=False, answer=answer)

    def quick_gate(self) -> tuple[int, int, int, Any, Any] | None:
        """What the compiled checkpoint path needs of the mount (`control.FastCheckpoint`): its
        root's fd (the syncfs), its fusectl directory's fd and number, the layer lock and the
        layer; None where it is not served in this process by a watched FUSE mount."""
        mount, connection, fusectl_dir = self._mount, self._connection, self._fusectl_dir
        # The mount's own handles (shadowfs.mountctl.Mount): its layer lock is the handlers'.
        fd = getattr(mount, "_root_fd", -1)
        ops = getattr(mount, "_ops", None)
        if connection is None or self._watchdog is None or fd < 0 or ops is None:
            return None
        if fusectl_dir < 0 or getattr(mount, "process", False):
            return None
        return fd, fusectl_dir, connection, ops.lock, self.layer

    def took_fold(self) -> None:
        """After a checkpoint answered from the fold's ids (under the layer lock)."""
        self.layer.took_fold(durable=False)

    def restore(self, tree_id: ObjectId) -> None:
        with self._waiting_on_layer("a rollback"):
            (self._mount or self.layer).restore(tree_id)

    def unmount(self) -> None:
        if self._quiet is not None:
            self._quiet.close()  # no fold once the layer is no longer behind the mount's lock
            self._quiet = None
        if self._mount is not None:
            mount, self._mount = self._mount, None
            with self._waiting_on_layer("the unmount"):
                mount.stop()
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if self._fusectl_dir >= 0:
            fd, self._fusectl_dir = self._fusectl_dir, -1
            os.close(fd)

    def discard(self, *, keep_files: bool = False) -> None:
        if self._quiet is not None:
            self._quiet.close()
            self._quiet = None
        self.layer.close(keep_files=keep_files)
        if not keep_files:
            from shadowfs.removal import remove_quietly  # not at a booth's start

            remove_quietly(self.scratch)


def default_layer_factory(ctx: LayerContext) -> BoothLayer:
    if ctx.fs == "overlay":
        return _OverlayBoothLayer(ctx)
    try:
        return _FuseBoothLayer(ctx)
    except ImportError as error:
        raise BoothError(
            f"the FUSE layer is not available in this build ({error}); run with --fs overlay"
        ) from None


# --------------------------------------------------------------------------- pending booths


class BoothRecord(Record):
    FIELDS = (
        "id", "tree", "base_tree", "tape", "created", "status", "name", "final_tree", "pid",
        "agent_status", "verify", "note", "tree_dev", "tree_ino", "seal", "mcp_staged",
        "mcp_servers",
    )  # fmt: skip
    id: str
    tree: str
    base_tree: str
    tape: str
    created: float
    status: str  # running | pending | conflict
    name: str | None
    final_tree: str | None
    pid: int | None
    agent_status: int | None
    verify: dict[str, Any] | None
    note: str | None
    # The tree's directory as the booth opened it (see jukebox.trees.realtree); also in run_start.
    tree_dev: int | None
    tree_ino: int | None
    # This user's keyed hash of the fields a commit acts on
    # (jukebox.booth.record_binding.record_seal): only a booth this user ran here is ever committed
    # from its record.
    seal: str | None
    # MCP calls staged and not yet run, and the declared servers they go to (jukebox.mcp.verdict).
    mcp_staged: list[dict[str, Any]] | None
    mcp_servers: dict[str, Any] | None

    def __init__(
        self,
        id: str,
        tree: str,
        base_tree: str,
        tape: str,
        created: float,
        status: str,
        name: str | None = None,
        final_tree: str | None = None,
        pid: int | None = None,
        agent_status: int | None = None,
        verify: dict[str, Any] | None = None,
        note: str | None = None,
        tree_dev: int | None = None,
        tree_ino: int | None = None,
        seal: str | None = None,
        mcp_staged: list[dict[str, Any]] | None = None,
        mcp_servers: dict[str, Any] | None = None,
    ) -> None:
        self.id = id
        self.tree = tree
        self.base_tree = base_tree
        self.tape = tape
        self.created = created
        self.status = status
        self.name = name
        self.final_tree = final_tree
        self.pid = pid
        self.agent_status = agent_status
        self.verify = verify
        self.note = note
        self.tree_dev = tree_dev
        self.tree_ino = tree_ino
        self.seal = seal
        self.mcp_staged = mcp_staged
        self.mcp_servers = mcp_servers

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _record_path(tape_dir: TapeDir, booth_id: str) -> Path:
    return tape_dir.booths_path / f"{check_tape_id(booth_id)}.json"


def save_record(tape_dir: TapeDir, record: BoothRecord) -> None:
    record.seal = record_seal(record)
    path = _record_path(tape_dir, record.id)
    tape_dir.private_dir(path.parent.name)
    tmp = path.with_suffix(".json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        json.dump(record.to_json(), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_record(tape_dir: TapeDir, booth_id: str) -> BoothRecord:
    path = _record_path(tape_dir, booth_id)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        _raise_if_finished(tape_dir, booth_id)
        raise UsageError(
            f"no pending booth {booth_id!r} in {tape_dir.path}: list them with "
            f"`jukebox booth ls --tape-dir {tape_dir.path}`"
        ) from None
    except ValueError:
        data = None
    try:
        return BoothRecord(**data)
    except TypeError:
        # A record is a plain file beside the tapes: anyone who handed over the dir wrote it.
        raise CheckFailed(
            f"{path} is not a booth record (not JSON, or keys a booth never writes): nothing "
            "was done; remove it by hand if it is not yours"
        ) from None


def this_process() -> dict[str, int]:
    """pid, uid, gid of this process, as a checkpoint frame's `peer` names its requester."""
    return Peer(os.getpid(), os.getuid(), os.getgid()).as_dict()


def _raise_if_finished(tape_dir: TapeDir, booth_id: str) -> None:
    """A booth asked for after its verdict: exit 1 saying when and by what it was finished."""
    from jukebox.booth.finished import finished_booth

    finished = finished_booth(tape_dir, booth_id)
    if finished is not None:
        raise CheckFailed(finished)


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_booths(tape_dir: TapeDir) -> list[BoothRecord]:
    out: list[BoothRecord] = []
    if not tape_dir.booths_path.is_dir():
        return out
    for path in sorted(tape_dir.booths_path.glob("*.json")):
        try:
            record = BoothRecord(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            continue
        if record.status == "running" and not _alive(record.pid):
            record.status = "crashed"  # its supervisor died: commit a checkpoint, or discard
        # Trust matters for what could be committed: a crashed booth can only be discarded, and
        # another user's crashed booth is still crashed (not `foreign`) to whoever cleans up.
        elif record.status != "running":
            record.status = _trust_status(tape_dir, record) or record.status
        out.append(record)
    return out


def _trust_status(tape_dir: TapeDir, record: BoothRecord) -> str | None:
    """`tampered` when the record does not match its tape (or the tape's chain breaks),
    `foreign` when it does but carries no seal of this user's (a received booth: never
    committed), else None."""
    from jukebox.booth.record_binding import NotSealed

    try:
        bound_tape(tape_dir, record.id, record.replace(), sealed=True)
    except NotSealed:
        return "foreign"
    except (JukeboxError, OSError, ValueError):
        return "tampered"
    return None


@contextlib.contextmanager
def _locked(tape_dir: TapeDir, booth_id: str) -> Iterator[BoothRecord]:
    """The record, held under an exclusive lock so two processes never commit one booth twice."""
    path = _record_path(tape_dir, booth_id)
    record = load_record(tape_dir, booth_id)
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = load_record(tape_dir, booth_id)  # re-read: another process may have finished it
        yield record
    finally:
        os.close(lock)


def _finish(tape_dir: TapeDir, booth_id: str) -> None:
    path = _record_path(tape_dir, booth_id)
    for p in (path, path.with_suffix(".lock")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _open_store(tape_dir: TapeDir) -> Any:
    from shadowfs.store import Store

    return Store.open(tape_dir.store_path, create=True)


def _append_to_tape(
    store: ObjectStore, tape_path: str, kind: str, payload: dict[str, Any], tree: Any = None,
    refs: Sequence[Any] = (),
) -> None:  # fmt: skip
    from jukebox.tape.tape import TapeWriter

    with TapeWriter.open_append(tape_path, store) as writer:
        writer.append(kind, payload, refs=refs, tree=tree)


# The longest a checkpoint frame (and any frame) waits in memory or in the page cache before it
# is on disk; also the store's FLUSH_DELAY.
GROUP_DELAY = 0.05


class GroupTape:
    """The booth's tape writer with group commit: checkpoints are acknowledged before any fsync.

    A checkpoint's frame is kept here, in memory, until a flush — on a background thread within
    GROUP_DELAY, or at once through `sync` — makes its objects durable (`store.flush()`: the pack
    fsync, then the index commit); only then is the frame written to the tape, and the tape
    fdatasynced. So a frame that reaches the disk never names an object that did not: a crash
    (even a power loss) costs at most the frames of the last GROUP_DELAY, never leaves one
    pointing at missing objects. Any frame appended while checkpoint frames wait queues behind
    them, keeping the tape in request order; the rest are written at once (one write(2), so a
    killed supervisor loses none of them) and fdatasynced by the same flush. `sync` runs before
    anything leaves the booth: a commit to the real tree, a verdict, the end of the run.

    The background flush takes the waiting frames off the queue and makes their objects durable
    without the lock: a checkpoint arriving during that fsync (tens of ms on a busy disk) queues
    its frame behind them instead of waiting for the disk. Other frames that queued only behind
    those in flight are written with them, not a flush later.
    """

    def __init__(self, writer: Any, store: ObjectStore, delay: float = GROUP_DELAY) -> None:
        self.writer = writer  # a TapeWriter created with fsync=False
        self.store = store
        self.path = writer.path
        self.delay = delay
        # fdatasync works on the inode through any descriptor; this one is ours to hold.
        self._fd = os.open(writer.path, os.O_RDONLY | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # (kind, payload, refs, tree, time_ns, deferred): deferred frames wait for a flush.
        self._queue: list[tuple[str, dict[str, Any], tuple[bytes, ...], Any, int, bool]] = []
        # Frames the background flush took off the queue and has not written yet; appends queue
        # behind them, and `sync` waits for them.
        self._in_flight = 0
        self._landed = threading.Condition(self._lock)
        self._unsynced = False
        self._due: float | None = None
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the background flusher. Until then every frame is durable when appended: the
        supervisor enters its namespaces only while it runs no other thread."""
        self._thread = threading.Thread(target=self._loop, name="jukebox-tape-flush", daemon=True)
        self._thread.start()

    @property
    def count(self) -> int:
        """Frames appended, including those waiting for their flush."""
        return self.writer.count + self._in_flight + len(self._queue)

    def append(
        self,
        kind: str,
        payload: dict[str, Any],
        refs: Sequence[bytes] = (),
        tree: Any = None,
        *,
        defer: bool = False,
    ) -> int:
        """Record a frame; returns its seq. ``defer``: its objects are not durable yet (a fresh
        snapshot's), so it waits for the next flush instead of the store flushing now."""
        with self._lock:
            self._raise_error()
            seq = self.writer.count + self._in_flight + len(self._queue)
            if defer or self._queue or self._in_flight:
                self._queue.append((kind, payload, tuple(refs), tree, time.time_ns(), defer))
            else:
                seq = self.writer.append(kind, payload, refs=refs, tree=tree).seq
                self._unsynced = True
            self._schedule()
            return seq

    def schedule(self) -> None:
        """The flush of a frame queued without `append` (the compiled checkpoint path's)."""
        with self._lock:
            self._schedule()

    def _schedule(self) -> None:
        if self._thread is None:
            self._sync_locked()
        elif self._due is None:
            self._due = time.monotonic() + self.delay
            # After the answer when a control request appended this (shadowfs.wakeups).
            wakeups.notify(self._wake)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise BoothError(
                f"the tape {self.path} could not be made durable ({self._error}); the run's "
                "record is incomplete — free disk space and check the tape dir"
            )

    def _write_queued(self) -> None:
        """With the lock held: the queued frames go to the tape, their objects flushed first."""
        while self._in_flight:
            self._landed.wait()
        if self._queue:
            self.store.flush()
            self._write_flushed(self._queue)
            self._queue.clear()
            self._unsynced = True

    def _write_flushed(self, frames: list[tuple[Any, ...]], *, refs_durable: bool = True) -> None:
        """With the lock held: ``frames`` to the tape. ``refs_durable``: the store was flushed
        since their objects were put, and the writer is told so (its own flush per frame
        would fsync, under the lock, what checkpoints put meanwhile)."""
        for kind, payload, refs, tree, t, _ in frames:
            self.writer.append(
                kind, payload, refs=refs, tree=tree, time_ns=t, refs_durable=refs_durable
            )

    def sync(self) -> None:
        """Everything appended so far durable now: objects, then frames, then one fdatasync."""
        with self._lock:
            self._raise_error()
            self._sync_locked()

    def _sync_locked(self) -> None:
        self._due = None
        self._write_queued()
        if self._unsynced:
            os.fdatasync(self._fd)
            self._unsynced = False

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closing and (self._due is None or self._due > time.monotonic()):
                    self._wake.wait(None if self._due is None else self._due - time.monotonic())
                if self._closing:
                    return
                self._due = None
                batch, self._queue = self._queue, []
                self._in_flight = len(batch)
            try:
                if batch:
                    self.store.flush()  # unlocked: see the class docstring
            except Exception as exc:  # reported by the next append or sync
                with self._lock:
                    self._queue[:0] = batch
                    self._in_flight = 0
                    self._error = exc
                    self._landed.notify_all()
                continue
            with self._lock:
                try:
                    self._write_flushed(batch)
                    # Frames that queued only because the batch was in flight are written now,
                    # as they would have been had they come after it.
                    plain = list(itertools.takewhile(lambda frame: not frame[5], self._queue))
                    del self._queue[: len(plain)]
                    self._write_flushed(plain, refs_durable=False)
                    if batch or plain:
                        self._unsynced = True
                    unsynced, self._unsynced = self._unsynced, False
                except Exception as exc:
                    self._error = exc
                    continue
                finally:
                    self._in_flight = 0
                    self._landed.notify_all()
            if unsynced:
                try:
                    os.fdatasync(self._fd)
                except OSError as exc:
                    with self._lock:
                        self._error = exc

    def close(self) -> None:
        """Sync what is left, stop the flusher, close the tape."""
        try:
            self.sync()
        finally:
            with self._lock:
                self._closing = True
                self._wake.notify()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self.writer.close()


def change_summary(store: ObjectReader, base: ObjectId, final: ObjectId) -> list[str]:
    """One line per changed path: `A`dded, `M`odified, `D`eleted, `T`ype or mode changed."""
    from shadowfs.tree import diff_trees

    return [change_summary_line(change) for change in diff_trees(store, base, final)]


def change_summary_line(change: Any) -> str:
    """``A path  (N bytes)``, ``A path  (fifo)``: one shadowfs.tree.Change as a review lists
    it, with what the entry is (`jukebox.display.names.entry_note`)."""
    from jukebox.display.names import change_line, entry_note

    return change_line(change.status, change.path) + entry_note(change.new or change.old)


def _pending_trees(record: BoothRecord) -> tuple[ObjectId, ObjectId]:
    if record.final_tree is None:
        if record.status == "running" and _alive(record.pid):
            raise UsageError(
                f"booth {record.id} is still running (pid {record.pid}): it has no final state "
                f"yet; wait for it, stop it (`jukebox booth stop {record.id}`), or give one of "
                "its checkpoints with --at"
            )
        raise UsageError(
            f"booth {record.id} has no final state: its supervisor (pid {record.pid}) died "
            f"before the run ended (crashed); commit one of its checkpoints with --at N|LABEL "
            f"(`jukebox log {record.tape}` lists them), or `jukebox booth discard {record.id}`"
        )
    return ObjectId.from_hex(record.base_tree), ObjectId.from_hex(record.final_tree)


def pending_checkpoint(record: BoothRecord, at: str) -> RollbackPoint:
    """The checkpoint ``at`` names in a finished booth's tape, found as `jukebox booth rollback
    --to` finds one inside the booth (`find_checkpoint`)."""
    from jukebox.tape.tape import Tape

    checkpoints = [RollbackPoint(0, "start", ObjectId.from_hex(record.base_tree), 0)]
    try:
        frames = Tape.load(record.tape).frames
    except (OSError, JukeboxError) as error:
        raise UsageError(
            f"cannot read the checkpoints of booth {record.id} from {record.tape}: {error}; "
            "commit or discard it whole"
        ) from None
    checkpoints += [
        RollbackPoint(int(f.payload["id"]), f.payload.get("label"), f.tree, f.seq)
        for f in frames
        if f.kind == "checkpoint" and f.tree is not None
    ]
    found = find_checkpoint(checkpoints, int(at) if at.isdigit() else at)
    if found is not None:
        return found
    if at.isdigit():
        raise UsageError(
            f"booth {record.id} has no checkpoint {at}: it has "
            f"{', '.join(str(c.n) for c in checkpoints)} (0 is the start); see "
            f"`jukebox log {record.tape}`"
        )
    labels = sorted({c.label for c in checkpoints if c.label})
    raise UsageError(
        f"booth {record.id} has no checkpoint labelled {at!r}: its labels are "
        f"{', '.join(labels)}; or give a checkpoint's number"
    )


def _target_tree(
    record: BoothRecord, at: str | None
) -> tuple[ObjectId, ObjectId, RollbackPoint | None]:
    """(base tree, the tree a diff or commit of the booth goes to, the checkpoint it is if
    ``at``)."""
    from jukebox.booth.partial import partial_base

    # After a partial commit (jukebox.booth.partial) the real tree holds part of the booth: what
    # is still pending is counted from there.
    if at is None:
        _, final = _pending_trees(record)
        return partial_base(record.tape, record.base_tree), final, None
    # A checkpoint is on the tape whether or not the run ended: a crashed booth has them too.
    checkpoint = pending_checkpoint(record, at)
    return partial_base(record.tape, record.base_tree), checkpoint.tree, checkpoint


@contextlib.contextmanager
def pending_changes(
    tape_dir: TapeDir, booth_id: str, at: str | None = None
) -> Iterator[tuple[Any, ObjectId, ObjectId, list[Any]]]:
    """(store, base tree, target tree, the shadowfs.tree.Changes) of what a commit of the booth
    (of its checkpoint ``at``, if given) would make; the store stays open inside."""
    from shadowfs.tree import diff_trees

    record = load_record(tape_dir, booth_id)
    with _open_store(tape_dir) as store:
        bound_tape(tape_dir, booth_id, record, store)
        base, target, _ = _target_tree(record, at)
        yield store, base, target, diff_trees(store, base, target)


Verdict = Callable[[str, dict[str, "Any"], "ObjectId | None"], None]
"""verdict(kind, payload, tree): append a frame to the booth's tape, durably."""


def commit_tree(
    store: ObjectReader,
    tape_dir: TapeDir,
    record: BoothRecord,
    base: ObjectId,
    final: ObjectId,
    *,
    by: str | None,
    write: Verdict,
    checkpoint: RollbackPoint | None = None,
    lock_timeout: float | None = None,
    partial: list[str] | None = None,
) -> int:
    """Commit ``final`` into the booth's real tree (the very directory the booth ran over, see
    jukebox.trees.realtree), then write the verdict frame and retire the booth record, all under the
    commit job's lock so recovery never races it. Returns the number of changes. A ``partial``
    commit (of those paths, jukebox.booth.partial) writes a `partial_commit` note instead and
    keeps the booth pending.

    Raises ConflictError (nothing applied), CheckFailed (the tree is another directory now, or
    locked past the timeout) or realtree.Interrupted (exit 130: a signal came, and the commit
    was undone before its commit point or finished after it)."""
    from jukebox.trees import realtree
    from shadowfs.errors import CommitInterrupted, TargetBusy
    from shadowfs.steptimes import lap
    from shadowfs.tree import diff_trees

    timeout = realtree.lock_timeout(lock_timeout)
    changes = len(diff_trees(store, base, final))  # remembered: the commit diffs the same
    lap("diff count")
    target = realtree.open_recorded_tree(record.id, record.tree, record.tree_dev, record.tree_ino)
    try:
        if _read_only_fs(target):
            # Before any journal: a commit that cannot stage could not undo itself either.
            raise CheckFailed(
                f"commit of booth {record.id} not started: {record.tree} is on a read-only file "
                f"system; remount it read-write, then `jukebox booth commit {record.id}` (it "
                "stays pending)"
            )
        with (
            realtree.interrupt_guard() as interrupted,
            realtree.CommitJob(tape_dir, record.id) as job,
        ):
            if not _record_path(tape_dir, record.id).exists():
                _raise_if_finished(tape_dir, record.id)
                raise UsageError(f"booth {record.id} was committed meanwhile; nothing to do")
            cp = {"id": checkpoint.n, "label": checkpoint.label} if checkpoint else None
            job.begin({
                "tree": record.tree, "tree_dev": record.tree_dev, "tree_ino": record.tree_ino,
                "base": base.hex(), "final": final.hex(), "changes": changes, "by": by,
                "checkpoint": cp, "partial": partial,
            })
            stats = read_stats(tape_dir, record.tree)  # read once for before and after
            known = known_files(tape_dir, record.tree, base, stats)
            lap("intent, stats, known files")
            try:
                job.apply(store, target, base, final, timeout=timeout, interrupted=interrupted,
                          known=known)  # fmt: skip
            except CommitInterrupted:
                write("note", {"event": "commit_interrupted", "outcome": "undone", "by": by}, None)
                raise realtree.Interrupted(
                    f"interrupted: the commit of booth {record.id} stopped before its commit "
                    f"point and was undone; {record.tree} is unchanged and the booth stays pending"
                ) from None
            except TargetBusy as error:
                raise CheckFailed(
                    f"commit of booth {record.id} not started: {error} (--lock-timeout)"
                ) from None
            forget_committed(tape_dir, record.tree, store, base, final, stats)
            lap("forget committed stats")
            payload: dict[str, Any] = {"ok": True, "changes": changes}
            if by is not None:
                payload["by"] = by
                payload["peer"] = this_process()  # who, for a later "already committed"
            if cp is not None:
                payload["checkpoint"] = cp
            if partial is not None:
                from jukebox.booth.partial import partial_note

                write("note", partial_note(payload, partial, final), final)
            else:
                write("commit", payload, final)
                _finish(tape_dir, record.id)
            lap("verdict written")
            if interrupted():
                raise realtree.Interrupted(
                    f"interrupted past the commit point: the commit of booth {record.id} was "
                    f"finished, {record.tree} holds its {changes} change(s)"
                )
    finally:
        os.close(target)
    return changes


def _refuse_running(record: BoothRecord) -> None:
    if record.status == "running" and _alive(record.pid):
        raise UsageError(
            f"booth {record.id} is still running (pid {record.pid}); wait for it, or end its "
            f"agent with `jukebox booth stop {record.id}`"
        )


def _read_only_fs(path_or_fd: str | int) -> bool:
    stats = os.fstatvfs(path_or_fd) if isinstance(path_or_fd, int) else os.statvfs(path_or_fd)
    return bool(stats.f_flag & os.ST_RDONLY)


def commit_booth(
    tape_dir: TapeDir,
    booth_id: str,
    at: str | None = None,
    *,
    allow_hooks: bool = False,
    lock_timeout: float | None = None,
    only: Sequence[str] | None = None,
) -> int:
    """Applies a pending booth to its real tree (its final state, or its checkpoint ``at``: a
    number or a label), or ``only`` the changes at and under those paths
    (jukebox.booth.partial); raises CheckFailed listing every conflict, or the hook-like files
    it changes unless ``allow_hooks`` (jukebox.review.host_hooks). Returns how many paths
    changed (a count: the lines of a summary were 0.1-0.3 s of a 50,000-file commit)."""
    from shadowfs.commit import collector_paused
    from shadowfs.errors import ConflictError
    from shadowfs.steptimes import lap

    # The hook check, the summary and the commit diff the same trees: 50,000 changes are
    # millions of objects that Python's cyclic collector would walk again and again.
    with _locked(tape_dir, booth_id) as record, collector_paused():
        _refuse_running(record)
        with _open_store(tape_dir) as store:
            bound_tape(tape_dir, booth_id, record, store, sealed=True)  # before any write
            base, final, checkpoint = _target_tree(record, at)
            lap("store opened, tape bound, trees")
            partial = None
            if only:
                from jukebox.booth.partial import select, tree_paths

                paths = tree_paths(only, record.tree)
                final, whole = select(store, booth_id, base, final, paths)
                partial = None if whole else sorted(os.fsdecode(p) for p in paths)
            from jukebox.sql import ledger

            sql = ledger.read(tape_dir, booth_id)
            if sql is not None and (at is not None or only):
                raise CheckFailed(
                    f"booth {booth_id} not committed: its database work is one prepared "
                    "transaction, committed whole or not at all; commit without --at/--only, or "
                    f"`jukebox booth discard {booth_id}`"
                )
            refused = "" if allow_hooks else _host_hooks_refusal(store, base, final)
            lap("host-hook check")
            if refused:
                raise CheckFailed(
                    f"booth {booth_id} not committed: {refused}; review them "
                    f"(`jukebox booth diff {booth_id}`), then commit with --allow-hooks or "
                    f"`jukebox booth discard {booth_id}`"
                )

            def verdict(kind: str, payload: dict[str, Any], tree: ObjectId | None) -> None:
                if kind == "note" and tree is not None:  # a partial commit's tree: referenced
                    _append_to_tape(store, record.tape, kind, payload, refs=[tree])
                else:
                    _append_to_tape(store, record.tape, kind, payload, tree=tree)

            if sql is not None:
                ledger.set_state(tape_dir, booth_id, ledger.COMMITTING)
            try:
                changes = commit_tree(
                    store, tape_dir, record, base, final, by="booth commit", write=verdict,
                    checkpoint=checkpoint, lock_timeout=lock_timeout, partial=partial,
                )
                if record.mcp_staged and partial is None:
                    from jukebox.mcp import verdict as mcp_verdict

                    servers, calls = mcp_verdict.from_record(record)
                    mcp_verdict.commit_staged(
                        calls, servers, lambda k, p: verdict(k, p, None), record.tree, booth_id,
                        checkpoint.n if checkpoint is not None else None,
                    )
            except ConflictError as error:
                _append_to_tape(
                    store,
                    record.tape,
                    "note",
                    {"event": "commit_refused", "conflicts": error.conflicts, "by": "booth commit"},
                )
                if sql is not None:
                    ledger.set_state(tape_dir, booth_id, ledger.PREPARED)
                raise CheckFailed(
                    f"commit of booth {booth_id} refused: {len(error.conflicts)} path(s) changed "
                    f"in {record.tree} since the booth started: "
                    + ", ".join(error.conflicts)
                    + f"; it stays pending: `jukebox booth discard {booth_id}` drops it"
                ) from None
            if sql is not None:  # past the file commit point: the databases follow
                done = ledger.finish(tape_dir, booth_id, commit=True)
                _append_to_tape(store, record.tape, "note",
                                {"event": "sql_commit", "databases": done, "by": "booth commit"})
        if record.status == "running" and partial is None:  # crashed, committed at a checkpoint
            _remove_leftovers(tape_dir, booth_id)
        elif partial is None:  # the booth is done: its kept staged files go, off the clock
            retire_scratch(tape_dir, booth_id)
        lap("job retired, scratch retired")
        return changes


def discard_booth(tape_dir: TapeDir, booth_id: str) -> None:
    """Drops a pending booth. An interrupted commit of it is recovered first (finished or
    undone), never left half-applied with no booth left to finish it."""
    from jukebox.trees import realtree

    finished = CheckFailed(
        f"booth {booth_id} was not discarded: its interrupted commit was past its commit point "
        "and has been finished, so its real tree holds its changes"
    )
    if realtree.recovered(tape_dir, booth_id) == "finished":
        raise finished
    with _locked(tape_dir, booth_id) as record:
        _refuse_running(record)
        if realtree.recover_commits(tape_dir, only=booth_id, wait=True).get(booth_id) == "finished":
            raise finished
        if realtree.has_interrupted_commit(tape_dir, booth_id):
            raise CheckFailed(
                f"booth {booth_id} was not discarded: its interrupted commit could not be "
                f"recovered (see above), and dropping the booth would leave {record.tree} torn"
            )
        bound_tape(tape_dir, booth_id, record)  # the record names what discard touches
        from jukebox.sql import ledger

        ledger.finish(tape_dir, booth_id, commit=False)  # before the record goes: see ledger
        if os.path.exists(record.tape):
            with (
                _open_store(tape_dir) as store,
                contextlib.suppress(JukeboxError, OSError, ValueError),
            ):
                if record.mcp_staged:
                    from jukebox.mcp import verdict as mcp_verdict

                    mcp_verdict.drop(
                        mcp_verdict.from_record(record)[1],
                        lambda k, p: _append_to_tape(store, record.tape, k, p), "booth discard",
                    )
                _append_to_tape(
                    store, record.tape, "discard", {"by": "booth discard", "peer": this_process()}
                )
        _remove_leftovers(tape_dir, booth_id)
        _finish(tape_dir, booth_id)


def _remove_leftovers(tape_dir: TapeDir, booth_id: str) -> None:
    """A finished booth's scratch, and what a killed supervisor left of its mount points."""
    remove_scratch(tape_dir, booth_id)
    with contextlib.suppress(OSError):
        os.rmdir(layer_mountpoint(tape_dir, booth_id))  # a killed supervisor's
    # A killed supervisor leaves its control socket's (empty) mount point in /tmp.
    isolation.remove_stale_socket_dirs(socket_dir_prefix(tape_dir.path, booth_id))


# --------------------------------------------------------------------------- the supervisor


def new_booth_id() -> str:
    # os.urandom, as secrets.token_hex: `secrets` (hmac, hashlib, random) is ~20 M
    # instructions of a booth's start for three random bytes.
    return time.strftime("%Y%m%d-%H%M%S") + "-" + os.urandom(3).hex()


def host_facts() -> dict[str, Any]:
    uname = os.uname()
    return {
        "kernel": uname.release,
        "machine": uname.machine,
        "hostname": socket.gethostname(),
        "uid": os.getuid(),
        "gid": os.getgid(),
        "pid": os.getpid(),
        "python": sys.version.split()[0],  # platform.python_version(), without platform
    }


def path_reaching_jukebox(path: str) -> str:
    """The agent's PATH, with the directory of this installation's `jukebox` appended when no
    `jukebox` is on it: agents checkpoint with `jukebox booth checkpoint`, and a jukebox started
    from a virtualenv without activating it is not on PATH. Appended, so the agent's own
    python and tools still come first."""
    searched = path or os.defpath  # what exec searches when PATH is unset
    if _on_path("jukebox", searched):
        return path
    ours = Path(sys.executable).parent / "jukebox"
    if not os.access(ours, os.X_OK):
        return path
    return f"{searched}{os.pathsep}{ours.parent}"


def _on_path(name: str, path: str) -> bool:
    """Whether shutil.which(name, path=path) finds it, without importing shutil (with bz2 and
    lzma) at every start for this one call."""
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return True
    return False


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


class RollbackPoint(Record):
    """A checkpoint a booth took, as what a rollback or a partial commit goes back to: its
    number (0 is the start), label, tree, and the seq of its `checkpoint` frame on the tape.
    Not the Python API's `jukebox.Checkpoint`, which holds the agent's memory too."""

    FIELDS = ("n", "label", "tree", "frame")
    n: int
    label: str | None
    tree: ObjectId
    frame: int | None

    def __init__(self, n: int, label: str | None, tree: ObjectId, frame: int | None) -> None:
        self.n = n
        self.label = label
        self.tree = tree
        self.frame = frame


def find_checkpoint(checkpoints: Sequence[RollbackPoint], to: str | int) -> RollbackPoint | None:
    """The checkpoint numbered ``to``, or the latest labelled ``to``; None if there is none."""
    if isinstance(to, int):
        return next((cp for cp in checkpoints if cp.n == to), None)
    return next((cp for cp in reversed(checkpoints) if cp.label == to), None)


class _Run(Record):
    """The live state the control handlers and the wait loop share."""

    FIELDS = (
        "booth_id", "tree", "writer", "layer", "started", "checkpoints", "lock", "rollbacks",
        "output", "spawn", "agent_pid", "trip", "mcp", "databases", "secrets",
    )  # fmt: skip
    booth_id: str
    tree: str
    writer: Any
    layer: BoothLayer
    started: float
    checkpoints: list[RollbackPoint]
    lock: threading.Lock
    rollbacks: int
    output: OutputTail  # what the agent printed, its end
    # How the agent is started: through the LLM proxy's session, which under --net none spawns
    # it inside the private network the proxy listens in.
    spawn: Callable[..., isolation.Child]  # (spec, stdin=, stdout=, stderr=)
    agent_pid: int | None
    trip: Any  # the circuit breaker's Trip, once one fired
    mcp: Any  # the MCP stage gate (jukebox.mcp.staging.StageGate)
    # The --pg databases (jukebox.sql.booth_link.BoothDatabases): checkpoints and rollbacks
    # take them along, before the files (their refusal leaves the files as they were).
    databases: Any
    # The booth's one scrubber (jukebox.redact.Scrubber): the operator's secret values and the
    # path secrets of the booth's proxies. Whatever the agent chose that reaches a frame (a
    # label, the verifier's output, an MCP call's arguments, through the gate) passes it.
    secrets: Any

    def __init__(
        self,
        booth_id: str,
        tree: str,
        writer: Any,
        layer: BoothLayer,
        started: float,
        checkpoints: list[RollbackPoint] | None = None,
        lock: threading.Lock | None = None,
        rollbacks: int = 0,
        output: OutputTail | None = None,
        spawn: Callable[..., isolation.Child] = isolation.spawn,
        agent_pid: int | None = None,
        trip: Any = None,
        mcp: Any = None,
        databases: Any = None,
        secrets: Any = None,
    ) -> None:
        if secrets is None:
            from jukebox.redact import Scrubber

            secrets = Scrubber()
        self.booth_id = booth_id
        self.tree = tree
        self.writer = writer
        self.layer = layer
        self.started = started
        self.checkpoints = [] if checkpoints is None else checkpoints
        self.lock = threading.Lock() if lock is None else lock
        self.rollbacks = rollbacks
        self.output = OutputTail() if output is None else output
        self.spawn = spawn
        self.agent_pid = agent_pid
        self.trip = trip
        self.mcp = mcp
        self.databases = databases
        self.secrets = secrets

    def scrubbed(self, text: str | None) -> str | None:
        """Text the agent chose (a checkpoint's label, the verifier's output), as a frame may
        show it: the booth's known secrets replaced, its proxies' path secrets among them (the
        agent's environment holds its base URLs, secret included)."""
        return None if text is None else str(self.secrets.text(text))

    def on_refused_write(self, error: OSError) -> None:
        """The layer refused a write the agent's kernel had already accepted: the agent learns
        at fsync or close at best, and its view of that file is no longer what the booth holds.
        Stopped like a breaker trip, once (on a thread of its own: this runs on a mount
        worker)."""
        if self.trip is not None:
            return
        from jukebox.display.render import size
        from jukebox.guard.breaker import Trip
        from shadowfs.layer import ScratchLimitReached

        # only the FUSE layer refuses writes (watch_refused_writes), and it has scratch_usage
        staged, limit = self.layer.scratch_usage()  # type: ignore[attr-defined]
        if isinstance(error, ScratchLimitReached) and limit is not None:
            trip = Trip(
                "scratch", limit, staged,
                f"a write would take the booth's staged files past {size(limit)} "
                f"(--max-scratch); {size(staged)} staged",
            )
        else:
            trip = Trip(
                "scratch", limit or 0, staged,
                f"the disk holding the booth's scratch refused a write ({error.strerror}); "
                f"{size(staged)} staged",
            )
        self.trip = trip
        threading.Thread(target=self.on_trip, args=(trip,), daemon=True).start()

    def on_trip(self, trip: Any) -> None:
        """A limit tripped: record it and stop the agent at once."""
        self.record_trip(trip)
        self.stop_agent(trip)

    def record_trip(self, trip: Any) -> None:
        """The breaker fired (called from the proxy's thread, before the agent is answered)."""
        self.trip = trip
        self.writer.append("breaker", trip.to_payload())

    def stop_agent(self, trip: Any) -> None:
        """SIGTERM, then SIGKILL after BREAKER_GRACE_S (the proxy calls this once the agent
        has been sent the refusal that explains the trip)."""
        if self.agent_pid is not None:
            _terminate(self.agent_pid, BREAKER_GRACE_S)

    def checkpoint(
        self, label: str | None, peer: Peer | None, reason: str = "request"
    ) -> RollbackPoint:
        with self.lock:
            n = len(self.checkpoints)
            if self.databases is not None:
                self.databases.checkpoint(n)
            tree, journal = self.layer.snapshot()
            return self._taken(n, label, tree, journal, peer, reason)

    def checkpoint_answering(self, peer: Peer, reply: Callable[[dict[str, Any]], None]) -> bool:
        """An unlabelled checkpoint the agent asked for, answered (``reply``, the control
        socket's) as soon as its tree and frame are known: the layer's bookkeeping after that
        (the journal let go, the store's flush scheduled) runs while the answer travels, still
        under the locks, so no request or write comes between. After a fold that is all a
        checkpoint is (`Layer.snapshot`). False, with nothing done, where the booth has no
        such layer or has databases to checkpoint first: the plain handler serves it."""
        snapshot = getattr(self.layer, "snapshot_answering", None)
        if snapshot is None:
            return False
        with self.lock:
            if self.databases is not None:
                return False
            n = len(self.checkpoints)

            def taken(tree: ObjectId, journal: ObjectId | None) -> None:
                cp = self._taken(n, None, tree, journal, peer, "request")
                reply({"checkpoint": n, "label": None, "tree": tree.hex(), "frame": cp.frame})

            snapshot(taken)
        return True

    def quick_gate(self) -> tuple[int, int, int, tuple[Any, ...]] | None:
        """For the control socket's compiled path (`control.FastCheckpoint`): None where the
        plain quick handler must serve (no such layer: the overlay backend, a layer in a child
        process; --pg databases are checked by the compiled path under the run's lock)."""
        gate = getattr(self.layer, "quick_gate", None)
        got = gate() if gate is not None else None
        if got is None or not isinstance(self.writer, GroupTape):
            return None
        fd, waiting, connection, layer_lock, layer = got
        return fd, waiting, connection, (self.lock, self, layer_lock, layer, self.writer)

    def fast_taken(self, n: int, seq: int, tree: bytes) -> None:
        """The compiled path answered checkpoint ``n`` (frame ``seq``, already queued) from the
        fold's tree, holding the run's lock and the layer lock: what `checkpoint_answering`
        does after its answer."""
        self.checkpoints.append(RollbackPoint(n, None, ObjectId(tree), seq))
        # it answered, so the layer gave it a gate: a _FuseBoothLayer
        self.layer.took_fold()  # type: ignore[attr-defined]
        self.writer.schedule()

    def _taken(
        self,
        n: int,
        label: str | None,
        tree: ObjectId,
        journal: ObjectId | None,
        peer: Peer | None,
        reason: str,
    ) -> RollbackPoint:
        """Checkpoint ``n``, whose snapshot is (tree, journal), recorded (under the lock)."""
        # The label as the agent gave it stays the one `rollback --to` finds.
        payload: dict[str, Any] = {"id": n, "label": self.scrubbed(label), "reason": reason}
        if journal is not None:
            payload["journal"] = journal.hex()
        if peer is not None:
            payload["peer"] = peer.as_dict()
        # Acknowledged now; the frame reaches the tape once its objects are durable.
        seq = self.writer.append(
            "checkpoint",
            payload,
            refs=[journal] if journal is not None else (),
            tree=tree,
            defer=True,
        )
        cp = RollbackPoint(n, label, tree, seq)
        self.checkpoints.append(cp)
        return cp

    def find(self, to: str | int) -> RollbackPoint:
        found = find_checkpoint(self.checkpoints, to)
        if found is not None:
            return found
        if isinstance(to, int):
            raise RequestError(
                f"no checkpoint {to}: this booth has 0..{len(self.checkpoints) - 1} "
                "(0 is the start)"
            )
        known = sorted({c.label for c in self.checkpoints if c.label})
        raise RequestError(f"no checkpoint labelled {to!r}: known labels are {known or 'none'}")

    def rollback(self, to: str | int, peer: Peer | None) -> RollbackPoint:
        with self.lock:
            cp = self.find(to)
            if self.databases is not None:
                self.databases.rollback(cp.n)
            self.layer.restore(cp.tree)
            payload: dict[str, Any] = {
                "to": cp.n, "label": self.scrubbed(cp.label), "reason": "request"
            }
            if peer is not None:
                payload["peer"] = peer.as_dict()
            self.writer.append("rollback", payload, tree=cp.tree, defer=True)
            self.rollbacks += 1
            if self.mcp is not None:
                self.mcp.drop_after(cp.n, f"rollback to checkpoint {cp.n}")
            return cp

    def handlers(self) -> dict[str, Callable[[dict[str, Any], Peer], dict[str, Any]]]:
        def checkpoint(req: dict[str, Any], peer: Peer) -> dict[str, Any]:
            cp = self.checkpoint(req.get("label"), peer)
            return {"checkpoint": cp.n, "label": cp.label, "tree": cp.tree.hex(), "frame": cp.frame}

        def rollback(req: dict[str, Any], peer: Peer) -> dict[str, Any]:
            cp = self.rollback(req["to"], peer)
            return {"checkpoint": cp.n, "label": cp.label, "tree": cp.tree.hex()}

        def status(req: dict[str, Any], peer: Peer) -> dict[str, Any]:
            usage = getattr(self.layer, "scratch_usage", None)
            staged, limit = usage() if usage is not None else (None, None)
            return {
                "booth": self.booth_id,
                "staged_bytes": staged,
                "scratch_limit": limit,
                "tree": self.tree,
                "tape": os.fspath(self.writer.path),
                "frames": self.writer.count,
                "uptime_s": round(time.monotonic() - self.started, 3),
                "rollbacks": self.rollbacks,
                # Checkpoints the control socket's compiled path answered (`control._quickline`).
                "compiled_answers": quickline_answers(),
                "checkpoints": [
                    {"n": c.n, "label": c.label, "tree": c.tree.hex(), "frame": c.frame}
                    for c in self.checkpoints
                ],
            }

        def mcp_record(req: dict[str, Any], peer: Peer) -> dict[str, Any]:
            return self.mcp.handle_record(req)

        def mcp_stage(req: dict[str, Any], peer: Peer) -> dict[str, Any]:
            with self.lock:  # not between a checkpoint's snapshot and its number
                return self.mcp.handle_stage(req, len(self.checkpoints) - 1)

        return {"checkpoint": checkpoint, "rollback": rollback, "status": status,
                "mcp_record": mcp_record, "mcp_stage": mcp_stage,
                "mcp_ask": lambda req, peer: self.mcp.handle_ask(req),
                "mcp_ask_status": lambda req, peer: self.mcp.handle_ask_status(req),
                "mcp_replay": lambda req, peer: self.mcp.handle_replay(req),
                "mcp_blob": lambda req, peer: self.mcp.handle_blob(req)}  # fmt: skip


def _start_http_gateways(run: _Run, servers: Mapping[str, Any], llm_session: Any,
                         env: Mapping[str, str], img: Image,
                         policy: Any = None) -> Any:  # fmt: skip
    """The supervisor's gateway to the streamable-HTTP MCP servers (jukebox.mcp.http_gateway),
    listening where the agent can connect (inside its network namespace under --net none)."""
    import socket as socket_mod

    from jukebox.mcp.http_gateway import HttpGateways
    from jukebox.mcp.policy import Policy
    from jukebox.mcp.record import scrub

    network = llm_session.network
    if network is not None:
        listener = network.listen()
    else:
        listener = socket_mod.socket(socket_mod.AF_INET, socket_mod.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
    # One scrubber with the stage gate's: a frame the gate records (a staged call run by the
    # commit, a stdio wrapper's) loses the same secrets as the gateway's own, the gateway's path
    # secret (added by HttpGateways) among them: an agent may pass its URL as an argument.
    scrubber = run.secrets
    scrubber.add(v for k, v in env.items() if img.is_secret(k))
    for spec in servers.values():
        scrubber.add(spec.secrets())

    def stage(server: str, tool: str, args: dict[str, Any]) -> str:
        with run.lock:  # not between a checkpoint's snapshot and its number
            return str(run.mcp.stage_declared(server, tool, args, len(run.checkpoints) - 1)["id"])

    gateways = HttpGateways({n: s.url for n, s in servers.items()}, run.mcp,
                            policy or Policy("staged_acid"), stage, lambda p: scrub(p, scrubber),
                            replay=run.mcp.replay, scrubber=scrubber,
                            headers={n: s.headers for n, s in servers.items()})  # fmt: skip
    return gateways.start(listener)


def _terminate(pid: int, grace: float) -> None:
    """SIGTERM now and SIGKILL if it still runs after `grace` seconds, through a pidfd so that
    a pid the supervisor has reaped and the kernel recycled is never hit."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    except ProcessLookupError:
        os.close(pidfd)
        return

    def kill_after_grace() -> None:
        try:
            # A pidfd turns readable when its process exits.
            exited, _, _ = select.select([pidfd], [], [], grace)
            if not exited:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)

    threading.Thread(target=kill_after_grace, name="breaker-stop", daemon=True).start()


def _exit_code(status: int) -> tuple[int | None, int | None]:
    """(exit status, terminating signal) from a wait status."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status), None


def _reap_stragglers() -> int:
    """Kills what the agent left running (we are its subreaper), so nothing writes after the
    final snapshot and nothing holds the mount."""
    try:
        # Mostly there is none (the agent's PID namespace died with its init): then no scan of
        # every process on the machine in /proc.
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return 0
    killed = 0
    for _ in range(50):
        kids = procs.children_of(os.getpid())
        if not kids:
            break
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        for pid in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    return killed


def _read_capped(fd: int, limit: int) -> tuple[str, bool]:
    """All of a pipe, keeping the head and the tail when it exceeds `limit` bytes."""
    head = b""
    tail = bytearray()
    total = 0
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        total += len(chunk)
        if len(head) < limit // 2:
            take = limit // 2 - len(head)
            head += chunk[:take]
            chunk = chunk[take:]
        tail += chunk
        if len(tail) > limit // 2:
            del tail[: len(tail) - limit // 2]
    truncated = total > len(head) + len(tail)
    text = head.decode(errors="replace")
    if truncated:
        text += f"\n[... {total - len(head) - len(tail)} bytes left out ...]\n"
    return text + bytes(tail).decode(errors="replace"), truncated


def _live_export(booth_id: str, writer: GroupTape) -> Any:
    """With OTEL_EXPORTER_OTLP_ENDPOINT set, the tape's frames also go to that collector as
    they are written (docs/otel.md#live-export); the SDK is imported only then."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    from jukebox.export.otel_live import from_environment

    live = from_environment(booth_id, _alert)
    if live is not None:
        writer.writer.listener = live.observe
    return live


def _alert(message: str) -> None:
    from jukebox.display.names import printable

    # Alerts quote paths the agent named (conflicts, hook-like files): shown, never acted on.
    sys.stderr.write(f"jukebox: {printable(message)}\n")
    sys.stderr.flush()


def _host_hooks_refusal(store: ObjectReader, base: ObjectId, final: ObjectId) -> str:
    """Why the booth is not committed without --allow-hooks ("" when nothing is flagged)."""
    if base == final:
        return ""
    from jukebox.review.host_hooks import host_hook_changes, refusal

    flagged = host_hook_changes(store, base, final)
    return refusal(flagged) if flagged else ""


def _warn_host_hooks(store: ObjectReader, base: ObjectId, final: ObjectId) -> None:
    """`--commit ask` shows the hook-like files first, highlighted on a terminal."""
    from jukebox.review.host_hooks import host_hook_changes, warning_block

    flagged = host_hook_changes(store, base, final)
    if flagged:
        from jukebox.display.style import wanted_on

        sys.stderr.write(warning_block(flagged, highlight=wanted_on(sys.stderr)))


def _ask(summary: list[str], booth_id: str) -> str:
    """'commit', 'discard' or 'keep', asked on the terminal."""
    shown = summary[:50]
    sys.stderr.write(f"booth {booth_id}: {len(summary)} change(s)\n")
    for line in shown:
        sys.stderr.write(f"  {line}\n")
    if len(summary) > len(shown):
        sys.stderr.write(
            f"  ... and {len(summary) - len(shown)} more (`jukebox booth diff {booth_id}`)\n"
        )
    try:
        # An unbuffered byte stream: a text-mode "r+" open of a tty fails (it is not seekable).
        tty = open("/dev/tty", "r+b", buffering=0)  # noqa: SIM115
    except OSError:
        return "keep"
    with tty:
        # Only what the operator types from now on answers: nothing queued during the run
        # (keys meant for the agent, a terminal's replies to what the agent printed).
        with contextlib.suppress(termios.error):
            termios.tcflush(tty.fileno(), termios.TCIFLUSH)
        while True:
            tty.write(
                b"commit these changes to the real tree? [y]es / [N]o, discard / [k]eep pending: "
            )
            typed = tty.readline()
            if not typed:  # the terminal went away: keep the work rather than guess
                return "keep"
            answer = typed.decode(errors="replace").strip().lower()
            if answer in ("y", "yes"):
                return "commit"
            if answer in ("", "n", "no"):
                return "discard"
            if answer in ("k", "keep"):
                return "keep"


def _redacted_command(
    argv: list[str], verify: str | None, img: Image
) -> tuple[list[str], str | None]:
    """The command line and verifier as a tape may show them: keys on a command line (an
    option's value, `NAME=value`, key-shaped values, the supervisor's secret environment
    values) are replaced by the marker (jukebox.redact)."""
    from jukebox.redact import Scrubber, redact_argv, redact_text

    known = Scrubber(value for name, value in os.environ.items() if img.is_secret(name))
    return redact_argv(argv, known), redact_text(verify, known) if verify else verify


def run_booth(
    argv: Sequence[str],
    tree: str | os.PathLike[str] = ".",
    tape_dir: str | os.PathLike[str] | None = None,
    tape_id: str | None = None,
    name: str | None = None,
    fs: str = "fuse",
    image: str | Image | None = None,
    commit_mode: str = "auto",
    verify_cmd: str | None = None,
    net: str | None = None,
    checkpoint_every: float | None = None,
    *,
    max_scratch: int | None = None,
    layer_factory: LayerFactory | None = None,
    llm: LlmOptions | None = None,
    breaker: Any = None,
    allow_hooks: bool = False,
    seccomp: bool = True,
    strict_sandbox: bool = False,
    paths: BoothPaths | None = None,
    mcp_config: str | None = None,
    databases: Mapping[str, str] | None = None,
    max_sql_rows_changed: int | None = None,
    mcp_limits: Any = None,
    mcp_replay: Any = None,
    mcp_upstreams: Mapping[str, str] | None = None,
    mcp_policy: Any = None,
    record_sql_results: bool = False,
    sql_replay: Any = None,
    max_sql_lock_seconds: float | None = None,
    preforked: isolation.PreforkedShim | None = None,
    set_up: Callable[[], None] | None = None,
) -> int:
    """Runs `argv` in a booth over `tree`; returns the exit status for the caller to exit with.

    `preforked`: the agent's shim, forked `join_later` by the caller before it imported this
    module (jukebox.cli.fast); run_booth uses it, or ends it when the agent starts otherwise
    (`--net none`). The caller still closes it if run_booth raised before taking it.
    `set_up`: called once the booth is set up, before its agent starts (jukebox.cli.fast turns
    the interpreter's cyclic garbage collector back on there).

    `mcp_config`: a `.mcp.json` whose stdio servers are the ones staged MCP calls may run
    against at the commit; the agent finds it rewritten through the gateway in
    `$JUKEBOX_MCP_CONFIG` (docs/mcp.md). `mcp_limits`: the breaker's tool call rules
    (jukebox.mcp.limits.ToolCallLimits). `mcp_replay`: in a replay or fork, the recorded MCP
    answers the gateways inside are served (jukebox.mcp.booth_replay.ToolReplay).
    `mcp_upstreams`: {name: URL} of streamable-HTTP MCP servers, served to the agent through the
    supervisor's gateway (jukebox.mcp.http_gateway), declared like `mcp_config`'s.
    `mcp_policy`: a jukebox.mcp.policy.Policy for every MCP server's calls (None: the tools'
    annotations decide, under staged_acid).

    `databases`: {name: postgresql:// URL} (--pg), each behind a SQL savepoint proxy whose
    transaction ends with the verdict (jukebox.sql); `record_sql_results` keeps what each
    statement answered on its frame. `sql_replay`: a jukebox.sql.replay.SqlRecording served to
    the agent instead of databases (replay --exec).

    `paths`: what this run adds to the image's view (--rw, --ro, --hide, --no-private-tmp).

    `seccomp=False` runs without the system call filter; `strict_sandbox` refuses to start
    (UsageError) when a protection cannot be applied here (see jukebox.booth.protections).

    CMD's own status, except: 1 when CMD exited 0 but `--commit auto` did not commit (the
    verifier failed, the commit conflicted, or it changes hook-like files and not
    ``allow_hooks``: see jukebox.review.host_hooks); 125-127 when the sandbox could not start CMD.

    In four steps: the options are checked (`_BoothOptions`: nothing is created until they are
    known good, so a refused run leaves no tape dir), the booth is set up (`_set_up`, every
    resource on one ExitStack that closes them in reverse, whatever happens), the agent runs
    (`_run_agent`), and the verdict is decided (`decide_verdict`) and carried out (`_conclude`).
    """
    argv = list(argv)
    _check_command(argv, commit_mode, fs, checkpoint_every)
    if breaker is not None:
        # A jukebox.guard.breaker.CircuitBreaker (the --max-* flags): the LLM proxy admits and
        # observes every model call through it and calls `_Run.on_trip` when it trips.
        from jukebox.llm.session import LlmOptions

        llm = (llm or LlmOptions()).replace(breaker=breaker)
    tree_path, tapes = _checked_tree(tree, tape_dir)
    # An Image object is one a replay or fork already chose (never one named by a tape).
    img: Image = image if isinstance(image, Image) else load_image(image)
    paths = paths or BoothPaths()
    if paths.private_tmp is not None:
        img = img.replace(private_tmp=paths.private_tmp)
    from jukebox.trees import realtree

    paths.check(tree_path, str(tapes.path), str(realtree.commit_key_dir()))
    _check_writable(tree_path, commit_mode)
    net = net or img.net
    if net not in ("host", "none"):
        raise UsageError(f"bad --net {net!r}: use host or none")
    scratch_limit = _checked_scratch_limit(
        max_scratch if max_scratch is not None else img.scratch_limit, fs
    )
    view = isolation.view_policy(img, net, scratch_limit)
    mcp_declared, mcp_servers, mcp_http = _mcp_servers(mcp_config, mcp_upstreams)
    _checked_databases(
        databases, commit_mode, max_sql_rows_changed, max_sql_lock_seconds, record_sql_results
    )
    booth_id = check_tape_id(tape_id) if tape_id else new_booth_id()
    tape_path = tapes.tape_path(booth_id)
    if tape_path.exists():
        raise UsageError(
            f"a tape {booth_id!r} already exists in {tapes.path}: pick another --tape-id"
        )
    cwd = os.getcwd()
    agent_cwd = cwd if _is_under(os.path.realpath(cwd), tree_path) else tree_path
    options = _BoothOptions(
        argv=argv,
        tree_path=tree_path,
        tapes=tapes,
        booth_id=booth_id,
        tape_path=tape_path,
        agent_cwd=os.path.realpath(agent_cwd),
        name=name,
        fs=fs,
        img=img,
        commit_mode=commit_mode,
        verify=verify_cmd if verify_cmd is not None else img.verify,
        net=net,
        checkpoint_every=checkpoint_every,
        scratch_limit=scratch_limit,
        view=view,
        paths=paths,
        layer_factory=layer_factory or default_layer_factory,
        llm=llm,
        allow_hooks=allow_hooks,
        seccomp=seccomp,
        strict_sandbox=strict_sandbox,
        mcp_declared=mcp_declared,
        mcp_servers=mcp_servers,
        mcp_http=mcp_http,
        mcp_limits=mcp_limits,
        mcp_replay=mcp_replay,
        mcp_policy=mcp_policy,
        databases=databases,
        max_sql_rows_changed=max_sql_rows_changed,
        record_sql_results=record_sql_results,
        sql_replay=sql_replay,
        max_sql_lock_seconds=max_sql_lock_seconds,
    )
    with contextlib.ExitStack() as stack:
        booth = _set_up(stack, options, preforked)
        if set_up is not None:
            set_up()
        return _conclude(booth, _run_agent(booth))


class _BoothOptions(Value):
    """run_booth's arguments, checked, with what they resolve to (the image, the paths, the
    booth's id, the MCP servers declared)."""

    FIELDS = (
        "argv", "tree_path", "tapes", "booth_id", "tape_path", "agent_cwd", "name", "fs", "img",
        "commit_mode", "verify", "net", "checkpoint_every", "scratch_limit", "view", "paths",
        "layer_factory", "llm", "allow_hooks", "seccomp", "strict_sandbox", "mcp_declared",
        "mcp_servers", "mcp_http", "mcp_limits", "mcp_replay", "mcp_policy", "databases",
        "max_sql_rows_changed", "record_sql_results", "sql_replay", "max_sql_lock_seconds",
    )  # fmt: skip
    argv: list[str]
    tree_path: str
    tapes: TapeDir
    booth_id: str
    tape_path: Path
    agent_cwd: str
    name: str | None
    fs: str
    img: Image
    commit_mode: str
    verify: str | None
    net: str
    checkpoint_every: float | None
    scratch_limit: int | None
    view: dict[str, Any]
    paths: BoothPaths
    layer_factory: LayerFactory
    llm: LlmOptions | None
    allow_hooks: bool
    seccomp: bool
    strict_sandbox: bool
    mcp_declared: dict[str, Any] | None
    mcp_servers: dict[str, Any]
    mcp_http: dict[str, Any]
    mcp_limits: Any
    mcp_replay: Any
    mcp_policy: Any
    databases: Mapping[str, str] | None
    max_sql_rows_changed: int | None
    record_sql_results: bool
    sql_replay: Any
    max_sql_lock_seconds: float | None

    def __init__(
        self,
        argv: list[str],
        tree_path: str,
        tapes: TapeDir,
        booth_id: str,
        tape_path: Path,
        agent_cwd: str,
        name: str | None,
        fs: str,
        img: Image,
        commit_mode: str,
        verify: str | None,
        net: str,
        checkpoint_every: float | None,
        scratch_limit: int | None,
        view: dict[str, Any],
        paths: BoothPaths,
        layer_factory: LayerFactory,
        llm: LlmOptions | None,
        allow_hooks: bool,
        seccomp: bool,
        strict_sandbox: bool,
        mcp_declared: dict[str, Any] | None,
        mcp_servers: dict[str, Any],
        mcp_http: dict[str, Any],
        mcp_limits: Any,
        mcp_replay: Any,
        mcp_policy: Any,
        databases: Mapping[str, str] | None,
        max_sql_rows_changed: int | None,
        record_sql_results: bool,
        sql_replay: Any,
        max_sql_lock_seconds: float | None,
    ) -> None:
        setfield(self, "argv", argv)
        setfield(self, "tree_path", tree_path)
        setfield(self, "tapes", tapes)
        setfield(self, "booth_id", booth_id)
        setfield(self, "tape_path", tape_path)
        setfield(self, "agent_cwd", agent_cwd)
        setfield(self, "name", name)
        setfield(self, "fs", fs)
        setfield(self, "img", img)
        setfield(self, "commit_mode", commit_mode)
        setfield(self, "verify", verify)
        setfield(self, "net", net)
        setfield(self, "checkpoint_every", checkpoint_every)
        setfield(self, "scratch_limit", scratch_limit)
        setfield(self, "view", view)
        setfield(self, "paths", paths)
        setfield(self, "layer_factory", layer_factory)
        setfield(self, "llm", llm)
        setfield(self, "allow_hooks", allow_hooks)
        setfield(self, "seccomp", seccomp)
        setfield(self, "strict_sandbox", strict_sandbox)
        setfield(self, "mcp_declared", mcp_declared)
        setfield(self, "mcp_servers", mcp_servers)
        setfield(self, "mcp_http", mcp_http)
        setfield(self, "mcp_limits", mcp_limits)
        setfield(self, "mcp_replay", mcp_replay)
        setfield(self, "mcp_policy", mcp_policy)
        setfield(self, "databases", databases)
        setfield(self, "max_sql_rows_changed", max_sql_rows_changed)
        setfield(self, "record_sql_results", record_sql_results)
        setfield(self, "sql_replay", sql_replay)
        setfield(self, "max_sql_lock_seconds", max_sql_lock_seconds)


def _check_command(
    argv: list[str], commit_mode: str, fs: str, checkpoint_every: float | None
) -> None:
    if not argv:
        raise UsageError("no command to run: write `jukebox booth run [OPTIONS] -- CMD ...`")
    if isolation.inside_booth():
        # An agent has no privilege left to build namespaces (and seccomp refuses unshare).
        raise UsageError(
            "a booth cannot run inside a booth (nesting is not supported): run the command "
            "directly here, or start its booth from outside"
        )
    if commit_mode not in COMMIT_MODES and commit_mode != DISCARD:
        raise UsageError(f"bad --commit {commit_mode!r}: use one of {', '.join(COMMIT_MODES)}")
    if fs not in FS_KINDS:
        raise UsageError(f"bad --fs {fs!r}: use one of {', '.join(FS_KINDS)}")
    if checkpoint_every is not None and checkpoint_every <= 0:
        raise UsageError("--checkpoint-every must be a positive number of seconds")


def _checked_tree(
    tree: str | os.PathLike[str], tape_dir: str | os.PathLike[str] | None
) -> tuple[str, TapeDir]:
    """The tree's real path and the tape dir (not made yet), which must not overlap."""
    tree_path = os.path.realpath(tree)
    if not os.path.isdir(tree_path):
        raise UsageError(f"the tree {tree} is not a directory: pass --tree DIR")
    if tree_path == "/":
        raise UsageError(
            "the tree cannot be / itself: pass --tree with the agent's working directory"
        )
    tapes = TapeDir(Path(os.path.realpath(TapeDir.resolve(tape_dir).path)))
    if _is_under(str(tapes.path), tree_path) or _is_under(tree_path, str(tapes.path)):
        raise UsageError(
            f"the tape dir {tapes.path} and the tree {tree_path} overlap: the booth would record "
            "its own tapes; point --tape-dir (or JUKEBOX_TAPE_DIR) outside the tree"
        )
    return tree_path, tapes


def _check_writable(tree_path: str, commit_mode: str) -> None:
    if not _read_only_fs(tree_path):
        return
    why = f"the tree {tree_path} is on a read-only file system: no commit can write there"
    if commit_mode in ("auto", "ask"):
        raise UsageError(
            f"{why}; remount it read-write, or run with --commit never to keep the "
            "agent's changes pending for review (`jukebox booth diff`)"
        )
    _alert(f"{why}; the booth will stay pending for review")


def _checked_scratch_limit(scratch_limit: int | None, fs: str) -> int | None:
    if scratch_limit is not None:
        if scratch_limit <= 0:
            raise UsageError("--max-scratch must be a positive size, like 512M or 20G")
        if fs == "overlay":
            raise UsageError(
                "a scratch limit (--max-scratch, or the image's limits.scratch) needs --fs fuse: "
                "kernel overlayfs writes its upper directory itself; drop the limit or use fuse"
            )
    return scratch_limit


def _mcp_servers(
    mcp_config: str | None, mcp_upstreams: Mapping[str, str] | None
) -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any]]:
    """The `.mcp.json` as declared, every MCP server the booth serves, and the HTTP ones."""
    from jukebox.mcp.servers import http_servers, read_config, stdio_servers

    declared = read_config(mcp_config) if mcp_config else None
    servers = stdio_servers(declared, mcp_config or "") if declared else {}
    served_http = http_servers(declared, dict(mcp_upstreams or {}), mcp_config or "")
    servers.update(served_http)
    return declared, servers, served_http


def _checked_databases(
    databases: Mapping[str, str] | None,
    commit_mode: str,
    max_rows_changed: int | None,
    max_lock_seconds: float | None,
    record_results: bool,
) -> None:
    """The --pg options checked, and each database reached (see BoothDatabases.probe)."""
    if max_rows_changed is not None and max_rows_changed < 0:
        raise UsageError("--max-sql-rows-changed must be 0 or more")
    if max_lock_seconds is not None and max_lock_seconds <= 0:
        raise UsageError("--max-sql-lock-seconds must be more than 0")
    if record_results and not databases:
        raise UsageError("--record-sql-results keeps what --pg databases answer: add --pg "
                         "NAME=URL, or drop it")
    if not databases:
        return
    from jukebox.sql.booth_link import BoothDatabases

    # Only a scratch booth (time travel) can do without prepared transactions: it commits
    # nothing and keeps nothing.
    BoothDatabases.probe(databases, needs_two_phase=commit_mode != DISCARD)


class _Booth(Record):
    """A booth set up: what the run and the verdict use. The resources are on `_set_up`'s
    ExitStack; `services` and `databases_open` are stacks of their own, closed earlier on the
    normal path (the proxies when the agent is gone, the databases with their verdict), and
    `layer_open` is emptied once the layer was discarded on the normal path."""

    FIELDS = (
        "options", "store", "writer", "record", "base_tree", "recorded_verify", "layer",
        "layer_open", "run", "services", "databases_open", "spec", "verifier_env", "state_fd",
    )  # fmt: skip
    options: _BoothOptions
    store: ObjectStore
    writer: GroupTape
    record: BoothRecord
    base_tree: ObjectId
    recorded_verify: str | None
    layer: BoothLayer
    layer_open: contextlib.ExitStack
    run: _Run
    services: contextlib.ExitStack
    databases_open: contextlib.ExitStack
    spec: isolation.ChildSpec
    verifier_env: dict[str, str]  # the agent's, without its stopped proxies (_verifier_env)
    state_fd: int  # the tape dir's state dir as the host sees it (scratchdir.keep_scratch)

    def __init__(
        self,
        options: _BoothOptions,
        store: Any,
        writer: GroupTape,
        record: BoothRecord,
        base_tree: ObjectId,
        recorded_verify: str | None,
        layer: BoothLayer,
        layer_open: contextlib.ExitStack,
        run: _Run,
        services: contextlib.ExitStack,
        databases_open: contextlib.ExitStack,
        spec: isolation.ChildSpec,
        verifier_env: dict[str, str],
        state_fd: int,
    ) -> None:
        self.options = options
        self.store = store
        self.writer = writer
        self.record = record
        self.base_tree = base_tree
        self.recorded_verify = recorded_verify
        self.layer = layer
        self.layer_open = layer_open
        self.run = run
        self.services = services
        self.databases_open = databases_open
        self.spec = spec
        self.verifier_env = verifier_env
        self.state_fd = state_fd


class _Outcome(Record):
    """What the agent's run came to, once it is over: its `exit` payload, whether it was
    interrupted, the verifier's result (None when none ran), the final tree."""

    FIELDS = ("status", "code", "interrupted", "verified", "final_tree")
    status: dict[str, Any]
    code: int  # the agent's exit status, 128 + N for signal N
    interrupted: bool
    verified: dict[str, Any] | None
    final_tree: ObjectId

    def __init__(
        self,
        status: dict[str, Any],
        code: int,
        interrupted: bool,
        verified: dict[str, Any] | None,
        final_tree: ObjectId,
    ) -> None:
        self.status = status
        self.code = code
        self.interrupted = interrupted
        self.verified = verified
        self.final_tree = final_tree


def _set_up(
    stack: contextlib.ExitStack, o: _BoothOptions, early: isolation.PreforkedShim | None = None
) -> _Booth:
    """Makes the booth, up to a ChildSpec ready to start; everything made is on `stack`.
    `early`: the agent's shim, forked before the supervisor's imports (run_booth)."""
    from jukebox.llm.defaults import DEFAULT_RECORD_LIMIT
    from jukebox.trees.realtree import open_tree

    tapes, booth_id = o.tapes, o.booth_id
    # Blocked before any thread exists, restored last: see _supervise's sigtimedwait.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WAITED_SIGNALS)
    stack.callback(signal.pthread_sigmask, signal.SIG_SETMASK, old_mask)
    # A tape dir this run made goes again when no tape was started in it.
    unused_tape_dir = stack.enter_context(contextlib.ExitStack())
    made_tape_dir = make_tape_dir(tapes.path)
    if made_tape_dir is not None:
        unused_tape_dir.callback(remove_unused_tape_dir, made_tape_dir, tapes)
    store = _open_store(tapes)
    stack.callback(store.close)
    # Before anything is written: strict mode refuses with nothing half-made.
    protections, cgroup = booth_protections(o.img, booth_id, seccomp=o.seccomp)
    stack.callback(cgroup.remove)  # the agent's processes are all gone by then (its PID ns)
    if o.strict_sandbox and protections.unavailable():
        raise UsageError(strict_refusal(protections))
    missing = protections.missing_line()
    if missing:
        _alert(missing)
    filtered = protections.is_on("seccomp")
    seccomp_bpf = _compiled_filter(o.img.seccomp_allow) if filtered else None
    if early is not None:
        stack.callback(early.close)  # ends and reaps it when the agent never started
        if o.net == "none":  # the agent starts inside the proxy's network: not through it
            early.close()
            early = None
        else:  # it joins the cgroups meanwhile, as the shim forked below does at once
            early.prepare(cgroup.procs_files, preload_seccomp=filtered and seccomp_bpf is None)
    from jukebox.mcp.servers import HEADER_ENV_PREFIX

    # A replay's or fork's MCP headers (jukebox.mcp.servers.header_env_name) are the
    # operator's credentials, for the supervisor's HTTP gateway: never the agent's.
    env = {k: v for k, v in o.img.filter_env(os.environ).items()
           if not k.startswith(HEADER_ENV_PREFIX)}  # fmt: skip
    # The tree's identity, from before its base tree is read: a commit goes into this very
    # directory or nowhere (see jukebox.trees.realtree).
    tree_fd, tree_dev, tree_ino = open_tree(o.tree_path)
    stack.callback(os.close, tree_fd)
    recorded_argv, recorded_verify = _redacted_command(o.argv, o.verify, o.img)
    base_tree = build_base_tree(store, tapes, o.tree_path, exclude=_stop_when_interrupted())
    writer, live = stack.enter_context(_opened_tape(o, store))
    unused_tape_dir.pop_all()
    writer.append(
        "run_start",
        {
            "tape_id": booth_id,
            "booth": booth_id,
            "name": o.name,
            "argv": recorded_argv,
            **({"argv_redacted": True} if recorded_argv != o.argv else {}),
            "cwd": o.agent_cwd,
            "tree": o.tree_path,
            "tree_dev": tree_dev,
            "tree_ino": tree_ino,
            "base_tree": base_tree.hex(),
            "image": o.img.name,
            # The image whole, hashed: replays compare with it and never resolve its name.
            "sandbox_image": image_record(o.img),
            "policy": {
                **o.img.policy(),
                "net": o.net,
                "verify": recorded_verify,
                "commit": o.commit_mode,
                "fs": o.fs,
                "checkpoint_every": o.checkpoint_every,
                "scratch_limit": o.scratch_limit,
                "llm_record_limit": o.scratch_limit or DEFAULT_RECORD_LIMIT,
                "view": o.view,
                "breaker": getattr(o.llm.breaker, "limits", None) if o.llm is not None else None,
                "protections": protections.policy(),
                "paths": o.paths.policy(),
                "mcp_servers": {n: s.describe() for n, s in o.mcp_servers.items()},
                "mcp_limits": o.mcp_limits.limits() if o.mcp_limits is not None else None,
                "mcp_policy": o.mcp_policy.describe() if o.mcp_policy is not None else None,
            },
            "host": host_facts(),
            "env": o.img.describe_env(env),
        },
        tree=base_tree,
    )
    record = BoothRecord(
        id=booth_id,
        name=o.name,
        tree=o.tree_path,
        base_tree=base_tree.hex(),
        tape=str(o.tape_path),
        created=time.time(),
        status="running",
        pid=os.getpid(),
        tree_dev=tree_dev,
        tree_ino=tree_ino,
    )
    save_record(tapes, record)

    # Opened on the host's mounts: a pending booth's scratch leaves the namespace's nosuid bind
    # of scratch/ for kept/ through it at the end (scratchdir.keep_scratch).
    state_fd = os.open(tapes.state, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    stack.callback(os.close, state_fd)
    # From here on this process lives in the booth's mount namespace.
    userns = isolation.enter_private_namespace()
    with contextlib.suppress(OSError):
        isolation.prctl(isolation.PR_SET_CHILD_SUBREAPER, 1)
    preforked = early
    if preforked is None and o.net != "none":  # under --net none: in the proxy's network
        # Forked while no thread runs yet: the agent's start then needs no new interpreter.
        preforked = isolation.PreforkedShim.fork(
            cgroup.procs_files, preload_seccomp=filtered and seccomp_bpf is None
        )
        stack.callback(preforked.close)  # ends and reaps it when the agent never started
    scratch = booth_scratch(tapes, booth_id)
    # Never over the tree's path here: see isolation.ChildSpec.mount_at.
    layer_dir = str(layer_mountpoint(tapes, booth_id, make=True))
    stack.callback(isolation.remove_private_dir, layer_dir)
    layer = o.layer_factory(
        LayerContext(
            o.fs, o.tree_path, tree_fd, store, scratch, base_tree, userns, o.scratch_limit,
            mountpoint=layer_dir,
        )
    )
    layer_open = stack.enter_context(contextlib.ExitStack())
    layer_open.callback(_quietly, layer.discard)
    layer_open.callback(_quietly, layer.unmount)
    layer.mount()
    writer.start()
    if live is not None:
        live.start()  # its threads, like the flusher's, only once in the namespaces
    run = _Run(booth_id, o.tree_path, writer, layer, time.monotonic())
    watch = getattr(layer, "watch_refused_writes", None)
    if watch is not None:
        watch(run.on_refused_write)
    run.checkpoints.append(RollbackPoint(0, "start", base_tree, 0))
    _stage_mcp_calls(o, run, record)
    sock_dir = isolation.private_socket_dir(socket_dir_prefix(tapes.path, booth_id))
    stack.callback(isolation.remove_private_dir, sock_dir)
    services = stack.enter_context(contextlib.ExitStack())
    databases_open = stack.enter_context(contextlib.ExitStack())
    sock_path = os.path.join(sock_dir, "control.sock")
    before_proxies = dict(env)
    llm_session = _start_services(o, run, env, services, databases_open, preforked, sock_path)
    env.update({SOCKET_ENV: sock_path, BOOTH_ID_ENV: booth_id, TAPE_ID_ENV: booth_id})
    _start_mcp_gateways(o, run, env, services, sock_dir, llm_session)
    spec = _child_spec(o, env, layer_dir, sock_dir, protections, cgroup, seccomp_bpf)
    verifier_env = _verifier_env(
        env, before_proxies, [*llm_session.proxy.base_urls(), MCP_URL_ENV]
    )
    return _Booth(o, store, writer, record, base_tree, recorded_verify, layer, layer_open, run,
                  services, databases_open, spec, verifier_env, state_fd)  # fmt: skip


def _verifier_env(
    env: Mapping[str, str], before: Mapping[str, str], proxied: Iterable[str]
) -> dict[str, str]:
    """The verifier's environment: the agent's `env`, except the variables `proxied` that
    pointed the agent at the booth's LLM proxy and MCP gateway, which have stopped by the time
    the verifier runs (their URLs would reach nothing, and carry the proxies' path secrets).
    Each gets back the value it had `before` the booth set it (the operator's own
    OPENAI_BASE_URL, say), or goes: a verifier that calls a model calls it as it would outside
    the booth, unrecorded, and under --net none has no network at all. The booth's control
    socket goes too: a verifier judges the run, it does not checkpoint or roll it back."""
    out = dict(env)
    for name in proxied:
        if name in before:
            out[name] = before[name]
        else:
            out.pop(name, None)
    out.pop(SOCKET_ENV, None)
    return out


def _quietly(close: Callable[[], None]) -> None:
    """For clean-ups on an error path: the first error is the news, not what it left behind."""
    with contextlib.suppress(Exception):
        close()


@contextlib.contextmanager
def _opened_tape(o: _BoothOptions, store: ObjectStore) -> Iterator[tuple[GroupTape, Any]]:
    """The booth's tape, and its live export (jukebox.export.otel_live.LiveExport, with
    OTEL_EXPORTER_OTLP_ENDPOINT set), closed in that order."""
    from jukebox.tape.tape import TapeWriter

    writer = GroupTape(TapeWriter.create(o.tape_path, store, o.booth_id, fsync=False), store)
    live = None
    try:
        live = _live_export(o.booth_id, writer)
        yield writer, live
    finally:
        # The normal path synced already; on an error path the first error is the news.
        _quietly(writer.close)
        if live is not None:
            live.close()  # bounded (otel_live.CLOSE_TIMEOUT), never raises


def _stage_mcp_calls(o: _BoothOptions, run: _Run, record: BoothRecord) -> None:
    """The gate the agent's MCP calls pass: staged for the verdict, asked about, replayed."""
    from jukebox.mcp.staging import StageGate

    writer = run.writer
    from jukebox.mcp.record import scrub

    # The calls a commit runs carry the arguments as the agent sent them (secrets too): their
    # frames, and every other the gate records, lose the operator's secret values first.
    # The declared servers' own secrets too (an HTTP server's URL password and headers).
    secrets = run.secrets
    secrets.add(v for k, v in o.img.filter_env(os.environ).items() if o.img.is_secret(k))
    for spec in o.mcp_servers.values():
        secrets.add(spec.secrets())
    run.mcp = StageGate(o.mcp_servers,
                        lambda kind, payload: writer.append(kind, scrub(payload, secrets)),
                        o.mcp_limits, run.on_trip)  # fmt: skip
    run.mcp.secrets = secrets
    run.mcp.policy = o.mcp_policy
    if o.mcp_replay is not None:
        o.mcp_replay.record = writer.append
        run.mcp.replay = o.mcp_replay

    # The modules of staged calls and approvals are imported when the agent stages a call or
    # asks about one, not at every booth's start.
    def keep_staged(calls: list[Any]) -> None:
        from jukebox.mcp import verdict as mcp_verdict

        # A staged call names the newest checkpoint, which may still wait for its group commit:
        # the tape holds it before the record names it, or a crash here would leave a pending
        # booth whose `commit --at` cannot find the checkpoint its calls were staged under.
        writer.sync()
        mcp_verdict.keep(record, o.mcp_servers, calls)
        save_record(o.tapes, record)

    def answer_of(ask_id: str) -> str | None:
        from jukebox.mcp.approvals import read_answer

        return read_answer(o.tapes, o.booth_id, ask_id)

    run.mcp.on_change = keep_staged
    run.mcp.answer_of = answer_of
    run.mcp.tell = lambda ask_id, what: _alert(
        f"booth {o.booth_id}: the agent asks to call {what}: `jukebox booth approve "
        f"{o.booth_id} {ask_id}` (or --deny; --tape-dir {o.tapes.path})"
    )


def _start_services(
    o: _BoothOptions,
    run: _Run,
    env: dict[str, str],
    services: contextlib.ExitStack,
    databases_open: contextlib.ExitStack,
    preforked: isolation.PreforkedShim | None,
    sock_path: str,
) -> Any:
    """The control socket, the LLM proxy and the --pg databases' proxies, on their stacks;
    the agent's environment learns how to reach them. Returns the LLM proxy's session."""
    from jukebox.llm.session import LlmSession

    server = ControlServer(
        sock_path, run.handlers(), quick={CHECKPOINT_LINE: run.checkpoint_answering}, fast=run
    ).start()
    services.callback(server.close)
    writer = run.writer
    llm_session = LlmSession.start(
        record=writer.append,
        environ=os.environ,
        secrets=[value for key, value in env.items() if o.img.is_secret(key)],
        tape_dir=o.tapes.path,
        private_network=o.net == "none",
        options=o.llm,
        on_trip=run.record_trip,
        stop_agent=run.stop_agent,
        record_limit=o.scratch_limit,
        scrubber=run.secrets,  # the proxy's secret joins it below, before the agent starts
    )
    services.callback(llm_session.close)
    if preforked is not None and llm_session.network is None:
        run.spawn = preforked.spawn
    else:
        run.spawn = lambda child_spec, **stdio: llm_session.spawn(
            functools.partial(isolation.spawn, **stdio), child_spec
        )
    env.update(llm_session.agent_env(env))
    # The proxy's secret is in the base URLs the agent gets: what the agent passes on elsewhere
    # (an MCP tool's arguments, an SQL statement, a checkpoint's label, the verifier's output)
    # loses it too, as its model calls do.
    run.secrets.add([llm_session.proxy.secret])
    network = llm_session.network
    listen = network.listen if network is not None else None
    # The LLM proxy's session adds to the environment: its secrets are hidden from SQL too.
    secret_values = [value for key, value in env.items() if o.img.is_secret(key)]
    secret_values.append(llm_session.proxy.secret)
    if o.databases:
        from jukebox.sql.booth_link import BoothDatabases

        run.databases = BoothDatabases.start(
            o.databases,
            record=writer.append,
            booth_id=o.booth_id,
            secrets=secret_values,
            listen=listen,
            max_rows_changed=o.max_sql_rows_changed,
            on_trip=run.on_trip,
            record_results=o.record_sql_results,
            max_lock_seconds=o.max_sql_lock_seconds,
        )
    elif o.sql_replay is not None:
        run.databases = o.sql_replay.start(
            record=writer.append, secrets=secret_values, listen=listen
        )
    if run.databases is not None:
        # An unfinished transaction is rolled back by its server.
        databases_open.callback(run.databases.close)
        env.pop("PGPASSWORD", None)  # the proxy trusts the agent; the server's is not its
        env.update(run.databases.agent_env())
    return llm_session


def _start_mcp_gateways(
    o: _BoothOptions,
    run: _Run,
    env: dict[str, str],
    services: contextlib.ExitStack,
    sock_dir: str,
    llm_session: Any,
) -> None:
    """The HTTP MCP servers' gateway, and the agent's `.mcp.json` rewritten through it."""
    http_urls: dict[str, str] = {}
    if o.mcp_http:
        http_gateways = _start_http_gateways(run, o.mcp_http, llm_session, env, o.img,
                                             o.mcp_policy)  # fmt: skip
        services.callback(http_gateways.stop)
        http_urls = http_gateways.urls()
        env[MCP_URL_ENV] = http_gateways.base_url()
        # An agent that pastes that URL into a prompt: its secret is the model calls' too.
        llm_session.add_secrets([http_gateways.secret])
    if o.mcp_declared is not None or o.mcp_http:
        from jukebox.mcp.servers import write_wrapped_config

        env["JUKEBOX_MCP_CONFIG"] = write_wrapped_config(
            o.mcp_declared or {"mcpServers": {}}, sock_dir, http_urls, o.mcp_policy
        )
    if o.mcp_replay is not None:
        from jukebox.mcp.record import REPLAY_ENV

        env[REPLAY_ENV] = "1"


def _child_spec(
    o: _BoothOptions,
    env: dict[str, str],
    layer_dir: str,
    sock_dir: str,
    protections: Protections,
    cgroup: BoothCgroup,
    seccomp_bpf: str | None,
) -> isolation.ChildSpec:
    """How the agent is started: its view of the host, its limits, its environment."""
    from jukebox.trees import realtree

    env["PATH"] = path_reaching_jukebox(env.get("PATH", ""))
    img = o.img
    hide = [
        *img.hidden_paths(),
        *o.paths.hide,
        str(o.tapes.path),
        str(realtree.commit_key_dir()),
        *o.view["hidden_socket_dirs"],
    ]
    writable = [o.tree_path, *o.paths.rw]  # the tree first: the verifier's cwd
    filtered = protections.is_on("seccomp")
    return isolation.ChildSpec(
        argv=o.argv,
        cwd=o.agent_cwd,
        env=env,
        keep=writable,
        mount_at={o.tree_path: layer_dir},
        keep_readonly=[sock_dir],
        keep_tools=[*isolation.hidden_tools(hide, img.private_tmp, writable), *o.paths.ro],
        hide=hide,
        readonly_root=img.readonly_host,
        private_tmp=img.private_tmp,
        limits=_rlimits(img, protections),
        net=o.net,
        seccomp=list(img.seccomp_allow) if filtered else None,
        seccomp_bpf=seccomp_bpf,
        cgroup_procs=cgroup.procs_files,
        cgroup_mounts=cgroup.mounts,
        tmp_size=o.view["tmp_size"],
        shm_size=o.view["shm_size"],
    )


def _run_agent(b: _Booth) -> _Outcome:
    """Runs the agent and its verifier; records the final tree (`fs`), `exit` and `verify`."""
    from jukebox.trees import realtree

    o, writer, record = b.options, b.writer, b.record
    status, interrupted = _supervise(b.spec, b.run, o.checkpoint_every)
    b.services.close()
    _reap_stragglers()

    final_tree, journal = b.layer.snapshot()
    fs_payload: dict[str, Any] = {"reason": "exit"}
    if journal is not None:
        fs_payload["journal"] = journal.hex()
    writer.append(
        "fs", fs_payload, refs=[journal] if journal is not None else (), tree=final_tree
    )
    writer.append("exit", status)
    _report_view_denials(b.run, b.spec, status,
                         (str(o.tapes.path), str(realtree.commit_key_dir())))  # fmt: skip
    verified: dict[str, Any] | None = None
    if o.verify and not interrupted:
        if status["code"] == 0 and not status.get("setup_error"):
            verified = _run_verifier(b.spec.replace(env=b.verifier_env), o.verify)
            # What it prints may show the supervisor's secret values (its environment is the
            # agent's, mostly) and the proxies' path secrets (the agent may leave its base URLs
            # in the tree). Scrubbed for the tape and for the booth's own stderr, which shows
            # a failing verifier's output.
            verified["output"] = b.run.scrubbed(verified["output"])
            interrupted = bool(verified.get("interrupted"))
        else:
            verified = {"cmd": o.verify, "skipped": "the agent failed", "ok": False}
        writer.append("verify", {**verified, "cmd": b.recorded_verify})
    if o.paths.rw:  # nothing of the booth runs any more
        _strip_rw_set_id(writer, o.paths.rw, record.created)
    b.layer.unmount()

    exit_status, exit_signal = status["code"], status["signal"]
    code = exit_status if exit_status is not None else 128 + (exit_signal or 0)
    record.final_tree = final_tree.hex()
    record.agent_status = code
    record.verify = {k: v for k, v in (verified or {}).items() if k != "output"} or None
    if status.get("setup_error"):
        _alert(status["setup_error"])
    return _Outcome(status, code, interrupted, verified, final_tree)


class BoothVerdict(Value):
    """What becomes of a booth's work (`decide_verdict`): `decision` is "commit", "discard",
    "keep" (pending), or "ask" (`--commit ask` and the tree changed: the operator decides);
    `reason`, when there is one, is told to the operator and recorded."""

    FIELDS = ("decision", "reason")
    decision: str
    reason: str

    def __init__(self, decision: str, reason: str = "") -> None:
        setfield(self, "decision", decision)
        setfield(self, "reason", reason)


def decide_verdict(
    commit_mode: str,
    status: Mapping[str, Any],
    verified: Mapping[str, Any] | None,
    *,
    interrupted: bool,
    tripped: str | None,
    changed: bool,
) -> BoothVerdict:
    """The verdict a finished run's facts call for, before the checks that read the store (host
    hooks) or ask the databases. `status` is the `exit` frame's payload, `verified` the `verify`
    frame's (None when no verifier ran), `tripped` the circuit breaker's rule when it tripped,
    `changed` whether the final tree differs from the base tree.

    A trip wins over everything (kept under `never`, else discarded), then a scratch booth's
    discard, an interruption (kept), `never` (kept) and `ask`; `auto` commits when the agent
    exited 0 and the verifier, if any, passed, and otherwise discards, saying why."""
    if tripped is not None:
        decision = "keep" if commit_mode == "never" else "discard"
        return BoothVerdict(decision, f"the circuit breaker tripped ({tripped})")
    if commit_mode == DISCARD:
        return BoothVerdict("discard")
    if interrupted:
        return BoothVerdict("keep", "interrupted")
    if commit_mode == "never":
        return BoothVerdict("keep")
    if commit_mode == "ask":
        return BoothVerdict("ask" if changed else "commit")
    agent_ok = status.get("code") == 0 and not status.get("setup_error")
    if agent_ok and (verified is None or verified.get("ok")):
        return BoothVerdict("commit")
    if agent_ok and verified:
        return BoothVerdict("discard", f"the verifier failed (exit {verified.get('exit')})")
    return BoothVerdict(
        "discard", status.get("setup_error") or f"the agent exited with {_describe(status)}"
    )


def _conclude(b: _Booth, out: _Outcome) -> int:
    """Carries out the verdict: the host-hook check, the databases' part, the commit, and the
    discard or the pending booth; returns run_booth's exit status."""
    o, run, store, record = b.options, b.run, b.store, b.record
    base_tree, final_tree = b.base_tree, out.final_tree
    code = out.code
    verdict = decide_verdict(
        o.commit_mode, out.status, out.verified, interrupted=out.interrupted,
        tripped=run.trip.rule if run.trip is not None else None, changed=final_tree != base_tree,
    )  # fmt: skip
    decision, reason = verdict.decision, verdict.reason
    if decision == "ask":
        _warn_host_hooks(store, base_tree, final_tree)
        decision = _ask(change_summary(store, base_tree, final_tree), o.booth_id)

    hooks_refused = ""
    if decision == "commit" and o.commit_mode == "auto" and not o.allow_hooks:
        hooks_refused = _host_hooks_refusal(store, base_tree, final_tree)
        if hooks_refused:
            decision, reason, code = "keep", hooks_refused, 1

    dbs = run.databases
    if dbs is not None:
        decision, reason, code = _databases_before(dbs, o.tapes, o.booth_id, decision, reason,
                                                   code)  # fmt: skip
    # Everything recorded so far is on disk before the real tree changes, a database's
    # transaction ends, an MCP call runs or a booth is kept pending. A verdict that does none of
    # that (no change to commit, a discard) is synced with the frames before it, by one
    # fdatasync, before its booth's record goes (_verdict_landed): a crash before that sync
    # leaves the record of a booth that did not finish, and only a suffix of its tape unsynced.
    if not _verdict_alone(decision, final_tree == base_tree, dbs, run.mcp.staged):
        b.writer.sync()
    if decision == "commit":
        decision, code = _commit_run(store, o.tapes, b.writer, record, base_tree, final_tree,
                                     code)  # fmt: skip
        if decision == "done" and run.mcp.staged:
            from jukebox.mcp.verdict import commit_staged

            def durably(kind: str, payload: dict[str, Any]) -> None:
                # Each frame on disk before the next call starts: a supervisor killed midway
                # leaves a tape that says which calls ran (jukebox.mcp.staging.run_staged).
                run.mcp.record(kind, payload)
                b.writer.sync()

            if commit_staged(run.mcp.staged, o.mcp_servers, durably, o.tree_path,
                             o.booth_id) and code == 0:  # fmt: skip
                code = 1
    if dbs is not None:
        b.databases_open.pop_all()  # _databases_after closes them, whatever happens
        _databases_after(dbs, o.tapes, b.writer, o.booth_id, decision)
    if decision == "discard":
        code = _discarded(b, out, reason, code)
    elif decision == "keep":
        code = _kept(b, out, reason, code, hooks_refused=bool(hooks_refused))
    b.writer.sync()
    # A pending booth's staged files stay until its commit or discard: freed now, they would be
    # the free inodes that ext4 without a journal scans past at each file the commit creates
    # in their groups, for a minute (docs/booth.md, "A pending booth's scratch").
    b.layer.discard(keep_files=decision == "keep")
    b.layer_open.pop_all()
    if decision == "keep":
        keep_scratch(o.tapes, o.booth_id, b.state_fd)
    return code


def _verdict_alone(decision: str, unchanged: bool, dbs: Any, staged: Any) -> bool:
    """Whether the verdict touches nothing outside the tape and the booth's own files: a discard,
    or a commit with nothing to commit, with no database transaction to end and no staged MCP
    call to run. Such a verdict needs no sync of the frames before it of its own: the one after
    its frame covers them too (`_verdict_landed`)."""
    if dbs is not None or staged:
        return False
    return decision == "discard" or (decision == "commit" and unchanged)


def _verdict_landed(writer: Any, tape_dir: TapeDir, booth_id: str) -> None:
    """The verdict's frame, and every frame before it, on disk; only then the booth's record
    goes: a crash before the sync leaves a record of a booth that did not finish, never a tape
    without its verdict and no record to say so."""
    writer.sync()
    _finish(tape_dir, booth_id)


def _discarded(b: _Booth, out: _Outcome, reason: str, code: int) -> int:
    o = b.options
    b.run.mcp.drop_all(reason or "discard")
    if o.commit_mode == DISCARD and not reason:
        b.writer.append("discard", {"by": "scratch booth", "residue": 0}, tree=b.base_tree)
    else:
        b.writer.append(
            "rollback",
            {"reason": reason or "rejected", "to": 0, "final": True, "residue": 0},
            tree=b.base_tree,
        )
    if reason:
        _alert(
            f"booth {o.booth_id} rolled back: {reason}; the real tree {o.tree_path} was not "
            f"touched (tape {o.tape_path})"
        )
        verified = out.verified
        if verified and not verified.get("ok") and verified.get("output"):
            sys.stderr.write(verified["output"][-4000:])
        if o.commit_mode == "auto" and code == 0:
            code = 1
    _verdict_landed(b.writer, o.tapes, o.booth_id)
    return code


def _kept(b: _Booth, out: _Outcome, reason: str, code: int, *, hooks_refused: bool) -> int:
    from jukebox.mcp import verdict as mcp_verdict

    o, record, booth_id = b.options, b.record, b.options.booth_id
    record.status = "pending" if record.status == "running" else record.status
    record.pid = None
    record.note = reason or None
    mcp_verdict.keep(record, o.mcp_servers, b.run.mcp.staged)
    save_record(o.tapes, record)
    _alert(
        f"booth {booth_id} kept pending{f' ({reason})' if reason else ''}: "
        f"`jukebox booth diff {booth_id}`, then `jukebox booth commit {booth_id}"
        f"{' --allow-hooks' if hooks_refused else ''}` or "
        f"`jukebox booth discard {booth_id}` (with --tape-dir {o.tapes.path})"
    )
    if out.interrupted and code == 0:
        code = 130
    return code


def _compiled_filter(allow: Sequence[str]) -> str | None:
    """The booth's seccomp filter compiled, from this user's cache (hidden from every booth,
    like the commit key beside it); None (no usable cache) leaves the compiling to CMD's
    process, as before there was a cache, and the reporting of what fails there too."""
    from jukebox.booth import syscall_filter
    from jukebox.trees import realtree

    try:
        program = syscall_filter.cached(allow, realtree.commit_key_dir() / "seccomp")
    except (OSError, ImportError, ValueError, syscall_filter.FilterError):
        return None
    return program.hex() if program is not None else None


def _stop_when_interrupted() -> Callable[[bytes], bool]:
    """An `exclude` for reading the base tree that leaves nothing out but stops the read at a
    pending interrupt: SIGINT/TERM/HUP are blocked by then (for sigtimedwait later), and reading
    a big tree (/usr: minutes) must not leave Ctrl-C unanswered. Nothing is recorded yet."""
    interrupts = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    seen = 0

    def check(_path: bytes) -> bool:
        nonlocal seen
        seen += 1
        if seen % 256 == 0 and interrupts & signal.sigpending():
            signal.sigtimedwait(interrupts, 0)  # taken: it is answered here
            raise KeyboardInterrupt
        return False

    return check


def _rlimits(img: Image, protections: Protections) -> dict[str, int]:
    limits = dict(img.limits)
    if protections.is_on("memory_cgroup"):
        # The cgroup counts memory really used; RLIMIT_AS counts address space, which runtimes
        # reserve by the gigabyte (Go, the JVM, V8) and would fail on for nothing.
        limits.pop("memory_bytes", None)
    return limits


def _describe(status: Mapping[str, Any]) -> str:
    if status.get("signal"):
        return f"signal {status['signal']} ({signal.Signals(status['signal']).name})"
    return f"status {status.get('code')}"


def _databases_before(
    dbs: Any, tapes: TapeDir, booth_id: str, decision: str, reason: str, code: int
) -> tuple[str, str, int]:
    """The databases' part of the verdict before the files': a commit or a kept booth prepares
    its transactions (two-phase commit); a discard rolls them back. A prepare the server
    refuses (a deferred constraint, a serialization failure) turns a commit into a discard."""
    from jukebox.sql import ledger

    if decision == "discard":
        with contextlib.suppress(Exception):
            dbs.end("ROLLBACK")
        return decision, reason, code
    try:
        dbs.prepare(tapes, booth_id, ledger.COMMITTING if decision == "commit" else
                    ledger.PREPARED)
    except Exception as error:
        with contextlib.suppress(Exception):
            dbs.end("ROLLBACK")
        ledger.remove(tapes, booth_id)
        if decision == "commit":
            return "discard", f"the database refused to commit ({error})", code or 1
        _alert(f"booth {booth_id}: its database work could not be kept pending ({error}); "
               "it was rolled back")
    return decision, reason, code


def _databases_after(
    dbs: Any, tapes: TapeDir, writer: Any, booth_id: str, decision: str
) -> None:
    """After the file commit point: COMMIT PREPARED; a kept booth's prepared transactions
    wait for `booth commit` or `booth discard` (jukebox.sql.ledger). No ledger: nothing was
    prepared, as the agent never connected (or a replay's stand-in served it)."""
    from jukebox.sql import ledger

    prepared = ledger.read(tapes, booth_id) is not None
    try:
        if decision == "done":
            if prepared:
                done = ledger.finish(tapes, booth_id, commit=True)
            else:
                dbs.end("COMMIT")
                done = list(dbs.urls)
            writer.append("note", {"event": "sql_commit", "databases": done})
        elif decision == "keep" and prepared:
            ledger.set_state(tapes, booth_id, ledger.PREPARED)
            writer.append("note", {"event": "sql_prepared", "databases": list(dbs.urls)})
    except Exception as error:
        _alert(str(error))
    finally:
        dbs.close()


def _commit_run(
    store: ObjectReader,
    tapes: TapeDir,
    writer: Any,
    record: BoothRecord,
    base: ObjectId,
    final: ObjectId,
    code: int,
) -> tuple[str, int]:
    if final == base:
        writer.append("commit", {"ok": True, "changes": 0}, tree=final)
        _verdict_landed(writer, tapes, record.id)
        note(f"no changes to commit: {record.tree} is as it was (tape {record.tape})")
        return "done", code
    # Imported only when there is something to commit: with its threads' and staging's
    # modules (concurrent.futures, logging, subprocess, secrets) it is about 10 ms of CPU, a
    # tenth of a `booth run -- true`.
    from shadowfs.commit import collector_paused
    from shadowfs.errors import ConflictError

    # A kill during the commit leaves a booth recovery can hand back, pending, when it undoes it.
    save_record(tapes, record)

    def verdict(kind: str, payload: dict[str, Any], tree: ObjectId | None) -> None:
        writer.append(kind, payload, tree=tree)
        writer.sync()

    try:
        with collector_paused():  # see commit_booth
            changes = commit_tree(store, tapes, record, base, final, by=None, write=verdict)
    except ConflictError as error:
        writer.append("note", {"event": "commit_refused", "conflicts": error.conflicts})
        record.status = "conflict"
        _alert(
            f"commit of booth {record.id} refused: the real tree changed under it at "
            + ", ".join(error.conflicts[:10])
        )
        return "keep", 1
    except CheckFailed as error:
        writer.append("note", {"event": "commit_refused", "reason": str(error)})
        _alert(str(error))
        return "keep", 1
    plural = "" if changes == 1 else "s"
    note(f"committed {changes} change{plural} to {record.tree} (tape {record.tape})")
    return "done", code


def _supervise(
    spec: isolation.ChildSpec, run: _Run, checkpoint_every: float | None
) -> tuple[dict[str, Any], bool]:
    """Starts CMD and waits for it, relaying signals; returns (exit payload, interrupted).

    CMD never shares the caller's terminal or process group: a terminal signal reaches it only
    through the supervisor, which passes the first interrupt on and kills CMD at the second,
    whether it arrived as a signal or as a key typed into the relayed pty."""
    started = time.monotonic()
    with relayed(AgentTerminal.for_caller()) as term, _output_tail(term, run.output) as stdio:
        spec.terminal = term is not None
        child = run.spawn(spec, **stdio)
        run.agent_pid = child.pid
        lock = threading.Lock()
        interrupts = 0

        def on_interrupt(forward: Callable[[], None]) -> None:
            nonlocal interrupts
            with lock:  # the pty's relay thread calls this too
                interrupts += 1
                if interrupts > 1:
                    if child.proc.returncode is None:  # not reaped: the pid is still ours
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(child.pid, signal.SIGKILL)
                    return
            forward()
            (term.notice if term is not None else _alert)(
                "interrupt: passed to the agent; interrupt again to kill it"
            )

        if term is not None:
            term.start(on_interrupt=lambda: on_interrupt(lambda: None))  # the pty sent it
            if run.mcp is not None:  # an MCP call to ask about: asked on this terminal too
                run.mcp.ask_terminal = term.ask
        ok = child.wait_started()
        run.writer.append("note", {"event": "agent_started", "pid": child.pid, "ok": ok})
        next_auto = time.monotonic() + checkpoint_every if checkpoint_every else None
        while True:
            with lock:
                pid, wstatus, usage = os.wait4(child.pid, os.WNOHANG)
                if pid:  # reaped here, not by Popen
                    child.proc.returncode = os.waitstatus_to_exitcode(wstatus)
                    break
            timeout = max(0.0, next_auto - time.monotonic()) if next_auto is not None else 3600.0
            info = signal.sigtimedwait(WAITED_SIGNALS, min(timeout, CHILD_POLL_SECONDS))
            if info is None:
                if next_auto is not None and time.monotonic() >= next_auto:
                    with contextlib.suppress(Exception):
                        run.checkpoint("auto", None, reason="timer")
                    next_auto = time.monotonic() + (checkpoint_every or 0)
                continue
            if info.si_signo == signal.SIGWINCH:
                if term is not None:
                    term.resize()
                continue
            if info.si_signo == signal.SIGCHLD:
                continue
            sig = info.si_signo
            # Who asked (`jukebox booth stop` sends SIGTERM), for the tape's reader; the uid as
            # this namespace sees it (an unprivileged booth's own user is 0 here).
            sender = {"pid": info.si_pid, "uid": info.si_uid}
            with contextlib.suppress(Exception):
                run.writer.append(
                    "note", {"event": "interrupt", "signal": signal.Signals(sig).name, **sender}
                )
            on_interrupt(functools.partial(send_to_agent, term, child.pid, sig))
    exit_status, exit_signal = _exit_code(wstatus)
    payload: dict[str, Any] = {
        "code": exit_status,
        "signal": exit_signal,
        "seconds": round(time.monotonic() - started, 6),
        "rusage": {
            "utime_s": round(usage.ru_utime, 6),
            "stime_s": round(usage.ru_stime, 6),
            "maxrss_kb": usage.ru_maxrss,
            "inblock": usage.ru_inblock,
            "oublock": usage.ru_oublock,
        },
    }
    if not ok:
        payload["setup_error"] = child.setup_error
    return payload, interrupts > 0


@contextlib.contextmanager
def _output_tail(term: AgentTerminal | None, tail: OutputTail) -> Iterator[dict[str, Any]]:
    """The agent's stdio for the spawn, with the tail of what it prints kept in `tail`: from
    its terminal's relay, or from its stderr teed through a pipe when that is no terminal."""
    stdio: dict[str, Any] = term.stdio() if term is not None else {}
    if term is not None:
        term.on_output = tail.add
    if stdio.get("stderr") is not None:
        yield stdio
        return
    tee = StderrTee(tail)
    try:
        yield {**stdio, "stderr": tee.write_fd}
    finally:
        tee.close()


def _strip_rw_set_id(writer: Any, rw: Sequence[str], started: float) -> None:
    """No set-id program the agent made is left in a --rw path (booth_paths.strip_set_id)."""
    # A second early: file systems stamp ctime from a clock that may lag a tick behind.
    stripped, stopped = strip_set_id(rw, int((started - 1) * 1e9))
    if not stripped and not stopped:
        return
    writer.append(
        "note",
        {"event": "rw_set_id_stripped", "count": len(stripped), "paths": stripped[:100],
         "walk_stopped": stopped},
    )  # fmt: skip
    if stripped:
        more = f" and {len(stripped) - 3} more" if len(stripped) > 3 else ""
        _alert(
            f"took the set-user/group-ID bits off {len(stripped)} file(s) the agent left in "
            f"--rw paths: {', '.join(stripped[:3])}{more}"
        )
    if stopped:
        _alert(
            f"stopped short in the --rw paths (at {SET_ID_WALK_LIMIT} entries, out of file "
            "descriptors, or at a directory moved while walked): set-id files the agent left "
            f"further in stay set-id; check them (`find {rw[0]} -perm /6000`)"
        )


def _report_view_denials(run: _Run, spec: isolation.ChildSpec, status: dict[str, Any],
                         never: tuple[str, ...]) -> None:  # fmt: skip
    """Says which hidden or read-only paths the agent failed on, and notes them on the tape."""
    output = run.output.text() + "\n" + (status.get("setup_error") or "")
    denials = view_denials(output, spec, never)
    if not denials:
        return
    run.writer.append(
        "note", {"event": "view_denials", "denials": [d.to_json() for d in denials]}
    )
    for denial in denials:
        _alert(denial.message())


def _run_verifier(spec: isolation.ChildSpec, command: str) -> dict[str, Any]:
    # No terminal: the verifier's stdin is /dev/null and its output a pipe.
    vspec = isolation.ChildSpec(
        **{
            **spec.__dict__,
            "argv": ["/bin/sh", "-c", command],
            "cwd": spec.keep[0],
            "terminal": False,
        }
    )
    read_fd, write_fd = os.pipe()
    started = time.monotonic()
    import subprocess  # here: a booth without a verifier starts without it (and locale)

    try:
        child = isolation.spawn(vspec, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd)
    finally:
        os.close(write_fd)
    # Read on a thread: this one waits for the operator's signals meanwhile.
    captured: list[tuple[str, bool]] = []
    reader = threading.Thread(
        target=lambda: captured.append(_read_capped(read_fd, VERIFY_OUTPUT_MAX)),
        name="jukebox-verify-output",
        daemon=True,
    )
    reader.start()
    try:
        child.wait_started()
        wstatus, interrupts = _wait_passing_interrupts(child, "the verifier")
        reader.join()  # the verifier's namespace is gone: nothing holds the pipe
    finally:
        if not reader.is_alive():
            os.close(read_fd)
    output, truncated = captured[0] if captured else ("", False)
    exit_status, exit_signal = _exit_code(wstatus)
    result: dict[str, Any] = {
        "cmd": command,
        "exit": exit_status,
        "signal": exit_signal,
        "ok": exit_status == 0,
        "seconds": round(time.monotonic() - started, 6),
        "output": output,
        "truncated": truncated,
    }
    if child.setup_error:
        result["setup_error"] = child.setup_error
    if interrupts:
        result["interrupted"] = True
    return result


def _wait_passing_interrupts(child: isolation.Child, what: str) -> tuple[int, int]:
    """Waits for a sandboxed child that holds no terminal, so the operator's Ctrl-C (or a
    SIGTERM, SIGHUP) reaches it only through here: the first is passed on, a second kills it.
    Returns (its wait status, the interrupts received)."""
    interrupts = 0
    while True:
        pid, wstatus = os.waitpid(child.pid, os.WNOHANG)
        if pid:
            child.proc.returncode = os.waitstatus_to_exitcode(wstatus)  # reaped here
            return wstatus, interrupts
        info = signal.sigtimedwait(WAITED_SIGNALS, CHILD_POLL_SECONDS)
        if info is None or info.si_signo in (signal.SIGCHLD, signal.SIGWINCH):
            continue
        interrupts += 1
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, info.si_signo if interrupts == 1 else signal.SIGKILL)
        if interrupts == 1:
            _alert(f"interrupt: passed to {what}; interrupt again to kill it")
