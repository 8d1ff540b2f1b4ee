"""The stage gate in a booth: destructive calls on the real memory server staged until the
verdict, run in order by the commit, dropped by rollback and discard, kept by a pending booth
for a later `jukebox booth commit` from another process; an agent that tries to stage a program
of its own is refused, and so is a record edited to run one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.mcp.conftest import JUKEBOX, memory_server, payloads

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

AGENT = str(Path(__file__).resolve().parent / "booth_agent.py")


@pytest.fixture
def setup(tmp_path: Path) -> dict:
    tree, tapes, memory = tmp_path / "tree", tmp_path / "tapes", tmp_path / "memory.jsonl"
    tree.mkdir()
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"memory": {
        "command": memory_server()[0], "env": {"MEMORY_FILE_PATH": str(memory)},
    }}}))  # fmt: skip
    return {"tree": tree, "tapes": tapes, "memory": memory, "config": config, "tmp": tmp_path}


def booth(s: dict, tape_id: str, commit: str, *steps: str,
          opts: list[str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(s["tree"]), "--tape-dir", str(s["tapes"]),
         "--tape-id", tape_id, "--mcp-config", str(s["config"]), "--commit", commit,
         *(opts or []), "--", sys.executable, AGENT, *steps],
        capture_output=True, text=True, timeout=120, cwd=s["tree"],
    )  # fmt: skip


def said(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def graph(memory: Path) -> list[str]:
    """The entities the real memory server holds, asked by a second client of its own."""
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    async def read() -> list[str]:
        env = {**os.environ, "MEMORY_FILE_PATH": str(memory)}
        params = StdioServerParameters(command=memory_server()[0], env=env)
        async with stdio_client(params) as (r, w), ClientSession(r, w) as session:
            await session.initialize()
            result = await session.call_tool("read_graph", {})
            return [e["name"] for e in result.structured_content["entities"]]

    return anyio.run(read)


def entities(memory: Path) -> list[str]:
    """The entities in the memory server's file (cheaper than a client, for later checks)."""
    if not memory.exists():
        return []
    lines = [json.loads(line) for line in memory.read_text().splitlines() if line.strip()]
    return [x["name"] for x in lines if x.get("type") == "entity"]


def test_pending_booth_keeps_staged_calls_for_a_later_commit(setup: dict) -> None:
    s = setup
    pwned = s["tmp"] / "pwned"
    proc = booth(s, "p1", "never",
                 "create", "alpha", "checkpoint", "cp1", "create", "beta",
                 "rollback", "cp1", "create", "gamma", "attack", str(pwned),
                 "write", "notes.txt")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    steps = said(proc)
    staged = [x for x in steps if x["step"] == "create"]
    # A well-formed result that says it is staged, with an id; never a silent success.
    assert [x["structured"]["jukebox"]["id"] for x in staged] == ["stage-1", "stage-2", "stage-3"]
    assert all(not x["error"] and "staged" in x["text"] for x in staged)
    # The attack: a program the operator never declared is never staged.
    (attack,) = [x for x in steps if x["step"] == "attack"]
    assert "does not serve the declared command" in attack["refusals"][0]
    assert "was not declared by the operator" in attack["refusals"][1]
    # Nothing reached the real server: a second client sees an empty graph.
    assert graph(s["memory"]) == []
    record_path = s["tapes"] / ".jukebox" / "booths" / "p1.json"
    record = json.loads(record_path.read_text())
    assert [c["id"] for c in record["mcp_staged"]] == ["stage-1", "stage-3"]  # beta rolled back

    # A record edited to run another program at the commit is refused (its seal breaks).
    forged = json.loads(record_path.read_text())
    forged["mcp_servers"]["memory"]["command"] = "sh"
    forged["mcp_servers"]["memory"]["args"] = ["-c", f"touch {pwned}"]
    record_path.write_text(json.dumps(forged))
    refused = subprocess.run([JUKEBOX, "booth", "commit", "p1", "--tape-dir", str(s["tapes"])],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 1 and not pwned.exists(), refused.stderr
    record_path.write_text(json.dumps(record))

    # Another process, later: the commit writes the files, then runs the calls in order.
    done = subprocess.run([JUKEBOX, "booth", "commit", "p1", "--tape-dir", str(s["tapes"])],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ran 2 staged MCP call(s)" in done.stderr + done.stdout
    assert (s["tree"] / "notes.txt").exists()
    assert graph(s["memory"]) == ["alpha", "gamma"]
    assert entities(s["memory"]) == ["alpha", "gamma"]
    assert not pwned.exists()
    tape = s["tapes"] / "p1.jbx"
    calls = payloads(tape, "tool_call")
    committed = [c for c in calls if c["decision"] == "commit"]
    assert [c["staged_id"] for c in committed] == ["stage-1", "stage-3"]
    assert all(c["ok"] for c in committed)
    assert [c["decision"] for c in calls if c.get("reported_by")] == ["stage"] * 3
    (dropped,) = payloads(tape, "note", "mcp_dropped")
    assert dropped["ids"] == ["stage-2"] and "rollback" in dropped["reason"]
    (report,) = payloads(tape, "note", "mcp_commit")
    assert report["ran"] == ["stage-1", "stage-3"] and report["failed"] is None


def test_verdicts_commit_in_order_stop_at_a_failure_and_discard(setup: dict) -> None:
    s = setup
    # A passing verdict: the files, then the calls; the failing one stops the rest.
    proc = booth(s, "c1", "auto", "create", "delta", "observe", "nobody-here",
                 "create", "epsilon", "write", "c1.txt")  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "staged MCP call stage-2 of booth c1 failed" in proc.stderr
    assert "ran before it: stage-1; not run: stage-3" in proc.stderr
    assert (s["tree"] / "c1.txt").exists()
    assert entities(s["memory"]) == ["delta"]
    (report,) = payloads(s["tapes"] / "c1.jbx", "note", "mcp_commit")
    assert report["ran"] == ["stage-1"] and report["failed"] == "stage-2"
    assert report["not_run"] == ["stage-3"]

    # The breaker counts tool calls: the second staged call trips --max-tool-calls 1, the
    # agent is stopped, the booth rolled back and its staged call dropped, nothing reaches
    # the server.
    proc = booth(s, "d1", "auto", "create", "zeta", "create", "eta", "write", "d1.txt",
                 opts=["--max-tool-calls", "1"])  # fmt: skip
    assert proc.returncode != 0, proc.stderr
    assert "circuit breaker tripped" in proc.stderr
    assert entities(s["memory"]) == ["delta"]
    assert not (s["tree"] / "d1.txt").exists()
    (trip,) = payloads(s["tapes"] / "d1.jbx", "breaker")
    assert trip["rule"] == "max_tool_calls" and trip["limit"] == 1
    (dropped,) = payloads(s["tapes"] / "d1.jbx", "note", "mcp_dropped")
    assert dropped["ids"] == ["stage-1"]


def test_ask_waits_for_the_operator(setup: dict) -> None:
    s = setup
    proc = subprocess.Popen(
        [JUKEBOX, "booth", "run", "--tree", str(s["tree"]), "--tape-dir", str(s["tapes"]),
         "--tape-id", "a1", "--mcp-config", str(s["config"]), "--commit", "never", "--",
         sys.executable, AGENT, "ask", "create_entities", "create", "yes", "create", "no"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=s["tree"],
    )  # fmt: skip
    asked = []
    assert proc.stderr is not None
    for line in proc.stderr:
        if "jukebox booth approve a1 ask-" in line:
            ask_id = line.split("jukebox booth approve a1 ")[1].split("`")[0]
            asked.append(ask_id)
            answer = ["--deny"] if len(asked) == 2 else []
            # The agent cannot answer itself: answers go in the hidden tape dir, not the socket.
            subprocess.run([JUKEBOX, "booth", "approve", "a1", ask_id, "--tape-dir",
                            str(s["tapes"]), *answer], check=True, capture_output=True)  # fmt: skip
            if len(asked) == 2:
                break
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and asked == ["ask-1", "ask-2"]
    yes, no = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert "refused" not in (yes["text"] or "") and "refused" in no["text"]
    calls = payloads(s["tapes"] / "a1.jbx", "tool_call")
    assert [(c["decision"], c["why"]) for c in calls] == [
        ("allow", "ask: the operator approved"),
        ("deny", "ask: the operator refused, or did not answer"),
    ]
    answers = payloads(s["tapes"] / "a1.jbx", "note", "mcp_answer")
    assert [a["answer"] for a in answers] == ["approve", "deny"]
    # Once the run is over, no question waits: an answer is refused.
    again = subprocess.run([JUKEBOX, "booth", "approve", "a1", "ask-1", "--tape-dir",
                            str(s["tapes"])], capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 2
