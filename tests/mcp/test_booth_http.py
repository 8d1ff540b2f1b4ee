"""A streamable-HTTP MCP server through the booth's gateway (`--mcp-upstream NAME=URL`): the
agent's SDK client reaches it at the URL of the rewritten config, a destructive call is staged
and invisible to the server until the verdict, then run by the commit; the gateway answers
nothing without its secret; with the server stopped, `jukebox replay --exec` serves the run's
calls from the tape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mcp.conftest import JUKEBOX, payloads

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

HERE = Path(__file__).resolve().parent
TOKEN = "notes-token-5ec7e7-0123456789"
ENV = {**os.environ, "NOTES_API_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def notes_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("http")
    notes = tmp / "notes.txt"
    proc = subprocess.Popen([sys.executable, str(HERE / "http_server.py"), str(notes)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    yield {"url": f"http://127.0.0.1:{port}/mcp", "notes": notes, "tmp": tmp, "proc": proc}
    proc.terminate()
    proc.wait(timeout=10)


def booth(s: dict, tape_id: str, status: int, *extra: str) -> subprocess.CompletedProcess[str]:
    tree = s["tmp"] / f"tree-{tape_id}"
    tree.mkdir()
    return subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(s["tmp"] / "tapes"),
         "--tape-id", tape_id, "--mcp-upstream", f"notes={s['url']}", "--commit", "auto", *extra,
         "--",
         sys.executable, str(HERE / "http_agent.py"), str(status)],
        capture_output=True, text=True, timeout=120, cwd=tree, env=ENV,
    )  # fmt: skip


def said(proc: subprocess.CompletedProcess[str]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            step = json.loads(line)
            if "step" in step:  # not replay's --json result
                out.setdefault(step["step"], []).append(step)
    return out


def test_policy_rules_apply_to_an_http_server(notes_server: dict) -> None:
    # A rule from the policy file, then a flag after it: the flag wins for add_note.
    s = notes_server
    policy = s["tmp"] / "policy.toml"
    policy.write_text('[tools]\n"notes/add_note" = "stage"\n"read_*" = "deny"\n')
    proc = booth(s, "p1", 0, "--mcp-policy", str(policy), "--mcp-deny", "notes/add_note",
                 "--mcp-allow", "read_notes")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    steps = said(proc)
    refused = steps["add_note"][0]
    assert refused["error"] and "rule notes/add_note" in refused["text"]
    assert [r["error"] for r in steps["read_notes"]] == [False, False]
    assert not s["notes"].exists()  # refused: it never reached the server
    tape = s["tmp"] / "tapes" / "p1.jbx"
    calls = payloads(tape, "tool_call")
    assert [(c["tool"], c["decision"], c["why"]) for c in calls] == [
        ("read_notes", "allow", "rule read_notes"), ("add_note", "deny", "rule notes/add_note"),
        ("read_notes", "allow", "rule read_notes"),
    ]  # fmt: skip
    (start,) = payloads(tape, "run_start")
    assert ["notes/add_note", "deny"] in start["policy"]["mcp_policy"]["rules"]


def test_http_server_through_the_stage_gate(notes_server: dict) -> None:
    s = notes_server
    proc = booth(s, "h1", 0)
    assert proc.returncode == 0, proc.stderr
    steps = said(proc)
    (url,) = steps["url"]
    assert url["url"].startswith(url["base"]) and url["url"].endswith("/mcp/notes/")
    staged = steps["add_note"][0]
    assert not staged["error"] and staged["structured"]["jukebox"]["id"] == "stage-1"
    # Held until the verdict: the server had not seen it when the agent read again.
    assert [r["text"] for r in steps["read_notes"]] == ["", ""]
    assert steps["knock"] == [{"step": "knock", "status": 404}]
    # The commit ran it against the real server, after the agent's run.
    assert s["notes"].read_text() == f"hello {TOKEN}\n"  # the commit ran it as the agent sent it
    assert TOKEN.encode() not in (s["tmp"] / "tapes" / "h1.jbx").read_bytes()
    tape = s["tmp"] / "tapes" / "h1.jbx"
    calls = payloads(tape, "tool_call")
    assert [(c["tool"], c["decision"]) for c in calls] == [
        ("read_notes", "allow"), ("add_note", "stage"), ("read_notes", "allow"),
        ("add_note", "commit"),
    ]
    assert calls[-1]["ok"] and "added" in json.dumps(calls[-1]["result"])
    (server,) = payloads(tape, "note", "mcp_server")
    assert server["transport"] == "http" and server["server"] == "notes"
    (start,) = payloads(tape, "run_start")
    assert start["policy"]["mcp_servers"] == {"notes": {"url": s["url"]}}

    # Every server stopped: the replay's gateway answers from the tape.
    s["proc"].terminate()
    s["proc"].wait(timeout=10)
    # The replay compares the agent's arguments with the recorded ones without the secret.
    proc = subprocess.run([JUKEBOX, "replay", str(tape), "--exec", "--json"],
                          capture_output=True, text=True, timeout=120, env=ENV)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    again = said(proc)
    assert again["read_notes"] == steps["read_notes"] and again["add_note"] == steps["add_note"]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["tools_served"] == 3, result
    replayed = payloads(s["tmp"] / "tapes" / f"{result['tape_id']}.jbx", "tool_call")
    assert [c["decision"] for c in replayed] == ["replay"] * 3
