"""Replay and fork of a booth's MCP tool calls: `jukebox replay --exec` serves the recorded
results offline (no server can start: node is off the PATH; one result is bigger than a control
socket line) and matches; a changed argument is a divergence with the frame and the diff;
`jukebox fork --at N --tool-result` gives the agent another result at frame N and lets the
later calls go to the real server."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mcp.conftest import JUKEBOX, memory_server, payloads

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

AGENT = str(Path(__file__).resolve().parent / "replay_agent.py")
# Its observation makes read_graph's result bigger than one control-socket line (64 KiB).
SEED = {"type": "entity", "name": "seed", "entityType": "x", "observations": ["s" * 100_000]}


TOKEN = "memory-token-0123456789abcdef"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One booth run with the real memory server, recorded and committed (its staged call ran)."""
    tmp = tmp_path_factory.mktemp("replay")
    tree, tapes = tmp / "tree", tmp / "tapes"
    tree.mkdir()
    # Outside /tmp: a booth's /tmp is private, and every booth here must see the same file.
    outside = Path(tempfile.mkdtemp(prefix="jukebox-mcp-replay-", dir="/var/tmp"))
    memory = outside / "memory.jsonl"
    memory.write_text(json.dumps(SEED) + "\n")
    config = tmp / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"memory": {
        "command": memory_server()[0],
        "env": {"MEMORY_FILE_PATH": str(memory), "MEMORY_API_TOKEN": TOKEN},
    }}}))  # fmt: skip
    proc = subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id",
         "r1", "--mcp-config", str(config), "--commit", "auto", "--",
         sys.executable, AGENT],
        capture_output=True, text=True, timeout=120, cwd=tree,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    yield {"tapes": tapes, "tape": tapes / "r1.jbx", "memory": memory, "out": said(proc)}
    shutil.rmtree(outside, ignore_errors=True)


def said(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def jukebox(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([JUKEBOX, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})  # fmt: skip


def test_replay_serves_recorded_tool_calls_offline_and_catches_a_changed_argument(
    recorded: dict,
) -> None:
    out = recorded["out"][:3]
    assert out[0] == {"step": "read", "names": ["seed"]} and "staged" in out[1]["text"]
    assert "alpha" in [json.loads(x)["name"] for x in recorded["memory"].read_text().split()]
    # No MCP server can start in the replay: node is not on its PATH.
    no_node = {"PATH": str(Path(sys.executable).parent), "MEMORY_FILE_PATH": "/nonexistent"}
    proc = jukebox("replay", str(recorded["tape"]), "--exec", "--json", env=no_node)
    assert proc.returncode == 0, proc.stderr
    # The agent saw what it saw when recorded: the graph before the commit ran its call.
    assert said(proc)[:3] == out
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["ok"] and result["tools_served"] == 3, result
    replay = recorded["tapes"] / f"{result['tape_id']}.jbx"
    calls = payloads(replay, "tool_call")
    original = [c for c in payloads(recorded["tape"], "tool_call") if c["decision"] != "commit"]
    assert [c["decision"] for c in calls] == ["replay"] * 3
    # Recorded whole although bigger than a control line, so the replay could serve it.
    big = original[0]["result"]["structuredContent"]["entities"][0]["observations"][0]
    assert big == "s" * 100_000
    assert [c["result"] for c in calls] == [c["result"] for c in original]
    assert all(c["replayed_from"] is not None for c in calls)
    assert all(p.get("replayed") for p in payloads(replay, "note", "mcp_server"))

    # Another argument than recorded: a divergence naming the frame, and the agent stopped.
    proc = jukebox("replay", str(recorded["tape"]), "--exec", env={**no_node, "SUFFIX": "-x"})
    assert proc.returncode == 1, proc.stderr
    assert "mcp:memory tools/call create_entities" in proc.stderr
    assert "alpha-x" in proc.stderr and "replay diverged at frame" in proc.stderr
    assert [s["step"] for s in said(proc)] == ["read"]  # stopped before its second read


def test_fork_overrides_a_tool_result_and_goes_live_after_it(recorded: dict) -> None:
    (first_read,) = [c for c in payloads(recorded["tape"], "tool_call")[:1]]
    at = next(i for i, (kind, p) in enumerate(_frames(recorded["tape"]))
              if kind == "tool_call" and p["tool"] == "read_graph")  # fmt: skip
    override = {"content": [{"type": "text", "text": "forked"}],
                "structuredContent": {"entities": [{"name": "forked", "entityType": "x",
                                                    "observations": []}], "relations": []}}
    # The server's environment comes back from the tape (MEMORY_FILE_PATH is no secret): the
    # caller does not set it.
    (start,) = payloads(recorded["tape"], "run_start")
    described = start["policy"]["mcp_servers"]["memory"]
    assert described["env_values"] == {"MEMORY_FILE_PATH": str(recorded["memory"])}
    assert "MEMORY_FILE_PATH" not in os.environ
    # A secret's value never reaches the tape: the fork says it is missing, in one line.
    assert described["env"] == ["MEMORY_API_TOKEN", "MEMORY_FILE_PATH"]
    assert TOKEN.encode() not in recorded["tape"].read_bytes()
    # On a terminal, the operator is asked for it (not echoed), and the fork's server gets it.
    from tests.on_terminal import plain, run_on_terminal

    question = ("'memory' ran with MEMORY_API_TOKEN set; its value (not shown; Enter to leave "
                "it out)")
    status, screen = run_on_terminal(
        [JUKEBOX, "fork", str(recorded["tape"]), "--at", str(at), "--tool-result",
         json.dumps(override), "--exec", "--tape-dir", str(recorded["tapes"])],
        env=dict(os.environ), timeout=120, answer=(question.encode(), TOKEN),
    )  # fmt: skip
    text = plain(screen)
    assert status == 0, text
    assert question in text and TOKEN not in text
    assert "the tape keeps no such value" not in text
    steps = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert steps[3] == {"step": "token", "sha": hashlib.sha256(TOKEN.encode()).hexdigest()[:16]}
    assert steps[0] == {"step": "read", "names": ["forked"]}
    assert "staged" in steps[1]["text"]  # past the fork, the booth's policy again
    # Live: the real server answers, and its graph holds what the original's commit created.
    assert steps[2] == {"step": "read", "names": ["seed", "alpha"]}
    fork_tape = recorded["tapes"] / "r1-fork-1.jbx"
    assert TOKEN not in json.dumps(payloads(fork_tape))
    calls = payloads(fork_tape, "tool_call")
    assert calls[0]["overridden"] and calls[0]["replayed_from"] == at
    assert calls[0]["result"]["structuredContent"]["entities"][0]["name"] == "forked"
    assert [c["decision"] for c in calls[1:]] == ["stage", "allow"]
    assert "replayed_from" not in calls[2]
    assert first_read["result"]["structuredContent"]["entities"][0]["name"] == "seed"

    # A tool result for a frame that is no tool call is refused, with what to do.
    bad = jukebox("fork", str(recorded["tape"]), "--at", "1", "--tool-result", "x",
                  "--tape-dir", str(recorded["tapes"]))  # fmt: skip
    assert bad.returncode == 2 and "fork at a tool_call frame" in bad.stderr


def _frames(tape: Path) -> list[tuple[str, dict]]:
    from jukebox.tape.tape import Tape
    from shadowfs.store import Store

    with Store.open(tape.parent / ".jukebox" / "store") as store:
        return [(f.kind, f.resolve_payload(store)) for f in Tape.load(tape, store).frames]
