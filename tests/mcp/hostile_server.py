"""A small MCP server written with the SDK for the gateway's hostile cases, run by the tests as
`python hostile_server.py [MODE]`.

MODE `mute` never answers anything (not even initialize); `garbage` answers every request with a
line that is not JSON and a JSON-RPC response to a request nobody sent; otherwise it serves tools:
`huge` (a result of N bytes), `hang` (never answers), `die` (the server exits mid-call), `echo`
(its arguments back, read-only),
`write` (appends a line to $HOSTILE_LOG: an external effect the tests can see).
"""

from __future__ import annotations

import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

app = MCPServer("hostile")


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def huge(size: int) -> str:
    return "x" * size


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
async def hang() -> str:
    import anyio

    await anyio.sleep_forever()
    return "never"


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def die() -> str:
    os._exit(3)


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def echo(text: str) -> str:
    return text


@app.tool()
def write(line: str) -> str:
    with open(os.environ["HOSTILE_LOG"], "a") as f:
        f.write(line + "\n")
    return f"wrote {line}"


if __name__ == "__main__":
    if sys.argv[1:] == ["mute"]:
        # Reads every request and answers none; leaves when its client closes the pipe.
        while sys.stdin.buffer.read(65536):
            pass
        sys.exit(0)
    if sys.argv[1:] == ["garbage"]:
        for _line in sys.stdin:
            sys.stdout.write('not json {{{\n{"jsonrpc": "2.0", "id": 99999, "result": 5}\n')
            sys.stdout.flush()
        sys.exit(0)
    app.run()
