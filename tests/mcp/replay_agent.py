"""An agent run in a booth by tests/mcp/test_booth_replay.py, then replayed and forked: it reads
the memory server's graph (allowed: read-only), creates an entity (staged) whose name ends in
$SUFFIX (a replay with another SUFFIX diverges), and reads the graph again. Prints one JSON line
per call, for the test to read, and a hash of the server's declared MEMORY_API_TOKEN."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import anyio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main() -> int:
    with open(os.environ["JUKEBOX_MCP_CONFIG"]) as f:
        entry = json.load(f)["mcpServers"]["memory"]
    params = StdioServerParameters(command=entry["command"], args=entry["args"],
                                   env={**os.environ, **entry.get("env", {})})  # fmt: skip
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await session.list_tools()
        graph = await session.call_tool("read_graph", {})
        say(step="read", names=[e["name"] for e in graph.structured_content["entities"]])
        entity = {"name": "alpha" + os.environ.get("SUFFIX", ""), "entityType": "ticket",
                  "observations": ["new"]}  # fmt: skip
        created = await session.call_tool("create_entities", {"entities": [entity]})
        say(step="create", error=created.is_error, text=created.content[0].text)
        graph = await session.call_tool("read_graph", {})
        say(step="read", names=[e["name"] for e in graph.structured_content["entities"]])
    # Which MEMORY_API_TOKEN the server was declared with (a hash: never the value itself).
    token = entry.get("env", {}).get("MEMORY_API_TOKEN", "")
    say(step="token", sha=hashlib.sha256(token.encode()).hexdigest()[:16])
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))
