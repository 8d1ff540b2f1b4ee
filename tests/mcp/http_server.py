"""A streamable-HTTP MCP server for tests/mcp (the SDK's MCPServer, served by uvicorn on
127.0.0.1): `read_notes` (read-only) and `add_note` (destructive) over a notes file named on
the command line, so a test sees from outside whether a call reached it; `echo`; `caps` (the
capabilities the client declared) and `aside` (asks the client its name, its model or its roots
on the session's standalone stream, outside any call as far as the protocol says:
tests/mcp/test_back_channel.py). With --log-auth it logs the Authorization header of every
request (NOTES.auth) and the client's port (NOTES.peers: one port per connection); with --json
it answers every POST with a JSON body. Prints its port."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from mcp.types import SamplingMessage, TextContent, ToolAnnotations
from pydantic import BaseModel

NOTES = Path(sys.argv[1])
LOG_AUTH = "--log-auth" in sys.argv[2:]  # off for bench/bench_mcp.py: no file write per call
JSON = "--json" in sys.argv[2:]  # answers as JSON bodies, not an event stream per request
server = MCPServer("notes")


class Name(BaseModel):
    name: str


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def read_notes() -> str:
    """The notes, one a line."""
    return NOTES.read_text() if NOTES.exists() else ""


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def echo(text: str) -> str:
    """Its argument back."""
    return text


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def caps(ctx: Context) -> str:
    """The capabilities the client declared (JSON)."""
    declared = ctx.session.client_capabilities
    return declared.model_dump_json(exclude_none=True) if declared is not None else "{}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def aside(ctx: Context, what: str) -> str:
    """Asks the client on the session's standalone stream (no related request: outside any
    call, as far as the protocol says), `what` being name, model or roots."""
    try:
        if what == "name":
            answer = await ctx.session.elicit("What is your name?", Name.model_json_schema())
            return f"hello {answer.content['name']}" if answer.content else answer.action
        if what == "model":
            said = await ctx.session.create_message(
                [SamplingMessage(role="user", content=TextContent(type="text", text="3+3"))],
                max_tokens=20,
            )
            assert isinstance(said.content, TextContent)
            return f"the model said {said.content.text}"
        roots = await ctx.session.list_roots()
        return " ".join(str(root.uri) for root in roots.roots)
    except MCPError as error:
        return f"refused: {error.message}"


@server.tool(annotations=ToolAnnotations(destructiveHint=True))
def add_note(text: str) -> str:
    """Adds a note."""
    with NOTES.open("a") as f:
        f.write(text + "\n")
    return f"added {text!r}"


if __name__ == "__main__":
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it each SSE event waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    app = server.streamable_http_app(json_response=JSON)

    async def seen_headers(scope: dict, receive: object, send: object) -> None:
        # Each request's Authorization header, a line each in NOTES.auth: the test sees what
        # the gateway and the commit sent upstream.
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"-").decode()
            with NOTES.with_suffix(".auth").open("a") as f:
                f.write(auth + "\n")
            with NOTES.with_suffix(".peers").open("a") as f:
                f.write(f"{scope['method']} {scope['client'][1]}\n")
        await app(scope, receive, send)  # type: ignore[arg-type]

    config = uvicorn.Config(seen_headers if LOG_AUTH else app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
