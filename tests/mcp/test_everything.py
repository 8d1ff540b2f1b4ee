"""The reference server `@modelcontextprotocol/server-everything` (npm) through `jukebox mcp
wrap`, reached by an agent framework's MCP client (openai-agents' MCPServerStdio): tools with
text, image and structured results, resources and prompts are forwarded and recorded, a secret
the server hands back (its environment) reaches the agent but never the tape, and
`--replay` answers the SDK's own client with the same results, offline."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from tests.mcp.conftest import HERE, JUKEBOX, only_tape, payloads, wrapped

EVERYTHING = HERE / "node" / "node_modules" / ".bin" / "mcp-server-everything"
SECRET = "sk-jukeboxtest-" + "7" * 32


def everything() -> list[str]:
    if not EVERYTHING.exists():
        pytest.fail(f"{EVERYTHING} is missing: `make setup` installs it (npm ci in tests/mcp/node)")
    return [str(EVERYTHING), "stdio"]


async def through_agents_sdk(tape_dir: Path) -> dict:
    from agents.mcp import MCPServerStdio

    server = MCPServerStdio(
        params={"command": JUKEBOX,
                "args": ["mcp", "wrap", "--name", "everything", "--tape-dir", str(tape_dir),
                         "--", *everything()],
                "env": {**os.environ, "EVERYTHING_API_KEY": SECRET}},
        client_session_timeout_seconds=60,
    )  # fmt: skip
    await server.connect()
    try:
        tools = {t.name for t in await server.list_tools()}
        echo = await server.call_tool("echo", {"message": "hi"})
        image = await server.call_tool("get-tiny-image", {})
        structured = await server.call_tool("get-structured-content", {"location": "Chicago"})
        env = await server.call_tool("get-env", {})
        resources = await server.list_resources()
        uri = str(resources.resources[0].uri)
        read = await server.read_resource(uri)
        prompt = await server.get_prompt("args-prompt", {"city": "Paris", "state": "TX"})
    finally:
        await server.cleanup()
    return {"tools": tools, "echo": echo, "image": image, "structured": structured, "env": env,
            "uri": uri, "read": read, "prompt": prompt}  # fmt: skip


async def replayed(tape: Path, tape_dir: Path, uri: str) -> dict:
    async with wrapped([], "--replay", str(tape), "--tape-dir", str(tape_dir)) as session:
        return {
            "echo": await session.call_tool("echo", {"message": "hi"}),
            "image": await session.call_tool("get-tiny-image", {}),
            "structured": await session.call_tool(
                "get-structured-content", {"location": "Chicago"}
            ),
            "env": await session.call_tool("get-env", {}),
            "read": await session.read_resource(uri),
            "prompt": await session.get_prompt("args-prompt", {"city": "Paris", "state": "TX"}),
        }


def test_everything_server_through_the_gateway_and_back_offline(tmp_path: Path) -> None:
    live = anyio.run(through_agents_sdk, tmp_path)
    assert {"echo", "get-tiny-image", "get-structured-content", "get-env"} <= live["tools"]
    assert live["echo"].content[0].text == "Echo: hi"
    assert live["image"].content[1].type == "image" and live["image"].content[1].data
    assert live["structured"].structured_content["temperature"] is not None
    assert SECRET in live["env"].content[0].text  # the agent gets what the server sent
    assert live["read"].contents and "Paris" in live["prompt"].messages[0].content.text

    tape = only_tape(tmp_path)
    calls = payloads(tape, "tool_call")
    assert [c["tool"] for c in calls] == ["echo", "get-tiny-image", "get-structured-content",
                                         "get-env"]  # fmt: skip
    assert all(c["ok"] and c["decision"] == "allow" for c in calls)
    assert SECRET not in tape.read_text(errors="replace")
    assert "[REDACTED]" in calls[3]["result"]["content"][0]["text"]
    assert [n["uri"] for n in payloads(tape, "note", "mcp_read")] == [live["uri"]]
    assert [n["prompt"] for n in payloads(tape, "note", "mcp_prompt")] == ["args-prompt"]

    # Offline, from the tape, to the SDK's own client: the same answers (the secret aside).
    again = anyio.run(replayed, tape, tmp_path / "replays", live["uri"])
    for key in ("echo", "image", "structured", "read", "prompt"):
        # openai-agents adds the server's identity to a result's _meta; the rest is the server's.
        assert again[key].model_dump(exclude={"meta"}) == live[key].model_dump(exclude={"meta"})
    assert SECRET not in again["env"].content[0].text
