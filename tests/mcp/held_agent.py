"""An agent run in a booth by tests/mcp/test_supervisor_killed.py: it reaches the server `log`
(tests/mcp/hostile_server.py, whose `write` tool appends a line to $HOSTILE_LOG: an effect the
test sees from outside) through the config the booth rewrote, with the SDK's ClientSession.

Its steps come from argv: `write LINE` (staged), `hang -` (the `hang` tool: staged by the test's
--mcp-stage rule), `checkpoint LABEL`, and `wait -`: print "ready" and sleep, so that the test
kills the supervisor while the calls are held. Prints one JSON line per call.
"""

from __future__ import annotations

import json
import os
import sys
import time

import anyio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from jukebox.booth import control


async def main(steps: list[str]) -> int:
    with open(os.environ["JUKEBOX_MCP_CONFIG"]) as f:
        entry = json.load(f)["mcpServers"]["log"]
    params = StdioServerParameters(command=entry["command"], args=entry["args"],
                                   env={**os.environ, **entry.get("env", {})})  # fmt: skip
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await session.list_tools()
        while steps:
            step, arg = steps.pop(0), steps.pop(0)
            if step in ("write", "hang"):
                args = {"line": arg} if step == "write" else {}
                result = await session.call_tool(step, args)
                print(json.dumps({"step": step, "structured": result.structured_content}),
                      flush=True)  # fmt: skip
            elif step == "checkpoint":
                control.request({"op": "checkpoint", "label": arg})
            elif step == "wait":
                print("ready", flush=True)
                time.sleep(120)  # the supervisor's kill ends this (PDEATHSIG down the chain)
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main, sys.argv[1:]))
