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
        url = json.load(f)["mcpServers"]["notes"]["url"]
    say(step="url", url=url, base=os.environ["JUKEBOX_MCP_URL"])
    async with (
        streamable_http_client(url) as (read, write, *_),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        await session.list_tools()
        # A secret of the operator's in an argument: the tape must never hold it.
        text = " ".join(filter(None, ["hello", os.environ.get("NOTES_API_TOKEN")]))
        for tool, args in (("read_notes", {}), ("add_note", {"text": text}),
                           ("read_notes", {})):  # fmt: skip
            result = await session.call_tool(tool, args)
            say(step=tool, error=result.is_error, text=result.content[0].text,
                structured=result.structured_content)  # fmt: skip
    # The same gateway without its secret: nothing.
    port = url.split("/")[2]
    try:
        urllib.request.urlopen(f"http://{port}/mcp/notes/", timeout=10)
        say(step="knock", status=200)
    except urllib.error.HTTPError as error:
        say(step="knock", status=error.code)
    return status


if __name__ == "__main__":
    sys.exit(anyio.run(main, int(sys.argv[1])))
