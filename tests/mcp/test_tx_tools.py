"""The Python API's tool calls: `await tx.tool(session, ...)` over the SDK's ClientSession to the
real memory server, and `tx.stage_tool_call(...)`, under SandboxPolicy(mcp_mode=...)."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from jukebox import Jukebox, SandboxPolicy
from tests.mcp.conftest import memory_server, payloads


def entity(name: str) -> dict:
    return {"entities": [{"name": name, "entityType": "ticket", "observations": ["new"]}]}


def names(result) -> list[str]:  # type: ignore[no-untyped-def]
    return [e["name"] for e in result.structured_content["entities"]]


def test_staged_calls_wait_for_the_commit_in_order_and_rollback_drops(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    env = {**os.environ, "MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")}
    sent: list[str] = []

    async def agent() -> None:
        params = StdioServerParameters(command=memory_server()[0], env=env)
        async with stdio_client(params) as (r, w), ClientSession(r, w) as session:
            await session.initialize()
            jb = Jukebox(tape_dir=str(tmp_path / "tapes"), sandbox=SandboxPolicy(root=tree))
            async with jb.transaction(tape_id="tx1") as tx:
                staged = await tx.tool(session, "create_entities", entity("alpha"))
                assert staged.structured_content == {"jukebox": {"staged": True,
                                                                 "id": "stage-1"}}  # fmt: skip
                # Read-only: runs now, and the staged call has not happened.
                assert names(await tx.tool(session, "read_graph", {})) == []
                cp = tx.checkpoint("before-beta")
                await tx.tool(session, "create_entities", entity("beta"))
                tx.rollback_to(cp)  # drops beta's staged call
                tx.stage_tool_call("notify", {"to": "ops"}, run=lambda: sent.append("ops"))
                tx.stage_file_write(tree / "ledger.json", "{}")
                assert sent == []
                outcome = await tx.commit()
            assert outcome.tool_calls["ran"] == ["stage-1", "stage-3"]
            assert outcome.tool_calls["failed"] is None
            assert names(await session.call_tool("read_graph", {})) == ["alpha"]

    anyio.run(agent)
    assert sent == ["ops"] and (tree / "ledger.json").read_text() == "{}"
    tape = tmp_path / "tapes" / "tx1.jbx"
    calls = payloads(tape, "tool_call")
    assert [(c["tool"], c["decision"]) for c in calls] == [
        ("create_entities", "stage"), ("read_graph", "allow"), ("create_entities", "stage"),
        ("notify", "stage"), ("create_entities", "commit"), ("notify", "commit"),
    ]  # fmt: skip
    (dropped,) = payloads(tape, "note", "mcp_dropped")
    assert dropped["ids"] == ["stage-2"]


def test_deny_mode_refuses_tool_calls_that_are_not_read_only(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    env = {**os.environ, "MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")}

    async def agent() -> None:
        params = StdioServerParameters(command=memory_server()[0], env=env)
        async with stdio_client(params) as (r, w), ClientSession(r, w) as session:
            await session.initialize()
            jb = Jukebox(tape_dir=str(tmp_path / "tapes"),
                         sandbox=SandboxPolicy(root=tree, mcp_mode="deny"))  # fmt: skip
            async with jb.transaction(tape_id="tx2") as tx:
                refused = await tx.tool(session, "create_entities", entity("alpha"))
                assert refused.is_error and "mcp_mode" in refused.content[0].text
                with pytest.raises(PermissionError, match="mcp_mode='deny'"):
                    tx.stage_tool_call("notify", {}, run=lambda: None)
                assert names(await tx.tool(session, "read_graph", {})) == []
                await tx.commit()
            assert names(await session.call_tool("read_graph", {})) == []

    anyio.run(agent)
    decisions = [c["decision"] for c in payloads(tmp_path / "tapes" / "tx2.jbx", "tool_call")]
    assert decisions == ["deny", "deny", "allow"]


def test_the_log_names_the_server_and_the_decision() -> None:
    from jukebox.display.render import describe

    staged = {"server": "memory", "tool": "create_entities", "args": {"n": 1},
              "decision": "stage", "staged_id": "stage-2"}  # fmt: skip
    assert describe("tool_call", staged) == "memory/create_entities({'n': 1}) staged stage-2"
    assert describe("tool_call", {**staged, "decision": "commit"}).endswith(" ran stage-2")
    assert describe("tool_call", {"tool": "t", "args": {}, "decision": "deny"}) == "t({}) denied"


def test_ask_and_a_compensating_call_over_the_memory_server(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    env = {**os.environ, "MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")}
    asked: list[tuple] = []

    async def operator(server, tool, args) -> bool:  # type: ignore[no-untyped-def]
        asked.append((server, tool, args))
        return args["entities"][0]["name"] == "asked-yes"

    def fail() -> None:
        raise RuntimeError("the ticket system is down")

    async def agent() -> None:
        params = StdioServerParameters(command=memory_server()[0], env=env)
        async with stdio_client(params) as (r, w), ClientSession(r, w) as session:
            await session.initialize()
            jb = Jukebox(tape_dir=str(tmp_path / "tapes"), sandbox=SandboxPolicy(root=tree))
            async with jb.transaction(tape_id="tx3") as tx:
                rules = {"memory/create_*": "ask"}
                yes = await tx.tool(session, "create_entities", entity("asked-yes"),
                                    server="memory", rules=rules, ask=operator)  # fmt: skip
                no = await tx.tool(session, "create_entities", entity("asked-no"),
                                   server="memory", rules=rules, ask=operator)  # fmt: skip
                assert not yes.is_error and no.is_error
                # The approved call ran at once; the refused one never did.
                assert names(await tx.tool(session, "read_graph", {})) == ["asked-yes"]
                await tx.tool(session, "create_entities", entity("alpha"), server="memory",
                              compensate=("delete_entities", {"entityNames": ["alpha"]}))
                tx.stage_tool_call("notify", {"to": "ops"}, run=fail)
                outcome = await tx.commit()
            assert outcome.tool_calls["ran"] == ["stage-1"]
            assert outcome.tool_calls["failed"] == "stage-2"
            # alpha was created by the commit, then taken back when notify failed.
            assert outcome.tool_calls["compensated"] == ["stage-1"]
            assert names(await session.call_tool("read_graph", {})) == ["asked-yes"]

    anyio.run(agent)
    assert [a[2]["entities"][0]["name"] for a in asked] == ["asked-yes", "asked-no"]
    calls = payloads(tmp_path / "tapes" / "tx3.jbx", "tool_call")
    assert [(c["tool"], c["decision"]) for c in calls] == [
        ("create_entities", "allow"), ("create_entities", "deny"), ("read_graph", "allow"),
        ("create_entities", "stage"), ("notify", "stage"), ("create_entities", "commit"),
        ("notify", "commit"), ("delete_entities", "compensate"),
    ]  # fmt: skip
    assert calls[0]["why"] == "ask: the operator approved" and calls[-1]["ok"]
