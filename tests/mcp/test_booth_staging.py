"""The stage gate in a booth: destructive calls on the real memory server staged until the
verdict, run in order by the commit, dropped by rollback and discard, kept by a pending booth
for a later `jukebox booth commit` from another process, asks answered by the operator; an agent
that tries to stage a program of its own is refused, and so is a record edited to run one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def booth_answering(s: dict, tape_id: str, commit: str, answers: list[str], *steps: str
                    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """A booth run whose questions (`ask`) the test answers in turn, as an operator would: with
    `jukebox booth approve` from outside (the agent cannot answer itself: answers go in the
    hidden tape dir, never over its control socket)."""
    proc = subprocess.Popen(
        [JUKEBOX, "booth", "run", "--tree", str(s["tree"]), "--tape-dir", str(s["tapes"]),
         "--tape-id", tape_id, "--mcp-config", str(s["config"]), "--commit", commit, "--",
         sys.executable, AGENT, *steps],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=s["tree"],
    )  # fmt: skip
    assert proc.stderr is not None
    asked, seen = [], []
    for line in proc.stderr:
        seen.append(line)
        marker = f"jukebox booth approve {tape_id} "
        if marker in line:
            ask_id = line.split(marker)[1].split("`")[0]
            flag = [] if answers[len(asked)] == "approve" else ["--deny"]
            asked.append(ask_id)
            subprocess.run([JUKEBOX, "booth", "approve", tape_id, ask_id, "--tape-dir",
                            str(s["tapes"]), *flag], check=True, capture_output=True)  # fmt: skip
            if len(asked) == len(answers):
                break
    out, err = proc.communicate(timeout=120)
    assert asked == [f"ask-{i + 1}" for i in range(len(answers))], "".join(seen) + err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(seen) + err)


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
    # add_observations asks the operator: the first call is refused, the second approved.
    proc = booth_answering(s, "p1", "never", ["deny", "approve"], "ask", "add_observations",
                           "create", "alpha", "checkpoint", "cp1", "create", "beta",
                           "rollback", "cp1", "create", "gamma", "attack", str(pwned),
                           "observe", "alpha", "observe", "gamma",
                           "write", "notes.txt")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    steps = said(proc)
    refused, approved = [x for x in steps if x["step"] == "observe"]
    assert refused["error"] and "jukebox refused" in refused["text"]
    assert "jukebox" not in approved["text"]  # forwarded: the server's own answer
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
    assert [(c["decision"], c["why"]) for c in calls if c.get("reported_by")] == [
        ("stage", "not readOnlyHint"), ("stage", "not readOnlyHint"),
        ("stage", "not readOnlyHint"), ("deny", "ask: the operator refused, or did not answer"),
        ("allow", "ask: the operator approved"),
    ]
    answers = payloads(tape, "note", "mcp_answer")
    assert [a["answer"] for a in answers] == ["deny", "approve"]
    (dropped,) = payloads(tape, "note", "mcp_dropped")
    assert dropped["ids"] == ["stage-2"] and "rollback" in dropped["reason"]
    (report,) = payloads(tape, "note", "mcp_commit")
    assert report["ran"] == ["stage-1", "stage-3"] and report["failed"] is None


def test_verdicts_commit_in_order_stop_at_a_failure_and_discard(setup: dict) -> None:
    s = setup
    # A passing verdict: the files, then the calls; the failing one stops the rest, and the
    # one that ran before it gets the compensating call the operator declares: the policy
    # file's entry, then --mcp-compensate's for the same tool, which wins (the last one).
    policy = s["tmp"] / "policy.toml"
    policy.write_text('[compensate."memory/create_entities"]\ntool = "no_such_tool"\n'
                      'args = {entityNames = "$args.entities.*.name"}\n')  # fmt: skip
    flag = ('memory/create_*={tool = "delete_entities", '
            'args = {entityNames = "$args.entities.*.name"}}')  # fmt: skip
    proc = booth(s, "c1", "auto", "create", "delta", "observe", "nobody-here",
                 "create", "epsilon", "write", "c1.txt",
                 opts=["--mcp-policy", str(policy), "--mcp-compensate", flag])  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "staged MCP call stage-2 of booth c1 failed" in proc.stderr
    assert "ran before it: stage-1; not run: stage-3" in proc.stderr
    assert "compensated: stage-1; compensation failed: none" in proc.stderr
    assert (s["tree"] / "c1.txt").exists()
    assert entities(s["memory"]) == []  # delta was created by the commit, then deleted
    (report,) = payloads(s["tapes"] / "c1.jbx", "note", "mcp_commit")
    assert report["ran"] == ["stage-1"] and report["failed"] == "stage-2"
    assert report["not_run"] == ["stage-3"] and report["compensated"] == ["stage-1"]
    undo = payloads(s["tapes"] / "c1.jbx", "tool_call")[-1]
    assert (undo["decision"], undo["tool"], undo["args"], undo["ok"]) == (
        "compensate", "delete_entities", {"entityNames": ["delta"]}, True)  # fmt: skip
    (start,) = payloads(s["tapes"] / "c1.jbx", "run_start")
    assert [c[:2] for c in start["policy"]["mcp_policy"]["compensate"]] == [
        ["memory/create_entities", "no_such_tool"], ["memory/create_*", "delete_entities"]]

    # The breaker counts tool calls: the second staged call trips --max-tool-calls 1, the
    # agent is stopped, the booth rolled back and its staged call dropped, nothing reaches
    # the server.
    proc = booth(s, "d1", "auto", "create", "zeta", "create", "eta", "write", "d1.txt",
                 opts=["--max-tool-calls", "1"])  # fmt: skip
    assert proc.returncode != 0, proc.stderr
    assert "circuit breaker tripped" in proc.stderr
    assert entities(s["memory"]) == []
    assert not (s["tree"] / "d1.txt").exists()
    (trip,) = payloads(s["tapes"] / "d1.jbx", "breaker")
    assert trip["rule"] == "max_tool_calls" and trip["limit"] == 1
    (dropped,) = payloads(s["tapes"] / "d1.jbx", "note", "mcp_dropped")
    assert dropped["ids"] == ["stage-1"]



def test_an_ask_answered_on_the_booths_terminal(setup: dict) -> None:
    from tests.on_terminal import plain, run_on_terminal

    s = setup
    status, screen = run_on_terminal(
        [JUKEBOX, "booth", "run", "--tree", str(s["tree"]), "--tape-dir", str(s["tapes"]),
         "--tape-id", "t1", "--mcp-config", str(s["config"]), "--", sys.executable, AGENT,
         "ask", "add_observations", "observe", "nobody"],
        env=dict(os.environ), cwd=s["tree"], timeout=120,
        answer=(b"(ask-1): allow it? [y/N]", "y"),
    )  # fmt: skip
    text = plain(screen)
    assert status == 0, text
    assert "the agent asks to call memory/add_observations (ask-1): allow it? [y/N] y" in text
    (observe,) = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert "jukebox refused" not in observe["text"]  # forwarded: the server's own answer
    (answer,) = payloads(s["tapes"] / "t1.jbx", "note", "mcp_answer")
    assert answer["answer"] == "approve" and answer["by"] == "terminal"


def test_compensate_flag_takes_a_policy_files_entry_as_toml_or_json() -> None:
    from jukebox.errors import UsageError
    from jukebox.mcp.policy import build_policy, parse_compensation

    toml = parse_compensation('m/create={tool = "delete", args = {names = "$args.items.*.id"}}')
    json_form = parse_compensation('m/create={"tool": "delete", '
                                   '"args": {"names": "$args.items.*.id"}}')  # fmt: skip
    assert toml == json_form
    policy = build_policy(None, compensate=['m/create={tool = "delete", args = {}}',
                                            'm/*={tool = "undo"}'])  # fmt: skip
    assert policy.compensation("m", "create", {}) == {"tool": "undo", "args": {}}  # the last
    for bad, said in (("m/create", "write SERVER/TOOL={tool"),
                      ("m/create={tool = }", "neither a TOML inline table nor a JSON object"),
                      ('m/create={tool = "t", when = "now"}', "must be {tool")):  # fmt: skip
        with pytest.raises(UsageError, match=said.replace("{", r"\{")):
            parse_compensation(bad)


def test_an_agent_that_leaves_at_once_loses_no_frame(setup: dict) -> None:
    # The wrapper writes each frame to the supervisor's socket before the agent has its answer,
    # without waiting for the supervisor's reply; the agent's end ends the booth and kills the
    # wrapper at once, and the supervisor still reads every frame its socket holds.
    s = setup
    proc = booth(s, "v1", "auto", "search", "a", "search", "b", "search", "c", "vanish", "0")
    assert proc.returncode == 0, proc.stderr
    assert [x["step"] for x in said(proc)] == ["search"] * 3
    calls = payloads(s["tapes"] / "v1.jbx", "tool_call")
    assert [(c["tool"], c["args"]["query"], c["ok"]) for c in calls] == [
        ("search_nodes", q, True) for q in "abc"
    ]


def test_a_staged_calls_frame_served_after_the_agents_rollback_is_recorded_once(
    tmp_path: Path,
) -> None:
    # The gateway sends a staged call's frame after the agent has its answer; the agent's
    # rollback, on its own connection, may be served first (seen at load 10). The frame is
    # still recorded; one naming a call never staged here, or a second one for the same call,
    # is refused.
    from jukebox.booth.control import RequestError
    from jukebox.mcp.servers import ServerSpec
    from jukebox.mcp.staging import StageGate
    from jukebox.tape.tape import TapeWriter
    from shadowfs.store import Store

    store = Store.open(tmp_path / "store", create=True)
    writer = TapeWriter.create(tmp_path / "t.jbx", store, "t", fsync=False)
    writer.append("run_start", {"name": "t"})
    gate = StageGate({"memory": ServerSpec("memory", "memory-server")}, writer.append)
    staged = gate.stage_declared("memory", "create", {"name": "beta"}, 1)["id"]
    assert gate.drop_after(1, "rollback to cp1") == [staged]

    def frame(staged_id: str) -> dict[str, Any]:
        payload = {"server": "memory", "tool": "create", "args": {"name": "beta"},
                   "decision": "stage", "staged_id": staged_id}  # fmt: skip
        return {"kind": "tool_call", "payload": payload}

    gate.handle_record(frame(staged))
    for wrong in (staged, "stage-9"):
        with pytest.raises(RequestError, match="staged here, once"):
            gate.handle_record(frame(wrong))
    writer.close()
    store.close()
    calls = payloads(tmp_path / "t.jbx", "tool_call")
    assert [(c["staged_id"], c["reported_by"]) for c in calls] == [(staged, "gateway")]
