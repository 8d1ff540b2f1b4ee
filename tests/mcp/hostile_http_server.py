"""A streamable-HTTP MCP server that misbehaves, for tests/mcp/test_http_hostile.py: the SDK's
MCPServer (tools `huge`, `hang`, `echo`, all read-only) behind a layer that answers a call of the
tool `garbage` with a body that is not JSON, and a call of `stray` with a JSON-RPC response to a
request nobody sent. Prints its port."""

from __future__ import annotations

import json
import socket
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("hostile-http")
READ_ONLY = ToolAnnotations(readOnlyHint=True)


@server.tool(annotations=READ_ONLY)
def huge(size: int) -> str:
    return "x" * size


@server.tool(annotations=READ_ONLY)
async def hang() -> str:
    import anyio

    await anyio.sleep_forever()
    return "never"


@server.tool(annotations=READ_ONLY)
def echo(text: str) -> str:
    return text


@server.tool(annotations=READ_ONLY)
def garbage() -> str:
    return "the layer below answers for it"


@server.tool(annotations=READ_ONLY)
def stray() -> str:
    return "the layer below answers for it"


class Hostile:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            request = json.loads(body)
        except ValueError:
            request = {}
        tool = (request.get("params") or {}).get("name") if isinstance(request, dict) else None
        if tool in ("garbage", "stray"):
            stray_answer = {"jsonrpc": "2.0", "id": 99999, "result": {}}
            answer = b"not json {{{" if tool == "garbage" else json.dumps(stray_answer).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": answer})
            return
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


if __name__ == "__main__":
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(Hostile(server.streamable_http_app()), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
