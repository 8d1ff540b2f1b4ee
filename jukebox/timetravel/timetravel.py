"""Time travel: re-executing a recorded booth run (`replay --exec`) and forking it (`fork`).

**Replay.** `replay_exec` re-runs the tape's recorded argv in a fresh booth whose tree is a
temporary directory holding the recorded base tree (materialized from the tape dir's store; the
recorded cwd relative to the tree is kept; argv words naming the recorded tree are pointed at
the copy). The agent gets no network (`--net none`), the proxy serves the recorded responses
(`ReplaySource`: strict or loose) and has no reachable upstream unless `until` is given, the
booth ends discarded (a `discard` frame, never a pending booth) and the temporary tree is
removed: nothing reaches the user's tree. The run is recorded as a new tape
`<id>-replay-<n>` beside the original (removed again with `record=False`).

The replay is checked against the tape in the manner of Temporal's non-determinism errors: the
first difference ends it (the agent is stopped there) and is reported with the original frame,
what was expected, what came and a compact diff. Differences looked for, in run order: a model
request that does not match (`Divergence` from the proxy), a checkpoint whose label or files
differ from the recorded checkpoint of the same rank (timer checkpoints are not compared: their
timing is not the agent's), fewer or more checkpoints, different final files, a different exit
status, and recorded calls never asked for. Files compare by content and mode
(`diff_trees`): mtimes always differ between two runs.

**Fork.** `fork` writes `<id>-fork-<n>` sharing frames 0..at-1 byte for byte
(`TapeWriter.fork_from`); its `fork` frame records the overrides. A process cannot be resumed
mid-run, so `exec_=True` re-executes the command from the start as a replay does, with the
model calls recorded before frame `at` served from the tape and every later call live (the
upstreams are the caller's `OPENAI_BASE_URL` / `ANTHROPIC_BASE_URL`) with the overrides applied
(`RequestRewriter`). The re-executed prefix must match the tape (else the fork fails with the
difference); its frames are not written again: the fork tape keeps the shared prefix and gets
only the frames the re-execution produced after the point matching frame at-1.

Both run a booth, which enters a private mount namespace in the calling process: call them from
a process of their own (the CLI is one), single-threaded when they start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jukebox.booth import procs
from jukebox.booth.images import Image
from jukebox.booth.paths import BoothPaths
from jukebox.errors import JukeboxError, UsageError
from jukebox.tape.tapedir import TapeDir
from shadowfs.oid import ObjectId

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

MODES = ("strict", "loose")
# The proxy of an offline replay needs upstream URLs; these reach nothing (port 9 is discard),
# and a replay without `until` refuses every call that would need them anyway.
OFFLINE_UPSTREAMS = {"openai": "http://127.0.0.1:9/v1", "anthropic": "http://127.0.0.1:9"}
AGENT_EVENTS = frozenset({"llm_turn", "checkpoint", "rollback", "tool_call"})
SHOW_PATHS = 8


@dataclass
class Recorded:
    """What a booth tape says about its run: enough to run it again."""

    tape_id: str
    argv: list[str]
    tree: str
    cwd: str
    base_tree: ObjectId
    image: str | None  # the recorded name: a label only, never resolved
    image_record: Any  # run_start's `sandbox_image`: name, content, blake3 (None on old tapes)
    fs: str
    # run_start's policy.mcp_servers: {name: {"command": [...], "env": [names]}} (--mcp-config),
    # {name: {"url": URL, "headers": [names]}} (streamable HTTP)
    mcp_servers: dict[str, Any] = field(default_factory=dict)
    # The caller's --mcp-config for a replay or fork (its servers' `env` and `headers`), and
    # the HTTP servers' headers taken from it or the environment (resolve_mcp_headers).
    mcp_given: dict[str, Any] = field(default_factory=dict)
    mcp_headers: dict[str, dict[str, str]] = field(default_factory=dict)

    def mcp_config(self, environ: Mapping[str, str]) -> dict[str, Any] | None:
        """The declared MCP servers as a .mcp.json for the new booth (its agent finds it in
        $JUKEBOX_MCP_CONFIG again); the tape names each server's environment variables and
        headers but holds none of their secret values: those come from the caller's
        --mcp-config or `environ`, where set."""
        if not self.mcp_servers:
            return None
        from jukebox.mcp.servers import restored_env
        from jukebox.redact import REDACTED

        servers: dict[str, Any] = {}
        for name, described in self.mcp_servers.items():
            found = self.mcp_given.get(name)
            given: dict[str, Any] = found if isinstance(found, dict) else {}
            if described.get("url"):
                url = str(described["url"])
                if REDACTED in url and isinstance(given.get("url"), str):
                    url = given["url"]  # the recorded one lost its password: the caller's
                entry: dict[str, Any] = {"type": "http", "url": url}
                if self.mcp_headers.get(name):
                    entry["headers"] = dict(self.mcp_headers[name])
                servers[name] = entry
                continue
            command = [str(a) for a in described.get("command") or []]
            if not command:
                continue
            found_env = given.get("env")
            given_env: dict[str, Any] = found_env if isinstance(found_env, dict) else {}
            env = restored_env(name, described, {**environ, **given_env},
                               _ask_env if _terminal() else None)  # fmt: skip
            servers[name] = {"command": command[0], "args": command[1:], "env": env}
        return {"mcpServers": servers}

    def resolve_mcp_headers(self, config: str | os.PathLike[str] | None,
                            environ: Mapping[str, str], how: str, live: bool) -> None:  # fmt: skip
        """Reads the caller's --mcp-config, and when the run may go `live` past its recording
        takes the value of every header the tape says an HTTP server was sent from it or
        `environ`: the server is reached as the run reached it, or nothing starts and a
        UsageError names the header missing (`how`: the command that takes --mcp-config).
        A replay that never goes live sends the server nothing and needs none."""
        from jukebox.mcp.servers import read_config, restored_headers

        if config is not None:
            self.mcp_given = dict(read_config(os.fspath(config))["mcpServers"])
        if not live:
            return
        for name, described in self.mcp_servers.items():
            names = described.get("headers")
            if described.get("url") and isinstance(names, list) and names:
                self.mcp_headers[name] = restored_headers(
                    name, [str(n) for n in names], self.mcp_given.get(name), environ, how
                )


@dataclass
class ImageChoice:
    """The image a replay or fork runs under, and how it compares with the recorded one."""

    image: Image
    difference: str | None  # one line, or None when the policies are the same
    loosened: list[str]  # with --image recorded: what it loosens against the built-in image

    def to_json(self) -> dict[str, Any]:
        from jukebox.booth.recorded_image import image_record

        return {
            "name": self.image.name,
            "blake3": image_record(self.image)["blake3"],
            "difference": self.difference,
            "loosened": self.loosened,
        }


@dataclass
class CheckpointMark:
    seq: int
    n: int  # rank among compared checkpoints, from 1
    label: str | None
    tree: ObjectId


@dataclass
class ReplayResult:
    code: int  # 0: the run matched its tape; 1: it diverged (see `difference`)
    tape_id: str
    tape_path: Path | None  # the replay's own tape (None when not kept)
    difference: str | None
    recorded_frames: int
    frames: int  # frames on the replay's tape
    checkpoints_matched: int
    checkpoints_expected: int
    llm_served: int
    llm_live: int
    spent_usd: float
    seconds: float
    agent_status: int | None
    image: ImageChoice | None = None
    tools_served: int = 0  # MCP tool calls answered from the tape
    # What went wrong besides a difference, one line each, the agent's own failure first: a
    # replay whose agent failed, or that refused a call the agent then caught, does not pass.
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["tape_path"] = os.fspath(self.tape_path) if self.tape_path else None
        out["ok"] = self.code == 0
        out["image"] = self.image.to_json() if self.image is not None else None
        return out

    def summary(self) -> str:
        kept = f" on tape {self.tape_id}" if self.tape_path else ""
        live = f", {self.llm_live} live" if self.llm_live else ""
        live += f", {self.tools_served} tool call(s) served" if self.tools_served else ""
        return (
            f"replayed {self.recorded_frames} recorded frame(s) as {self.frames} new frame(s)"
            f"{kept}: {self.checkpoints_matched}/{self.checkpoints_expected} checkpoint(s) "
            f"matched, {self.llm_served} LLM call(s) served from the tape{live}, "
            f"{self.seconds:.2f}s, ${self.spent_usd:.2f} spent"
        )


@dataclass
class ForkResult:
    code: int
    tape_id: str
    tape_path: Path
    at: int
    overrides: dict[str, Any]  # model: {provider: model}, or a string for every provider
    executed: bool = False
    appended: int = 0  # frames the re-execution added after the shared prefix and fork frame
    llm_served: int = 0
    llm_live: int = 0
    tools_served: int = 0
    spent_usd: float = 0.0
    agent_status: int | None = None
    difference: str | None = None
    image: ImageChoice | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # as ReplayResult's

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out["tape_path"] = os.fspath(self.tape_path)
        out["image"] = self.image.to_json() if self.image is not None else None
        return out


# --------------------------------------------------------------------------- reading the tape


def recorded_run(tape: Any) -> Recorded:
    """The run a booth tape records, or a UsageError when it is not a booth run."""
    start = tape.frames[0].payload if tape.frames else {}
    if tape.frames and tape.store is not None:
        start = tape.frames[0].resolve_payload(tape.store)  # a large image may be in the store
    argv, base = start.get("argv"), start.get("base_tree")
    if tape.frames and tape.frames[0].kind == "run_start" and isinstance(argv, list) and base:
        policy = start["policy"] if isinstance(start.get("policy"), dict) else {}
        tree = str(start.get("tree") or "")
        return Recorded(
            tape_id=tape.tape_id or Path(os.fspath(tape.path)).stem,
            argv=[str(a) for a in argv],
            tree=tree,
            cwd=str(start.get("cwd") or tree),
            base_tree=ObjectId.from_hex(base),
            image=start["image"] if isinstance(start.get("image"), str) else None,
            image_record=start.get("sandbox_image"),
            fs=policy["fs"] if policy.get("fs") in ("fuse", "overlay") else "fuse",
            mcp_servers=dict(policy.get("mcp_servers") or {}),
        )
    raise UsageError(
        f"{os.fspath(tape.path)} was not recorded by `jukebox booth run` (its run_start has no "
        "argv and base tree): there is no command to re-execute"
    )


def select_image(run: Recorded, image: str | None, trust_recorded: bool) -> ImageChoice:
    """The image a replay or fork of `run` runs under: the caller's `image` (a name or a path,
    resolved in the caller's cwd; default the built-in one), or with `image="recorded"` the
    tape's own, which must not loosen the built-in image unless `trust_recorded`."""
    from jukebox.booth.images import load_image
    from jukebox.booth.recorded_image import (
        RECORDED,
        difference_line,
        image_from_record,
        loosenings,
    )

    if trust_recorded and image != RECORDED:
        raise UsageError(
            f"--trust-recorded-image confirms --image {RECORDED}: add --image {RECORDED} or drop it"
        )
    loosened: list[str] = []
    if image == RECORDED:
        chosen = image_from_record(run.image_record, run.tape_id)
        # The booth of a replay or fork is offline whatever the image says.
        loosened = loosenings(chosen, load_image(None), ignore=("net",))
        if loosened and not trust_recorded:
            raise UsageError(
                f"the image recorded in {run.tape_id} is looser than the built-in one: "
                + "; ".join(loosened)
                + f"; add --trust-recorded-image to run under it anyway, or drop --image {RECORDED}"
            )
    else:
        chosen = load_image(image)
    return ImageChoice(chosen, difference_line(run.image_record, chosen, run.tape_id), loosened)


def checkpoint_marks(tape: Any, through: int | None = None) -> list[CheckpointMark]:
    """The checkpoints the agent asked for (timer ones excluded), through frame `through`."""
    marks: list[CheckpointMark] = []
    for frame in tape.frames:
        if through is not None and frame.seq > through:
            break
        if frame.kind != "checkpoint" or frame.tree is None:
            continue
        if frame.payload.get("reason") == "timer":
            continue
        marks.append(
            CheckpointMark(frame.seq, len(marks) + 1, frame.payload.get("label"), frame.tree)
        )
    return marks


def final_fs(tape: Any) -> tuple[int, ObjectId] | None:
    for frame in reversed(tape.frames):
        if frame.kind == "fs" and frame.tree is not None and frame.payload.get("reason") == "exit":
            return frame.seq, frame.tree
    return None


def exit_code(tape: Any) -> int | None:
    for frame in reversed(tape.frames):
        if frame.kind == "exit":
            code = frame.payload.get("code")
            return code if isinstance(code, int) else None
    return None


def same_files(store: ObjectReader, a: ObjectId | None, b: ObjectId | None) -> list[str]:
    """The paths that differ (content, kind or mode; not mtimes), as `M path` lines."""
    if a == b:
        return []
    from jukebox.display.names import change_line
    from shadowfs.tree import diff_trees

    return [change_line(c.status, c.path) for c in diff_trees(store, a, b)]


def next_tape_id(tapes: TapeDir, base: str, what: str) -> str:
    n = 1
    while tapes.tape_path(f"{base}-{what}-{n}").exists():
        n += 1
    return f"{base}-{what}-{n}"


# --------------------------------------------------------------------------- the watched booth


def _stop_agent() -> int:
    """Kills every descendant of this process: in a booth supervisor, the agent (and a verifier).

    Each one directly, not just the booth's init: the init's death takes the rest of its PID
    namespace with it only once the kernel gets round to it, and an agent woken by the reply to
    its checkpoint meanwhile could still reach the proxy. A pending SIGKILL lets no more of a
    process's own code run."""
    killed = 0
    for pid in procs.descendants_of(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


class _Watch:
    """Compares each snapshot the booth takes with the recorded checkpoint of the same rank and
    stops the agent at the first difference; the report is built afterwards from the tapes."""

    def __init__(self, marks: list[CheckpointMark]) -> None:
        self.marks = marks
        self.snapshots = 0
        self.stopped: str | None = None
        # Whether stopping killed a running agent (a difference found in the snapshot taken at
        # its exit stops nothing): its exit status is then ours, not its own.
        self.killed = False

    def layer_factory(self, inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
        watch = self

        class WatchedLayer:
            def __init__(self, ctx: Any) -> None:
                self.inner = inner(ctx)
                self.store = ctx.store

            def mount(self) -> None:
                self.inner.mount()

            def snapshot(self) -> tuple[ObjectId, ObjectId | None]:
                tree, journal = self.inner.snapshot()
                watch.observe(self.store, tree)
                return tree, journal

            def restore(self, tree_id: ObjectId) -> None:
                self.inner.restore(tree_id)

            def unmount(self) -> None:
                self.inner.unmount()

            def discard(self, *, keep_files: bool = False) -> None:
                self.inner.discard(keep_files=keep_files)

        return WatchedLayer

    def observe(self, store: ObjectReader, tree: ObjectId) -> None:
        i, self.snapshots = self.snapshots, self.snapshots + 1
        if (
            self.stopped is None
            and i < len(self.marks)
            and same_files(store, self.marks[i].tree, tree)
        ):
            self.stop(f"checkpoint #{i + 1}")

    def on_divergence(self, divergence: Any) -> None:
        self.stop("llm")

    def stop(self, why: str) -> None:
        if self.stopped is None:
            self.stopped = why
            self.killed = _stop_agent() > 0


@contextlib.contextmanager
def _scratch_tree(store: ObjectReader, run: Recorded) -> Iterator[tuple[str, str, list[str]]]:
    """A temporary copy of the base tree: (tree path, cwd for the agent, argv), removed after."""
    from jukebox.display.progress import step
    from shadowfs.tree import materialize

    root = tempfile.mkdtemp(prefix="jukebox-replay-")
    try:
        tree = os.path.join(root, "tree")
        with step("writing the recorded tree", done="wrote the recorded tree", counted=False):
            materialize(store, run.base_tree, tree)
        rel = os.path.relpath(run.cwd, run.tree) if run.tree else "."
        cwd = os.path.normpath(os.path.join(tree, rel))
        if rel.startswith("..") or not os.path.isdir(cwd):
            cwd = tree
        prefix = run.tree.rstrip("/") + "/"
        argv = [
            tree if a == run.tree else tree + "/" + a[len(prefix) :] if a.startswith(prefix) else a
            for a in run.argv
        ] if run.tree else list(run.argv)  # fmt: skip
        yield tree, cwd, argv
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_watched(
    store_path: Path,
    run: Recorded,
    tapes: TapeDir,
    tape_id: str,
    llm: Any,
    watch: _Watch,
    fs: str | None,
    name: str,
    image: Image,
    paths: BoothPaths | None = None,
    mcp_replay: Any = None,
    sql: Any = None,
) -> tuple[int, float]:
    """Runs the recorded command in a fresh, offline, never-committing booth; returns
    (booth status, seconds). The booth ends discarded and the scratch tree is removed."""
    from jukebox.booth.supervisor import DISCARD, default_layer_factory, discard_booth, run_booth
    from shadowfs.store import Store

    with Store.open(store_path, create=False) as store, _scratch_tree(store, run) as scratch:
        tree, cwd, argv = scratch
        mcp_config = None
        declared = run.mcp_config(os.environ)
        if declared is not None:
            import json

            # Beside the scratch tree, removed with it.
            mcp_config = os.path.join(os.path.dirname(tree), "mcp.json")
            # Private: it may hold the caller's headers and env values.
            fd = os.open(mcp_config, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with open(fd, "w") as f:
                json.dump(declared, f)
        old_cwd = os.getcwd()
        os.chdir(cwd)  # the booth starts the agent in the caller's cwd when it is in the tree
        started = time.monotonic()
        try:
            status = run_booth(
                argv,
                tree,
                tapes.path,
                tape_id=tape_id,
                name=name,
                fs=fs or run.fs,
                image=image,  # chosen by the caller, never read from the tape
                paths=paths,  # the caller's --rw/--ro/--hide too, never the tape's
                commit_mode=DISCARD,  # quietly: nobody will ever commit a scratch booth
                verify_cmd="",  # the verifier judges a run for commit; a replay never commits
                net="none",
                layer_factory=watch.layer_factory(default_layer_factory),
                llm=llm,
                mcp_config=mcp_config,
                mcp_replay=mcp_replay,
                sql_replay=sql,
            )
        finally:
            seconds = time.monotonic() - started
            os.chdir(old_cwd)
            # Only a booth that failed before its verdict still has a record to clear.
            with contextlib.suppress(JukeboxError):
                discard_booth(tapes, tape_id)
    return status, seconds


def _tool_replay(tape: Any, store: ObjectReader, until: int | None,
                 override: tuple[int, dict[str, Any]] | None = None) -> Any:  # fmt: skip
    """The recorded MCP answers a replay or fork serves (None when the tape has none)."""
    if not any(f.kind == "tool_call" for f in tape.frames) and not recorded_run(tape).mcp_servers:
        return None
    from jukebox.mcp.booth_replay import ToolReplay

    return ToolReplay.from_tape(tape, store, until, override)


def _llm_counts(tape: Any, store: ObjectReader) -> tuple[int, int, float]:
    """(calls served from a tape, live calls, dollars spent on the live ones)."""
    served = live = 0
    spent = 0.0
    for frame in tape.frames:
        if frame.kind != "llm_turn":
            continue
        p = frame.payload
        if p.get("replayed_from") is not None:
            served += 1
        else:
            live += 1
            cost = p.get("cost_usd")
            spent += float(cost) if isinstance(cost, int | float) else 0.0
    return served, live, spent


def _first_difference(
    original: Any,
    replay: Any,
    store: ObjectReader,
    marks: list[CheckpointMark],
    *,
    whole_run: bool,
    remaining: int,
    tools_remaining: int = 0,
) -> tuple[str | None, int]:
    """The first way the replay differs from the original, as a report, and how many
    checkpoints matched before it."""
    got = checkpoint_marks(replay)
    divergence = next(
        (f for f in replay.frames if f.kind == "note" and f.payload.get("event") == "divergence"),
        None,
    )
    matched = 0
    for i, mark in enumerate(marks):
        came = got[i] if i < len(got) else None
        if divergence is not None and (came is None or divergence.seq < came.seq):
            return str(divergence.payload.get("message")), matched
        if came is None:
            if not whole_run:
                return None, matched  # past `until`, the recording no longer binds the run
            return (
                f"replay diverged at frame {mark.seq} (checkpoint #{mark.n}"
                f"{_label(mark.label)}): the run ended without it\n"
                f"  expected: checkpoint #{mark.n}{_label(mark.label)}, "
                f"tree {mark.tree.hex()[:16]}\n"
                f"  got:      {len(got)} checkpoint(s) in all, then the run ended"
            ), matched
        paths = same_files(store, mark.tree, came.tree)
        if paths or came.label != mark.label:
            return _checkpoint_report(mark, came, paths), matched
        matched += 1
    if divergence is not None:
        return str(divergence.payload.get("message")), matched
    if not whole_run:
        return None, matched
    if len(got) > len(marks):
        extra = got[len(marks)]
        return (
            f"replay diverged after the last recorded checkpoint: checkpoint #{extra.n}"
            f"{_label(extra.label)} (replay frame {extra.seq}) was not on the tape\n"
            f"  expected: {len(marks)} checkpoint(s)\n"
            f"  got:      {len(got)}"
        ), matched
    want, have = final_fs(original), final_fs(replay)
    if want is not None and have is not None:
        paths = same_files(store, want[1], have[1])
        if paths:
            return (
                f"replay diverged at frame {want[0]} (the files at exit): they differ from "
                "the recorded ones\n"
                f"  expected: tree {want[1].hex()[:16]}\n"
                f"  got:      tree {have[1].hex()[:16]} (replay frame {have[0]})\n"
                + _paths_block(paths)
            ), matched
    want_code, have_code = exit_code(original), exit_code(replay)
    if want_code != have_code:
        return (
            "replay diverged at the exit: the agent's status differs\n"
            f"  expected: exit status {want_code}\n"
            f"  got:      exit status {have_code}"
        ), matched
    if remaining:
        return (
            f"replay diverged at the end: the run made fewer model calls than the tape holds "
            f"({remaining} recorded call(s) never asked for)"
        ), matched
    if tools_remaining:
        return (
            f"replay diverged at the end: the run made fewer MCP tool calls than the tape holds "
            f"({tools_remaining} recorded call(s) never asked for)"
        ), matched
    return None, matched


def _run_problems(original: Any, replay: Any, stopped: bool) -> list[str]:
    """The agent's failure (unless the replay stopped it) and the calls the replay refused, one
    line each: neither is a difference from the tape the checks above would always see (past
    `--until` nothing binds the run; an agent may catch the refusal and carry on)."""
    lines = []
    status, recorded = exit_code(replay), exit_code(original)
    if not stopped and status not in (None, 0) and status != recorded:
        lines.append(
            f"the agent failed: it exited with status {status} (recorded: {recorded}); "
            "its own output above says why"
        )
    for frame in replay.frames:
        p = frame.payload
        if frame.kind == "note" and p.get("event") == "replay_refused":
            lines.append(
                f"the replay refused {p.get('method')} {p.get('path')} ({p.get('provider')}): "
                f"not a recorded model call, and a replay never reaches the network "
                f"(replay frame {frame.seq})"
            )
    return lines


def _label(label: Any) -> str:
    return f' "{label}"' if label else ""


def _checkpoint_report(mark: CheckpointMark, came: CheckpointMark, paths: list[str]) -> str:
    what = "files" if paths else "label"
    lines = [
        f"replay diverged at frame {mark.seq} (checkpoint #{mark.n}{_label(mark.label)}): "
        f"its {what} differ from the recorded ones",
        f"  expected: checkpoint{_label(mark.label)}, tree {mark.tree.hex()[:16]}",
        f"  got:      checkpoint{_label(came.label)}, tree {came.tree.hex()[:16]} "
        f"(replay frame {came.seq})",
    ]
    if paths:
        lines.append(_paths_block(paths).rstrip("\n"))
    return "\n".join(lines)


def _paths_block(paths: list[str]) -> str:
    shown = [f"    {p}" for p in paths[:SHOW_PATHS]]
    if len(paths) > SHOW_PATHS:
        shown.append(f"    ... and {len(paths) - SHOW_PATHS} more")
    return "  diff:\n" + "\n".join(shown) + "\n"


# --------------------------------------------------------------------------- replay --exec


def replay_exec(
    tape_path: str | os.PathLike[str],
    tape_dir: str | os.PathLike[str] | None = None,
    mode: str = "strict",
    until: int | None = None,
    *,
    record: bool = True,
    fs: str | None = None,
    image: str | None = None,
    trust_recorded_image: bool = False,
    honor_timing: bool = False,
    paths: BoothPaths | None = None,
    mcp_config: str | os.PathLike[str] | None = None,
) -> ReplayResult:
    """Re-runs a recorded booth run offline and checks it against its tape (see the module);
    `honor_timing` answers each model call after its recorded latency, in the recorded order.
    `mcp_config`: the caller's `.mcp.json`, where the MCP servers' secret env values and
    headers come from (else the environment; Recorded.resolve_mcp_headers)."""
    from jukebox.llm.replay import ReplaySource
    from jukebox.llm.session import LlmOptions
    from jukebox.llm.upstreams import upstreams_from_env
    from jukebox.sql.replay import SqlRecording
    from jukebox.tape.tape import Tape
    from shadowfs.store import Store

    if mode not in MODES:
        raise UsageError(f"bad replay mode {mode!r}: use --strict or --loose")
    # Absolute: the booth starts in the scratch tree, where a relative tape dir means another.
    tapes = TapeDir.resolve(tape_dir if tape_dir is not None else Path(tape_path).parent)
    tapes = TapeDir(Path(os.path.abspath(tapes.path)))
    if not (tapes.store_path / "packs").is_dir():
        raise UsageError(
            f"no store in {tapes.path}: a replay needs the tape dir the run was recorded in"
        )
    with Store.open(tapes.store_path, create=False) as store:
        original = Tape.load(tape_path, store)
        if until is not None and not 0 <= until < len(original.frames):
            raise UsageError(
                f"--until {until} is not a frame of {tape_path}: it has frames 0 to "
                f"{len(original.frames) - 1}"
            )
        original.check_chain()  # a damaged tape says nothing we may act on
        run = recorded_run(original)
        run.resolve_mcp_headers(mcp_config, os.environ, "`jukebox replay --exec --until N`",
                                live=until is not None)  # fmt: skip
        chosen = select_image(run, image, trust_recorded_image)
        source = ReplaySource.from_tape(
            original, store, mode=mode, until=until, honor_timing=honor_timing
        )
        tools = _tool_replay(original, store, until)
        sql = SqlRecording.from_tape(original, store)  # --pg: served from the tape
    marks = checkpoint_marks(original, through=until)
    watch = _Watch(marks)
    if tools is not None:
        tools.on_divergence = watch.on_divergence
    tape_id = next_tape_id(tapes, run.tape_id, "replay")
    llm = LlmOptions(
        replay=source,
        upstreams=OFFLINE_UPSTREAMS if until is None else upstreams_from_env(os.environ),
        on_divergence=watch.on_divergence,
    )
    if sql is not None:
        sql.on_divergence = watch.on_divergence
    status, seconds = _run_watched(
        tapes.store_path, run, tapes, tape_id, llm, watch, fs, f"replay of {run.tape_id}",
        chosen.image, paths, tools, sql,
    )  # fmt: skip
    replay_path = tapes.tape_path(tape_id)
    with Store.open(tapes.store_path, create=False) as store:
        original = Tape.load(tape_path, store)
        replayed = Tape.load(replay_path, store)
        difference, matched = _first_difference(
            original,
            replayed,
            store,
            marks,
            whole_run=until is None,
            remaining=source.remaining() if until is None else 0,
            tools_remaining=tools.remaining() if tools is not None and until is None else 0,
        )
        if difference is None and until is None and sql is not None and sql.remaining():
            difference = (
                "replay diverged at the end: the run ran fewer SQL statements than the tape "
                f"holds ({sql.remaining()} recorded statement(s) never run)"
            )
        problems = _run_problems(original, replayed, stopped=watch.killed)
        served, live, spent = _llm_counts(replayed, store)
        frames = len(replayed.frames)
    if not record:
        replay_path.unlink(missing_ok=True)
    return ReplayResult(
        code=1 if difference or problems else 0,
        tape_id=tape_id,
        tape_path=replay_path if record else None,
        difference=difference,
        recorded_frames=len(original.frames),
        frames=frames,
        checkpoints_matched=matched,
        checkpoints_expected=len(marks),
        llm_served=served,
        llm_live=live,
        spent_usd=spent,
        seconds=seconds,
        agent_status=status,
        image=chosen,
        tools_served=tools.served if tools is not None else 0,
        problems=problems,
    )


# --------------------------------------------------------------------------- fork


def fork(
    tape_path: str | os.PathLike[str],
    at: int,
    *,
    tape_dir: str | os.PathLike[str] | None = None,
    model: str | Mapping[str, str] | Sequence[str] | None = None,
    system_prompt: str | None = None,
    exec_: bool = False,
    mode: str = "strict",
    tape_id: str | None = None,
    fs: str | None = None,
    image: str | None = None,
    trust_recorded_image: bool = False,
    paths: BoothPaths | None = None,
    honor_timing: bool = False,
    tool_result: str | None = None,
    mcp_config: str | os.PathLike[str] | None = None,
) -> ForkResult:
    """Forks a tape at frame `at` (1..len): see the module for what `exec_` re-runs. `model`:
    a bare name, {provider: model}, or `--model` values (see `jukebox.llm.model_override`).
    `honor_timing` (with `exec_`) answers the calls served from the tape after their recorded
    latency, in the recorded order, as `replay_exec` does. `tool_result`: the result the MCP
    tool call at frame `at` gets instead of the recorded one (see
    jukebox.mcp.booth_replay.tool_result_override); MCP tool calls before `at` are served from
    the tape, later ones go to the real servers. `mcp_config`: the caller's `.mcp.json`, where
    those servers' secret env values and headers come from (else the environment)."""
    from jukebox.llm.model_override import resolve as resolve_model
    from jukebox.tape.tape import Tape, TapeWriter
    from jukebox.tape.tapedir import check_tape_id
    from shadowfs.store import Store

    if mode not in MODES:
        raise UsageError(f"bad replay mode {mode!r}: use --strict or --loose")
    # Absolute: the booth starts in the scratch tree, where a relative tape dir means another.
    tapes = TapeDir.resolve(tape_dir if tape_dir is not None else Path(tape_path).parent)
    tapes = TapeDir(Path(os.path.abspath(tapes.path)))
    with Store.open(tapes.store_path, create=True) as store:
        origin = Tape.load(tape_path, store)
        n = len(origin.frames)
        if not 1 <= at <= n:
            raise UsageError(
                f"cannot fork {tape_path} at frame {at}: it has {n} frame(s) (0..{n - 1}), "
                f"so fork at 1..{n}"
            )
        origin.check_chain()
        if exec_ and any(f.kind == "note" and f.payload.get("event") == "sql_databases"
                         for f in origin.frames):
            raise UsageError(
                f"fork --exec of {origin.tape_id or tape_path} is not supported: its run used "
                "--pg databases, whose work cannot go live from the fork point yet; fork "
                "without --exec, or `jukebox replay --exec` it offline"
            )
        pairs = (("model", resolve_model(model, origin, at)), ("system_prompt", system_prompt))
        overrides: dict[str, Any] = {k: v for k, v in pairs if v is not None}
        if tool_result is not None:
            from jukebox.mcp.booth_replay import tool_result_override

            _, replaced = tool_result_override(origin, store, at, tool_result)
            overrides["tool_result"] = {"frame": at, "result": replaced}
        if not exec_ and (image is not None or trust_recorded_image or paths is not None):
            raise UsageError(
                "--image, --trust-recorded-image, --rw, --ro, --hide and --no-private-tmp "
                "choose the booth of --exec: add --exec"
            )
        if not exec_ and honor_timing:
            raise UsageError(
                "--honor-timing paces the calls --exec serves from the tape: add --exec"
            )
        run = recorded_run(origin) if exec_ else None
        if run is not None:  # before anything is written: a missing header stops it here
            run.resolve_mcp_headers(mcp_config, os.environ, "`jukebox fork --exec`", live=True)
        elif mcp_config is not None:
            raise UsageError("--mcp-config gives the MCP servers of --exec: add --exec")
        chosen = select_image(run, image, trust_recorded_image) if run is not None else None
        base_id = origin.tape_id or Path(os.fspath(tape_path)).stem
        new_id = check_tape_id(tape_id) if tape_id else next_tape_id(tapes, base_id, "fork")
        new_path = tapes.tape_path(new_id)
        if new_path.exists():
            raise UsageError(f"a tape {new_id!r} already exists in {tapes.path}: pick another id")
        extra = {"overrides": overrides, "exec": exec_}
        writer = TapeWriter.fork_from(origin, at, new_path, new_id, store=store, extra=extra)
        writer.close()
    result = ForkResult(0, new_id, new_path, at, overrides, image=chosen)
    if run is None or chosen is None:
        return result
    try:
        _fork_exec(
            result, Path(tape_path), tapes, run, mode, fs, chosen.image, paths, honor_timing
        )
    except BaseException:
        new_path.unlink(missing_ok=True)  # a fork whose re-execution never ran is no fork
        raise
    return result


def _fork_exec(
    result: ForkResult,
    origin_path: Path,
    tapes: TapeDir,
    run: Recorded,
    mode: str,
    fs: str | None,
    image: Image,
    paths: BoothPaths | None = None,
    honor_timing: bool = False,
) -> None:
    from jukebox.llm.replay import ReplaySource
    from jukebox.llm.rewrite import RequestRewriter
    from jukebox.llm.session import LlmOptions
    from jukebox.llm.upstreams import upstreams_from_env
    from jukebox.tape.tape import Tape, TapeWriter
    from shadowfs.store import Store

    at = result.at
    with Store.open(tapes.store_path, create=False) as store:
        origin = Tape.load(origin_path, store)
        source = ReplaySource.from_tape(
            origin, store, mode=mode, until=at - 1, honor_timing=honor_timing
        )
        override = result.overrides.get("tool_result")
        tools = _tool_replay(
            origin, store, at - 1, (at, override["result"]) if override is not None else None
        )
        prefix_events = sum(1 for f in origin.frames[1:at] if f.kind in AGENT_EVENTS)
    marks = checkpoint_marks(origin, through=at - 1)
    watch = _Watch(marks)
    if tools is not None:
        tools.on_divergence = watch.on_divergence
    scratch_id = f"{result.tape_id}.exec"
    llm = LlmOptions(
        replay=source,
        rewriter=RequestRewriter(
            model=result.overrides.get("model"),
            system_prompt=result.overrides.get("system_prompt"),
        ),
        upstreams=upstreams_from_env(os.environ),
        on_divergence=watch.on_divergence,
    )
    scratch_path = tapes.tape_path(scratch_id)
    try:
        status, _ = _run_watched(
            tapes.store_path, run, tapes, scratch_id, llm, watch, fs,
            f"fork of {run.tape_id} at frame {at}", image, paths, tools,
        )  # fmt: skip
        result.executed = True
        result.agent_status = status
        with Store.open(tapes.store_path, create=False) as store:
            origin = Tape.load(origin_path, store)
            scratch = Tape.load(scratch_path, store)
            difference, _ = _first_difference(
                origin, scratch, store, marks, whole_run=False, remaining=0
            )
            frames = scratch.frames[1:]
            seen = 0
            while frames and seen < prefix_events:
                if frames[0].kind in AGENT_EVENTS:
                    seen += 1
                frames = frames[1:]
            if seen < prefix_events and difference is None:
                difference = (
                    f"fork diverged before frame {at}: the re-executed run ended after "
                    f"{seen} of the {prefix_events} recorded agent event(s) it had to replay"
                )
            with TapeWriter.open_append(result.tape_path, store) as writer:
                if difference is not None:
                    writer.append("note", {"event": "fork_exec_failed", "message": difference})
                else:
                    for frame in frames:
                        if frame.kind == "discard":
                            continue  # the scratch booth's own clean-up, not the run's
                        writer.append(
                            frame.kind,
                            frame.resolve_payload(store),
                            refs=frame.refs,
                            tree=frame.tree,
                            time_ns=frame.time_ns,
                        )
                        result.appended += 1
            fork_tape = Tape.load(result.tape_path, store)
            live_frames = fork_tape.frames[at + 1 :]
            result.llm_served = sum(
                1 for f in scratch.frames if f.kind == "llm_turn" and "replayed_from" in f.payload
            )
            result.llm_live = sum(1 for f in live_frames if f.kind == "llm_turn")
            result.tools_served = tools.served if tools is not None else 0
            result.spent_usd = sum(
                float(f.payload.get("cost_usd") or 0.0) for f in live_frames if f.kind == "llm_turn"
            )
            result.problems = _run_problems(origin, scratch, stopped=watch.killed)
        result.difference = difference
        result.code = 1 if difference is not None or result.problems else 0
    finally:
        scratch_path.unlink(missing_ok=True)


def _terminal() -> bool:
    import sys

    return sys.stdin.isatty() and sys.stderr.isatty()


def _ask_env(server: str, name: str) -> str | None:
    """A recorded MCP server's secret, typed by the operator (not echoed); None if left empty."""
    import getpass

    value = getpass.getpass(f"jukebox: the MCP server {server!r} ran with {name} set; its "
                            "value (not shown; Enter to leave it out): ")  # fmt: skip
    return value or None
