"""The Python API: `Jukebox`, `SandboxPolicy`, `track`, and `Tape` with fork and replay.

An agent written in Python gets the booth's guarantees in its own process::

    jb = Jukebox(tape_dir="./tapes", sandbox=SandboxPolicy(), breaker=CircuitBreaker(...))

    @jb.track(name="my-agent")
    async def agent(task: str) -> dict:
        async with jb.transaction() as tx:     # a tape of its own: tapes/tr_<8 hex>.jbx
            tx.record_agent_turn("planner", "...", model="gpt-4o", cost_usd=0.01)
            tx.stage_file_write("out/report.md", "...")   # invisible on disk until commit
            await tx.commit()

`track` records which function ran with which arguments (its import path and JSON-safe
arguments, secrets redacted), so a fork can re-execute it; each transaction opened inside the
call writes a tape whose run_start carries that, and the call's end appends an exit frame to each.
Transactions are documented in `jukebox.api.transaction`, the memory they carry in
`jukebox.api.state`, and the whole API in docs/python-api.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from jukebox.api.state import StateVersion
from jukebox.api.transaction import (
    FILESYSTEM_MODES,
    MCP_MODES,
    Run,
    TapeLog,
    Transaction,
    _json_safe,
    claim_tape_path,
    current_redirect,
    current_run,
    new_tape_id,
    recover_commits,
)
from jukebox.guard.breaker import CircuitBreaker
from jukebox.redact import (
    KEY_SHAPES,
    MIN_SECRET_LEN,
    REDACTED,
    Scrubber,
    is_secret_name,
    redact_text,
)
from jukebox.tape import tape as _tape
from jukebox.tape.compare import Comparison, compare_tapes
from jukebox.tape.tapedir import TapeDir, check_tape_id, default_tape_dir

if TYPE_CHECKING:
    from shadowfs.objects import ObjectStore
    from shadowfs.store import Store

__all__ = ["BSide", "Jukebox", "Report", "SandboxPolicy", "Tape", "track"]

F = TypeVar("F", bound=Callable[..., Any])



# --------------------------------------------------------------------------- policy


def _check_choice(field: str, value: object, valid: Mapping[str, str]) -> None:
    if value not in valid:
        options = "; ".join(f"{k!r}: {v}" for k, v in valid.items())
        raise ValueError(
            f"unknown SandboxPolicy {field} {value!r}: use one of {', '.join(map(repr, valid))} "
            f"({options})"
        )


@dataclass(frozen=True)
class SandboxPolicy:
    """How a transaction isolates what the agent does.

    filesystem: ``copy_on_write`` (default) stages every write and applies them all at commit;
    ``passthrough`` reads and writes the real files (recorded, never undone).
    mcp_mode: ``staged_acid`` (default) holds staged side effects for the commit; ``deny``
    refuses them.
    root: the directory the layer covers (default: the working directory when a transaction
    opens). Opening a transaction reads this tree once per process (later opens re-read only
    files whose size or mtime changed), so point it at the project, not at $HOME.
    max_scratch_bytes: the most a copy-on-write transaction may stage, all files together
    (their apparent sizes); a write past it raises OSError(ENOSPC), as a full disk would, and
    stages nothing. None (default): no limit.
    """

    filesystem: str = "copy_on_write"
    mcp_mode: str = "staged_acid"
    root: str | os.PathLike[str] | None = None
    max_scratch_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_choice("filesystem", self.filesystem, FILESYSTEM_MODES)
        _check_choice("mcp_mode", self.mcp_mode, MCP_MODES)
        if self.root is not None and not isinstance(self.root, str | os.PathLike):
            raise TypeError(f"SandboxPolicy root must be a path, got {type(self.root).__name__}")
        limit = self.max_scratch_bytes
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                                  or limit <= 0):
            raise ValueError(
                f"SandboxPolicy max_scratch_bytes must be a positive number of bytes or None, "
                f"got {limit!r}"
            )
        if limit is not None and self.filesystem != "copy_on_write":
            raise ValueError(
                "SandboxPolicy max_scratch_bytes bounds what a copy_on_write transaction stages; "
                f"with filesystem={self.filesystem!r} writes go straight to disk: drop the limit"
            )

    def describe(self) -> dict[str, Any]:
        return {
            "filesystem": self.filesystem,
            "mcp_mode": self.mcp_mode,
            "root": os.fspath(self.root) if self.root is not None else None,
            "max_scratch_bytes": self.max_scratch_bytes,
        }


# --------------------------------------------------------------------------- arguments


def _secret_env_values() -> list[str]:
    """The secret-named variables' values, and the running proxy's secret: the base URLs it
    puts in the environment carry it, and a tracked call may be handed one, return one or fail
    with one in its message (`requests` and httpx errors name the URL)."""
    out = []
    for name, value in os.environ.items():
        if len(value) >= MIN_SECRET_LEN and is_secret_name(name):
            out.append(value)
    proxy = _capture.proxy
    if proxy is not None:
        out.append(proxy.secret)
    return out


def _scrub(value: Any, env_secrets: list[str]) -> tuple[Any, bool]:
    """(value with credential-looking strings replaced, whether anything was)."""
    if isinstance(value, str):
        hit = bool(KEY_SHAPES.search(value)) or any(s in value for s in env_secrets)
        return (REDACTED, True) if hit else (value, False)
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        found = False
        for k, v in value.items():
            if isinstance(k, str) and is_secret_name(k):
                out[k], hit = REDACTED, True
            else:
                out[k], hit = _scrub(v, env_secrets)
            found = found or hit
        return out, found
    if isinstance(value, list):
        pairs = [_scrub(v, env_secrets) for v in value]
        return [p[0] for p in pairs], any(p[1] for p in pairs)
    return value, False


def _is_native(value: Any) -> bool:
    """Does the JSON-safe form of `value` give back an equal value?"""
    if value is None or isinstance(value, bool | int | str):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return all(_is_native(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_native(v) for k, v in value.items())
    return False


def describe_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict:
    """The recorded arguments of one call: JSON-safe, secrets redacted, replayability noted."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        items = list(bound.arguments.items())
        kinds = {n: p.kind for n, p in bound.signature.parameters.items()}
    except (TypeError, ValueError):
        items = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        kinds = {}
    env_secrets = _secret_env_values()
    recorded: dict[str, Any] = {}
    redacted: list[str] = []
    opaque: list[str] = []
    for name, value in items:
        if kinds.get(name) == inspect.Parameter.VAR_POSITIONAL:
            value = list(value)
        if is_secret_name(name):
            recorded[name] = REDACTED
            redacted.append(name)
            continue
        if not _is_native(value):
            opaque.append(name)
        safe, hit = _scrub(_json_safe(value), env_secrets)
        if hit:
            redacted.append(name)
        recorded[name] = safe
    return {
        "values": recorded,
        "redacted": redacted,
        "opaque": opaque,
        "replayable": not redacted and not opaque,
    }


def describe_function(fn: Callable[..., Any]) -> dict[str, Any]:
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "?")
    try:
        source = inspect.getsourcefile(fn)
    except TypeError:
        source = None
    return {
        "module": module,
        "qualname": qualname,
        "import_path": f"{module}:{qualname}",
        "file": os.path.abspath(source) if source else None,
        "async": inspect.iscoroutinefunction(fn),
    }


def _error_payload(error: BaseException) -> dict[str, Any]:
    message = redact_text(str(error), Scrubber(_secret_env_values()))
    return {"type": type(error).__name__, "message": message[:2000]}


# --------------------------------------------------------------------------- model calls

_SDK_MODULES = ("openai", "anthropic", "google.genai")
CAPTURE_MODES = ("auto", "always", "never")


class _LlmCapture:
    """The recording proxy for the tracked runs of this process.

    While a tracked call runs, OPENAI_BASE_URL and ANTHROPIC_BASE_URL point at an in-process
    `jukebox.llm` proxy (the booth's code path), so SDK clients made inside the call send their
    requests through it; each exchange becomes an llm_turn frame on the innermost open
    transaction's tape, or on a tape of the run's own. The variables are process-wide: calls
    overlapping in time share the proxy, and the innermost one started receives the frames.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: list[Run] = []
        self._proxy: Any = None
        self._saved: dict[str, str | None] = {}
        self.pinned = False  # a B side's proxy: stays up between its runs, stopped by it

    @property
    def proxy(self) -> Any:
        """The running proxy, or None."""
        return self._proxy

    def _start(self, tape_dir: Path, **options: Any) -> None:
        from jukebox.llm.pricing import PriceTable
        from jukebox.llm.server import ProxyServer, upstreams_from_env

        proxy = ProxyServer(
            upstreams=options.pop("upstreams", None) or upstreams_from_env(os.environ),
            record=self._record,
            record_inline=True,  # a transaction's writer writes; its sync is its own
            breaker=_RunBreaker(self),
            on_trip=self._on_trip,
            secrets=_secret_env_values(),
            prices=PriceTable.load(tape_dir, os.environ),
            **options,
        ).start()
        self._proxy = proxy
        for name, url in proxy.base_urls().items():
            self._saved[name] = os.environ.get(name)
            os.environ[name] = url

    def _stop(self) -> Any:
        proxy, self._proxy = self._proxy, None
        for name, old in self._saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        self._saved.clear()
        return proxy

    def enter(self, run: Run, tape_dir: Path) -> None:
        with self._lock:
            self._runs.append(run)
            if self._proxy is None:
                self._start(tape_dir)

    def leave(self, run: Run) -> None:
        with self._lock:
            if run in self._runs:
                self._runs.remove(run)
            if self._runs or self._proxy is None or self.pinned:
                return
            proxy = self._stop()
        proxy.stop()

    @contextlib.contextmanager
    def pin(
        self,
        tape_dir: Path,
        replay: Any,
        rewriter: Any,
        upstreams: Mapping[str, str],
        on_divergence: Callable[[Any], Any],
    ) -> Iterator[None]:
        """A proxy that serves `replay` and sends live calls, rewritten, to `upstreams`, for
        the tracked runs started meanwhile (a B side's re-execution)."""
        with self._lock:
            if self._proxy is not None or self._runs:
                raise RuntimeError(
                    "replay_and_diff cannot run while a tracked call is running in this "
                    "process (they would share one proxy): call it outside tracked functions"
                )
            self._start(
                tape_dir, upstreams=upstreams, replay=replay, rewriter=rewriter,
                on_divergence=on_divergence,
            )  # fmt: skip
            self.pinned = True
        try:
            yield
        finally:
            with self._lock:
                self.pinned = False
                self._runs.clear()
                proxy = self._stop()
            proxy.stop()

    def run(self) -> Run | None:
        with self._lock:
            return self._runs[-1] if self._runs else None

    def _record(self, kind: str, payload: dict[str, Any]) -> Any:
        run = self.run()
        log = run.current() if run is not None else None
        if log is None:
            return None
        return log.append(kind, payload)

    def _on_trip(self, trip: Any) -> None:
        run = self.run()
        log = run.current() if run is not None else None
        if log is not None:
            log.append("breaker", {**trip.to_payload(), "source": "llm"}, durable=True)


class _RunBreaker:
    """The proxy's breaker: whichever tracked run is current owns the budget."""

    def __init__(self, capture: _LlmCapture) -> None:
        self._capture = capture

    def _breaker(self) -> CircuitBreaker | None:
        run = self._capture.run()
        return run.breaker if run is not None else None

    def admit(self, reservation: Any = None) -> Any:
        b = self._breaker()
        return b.admit(reservation) if b is not None else None

    @property
    def unknown_cost(self) -> str | None:
        b = self._breaker()
        return b.unknown_cost if b is not None else None

    @property
    def max_cost_usd(self) -> float | None:
        b = self._breaker()
        return b.max_cost_usd if b is not None else None

    def release(self, reservation: Any) -> None:
        # Whichever run held it: a reservation not held is ignored.
        b = self._breaker()
        if b is not None:
            b.release(reservation)

    def observe(self, **kwargs: Any) -> Any:
        b = self._breaker()
        return b.observe(**kwargs) if b is not None else None


_capture = _LlmCapture()


def _wants_capture(mode: str) -> bool:
    if mode == "always":
        return True
    if mode == "never":
        return False
    import sys

    return any(m in sys.modules for m in _SDK_MODULES)


# Tracked functions of this process by (import path, file): a B side re-executes the very
# function object when it is still alive here (notebooks, tests, functions defined in a body).
_tracked: weakref.WeakValueDictionary[tuple[str, str | None], Any] = (
    weakref.WeakValueDictionary()
)


# --------------------------------------------------------------------------- Jukebox


class Jukebox:
    """One tape dir, a sandbox policy and a breaker: the factory for tracked runs and
    transactions. Opening it settles any commit a killed process left midway."""

    def __init__(
        self,
        tape_dir: str | os.PathLike[str] | None = None,
        sandbox: SandboxPolicy | None = None,
        breaker: CircuitBreaker | None = None,
        *,
        capture_llm: str = "auto",
    ) -> None:
        if capture_llm not in CAPTURE_MODES:
            raise ValueError(
                f"unknown capture_llm {capture_llm!r}: use 'auto' (record OpenAI and Anthropic "
                "SDK calls when an SDK is imported), 'always' or 'never'"
            )
        self.capture_llm = capture_llm
        if sandbox is None:
            sandbox = SandboxPolicy()
        elif not isinstance(sandbox, SandboxPolicy):
            raise TypeError(
                f"sandbox must be a SandboxPolicy, got {type(sandbox).__name__}: "
                "pass sandbox=SandboxPolicy(filesystem=..., mcp_mode=...)"
            )
        if breaker is not None and not isinstance(breaker, CircuitBreaker):
            raise TypeError(
                f"breaker must be a CircuitBreaker, got {type(breaker).__name__}: "
                "pass breaker=CircuitBreaker(max_cost_usd=...)"
            )
        path = Path(tape_dir) if tape_dir is not None else default_tape_dir()
        # Absolute now, so a later chdir by the agent does not move the tapes.
        self.tapes = TapeDir(Path(os.path.abspath(path)))
        self.sandbox = sandbox
        self.breaker = breaker
        self.recovered: list[tuple[str, str]] = []
        self._store: Store | None = None
        self._lock = threading.Lock()
        self.tapes.path.mkdir(parents=True, exist_ok=True)
        state = self.tapes.state
        if (state / "commits").is_dir() or (state / "scratch").is_dir():
            self.recovered = recover_commits(self.tapes, self.store)

    @property
    def tape_dir(self) -> Path:
        return self.tapes.path

    @property
    def store(self) -> Store:
        """The tape dir's content-addressed store, opened on first use."""
        if self._store is None:
            with self._lock:
                if self._store is None:
                    from shadowfs.store import Store

                    store = Store.open(self.tapes.store_path, create=True)
                    # Flushed and unlocked at exit even if nobody calls close().
                    weakref.finalize(self, store.close)
                    self._store = store
        return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None

    def __enter__(self) -> Jukebox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Jukebox(tape_dir={str(self.tapes.path)!r}, sandbox={self.sandbox!r})"

    # -- transactions --------------------------------------------------------------------------

    def transaction(
        self,
        tape_id: str | None = None,
        *,
        name: str | None = None,
        state: Mapping[str, Any] | StateVersion | None = None,
    ) -> Transaction:
        """A new transaction; use it with ``with`` or ``async with``.

        tape_id: the tape's id (default ``tr_<8 hex>``); reusing an id moves the earlier tape to
        ``<id>.<n>.jbx``. name: the agent name `jukebox ls` shows (default: the tracked run's).
        state: the memory to start from.
        """
        return Transaction(
            tapes=self.tapes,
            store_factory=lambda: self.store,
            tape_id=tape_id,
            name=name,
            filesystem=self.sandbox.filesystem,
            mcp_mode=self.sandbox.mcp_mode,
            root=self.sandbox.root,
            scratch_limit=self.sandbox.max_scratch_bytes,
            breaker=self.breaker,
            policy=self.sandbox.describe(),
            initial_state=state,
        )

    # -- tracking ------------------------------------------------------------------------------

    def track(self, fn: F | None = None, *, name: str | None = None) -> Any:
        """Decorate a sync or async function as a tracked agent run (``@jb.track`` or
        ``@jb.track(name=...)``)."""

        def decorate(f: F) -> F:
            if inspect.isasyncgenfunction(f) or inspect.isgeneratorfunction(f):
                raise TypeError(
                    f"@track cannot wrap the generator {f.__qualname__}: track a function that "
                    "returns its result"
                )
            run_name = name or str(getattr(f, "__qualname__", "agent"))
            function = describe_function(f)

            if inspect.iscoroutinefunction(f):

                @functools.wraps(f)
                async def run_async(*args: Any, **kwargs: Any) -> Any:
                    run, token = self._begin(run_name, function, f, args, kwargs)
                    try:
                        result = await f(*args, **kwargs)
                    except BaseException as error:
                        self._end(run, token, {"code": 1, "error": _error_payload(error)})
                        raise
                    self._end(run, token, {"code": 0, "result": _result(result)})
                    return result

                wrapper: Any = run_async
            else:

                @functools.wraps(f)
                def run_sync(*args: Any, **kwargs: Any) -> Any:
                    run, token = self._begin(run_name, function, f, args, kwargs)
                    try:
                        result = f(*args, **kwargs)
                    except BaseException as error:
                        self._end(run, token, {"code": 1, "error": _error_payload(error)})
                        raise
                    self._end(run, token, {"code": 0, "result": _result(result)})
                    return result

                wrapper = run_sync
            wrapper.__jukebox_track__ = {"name": run_name, **function}
            _tracked[(function["import_path"], function["file"])] = wrapper
            return wrapper

        return decorate(fn) if fn is not None else decorate

    def _begin(
        self,
        run_name: str,
        function: dict[str, Any],
        f: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Run, Any]:
        run = Run(
            id="run_" + secrets.token_hex(6),
            name=run_name,
            function=function,
            args=describe_call(f, args, kwargs),
            breaker=CircuitBreaker(**self.breaker.limits) if self.breaker is not None else None,
            fallback=self._run_tape,
        )
        redirect = current_redirect.get()
        if redirect is not None:
            # A B side: the run's own tape (model calls outside transactions) is redirected too.
            run.redirect = redirect
            run.fallback = lambda r: _open_run_tape(
                redirect.tapes, redirect.store, r, redirect.open_log(0)
            )
        token = current_run.set(run)
        if _wants_capture(self.capture_llm) or _capture.pinned:
            try:
                _capture.enter(run, self.tapes.path)
            except BaseException:
                current_run.reset(token)
                raise
        return run, token

    def _end(self, run: Run, token: Any, payload: dict[str, Any]) -> None:
        current_run.reset(token)
        try:
            _capture.leave(run)
        finally:
            run.finish({**payload, "run": run.id})

    def _run_tape(self, run: Run) -> TapeLog:
        return _open_run_tape(self.tapes, self.store, run)


def _open_run_tape(
    tapes: TapeDir, store: ObjectStore, run: Run, log: TapeLog | None = None
) -> TapeLog:
    """A tape for a run's model calls made outside any transaction (``transaction: 0``)."""
    tape_id = new_tape_id()
    if log is None:
        path, _ = claim_tape_path(tapes, tape_id)
        log = TapeLog(path, store, tape_id)
    log.append(
        "run_start",
        {
            "tape_id": tape_id,
            "name": run.name,
            "cwd": os.getcwd(),
            "pid": os.getpid(),
            "run": {"id": run.id, "function": run.function, "args": run.args, "transaction": 0},
        },
    )
    return log


def _result(value: Any) -> Any:
    safe, _ = _scrub(_json_safe(value), _secret_env_values())
    return safe


_default: Jukebox | None = None
_default_lock = threading.Lock()


def default_jukebox() -> Jukebox:
    """The Jukebox module-level `track` uses: in the default tape dir (`default_tape_dir`)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Jukebox(tape_dir=None)
        return _default


def track(fn: F | None = None, *, name: str | None = None) -> Any:
    """``@jukebox.track``: `Jukebox.track` on the default Jukebox (created on the first call of
    a tracked function, so decorating costs nothing)."""

    def decorate(f: F) -> F:
        tracked: dict[str, Any] = {}

        def resolve() -> Any:
            if "fn" not in tracked:
                tracked["fn"] = default_jukebox().track(f, name=name)
            return tracked["fn"]

        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def lazy_async(*args: Any, **kwargs: Any) -> Any:
                return await resolve()(*args, **kwargs)

            # the wrapper keeps f's signature (functools.wraps), which mypy cannot see
            return lazy_async  # type: ignore[return-value]

        @functools.wraps(f)
        def lazy(*args: Any, **kwargs: Any) -> Any:
            return resolve()(*args, **kwargs)

        # the wrapper keeps f's signature (functools.wraps), which mypy cannot see
        return lazy  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


# --------------------------------------------------------------------------- tapes and forks


def _open_store_for(path: Path) -> Any:
    from shadowfs.store import Store

    store_path = TapeDir(path.parent).store_path
    if not (store_path / "packs").is_dir():
        raise ValueError(
            f"no store beside {path} ({store_path}): a tape is replayed in the tape dir it "
            "was recorded in; copy the whole tape dir, .jukebox included"
        )
    return Store.open(store_path, create=False)


class Tape(_tape.Tape):
    """A loaded tape (`jukebox.tape.tape.Tape`) that can also be forked and replayed."""

    def fork(
        self,
        at_frame: int,
        override_model: str | Mapping[str, str] | None = None,
        override_system_prompt: str | None = None,
        *,
        tape_id: str | None = None,
    ) -> BSide:
        """Plan a B side: frames 0..at_frame-1 shared with this tape, then the tracked function
        re-executed with the overrides. Nothing is written until `BSide.replay_and_diff`.

        `override_model` is per provider, as `jukebox fork --model` is: ``{"openai": "gpt-4.1",
        "anthropic": "claude-…"}``, or a bare name for the provider of the frame forked at (for
        every provider when the tape has no model call); see `jukebox.llm.model_override`."""
        n = len(self.frames)
        if isinstance(at_frame, bool) or not isinstance(at_frame, int) or not 1 <= at_frame <= n:
            raise ValueError(
                f"cannot fork {os.fspath(self.path)} at frame {at_frame!r}: it has {n} frames "
                f"(0..{n - 1}), so fork at 1..{n}"
            )
        if tape_id is not None:
            check_tape_id(tape_id)
        from jukebox.errors import UsageError
        from jukebox.llm.model_override import resolve

        try:
            model = resolve(override_model, self, at_frame)
        except UsageError as error:
            raise ValueError(str(error)) from None
        start = self.frames[0].payload if self.frames else {}
        run = start.get("run") if isinstance(start, dict) else None
        return BSide(
            origin=self,
            at_frame=at_frame,
            override_model=model,
            override_system_prompt=override_system_prompt,
            tape_id=tape_id or new_tape_id(),
            function=run.get("function") if isinstance(run, dict) else None,
            arguments=run.get("args") if isinstance(run, dict) else None,
        )


@dataclass
class BSide:
    """A planned fork of a tape (see `Tape.fork`)."""

    origin: Tape
    at_frame: int
    override_model: str | dict[str, str] | None  # as resolved: see `Tape.fork`
    override_system_prompt: str | None
    tape_id: str
    function: dict[str, Any] | None
    arguments: dict[str, Any] | None

    @property
    def path(self) -> Path:
        return Path(os.fspath(self.origin.path)).parent / f"{self.tape_id}.jbx"

    @property
    def overrides(self) -> dict[str, Any]:
        pairs = (("model", self.override_model), ("system_prompt", self.override_system_prompt))
        return {k: v for k, v in pairs if v is not None}

    def replay_and_diff(self, endpoint: str | Mapping[str, str] | None = None) -> Report:
        """Re-execute the tracked function from `at_frame` and compare the two sides.

        Model calls before `at_frame` are answered from the tape; later ones go to ``endpoint``
        (a base URL such as ``http://127.0.0.1:8000/v1``, or ``{"openai": url, "anthropic":
        url}``; default: OPENAI_BASE_URL / ANTHROPIC_BASE_URL, else the public APIs) with the
        overrides applied. Files live in a scratch copy of the tape's base tree; the B side is
        the tape at `path`. See `jukebox.api.bside` for what is matched and what a divergence does.
        """
        if self.function is None:
            raise ValueError(
                f"{os.fspath(self.origin.path)} was not recorded by a @jb.track function, so "
                "there is nothing to re-execute: fork tapes whose run_start names a function"
            )
        from jukebox.api import bside

        origin_path = Path(os.path.abspath(os.fspath(self.origin.path)))
        store = _open_store_for(origin_path)
        try:
            outcome = bside.reexecute(
                origin_path,
                store,
                self.at_frame,
                tape_id=self.tape_id,
                overrides=self.overrides,
                endpoint=endpoint,
                registry=_tracked,
                capture=_capture,
            )
            a = _tape.Tape.load(origin_path, store)
            b = _tape.Tape.load(outcome.tape_path, store)
            report = Report.of(compare_tapes(a, b, store), outcome.to_json())
        finally:
            store.close()
        return report


# --------------------------------------------------------------------------- reports


@dataclass
class Report(Comparison):
    """`jukebox.tape.compare.Comparison` (frames, models, messages, tool calls, files, tokens,
    cost) plus, for a B side, how its re-execution went."""

    reexecution: dict[str, Any] | None = None

    @classmethod
    def of(cls, comparison: Comparison, reexecution: dict[str, Any] | None = None) -> Report:
        fields = {k: getattr(comparison, k) for k in comparison.__dataclass_fields__}
        return cls(**fields, reexecution=reexecution)

    @classmethod
    def between(
        cls, a: _tape.Tape | str | os.PathLike[str], b: _tape.Tape | str | os.PathLike[str]
    ) -> Report:
        """Compare two recorded tapes of one tape dir (paths or loaded tapes)."""
        pa = Path(os.fspath(a.path if isinstance(a, _tape.Tape) else a))
        pb = Path(os.fspath(b.path if isinstance(b, _tape.Tape) else b))
        store = _open_store_for(pa)
        try:
            return cls.of(compare_tapes(Tape.load(pa, store), Tape.load(pb, store), store))
        finally:
            store.close()

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if self.reexecution is not None:
            out["reexecution"] = self.reexecution
        return out

    def to_markdown(self) -> str:
        text = super().to_markdown()
        r = self.reexecution
        if r is None:
            return text
        at = r["at"]
        lines = ["## Re-execution", ""]
        if r["difference"]:
            lines.append(f"**Diverged**: {r['difference']}")
            lines.append("")
            lines.append("B holds the shared frames, the fork frame and a note; nothing after.")
        else:
            lines.append(
                f"B re-ran the tracked function: its first {at} frame(s) matched A's frames "
                f"0..{at - 1} (shared, not rewritten), the rest of B is the new run, made in a "
                "scratch copy of A's base tree (the real tree was not touched)."
            )
        if r.get("error"):
            lines.append("")
            lines.append(f"The function raised {r['error']['type']}: {r['error']['message']}")
        head, sep, rest = text.partition("\n## ")
        return head + "\n" + "\n".join(lines) + "\n" + sep + rest
