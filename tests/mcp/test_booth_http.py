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

from jukebox.errors import UsageError
from tests.mcp.conftest import JUKEBOX, payloads

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

HERE = Path(__file__).resolve().parent
TOKEN = "notes-token-5ec7e7-0123456789"
AUTH = "auth-header-0f3c2a-9876543210"  # the config's Authorization: Bearer value
FORK_AUTH = "fork-header-77d1e0-1357924680"  # the fork's, from the environment
REPLAY_AUTH = "replay-header-4b9e21-2468013579"  # replay --until's, from its --mcp-config
ENV = {**os.environ, "NOTES_API_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def notes_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("http")
    notes = tmp / "notes.txt"
    proc = subprocess.Popen([sys.executable, str(HERE / "http_server.py"), str(notes),
                             "--log-auth"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    yield {"url": f"http://127.0.0.1:{port}/mcp", "notes": notes, "tmp": tmp, "proc": proc}
    proc.terminate()
    proc.wait(timeout=10)


def booth(s: dict, tape_id: str, status: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """A booth run of http_agent.py; `notes` from --mcp-upstream unless `extra` declares it."""
    tree = s["tmp"] / f"tree-{tape_id}"
    tree.mkdir()
    declared = [] if "--mcp-config" in extra else ["--mcp-upstream", f"notes={s['url']}"]
    return subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(s["tmp"] / "tapes"),
         "--tape-id", tape_id, *declared, "--commit", "auto", *extra,
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


def test_upstream_client_keeps_its_connection(notes_server: dict) -> None:
    # The server answers each call with an event stream, which the SDK's client closes before
    # its end: the gateway's client (and the commit's) reads that end, so its calls share one
    # connection instead of a new one each (what most of the HTTP gateway's cost per call was).
    import anyio
    from mcp import ClientSession

    from jukebox.mcp.servers import ServerSpec

    s = notes_server
    peers = s["notes"].with_suffix(".peers")
    peers.unlink(missing_ok=True)
    spec = ServerSpec("notes", "", url=s["url"], headers={"Authorization": "Bearer keep"})

    async def calls() -> list[str]:
        texts = []
        async with spec.http_transport() as (read, write, *_), ClientSession(read, write) as c:
            await c.initialize()
            for i in range(6):
                result = await c.call_tool("echo", {"text": f"n{i}"})
                texts.append(result.content[0].text)  # type: ignore[union-attr]
                # The end of the body is read after the answer: a call made before that ends
                # takes another connection (reused too), which a loaded machine makes likely.
                await anyio.sleep(0.02)
        return texts

    assert anyio.run(calls) == [f"n{i}" for i in range(6)]
    posts = [line.split()[1] for line in peers.read_text().splitlines() if line.startswith("POST")]
    assert len(posts) >= 8, posts  # initialize, initialized, 6 calls (the SDK's own list too)
    assert len(set(posts)) <= len(posts) // 2, posts  # one port per POST without the reuse


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
    # Declared in a Claude Code style config, with the operator's Authorization header, beside
    # a stdio server.
    s = notes_server
    config = s["tmp"] / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {
        "notes": {"type": "http", "url": s["url"], "headers": {"Authorization": f"Bearer {AUTH}"}},
        "echo": {"command": sys.executable, "args": [str(HERE / "hostile_server.py")]},
    }}))  # fmt: skip
    s["notes"].with_suffix(".auth").unlink(missing_ok=True)  # what the other tests sent
    proc = booth(s, "h1", 0, "--mcp-config", str(config))
    assert proc.returncode == 0, proc.stderr
    steps = said(proc)
    (url,) = steps["url"]
    assert url["url"].startswith(url["base"]) and url["url"].endswith("/mcp/notes/")
    staged = steps["add_note"][0]
    assert not staged["error"] and staged["structured"]["jukebox"]["id"] == "stage-1"
    # Held until the verdict: the server had not seen it when the agent read again.
    assert [r["text"] for r in steps["read_notes"]] == ["", ""]
    assert steps["knock"] == [{"step": "knock", "status": 404}]
    # The commit ran it against the real server, after the agent's run, as the agent sent it.
    secret = url["base"].split("/")[3]
    assert s["notes"].read_text() == f"hello {TOKEN} {secret}\n"
    # The header reached the server on every request (the gateway's and the commit's); the
    # agent's config has none of it.
    seen = s["notes"].with_suffix(".auth").read_text().splitlines()
    assert len(seen) > 3 and set(seen) == {f"Bearer {AUTH}"}, seen
    assert "headers" not in steps["config"][0]["notes"]
    assert steps["echo"] == [{"step": "echo", "error": False, "text": secret}]
    tape = s["tmp"] / "tapes" / "h1.jbx"
    calls = payloads(tape, "tool_call")
    assert [(c["tool"], c["decision"]) for c in calls] == [
        ("read_notes", "allow"), ("add_note", "stage"), ("read_notes", "allow"),
        ("echo", "allow"), ("add_note", "commit"),
    ]
    assert calls[-1]["ok"] and "added" in json.dumps(calls[-1]["result"])
    # The path secret, the operator's token and the header: in no frame (the stdio wrapper's
    # and the commit's included), no file of the tape dir, nothing the booth said.
    frames = json.dumps(payloads(tape))
    assert calls[-1]["args"] == {"text": "hello [REDACTED] [REDACTED]"}
    for value in (secret, TOKEN, AUTH):
        assert value not in frames and value not in proc.stderr, value
        for path in (s["tmp"] / "tapes").rglob("*"):
            assert not path.is_file() or value.encode() not in path.read_bytes(), (value, path)
    (server,) = payloads(tape, "note", "mcp_server", server="notes")
    assert server["transport"] == "http"
    (start,) = payloads(tape, "run_start")
    assert start["policy"]["mcp_servers"]["notes"] == {"url": s["url"],
                                                       "headers": ["Authorization"]}  # fmt: skip

    # A fork past the recording reaches the server again, with the header the tape names and
    # never holds: a fork without its value stops before anything runs, and says how to give it.
    from jukebox.tape.tape import Tape

    at = [i for i, f in enumerate(Tape.load(tape).frames) if f.kind == "tool_call"][2]
    fork = [JUKEBOX, "fork", str(tape), "--at", str(at), "--exec", "--tape-id", "h1-fork"]
    missing = subprocess.run(fork, capture_output=True, text=True, timeout=60, env=ENV)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "'Authorization'" in missing.stderr and "--mcp-config FILE" in missing.stderr
    assert "$JUKEBOX_MCP_HEADER_NOTES_AUTHORIZATION" in missing.stderr
    assert not (s["tmp"] / "tapes" / "h1-fork.jbx").exists()
    s["notes"].with_suffix(".auth").unlink()
    forked = subprocess.run(fork, capture_output=True, text=True, timeout=120, env={
        **ENV, "JUKEBOX_MCP_HEADER_NOTES_AUTHORIZATION": f"Bearer {FORK_AUTH}"})  # fmt: skip
    assert forked.returncode == 0, forked.stderr
    assert said(forked)["read_notes"][1]["text"].startswith("hello")  # live: the committed note
    assert said(forked)["config"][0]["header_env"] == []  # kept from the agent
    seen = s["notes"].with_suffix(".auth").read_text().splitlines()
    assert seen and set(seen) == {f"Bearer {FORK_AUTH}"}, seen
    fork_calls = payloads(s["tmp"] / "tapes" / "h1-fork.jbx", "tool_call")
    assert [(c["tool"], c["decision"]) for c in fork_calls][-2:] == [
        ("read_notes", "allow"), ("echo", "allow")]  # fmt: skip
    (fork_start,) = payloads(s["tmp"] / "tapes" / "h1-fork.jbx", "run_start")
    assert fork_start["policy"]["mcp_servers"]["notes"]["headers"] == ["Authorization"]

    # `replay --exec --until N` past the staged call: the second read goes live, with the header
    # from the caller's --mcp-config (the fork above took the environment's); without either
    # it stops before anything runs, naming this command.
    staged_at = [i for i, f in enumerate(Tape.load(tape).frames) if f.kind == "tool_call"][1]
    until = [JUKEBOX, "replay", str(tape), "--exec", "--until", str(staged_at), "--json"]
    missing = subprocess.run(until, capture_output=True, text=True, timeout=60, env=ENV)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "`jukebox replay --exec --until N`" in missing.stderr, missing.stderr
    now = s["tmp"] / "now.json"
    now.write_text(json.dumps({"mcpServers": {"notes": {
        "type": "http", "url": s["url"], "headers": {"authorization": f"Bearer {REPLAY_AUTH}"}}}}))
    s["notes"].with_suffix(".auth").unlink()
    replayed_until = subprocess.run([*until, "--mcp-config", str(now)], capture_output=True,
                                    text=True, timeout=120, env=ENV)  # fmt: skip
    assert replayed_until.returncode == 0, replayed_until.stderr
    reads = said(replayed_until)["read_notes"]
    assert reads[0]["text"] == "" and reads[1]["text"].startswith("hello")  # served, then live
    seen = s["notes"].with_suffix(".auth").read_text().splitlines()
    assert seen and set(seen) == {f"Bearer {REPLAY_AUTH}"}, seen
    result = json.loads(replayed_until.stdout.splitlines()[-1])
    until_calls = payloads(s["tmp"] / "tapes" / f"{result['tape_id']}.jbx", "tool_call")
    assert [(c["tool"], c["decision"]) for c in until_calls][:3] == [
        ("read_notes", "replay"), ("add_note", "replay"), ("read_notes", "allow")]  # fmt: skip
    for path in (s["tmp"] / "tapes").rglob("*"):  # the fork's and the replay's included
        for value in (AUTH, FORK_AUTH, REPLAY_AUTH):
            assert not path.is_file() or value.encode() not in path.read_bytes(), (value, path)

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
    assert result["tools_served"] == 4, result
    replayed = payloads(s["tmp"] / "tapes" / f"{result['tape_id']}.jbx", "tool_call")
    assert [c["decision"] for c in replayed] == ["replay"] * 4
    # The replay's gateway has a secret of its own, compared and kept off its tape the same way.
    fresh = again["url"][0]["base"].split("/")[3]
    assert fresh != secret and fresh not in json.dumps(replayed)


def test_fork_headers_from_the_callers_config_before_the_environment(tmp_path: Path) -> None:
    # What `fork --exec --mcp-config FILE` and `replay --exec --until N` resolve before the
    # booth starts (the fork above takes the environment's; here both are given).
    from jukebox.mcp.servers import header_env_name
    from jukebox.timetravel.timetravel import Recorded
    from shadowfs.oid import ObjectId

    config = tmp_path / "now.json"
    config.write_text(json.dumps({"mcpServers": {"my-notes": {
        "type": "http", "url": "https://elsewhere.example/mcp",
        "headers": {"authorization": "Bearer from-config"}}}}))  # fmt: skip
    env = {header_env_name("my-notes", "Authorization"): "Bearer from-env",
           header_env_name("my-notes", "X-Team"): "blue"}  # fmt: skip
    assert list(env) == ["JUKEBOX_MCP_HEADER_MY_NOTES_AUTHORIZATION",
                         "JUKEBOX_MCP_HEADER_MY_NOTES_X_TEAM"]  # fmt: skip
    run = Recorded("t", ["agent"], "/t", "/t", ObjectId(bytes(32)), None, None, "fuse",
                   {"my-notes": {"url": "https://mcp.example/mcp",
                                 "headers": ["Authorization", "X-Team"]}})  # fmt: skip
    run.resolve_mcp_headers(config, env, "`jukebox fork --exec`", live=True)
    # The recorded URL (the config's is another server's now), the headers by name.
    assert run.mcp_config({}) == {"mcpServers": {"my-notes": {
        "type": "http", "url": "https://mcp.example/mcp",
        "headers": {"Authorization": "Bearer from-config", "X-Team": "blue"}}}}  # fmt: skip
    # A replay that never goes past its recording sends the server nothing: none is needed.
    run.resolve_mcp_headers(None, {}, "`jukebox replay --exec --until N`", live=False)
    with pytest.raises(UsageError, match=r"'X-Team'.*JUKEBOX_MCP_HEADER_MY_NOTES_X_TEAM"):
        run.resolve_mcp_headers(config, {}, "`jukebox fork --exec`", live=True)
