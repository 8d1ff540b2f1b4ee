"""The long fuzz run (`make fuzz`): atheris, coverage-guided, on every target.

    python -m tests.fuzz [--seconds S] [--only a,b] [--jobs J] [--runs N] [--out DIR]

Targets run in child processes, J at a time (default: the CPU count), sharing S seconds of wall
time (default `$JUKEBOX_FUZZ_SECONDS`, else 60). Each child starts from the target's seed inputs
plus the corpus it kept last time in DIR/corpus/<target> (default DIR: `$JUKEBOX_FUZZ_OUT`, else
~/.cache/jukebox/fuzz, so the corpus grows from run to run outside the repo), stops a single
input after 10 s as a hang, and writes any input that broke the property to DIR/crashes/. The exit
status is 1 when any target broke, and the summary names the input file to replay:

    python -m tests.fuzz --worker TARGET DIR/crashes/<target>-crash-<sha1>
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.fuzz.scratch import SCRATCH_ENV

REPO = Path(__file__).resolve().parents[2]


def worker(name: str, args: list[str]) -> None:
    """Inside the child: instrument the project, then hand the target to libFuzzer."""
    import atheris

    with atheris.instrument_imports(include=["jukebox", "shadowfs"]):
        from tests.fuzz.registry import all_targets

        target = all_targets(include_canary=True)[name]

    atheris.Setup([sys.argv[0], *args], target.one_input)
    atheris.Fuzz()


@dataclass
class Result:
    name: str
    status: int
    execs: int
    seconds: float
    crash: Path | None
    log: Path


def _seed_corpus(name: str, corpus: Path) -> None:
    from tests.fuzz.registry import all_targets

    corpus.mkdir(parents=True, exist_ok=True)
    target = all_targets(include_canary=True)[name]
    for i, data in enumerate([*target.seeds(), *target.regressions]):
        (corpus / f"seed-{i}").write_bytes(data)


def _start(
    name: str, seconds: int, runs: int | None, out: Path
) -> tuple[subprocess.Popen, Path, Path]:
    corpus = out / "corpus" / name
    crashes = out / "crashes"
    crashes.mkdir(parents=True, exist_ok=True)
    _seed_corpus(name, corpus)
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    args = [
        f"-max_total_time={seconds}",
        "-timeout=10",
        "-rss_limit_mb=4096",
        "-max_len=65536",
        "-print_final_stats=1",
        f"-artifact_prefix={crashes}/{name}-",
    ]
    if runs is not None:
        args.append(f"-runs={runs}")
    cmd = [sys.executable, "-m", "tests.fuzz", "--worker", name, *args, str(corpus)]
    scratch = Path(tempfile.mkdtemp(prefix="jukebox-fuzz-"))  # short: sockets live in it
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), SCRATCH_ENV: str(scratch)},
    )
    return proc, log, scratch


def _result(name: str, status: int, seconds: float, log: Path) -> Result:
    text = log.read_text(errors="replace")
    execs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", text)
    crash = re.findall(r"Test unit written to (\S+)", text)
    return Result(
        name,
        status,
        int(execs[-1]) if execs else 0,
        seconds,
        Path(crash[-1]) if crash else None,
        log,
    )


def run(names: list[str], seconds: int, jobs: int, runs: int | None, out: Path) -> list[Result]:
    each = max(5, seconds * jobs // max(1, len(names)))
    pending = list(names)
    active: dict[str, tuple[subprocess.Popen, Path, Path, float]] = {}
    results: list[Result] = []
    while pending or active:
        while pending and len(active) < jobs:
            name = pending.pop(0)
            proc, log, scratch = _start(name, each, runs, out)
            active[name] = (proc, log, scratch, time.monotonic())
        for name, (proc, log, scratch, started) in list(active.items()):
            if proc.poll() is not None:
                del active[name]
                shutil.rmtree(scratch, ignore_errors=True)
                results.append(_result(name, proc.returncode, time.monotonic() - started, log))
        time.sleep(0.1)
    return results


def _default_out() -> Path:
    if os.environ.get("JUKEBOX_FUZZ_OUT"):
        return Path(os.environ["JUKEBOX_FUZZ_OUT"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "jukebox" / "fuzz"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2:])
        return 0
    from tests.fuzz.registry import all_targets

    parser = argparse.ArgumentParser(
        prog="python -m tests.fuzz", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--seconds", type=int, default=int(os.environ.get("JUKEBOX_FUZZ_SECONDS", "60"))
    )
    parser.add_argument("--only", default="", help="comma-separated target names")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--runs", type=int, default=None, help="stop each target after N inputs")
    parser.add_argument("--out", type=Path, default=_default_out())
    opts = parser.parse_args(argv)
    known = all_targets(include_canary=True)
    names = [n for n in opts.only.split(",") if n] or [n for n in known if n != "canary"]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(known)}")
    out = opts.out.resolve()
    results = run(names, opts.seconds, max(1, opts.jobs), opts.runs, out)
    failed = [r for r in results if r.status != 0]
    for r in sorted(results, key=lambda r: r.name):
        verdict = "ok" if r.status == 0 else f"BROKE (exit {r.status})"
        print(
            f"{r.name:12} {verdict:16} {r.execs:>10} inputs in {r.seconds:6.1f} s"
            + (f"  input: {r.crash}" if r.crash else "")
            + ("" if r.status == 0 else f"  log: {r.log}")
        )
    print(
        f"{len(results) - len(failed)} of {len(results)} targets held; "
        f"{sum(r.execs for r in results)} inputs in all"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
