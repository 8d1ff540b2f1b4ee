"""What the booth's isolation costs: `jukebox booth run -- true` and fs workloads inside a booth,
with every protection on, side by side with the protections that have a switch turned off.

The switch is an image: the default `host` image plus `[seccomp] enabled = false` and
`[cgroup] enabled = false` (the system-call filter and the pids/memory cgroup). A version whose
images have no such keys gets a row saying so. The other protections (private /dev, IPC and UTS
namespaces, the cut capability set, private state) have no switch: to compare with a version
before them, point `JUKEBOX_BENCH_BASELINE` at that version's `jukebox` executable (an install of
an older commit in its own venv) and its rows run interleaved with the others.

`booth run -- true` is timed as a whole process, from launch to exit (auto commit of no
changes); its `min_us` (the least disturbed of the runs) is what bench.goals compares, since on
a shared machine the median moves by hundreds of milliseconds from one run to the next.

The fs rows run the fs suite's own Python workloads (`python -m bench.fs_workloads child`) as
the agent; they time their own loop, so booth start-up is excluded and what is left is the cost
of the sandbox on every system call (the seccomp filter runs on each) and of the layer. The
agent then exits 3, so the booth rolls its writes back and the tree stays as it was.

Every row also gives `cpu_s`: the CPU seconds of the whole booth (supervisor, FUSE threads, shim
and agent), which a loaded machine disturbs far less than the wall-clock figures.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import median, percentile

GROUP = "isolation"
JUKEBOX = str(Path(sys.executable).parent / "jukebox")
REPO = Path(__file__).resolve().parent.parent
BASELINE_ENV = "JUKEBOX_BENCH_BASELINE"
STARTUP_CASE = "booth run -- true (whole command)"
ALL_ON = "every protection"
SWITCHED_OFF = "seccomp + cgroup off"
BASELINE = "previous version"
SWITCH_IMAGE = """
[seccomp]
enabled = false

[cgroup]
enabled = false
"""
# (system, jukebox executable, extra `booth run` options)
Config = tuple[str, str, list[str]]
ROLLED_BACK = 3  # the fs agents' exit status: the booth discards their writes
# (id, what, agent shell command run in the tree; prints its own timed seconds last)
# PYTHONPATH only for the agent: a baseline jukebox must not import this checkout.
FS_WORKLOADS = (
    ("create", "create {n:,} small files",
     "echo {n} | PYTHONPATH={repo} {py} -m bench.fs_workloads child create ."),
    ("seqwrite", "{mb} MiB sequential write + fsync",
     "echo {mb} | PYTHONPATH={repo} {py} -m bench.fs_workloads child seqwrite ."),
)  # fmt: skip


def _switch_image(work: Path) -> tuple[Path | None, str]:
    """The default image with the switchable protections off, or None and why not."""
    from jukebox.booth.images import IMAGES_DIR, load_image
    from jukebox.errors import UsageError

    path = work / "switched-off.toml"
    path.write_text((IMAGES_DIR / "host.toml").read_text() + SWITCH_IMAGE)
    try:
        load_image(str(path))
    except UsageError as error:
        return None, f"no switch in this version ({error})"
    return path, ""


def _configs(work: Path) -> tuple[list[Config], list[dict[str, Any]]]:
    """(system, jukebox executable, extra `booth run` options) per configuration, and a note
    for each configuration that cannot run here."""
    configs = [(ALL_ON, JUKEBOX, [])]
    missing = []
    image, why = _switch_image(work)
    if image is not None:
        configs.append((SWITCHED_OFF, JUKEBOX, ["--image", str(image)]))
    else:
        missing.append({"group": GROUP, "case": "all", "system": SWITCHED_OFF, "note": why})
    baseline = os.environ.get(BASELINE_ENV)
    if baseline:
        configs.append((BASELINE, baseline, []))
    return configs, missing


def _booth(config: Config, tree: Path, tapes: Path, *rest: str) -> list[str]:
    system, jukebox, opts = config
    # A tape dir per configuration: another version may not read this one's booth records.
    own = tapes / "".join(c if c.isalnum() else "-" for c in system)
    return [jukebox, "booth", "run", "--tree", str(tree), "--tape-dir", str(own), *opts, *rest]


def _run(argv: list[str], ok: tuple[int, ...] = (0,)) -> tuple[str, float]:
    """The command's stdout, and the CPU seconds (user + system) it and every descendant it
    waited for used: the supervisor, its FUSE threads, the shim and the agent. On a loaded
    machine this moves far less than wall time does."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in ok:
        raise RuntimeError(f"{argv[:3]} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.stdout, cpu


def _row(case: str, system: str, samples: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "group": GROUP,
        "case": case,
        "system": system,
        "min_us": min(samples),
        "p50_us": percentile(samples, 50),
        "p99_us": percentile(samples, 99),
        "mean_us": sum(samples) / len(samples),
        "n": len(samples),
        **extra,
    }


def _startup_rows(configs: list[Config], tree: Path, tapes: Path, runs: int) -> list[dict]:
    samples: dict[str, list[float]] = {config[0]: [] for config in configs}
    cpu: dict[str, list[float]] = {config[0]: [] for config in configs}
    for _ in range(runs):  # interleaved, so drift hits every configuration alike
        for config in configs:
            t0 = time.perf_counter()
            _, used = _run(_booth(config, tree, tapes, "--", "true"))
            samples[config[0]].append((time.perf_counter() - t0) * 1e6)
            cpu[config[0]].append(used)
    now = median(samples[ALL_ON])
    rows = []
    for system, jukebox, _ in configs:
        note = "" if system == ALL_ON else (
            f"every protection: {(now - median(samples[system])) / 1e3:+.1f} ms over this"
        )
        if system == BASELINE:
            note = f"{jukebox}; {note}"
        rows.append(_row(STARTUP_CASE, system, samples[system], cpu_s=median(cpu[system]),
                         note=note))  # fmt: skip
    return rows


def _fs_rows(configs: list[Config], tree: Path, tapes: Path, runs: int, quick: bool) -> list[dict]:
    sizes = {"n": 500 if quick else 2000, "mb": 16 if quick else 64}
    rows = []
    for fs in ("fuse", "overlay"):
        for wid, what, command in FS_WORKLOADS:
            agent = f"{command.format(py=sys.executable, repo=REPO, **sizes)}; exit {ROLLED_BACK}"
            seconds: dict[str, list[float]] = {config[0]: [] for config in configs}
            cpu: dict[str, list[float]] = {config[0]: [] for config in configs}
            for _ in range(runs):
                for config in configs:
                    argv = _booth(config, tree, tapes, "--fs", fs, "--", "sh", "-c", agent)
                    out, used = _run(argv, ok=(ROLLED_BACK,))
                    seconds[config[0]].append(float(out.strip().splitlines()[-1]))
                    cpu[config[0]].append(used)
            rows += [
                {"group": GROUP, "case": f"{what.format(**sizes)}, --fs {fs}", "system": system,
                 "seconds": median(samples), "cpu_s": median(cpu[system]), "n": len(samples),
                 "workload": wid}
                for system, samples in seconds.items()
            ]  # fmt: skip
    return rows


def run(quick: bool = False) -> list[dict]:
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return [{"group": GROUP, "case": "all", "system": "jukebox booth",
                 "note": "skipped: /dev/fuse not usable by this user"}]  # fmt: skip
    # Not under /tmp: the booth's /tmp is private, and the tree must be the same inside.
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="jukebox-bench-isolation-"))
    try:
        configs, missing = _configs(work)
        tree, tapes = work / "tree", work / "tapes"
        tree.mkdir()
        for i in range(100):
            (tree / f"file{i}.txt").write_text(f"content {i}\n" * 20)
        return [
            *_startup_rows(configs, tree, tapes, 3 if quick else 10),
            *_fs_rows(configs, tree, tapes, 1 if quick else 3, quick),
            *missing,
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
