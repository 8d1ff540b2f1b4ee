"""A small MCP server written with the SDK for the gateway's hostile cases, run by the tests as
`python hostile_server.py [MODE]`.

MODE `mute` never answers anything (not even initialize); `garbage` answers every request with a
line that is not JSON and a JSON-RPC response to a request nobody sent; otherwise it serves tools:
`huge` (a result of N bytes), `hang` (never answers; appends a line to $HOSTILE_HANG_LOG, when
set, as it starts), `die` (the server exits mid-call), `echo` (its arguments back, read-only),
`aside` (asks the client's model and its roots, outside the call as far as the protocol says),
`write` (appends a line to $HOSTILE_LOG: an external effect the tests can see).
"""

from __future__ import annotations

import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

app = MCPServer("hostile")


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def huge(size: int) -> str:
    return "x" * size


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
async def hang() -> str:
    import anyio

    if "HOSTILE_HANG_LOG" in os.environ:  # the call reached the server: a test waits on this
        with open(os.environ["HOSTILE_HANG_LOG"], "a") as f:
            f.write("hang\n")
    await anyio.sleep_forever()
    return "never"


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def die() -> str:
    os._exit(3)


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def echo(text: str) -> str:
    return text


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
async def aside(ctx: Context) -> str:
    """Asks the client's model (sampling, with no related request) and its roots."""
    from mcp.types import SamplingMessage, TextContent

    said = await ctx.session.create_message(
        [SamplingMessage(role="user", content=TextContent(type="text", text="3+3"))], max_tokens=9
    )
    assert isinstance(said.content, TextContent)
    roots = await ctx.session.list_roots()
    return f"the model said {said.content.text}; roots {' '.join(str(r.uri) for r in roots.roots)}"


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
