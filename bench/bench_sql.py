"""The SQL savepoint proxy: what it adds to one statement, against talking to the server
directly.

A private PostgreSQL cluster (tests/sql/cluster.py: Debian's `postgresql`, `initdb` in a
temporary directory, on 127.0.0.1) is started for the run. psycopg 3 connections in autocommit,
one direct and one through a proxy recording its `sql` frames to a tape as a booth does
(jukebox.booth.supervisor.GroupTape), take turns statement by statement, so a noisy neighbour slows
them
alike. Through the proxy every statement is also wrapped in its savepoint (jukebox.sql.session):
the SAVEPOINT goes with the statement and the RELEASE after the agent's answer, so neither costs
the agent a round trip.

Cases: `SELECT 1` (simple query), a primary-key lookup with a parameter (extended query:
Parse/Bind/Execute/Sync), and an INSERT of one row. Then pgbench's default (TPC-B-like)
workload, one client, `-M simple` and `-M extended`, direct and through the proxy: transactions
per second and the mean latency of one transaction (seven statements in BEGIN … END, so the
agent's transactions as savepoints). Last, the same transaction from psycopg taking turns direct,
direct as savepoints inside one long transaction (what the booth's design costs on the server,
without the proxy) and through the proxy. `cpu_us` is the CPU this process spent per
statement (client and proxy; `overhead_cpu_us` the proxy's share), which a busy machine
inflates far less than wall time.

`python -m bench.bench_sql --instructions [select lookup insert]` counts instead the
instructions of the proxy's process per statement (callgrind), which the machine's load does
not move (see `instructions`).

The three single statements are also measured through a proxy in a process of its own
(`PROXY_PROCESS`, `python -m bench.bench_sql --serve URL`), as in a booth, where the proxy runs in
the supervisor and the agent is another process: in this process the client's Python and the
proxy thread take turns on one GIL, so whatever the proxy does after an answer (its `sql`
frame) delays the client reading it, which never happens to an agent. Its `cpu_us` adds the
proxy process's CPU per statement (from /proc, over the whole case) to this one's.

Last, the three single statements once more, direct and through two proxies in processes of
their own, one as a booth runs it (the default: it polls for the server's answer,
jukebox.spin.Spin, and yields its CPU to the agent after it) and one with
`JUKEBOX_SQL_SPIN=0`, the order of the turn rotating each round so that neither always follows
the other's frame work: what those save, side by side.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import overhead_rows

GROUP = "sql proxy"
DIRECT = "direct"
PROXY = "proxy, recording"
PROXY_PROCESS = "proxy in its own process, recording"
# The same two ways, taking turns in a rotating order: with the proxy's poll for the server's
# answer and its yield to the agent after it (the default), and without (JUKEBOX_SQL_SPIN=0).
POLLING = "proxy in its own process, the default: polling (rotating turns)"
NOT_POLLING = "proxy in its own process, JUKEBOX_SQL_SPIN=0 (rotating turns)"
DIRECT_ONE_TX = "direct, one transaction of savepoints"
TPCB = "TPC-B-like transaction (7 statements), psycopg"
SIMPLE = "SELECT 1, simple query"
LOOKUP = "primary-key lookup, extended query"
INSERT = "INSERT one row, autocommit"
WARMUP = 20


def _take_turns(
    systems: list[tuple[str, Any]], statement: Callable[[Any, int], object], n: int,
    elsewhere: dict[str, Callable[[], float]] | None = None, rotate: bool = False,
) -> dict[str, tuple[list[float], float]]:
    """`elsewhere`: for a system served by another process, that process's CPU µs so far.
    `rotate`: the order of the turn moves by one each round, so that each system follows
    each other one as often (a proxy's work after its answer, its frame, runs while the next
    system in the turn serves, which the fixed order always hands to the same one)."""
    samples: dict[str, list[float]] = {name: [] for name, _ in systems}
    cpu: dict[str, float] = dict.fromkeys(samples, 0.0)
    apart = {name: read for name, read in (elsewhere or {}).items() if name in samples}
    others = {name: read() for name, read in apart.items()}
    for i in range(WARMUP + n):
        turn = systems[i % len(systems):] + systems[:i % len(systems)] if rotate else systems
        for name, conn in turn:
            c0 = time.process_time_ns()
            t0 = time.perf_counter_ns()
            statement(conn, i)
            took = (time.perf_counter_ns() - t0) / 1000.0
            if i >= WARMUP:
                samples[name].append(took)
                cpu[name] += (time.process_time_ns() - c0) / 1000.0
    for name, read in apart.items():
        cpu[name] += (read() - others[name]) * n / (WARMUP + n)
    return {name: (samples[name], cpu[name] / n) for name in samples}


def _cpu_us(pid: int) -> float:
    """User and system CPU of process `pid` so far, µs (clock ticks: fine over a case)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) * 1e6 / os.sysconf("SC_CLK_TCK")


def _serve_apart(url: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`--serve` in a process of its own, with `env` added to its environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "bench.bench_sql", "--serve", url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, **(env or {})),
    )


def _serve(url: str) -> None:
    """The proxy in a process of its own, recording to a tape as a booth does: prints its
    port, serves until its stdin closes."""
    from jukebox.booth.supervisor import GroupTape
    from jukebox.sql.server import SqlProxy
    from jukebox.sql.upstream import Target
    from jukebox.tape.tape import TapeWriter
    from shadowfs.store import Store

    with tempfile.TemporaryDirectory(prefix="bench-sql-proc-") as tmp:
        store = Store.open(Path(tmp) / "store", create=True)
        writer = GroupTape(TapeWriter.create(Path(tmp) / "t.jbx", store, "bench", fsync=False),
                           store)
        writer.start()
        writer.append("run_start", {"name": "bench"})
        proxy = SqlProxy({"main": Target.parse(url)}, writer.append, "bench",
                         apart=True).start()  # its agent is another process, as a booth's
        print(proxy.databases["main"].port, flush=True)
        sys.stdin.read()
        proxy.stop()
        writer.close()
        store.close()



def _pgbench(cluster: Any, port: int, seconds: int) -> list[dict[str, Any]]:
    """pgbench's default workload direct and through the proxy (its tables made directly:
    `pgbench -i` vacuums, which the proxy refuses)."""
    import re
    import subprocess

    pgbench = str(cluster.bin / "pgbench")
    subprocess.run([pgbench, "-i", "-q", "-s", "1", cluster.url("bench")], check=True,
                   capture_output=True)
    rows = []
    # Direct runs first: the proxy's runs leave their rows locked by the booth's transaction,
    # which would hold up any other client updating them (pgbench's one branch row, always).
    for system, url in ((DIRECT, cluster.url("bench")),
                        (PROXY, f"postgresql://agent@127.0.0.1:{port}/bench")):
        for mode in ("simple", "extended"):
            out = subprocess.run([pgbench, "-n", "-c", "1", "-M", mode, "-T", str(seconds),
                                  url], check=True, capture_output=True, text=True,
                                 timeout=seconds + 120).stdout
            tps = re.search(r"tps = ([0-9.]+)", out)
            latency = re.search(r"latency average = ([0-9.]+) ms", out)
            rows.append({
                "group": GROUP, "case": f"pgbench TPC-B-like, 1 client, -M {mode}",
                "system": system, "tps": float(tps.group(1)) if tps else None,
                "mean_us": float(latency.group(1)) * 1000 if latency else None,
            })
    return rows


def _tpcb(conn: Any, i: int, wrap: tuple[str, str]) -> None:
    """pgbench's default transaction, its random values seeded by `i`."""
    import random

    rnd = random.Random(i)
    aid, tid, delta = rnd.randint(1, 100_000), rnd.randint(1, 10), rnd.randint(-5000, 5000)
    conn.execute(wrap[0])
    conn.execute("UPDATE pgbench_accounts SET abalance = abalance + %s WHERE aid = %s",
                 (delta, aid))
    conn.execute("SELECT abalance FROM pgbench_accounts WHERE aid = %s", (aid,)).fetchone()
    conn.execute("UPDATE pgbench_tellers SET tbalance = tbalance + %s WHERE tid = %s",
                 (delta, tid))
    conn.execute("UPDATE pgbench_branches SET bbalance = bbalance + %s WHERE bid = 1", (delta,))
    conn.execute("INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) "
                 "VALUES (%s, 1, %s, %s, CURRENT_TIMESTAMP)", (tid, aid, delta))
    conn.execute(wrap[1])


def _tpcb_rows(cluster: Any, proxied: Any, n: int) -> list[dict[str, Any]]:
    """The TPC-B-like transaction taking turns direct, direct inside one long transaction as
    savepoints (what the booth's one transaction makes of it on the server, without the
    proxy), and through the proxy: the first gap is the design's, the second the proxy's.
    The direct ones on databases of their own, since the booth's transaction keeps its rows
    locked."""
    import subprocess

    import psycopg

    for db in ("tb_direct", "tb_onetx"):
        cluster.psql(f"CREATE DATABASE {db}")
        subprocess.run([str(cluster.bin / "pgbench"), "-i", "-q", "-s", "1", cluster.url(db)],
                       check=True, capture_output=True)
    direct = psycopg.connect(cluster.url("tb_direct"), autocommit=True)
    one_tx = psycopg.connect(cluster.url("tb_onetx"), autocommit=True)
    try:
        one_tx.execute("BEGIN")
        systems = [(DIRECT, (direct, ("BEGIN", "COMMIT"))),
                   (DIRECT_ONE_TX, (one_tx, ("SAVEPOINT s", "RELEASE SAVEPOINT s"))),
                   (PROXY, (proxied, ("BEGIN", "COMMIT")))]
        measured = _take_turns(systems, lambda s, i: _tpcb(s[0], i, s[1]), n)
    finally:
        direct.close()
        one_tx.close()
    return overhead_rows(GROUP, TPCB, measured)


def _cluster() -> Any:
    """A private PostgreSQL cluster (tests/sql/cluster.py), not started yet."""
    from tests.sql.cluster import Cluster, bindir

    where = bindir()
    if where is None:
        raise RuntimeError("PostgreSQL is not installed (make setup installs it)")
    return Cluster(where)


def _fill(cluster: Any) -> None:
    """Start `cluster` with the bench's database: 1,000 rows to look up, a table to insert in."""
    cluster.init()
    cluster.psql("CREATE DATABASE bench")
    cluster.psql("CREATE TABLE k (id int PRIMARY KEY, v text); INSERT INTO k SELECT i, "
                 "'value ' || i FROM generate_series(1, 1000) i; "
                 "CREATE TABLE w (id bigserial PRIMARY KEY, v text)", db="bench")


def run(quick: bool = False) -> list[dict[str, Any]]:
    import psycopg

    from jukebox.booth.supervisor import GroupTape
    from jukebox.sql.server import SqlProxy
    from jukebox.sql.upstream import Target
    from jukebox.tape.tape import TapeWriter
    from shadowfs.store import Store

    n = 300 if quick else 3000
    cluster = _cluster()
    rows: list[dict[str, Any]] = []
    try:
        _fill(cluster)
        with tempfile.TemporaryDirectory(prefix="bench-sql-") as tmp:
            store = Store.open(Path(tmp) / "store", create=True)
            writer = GroupTape(TapeWriter.create(Path(tmp) / "t.jbx", store, "bench",
                                                 fsync=False), store)
            writer.start()
            writer.append("run_start", {"name": "bench"})
            proxy = SqlProxy({"main": Target.parse(cluster.url("bench"))}, writer.append,
                             "bench").start()
            port = proxy.databases["main"].port
            direct = psycopg.connect(cluster.url("bench"), autocommit=True)
            proxied = psycopg.connect(f"postgresql://agent@127.0.0.1:{port}/bench",
                                      autocommit=True)
            server = _serve_apart(cluster.url("bench"))
            still = _serve_apart(cluster.url("bench"), {"JUKEBOX_SQL_SPIN": "0"})
            apart = []
            for process in (server, still):
                assert process.stdout is not None
                apart.append(psycopg.connect(
                    f"postgresql://agent@127.0.0.1:{int(process.stdout.readline())}/bench",
                    autocommit=True,
                ))
            other, not_polling = apart
            systems = [(DIRECT, direct), (PROXY, proxied), (PROXY_PROCESS, other)]
            elsewhere = {PROXY_PROCESS: lambda: _cpu_us(server.pid),
                         POLLING: lambda: _cpu_us(server.pid),
                         NOT_POLLING: lambda: _cpu_us(still.pid)}
            try:
                cases: list[tuple[str, Callable[[Any, int], object]]] = [
                    (SIMPLE, lambda c, i: c.execute("SELECT 1").fetchone()),
                    (LOOKUP, lambda c, i: c.execute("SELECT v FROM k WHERE id = %s",
                                                    (i % 1000 + 1,)).fetchone()),
                    (INSERT, lambda c, i: c.execute("INSERT INTO w (v) VALUES (%s)",
                                                    (f"row {i}",))),
                ]
                for case, statement in cases:
                    rows += overhead_rows(GROUP, case,
                                          _take_turns(systems, statement, n, elsewhere))
                polls = [(DIRECT, direct), (POLLING, other), (NOT_POLLING, not_polling)]
                for case, statement in cases:
                    rows += overhead_rows(GROUP, case, _take_turns(
                        polls, statement, n, elsewhere, rotate=True))
                for conn in apart:
                    conn.close()
                server.communicate("", timeout=30)
                still.communicate("", timeout=30)
                rows += _pgbench(cluster, port, 3 if quick else 15)
                # After pgbench: the proxy's transactions keep pgbench's rows locked.
                rows += _tpcb_rows(cluster, proxied, 100 if quick else 1000)
            finally:
                direct.close()
                proxied.close()
                for conn in apart:
                    conn.close()
                for process in (server, still):
                    if process.poll() is None:
                        process.kill()
                        process.wait()
                proxy.stop()
                writer.close()
                store.close()
    finally:
        cluster.remove()
    return rows


def instructions(case: str, n: int = 500, warm: int = 200) -> float:
    """Instructions the proxy's process runs per statement of `case` (select, lookup, insert),
    what does not move with the machine's load: the proxy in a process of its own recording
    to a tape (`--serve`) under callgrind, its instrumentation switched on after `warm`
    statements and off after `n` more (psycopg in autocommit, PYTHONHASHSEED=0, no poll for
    the server's answers: `JUKEBOX_SQL_SPIN=0`). Needs
    valgrind; a few minutes a case."""
    import re

    import psycopg

    cluster = _cluster()
    out = Path(tempfile.mkdtemp(prefix="bench-sql-cg-")) / "callgrind.out"
    try:
        _fill(cluster)
        server = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={out}", sys.executable, "-m", "bench.bench_sql", "--serve",
             cluster.url("bench")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            # No poll for the server's answer: its instructions would count the wait, not
            # the work (and under callgrind every wait is long).
            text=True, env=dict(os.environ, PYTHONHASHSEED="0", JUKEBOX_SQL_SPIN="0"),
        )
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with psycopg.connect(f"postgresql://agent@127.0.0.1:{port}/bench",
                             autocommit=True) as conn:
            statement = {
                "select": lambda i: conn.execute("SELECT 1").fetchone(),
                "lookup": lambda i: conn.execute("SELECT v FROM k WHERE id = %s",
                                                 (i % 1000 + 1,)).fetchone(),
                "insert": lambda i: conn.execute("INSERT INTO w (v) VALUES (%s)", (f"r{i}",)),
            }[case]
            for i in range(warm):
                statement(i)
            toggle = ["callgrind_control", "-i"]
            subprocess.run([*toggle, "on", str(server.pid)], check=True, capture_output=True)
            for i in range(n):
                statement(i)
            time.sleep(0.5)  # the last statements' frames written
            subprocess.run([*toggle, "off", str(server.pid)], check=True, capture_output=True)
        server.communicate("", timeout=300)
        totals = re.search(r"^totals: (\d+)", out.read_text(), re.M)
        assert totals is not None, "callgrind wrote no totals"
        return int(totals.group(1)) / n
    finally:
        cluster.remove()
        subprocess.run(["rm", "-rf", "--", str(out.parent)], check=False)


CASES = ("select", "lookup", "insert")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_sql",
        description="What the SQL savepoint proxy adds to a statement, against the server "
        "directly (a private PostgreSQL cluster). Without options: the quick run (300 "
        "statements a case, pgbench 3 s), its rows printed; `python -m bench --only sql` "
        "runs the full one.",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--instructions", nargs="*", choices=CASES, metavar="CASE",
        help="count instead the instructions of the proxy's process a statement (callgrind; "
        f"needs valgrind, a few minutes a case); CASE is one of {', '.join(CASES)} "
        "(default: all three)",
    )
    what.add_argument(
        "--serve", metavar="URL",
        help="serve a proxy of the database URL recording to a throwaway tape, print its "
        "port, stop when stdin closes (what the bench starts in a process of its own)",
    )
    args = p.parse_args(argv)
    if args.serve is not None:
        _serve(args.serve)
    elif args.instructions is not None:
        for name in args.instructions or CASES:
            print(f"{name}: {instructions(name) / 1000:.0f} k instructions a statement")
    else:
        for r in run(quick=True):
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
