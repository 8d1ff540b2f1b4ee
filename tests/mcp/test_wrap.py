"""`jukebox mcp wrap` outside a booth: real servers behind it, the SDK's ClientSession in front,
and the gateway's own tape recording every call."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import anyio
import pytest
from mcp.shared.exceptions import MCPError

from tests.mcp.conftest import (
    JUKEBOX,
    git_server,
    hostile_server,
    memory_server,
    only_tape,
    payloads,
    wrapped,
)  # fmt: skip

ENTITY = {"name": "ticket-1", "entityType": "ticket", "observations": ["opened by the agent"]}


def test_memory_server_calls_are_forwarded_and_recorded(tmp_path: Path) -> None:
    tapes = tmp_path / "tapes"
    env = {"MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")}

    async def agent() -> None:
        async with wrapped(memory_server(), "--tape-dir", str(tapes), "--name", "memory",
                           env=env) as session:  # fmt: skip
            tools = {t.name: t for t in (await session.list_tools()).tools}
            assert tools["read_graph"].annotations.read_only_hint is True
            created = await session.call_tool("create_entities", {"entities": [ENTITY]})
            assert not created.is_error
            graph = await session.call_tool("read_graph", {})
            assert graph.structured_content["entities"][0]["name"] == "ticket-1"

    anyio.run(agent)
    # Forwarded for real: the server wrote its file.
    assert "ticket-1" in (tmp_path / "memory.jsonl").read_text()
    tape = only_tape(tapes)
    calls = payloads(tape, "tool_call")
    assert [c["tool"] for c in calls] == ["create_entities", "read_graph"]
    create, read = calls
    assert create["server"] == "memory"
    assert create["args"] == {"entities": [ENTITY]}
    # Outside a booth nothing waits for a verdict: what would be staged is forwarded (--mode
    # record), and the tape says so.
    assert create["decision"] == "allow" and "mode record" in create["why"]
    assert read["decision"] == "allow" and read["why"] == "readOnlyHint"
    assert read["result"]["structuredContent"]["entities"][0]["name"] == "ticket-1"
    assert read["result"]["content"][0]["type"] == "text"
    assert create["ok"] is True and create["latency_ms"] >= 0
    listed = payloads(tape, "note", "mcp_list")
    assert listed and listed[0]["what"] == "tools/list"
    assert {t["name"] for t in listed[0]["result"]["tools"]} >= {"create_entities", "read_graph"}
    assert payloads(tape, "note", "mcp_server")[0]["initialize"]["serverInfo"]["name"]
    verified = subprocess.run([JUKEBOX, "verify", str(tape)], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr
    listing = subprocess.run([JUKEBOX, "ls", "--tape-dir", str(tapes), "--json"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(listing.stdout)[0]["status"] == "EXITED"

    # Replay, offline: no server starts (the command after -- does not even exist), the
    # memory file is gone, and the recorded answers come back.
    (tmp_path / "memory.jsonl").unlink()
    replays = tmp_path / "replays"

    async def replay(entity: dict) -> str | None:
        async with wrapped(["/nonexistent/server"], "--tape-dir", str(replays), "--replay",
                           str(tape)) as session:  # fmt: skip
            assert "read_graph" in {t.name for t in (await session.list_tools()).tools}
            try:
                created = await session.call_tool("create_entities", {"entities": [entity]})
            except MCPError as error:
                return str(error)
            assert not created.is_error
            graph = await session.call_tool("read_graph", {})
            assert graph.structured_content["entities"][0]["name"] == "ticket-1"
        return None

    assert anyio.run(replay, ENTITY) is None
    assert not (tmp_path / "memory.jsonl").exists()
    (replayed,) = replays.glob("*.jbx")
    assert [c["replayed_from"] for c in payloads(replayed, "tool_call")] == _seqs(tape)
    replayed.unlink()

    # A changed argument is a divergence, reported like a model's.
    assert "replay diverged at frame" in anyio.run(replay, {**ENTITY, "name": "ticket-2"})
    (diverged,) = replays.glob("*.jbx")
    (note,) = payloads(diverged, "note", "divergence")
    assert note["kind"] == "request_mismatch" and note["provider"] == "mcp:memory"
    assert any("ticket-2" in line for line in note["diff"])


def _seqs(tape: Path) -> list[int]:
    from jukebox.tape.tape import Tape

    return [f.seq for f in Tape.load(tape).intact_frames if f.kind == "tool_call"]


def test_deny_mode_refuses_what_is_not_read_only(tmp_path: Path) -> None:
    tapes = tmp_path / "tapes"
    memory = tmp_path / "memory.jsonl"

    async def agent() -> None:
        async with wrapped(memory_server(), "--tape-dir", str(tapes), "--mode", "deny",
                           "--max-tool-calls", "2",
                           env={"MEMORY_FILE_PATH": str(memory)}) as session:  # fmt: skip
            refused = await session.call_tool("create_entities", {"entities": [ENTITY]})
            assert refused.is_error
            assert "refused" in refused.content[0].text
            graph = await session.call_tool("read_graph", {})  # read-only: still served
            assert graph.structured_content["entities"] == []
            # The breaker: a third call is past --max-tool-calls 2, refused without running.
            third = await session.call_tool("read_graph", {})
            assert third.is_error and "--max-tool-calls 2" in third.content[0].text

    anyio.run(agent)
    assert not memory.exists() or "ticket-1" not in memory.read_text()
    create, read, third = payloads(only_tape(tapes), "tool_call")
    assert create["decision"] == "deny" and create["ok"] is False
    assert read["decision"] == "allow"
    assert third["decision"] == "deny" and third["breaker"]["rule"] == "max_tool_calls"


def test_a_policy_rule_beats_the_annotations(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    policy = tmp_path / "policy.toml"
    policy.write_text('mode = "record"\n[tools]\n"git/git_log" = "deny"\n')

    async def agent() -> None:
        async with wrapped(git_server(repo), "--tape-dir", str(tmp_path / "tapes"), "--name",
                           "git", "--policy", str(policy)) as session:  # fmt: skip
            status = await session.call_tool("git_status", {"repo_path": str(repo)})
            assert not status.is_error and "branch" in status.content[0].text.lower()
            log = await session.call_tool("git_log", {"repo_path": str(repo)})
            assert log.is_error and "rule git/git_log" in log.content[0].text

    anyio.run(agent)
    status, log = payloads(only_tape(tmp_path / "tapes"), "tool_call")
    assert status["decision"] == "allow" and status["why"] == "readOnlyHint"
    assert log["decision"] == "deny" and log["why"] == "rule git/git_log"


def test_hostile_server_huge_result_a_hang_and_a_secret(tmp_path: Path) -> None:
    tapes = tmp_path / "tapes"
    size = 1024 * 1024
    secret = "s3cr3t-value-0123456789"

    async def agent() -> None:
        async with wrapped(hostile_server(), "--tape-dir", str(tapes), "--timeout", "2",
                           env={"TICKETS_API_TOKEN": secret}) as s:  # fmt: skip
            huge = await s.call_tool("huge", {"size": size})
            assert len(huge.content[0].text) == size
            with pytest.raises(MCPError, match=r"did not answer tools/call 'hang' within 2s"):
                await s.call_tool("hang", {})
            # The gateway is still serving after the timeout.
            echoed = await s.call_tool("echo", {"text": f"token is {secret}"})
            assert echoed.content[0].text == f"token is {secret}"  # the agent gets it as is

    anyio.run(agent)
    tape = only_tape(tapes)
    huge, hang, echo = payloads(tape, "tool_call")
    assert len(huge["result"]["content"][0]["text"]) == size  # whole, through the store
    assert hang["ok"] is False and "did not answer" in hang["error"]["message"]
    # Secrets never reach a tape: the secret-looking variable's value is redacted everywhere.
    assert echo["ok"] is True and echo["args"] == {"text": "token is [REDACTED]"}
    assert secret.encode() not in tape.read_bytes()


def test_a_relayed_call_cancelled_by_the_agent_and_one_the_server_dies_in(tmp_path: Path) -> None:
    # Both calls are read-only, so relayed as they came (jukebox.mcp.relay), not through the
    # gateway's SDK server and client: the cancellation must reach the server, and a server
    # that dies must fail the call it held, not leave the agent waiting.
    tapes = tmp_path / "tapes"

    async def agent() -> str:
        async with wrapped(hostile_server(), "--tape-dir", str(tapes)) as s:
            await s.list_tools()  # the gateway knows the tools' annotations: it may relay
            with anyio.move_on_after(1) as waited:
                await s.call_tool("hang", {})
            assert waited.cancelled_caught  # the SDK's client sends notifications/cancelled
            echoed = await s.call_tool("echo", {"text": "after"})
            assert echoed.content[0].text == "after"
            with pytest.raises(MCPError) as error:
                await s.call_tool("die", {})
            return str(error.value)

    assert "closed its connection before answering" in anyio.run(agent)
    hang, echo, die = payloads(only_tape(tapes), "tool_call")
    assert hang["ok"] is False and hang["error"] == {"message": "cancelled by the agent"}
    assert echo["ok"] is True and echo["result"]["content"][0]["text"] == "after"
    assert die["ok"] is False and "closed its connection" in die["error"]["message"]


def test_max_tool_repeat_refuses_the_nth_identical_call_in_a_row(tmp_path: Path) -> None:
    async def agent() -> list[tuple[bool, str]]:
        async with wrapped(hostile_server(), "--tape-dir", str(tmp_path / "tapes"),
                           "--max-tool-repeat", "2") as s:  # fmt: skip
            out = []
            for text in ("a", "b", "b"):  # a, b: different calls; b again: the 2nd in a row
                result = await s.call_tool("echo", {"text": text})
                out.append((result.is_error, result.content[0].text))
            return out

    a, b, again = anyio.run(agent)
    assert a == (False, "a") and b == (False, "b")
    assert again[0] and "--max-tool-repeat 2" in again[1] and "it did not run" in again[1]


@pytest.mark.parametrize("mode", ["mute", "garbage"])
def test_a_server_that_never_answers_initialize_is_a_clear_error(tmp_path: Path,
                                                                 mode: str) -> None:  # fmt: skip
    # mute: silence; garbage: lines that are not JSON-RPC, and an answer to nothing asked.
    proc = subprocess.run(
        [JUKEBOX, "mcp", "wrap", "--tape-dir", str(tmp_path / "tapes"), "--start-timeout", "1",
         "--", *hostile_server(mode)],
        input="", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "did not answer initialize within 1s" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no server to wrap"),
        (["--mode", "staged_acid", "--", "true"], "staging needs a booth"),
        (["--allow", "x", "--deny", "", "--", "true"], "non-empty"),
        (["--timeout", "0", "--", "true"], "--timeout"),
        (["--policy", "{bad_compensation}", "--", "true"], "must be {tool"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[compensate]\n"memory/create_*" = "delete_entities"\n')
    args = [a.format(bad_compensation=bad) for a in args]
    proc = subprocess.run([JUKEBOX, "mcp", "wrap", "--tape-dir", str(tmp_path), *args],
                          input="", capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode in (1, 2), proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_mcp_config_is_rewritten_through_the_gateway(tmp_path: Path) -> None:
    config = tmp_path / ".mcp.json"
    config.write_text(json.dumps({"mcpServers": {
        "memory": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-memory"],
                   "env": {"MEMORY_FILE_PATH": "/data/memory.jsonl"}},
        "web": {"type": "http", "url": "https://example.invalid/mcp"},
    }}))  # fmt: skip
    out = tmp_path / "wrapped.json"
    subprocess.run([JUKEBOX, "mcp", "config", str(config), "-o", str(out)], check=True)
    servers = json.loads(out.read_text())["mcpServers"]
    assert servers["memory"]["command"] == JUKEBOX
    assert servers["memory"]["args"] == ["mcp", "wrap", "--name", "memory", "--", "npx", "-y",
                                         "@modelcontextprotocol/server-memory"]  # fmt: skip
    assert servers["memory"]["env"] == {"MEMORY_FILE_PATH": "/data/memory.jsonl"}
    assert servers["web"] == {"type": "http", "url": "https://example.invalid/mcp"}

    # A config that is not one is refused in one line, by `mcp config` and by a booth alike,
    # before the booth makes anything.
    config.write_text('{"servers": {}}')
    (tmp_path / "tree").mkdir()
    for args in (["mcp", "config", str(config)],
                 ["booth", "run", "--tree", str(tmp_path / "tree"), "--tape-dir",
                  str(tmp_path / "tapes"), "--mcp-config", str(config), "--", "true"]):  # fmt: skip
        proc = subprocess.run([JUKEBOX, *args], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 2 and 'no "mcpServers" object' in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "tapes").exists()


def test_a_call_on_the_sdk_path_cancelled_or_left_is_recorded(tmp_path: Path) -> None:
    # Called before any listing, so through the gateway's SDK server and client, not relayed:
    # a call the agent cancels, and one the agent leaves without a word (its pipe closed
    # mid-call), each end in a tool_call frame that says so, as a relayed call's does.
    import os

    cancelled_dir, left_dir = tmp_path / "cancelled", tmp_path / "left"

    async def agent() -> None:
        async with wrapped(hostile_server(), "--tape-dir", str(cancelled_dir)) as s:
            with anyio.move_on_after(1) as waited:
                await s.call_tool("hang", {})
            assert waited.cancelled_caught  # the SDK's client sends notifications/cancelled
            echoed = await s.call_tool("echo", {"text": "after"})
            assert echoed.content[0].text == "after"

    anyio.run(agent)
    hang, echo = payloads(only_tape(cancelled_dir), "tool_call")
    assert hang["ok"] is False and hang["error"] == {"message": "cancelled by the agent"}
    assert hang["cancelled"] is True and echo["ok"] is True

    # An agent that goes away: its lines, then its end of the pipe closed while `hang` runs.
    reached = tmp_path / "reached"  # the server notes there that `hang` has started
    wrapper = subprocess.Popen(
        [JUKEBOX, "mcp", "wrap", "--tape-dir", str(left_dir), "--", *hostile_server()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "HOSTILE_HANG_LOG": str(reached)},
    )  # fmt: skip
    assert wrapper.stdin is not None and wrapper.stdout is not None
    for message in (
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "leaver", "version": "1"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
         "params": {"name": "hang", "arguments": {}}},
    ):  # fmt: skip
        wrapper.stdin.write(json.dumps(message).encode() + b"\n")
        wrapper.stdin.flush()
        if message.get("id") == 1:
            assert b'"result"' in wrapper.stdout.readline()  # initialized
    import time

    deadline = time.monotonic() + 30
    while not (reached.exists() and list(left_dir.glob("*.jbx"))):  # the call is at the server
        assert time.monotonic() < deadline, "the hang call never reached the server"
        time.sleep(0.05)
    wrapper.stdin.close()
    assert wrapper.wait(timeout=30) == 0
    [left] = payloads(only_tape(left_dir), "tool_call")
    assert left["tool"] == "hang" and left["ok"] is False and left["cancelled"] is True, left
    assert left["error"] == {"message": "the agent closed the connection first"}
