"""An agent run inside a booth by tests/mcp/test_booth_staging.py: it reaches the memory server
through the config the booth rewrote ($JUKEBOX_MCP_CONFIG) with the SDK's ClientSession, and
takes its steps from argv:

    create NAME         create_entities NAME (staged: not read-only)
    observe NAME        add_observations to NAME (staged; fails at the commit if NAME is missing)
    checkpoint LABEL    ask the booth for a checkpoint
    rollback LABEL      ask the booth to roll back to it
    ask TOOL            (first) the gateway asks the operator before TOOL runs
    search QUERY        search_nodes QUERY (read-only: relayed as it came)
    write FILE          write FILE in the tree
    attack              try to stage calls on programs the operator never declared
    exit N              leave with status N
    vanish N            leave with status N at once, with no goodbye to the gateway

Prints one JSON line per step, for the test to read.
"""

from __future__ import annotations

import json
import os
import sys

import anyio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from jukebox.booth import control


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(steps: list[str]) -> int:
    with open(os.environ["JUKEBOX_MCP_CONFIG"]) as f:
        config = json.load(f)
    entry = config["mcpServers"]["memory"]
    args = list(entry["args"])
    if steps[:1] == ["ask"]:
        at = args.index("--")
        args[at:at] = ["--ask", steps[1], "--ask-timeout", "60"]
        del steps[:2]
    params = StdioServerParameters(command=entry["command"], args=args,
                                   env={**os.environ, **entry.get("env", {})})  # fmt: skip
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await session.list_tools()
        while steps:
            step, arg = steps.pop(0), steps.pop(0)
            if step == "create":
                entity = {"name": arg, "entityType": "ticket", "observations": ["new"]}
                result = await session.call_tool("create_entities", {"entities": [entity]})
                say(step=step, error=result.is_error, structured=result.structured_content,
                    text=result.content[0].text)  # fmt: skip
            elif step == "search":
                result = await session.call_tool("search_nodes", {"query": arg})
                say(step=step, error=result.is_error)
            elif step == "observe":
                obs = {"entityName": arg, "contents": ["seen"]}
                result = await session.call_tool("add_observations", {"observations": [obs]})
                say(step=step, error=result.is_error, structured=result.structured_content,
                    text=result.content[0].text if result.content else "")  # fmt: skip
            elif step == "checkpoint":
                control.request({"op": "checkpoint", "label": arg})
            elif step == "rollback":
                control.request({"op": "rollback", "to": arg})
            elif step == "write":
                with open(arg, "w") as f:
                    f.write("written in the booth\n")
            elif step == "attack":
                refusals = []
                for server, argv in (("memory", ["sh", "-c", f"touch {arg}"]),
                                     ("evil", ["sh", "-c", f"touch {arg}"])):  # fmt: skip
                    try:
                        control.request({"op": "mcp_stage", "server": server, "argv": argv,
                                         "tool": "x", "args": {}})  # fmt: skip
                        refusals.append(None)
                    except control.ControlError as error:
                        refusals.append(str(error))
                say(step=step, refusals=refusals)
            elif step == "exit":
                return int(arg)
            elif step == "vanish":
                os._exit(int(arg))
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main, sys.argv[1:]))
