"""shadowfs-fuse against fuse-overlayfs when both cores are busy with other work.

A booth's FUSE server is Python threads in the supervisor; fuse-overlayfs is C. On an idle
machine the booth is faster on agent workloads (docs/benchmarks.md, the `fs` group); when every
core is busy, each FUSE request waits for the scheduler, and more so for a process that needs
several wake-ups (and the GIL) per request. This group runs a subset of the fs suite's
workloads (bench.fs_workloads: the same fixtures, mounts and timing, the systems interleaved)
three times, one condition after the other: as the machine is, and with a CPU hog per core
started by the bench itself (a busy loop each, at normal priority, stopped after), first in the
bench's own session, then each in a session of its own. Rows carry the ratio to fuse-overlayfs in
the same condition and the load average seen; the geometric mean row of the second condition is
the figure issue 33 judges (at most 1.0 loaded; bench.goals). `--loaded-workloads` and
`--loaded-conditions` (quiet, hogged, apart) run a subset, for a quicker look at one row.

Why the third condition: with autogroup scheduling (Linux's default where processes are not put
in cgroups) the kernel shares the CPU between sessions first. fuse-overlayfs daemonizes into a
session of its own; the booth's server is threads in the bench's process, in one session with
the busy loops of the second condition and the workload. Other work on a real machine runs in
other sessions (or cgroups), as the third condition's busy loops do.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from bench import backends as bk
from bench import fs_workloads as fw
from bench import scratch_fs
from bench.harness import fmt

GROUP = "loaded"
WORKLOADS = ("untar", "walk_warm", "grep", "create", "edit", "rm_untarred", "git_status")
SYSTEMS = [bk.NATIVE, bk.FUSE_OVERLAYFS, bk.SHADOWFS_FUSE]
QUIET = "as the machine is"
HOGGED = "a busy loop per core"
APART = "a busy loop per core, each in a session of its own"
CONDITIONS = (QUIET, HOGGED, APART)
# What --loaded-conditions names each condition.
CONDITION_NAMES = {"quiet": QUIET, "hogged": HOGGED, "apart": APART}
HOG = "while True: pass"


@contextlib.contextmanager
def cpu_hog(n: int, apart: bool = False) -> Iterator[None]:
    """`n` busy loops, one per core, for the duration; ``apart``: each in a new session."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", HOG], start_new_session=apart) for _ in range(n)
    ]
    try:
        yield
    finally:
        for proc in hogs:
            proc.kill()
        for proc in hogs:
            proc.wait()


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def check_options(
    workloads: Sequence[str] | None = None, conditions: Sequence[str] | None = None
) -> None:
    """Raise ValueError naming what is unknown, before anything runs."""
    known = [w.id for w in fw.make_workloads(fw.Sizes.for_mode(True))]
    unknown = [w for w in workloads or () if w not in known]
    if unknown:
        raise ValueError(
            f"unknown loaded workload(s) {', '.join(unknown)}; choose from {', '.join(known)}."
        )
    unknown = [c for c in conditions or () if c not in CONDITION_NAMES]
    if unknown:
        raise ValueError(
            f"unknown loaded condition(s) {', '.join(unknown)}; "
            f"choose from {', '.join(CONDITION_NAMES)}."
        )


def run(
    quick: bool = False,
    workloads: Sequence[str] | None = None,
    conditions: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Rows per condition, workload and system; `workloads` and `conditions` (names of
    CONDITION_NAMES) run a subset, in the group's order."""
    check_options(workloads, conditions)
    if os.geteuid() != 0:
        return [{"group": GROUP, "case": "all", "system": "-", "note": "skipped: needs root"}]
    sizes = fw.Sizes.for_mode(quick)
    fx = fw.Fixtures(sizes)
    every = {w.id: w for w in fw.make_workloads(sizes)}
    ids = list(workloads) if workloads else list(WORKLOADS[:3] if quick else WORKLOADS)
    chosen = [every[w] for w in ids]
    wanted = [CONDITION_NAMES[c] for c in conditions] if conditions else list(CONDITIONS)
    runs = 1 if quick else 3
    cores = len(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    with scratch_fs.place(scratch_fs.TMP) as where:
        for condition in (c for c in CONDITIONS if c in wanted):
            before = _load()
            busy = condition != QUIET
            hog = cpu_hog(cores, condition == APART) if busy else contextlib.nullcontext()
            with hog:
                got = fw._run_on(where, chosen, SYSTEMS, fx, runs)
            load = f"load average {before} before, {_load()} after"
            hogs = cores if busy else 0
            for row in got:
                row.update(group=GROUP, condition=condition, load=load, hogs=hogs)
            rows += got
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """Seconds per workload and system in each condition, and shadowfs-fuse over
    fuse-overlayfs."""
    out = ["Median of the runs; lower is better. Ratio: shadowfs-fuse / fuse-overlayfs, "
           "same condition.", ""]  # fmt: skip
    for condition in CONDITIONS:
        mine = [r for r in rows if r.get("condition") == condition]
        if not mine:
            continue
        out += [f"**{condition}** ({mine[0].get('load', '')})", ""]
        out += [f"| workload | {' | '.join(SYSTEMS)} | ratio |", "|---|" + "---:|" * 4]
        cases = dict.fromkeys(r["case"] for r in mine if r.get("workload") != "geomean")
        for case in cases:
            cells = []
            for system in SYSTEMS:
                row = next((r for r in mine if r["case"] == case and r["system"] == system), {})
                cells.append(fmt(row["seconds"]) if "seconds" in row else "—")
            fuse = next((r for r in mine if r["case"] == case
                         and r["system"] == bk.SHADOWFS_FUSE), {})  # fmt: skip
            ratio = fuse.get("ratio_fuse_overlayfs")
            out.append(f"| {case} | {' | '.join(cells)} | "
                       f"{fmt(ratio, 'ratio') if ratio else '—'} |")  # fmt: skip
        geo = next((r for r in mine if r.get("workload") == "geomean"
                    and r["system"] == bk.SHADOWFS_FUSE), {})  # fmt: skip
        if "ratio_fuse_overlayfs" in geo:
            out.append(
                f"| geometric mean | | | | **{fmt(geo['ratio_fuse_overlayfs'], 'ratio')}** |"
            )
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    for r in run(quick="--quick" in sys.argv):
        print(r)
