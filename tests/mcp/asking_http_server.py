"""A streamable-HTTP MCP server that talks back in the middle of a call, for
tests/mcp/test_http_relay.py: the SDK's MCPServer with an event store (so its streams can be
resumed with Last-Event-ID), served by uvicorn on 127.0.0.1. Its tools, all read-only (so the
booth's gateway relays them as they came, jukebox.mcp.http_relay):

- `ask`: asks the client its name (elicitation) and answers `hello NAME` (or what it got);
- `sample`: asks the client's model (sampling) and answers `the model said TEXT`;
- `pause`: closes the call's event stream before answering (the client must resume it with
  Last-Event-ID to get the answer), then answers `resumed`;
- `wait`: never answers; when cancelled, writes `cancelled` to the file named on the command
  line, so a test sees that the cancellation reached the server.

Prints its port."""

from __future__ import annotations

import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import EventMessage, EventStore
from mcp.types import SamplingMessage, TextContent, ToolAnnotations
from pydantic import BaseModel

server = MCPServer("asking")
READ_ONLY = ToolAnnotations(readOnlyHint=True)


class Name(BaseModel):
    name: str


@server.tool(annotations=READ_ONLY)
async def ask(ctx: Context) -> str:
    """Asks the client its name."""
    answer = await ctx.elicit("What is your name?", Name)
    if answer.action == "accept":
        return f"hello {answer.data.name}"
    return f"no name: {answer.action}"


@server.tool(annotations=READ_ONLY)
async def sample(ctx: Context, prompt: str) -> str:
    """Asks the client's model."""
    said = await ctx.session.create_message(
        [SamplingMessage(role="user", content=TextContent(type="text", text=prompt))],
        max_tokens=20,
        related_request_id=ctx.request_id,  # on the call's own stream, as ctx.elicit sends
    )
    text = said.content.text if isinstance(said.content, TextContent) else str(said.content)
    return f"the model said {text}"


@server.tool(annotations=READ_ONLY)
async def pause(ctx: Context) -> str:
    """Closes its event stream, then answers on the resumed one."""
    await ctx.close_sse_stream()
    await anyio.sleep(0.3)
    return "resumed"


@server.tool(annotations=READ_ONLY)
async def wait() -> str:
    """Never answers."""
    try:
        await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        with open(sys.argv[1], "w") as f:
            f.write("cancelled\n")
        raise
    return "never"


class Events(EventStore):
    """Every event in memory, numbered in one sequence across streams."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []  # (id, stream, message)

    async def store_event(self, stream_id: str, message: Any) -> str:
        event_id = str(len(self.events) + 1)
        self.events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(
        self, last_event_id: str, send_callback: Callable[[EventMessage], Awaitable[None]]
    ) -> str | None:
        stream = next((s for i, s, _ in self.events if i == last_event_id), None)
        if stream is None:
            return None
        after = False
        for event_id, stream_id, message in self.events:
            if after and stream_id == stream and message is not None:
                await send_callback(EventMessage(message, event_id))
            after = after or event_id == last_event_id
        return stream


if __name__ == "__main__":
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    app = server.streamable_http_app(event_store=Events(), retry_interval=100)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
