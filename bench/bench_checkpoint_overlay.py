"""Checkpoint and rollback on the kernel OverlayFS backend (shadowfs-overlay).

A step changes 1, 10 or 100 small files through the mount (appends, so each is copied up), then
`snapshot()` is timed; rows match the git baseline on `files_changed` and `repo_files`. A
snapshot walks the upper directory, so its cost follows everything changed since the booth
started, not the size of the base tree; files unchanged since the previous snapshot are trusted
by stat. Rollback rows time `restore()` to the checkpoint before the last step (a /proc scan for
the mount's users, the upper rewrite, an MS_REMOUNT). Needs root.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.fs_workloads import cached, write_small_tree
from bench.harness import summarize_us
from shadowfs.overlay import OverlayLayer
from shadowfs.store import Store

CHANGED = (1, 10, 100)
SYSTEM = "shadowfs-overlay"


def _change(mnt: Path, paths: list[str], k: int, round_: int) -> None:
    for i in range(k):
        rel = paths[(round_ * 7919 + i * 104729) % len(paths)]
        with open(mnt / rel, "a") as f:
            f.write(f"# round {round_} edit {i}\n")


def bench_tree(n_files: int, reps: int) -> list[dict[str, Any]]:
    lower = cached(f"small-tree-{n_files}", lambda tmp: write_small_tree(tmp, n_files))
    paths = sorted(str(p.relative_to(lower)) for p in lower.rglob("*.py"))
    scratch = Path(tempfile.mkdtemp(prefix="jukebox-bench-overlay-"))
    rows: list[dict[str, Any]] = []
    try:
        mnt = scratch / "mnt"
        mnt.mkdir()
        with (
            Store.open(scratch / "store") as store,
            OverlayLayer(lower, store, scratch / "booth").mounted(mnt) as layer,
        ):
            round_ = 0
            for k in CHANGED:
                snaps: list[float] = []
                rollbacks: list[float] = []
                hashed: list[int] = []
                for rep in range(reps + 1):  # the first round warms caches; dropped
                    round_ += 1
                    before = layer.snapshot()
                    _change(mnt, paths, k, round_)
                    t0 = time.perf_counter_ns()
                    layer.snapshot()
                    t1 = time.perf_counter_ns()
                    if rep:
                        snaps.append((t1 - t0) / 1000.0)
                        hashed.append(layer.snapshot_stats.hashed)
                    if rep % 4 == 1:  # rollback, then redo the step so the tree keeps growing
                        t0 = time.perf_counter_ns()
                        layer.restore(before)
                        rollbacks.append((time.perf_counter_ns() - t0) / 1000.0)
                        _change(mnt, paths, k, round_)
                rows.append({
                    "group": "checkpoint",
                    "case": f"snapshot after {k} changed files, {n_files:,}-file tree",
                    "system": SYSTEM,
                    **summarize_us(snaps),
                    "files_changed": k,
                    "repo_files": n_files,
                    "note": "files read per snapshot (median): "
                            f"{sorted(hashed)[len(hashed) // 2]}",
                })
                rows.append({
                    "group": "checkpoint",
                    "case": f"rollback to the previous checkpoint, {k} changed files, "
                            f"{n_files:,}-file tree",
                    "system": SYSTEM,
                    **summarize_us(rollbacks),
                    "files_changed": k,
                    "repo_files": n_files,
                    "note": "users frozen, upper rewritten, MS_REMOUNT",
                })
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def run(quick: bool = False) -> list[dict[str, Any]]:
    if os.geteuid() != 0:
        return [{"group": "checkpoint", "case": "snapshot on kernel overlayfs", "system": SYSTEM,
                 "note": "skipped: kernel overlay mounts need root"}]
    rows = bench_tree(1_000, reps=10 if quick else 40)
    if not quick:
        t0 = time.perf_counter()
        rows += bench_tree(100_000, reps=20)
        print(f"bench: checkpoint_overlay 100k tree {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    return rows
