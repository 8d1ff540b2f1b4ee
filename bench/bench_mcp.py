"""What the MCP gateway adds to a tool call: `jukebox mcp wrap` against calling the server
directly, both with the SDK's ClientSession over stdio.

The server is a small one written with the SDK (tests/mcp/hostile_server.py, its read-only `echo`
tool); each call sends 100 bytes of text and gets them back. The gateway's row records every call
on its own tape, as it does in use. `overhead_p50_us` is the gateway's p50 less the direct one's.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import summarize_us

GROUP = "mcp"
CASE = "tool call, stdio (echo, 100 B)"
DIRECT = "direct"
GATEWAY = "jukebox mcp wrap"
REPO = Path(__file__).resolve().parent.parent
SERVER = [sys.executable, str(REPO / "tests" / "mcp" / "hostile_server.py")]


async def _samples(command: list[str], n: int, warmup: int) -> list[float]:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=command[0], args=command[1:], env=dict(os.environ))
    out: list[float] = []
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await session.list_tools()
        for i in range(warmup + n):
            started = time.perf_counter()
            await session.call_tool("echo", {"text": "x" * 100})
            if i >= warmup:
                out.append((time.perf_counter() - started) * 1e6)
    return out


def run(quick: bool = False) -> list[dict[str, Any]]:
    import anyio

    n = 40 if quick else 400
    jukebox = str(Path(sys.executable).parent / "jukebox")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jukebox-bench-mcp-") as tapes:
        wrapped = [jukebox, "mcp", "wrap", "--tape-dir", tapes, "--", *SERVER]
        direct = summarize_us(anyio.run(_samples, SERVER, n, 10))
        through = summarize_us(anyio.run(_samples, wrapped, n, 10))
    rows.append({"group": GROUP, "case": CASE, "system": DIRECT, **direct})
    rows.append({"group": GROUP, "case": CASE, "system": GATEWAY, **through,
                 "overhead_p50_us": through["p50_us"] - direct["p50_us"]})  # fmt: skip
    return rows
