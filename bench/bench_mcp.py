"""What the MCP gateway adds to a tool call, over stdio and over streamable HTTP.

Every series is the SDK's ClientSession calling a small SDK server's read-only `echo` tool with
100 bytes of text. The anchors run in the same run, taking turns call by call with the gateway
they anchor, so both see the same machine at the same moment:

- stdio, outside a booth: the server (tests/mcp/hostile_server.py) directly, and through
  `jukebox mcp wrap`, which records every call on its own tape.
- In a booth (`jukebox booth run --mcp-config ... --mcp-upstream ...`), one agent times four
  sessions in turns: the stdio server started directly, the same server through the wrapper of
  `$JUKEBOX_MCP_CONFIG` (its frames go to the supervisor over the control socket), the
  streamable-HTTP server (tests/mcp/http_server.py) at its own URL, and the same server through
  the supervisor's HTTP gateway at `$JUKEBOX_MCP_URL/NAME/` (recorded on the booth's tape).

A booth needs root and /dev/fuse: without them only the stdio rows are measured.
`overhead_p50_us` is the gateway's p50 less its anchor's, `ratio` the gateway's p50 over it.

With valgrind, the stdio rows outside a booth and the HTTP rows get `instructions`: what one
call costs each process, counted by callgrind (every thread of it, after uncounted warm-up
calls), a figure the machine's load does not move: the stdio server on its own and
`jukebox mcp wrap` in front of it (`stdio_instructions`); the HTTP server on its own (the
anchor), and the booth's HTTP gateway in front of it,
in a process of its own (`python -m bench.bench_mcp gateway URL`: jukebox.mcp.http_gateway with
a stage gate recording on a tape, as the supervisor runs it).

Old against new, in the same minutes: `python -m bench.bench_mcp compare N NAME=REPO[:PATH] ...`
(wall clock, each checkout's HTTP gateway in a process of its own in front of one server, one
client taking turns, the order reversed every round) and `compare-instructions` (the same under
callgrind). `:PATH` is put before the checkout on its gateway's PYTHONPATH.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import summarize_us

GROUP = "mcp"
STDIO = "tool call, stdio (echo, 100 B)"
STDIO_BOOTH = "tool call, stdio, in a booth (echo, 100 B)"
HTTP_BOOTH = "tool call, streamable HTTP, in a booth (echo, 100 B)"
DIRECT = "direct"
WRAP = "jukebox mcp wrap"
GATEWAY, CASE = WRAP, STDIO  # the stdio goal's row (bench/goals.py)
HTTP_GATEWAY = "booth HTTP gateway"
REPO = Path(__file__).resolve().parent.parent
SERVER = [sys.executable, str(REPO / "tests" / "mcp" / "hostile_server.py")]
HTTP_SERVER = [sys.executable, str(REPO / "tests" / "mcp" / "http_server.py")]
WARMUP = 20
ARGS = {"text": "x" * 100}


async def _take_turns(opened: dict[str, Any], n: int) -> dict[str, list[float]]:
    """Calls `echo` on every session in turn, n times after WARMUP untimed rounds."""
    out: dict[str, list[float]] = {name: [] for name in opened}
    for i in range(n + WARMUP):
        for name, session in opened.items():
            started = time.perf_counter()
            await session.call_tool("echo", ARGS)
            if i >= WARMUP:
                out[name].append((time.perf_counter() - started) * 1e6)
    return out


async def _sessions(stdio: dict[str, list[str]], http: dict[str, str], n: int) -> dict[str, Any]:
    import contextlib

    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client

    opened: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        for name, command in stdio.items():
            params = StdioServerParameters(command=command[0], args=command[1:],
                                           env=dict(os.environ))  # fmt: skip
            read, write = await stack.enter_async_context(stdio_client(params))
            opened[name] = await stack.enter_async_context(ClientSession(read, write))
        for name, url in http.items():
            read, write, *_ = await stack.enter_async_context(streamable_http_client(url))
            opened[name] = await stack.enter_async_context(ClientSession(read, write))
        for session in opened.values():
            await session.initialize()
            await session.list_tools()
        return await _take_turns(opened, n)


def _rows(case: str, samples: dict[str, list[float]], anchor: str) -> list[dict[str, Any]]:
    base = summarize_us(samples[anchor])
    rows = [{"group": GROUP, "case": case, "system": DIRECT, **base}]
    for system, values in samples.items():
        if system == anchor:
            continue
        row = summarize_us(values)
        rows.append({"group": GROUP, "case": case, "system": system, **row,
                     "overhead_p50_us": row["p50_us"] - base["p50_us"],
                     "ratio": round(row["p50_us"] / base["p50_us"], 2)})  # fmt: skip
    return rows


def _booth_agent(n: int) -> None:
    """Inside the booth: the four sessions in turns; one JSON line of samples on stdout."""
    import anyio

    with open(os.environ["JUKEBOX_MCP_CONFIG"]) as f:
        servers = json.load(f)["mcpServers"]
    wrapped = servers["echo"]
    samples = anyio.run(_sessions, {
        "stdio direct": SERVER, "stdio wrap": [wrapped["command"], *wrapped["args"]],
    }, {"http direct": os.environ["BENCH_MCP_HTTP"], "http gateway": servers["notes"]["url"]},
        n)  # fmt: skip
    print("BENCH " + json.dumps(samples), flush=True)


def _in_booth(n: int, tmp: Path) -> list[dict[str, Any]]:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        return []
    server = subprocess.Popen([*HTTP_SERVER, str(tmp / "notes.txt")], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline())}/mcp"
        config = tmp / "mcp.json"
        config.write_text(json.dumps({"mcpServers": {
            "echo": {"command": SERVER[0], "args": SERVER[1:]}}}))  # fmt: skip
        tree = tmp / "tree"
        tree.mkdir()
        jukebox = str(Path(sys.executable).parent / "jukebox")
        proc = subprocess.run(
            [jukebox, "booth", "run", "--tree", str(tree), "--tape-dir", str(tmp / "tapes"),
             "--net", "host", "--mcp-config", str(config), "--mcp-upstream", f"notes={url}",
             "--commit", "auto", "--", sys.executable, "-m", "bench.bench_mcp", "agent", str(n)],
            capture_output=True, text=True, cwd=REPO, timeout=600,
            env={**os.environ, "BENCH_MCP_HTTP": url, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=10)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the booth's bench agent failed ({proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")  # fmt: skip
    samples = json.loads(lines[-1].removeprefix("BENCH "))
    rows = _rows(STDIO_BOOTH, {DIRECT: samples["stdio direct"], WRAP: samples["stdio wrap"]},
                 DIRECT)  # fmt: skip
    rows += _rows(HTTP_BOOTH, {DIRECT: samples["http direct"],
                               HTTP_GATEWAY: samples["http gateway"]}, DIRECT)  # fmt: skip
    return rows


def _gateway(url: str) -> None:
    """The booth's HTTP gateway in front of `url`, in this process, its frames on a tape through
    a stage gate, as the supervisor runs it; prints its URL, serves until stdin closes."""
    import socket

    from jukebox.mcp.http_gateway import HttpGateways
    from jukebox.mcp.policy import Policy
    from jukebox.mcp.record import scrub
    from jukebox.mcp.staging import StageGate
    from jukebox.redact import Scrubber
    from jukebox.tape.tape import TapeWriter
    from shadowfs.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="jukebox-bench-mcp-gw-"))
    store = Store.open(tmp / "store", create=True)
    writer = TapeWriter.create(tmp / "gw.jbx", store, "gw", fsync=False)
    writer.append("run_start", {"tape_id": "gw"})
    scrubber = Scrubber(["bench-secret-0123456789"])  # a booth always has one (the path's)
    gateways = HttpGateways({"notes": url}, StageGate({}, writer.append), Policy("staged_acid"),
                            lambda server, tool, args: "stage-1",
                            lambda payload: scrub(payload, scrubber),
                            scrubber=scrubber)  # fmt: skip
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    gateways.start(listener)
    # Terminated (as the benches end it after closing stdin) or not, its files go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(gateways.urls()["notes"], flush=True)
    try:
        sys.stdin.read()
    finally:
        gateways.stop()
        writer.close()
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _callgrind(pid: int, *command: str) -> None:
    subprocess.run(["callgrind_control", *command, str(pid)], check=True, capture_output=True,
                   timeout=300)  # fmt: skip


def http_instructions(n: int, tmp: Path) -> dict[str, int]:
    """Instructions per echo call of the HTTP server alone and of the gateway in front of it,
    each process under callgrind; empty without valgrind."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return {}
    import anyio

    procs: dict[str, subprocess.Popen[str]] = {}
    url = ""  # the server's, then the gateway's in front of it
    try:
        for name, command in (("server", [*HTTP_SERVER, str(tmp / "cg-notes.txt")]),
                              ("gateway", [sys.executable, "-m", "bench.bench_mcp", "gateway"])):
            if name == "gateway":
                command.append(url)
            proc = procs[name] = subprocess.Popen(
                ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                 f"--callgrind-out-file={tmp}/cg-{name}.out", *command],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                          "PYTHONHASHSEED": "0"},
            )  # fmt: skip
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            url = line if name == "gateway" else f"http://127.0.0.1:{int(line)}/mcp"

        async def calls() -> None:
            from mcp import ClientSession
            from mcp.client.streamable_http import streamable_http_client

            async with (streamable_http_client(url) as (read, write, *_),
                        ClientSession(read, write) as session):  # fmt: skip
                await session.initialize()
                await session.list_tools()
                for _ in range(WARMUP):
                    await session.call_tool("echo", ARGS)
                for proc in procs.values():
                    _callgrind(proc.pid, "--instr=on")
                for _ in range(n):
                    await session.call_tool("echo", ARGS)
                await anyio.sleep(1)  # the gateway's frames thread writes the last frames

        anyio.run(calls)
        out = {}
        for name, proc in procs.items():
            _callgrind(proc.pid, "--instr=off")
            _callgrind(proc.pid, "--dump")
            out[name] = _totals(f"{tmp}/cg-{name}.out", n)
        return out
    finally:
        _stop(procs.values())


def _stop(procs: Any) -> None:
    """Ends processes that serve until their stdin closes."""
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.terminate()
        proc.wait(timeout=60)


def _pid_of(marker: str) -> int:
    """The process whose command line holds `marker` (a callgrind output path of this run)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if f"--callgrind-out-file={marker}".encode() in cmdline:
                return int(entry)
    raise RuntimeError(f"no process runs with {marker}")


def _totals(out: str, n: int) -> int:
    totals = [int(x) for d in glob.glob(f"{out}*")
              for x in re.findall(r"^totals: (\d+)", Path(d).read_text(), re.M)]  # fmt: skip
    return round(max(totals) / n)


async def _counted_rounds(sessions: list[Any], pids: Any, n: int) -> None:
    """WARMUP uncounted rounds of `echo` on every session, then n counted by callgrind in the
    processes `pids()` names, dumped."""
    import anyio

    for _ in range(WARMUP):
        for session in sessions:
            await session.call_tool("echo", ARGS)
    counted = pids()
    for pid in counted:
        _callgrind(pid, "--instr=on")
    for _ in range(n):
        for session in sessions:
            await session.call_tool("echo", ARGS)
    await anyio.sleep(1)  # the gateways' frames threads write the last frames
    for pid in counted:
        _callgrind(pid, "--instr=off")
        _callgrind(pid, "--dump")


def stdio_instructions(n: int, tmp: Path) -> dict[str, int]:
    """Instructions per echo call of the stdio server alone and of `jukebox mcp wrap` in front
    of it (recording on its own tape), each process under callgrind; empty without valgrind."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return {}
    import contextlib

    import anyio
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    jukebox = str(Path(sys.executable).parent / "jukebox")
    commands = {
        "server": SERVER,
        "gateway": [jukebox, "mcp", "wrap", "--tape-dir", str(tmp / "cg-tapes"), "--", *SERVER],
    }
    outs = {name: f"{tmp}/cg-stdio-{name}.out" for name in commands}

    async def calls() -> dict[str, int]:
        # valgrind's own lines, and the server's log, on nobody's terminal
        with open(os.devnull, "w") as quiet:
            return await counted(quiet)

    async def counted(quiet: Any) -> dict[str, int]:
        async with contextlib.AsyncExitStack() as stack:
            sessions = []
            for name, command in commands.items():
                params = StdioServerParameters(
                    command="valgrind", args=["--tool=callgrind", "--instr-atstart=no",
                                              f"--callgrind-out-file={outs[name]}", *command],
                    env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"},
                )  # fmt: skip
                read, write = await stack.enter_async_context(stdio_client(params, quiet))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                await session.list_tools()
                sessions.append(session)
            await _counted_rounds(sessions, lambda: [_pid_of(out) for out in outs.values()], n)
        return {name: _totals(out, n) for name, out in outs.items()}

    return anyio.run(calls)


def _checkouts(specs: list[str]) -> dict[str, tuple[str, str]]:
    """NAME=REPO[:EXTRA_PYTHONPATH] -> (the checkout, the PYTHONPATH of its gateway)."""
    out = {}
    for spec in specs:
        name, _, where = spec.partition("=")
        repo, _, extra = where.partition(":")
        out[name] = (repo, f"{repo}:{extra}" if extra else repo)
    return out


def compare(n: int, specs: list[str]) -> None:
    """`python -m bench.bench_mcp compare N NAME=REPO[:PYTHONPATH] ...`: the booth's HTTP gateway
    of each checkout, each in a process of its own (`gateway URL`), in front of one HTTP server;
    one client calls `echo` through each and directly, in turns call by call, the order reversed
    every round; prints each p50, what it adds to the direct call, and the load before and
    after. Old against new in the same minutes, whatever else the machine runs."""
    import statistics

    import anyio

    tmp = Path(tempfile.mkdtemp(prefix="jukebox-bench-mcp-cmp-"))
    server = subprocess.Popen([*HTTP_SERVER, str(tmp / "notes.txt")], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    gateways: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None
        urls = {DIRECT: f"http://127.0.0.1:{int(server.stdout.readline())}/mcp"}
        for name, (repo, path) in _checkouts(specs).items():
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.bench_mcp", "gateway", urls[DIRECT]], cwd=repo,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, env={**os.environ, "PYTHONPATH": path},
            )  # fmt: skip
            gateways.append(proc)
            assert proc.stdout is not None
            urls[name] = proc.stdout.readline().strip()

        async def turns() -> dict[str, list[float]]:
            import contextlib

            from mcp import ClientSession
            from mcp.client.streamable_http import streamable_http_client

            out: dict[str, list[float]] = {name: [] for name in urls}
            async with contextlib.AsyncExitStack() as stack:
                sessions = {}
                for name, url in urls.items():
                    read, write, *_ = await stack.enter_async_context(streamable_http_client(url))
                    session = await stack.enter_async_context(ClientSession(read, write))
                    await session.initialize()
                    await session.list_tools()
                    sessions[name] = session
                for i in range(n + WARMUP):
                    order = list(sessions.items())
                    for name, session in order[::-1] if i % 2 else order:
                        started = time.perf_counter()
                        await session.call_tool("echo", ARGS)
                        if i >= WARMUP:
                            out[name].append((time.perf_counter() - started) * 1e6)
            return out

        before = os.getloadavg()
        samples = anyio.run(turns)
        after = os.getloadavg()
    finally:
        for proc in gateways:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load (1 min) {before[0]:.2f} -> {after[0]:.2f}; {n} calls each after {WARMUP}")
    direct = statistics.median(samples[DIRECT])
    for name, values in samples.items():
        p50 = statistics.median(values)
        print(f"{name:>24}: p50 {p50:8,.0f} us  added {p50 - direct:+7,.0f} us  "
              f"{p50 / direct:.2f}x")  # fmt: skip


def compare_instructions(n: int, specs: list[str]) -> None:
    """`python -m bench.bench_mcp compare-instructions N NAME=REPO[:PYTHONPATH] ...`: as
    `compare`, each process under callgrind (the HTTP server and each checkout's gateway), n
    echo calls after WARMUP uncounted; prints the instructions per call of each."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("compare-instructions needs valgrind (callgrind_control)")
    import anyio

    tmp = Path(tempfile.mkdtemp(prefix="jukebox-bench-mcp-cg-"))
    procs: dict[str, subprocess.Popen[str]] = {}

    def counted(name: str, command: list[str], cwd: str, path: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={tmp}/cg-{name}.out", *command],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            cwd=cwd, env={**os.environ, "PYTHONPATH": path, "PYTHONHASHSEED": "0"},
        )  # fmt: skip

    try:
        proc = procs["server"] = counted("server", [*HTTP_SERVER, str(tmp / "notes.txt")],
                                         str(REPO), str(REPO))  # fmt: skip
        assert proc.stdout is not None
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}/mcp"
        urls = {}
        for name, (repo, path) in _checkouts(specs).items():
            proc = procs[name] = counted(
                name, [sys.executable, "-m", "bench.bench_mcp", "gateway", url], repo, path)
            assert proc.stdout is not None
            urls[name] = proc.stdout.readline().strip()

        async def calls() -> None:
            import contextlib

            from mcp import ClientSession
            from mcp.client.streamable_http import streamable_http_client

            async with contextlib.AsyncExitStack() as stack:
                sessions = []
                for url in urls.values():
                    read, write, *_ = await stack.enter_async_context(streamable_http_client(url))
                    session = await stack.enter_async_context(ClientSession(read, write))
                    await session.initialize()
                    await session.list_tools()
                    sessions.append(session)
                await _counted_rounds(sessions, lambda: [p.pid for p in procs.values()], n)

        anyio.run(calls)
        for name in procs:
            calls_seen = n * len(urls) if name == "server" else n
            print(f"{name:>24}: {_totals(f'{tmp}/cg-{name}.out', calls_seen):,} instructions "
                  "per call")  # fmt: skip
    finally:
        _stop(procs.values())
        shutil.rmtree(tmp, ignore_errors=True)


def run(quick: bool = False) -> list[dict[str, Any]]:
    import anyio

    n = 40 if quick else 400
    jukebox = str(Path(sys.executable).parent / "jukebox")
    tmp = Path(tempfile.mkdtemp(prefix="jukebox-bench-mcp-"))
    try:
        wrapped = [jukebox, "mcp", "wrap", "--tape-dir", str(tmp / "own-tapes"), "--", *SERVER]
        samples = anyio.run(_sessions, {DIRECT: SERVER, WRAP: wrapped}, {}, n)
        rows = _rows(STDIO, samples, DIRECT)
        rows += _in_booth(n, tmp)
        # Minutes under valgrind: not in a quick run.
        for case, count in ((HTTP_BOOTH, http_instructions), (STDIO, stdio_instructions)):
            counted = {} if quick else count(100, tmp)
            for row in rows:
                if counted and row["case"] == case:
                    row["instructions"] = counted["server" if row["system"] == DIRECT
                                                  else "gateway"]  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["agent"]:
        _booth_agent(int(sys.argv[2]))
    elif sys.argv[1:2] == ["gateway"]:
        _gateway(sys.argv[2])
    elif sys.argv[1:2] == ["compare"]:
        compare(int(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1:2] == ["compare-instructions"]:
        compare_instructions(int(sys.argv[2]), sys.argv[3:])
    else:
        for r in run(quick="--quick" in sys.argv):
            print(r)
