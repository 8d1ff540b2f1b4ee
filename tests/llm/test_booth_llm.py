"""The proxy inside real booths: record a run of both SDKs that edits files, replay it offline
in a fresh booth, see a changed prompt diverge, and `--net none` reach only the proxy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.tape.tape import Tape
from shadowfs.store import Store
from tests.llm.conftest import ANTHROPIC_KEY, OPENAI_KEY
from tests.llm.upstream import FakeUpstream

REPO = Path(__file__).resolve().parents[2]
SCENARIO = str(Path(__file__).with_name("scenario.py"))
JUKEBOX = str(Path(sys.executable).parent / "jukebox")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")

# Runs a booth replaying a tape, in a fresh process (a booth must start single-threaded).
REPLAY_DRIVER = """
import json, sys
from jukebox.booth.supervisor import run_booth
from jukebox.llm.replay import ReplaySource
from jukebox.llm.session import LlmOptions
from jukebox.tape.tape import Tape
from shadowfs.store import Store
tape_path, store_path, tree, tape_dir, mode, *argv = sys.argv[1:]
with Store.open(store_path) as store:
    source = ReplaySource.from_tape(Tape.load(tape_path, store), store, mode=mode)
code = run_booth(argv, tree, tape_dir, tape_id="replayed", commit_mode="auto",
                 llm=LlmOptions(replay=source))
d = source.divergence
print(json.dumps({"code": code, "remaining": source.remaining(),
                  "divergence": d and {"seq": d.seq, "message": d.message()}}))
"""


def booth_env(upstream: FakeUpstream | None) -> dict[str, str]:
    env = dict(os.environ, OPENAI_API_KEY=OPENAI_KEY, ANTHROPIC_API_KEY=ANTHROPIC_KEY)
    # The supervisor's base URLs become the proxy's upstreams.
    env["OPENAI_BASE_URL"] = upstream.openai_url if upstream else "http://127.0.0.1:9/v1"
    env["ANTHROPIC_BASE_URL"] = upstream.url if upstream else "http://127.0.0.1:9"
    return env


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [JUKEBOX, *args], capture_output=True, text=True, env=env, timeout=60, cwd="/"
    )


def test_record_then_replay_a_booth_run_offline(upstream: FakeUpstream, tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    argv = [sys.executable, SCENARIO, "out.json"]
    proc = run_cli("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes),
                   "--tape-id", "rec", "--", *argv, env=booth_env(upstream))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    recorded = json.loads((tree / "out.json").read_text())
    files = {p: (tree / p).read_text() for p in ("hello.txt", "notes.txt")}
    store_path = tapes / ".jukebox" / "store"
    with Store.open(store_path) as store:
        tape = Tape.load(tapes / "rec.jbx", store)
        turns = [f.resolve_payload(store) for f in tape.frames if f.kind == "llm_turn"]
        assert len(turns) == 10
        assert {t["provider"] for t in turns} == {"openai", "anthropic"}
        assert all(t["cost_usd"] is not None and t["status"] == 200 for t in turns)
        assert turns[0]["tool_calls"][0]["name"] == "write_file"
        kinds = [f.kind for f in tape.frames]
        assert kinds.index("llm_turn") < kinds.index("fs")
        data = (tapes / "rec.jbx").read_bytes()
        for oid in store.iter_oids():
            data += store.get(oid)
    assert OPENAI_KEY.encode() not in data and ANTHROPIC_KEY.encode() not in data

    # Offline: the upstream is gone and the supervisor points at a closed port.
    upstream.stop()
    for name in ("out.json", *files):
        (tree / name).unlink()
    calls = len(upstream.seen)
    proc = subprocess.run(
        [sys.executable, "-c", REPLAY_DRIVER, str(tapes / "rec.jbx"), str(store_path),
         str(tree), str(tapes), "strict", *argv],
        capture_output=True, text=True, env=booth_env(None), timeout=60, cwd="/",
    )  # fmt: skip
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "remaining": 0, "divergence": None}, proc.stderr
    assert json.loads((tree / "out.json").read_text()) == recorded
    assert {p: (tree / p).read_text() for p in files} == files
    assert len(upstream.seen) == calls

    # A changed prompt diverges at the first llm_turn frame, in a booth too.
    proc = subprocess.run(
        [sys.executable, "-c", REPLAY_DRIVER.replace('"replayed"', '"replayed2"'),
         str(tapes / "rec.jbx"), str(store_path), str(tree), str(tapes), "strict",
         *argv, "write goodbye"],
        capture_output=True, text=True, env=booth_env(None), timeout=60, cwd="/",
    )  # fmt: skip
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    first_turn = next(f.seq for f in tape.frames if f.kind == "llm_turn")
    assert result["code"] != 0 and result["divergence"]["seq"] == first_turn
    assert "write goodbye" in result["divergence"]["message"]


NET_AGENT = """
import json, os, socket, sys
import openai
out = {}
o = openai.OpenAI(max_retries=0)
r = o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "net"}])
out["llm"] = r.choices[0].message.content
targets = {"host_port": ("127.0.0.1", int(sys.argv[1])), "outside": ("10.255.255.1", 80)}
for name, addr in targets.items():
    try:
        socket.create_connection(addr, timeout=2).close()
        out[name] = "connected"
    except OSError as e:
        out[name] = type(e).__name__
json.dump(out, open("net.json", "w"))
"""


def test_net_none_reaches_the_proxy_and_nothing_else(
    upstream: FakeUpstream, tmp_path: Path
) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "agent.py").write_text(NET_AGENT)
    proc = run_cli("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--net", "none",
                   "--", sys.executable, "agent.py", str(upstream.port),
                   env=booth_env(upstream))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tree / "net.json").read_text())
    assert out["llm"] == "echo: net"
    # The fake upstream listens on the host's 127.0.0.1: the agent cannot reach it directly.
    assert out["host_port"] == "ConnectionRefusedError"
    assert out["outside"] != "connected"


def test_the_verifier_gets_neither_the_control_socket_nor_the_stopped_proxies(
    upstream: FakeUpstream, tmp_path: Path
) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    # The agent sees them all; the verifier prints what it got, and fails so that it is shown.
    agent = "test -n \"$JUKEBOX_SOCKET\" && test -n \"$JUKEBOX_BOOTH_ID\""
    proc = run_cli("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes),
                   "--tape-id", "v", "--verify", "env; exit 1", "--", "sh", "-c", agent,
                   env=booth_env(upstream))  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    with Store.open(tapes / ".jukebox" / "store") as store:
        tape = Tape.load(tapes / "v.jbx", store)
        (verify,) = [f.resolve_payload(store) for f in tape.frames if f.kind == "verify"]
    seen = dict(line.split("=", 1) for line in verify["output"].splitlines() if "=" in line)
    assert "JUKEBOX_BOOTH_ID" in seen  # the verifier's env was printed whole
    assert "JUKEBOX_SOCKET" not in seen
    assert seen["OPENAI_BASE_URL"] == upstream.openai_url  # the operator's own, not the proxy's
