"""The client matrix: one small tool-calling, streaming agent written with each popular client
library (client_agents.py), through the proxy by the Python API, as test_replay.py drives the
SDKs: record, tools, stream, strict replay offline, divergence, fork and the breaker.

Each library is a test dependency; every one of these tests runs the real library against the
fake upstream on 127.0.0.1, configured by the environment only, as an agent in a booth is.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jukebox.guard.breaker import CircuitBreaker
from jukebox.llm.placeholder_keys import placeholder_env
from jukebox.llm.replay import Divergence, ReplaySource
from jukebox.llm.rewrite import RequestRewriter
from jukebox.llm.server import ProxyServer
from jukebox.tape.tape import Frame, Tape
from shadowfs.store import Store
from tests.llm import client_agents
from tests.llm.conftest import ANTHROPIC_KEY, OPENAI_KEY, Recording
from tests.llm.upstream import FakeUpstream

CLIENTS = list(client_agents.AGENTS)
EXPECTED = {
    "turns": ["tool write_file: wrote hello.txt", "done: wrote hello.txt"],
    "stream": "echo: " + client_agents.STREAM_PROMPT,
}
FORK_MODELS = {"openai": "gpt-4.1", "anthropic": "claude-sonnet-4-5"}
KEYS = {"OPENAI_API_KEY": OPENAI_KEY, "ANTHROPIC_API_KEY": ANTHROPIC_KEY}


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    """One upstream for the module: each client's run is recorded once, and its cases share it."""
    up = FakeUpstream().start()
    yield up
    up.stop()


def agent_env(monkeypatch: pytest.MonkeyPatch, work: Path) -> None:
    """The agent's working directory and environment, nothing of the host's leaking in."""
    work.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(work)
    for name in list(os.environ):
        if name.startswith(("OPENAI_", "ANTHROPIC_", "LITELLM_", "LANGCHAIN_", "LANGSMITH_")):
            monkeypatch.delenv(name)
    for name, value in {**client_agents.QUIET_ENV, **KEYS}.items():
        monkeypatch.setenv(name, value)


def point_at(proxy: ProxyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The base-URL variables a booth sets for its agent, at `proxy`."""
    for name, value in proxy.base_urls().items():
        monkeypatch.setenv(name, value)


def turns(frames: list[Frame], store: Any) -> list[dict[str, Any]]:
    return [f.resolve_payload(store) for f in frames if f.kind == "llm_turn"]


@dataclass
class Run:
    """One client's agent run, recorded through the proxy."""

    seen: dict[str, Any]
    recording: Recording
    turns: list[dict[str, Any]]
    upstream_calls: list[Any]  # the bodies the upstream received
    work: Path

    def tape(self) -> Tape:
        return self.recording.tape()

    @property
    def first_turn(self) -> int:
        return next(f.seq for f in self.tape().frames if f.kind == "llm_turn")


@pytest.fixture(scope="module")
def runs(
    upstream: FakeUpstream, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Run]]:
    """Each client's recorded run, made when a test first asks for it."""
    made: dict[str, Run] = {}
    yield made
    for run in made.values():
        run.recording.close()


@pytest.fixture
def run(
    name: str,
    runs: dict[str, Run],
    upstream: FakeUpstream,
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    if name not in runs:
        root = tmp_path_factory.mktemp(f"record-{name}")
        recording = Recording(root)
        before = len(upstream.seen)
        with pytest.MonkeyPatch.context() as mp:
            agent_env(mp, root / "work")
            with recording.proxy(upstream) as proxy:
                point_at(proxy, mp)
                seen = client_agents.run(name)
        calls = [body for _, _, _, body in upstream.seen[before:]]
        runs[name] = Run(seen, recording, turns(recording.tape().frames, recording.store),
                         calls, root / "work")  # fmt: skip
    return runs[name]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    agent_env(monkeypatch, tmp_path / "work")
    return monkeypatch


def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No upstream and no API key, as in `jukebox replay --exec`: the placeholder keys only."""
    for name in KEYS:
        monkeypatch.delenv(name)
    for name, value in placeholder_env(os.environ).items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("name", CLIENTS)
def test_record(name: str, run: Run) -> None:
    assert run.seen == EXPECTED
    assert len(run.turns) == 3 == len(run.upstream_calls)
    assert all(t["status"] == 200 and "error" not in t for t in run.turns)
    assert all(t["queued_ms"] >= 0 and t["latency_ms"] > 0 for t in run.turns)
    # Every call counted and priced: the breaker's totals see them all.
    assert all(t["usage"]["input"] > 0 and t["usage"]["output"] > 0 for t in run.turns)
    assert all(t["cost_usd"] > 0 for t in run.turns)
    store = run.recording.store
    data = run.recording.path.read_bytes() + b"".join(store.get(o) for o in store.iter_oids())
    assert OPENAI_KEY.encode() not in data and ANTHROPIC_KEY.encode() not in data


@pytest.mark.parametrize("name", CLIENTS)
def test_tools(name: str, run: Run) -> None:
    assert (run.work / "hello.txt").read_text() == "write hello\n"  # the tool ran
    first, second = run.turns[:2]
    assert [c["name"] for c in first["tool_calls"]] == ["write_file"]
    assert first["tool_calls"][0]["arguments"]["path"] == "hello.txt"
    # The tool's result went back to the model, which answered with it.
    assert "wrote hello.txt" in json.dumps(second["request"])
    assert second["tool_calls"] == [] and run.seen["turns"][-1] == "done: wrote hello.txt"


@pytest.mark.parametrize("name", CLIENTS)
def test_stream(name: str, run: Run) -> None:
    streamed = run.turns[2]
    assert streamed["stream"] is True and run.seen["stream"] == EXPECTED["stream"]
    assert len(streamed["response"]) > 3  # the events, each recorded
    # Usage reported by the upstream, asked for by the proxy where the client did not.
    assert streamed["usage"]["output"] > 0 and "usage_estimated" not in streamed
    if streamed["endpoint"] == "chat.completions":
        asked = (streamed["request"].get("stream_options") or {}).get("include_usage")
        assert bool(streamed.get("usage_requested")) == (not asked)


@pytest.mark.parametrize("name", CLIENTS)
def test_strict_replay_offline(
    name: str, run: Run, upstream: FakeUpstream, env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    offline(env)
    calls = len(upstream.seen)
    source = ReplaySource.from_tape(run.tape(), run.recording.store, mode="strict")
    second = Recording(tmp_path / "replay")
    try:
        with second.proxy(None, replay=source) as proxy:
            point_at(proxy, env)
            replayed = client_agents.run(name)
        assert replayed == run.seen
        assert source.divergence is None and source.remaining() == 0
        assert Path("hello.txt").read_text() == "write hello\n"
        assert len(upstream.seen) == calls
        served = turns(second.tape().frames, second.store)
        assert len(served) == len(run.turns) and {t["cost_usd"] for t in served} == {0.0}
    finally:
        second.close()


@pytest.mark.parametrize("name", CLIENTS)
def test_divergence(name: str, run: Run, env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    offline(env)
    source = ReplaySource.from_tape(run.tape(), run.recording.store, mode="strict")
    diverged: list[Divergence] = []
    second = Recording(tmp_path / "replay")
    try:
        with second.proxy(None, replay=source, on_divergence=diverged.append) as proxy:
            point_at(proxy, env)
            with pytest.raises(Exception, match="replay diverged") as caught:
                client_agents.run(name, "write goodbye")
    finally:
        second.close()
    assert source.divergence is not None and source.divergence.seq == run.first_turn
    assert "write goodbye" in str(caught.value)  # the diff reaches the agent
    assert len(diverged) == 1


@pytest.mark.parametrize("name", CLIENTS)
def test_fork(
    name: str, run: Run, upstream: FakeUpstream, env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = ReplaySource.from_tape(run.tape(), run.recording.store, until=run.first_turn)
    before = len(upstream.seen)
    fork = Recording(tmp_path / "fork")
    try:
        rewriter = RequestRewriter(model=FORK_MODELS)
        with fork.proxy(upstream, replay=source, rewriter=rewriter) as proxy:
            point_at(proxy, env)
            seen = client_agents.run(name)
        assert seen == EXPECTED
        # The first call came from the tape; the two after it went live with the fork's model.
        live = [body for _, _, _, body in upstream.seen[before:]]
        assert len(live) == len(run.turns) - 1
        assert {body["model"] for body in live} <= {*FORK_MODELS.values()}
        forked = turns(fork.tape().frames, fork.store)
        assert [t.get("replayed_from") for t in forked] == [run.first_turn, None, None]
    finally:
        fork.close()


class RequestCounter:
    """A TCP relay in front of the proxy counting the HTTP requests the agent sends, so that a
    client's retries are seen even when the proxy answers them itself."""

    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy
        self.requests = 0
        counter = self

        class Relay(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with socket.create_connection((proxy.host, proxy.port)) as to_proxy:
                    back = threading.Thread(target=counter._pump, args=(to_proxy, self.request))
                    back.start()
                    counter._pump(self.request, to_proxy, count=True)
                    back.join()

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Relay)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool = False) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if count:  # a request line ends so; JSON bodies hold no raw CRLF
                    self.requests += data.count(b" HTTP/1.1\r\n")
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def base_urls(self) -> dict[str, str]:
        here = f"http://127.0.0.1:{self.server.server_address[1]}"
        return {k: v.replace(self.proxy.origin, here) for k, v in self.proxy.base_urls().items()}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("name", CLIENTS)
def test_breaker(
    name: str, upstream: FakeUpstream, env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    trips: list[Any] = []
    breaker = CircuitBreaker(max_turns=1)
    before = len(upstream.seen)
    recording = Recording(tmp_path / "breaker")
    try:
        with recording.proxy(upstream, breaker=breaker, on_trip=trips.append) as proxy:
            counter = RequestCounter(proxy)
            for variable, url in counter.base_urls().items():
                env.setenv(variable, url)
            with pytest.raises(Exception, match="circuit breaker tripped: max_turns"):
                client_agents.run(name)
            counter.close()
    finally:
        recording.close()
    assert [t.rule for t in trips] == ["max_turns"]
    assert len(upstream.seen) == before + 1  # the second call was refused before forwarding
    # ... with an answer no client retries (litellm retried the breaker's answer 8 times).
    assert counter.requests == 2


# ---------------------------------------------------------------------------------- in a booth

AGENT = str(Path(client_agents.__file__))
JUKEBOX = str(Path(sys.executable).parent / "jukebox")
DEAD = "http://127.0.0.1:9"  # nothing listens there: a run pointed at it is offline


def jukebox(cwd: Path, *args: str, upstream: FakeUpstream | None) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: from `cwd`, configured by the environment; the supervisor's
    base URLs become the proxy's upstreams, and with `upstream=None` there is none, nor a key."""
    env = {k: v for k, v in os.environ.items() if k not in KEYS and k != "JUKEBOX_TAPE_DIR"}
    env["OPENAI_BASE_URL"] = upstream.openai_url if upstream else DEAD + "/v1"
    env["ANTHROPIC_BASE_URL"] = upstream.url if upstream else DEAD
    if upstream is not None:
        env.update(KEYS)
    return subprocess.run(
        [JUKEBOX, *args], capture_output=True, text=True, env=env, timeout=120, cwd=cwd
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")
def test_booth_record_then_strict_replay_offline(upstream: FakeUpstream, tmp_path: Path) -> None:
    """Every client in one booth (one agent process: each library is imported once), then the
    same run replayed by `jukebox replay --exec`, offline and without API keys."""
    tree = tmp_path / "tree"
    tree.mkdir()
    before = len(upstream.seen)
    # A tape dir relative to where jukebox runs.
    proc = jukebox(tmp_path, "booth", "run", "--tree", str(tree), "--tape-dir", "tapes",
                   "--tape-id", "rec", "--", sys.executable, AGENT, *CLIENTS,
                   upstream=upstream)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == dict.fromkeys(CLIENTS, EXPECTED)
    assert (tree / "hello.txt").read_text() == "write hello\n"  # committed
    calls = len(upstream.seen) - before
    assert calls == 3 * len(CLIENTS)
    with Store.open(tmp_path / "tapes" / ".jukebox" / "store") as store:
        recorded = turns(Tape.load(tmp_path / "tapes" / "rec.jbx", store).frames, store)
    assert len(recorded) == calls and all(t["cost_usd"] > 0 for t in recorded)

    proc = jukebox(tmp_path, "replay", "rec", "--tape-dir", "tapes", "--exec", upstream=None)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == dict.fromkeys(CLIENTS, EXPECTED)
    assert f"{calls} LLM call(s) served from the tape" in proc.stderr
    assert len(upstream.seen) == before + calls
