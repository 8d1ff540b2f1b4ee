"""The recording LLM proxy: what it adds to a call and to a stream's first token, against
calling the upstream directly.

The upstream is the fake OpenAI server of the tests (tests/llm/upstream.py), on 127.0.0.1 in a
process of its own (sharing a GIL with it would bill its Python time to the proxy), so the
numbers are the proxy's own cost: parsing, forwarding (jukebox.llm.upstream_client), SSE
parsing on the side, and writing the llm_turn frame before the agent sees the end of the
response. Calls go through
one keep-alive httpx client per system, as an SDK's would, and the systems take turns call by
call, so a noisy neighbour slows them alike.

Rows: a JSON chat completion and a streamed one (about 12 SSE events), whole call, direct,
through the proxy recording to a tape as a booth does (jukebox.booth.supervisor.GroupTape: the frame
is written before the agent sees the end, its fdatasync joins the group commit's, within 50 ms),
and through the proxy recording with a TapeWriter's own fdatasync per frame (what
`ProxyServer(record=writer.append)` gives a caller of the Python API); and the stream's first
token: from sending the request to holding the first complete SSE event (the frame is written
only at the end of a stream, so the first token never waits for the disk), also with the
upstream pausing after the first event. Besides wall
time, `cpu_us` is the CPU this process spent per call, whole call (client and proxy;
`overhead_cpu_us` the proxy's share), which a busy machine inflates far less than wall time on
two shared cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.harness import overhead_rows
from jukebox.booth.supervisor import GroupTape
from jukebox.llm.server import ProxyServer
from jukebox.tape.tape import TapeWriter
from shadowfs.store import Store

UPSTREAM = Path(__file__).resolve().parents[1] / "tests" / "llm" / "upstream.py"
GROUP = "llm proxy"
DIRECT = "direct"
RECORDING = "proxy, recording"
FSYNC_EACH = "proxy, recording, fsync per frame"
WHOLE_JSON = "chat completion, JSON"
WHOLE_STREAM = "chat completion, stream"
FIRST_TOKEN = "chat completion, stream: first token"
# A model that thinks between its first and second token: a proxy that passed a stream on one
# upstream read late would add the whole pause to the first token.
PAUSE_MS = 50
PAUSED_FIRST_TOKEN = f"{FIRST_TOKEN}, upstream pausing {PAUSE_MS} ms after it"
WARMUP = 5

MESSAGES = [
    {"role": "system", "content": "You are a coding agent. Keep changes small. " * 20},
    {"role": "user", "content": "stream a short answer of about ten words for the bench"},
]
HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-bench-key-0000"}


def _body(stream: bool) -> bytes:
    return json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES, "stream": stream}).encode()


def _whole(client: httpx.Client, url: str, stream: bool) -> float:
    """One call, start to end of the response, in µs."""
    body = _body(stream)
    t0 = time.perf_counter_ns()
    if stream:
        with client.stream("POST", url, content=body, headers=HEADERS) as resp:
            for _ in resp.iter_raw():
                pass
    else:
        client.post(url, content=body, headers=HEADERS).read()
    return (time.perf_counter_ns() - t0) / 1000.0


def _first_token(client: httpx.Client, url: str, pause_ms: int = 0) -> float:
    """One streamed call: µs from sending it to holding its first complete event; the rest is
    read untimed. `pause_ms`: the upstream pauses that long after the first event."""
    body = _body(True)
    headers = {**HEADERS, "x-fake-pause-ms": str(pause_ms)} if pause_ms else HEADERS
    took = None
    t0 = time.perf_counter_ns()
    with client.stream("POST", url, content=body, headers=headers) as resp:
        seen = b""
        for chunk in resp.iter_raw():
            if took is None:
                seen += chunk
                if b"\n\n" in seen:
                    took = (time.perf_counter_ns() - t0) / 1000.0
    assert took is not None, "the stream had no complete event"
    return took


def _take_turns(
    systems: list[tuple[str, httpx.Client, str]],
    measure: Callable[[httpx.Client, str], float],
    n: int,
) -> dict[str, tuple[list[float], float]]:
    """`measure` on every system in turn, n times after WARMUP untimed rounds: each system's
    samples, and the CPU time this process spent per call (the client's and the in-process
    proxy's; the upstream has a process of its own), in µs."""
    out: dict[str, tuple[list[float], float]] = {name: ([], 0.0) for name, _, _ in systems}
    for i in range(n + WARMUP):
        for name, client, url in systems:
            cpu = time.process_time_ns()
            took = measure(client, url)
            cpu = time.process_time_ns() - cpu
            if i >= WARMUP:
                samples, spent = out[name]
                samples.append(took)
                out[name] = (samples, spent + cpu / 1000.0 / n)
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
    clients: list[httpx.Client] = []
    proxies: list[tuple[ProxyServer, TapeWriter | GroupTape]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
            root = Path(tmp)
            store = Store.open(root / "store", create=True)
            urls = [(DIRECT, upstreams["openai"])]
            for system in (RECORDING, FSYNC_EACH):
                each = system == FSYNC_EACH
                writer: TapeWriter | GroupTape
                writer = TapeWriter.create(root / f"{each}.jbx", store, "bench", fsync=each)
                if not each:
                    writer = GroupTape(writer, store)  # as run_booth records
                    writer.start()
                writer.append("run_start", {"name": "bench"})
                proxy = ProxyServer(
                    upstreams=upstreams, record=writer.append, record_inline=not each
                ).start()
                proxies.append((proxy, writer))
                urls.append((system, proxy.url + "/openai/v1"))
            systems = []
            for name, url in urls:
                clients.append(httpx.Client())
                systems.append((name, clients[-1], url + "/chat/completions"))
            for case, measure, times in (
                (WHOLE_JSON, lambda c, u: _whole(c, u, False), n),
                (WHOLE_STREAM, lambda c, u: _whole(c, u, True), n),
                (FIRST_TOKEN, _first_token, n),
                (PAUSED_FIRST_TOKEN, lambda c, u: _first_token(c, u, PAUSE_MS), n // 5),
            ):
                rows += overhead_rows(GROUP, case, _take_turns(systems, measure, times))
            for proxy, writer in proxies:
                proxy.stop()
                writer.close()
            store.close()
    finally:
        for client in clients:
            client.close()
        server.kill()
        server.wait()
    return rows


if __name__ == "__main__":
    for r in run(quick=True):
        print(r)
