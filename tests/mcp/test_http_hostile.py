"""A streamable-HTTP upstream that misbehaves, through the booth's HTTP gateway
(jukebox.mcp.http_gateway, as the supervisor runs it: a real stage gate recording on a real
tape): a big result is served and recorded whole, one past the SDK's 1 MiB limit on a
server-sent event is a clear error, and a body that is not JSON-RPC, an answer to a
request nobody sent and a call never answered each end in a clear MCP error to the agent's SDK
client within the gateway's timeout, and the gateway keeps serving."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.mcp.conftest import http_gateway_before, payloads

HERE = Path(__file__).resolve().parent
TIMEOUT = 2.0


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[dict[str, Any]]:
    script = HERE / "hostile_http_server.py"
    with http_gateway_before(script, "h", tmp_path, TIMEOUT) as gateway:
        yield gateway


def test_a_hostile_http_upstream_ends_in_clear_errors(gateway: dict[str, Any]) -> None:
    size = 256 * 1024  # twice in the result (content and structuredContent)
    took: dict[str, float] = {}

    async def agent() -> dict[str, str]:
        errors: dict[str, str] = {}
        async with (
            streamable_http_client(gateway["url"]) as (read, write, *_),
            ClientSession(read, write, read_timeout_seconds=30) as session,
        ):
            await session.initialize()
            await session.list_tools()
            result = await session.call_tool("huge", {"size": size})
            assert len(result.content[0].text) == size
            with pytest.raises(MCPError, match="exceeded the 1048576 byte limit"):
                await session.call_tool("huge", {"size": 4 * size})
            for tool in ("garbage", "stray", "hang"):
                started = time.monotonic()
                with pytest.raises(MCPError) as raised:
                    await session.call_tool(tool, {})
                took[tool] = time.monotonic() - started
                errors[tool] = str(raised.value)
            # Still serving after all of it.
            echoed = await session.call_tool("echo", {"text": "still here"})
            assert echoed.content[0].text == "still here"
        return errors

    errors = anyio.run(agent)
    # Never a hang: each ends within the gateway's timeout (the client would wait 30 s).
    assert all(t < TIMEOUT + 5 for t in took.values()), took
    # A body that is not JSON-RPC: the SDK's client says so at once.
    assert errors["garbage"].startswith("Failed to parse JSON response"), errors
    # An answer to nothing, in the body of the call's POST (relayed: jukebox.mcp.http_relay):
    # said at once.
    assert errors["stray"] == "jukebox: the MCP server 'h' answered another request than this call"
    # No answer: the timeout.
    assert errors["hang"] == (f"jukebox: the MCP server 'h' did not answer tools/call 'hang' "
                              f"within {TIMEOUT:g}s"), errors  # fmt: skip
    calls = payloads(gateway["tape"], "tool_call")
    assert [c["tool"] for c in calls] == ["huge", "huge", "garbage", "stray", "hang", "echo"]
    assert len(calls[0]["result"]["content"][0]["text"]) == size  # recorded whole
    assert [c["ok"] for c in calls] == [True, False, False, False, False, True]
    assert "byte limit" in calls[1]["error"]["message"]
    assert "Failed to parse JSON response" in calls[2]["error"]["message"]
    assert "answered another request" in calls[3]["error"]["message"]
    assert "did not answer" in calls[4]["error"]["message"]
