"""A streamable-HTTP MCP server for tests/mcp (the SDK's MCPServer, served by uvicorn on
127.0.0.1): `read_notes` (read-only) and `add_note` (destructive) over a notes file named on
the command line, so a test sees from outside whether a call reached it, and with --log-auth
the Authorization header of every request (NOTES.auth) and the client's port (NOTES.peers: one
port per connection); with --json it answers every POST with a JSON body. Prints its port."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

NOTES = Path(sys.argv[1])
LOG_AUTH = "--log-auth" in sys.argv[2:]  # off for bench/bench_mcp.py: no file write per call
JSON = "--json" in sys.argv[2:]  # answers as JSON bodies, not an event stream per request
server = MCPServer("notes")


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def read_notes() -> str:
    """The notes, one a line."""
    return NOTES.read_text() if NOTES.exists() else ""


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def echo(text: str) -> str:
    """Its argument back."""
    return text


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
