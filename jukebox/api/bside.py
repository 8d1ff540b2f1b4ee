"""The B side of a fork: a tracked function re-executed from a tape's frame N with overrides.

`reexecute(origin, store, at, ...)` (behind `jukebox.api.api.BSide.replay_and_diff`) calls the
function `@jb.track` recorded in the tape's run_start (its import path and JSON arguments) once
more, in this process, with every effect redirected:

* files: each transaction of the re-executed run gets as its root a scratch copy of the tape's
  base tree (materialized from the store into a temporary directory, removed afterwards); the
  working directory is the recorded one inside that copy. Commits land in the copy: nothing
  touches the real tree or the real tape dir's tapes. The tape dir keeps its place relative to
  the root (a ``tapes/`` inside the copy), so relative paths resolve as they did when recorded.
* model calls: the in-process proxy serves the tape's recorded responses for calls before frame
  N (`ReplaySource`, strict: a request that differs is a divergence) and sends every later call
  to the given endpoint (default: the user's OPENAI_BASE_URL / ANTHROPIC_BASE_URL, else the
  public APIs) with the overrides applied (`RequestRewriter`).
* the tape: the B side is a new tape beside the original sharing frames 0..N-1 byte for byte
  (`TapeWriter.fork_from`); frame N is a `fork` frame holding the overrides. The re-executed
  transaction (the one whose rank in the run matches the original's) writes through `ForkLog`:
  its first N frames are *matched* against the original's (kind, the payload fields that say
  what the agent did, the files by content) and not written again; the frames after them are
  appended. Other transactions of the run write throwaway tapes in the scratch tape dir.

The first frame that differs before N ends the re-execution the way Temporal reports
non-determinism: a `note` frame (`event: fork_exec_failed`) on the B side names the frame, what
was expected and what came; `ReplayDiverged` is raised inside the agent's code so it stops
there; the proxy refuses every later model call, so nothing goes live after a divergence.

Overrides and agent turns: the model override changes what model calls are sent with. A turn the
agent records itself (`tx.record_agent_turn(model=...)`) is not a model call: after the fork it
is written as the agent wrote it plus ``model_override``, so the report shows the model in effect
for the B side without pretending a call was made with it.

One re-execution at a time per process, and not while another tracked call runs: the proxy's
base URLs and the working directory are process-wide.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jukebox.api.transaction import TapeLog, _relative, current_redirect
from jukebox.errors import CheckFailed
from jukebox.tape.frame import Frame
from jukebox.tape.tape import Tape, TapeWriter
from jukebox.tape.tapedir import TapeDir

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader, ObjectStore

# Payload fields that say what the agent did, per frame kind; the rest (times, pids, paths of
# the scratch copy, journal ids) differs between any two runs.
COMPARED: dict[str, tuple[str, ...]] = {
    "run_start": ("name", "policy"),
    "agent_turn": ("agent", "text", "model", "cost_usd", "tokens", "tool_calls", "failed"),
    "fs": ("op", "path", "bytes"),
    "checkpoint": ("id", "label"),
    "rollback": ("to", "label", "final", "reason"),
    "commit": ("changes",),
    "breaker": ("rule",),
    "tool_call": ("tool", "args", "result", "ok"),
    "llm_turn": ("provider", "endpoint", "model", "status"),
    "exit": ("code", "result", "error"),
}
SHOW = 100


class ReplayDiverged(CheckFailed):
    """The re-executed function stopped matching its tape before the fork point."""


@dataclass
class Reexecution:
    """What happened when the function ran again."""

    tape_path: Path
    at: int
    matched: int  # prefix frames the re-execution reproduced
    difference: str | None
    result: Any = None
    error: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "tape_path": os.fspath(self.tape_path),
            "at": self.at,
            "matched": self.matched,
            "difference": self.difference,
            "result": self.result,
            "error": self.error,
        }


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return text if len(text) <= SHOW else text[: SHOW - 3] + "..."


def _same(a: Any, b: Any) -> bool:
    return _short_full(a) == _short_full(b)


def _short_full(value: Any) -> str:
    # Through JSON both ways, so a tuple and a list, or 420 and 420.0, compare as a tape would.
    return json.dumps(json.loads(json.dumps(value, default=str)), sort_keys=True)


def mismatch(store: ObjectReader, want: Frame, kind: str, payload: Mapping[str, Any],
             tree: Any) -> str | None:
    """Why a re-executed frame is not the recorded one, or None when it is."""
    if want.kind != kind:
        return f"expected a {want.kind} frame, got a {kind} frame"
    recorded = want.resolve_payload(store)
    for key in COMPARED.get(kind, ()):
        if not _same(recorded.get(key), payload.get(key)):
            want_value, got_value = _short(recorded.get(key)), _short(payload.get(key))
            return f"{kind} {key} differs: expected {want_value}, got {got_value}"
    if kind == "llm_turn" and payload.get("replayed_from") is None:
        return "the model call was not answered from the tape"
    if want.tree is not None and tree is not None:
        from jukebox.timetravel.timetravel import same_files

        paths = same_files(store, want.tree, tree)
        if paths:
            more = f" and {len(paths) - 8} more" if len(paths) > 8 else ""
            return f"{kind} files differ: {', '.join(paths[:8])}{more}"
    return None


class ForkLog(TapeLog):
    """The B side's tape as the re-executed transaction sees it (see the module docstring)."""

    def __init__(self, reexec: _Session, writer: TapeWriter) -> None:
        # Not TapeLog.__init__: the fork writer already exists (made by fork_from).
        self.writer = writer
        self.path = Path(os.fspath(writer.path))
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self._session = reexec
        self._count = 0
        self._closed = False

    def append(self, kind: str, payload: Mapping[str, Any], *, durable: bool = False,
               **kw: Any) -> Frame:
        s = self._session
        with s.lock:
            i, self._count = self._count, self._count + 1
            if s.difference is not None:
                return s.sink(kind, payload, kw)
            if i < s.at and kind == "note" and payload.get("event") == "divergence":
                # The proxy's report of a model request that differs from the tape's; the SDK
                # call already failed with it, so the agent needs no exception from here.
                s.diverge(
                    f"the re-execution diverged before the fork at frame {s.at}: "
                    f"{payload.get('message')}"
                )
                return s.sink(kind, payload, kw)
            if i < s.at:
                want = s.origin.frames[i]
                why = mismatch(s.store, want, kind, payload, kw.get("tree"))
                if why is None:
                    s.matched = i + 1
                    return want  # the B side's frame i is this one, shared byte for byte
                message = (
                    f"the re-execution diverged at frame {i} of {s.origin_id}, before the fork "
                    f"at frame {s.at}: {why}"
                )
                s.diverge(message)
                s.sink(kind, payload, kw)
                raise ReplayDiverged(message)
            if kind == "agent_turn" and s.model_override is not None:
                payload = {**payload, "model_override": s.model_override}
            frame = self.writer.append(kind, payload, **kw)
        if durable:
            self.sync()
        return frame

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            super().close()


class _Session:
    """One re-execution's shared state: the origin, the match position, the divergence."""

    def __init__(self, origin: Tape, store: ObjectStore, at: int, writer: TapeWriter, scratch: Path,
                 model_override: str | None) -> None:
        self.origin = origin
        self.origin_id = origin.tape_id or Path(os.fspath(origin.path)).stem
        self.store = store
        self.at = at
        self.model_override = model_override
        self.lock = threading.RLock()
        self.matched = 0
        self.difference: str | None = None
        self.log = ForkLog(self, writer)
        self.log_taken = False
        self.source: Any = None
        self._scratch = scratch
        self._sink: TapeWriter | None = None

    def sink(self, kind: str, payload: Mapping[str, Any], kw: dict[str, Any]) -> Frame:
        """Somewhere real for frames after a divergence to go (thrown away with the scratch)."""
        if self._sink is None:
            self._sink = TapeWriter.create(self._scratch / "diverged.jbx", self.store,
                                           "diverged", fsync=False)  # fmt: skip
        return self._sink.append(kind, payload, **kw)

    def diverge(self, message: str) -> None:
        with self.lock:
            if self.difference is not None:
                return
            self.difference = message
            if self.source is not None:
                self.source.halt(message)
            note = {"event": "fork_exec_failed", "message": message}
            if not self.log._closed:
                self.log.writer.append("note", note)
            else:
                with TapeWriter.open_append(self.log.path, self.store) as writer:
                    writer.append("note", note)

    def on_llm_divergence(self, divergence: Any) -> None:
        self.diverge(f"the re-execution diverged before the fork at frame {self.at}: "
                     f"{divergence.message()}")  # fmt: skip

    def close(self) -> None:
        self.log.close()
        if self._sink is not None:
            self._sink.close()


@dataclass
class Redirect:
    """What `jukebox.api.transaction` and `jukebox.api.api` read from `current_redirect`."""

    root: str
    tapes: TapeDir
    store: ObjectStore
    target: int  # the rank of the transaction the origin tape recorded (0: the run's own tape)
    session: _Session

    def open_log(self, rank: int) -> TapeLog | None:
        s = self.session
        if rank != self.target or s.log_taken:
            return None
        s.log_taken = True
        return s.log


# --------------------------------------------------------------------------- the function


def resolve_function(
    function: Mapping[str, Any], registry: Mapping[Any, Any], tape_dir: Path | None = None
) -> Callable:
    """The tracked callable a run_start names: this process's own, else imported. A file the
    tape names inside `tape_dir` (what someone sent along with the tape) is never loaded."""
    import_path = str(function.get("import_path"))
    file = function.get("file")
    if isinstance(file, str) and tape_dir is not None:
        real, home = os.path.realpath(file), os.path.realpath(tape_dir)
        if real == home or real.startswith(home.rstrip("/") + "/"):
            raise ValueError(
                f"cannot re-execute {import_path}: the tape names its file {file}, inside the "
                "tape dir itself; a tape's function is only run from code this machine has"
            )
    found = registry.get((import_path, file))
    if found is not None:
        return found
    module_name = str(function.get("module"))
    qualname = str(function.get("qualname"))
    if "<locals>" in qualname:
        raise ValueError(
            f"cannot re-execute {import_path}: it was defined inside another function, so it "
            "can only be found in the process that defined it; define it at module level or "
            "fork from that process"
        )
    module = _module(module_name, file if isinstance(file, str) else None, import_path)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(
                f"cannot re-execute {import_path}: {module_name} has no {qualname} any more; "
                "restore the function or fork a tape it recorded"
            )
    return obj


def _module(name: str, file: str | None, import_path: str) -> Any:
    main = sys.modules.get("__main__")
    if name == "__main__":
        main_file = getattr(main, "__file__", None)
        if file and main_file and os.path.realpath(main_file) == os.path.realpath(file):
            return main
    else:
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    if not file or not os.path.isfile(file):
        raise ValueError(
            f"cannot re-execute {import_path}: its module is not importable and its file "
            f"{file or '(unknown)'} is gone; run from where the module can be imported"
        )
    # A script run as __main__: loaded again under a name of its own, so its
    # `if __name__ == "__main__":` block does not run.
    alias = "_jukebox_bside_" + "".join(c if c.isalnum() else "_" for c in file)
    if alias in sys.modules:
        return sys.modules[alias]
    spec = importlib.util.spec_from_file_location(alias, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot re-execute {import_path}: {file} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    sys.path.insert(0, os.path.dirname(file))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(alias, None)
        raise
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(os.path.dirname(file))
    return module


def call_arguments(fn: Callable, values: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The recorded arguments (bound by name, defaults applied) as a call again."""
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if not params or not set(values) <= set(params):
        return list(values.values()), {}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for name, param in params.items():
        if name not in values:
            continue
        value = values[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            args.extend(value)
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            kwargs.update(value)
        elif param.kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


def _run(fn: Callable, args: list[Any], kwargs: dict[str, Any]) -> Any:
    result = fn(*args, **kwargs)
    if not inspect.isawaitable(result):
        return result

    async def wait() -> Any:
        return await result

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    # Called from inside an event loop (a notebook, an async agent): run on a loop of its own.
    box: dict[str, Any] = {}
    ctx = contextvars.copy_context()

    def worker() -> None:
        try:
            box["value"] = ctx.run(asyncio.run, wait())
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=worker, name="jukebox-bside")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


# --------------------------------------------------------------------------- the scratch copy


@contextlib.contextmanager
def _scratch(store: ObjectReader, start: Mapping[str, Any], tape_dir: Path
             ) -> Iterator[tuple[Path, str, str, TapeDir]]:
    """(temp dir, root, cwd, scratch tape dir): the base tree copied, removed afterwards."""
    from shadowfs.oid import ObjectId
    from shadowfs.tree import materialize

    temp = Path(tempfile.mkdtemp(prefix="jukebox-bside-"))
    try:
        root = temp / "tree"
        base = start.get("base_tree")
        if isinstance(base, str):
            materialize(store, ObjectId.from_hex(base), root)
        else:
            root.mkdir()  # a run's own tape (no transaction): nothing recorded to copy
        recorded_root = start.get("root")
        recorded_cwd = start.get("cwd")
        cwd = str(root)
        tapes = TapeDir(temp / "tapes")
        if isinstance(recorded_root, str):
            if isinstance(recorded_cwd, str):
                rel = _relative(os.path.realpath(recorded_cwd), recorded_root)
                if rel is not None and os.path.isdir(root / rel):
                    cwd = os.path.normpath(root / rel)
            rel = _relative(os.path.realpath(tape_dir), recorded_root)
            if rel is not None:
                tapes = TapeDir(root / rel)
        tapes.path.mkdir(parents=True, exist_ok=True)
        yield temp, str(root), cwd, tapes
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def _chdir(path: str) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


# --------------------------------------------------------------------------- the re-execution


def upstreams_for(endpoint: str | Mapping[str, str] | None) -> dict[str, str]:
    """Where calls after the fork go: a mapping per provider, one base URL for both (the
    OpenAI-style ``.../v1``; Anthropic calls go to it without ``/v1``), or the environment's."""
    from jukebox.llm.upstreams import upstreams_from_env

    out = upstreams_from_env(os.environ)
    if endpoint is None:
        return out
    if isinstance(endpoint, Mapping):
        unknown = set(endpoint) - set(out)
        if unknown:
            raise ValueError(
                f"unknown provider(s) {sorted(unknown)} in endpoint: use {sorted(out)}"
            )
        return {**out, **{k: str(v).rstrip("/") for k, v in endpoint.items()}}
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise ValueError(
            f"endpoint must be an http(s) base URL such as http://127.0.0.1:8000/v1, or a "
            f"mapping {{'openai': url, 'anthropic': url}}; got {endpoint!r}"
        )
    base = endpoint.rstrip("/")
    root = base[: -len("/v1")] if base.endswith("/v1") else base
    return {"openai": root + "/v1", "anthropic": root}


def reexecute(
    origin_path: Path,
    store: ObjectStore,
    at: int,
    *,
    tape_id: str,
    overrides: Mapping[str, Any],  # model: {provider: model} or a string (model_override)
    endpoint: str | Mapping[str, str] | None,
    registry: Mapping[Any, Any],
    capture: Any,
) -> Reexecution:
    """Runs the B side (see the module docstring); returns what happened. The B side's tape is
    at `Reexecution.tape_path` whatever happened (with a note when it diverged)."""
    from jukebox.llm.model_override import model_label
    from jukebox.llm.replay import ReplaySource
    from jukebox.llm.rewrite import RequestRewriter

    origin = Tape.load(origin_path, store)
    origin.check_chain()  # a damaged tape says nothing we may act on
    start = origin.frames[0].payload
    run = start["run"] if isinstance(start.get("run"), dict) else {}
    function = run["function"] if isinstance(run.get("function"), dict) else None
    arguments = run["args"] if isinstance(run.get("args"), dict) else None
    if function is None or arguments is None:
        raise ValueError(
            f"{origin_path} was not recorded by a @jb.track function, so there is nothing to "
            "re-execute: fork tapes whose run_start names a function"
        )
    if not arguments.get("replayable", True):
        hidden = sorted({*arguments.get("redacted", []), *arguments.get("opaque", [])})
        raise ValueError(
            f"cannot re-execute {function.get('import_path')}: the tape holds no usable value "
            f"for argument(s) {', '.join(hidden)} (redacted as secrets or not JSON); "
            "pass them some other way than as arguments (the environment, say)"
        )
    target = run.get("transaction")
    if not isinstance(target, int):
        target = 1 if start.get("root") is not None else 0  # tapes from before ranks existed
    upstreams = upstreams_for(endpoint)
    tapes = TapeDir(origin_path.parent)
    # Found from the caller's cwd, before the scratch copy of the tape's tree becomes the cwd:
    # an import there would run code the tape dir brought (see docs/reliability.md).
    fn = resolve_function(function, registry, tapes.path)
    args, kwargs = call_arguments(fn, arguments.get("values") or {})
    new_path = tapes.tape_path(tape_id)
    if new_path.exists():
        raise ValueError(f"a tape {tape_id!r} already exists in {tapes.path}: fork again")
    extra = {"overrides": dict(overrides), "exec": True, "via": "replay_and_diff",
             "function": function.get("import_path")}  # fmt: skip
    writer = TapeWriter.fork_from(origin, at, new_path, tape_id, store=store, extra=extra)
    outcome = Reexecution(new_path, at, 0, None)
    with _scratch(store, start, tapes.path) as (temp, root, cwd, scratch_tapes):
        model = overrides.get("model")
        shown = model_label(model) if model is not None else None
        session = _Session(origin, store, at, writer, temp, shown)
        session.source = ReplaySource.from_tape(origin, store, mode="strict", until=at - 1)
        redirect = Redirect(root, scratch_tapes, store, target, session)
        rewriter = RequestRewriter(
            model=overrides.get("model"), system_prompt=overrides.get("system_prompt")
        )
        try:
            with (
                capture.pin(tapes.path, session.source, rewriter, upstreams,
                               session.on_llm_divergence),
                _chdir(cwd),
            ):  # fmt: skip
                token = current_redirect.set(redirect)
                try:
                    outcome.result = _run(fn, args, kwargs)
                except ReplayDiverged:
                    pass
                except Exception as error:  # the agent's own failure is part of the B side
                    outcome.error = {"type": type(error).__name__, "message": str(error)[:2000]}
                finally:
                    current_redirect.reset(token)
            with session.lock:
                if session.difference is None and not session.log_taken:
                    session.diverge(
                        f"the re-execution never opened transaction #{target} of the run, "
                        f"which {session.origin_id} recorded: nothing to fork"
                    )
                elif session.difference is None and session.matched < at:
                    session.diverge(
                        f"the re-execution diverged before the fork at frame {at}: it ended "
                        f"after reproducing {session.matched} of the {at} frame(s) before it"
                    )
        except BaseException:
            session.close()
            if not session.log_taken:
                new_path.unlink(missing_ok=True)  # the function never ran: no B side
            raise
        session.close()
    outcome.matched = session.matched
    outcome.difference = session.difference
    return outcome
