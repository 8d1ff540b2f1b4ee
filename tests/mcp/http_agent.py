"""An agent run in a booth by tests/mcp/test_booth_http.py: it reaches the streamable-HTTP
server `notes` at the URL the booth's rewritten config gives ($JUKEBOX_MCP_CONFIG), with the SDK's
client; reads, adds a note (staged), reads again, and knocks on the gateway without its secret.
Prints one JSON line per step; exits with argv[1]."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import anyio
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(status: int) -> int:
    with open(os.environ["JUKEBOX_MCP_CONFIG"]) as f:
        servers = json.load(f)["mcpServers"]
    url = servers["notes"]["url"]
    say(step="url", url=url, base=os.environ["JUKEBOX_MCP_URL"])
    async with (
        streamable_http_client(url) as (read, write, *_),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        await session.list_tools()
        # A secret of the operator's in an argument, and the gateway's own URL (its path
        # secret): the tape must never hold either.
        secret = url.split("/")[3]  # http://127.0.0.1:PORT/SECRET/mcp/notes/
        text = " ".join(filter(None, ["hello", os.environ.get("NOTES_API_TOKEN"), secret]))
        for tool, args in (("read_notes", {}), ("add_note", {"text": text}),
                           ("read_notes", {})):  # fmt: skip
            result = await session.call_tool(tool, args)
            say(step=tool, error=result.is_error, text=result.content[0].text,
                structured=result.structured_content)  # fmt: skip
    # A fork's header variables are the supervisor's, never the agent's.
    say(step="config", notes=servers["notes"],
        header_env=sorted(k for k in os.environ if k.startswith("JUKEBOX_MCP_HEADER_")))
    if "echo" in servers:  # a stdio server beside it, through `jukebox mcp wrap`
        await echo(servers["echo"], secret)
    # The same gateway without its secret: nothing.
    port = url.split("/")[2]
    try:
        urllib.request.urlopen(f"http://{port}/mcp/notes/", timeout=10)
        say(step="knock", status=200)
    except urllib.error.HTTPError as error:
        say(step="knock", status=error.code)
    return status


async def echo(entry: dict, text: str) -> None:
    """The stdio server's echo tool, given the HTTP gateway's path secret: allowed (read-only),
    so its arguments and its result both hold it."""
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=entry["command"], args=entry["args"],
                                   env=dict(os.environ))  # fmt: skip
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        result = await session.call_tool("echo", {"text": text})
        say(step="echo", error=result.is_error, text=result.content[0].text)


if __name__ == "__main__":
    sys.exit(anyio.run(main, int(sys.argv[1])))
