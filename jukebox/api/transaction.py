"""Transactions: one unit of agent work whose files, memory and verdict share one tape.

A transaction stages every file write in a copy-on-write `shadowfs.layer.Layer` over a root
directory (the policy's ``root``, else the working directory when it opens), keeps the agent's
memory in a versioned `jukebox.api.state.State`, and records what happens as frames on a tape of its
own. Nothing reaches the real tree before `Transaction.commit`, which applies the layer through
`shadowfs.commit.apply`: conflict-checked against what the layer started from, crash-safe, all or
nothing. A rollback, an exception in the block, a tripped breaker, or leaving the block without a
verdict throws the layer away and says why on the tape.

Frames a transaction writes (docs/python-api.md has the payloads)::

    run_start   tree = the root's tree when the transaction opened
    agent_turn  one per record_agent_turn (cost_usd counts in `jukebox ls`)
    fs          one per stage_file_write; tree = the layer after the write
    checkpoint  tree = the layer, payload state = the memory's version id
    rollback    to a checkpoint, or final: true with the reason (the verdict ROLLED_BACK)
    breaker     the rule that tripped
    commit      tree = what was applied (the verdict COMMITTED)
    exit        written by a tracked run when its function returns (see jukebox.api.api)

The tape dir's own state (``.jukebox``) and its tapes (``*.jbx``) are outside every transaction's
view even when the tape dir lies inside the root: the transaction would otherwise hash its own
store into itself, and a commit must never touch a tape.

Crash recovery: before applying, the commit writes an *owner record* beside the commit journal
(``TAPE_DIR/.jukebox/commits/<key>.owner.json``, key = the root's path hash) naming the tape and
trees, and holds a lock for the whole commit. `recover_commits` (run by every `Jukebox` when it
opens a tape dir) finds records whose lock is free — their process died — lets
`shadowfs.commit.recover` finish or undo the apply, and appends the verdict that really happened
to the tape.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import json
import os
import secrets
import shutil
import stat
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from blake3 import blake3

from jukebox.api.state import State, StateVersion
from jukebox.errors import UsageError
from jukebox.guard.breaker import BreakerState, BreakerTripped, CircuitBreaker
from jukebox.tape.errors import TapeProblem
from jukebox.tape.frame import Frame
from jukebox.tape.tape import TapeWriter
from jukebox.tape.tapedir import TAPE_SUFFIX, TapeDir, check_tape_id
from jukebox.trees.basetree import build_base_tree, forget_committed
from shadowfs import tree as trees
from shadowfs.commit import apply as apply_commit
from shadowfs.commit import recover as recover_commit
from shadowfs.errors import ConflictError
from shadowfs.layer import Layer
from shadowfs.oid import ObjectId, hash_object

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader, ObjectStore

__all__ = [
    "Checkpoint",
    "Outcome",
    "Run",
    "Transaction",
    "TransactionClosed",
    "TxFS",
    "current_run",
    "recover_commits",
]

OPEN = "OPEN"
COMMITTED = "COMMITTED"
ROLLED_BACK = "ROLLED_BACK"

FILESYSTEM_MODES = {
    "copy_on_write": "file writes are staged in a copy-on-write layer and reach the disk only "
    "at commit, all at once (crash-safe, conflict-checked)",
    "passthrough": "tx.fs reads and writes the real files directly: nothing is staged, and "
    "rollback cannot undo a write (the tape still records it)",
}
MCP_MODES = {
    "staged_acid": "side effects staged through the transaction (stage_file_write) are held "
    "with the files and applied all or nothing at commit; tool calls that are not read-only "
    "(tx.tool, tx.stage_tool_call) are staged and run after the files at commit",
    "deny": "stage_file_write and tool calls that are not read-only are refused (PermissionError, "
    "or a refused tool result) and the refusal is recorded",
}

_STATE_DIR = ".jukebox"
_TAPE_ID_PREFIX = "tr_"


class TransactionClosed(UsageError):
    """The transaction already has its verdict (or was never opened); start a new one."""


# --------------------------------------------------------------------------- tapes


class TapeLog:
    """A transaction's tape writer with grouped syncs.

    Every frame reaches the file with one write(2), so a killed process loses nothing. The
    fdatasync that makes frames survive a power loss runs at the points that matter — before a
    commit touches the real tree, after each verdict, at exit — instead of once per frame: it is
    the whole cost of a rollback_to on a real disk (about 70 us of a 0.19 ms budget, and far more
    under load). A power loss can cost the frames after the last sync, never a verdict.
    """

    def __init__(self, path: Path, store: ObjectStore, tape_id: str) -> None:
        self.writer = TapeWriter.create(path, store, tape_id, fsync=False)
        # fdatasync works on the inode through any descriptor; this one is ours to hold.
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def append(self, kind: str, payload: Mapping[str, Any], *, durable: bool = False,
               **kw: Any) -> Frame:
        frame = self.writer.append(kind, payload, **kw)
        if durable:
            self.sync()
        return frame

    def sync(self) -> None:
        if self._fd >= 0:
            os.fdatasync(self._fd)

    def close(self) -> None:
        self.writer.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# --------------------------------------------------------------------------- runs


@dataclass
class Run:
    """One call of a tracked function: what its transactions write into run_start, the breaker
    they share, and the tapes that get its exit frame."""

    id: str
    name: str
    function: dict[str, Any] | None = None
    args: dict[str, Any] | None = None
    breaker: CircuitBreaker | None = None
    logs: list[TapeLog] = field(default_factory=list)
    # Tapes of transactions open right now, innermost last: where model calls are recorded.
    active: list[TapeLog] = field(default_factory=list)
    # Makes a tape for model calls made while no transaction is open (set by jukebox.api.api).
    fallback: Any = None
    # A re-execution's redirect (jukebox.api.bside): every transaction's root, store and tape.
    redirect: Any = None
    opened: int = 0  # transactions opened so far; each run_start records its rank
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_rank(self) -> int:
        with self.lock:
            self.opened += 1
            return self.opened

    def adopt(self, log: TapeLog) -> None:
        with self.lock:
            self.logs.append(log)
            self.active.append(log)

    def settled(self, log: TapeLog) -> None:
        with self.lock:
            if log in self.active:
                self.active.remove(log)

    def current(self) -> TapeLog | None:
        """The tape a model call made now belongs on (creating the run's own if needed)."""
        with self.lock:
            if self.active:
                return self.active[-1]
            if self.fallback is None:
                return None
            log = self.fallback(self)
            self.logs.append(log)
            self.fallback = None
            self.active.append(log)  # stays current for later calls outside transactions
            return log

    def finish(self, payload: Mapping[str, Any]) -> None:
        """Append the exit frame to every tape the run opened, then close them."""
        with self.lock:
            logs, self.logs = self.logs, []
        for log in logs:
            try:
                log.append("exit", payload, durable=True)
            finally:
                log.close()


current_run: contextvars.ContextVar[Run | None] = contextvars.ContextVar(
    "jukebox_run", default=None
)
# Set while a B side re-executes a tracked function (jukebox.api.bside.Redirect): runs started
# then take their roots, store and tapes from it.
current_redirect: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jukebox_redirect", default=None
)


# --------------------------------------------------------------------------- results


# Checkpoint 0 is the start (the root's tree and the memory as the transaction opened); the
# first checkpoint() is 1. A booth numbers its checkpoints the same way (docs/python-api.md).
START = 0


@dataclass(frozen=True)
class Checkpoint:
    """A point a transaction can go back to: files (tree) and memory (state) together."""

    n: int
    label: str | None
    frame: int
    tree: ObjectId | None
    state: StateVersion
    state_id: ObjectId
    breaker: BreakerState | None = None


class Outcome:
    """What commit() and rollback() return. The work is already done when they return; the
    object is also awaitable, so ``await tx.commit()`` and ``tx.commit()`` mean the same."""

    __slots__ = ("_pending", "frame", "reason", "status", "tool_calls")

    def __init__(self, status: str, frame: int, reason: str | None = None,
                 pending: Any = None) -> None:  # fmt: skip
        self.status = status
        self.frame = frame
        self.reason = reason
        # Staged tool calls whose runners are coroutines (jukebox.mcp.tx_tools): awaiting the
        # outcome runs them; `tool_calls` is then the report (ran, failed, not_run).
        self._pending = pending
        self.tool_calls: dict[str, Any] | None = None

    def __await__(self) -> Any:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.tool_calls = yield from pending.__await__()
        return self

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"Outcome({self.status}, frame={self.frame}{why})"


# --------------------------------------------------------------------------- base trees


def _relative(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` ("" for the root itself), or None when outside it."""
    if path == root:
        return ""
    prefix = root if root.endswith(os.sep) else root + os.sep
    if path.startswith(prefix):
        return path[len(prefix) :]
    return None


def build_base(
    store: ObjectStore, root: str, tape_dir: str, tapes: TapeDir | None = None
) -> ObjectId:
    """The tree of ``root`` as a transaction sees it: without the tape dir's own records. With
    ``tapes``, the last build of ``root`` recorded there serves as a stat cache
    (jukebox.trees.basetree), so unchanged files are not read again."""
    rel = _relative(tape_dir, root)
    tape_rel = os.fsencode(rel) if rel is not None else None
    state_rel = None if tape_rel is None else os.path.join(tape_rel, _STATE_DIR.encode())
    tape_suffix = TAPE_SUFFIX.encode()

    def is_tape_record(path: bytes) -> bool:
        """The tape dir's own state and tapes are records of the run, not part of the tree."""
        if tape_rel is None or os.path.dirname(path) != tape_rel:
            return False
        return path == state_rel or path.endswith(tape_suffix)

    if tapes is None:
        return trees.build_tree(store, root, exclude=is_tape_record)
    return build_base_tree(store, tapes, root, exclude=is_tape_record)


# --------------------------------------------------------------------------- the file view


class TxFS:
    """Files as the transaction sees them: the real tree plus its staged changes.

    Paths are absolute or relative to the working directory, and must lie inside the
    transaction's root. Writes create missing parent directories.
    """

    def __init__(self, tx: Transaction) -> None:
        self._tx = tx

    # -- paths ---------------------------------------------------------------------------------

    def relpath(self, path: str | os.PathLike[str]) -> str:
        """``path`` relative to the transaction root; ValueError when it is outside it."""
        tx = self._tx
        text = os.fsdecode(os.fspath(path))
        absolute = os.path.abspath(text)
        rel = _relative(absolute, tx.root)
        if rel is None:
            # A symlinked prefix (/tmp -> /private/tmp) can hide that the path is inside.
            rel = _relative(os.path.realpath(absolute), tx.root)
        if rel is None:
            raise ValueError(
                f"{text!r} is outside the transaction's root {tx.root}: stage files under the "
                "root, or set SandboxPolicy(root=...) to a directory that contains them"
            )
        if tx._hidden(rel):
            raise ValueError(
                f"{text!r} is inside the tape dir's own records ({_STATE_DIR} or a *.jbx tape), "
                "which no transaction may change: write somewhere else"
            )
        return rel

    # -- reading -------------------------------------------------------------------------------

    def read(self, path: str | os.PathLike[str]) -> bytes:
        tx = self._tx
        with tx._lock:
            rel = self.relpath(path)
            if tx._layer is None:
                with open(os.path.join(tx.root, rel), "rb") as f:
                    return f.read()
            return tx._live_layer().read_file(rel)

    def read_text(self, path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        tx = self._tx
        with tx._lock:
            rel = self.relpath(path)
            if tx._layer is None:
                return os.path.lexists(os.path.join(tx.root, rel))
            return tx._live_layer().exists(rel)

    def is_dir(self, path: str | os.PathLike[str]) -> bool:
        tx = self._tx
        with tx._lock:
            rel = self.relpath(path)
            if tx._layer is None:
                return os.path.isdir(os.path.join(tx.root, rel))
            layer = tx._live_layer()
            return layer.exists(rel) and stat.S_ISDIR(layer.stat(rel).st_mode)

    def listdir(self, path: str | os.PathLike[str] = ".") -> list[str]:
        tx = self._tx
        with tx._lock:
            rel = self.relpath(path)
            if tx._layer is None:
                names = sorted(os.listdir(os.path.join(tx.root, rel)))
            else:
                names = tx._live_layer().listdir(rel)
            return [n for n in names if not tx._hidden(f"{rel}/{n}" if rel else n)]

    list = listdir

    # -- writing -------------------------------------------------------------------------------

    def write(self, path: str | os.PathLike[str], data: str | bytes) -> int:
        """Create or replace a file; returns the bytes written."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        elif not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"write() takes str or bytes, got {type(data).__name__}")
        tx = self._tx
        with tx._lock:
            tx._check_open()
            rel = self.relpath(path)
            if not rel:
                raise IsADirectoryError(errno.EISDIR, "the root is a directory", tx.root)
            parent = os.path.dirname(rel)
            if tx._layer is None:
                target = os.path.join(tx.root, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(data)
            else:
                layer = tx._live_layer()
                if parent and not layer.exists(parent):
                    layer.mkdir(parent, parents=True, exist_ok=True)
                layer.write_file(rel, bytes(data))
            return len(data)

    def mkdir(self, path: str | os.PathLike[str], *, parents: bool = True) -> None:
        tx = self._tx
        with tx._lock:
            tx._check_open()
            rel = self.relpath(path)
            if tx._layer is None:
                os.makedirs(os.path.join(tx.root, rel), exist_ok=True)
            else:
                tx._live_layer().mkdir(rel, parents=parents, exist_ok=True)

    def delete(self, path: str | os.PathLike[str], *, recursive: bool = False) -> None:
        tx = self._tx
        with tx._lock:
            tx._check_open()
            rel = self.relpath(path)
            if not rel:
                raise PermissionError(errno.EPERM, "the transaction root cannot be deleted")
            if tx._layer is not None:
                tx._live_layer().delete(rel, recursive=recursive)
                return
            target = os.path.join(tx.root, rel)
            if os.path.isdir(target) and not os.path.islink(target):
                if recursive:
                    shutil.rmtree(target)
                else:
                    os.rmdir(target)
            else:
                os.unlink(target)


# --------------------------------------------------------------------------- the transaction


def _json_safe(value: Any) -> Any:
    """A value a frame payload can hold; anything else as its (short) repr."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return {"$repr": repr(value)[:500]}


def _token_total(tokens: int | Mapping[str, Any] | None) -> int:
    if tokens is None:
        return 0
    if isinstance(tokens, Mapping):
        return sum(v for v in tokens.values() if isinstance(v, int) and not isinstance(v, bool))
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
        return tokens
    raise ValueError(
        f"tokens must be a whole number >= 0 or a dict of counts (e.g. {{'input': 120, "
        f"'output': 40}}), not {tokens!r}"
    )


def new_tape_id() -> str:
    return _TAPE_ID_PREFIX + secrets.token_hex(4)


def claim_tape_path(tapes: TapeDir, tape_id: str) -> tuple[Path, Path | None]:
    """Where a new tape with this id goes, and where an existing one was moved to (if any).

    ``<id>.jbx`` always holds the latest run with that id; an earlier run keeps every byte and
    moves to ``<id>.<n>.jbx`` (n = 1 for the first run moved, then 2, ...). A tape is never
    overwritten.
    """
    path = tapes.tape_path(tape_id)
    if not os.path.lexists(path):
        return path, None
    n = 1
    for p in tapes.path.glob(f"{tape_id}.*{TAPE_SUFFIX}"):
        middle = p.name[len(tape_id) + 1 : -len(TAPE_SUFFIX)]
        if middle.isdigit():
            n = max(n, int(middle) + 1)
    while True:
        moved = tapes.path / f"{tape_id}.{n}{TAPE_SUFFIX}"
        try:
            # link + unlink, not rename: rename would replace a tape another process just made.
            os.link(path, moved)
        except FileExistsError:
            n += 1
            continue
        except FileNotFoundError:
            return path, None  # someone else moved it first
        os.unlink(path)
        return path, moved


class Transaction:
    """See the module docstring. Made by `Jukebox.transaction`; use it as a (async) context
    manager, which opens it on entry and rolls it back on exit when it has no verdict yet."""

    def __init__(
        self,
        *,
        tapes: TapeDir,
        store_factory: Any,
        tape_id: str | None,
        name: str | None,
        filesystem: str,
        mcp_mode: str,
        root: str | os.PathLike[str] | None,
        breaker: CircuitBreaker | None,
        policy: Mapping[str, Any] | None = None,
        scratch_limit: int | None = None,
        initial_state: Mapping[str, Any] | StateVersion | None = None,
    ) -> None:
        if tape_id is not None:
            if not isinstance(tape_id, str):
                raise TypeError(f"tape_id must be a string, got {type(tape_id).__name__}")
            try:
                check_tape_id(tape_id)
            except UsageError as e:
                raise ValueError(str(e)) from None
        self._tapes = tapes
        self._store_factory = store_factory
        self._requested_id = tape_id
        self._name = name
        self._filesystem = filesystem
        self._mcp_mode = mcp_mode
        self._root_arg = root
        self._scratch_limit = scratch_limit
        self._template = breaker
        self._policy = dict(policy or {})
        self.state = State(initial_state)
        self.fs = TxFS(self)
        self.tape_id: str = tape_id or ""
        self.tape_path: Path | None = None
        self.archived: Path | None = None
        self.root: str = ""
        self.status = "NEW"
        self.base_tree: ObjectId | None = None
        self.checkpoints: list[Checkpoint] = []
        self._lock = threading.RLock()
        self._layer: Layer | None = None
        self._log: TapeLog | None = None
        self._store: Any = None
        self._run: Run | None = None
        self._breaker: CircuitBreaker | None = None
        self._scratch: Path | None = None
        self._scratch_lock = -1
        self._tape_rel: str | None = None
        self._turns = 0
        self._staged = 0
        self._start: StateVersion | None = None
        self._start_breaker: BreakerState | None = None
        self._tools: Any = None  # jukebox.mcp.tx_tools.ToolStage, made at the first tool call

    # -- opening -------------------------------------------------------------------------------

    def open(self) -> Transaction:
        if self.status != "NEW":
            raise TransactionClosed(
                f"transaction {self.tape_id} was already opened; make a new one with "
                "jb.transaction()"
            )
        run = self._run = current_run.get()
        rank = run.next_rank() if run is not None else 0
        redirect = run.redirect if run is not None else None
        if redirect is not None:
            # A B side re-executing the run: a scratch root and tape dir, the real store.
            self._tapes = redirect.tapes
            store = self._store = redirect.store
            root = redirect.root
        else:
            store = self._store = self._store_factory()
            root = os.path.realpath(os.fspath(self._root_arg) if self._root_arg else os.getcwd())
        if not os.path.isdir(root):
            raise ValueError(
                f"the transaction root {root} is not a directory: set SandboxPolicy(root=...) "
                "to an existing directory"
            )
        self.root = root
        tape_dir = os.path.realpath(self._tapes.path)
        self._tape_rel = _relative(tape_dir, root)
        if run is not None:
            self._breaker = run.breaker
        elif self._template is not None:
            self._breaker = CircuitBreaker(**self._template.limits)
        try:
            if self._filesystem == "copy_on_write":
                self.base_tree = build_base(
                    store, root, tape_dir, None if redirect is not None else self._tapes
                )
                self._scratch, self._scratch_lock = _make_scratch(self._tapes)
                self._layer = Layer(
                    root, store, self._scratch, base_tree=self.base_tree,
                    scratch_limit=self._scratch_limit,
                )
            tape_id = self._requested_id or self._fresh_id()
            self.tape_id = tape_id
            log = redirect.open_log(rank) if redirect is not None else None
            if log is not None:
                self.tape_path, self._log = log.path, log
            else:
                self.tape_path, self.archived = claim_tape_path(self._tapes, tape_id)
                self._log = TapeLog(self.tape_path, store, tape_id)
            payload: dict[str, Any] = {
                "tape_id": tape_id,
                "name": self._name or (run.name if run is not None else None) or _script_name(),
                "argv": list(sys.argv),
                "cwd": os.getcwd(),
                "root": root,
                "pid": os.getpid(),
                "python": sys.version.split()[0],
                "policy": {
                    **self._policy,
                    "filesystem": self._filesystem,
                    "mcp_mode": self._mcp_mode,
                },
            }
            if self._breaker is not None:
                payload["breaker"] = self._breaker.limits
            if run is not None:
                payload["run"] = {
                    "id": run.id, "function": run.function, "args": run.args, "transaction": rank
                }
            if self.archived is not None:
                payload["previous_run"] = self.archived.name
            if self.base_tree is not None:
                payload["base_tree"] = self.base_tree.hex()
            self._log.append("run_start", payload, tree=self.base_tree)
        except BaseException:
            self._cleanup()
            if self._log is not None:
                self._log.close()
            raise
        if run is not None:
            run.adopt(self._log)
        self._start = self.state.version
        self._start_breaker = self._breaker.state() if self._breaker is not None else None
        self.status = OPEN
        return self

    def _fresh_id(self) -> str:
        while True:
            tape_id = new_tape_id()
            if not os.path.lexists(self._tapes.tape_path(tape_id)):
                return tape_id

    def __enter__(self) -> Transaction:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(exc)

    async def __aenter__(self) -> Transaction:
        return self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(exc)

    def close(self, exc: BaseException | None = None) -> None:
        """End the transaction: without a verdict it rolls back, naming ``exc`` if given."""
        with self._lock:
            if self.status == OPEN:
                if exc is not None:
                    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    self._finish_rollback(
                        f"the transaction block raised {reason}",
                        {"exception": {"type": type(exc).__name__, "message": str(exc)[:2000]}},
                    )
                else:
                    self._finish_rollback(
                        "the transaction block ended without commit() or rollback()", {}
                    )
            if getattr(self, "_tools_pending", False) and self._log is not None:
                # commit() was not awaited: its staged tool calls never ran.
                self._tools_pending = False
                self._append("note", {"event": "mcp_dropped", "reason": "commit() was not "
                                      "awaited: staged tool calls never ran"})  # fmt: skip
            self._cleanup()

    # -- recording -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.status != OPEN:
            what = "was never opened" if self.status == "NEW" else f"is {self.status}"
            raise TransactionClosed(
                f"transaction {self.tape_id or '(unopened)'} {what}: use it inside "
                "`with jb.transaction() as tx:` and before its commit() or rollback()"
            )

    def _append(self, kind: str, payload: Mapping[str, Any], **kw: Any) -> Frame:
        assert self._log is not None
        return self._log.append(kind, payload, **kw)

    def record_agent_turn(
        self,
        agent_name: str,
        message: str,
        model: str | None = None,
        cost_usd: float = 0.0,
        tokens: int | Mapping[str, int] | None = None,
        *,
        tool_calls: list[dict[str, Any]] | None = None,
        failed: str | None = None,
        **extra: Any,
    ) -> Frame:
        """Record one agent step as an agent_turn frame, then apply the breaker's limits.

        A tripped limit records a breaker frame, rolls the transaction back (nothing reaches the
        disk) and raises `BreakerTripped` naming the rule.
        """
        if not isinstance(message, str):
            raise TypeError(f"message must be a string, got {type(message).__name__}")
        if isinstance(cost_usd, bool) or not isinstance(cost_usd, int | float) or cost_usd < 0:
            raise ValueError(f"cost_usd must be a number >= 0 (US dollars), not {cost_usd!r}")
        total = _token_total(tokens)
        with self._lock:
            self._check_open()
            self._turns += 1
            payload: dict[str, Any] = {
                "turn": self._turns,
                "agent": agent_name,
                "text": message,
                "model": model,
                "cost_usd": cost_usd,
            }
            if tokens is not None:
                payload["tokens"] = _json_safe(tokens)
            if tool_calls:
                payload["tool_calls"] = _json_safe(tool_calls)
            if failed is not None:
                payload["failed"] = failed
            for k, v in extra.items():
                payload.setdefault(k, _json_safe(v))
            frame = self._append("agent_turn", payload)
            if self._breaker is not None:
                try:
                    self._breaker.check(
                        cost_usd=float(cost_usd),
                        tokens=total,
                        text=message,
                        tool_calls=tool_calls,
                        failed=failed,
                    )
                except BreakerTripped as tripped:
                    self._append("breaker", {**tripped.trip.to_payload(), "turn": frame.seq})
                    self._finish_rollback(str(tripped), {"breaker": tripped.trip.rule})
                    raise
            return frame

    def stage_file_write(self, path: str | os.PathLike[str], content: str | bytes) -> Frame:
        """Stage a file write (visible through tx.fs, on disk only after commit) and record it
        as an fs frame whose tree is the layer after the write."""
        with self._lock:
            self._check_open()
            rel = self.fs.relpath(path)
            if self._mcp_mode == "deny":
                self._append(
                    "tool_call",
                    {"tool": "stage_file_write", "args": {"path": rel}, "result": "denied",
                     "ok": False},
                )
                raise PermissionError(
                    f"staging a write to {rel!r} is refused by SandboxPolicy(mcp_mode='deny'); "
                    "use mcp_mode='staged_acid' to allow staged writes"
                )
            size = self.fs.write(path, content)
            self._staged += 1
            payload: dict[str, Any] = {"op": "write", "path": rel, "bytes": size}
            if self._layer is None:
                payload["staged"] = False  # passthrough: it is on disk already
                return self._append("fs", payload)
            tree, journal = self._layer.snapshot()
            refs = []
            if journal is not None:
                payload["journal"] = journal.hex()
                refs.append(journal)
            return self._append("fs", payload, refs=refs, tree=tree)

    def _tool_stage(self) -> Any:
        if self._tools is None:
            from jukebox.mcp.tx_tools import ToolStage

            self._tools = ToolStage(self._append, self._mcp_mode)
        return self._tools

    def stage_tool_call(self, tool: str, args: Mapping[str, Any] | None = None,
                        run: Any = None, *, server: str | None = None,
                        compensate: Any = None) -> str:  # fmt: skip
        """Stage a call of a tool that is not MCP: ``run()`` (a function, or a coroutine
        function: then ``await tx.commit()``) runs only at the commit, after the files, in the
        order staged. Returns its id. Refused (PermissionError) under mcp_mode='deny'.
        ``compensate()``, if given, runs when a call staged after this one fails at the commit
        (this one having run); docs/mcp.md says what that can promise."""
        if run is None or not callable(run):
            raise TypeError("stage_tool_call needs run=, the function the commit calls")
        with self._lock:
            self._check_open()
            args = dict(args or {})
            if self._mcp_mode == "deny":
                denied = {"tool": tool, "args": _json_safe(args), "decision": "deny",
                          "result": "denied", "ok": False}  # fmt: skip
                self._append("tool_call", denied)
                raise PermissionError(
                    f"staging a call of {tool!r} is refused by SandboxPolicy(mcp_mode='deny'); "
                    "use mcp_mode='staged_acid' to stage it until the commit"
                )
            newest = self.checkpoints[-1].n if self.checkpoints else 0
            return self._tool_stage().stage(tool, _json_safe(args), run, server, newest,
                                            compensate=compensate)  # fmt: skip

    async def tool(self, session: Any, name: str, args: Mapping[str, Any] | None = None, *,
                   server: str | None = None, rules: Mapping[str, str] | None = None,
                   ask: Any = None,
                   compensate: tuple[str, Mapping[str, Any]] | None = None) -> Any:  # fmt: skip
        """Call MCP tool ``name`` over ``session`` (an ``mcp.ClientSession``) under the
        transaction's mcp_mode: read-only tools (their own annotations) run now; others are
        staged until ``await tx.commit()`` (staged_acid) or refused (deny). Returns the tool's
        result, or one that says it was staged (with its id) or refused.

        ``rules``: {"PATTERN": "allow|stage|deny|ask"} before the annotations, as a policy
        file's (docs/mcp.md). ``ask(server, tool, args)`` (a function or coroutine function)
        answers a call decided ``ask``: true runs it now, false refuses it; without it an ask is
        refused. ``compensate=(TOOL, ARGS)``: the call the commit makes over the same session
        if a call staged after this one fails, once this one has run."""
        self._check_open()
        newest = self.checkpoints[-1].n if self.checkpoints else 0
        return await self._tool_stage().tool(
            session, name, dict(args or {}), server, newest, rules=rules, ask=ask,
            compensate=(compensate[0], dict(compensate[1])) if compensate else None,
        )  # fmt: skip

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint(self, label: str | None = None) -> Checkpoint:
        """Record the files and the memory as they are now; `rollback_to` can return here."""
        with self._lock:
            self._check_open()
            version = self.state.version
            refs: list[ObjectId] = []
            state_id = version.save(self._store, refs)
            tree = journal = None
            if self._layer is not None:
                tree, journal = self._layer.snapshot()
            n = len(self.checkpoints) + 1  # 0 is the start, as in a booth
            payload: dict[str, Any] = {"id": n, "label": label, "state": state_id.hex()}
            refs.append(state_id)
            if journal is not None:
                payload["journal"] = journal.hex()
                refs.append(journal)
            frame = self._append("checkpoint", payload, refs=refs, tree=tree)
            cp = Checkpoint(
                n,
                label,
                frame.seq,
                tree,
                version,
                state_id,
                self._breaker.state() if self._breaker is not None else None,
            )
            self.checkpoints.append(cp)
            return cp

    def _start_checkpoint(self) -> Checkpoint:
        """Checkpoint 0, the start: the root's tree and the memory as the transaction opened.
        Made when asked for (its memory is saved to the store only then)."""
        assert self._start is not None
        state_id = self._start.save(self._store, [])
        return Checkpoint(
            START, "start", 0, self.base_tree, self._start, state_id, self._start_breaker
        )

    def _find(self, to: Checkpoint | str | int) -> Checkpoint:
        """A checkpoint by itself, its number (0 is the start, then 1, 2, ... as a booth numbers
        them) or its label (the latest with it; "start" when no checkpoint took that label)."""
        if isinstance(to, Checkpoint):
            if to.n == START and to.state is self._start:
                return to
            if 1 <= to.n <= len(self.checkpoints) and self.checkpoints[to.n - 1] is to:
                return to
            raise ValueError(
                f"checkpoint {to.n} ({to.label!r}) belongs to another transaction: pass one "
                "this transaction's checkpoint() returned"
            )
        if isinstance(to, int) and not isinstance(to, bool):
            if to == START:
                return self._start_checkpoint()
            if 1 <= to <= len(self.checkpoints):
                return self.checkpoints[to - 1]
            raise ValueError(
                f"no checkpoint {to}: this transaction has checkpoints 1 to "
                f"{len(self.checkpoints)} (0 is the start)"
                if self.checkpoints
                else f"no checkpoint {to}: this transaction has none yet (0 is the start)"
            )
        for cp in reversed(self.checkpoints):
            if cp.label == to:
                return cp
        if to == "start":
            return self._start_checkpoint()
        known = sorted({c.label for c in self.checkpoints if c.label} | {"start"})
        raise ValueError(f"no checkpoint labelled {to!r}: known labels are {known}")

    def rollback_to(self, checkpoint: Checkpoint | str | int) -> Checkpoint:
        """Bring files and memory back to a checkpoint (a Checkpoint, its label or its number).

        The memory is a pointer swap; the files cost what differs. The transaction stays open.
        """
        with self._lock:
            self._check_open()
            cp = self._find(checkpoint)
            if self._layer is not None and cp.tree is not None:
                self._layer.restore(cp.tree)
            self.state.restore(cp.state)
            if self._breaker is not None and cp.breaker is not None:
                self._breaker.restore(cp.breaker)
            payload: dict[str, Any] = {"to": cp.n, "label": cp.label, "state": cp.state_id.hex()}
            if self._layer is None:
                payload["files_restored"] = False
            self._append("rollback", payload, refs=[cp.state_id], tree=cp.tree)
            if self._tools is not None:
                self._tools.drop_after(cp.n)
            return cp

    # -- verdicts ------------------------------------------------------------------------------

    def rollback(self, reason: str | None = None) -> Outcome:
        """End the transaction rolled back: nothing staged reaches the disk, the memory returns
        to where it started, and the tape says ROLLED_BACK with ``reason``."""
        with self._lock:
            self._check_open()
            return self._finish_rollback(reason or "rolled back by the agent", {})

    def _finish_rollback(self, reason: str, extra: Mapping[str, Any]) -> Outcome:
        assert self._start is not None
        discarded = self.state.version
        payload: dict[str, Any] = {"final": True, "reason": reason, "to": "start", **extra}
        refs: list[ObjectId] = []
        if self._tools is not None:
            self._tools.drop_all(reason)
        try:
            if discarded is not self._start or self.checkpoints:
                # The memory that is thrown away is still worth having on the tape.
                discarded_id = discarded.save(self._store, refs)
                payload["discarded_state"] = discarded_id.hex()
                refs.append(discarded_id)
            if self._layer is not None:
                tree, journal = self._layer.snapshot()
                if tree != self.base_tree:
                    payload["discarded_tree"] = tree.hex()
                    refs.append(tree)
                if journal is not None:
                    payload["journal"] = journal.hex()
                    refs.append(journal)
            elif self._staged:
                payload["files_restored"] = False
            frame = self._append(
                "rollback", payload, refs=refs, tree=self.base_tree, durable=True
            )
        finally:
            self.status = ROLLED_BACK
            self.state.restore(self._start)
            self._cleanup()
        return Outcome(ROLLED_BACK, frame.seq, reason)

    def commit(self) -> Outcome:
        """Apply every staged change to the real tree at once and end the transaction.

        Raises shadowfs's ConflictError (having written nothing; the transaction ends rolled
        back) when a path it changes was changed on disk since the transaction opened.
        """
        with self._lock:
            self._check_open()
            refs: list[ObjectId] = []
            state_id = self.state.version.save(self._store, refs)
            refs.append(state_id)
            if self._layer is None:
                frame = self._append(
                    "commit", {"changes": self._staged, "state": state_id.hex(),
                               "passthrough": True},
                    refs=refs,
                    durable=True,
                )
                return self._committed(frame.seq)
            final, journal = self._layer.snapshot()
            payload: dict[str, Any] = {"state": state_id.hex(), "root": self.root}
            if journal is not None:
                payload["journal"] = journal.hex()
                refs.append(journal)
            assert self.base_tree is not None
            if final == self.base_tree:
                frame = self._append(
                    "commit", {**payload, "changes": 0}, refs=refs, tree=final, durable=True
                )
            else:
                with _CommitGuard(self._tapes, self.root, self._store) as guard:
                    guard.claim(
                        {
                            "target": self.root,
                            "tape": str(self.tape_path),
                            "tape_id": self.tape_id,
                            "base_tree": self.base_tree.hex(),
                            "new_tree": final.hex(),
                            "state": state_id.hex(),
                            "pid": os.getpid(),
                        }
                    )
                    # The tape up to here must outlive any change to the real tree.
                    assert self._log is not None
                    self._log.sync()
                    try:
                        report = apply_commit(
                            self._store, self.root, self.base_tree, final,
                            journal_dir=guard.journal_dir,
                        )
                    except ConflictError as conflict:
                        guard.release_claim()
                        self._finish_rollback(
                            str(conflict), {"conflicts": conflict.conflicts[:100]}
                        )
                        raise
                    frame = self._append(
                        "commit",
                        {**payload, "changes": report.changed, "bytes": report.bytes_written},
                        refs=refs,
                        tree=final,
                        durable=True,
                    )
                    guard.release_claim()
            # The root now holds `final` wherever the layer changed it.
            forget_committed(self._tapes, self.root, self._store, self.base_tree, final)
            return self._committed(frame.seq)

    def _committed(self, seq: int) -> Outcome:
        """The files are committed: now the staged tool calls (jukebox.mcp.tx_tools), then the
        clean-up; calls that must be awaited run when the outcome is."""
        self.status = COMMITTED
        pending = self._tools.after_commit() if self._tools is not None else None
        if pending is None:
            outcome = Outcome(COMMITTED, seq)
            outcome.tool_calls = self._tools.report if self._tools is not None else None
            self._cleanup()
            return outcome

        self._tools_pending = True

        async def finish() -> dict[str, Any]:
            self._tools_pending = False
            try:
                return await pending
            finally:
                self._cleanup()

        return Outcome(COMMITTED, seq, pending=finish())

    # -- internals -----------------------------------------------------------------------------

    def _hidden(self, rel: str) -> bool:
        t = self._tape_rel
        if t is None:
            return False
        state = f"{t}/{_STATE_DIR}" if t else _STATE_DIR
        if rel == state or rel.startswith(state + "/"):
            return True
        return os.path.dirname(rel) == t and rel.endswith(TAPE_SUFFIX)

    def _live_layer(self) -> Layer:
        if self.status != OPEN or self._layer is None:
            self._check_open()
        # _check_open raised unless the layer is there
        return self._layer  # type: ignore[return-value]

    def _cleanup(self) -> None:
        if self._run is not None and self._log is not None and self.status != OPEN:
            self._run.settled(self._log)
        if self._layer is not None:
            self._layer.close()
            self._layer = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._scratch_lock >= 0:
            os.close(self._scratch_lock)
            self._scratch_lock = -1
        if self.status in (COMMITTED, ROLLED_BACK) and self._run is None and self._log:
            self._log.close()

    def __repr__(self) -> str:
        return f"<Transaction {self.tape_id or '(unopened)'} {self.status}>"


def _script_name() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.basename(path) if path else "python"


# --------------------------------------------------------------------------- scratch space


def _lock_nb(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _make_scratch(tapes: TapeDir) -> tuple[Path, int]:
    """A scratch dir for one layer, with a held lock that tells a live layer from a dead one."""
    scratch = tapes.private_dir("scratch") / f"tx-{os.getpid()}-{secrets.token_hex(4)}"
    scratch.mkdir(0o700)
    fd = os.open(scratch / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return scratch, fd


def clean_scratch(tapes: TapeDir) -> int:
    """Remove scratch dirs of transactions whose process died; returns how many."""
    base = tapes.state / "scratch"
    removed = 0
    try:
        entries = list(base.iterdir())
    except FileNotFoundError:
        return 0
    for d in entries:
        if not d.name.startswith("tx-"):
            continue  # booths keep their own scratch here
        try:
            fd = os.open(d / ".lock", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = -1
        try:
            if fd >= 0 and not _lock_nb(fd):
                continue
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
        finally:
            if fd >= 0:
                os.close(fd)
    return removed


# --------------------------------------------------------------------------- commit records


def _commit_key(root: str) -> str:
    return blake3(os.fsencode(root)).hexdigest()[:16]


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(data, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class _CommitGuard:
    """One commit into one root at a time (across processes), with its owner record."""

    def __init__(self, tapes: TapeDir, root: str, store: ObjectStore) -> None:
        key = _commit_key(root)
        base = tapes.private_dir("commits")
        self.tapes = tapes
        self.store = store
        self.journal_dir = base / key
        self.owner = base / f"{key}.owner.json"
        self.lock_path = base / f"{key}.lock"
        self.fd = -1

    def __enter__(self) -> _CommitGuard:
        self.fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        if self.owner.exists():
            # A commit whose process died; settle it (and its tape) before starting ours.
            _settle(self.owner, self.journal_dir, self.store)
        return self

    def claim(self, record: dict[str, Any]) -> None:
        _write_json_atomic(self.owner, record)

    def release_claim(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.owner)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
        self.fd = -1


def _holds_new(store: ObjectReader, root: str, base: ObjectId, new: ObjectId) -> bool:
    """After a recovery that had no journal to redo: did the commit finish (True) or never
    reach its commit point (False)? The tree is exactly one or the other, so one changed path
    decides."""
    for change in trees.diff_trees(store, base, new):
        path = os.path.join(root, os.fsdecode(change.path))
        e = change.new
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if e is None:
            return st is None
        if st is None:
            return False
        if e.kind == trees.DIR:
            if not stat.S_ISDIR(st.st_mode):
                return False
            if change.status == "mode":
                return stat.S_IMODE(st.st_mode) == e.mode
            continue  # an added directory: its contents decide
        if e.kind == trees.SYMLINK:
            return stat.S_ISLNK(st.st_mode) and os.fsencode(os.readlink(path)) == e.target
        if e.kind in trees.SPECIALS:
            return stat.S_IFMT(st.st_mode) == trees.SPECIAL_FMT[e.kind] and (
                e.kind not in trees.DEVICES or st.st_rdev == e.rdev
            )
        if not stat.S_ISREG(st.st_mode) or st.st_size != e.size:
            return False
        if change.status == "mode":
            return stat.S_IMODE(st.st_mode) == e.mode
        if e.oid is None:
            return False  # a file entry without content: a damaged tree, never held
        with open(path, "rb") as f:
            data = f.read()
        if store.kind(e.oid) == "blob":
            return hash_object("blob", data) == e.oid
        return store.read_bytes(e.oid) == data
    return True


def _settle(owner: Path, journal_dir: Path, store: ObjectStore) -> str | None:
    """Finish or undo a dead process's commit and record the real verdict on its tape."""
    try:
        record = json.loads(owner.read_text())
        target = record["target"]
        base = ObjectId.from_hex(record["base_tree"])
        new = ObjectId.from_hex(record["new_tree"])
    except (OSError, ValueError, KeyError, TypeError):
        owner.unlink(missing_ok=True)
        return None
    redone = recover_commit(target, journal_dir)
    applied = redone or _holds_new(store, target, base, new)
    tape = Path(record.get("tape", ""))
    if tape.is_file():
        try:
            with TapeWriter.open_append(tape, store) as w:
                if applied:
                    state = record.get("state")
                    refs = [ObjectId.from_hex(state)] if isinstance(state, str) else []
                    w.append(
                        "commit",
                        {"recovered": True, "state": state, "root": target},
                        refs=refs,
                        tree=new,
                    )
                else:
                    w.append(
                        "rollback",
                        {
                            "final": True,
                            "recovered": True,
                            "to": "start",
                            "reason": "the process died during commit, before its commit "
                            "point: nothing reached the disk",
                        },
                        tree=base,
                    )
        except (OSError, TapeProblem, ValueError):
            pass  # the disk is settled either way; a damaged tape is verify's to report
    owner.unlink(missing_ok=True)
    return COMMITTED if applied else ROLLED_BACK


def recover_commits(tapes: TapeDir, store: ObjectStore) -> list[tuple[str, str]]:
    """Settle every commit into any root whose process died midway, and remove dead
    transactions' scratch space. Returns (tape id, verdict) per settled commit."""
    clean_scratch(tapes)
    base = tapes.state / "commits"
    settled: list[tuple[str, str]] = []
    try:
        owners = sorted(base.glob("*.owner.json"))
    except FileNotFoundError:
        return settled
    for owner in owners:
        key = owner.name[: -len(".owner.json")]
        fd = os.open(base / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if not _lock_nb(fd):
                continue  # a live process is committing right now
            if not owner.exists():
                continue
            try:
                tape_id = json.loads(owner.read_text()).get("tape_id", "?")
            except (OSError, ValueError):
                tape_id = "?"
            verdict = _settle(owner, base / key, store)
            if verdict is not None:
                settled.append((str(tape_id), verdict))
        finally:
            os.close(fd)
    return settled
