"""The recording LLM proxy: what it adds to a call and to a stream's first token, against
calling the upstream directly.

The upstream is the fake OpenAI server of the tests (tests/llm/upstream.py), on 127.0.0.1 in a
process of its own (sharing a GIL with it would bill its Python time to the proxy), so the
numbers are the proxy's own cost: parsing, forwarding (jukebox.llm.upstream_client), SSE
parsing on the side, and writing the llm_turn frame before the agent sees the end of the
response. Calls go through
one keep-alive httpx client per system, as an SDK's would, and the systems take turns call by
call, each round starting one system further on, so a noisy neighbour slows them alike and no
system always comes first or right after the same one (`_take_turns`).

Rows: a JSON chat completion and a streamed one (about 12 SSE events), whole call, direct,
and through the proxy recording to a tape as a booth does (jukebox.booth.supervisor.GroupTape:
the frame is written before the agent sees the end, its fdatasync joins the group commit's,
within 50 ms) in a process of its own, as a booth's supervisor is apart from its agent; the
same proxy in the client's process ("in the client's process": the Python API's way, where the
agent's Python and the proxy share one GIL, and the proxy's work after a write holds the
client up until the proxy waits); and through the proxy recording with a TapeWriter's own
fdatasync per frame (what `ProxyServer(record=writer.append)` gives a caller of the Python
API, also in the client's process); and the stream's first token: from sending the request to
holding the first complete SSE event (the frame is written only at the end of a stream, so
the first token never waits for the disk), also with the upstream pausing after the first
event. Besides wall time, `cpu_us` is the CPU spent per call, whole call: this process's
(client, and an in-process proxy) plus the proxy process's, all its threads
(`overhead_cpu_us`: the proxy's share), which a busy machine inflates far less than wall time
on two shared cores; and `instructions`, on the recording proxy's JSON and stream rows, the
instructions it executes per call, counted by valgrind's callgrind in a proxy process of its
own (`instructions_per_call`, the group commit's flusher held off, and the proxy's busy-polls
off, which would count the wait rather than the work): a figure the machine's load moves by
about 1%, not 2x, to compare code with code. Without valgrind that column stays empty. And
`sleeps_per_call`, on the rows of the proxy in a process of its own: the times its threads
went to sleep (voluntary context switches) per call, each a wake-up paid later, which on
these VMs costs more than most of the proxy's code (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
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
# As a booth runs it: in a process of its own (the supervisor's), apart from the agent's.
RECORDING = "proxy, recording"
# The same proxy in the client's own process, sharing its GIL (as the Python API runs one).
IN_PROCESS = "proxy, recording, in the client's process"
FSYNC_EACH = "proxy, recording, fsync per frame"
WHOLE_JSON = "chat completion, JSON"
WHOLE_STREAM = "chat completion, stream"
FIRST_TOKEN = "chat completion, stream: first token"
# A model that thinks between its first and second token: a proxy that passed a stream on one
# upstream read late would add the whole pause to the first token.
PAUSE_MS = 50
PAUSED_FIRST_TOKEN = f"{FIRST_TOKEN}, upstream pausing {PAUSE_MS} ms after it"
WARMUP = 5
# Calls counted per case under callgrind (the proxy runs about 50 times slower there), after as
# many uncounted ones.
COUNTED_CALLS = 40
INSTRUCTIONS = "instructions"
SLEEPS = "sleeps_per_call"

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


class _ProxyProcess:
    """A recording proxy in a child process (`serve`), as a booth's runs apart from its agent."""

    def __init__(self, base: str, *, valgrind: list[str] | None = None) -> None:
        env = dict(os.environ, PYTHONHASHSEED="0")
        command = [sys.executable, "-m", "bench.bench_proxy", "serve", base]
        if valgrind is not None:
            command = [*valgrind, *command, "--hold-flush"]
            env["JUKEBOX_LLM_SPIN"] = "0"  # a poll's instructions count the wait, not the work
        self.child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, cwd=Path(__file__).resolve().parents[1], env=env,
        )  # fmt: skip
        assert self.child.stdin is not None and self.child.stdout is not None
        self.stdin, self.stdout = self.child.stdin, self.child.stdout
        self.url = self.stdout.readline().strip()
        if not self.url:
            self.close()
            raise RuntimeError("the proxy process did not start")

    def cpu_ns(self) -> int:
        """The CPU time the child has spent, all its threads."""
        self.stdin.write("cpu\n")
        self.stdin.flush()
        return int(self.stdout.readline())

    def sleeps(self) -> int:
        """The times the child's threads went to sleep so far (voluntary context switches)."""
        total = 0
        for task in glob.glob(f"/proc/{self.child.pid}/task/*/status"):
            with contextlib.suppress(OSError), open(task) as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        return total

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.stdin.close()
        try:
            self.child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


def _take_turns(
    systems: list[tuple[str, httpx.Client, str, _ProxyProcess | None]],
    measure: Callable[[httpx.Client, str], float],
    n: int,
    sleeps: dict[str, float] | None = None,
) -> dict[str, tuple[list[float], float]]:
    """`measure` on every system in turn, n times after WARMUP untimed rounds: each system's
    samples, and the CPU time spent per call, in µs: this process's (the client's and an
    in-process proxy's) and a proxy process's (the upstream has a process of its own).
    `sleeps` gets a proxy process's sleeps per call."""
    out: dict[str, tuple[list[float], float]] = {name: ([], 0.0) for name, _, _, _ in systems}
    child_cpu: dict[str, int] = {}
    child_sleeps: dict[str, int] = {}
    for i in range(n + WARMUP):
        if i == WARMUP:
            child_cpu = {name: p.cpu_ns() for name, _, _, p in systems if p is not None}
            child_sleeps = {name: p.sleeps() for name, _, _, p in systems if p is not None}
        # Each round starts one system further on: in a fixed order a system's place moved its
        # figures by more than the code did (docs/benchmarks.md, the paused first token).
        turn = i % len(systems)
        for name, client, _url, _ in systems[turn:] + systems[:turn]:
            cpu = time.process_time_ns()
            took = measure(client, _url)
            cpu = time.process_time_ns() - cpu
            if i >= WARMUP:
                samples, spent = out[name]
                samples.append(took)
                out[name] = (samples, spent + cpu / 1000.0 / n)
    for name, _, _, proxy in systems:
        if proxy is not None:
            if sleeps is not None:
                sleeps[name] = round((proxy.sleeps() - child_sleeps[name]) / n, 2)
            samples, spent = out[name]
            out[name] = (samples, spent + (proxy.cpu_ns() - child_cpu[name]) / 1000.0 / n)
    return out



def _recording_proxy(
    root: Path, store: Store, upstreams: dict[str, str], fsync_each: bool = False,
    delay: float | None = None, spin: bool = False,
) -> tuple[ProxyServer, TapeWriter | GroupTape]:
    """A proxy recording as a booth does (GroupTape, frames written on the proxy's loop), or
    with a TapeWriter syncing each frame. `delay`: the group commit's, when not the booth's;
    `spin`: its waits busy-poll, as a booth's proxy apart from its agent does."""
    writer: TapeWriter | GroupTape
    writer = TapeWriter.create(root / f"{fsync_each}.jbx", store, "bench", fsync=fsync_each)
    if not fsync_each:
        writer = GroupTape(writer, store) if delay is None else GroupTape(writer, store, delay)
        writer.start()  # as run_booth records
    writer.append("run_start", {"name": "bench"})
    proxy = ProxyServer(
        upstreams=upstreams, record=writer.append, record_inline=not fsync_each, spin=spin
    ).start()
    return proxy, writer


def _serve(base: str, hold_flush: bool) -> None:
    """A `_ProxyProcess`: a recording proxy to the upstream at `base`, its URL on stdout, its
    CPU time on each `cpu` line of stdin, until stdin closes. With `hold_flush` (for counting
    instructions) its group commit waits an hour: the flusher's work is off every call's path
    (its own thread, after the answer), and its timing would move the count."""
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        store = Store.open(Path(tmp) / "store", create=True)
        proxy, writer = _recording_proxy(
            Path(tmp), store, {"openai": base + "/v1", "anthropic": base},
            delay=3600.0 if hold_flush else None, spin=True,
        )  # fmt: skip
        print(proxy.url, flush=True)
        for line in sys.stdin:
            if line.strip() == "cpu":
                print(time.process_time_ns(), flush=True)
        proxy.stop()
        writer.close()
        store.close()


def _callgrind(pid: int, *command: str) -> None:
    subprocess.run(
        ["callgrind_control", *command, str(pid)], check=True, capture_output=True, timeout=120
    )


def instructions_per_call(
    base: str, cases: list[tuple[str, Callable[[httpx.Client, str], float]]], n: int
) -> dict[str, int]:
    """Instructions the recording proxy executes per call of each case, counted by callgrind
    in a proxy process of its own (every thread of it), between uncounted warm-up calls and
    the end: a figure a loaded machine does not move, unlike its time. Empty without
    valgrind."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return {}
    out: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-proxy-cg-") as tmp:
        valgrind = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={tmp}/cg.out",
        ]  # fmt: skip
        proxy = _ProxyProcess(base, valgrind=valgrind)
        try:
            url = proxy.url + "/openai/v1/chat/completions"
            with httpx.Client(timeout=60) as client:
                for case, measure in cases:
                    for _ in range(n):
                        measure(client, url)
                    _callgrind(proxy.child.pid, "--instr=on")
                    for _ in range(n):
                        measure(client, url)
                    _callgrind(proxy.child.pid, "--instr=off")
                    _callgrind(proxy.child.pid, "--dump")
                    dumps = sorted(glob.glob(f"{tmp}/cg.out.*"), key=os.path.getmtime)
                    found = re.search(r"^totals: (\d+)", Path(dumps[-1]).read_text(), re.M)
                    if found is not None:
                        out[case] = round(int(found.group(1)) / n)
        finally:
            proxy.close()
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
    apart: _ProxyProcess | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
            root = Path(tmp)
            store = Store.open(root / "store", create=True)
            apart = _ProxyProcess(base)
            urls: list[tuple[str, str, _ProxyProcess | None]] = [
                (DIRECT, upstreams["openai"], None),
                (RECORDING, apart.url + "/openai/v1", apart),
            ]
            for system in (IN_PROCESS, FSYNC_EACH):
                proxy, writer = _recording_proxy(root, store, upstreams, system == FSYNC_EACH)
                proxies.append((proxy, writer))
                urls.append((system, proxy.url + "/openai/v1", None))
            systems = []
            for name, url, child in urls:
                clients.append(httpx.Client())
                systems.append((name, clients[-1], url + "/chat/completions", child))
            whole: list[tuple[str, Callable[[httpx.Client, str], float]]] = [
                (WHOLE_JSON, lambda c, u: _whole(c, u, False)),
                (WHOLE_STREAM, lambda c, u: _whole(c, u, True)),
            ]
            for case, measure, times in (
                *((case, measure, n) for case, measure in whole),
                (FIRST_TOKEN, _first_token, n),
                (PAUSED_FIRST_TOKEN, lambda c, u: _first_token(c, u, PAUSE_MS), n // 5),
            ):
                slept: dict[str, float] = {}
                case_rows = overhead_rows(
                    GROUP, case, _take_turns(systems, measure, times, slept)
                )
                for row in case_rows:
                    if row["system"] in slept:
                        row[SLEEPS] = slept[row["system"]]
                rows += case_rows
            for proxy, writer in proxies:
                proxy.stop()
                writer.close()
            store.close()
        counted = instructions_per_call(
            base, whole, COUNTED_CALLS // 2 if quick else COUNTED_CALLS
        )
        for row in rows:
            if row["system"] == RECORDING and row["case"] in counted:
                row[INSTRUCTIONS] = counted[row["case"]]
    finally:
        for client in clients:
            client.close()
        if apart is not None:
            apart.close()
        server.kill()
        server.wait()
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        _serve(sys.argv[2], hold_flush="--hold-flush" in sys.argv[3:])
    else:
        for r in run(quick=True):
            print(r)
