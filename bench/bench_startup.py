"""What a user waits for at the start of a command, next to its anchors in the same run.

* `jukebox booth run --tree T -- true`, whole process (store, base tree, mount, the shim, the
  verdict), beside bubblewrap starting `true` with every namespace it has (`bwrap
  --unshare-all`, the anchor a sandbox's start is judged against) and `python -c pass` (the
  floor any Python command stands on). Goal: ≤ 100 ms.
* `jukebox replay TAPE` of an 8-frame booth tape (three checkpoints and a commit), whole
  process, beside the same floor. Goal: ≤ 60 ms.

Each command runs `runs` times, the systems interleaved so the machine's drift hits them alike;
`min_us` is the least disturbed run, `cpu_s` the CPU seconds of the command and every process it
waited for (the shim, the agent): on a shared machine it moves far less than wall time. Set
JUKEBOX_BENCH_BASELINE to another version's `jukebox` executable (an older commit installed in
its own venv) to run it interleaved too, as the `isolation` group does.

Warm (`jukebox warm start`, jukebox.cli.warm_server): the same two commands again, in the same
interleaved run, handed to a server the bench starts for itself; `cpu_s` is then the client's
alone (the process the user waits on), and `server_cpu_s` the CPU of the server's child that ran
the command (the server's reaped children's CPU, per run; the kernel counts it in ticks of
10 ms, so it is an average over the runs). `python -S -c pass` is the interpreter's start with
no site (no .pth, no editable finder): what is left of a warm command's wait once the client's
Python starts as fast as Python can. The cold rows run with JUKEBOX_WARM=off, so a server the
user keeps does not touch them.

Where valgrind is installed, the replay and the floor (not the warm client: under valgrind its
resource limits differ from the server's, so it runs cold) are also counted once in instructions
(`instructions`, cachegrind, PYTHONHASHSEED fixed): a figure the machine's load cannot move, so
two runs of different code compare even when their wall times were taken at different loads.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import median, percentile

GROUP = "startup"
JUKEBOX = str(Path(sys.executable).parent / "jukebox")
BASELINE_ENV = "JUKEBOX_BENCH_BASELINE"
BOOTH_CASE = "start a sandbox running `true` (whole command)"
REPLAY_CASE = "replay an 8-frame tape (whole command)"
BOOTH_SYSTEM = "jukebox booth run --tree T -- true"
REPLAY_SYSTEM = "jukebox replay TAPE"
BWRAP_SYSTEM = "bwrap --unshare-all -- true (anchor)"
FLOOR_SYSTEM = "python -c pass (floor)"
BARE_FLOOR_SYSTEM = "python -S -c pass (floor, no site)"
BOOTH_WARM_SYSTEM = "jukebox booth run --tree T -- true, warm (client)"
REPLAY_WARM_SYSTEM = "jukebox replay TAPE, warm (client)"
WARM_SYSTEMS = (BOOTH_WARM_SYSTEM, REPLAY_WARM_SYSTEM)
BOOTH_GOAL_MS = 100.0
REPLAY_GOAL_MS = 60.0
# Three checkpoints and an auto commit: run_start, agent_started, 3 checkpoints, fs, exit,
# commit.
EIGHT_FRAMES = "for i in 1 2 3; do echo $i > step$i.txt; jukebox booth checkpoint >/dev/null; done"


COLD_ENV = {**os.environ, "JUKEBOX_WARM": "off"}
# A case's environment, by its argv's identity (see _warm_case); the others run COLD_ENV.
_ENVS: dict[int, dict[str, str]] = {}


def _timed(argv: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, float]:
    """(wall µs, CPU seconds of the command and every descendant it waited for)."""
    env = _ENVS.get(id(argv), COLD_ENV)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL, env=env)  # fmt: skip
    wall = (time.perf_counter() - t0) * 1e6
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in ok:
        raise RuntimeError(f"{argv[:3]} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _warm_case(argv: list[str], directory: Path) -> list[str]:
    """`argv` run with the bench's own warm server."""
    case = list(argv)
    _ENVS[id(case)] = {**COLD_ENV, "JUKEBOX_WARM": "", "JUKEBOX_WARM_DIR": str(directory)}
    return case


def _start_server(directory: Path) -> int | None:
    """Starts the bench's warm server; its pid, or None when it would not start."""
    env = {**COLD_ENV, "JUKEBOX_WARM": "", "JUKEBOX_WARM_DIR": str(directory)}
    proc = subprocess.run([JUKEBOX, "warm", "start", "--idle-timeout", "900"], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        return None
    found = re.search(r"pid (\d+)", proc.stdout)
    return int(found[1]) if found else None


def _reaped_cpu(pid: int) -> float:
    """CPU seconds of the reaped children of `pid` (cutime + cstime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def _interleaved_warm(
    cases: dict[str, list[str]], runs: int, server: int | None
) -> tuple[dict[str, tuple[list[float], list[float]]], float | None]:
    """As _interleaved, and the CPU per run of the server's children (None without one)."""
    if server is None:
        return _interleaved(cases, runs), None
    before = _reaped_cpu(server)
    results = _interleaved(cases, runs)
    warm_runs = (runs + 1) * sum(1 for name in cases if name in WARM_SYSTEMS)
    return results, (_reaped_cpu(server) - before) / max(warm_runs, 1)


def _counted_env(argv: list[str]) -> dict[str, str]:
    """The hash seed fixed, except for a warm client: the server's children hash with the
    server's seed, so a client asking for another runs cold (jukebox.cli.warm.identity)."""
    env = _ENVS.get(id(argv))
    return env if env is not None else {**COLD_ENV, "PYTHONHASHSEED": "0"}


def _instructions(argv: list[str]) -> int | None:
    """The instructions `argv` runs (user space, the whole process), or None without valgrind."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return None
    proc = subprocess.run(
        [valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=_counted_env(argv), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    found = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
    return int(found[1].replace(",", "")) if proc.returncode == 0 and found else None


def _bwrap() -> list[str] | None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None
    return [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc",
            "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", "true"]  # fmt: skip


def _interleaved(
    cases: dict[str, list[str]], runs: int
) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in cases}
    for argv in cases.values():  # one untimed run each: page cache, bytecode, stat cache
        _timed(argv)
    for _ in range(runs):
        for name, argv in cases.items():
            wall, cpu = _timed(argv)
            out[name][0].append(wall)
            out[name][1].append(cpu)
    return out


def _rows(case: str, results: dict[str, tuple[list[float], list[float]]], anchor: str,
          goal_ms: float, subject: str) -> list[dict[str, Any]]:  # fmt: skip
    base = median(results[anchor][0]) if anchor in results else None
    rows = []
    for system, (walls, cpus) in results.items():
        p50 = percentile(walls, 50)
        note = ""
        if system == subject or system.startswith("previous version"):
            note = f"goal ≤ {goal_ms:.0f} ms: {'met' if p50 <= goal_ms * 1e3 else 'not met'}"
        rows.append({
            "group": GROUP, "case": case, "system": system,
            "min_us": min(walls), "p50_us": p50, "p99_us": percentile(walls, 99),
            "cpu_s": round(median(cpus), 4), "n": len(walls),
            "ratio": p50 / base if base else None, "note": note,
        })  # fmt: skip
    return rows


def _load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def run(quick: bool = False) -> list[dict[str, Any]]:
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return [{"group": GROUP, "case": "all", "system": "jukebox booth",
                 "note": "skipped: /dev/fuse not usable by this user"}]  # fmt: skip
    import compileall

    from bench.harness import REPO

    # An installed jukebox has bytecode (pip compiles it); without it every start recompiles
    # what changed (PYTHONDONTWRITEBYTECODE is set on some machines), which is not the product.
    for package in ("jukebox", "shadowfs"):
        compileall.compile_dir(REPO / package, quiet=1)
    runs = 5 if quick else 20
    server: int | None = None
    cases: dict[str, list[str]] = {}
    baseline = os.environ.get(BASELINE_ENV)
    load_before = _load_average()
    # Not under /tmp: the booth's /tmp is private, and the tree must be the same inside.
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="jukebox-bench-startup-"))
    try:
        tree, tapes, other = work / "tree", work / "tapes", work / "tapes-baseline"
        tree.mkdir()
        for i in range(100):
            (tree / f"file{i}.txt").write_text(f"content {i}\n" * 20)
        floor = [sys.executable, "-c", "pass"]
        bare_floor = [sys.executable, "-S", "-c", "pass"]
        warm_dir = work / "warm"
        server = _start_server(warm_dir)
        cases: dict[str, list[str]] = {}
        bwrap = _bwrap()
        if bwrap is not None:
            cases[BWRAP_SYSTEM] = bwrap
        cases[FLOOR_SYSTEM] = floor
        cases[BARE_FLOOR_SYSTEM] = bare_floor
        # No changes and an auto commit: nothing is left pending, so runs do not pile up.
        cases[BOOTH_SYSTEM] = [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir",
                               str(tapes), "--commit", "auto", "--", "true"]  # fmt: skip
        if server is not None:
            cases[BOOTH_WARM_SYSTEM] = _warm_case(cases[BOOTH_SYSTEM], warm_dir)
        if baseline:
            cases[f"previous version ({baseline})"] = [
                baseline, "booth", "run", "--tree", str(tree), "--tape-dir", str(other),
                "--commit", "auto", "--", "true"]  # fmt: skip
        results, server_cpu = _interleaved_warm(cases, runs, server)
        rows = _rows(BOOTH_CASE, results, BWRAP_SYSTEM if bwrap else FLOOR_SYSTEM,
                     BOOTH_GOAL_MS, BOOTH_SYSTEM)  # fmt: skip
        _note_warm(rows, BOOTH_WARM_SYSTEM, server_cpu, BOOTH_GOAL_MS)

        replay_tree = work / "replay-tree"
        replay_tree.mkdir()
        (replay_tree / "a.txt").write_text("a\n")
        subprocess.run(
            [JUKEBOX, "booth", "run", "--tree", str(replay_tree), "--tape-dir", str(tapes),
             "--tape-id", "eight", "--", "sh", "-c", EIGHT_FRAMES],
            check=True, capture_output=True,
        )  # fmt: skip
        replays: dict[str, list[str]] = {
            FLOOR_SYSTEM: floor,
            BARE_FLOOR_SYSTEM: bare_floor,
            REPLAY_SYSTEM: [JUKEBOX, "replay", str(tapes / "eight.jbx")],
        }
        if server is not None:
            replays[REPLAY_WARM_SYSTEM] = _warm_case(replays[REPLAY_SYSTEM], warm_dir)
        if baseline:
            replays[f"previous version ({baseline})"] = [
                baseline,
                "replay",
                str(tapes / "eight.jbx"),
            ]
        replay_results, server_cpu = _interleaved_warm(replays, runs, server)
        replay_rows = _rows(REPLAY_CASE, replay_results, FLOOR_SYSTEM, REPLAY_GOAL_MS,
                            REPLAY_SYSTEM)  # fmt: skip
        _note_warm(replay_rows, REPLAY_WARM_SYSTEM, server_cpu, REPLAY_GOAL_MS)
        floor_count = _instructions(floor)
        for row in replay_rows:
            if row["system"] in WARM_SYSTEMS:
                # valgrind lowers the client's resource limits, so a server would find it
                # another process than itself and the client ran cold: not counted.
                continue
            count = _instructions(replays[row["system"]])
            if count is not None:
                row["instructions"] = count
                if floor_count:
                    row["instructions_vs_floor"] = round(count / floor_count, 2)
        rows += replay_rows
        load = f"load average {load_before} before, {_load_average()} after"
        for row in rows:
            row["note"] = "; ".join(x for x in (row["note"], load) if x)
        return rows
    finally:
        if server is not None:
            subprocess.run([JUKEBOX, "warm", "stop"], capture_output=True,
                           env=_ENVS.get(id(cases.get(BOOTH_WARM_SYSTEM)), COLD_ENV))  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)


def _note_warm(rows: list[dict[str, Any]], system: str, server_cpu: float | None,
               goal_ms: float) -> None:  # fmt: skip
    """The warm row's goal note and its server child's CPU."""
    for row in rows:
        if row["system"] == system:
            met = "met" if row["p50_us"] <= goal_ms * 1e3 else "not met"
            row["note"] = f"goal ≤ {goal_ms:.0f} ms (warm): {met}"
            if server_cpu is not None:
                row["server_cpu_s"] = round(server_cpu, 4)


if __name__ == "__main__":
    for r in run(quick="--quick" in sys.argv):
        print(r)
