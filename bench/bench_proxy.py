"""The recording LLM proxy: overhead per call against calling the upstream directly.

The upstream is the fake OpenAI server of the tests (tests/llm/upstream.py), on 127.0.0.1 in a
process of its own (sharing a GIL with it would bill its Python time to the proxy), so the
numbers are the proxy's own cost: parsing, forwarding through httpx, SSE parsing on the
side, and writing the llm_turn frame (with its fdatasync) before the agent sees the end of the
response. Calls go through one keep-alive httpx client, as an SDK's would. Rows: a JSON chat
completion and a streamed one (about 12 SSE events), direct, through the proxy recording to a
tape, and through the proxy with the tape's fsync off (the floor without the disk).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness import summarize_us
from jukebox.llm.server import ProxyServer
from jukebox.tape import TapeWriter
from shadowfs.store import Store

UPSTREAM = Path(__file__).resolve().parents[1] / "tests" / "llm" / "upstream.py"

MESSAGES = [
    {"role": "system", "content": "You are a coding agent. Keep changes small. " * 20},
    {"role": "user", "content": "stream a short answer of about ten words for the bench"},
]


def _samples(client: httpx.Client, url: str, stream: bool, n: int) -> list[float]:
    body = json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES, "stream": stream}).encode()
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench-key-0000"}
    out = []
    for i in range(n + 5):
        t0 = time.perf_counter_ns()
        if stream:
            with client.stream("POST", url, content=body, headers=headers) as resp:
                for _ in resp.iter_bytes():
                    pass
        else:
            client.post(url, content=body, headers=headers).read()
        if i >= 5:  # warm-up: connections, imports, first frames
            out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def run(quick: bool = False) -> list[dict[str, Any]]:
    n = 150 if quick else 1500
    rows: list[dict[str, Any]] = []
    server = subprocess.Popen(
        [sys.executable, str(UPSTREAM), "0"], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    base = f"http://127.0.0.1:{int(server.stdout.readline())}"
    upstreams = {"openai": base + "/v1", "anthropic": base}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp, httpx.Client() as client:
            root = Path(tmp)
            store = Store.open(root / "store", create=True)
            systems: list[tuple[str, str, Any]] = [("direct", upstreams["openai"], None)]
            proxies = []
            for fsync in (True, False):
                writer = TapeWriter.create(root / f"t{fsync}.jbx", store, "bench", fsync=fsync)
                writer.append("run_start", {"name": "bench"})
                proxy = ProxyServer(
                    upstreams=upstreams,
                    record=writer.append,
                ).start()
                proxies.append((proxy, writer))
                name = "proxy, recording" + ("" if fsync else " (fsync off)")
                systems.append((name, proxy.url + "/openai/v1", writer))
            for stream in (False, True):
                case = "chat completion, " + ("stream" if stream else "JSON")
                direct = None
                for system, url, _ in systems:
                    row: dict[str, Any] = {"group": "llm proxy", "case": case, "system": system}
                    row.update(summarize_us(_samples(client, url + "/chat/completions", stream, n)))
                    if direct is None:
                        direct = row
                    else:
                        row["overhead_p50_us"] = row["p50_us"] - direct["p50_us"]
                        row["overhead_p99_us"] = row["p99_us"] - direct["p99_us"]
                    rows.append(row)
            for proxy, writer in proxies:
                proxy.stop()
                writer.close()
            store.close()
    finally:
        server.kill()
        server.wait()
    return rows


if __name__ == "__main__":
    for r in run(quick=True):
        print(r)
