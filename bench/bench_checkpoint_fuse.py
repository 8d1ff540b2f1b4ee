"""Checkpoint, rollback and memory of the FUSE shadow booth (shadowfs-fuse).

A step changes 1, 10 or 100 small files through a real mount (appends, so each is copied up),
then `layer.snapshot()` is timed as a booth calls it: on a thread that is not one of the mount's
workers, through the mount handle (a syncfs and a barrier request that bring the kernel's dirty
pages into the layer, then the snapshot on the calling thread under the mount's layer lock). The
through-mount and in-process rows each come from 3 fresh processes (`IN_PROCESS_RUNS`; 1 with
--quick): p50 is the median of their p50s (`runs_p50_us`). Rows match the git
baseline on `files_changed` and `repo_files`; the git figures are measured in the same run with
`bench.bench_git_baseline.bench_repo`, and `vs_git` is git's p50 over ours (higher is better).

Snapshots are taken as a booth takes them, as group commits (`snapshot(durable=False)`): the
store's fsync and index commit run on its background thread within 50 ms (`Store.flush_soon`),
so a row times what a checkpoint waits for, not the disk. The
in-process rows time `layer.snapshot()` on an unmounted layer whose step was written through
the layer itself: the snapshot alone, without the mount's lock and syncfs.

Rollback is `layer.restore()` to the checkpoint before a step of 10 changed files, called in
process on an unmounted layer (the target), and through the mount handle (which adds the mount's
lock and the kernel cache invalidations).

Memory runs in child processes so each figure is that process's own: the serving process's RSS
after a full walk of a 100,000-file tree through the mount, and the peak RSS (ru_maxrss) above
the post-mount baseline while a big base file is copied up through the mount by a 1-byte
append, snapshotted and committed into the real tree (`shadowfs.commit.apply`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.bench_git_baseline import bench_repo as git_rows
from bench.fs_workloads import REPO_ROOT, cached, write_small_tree
from bench.harness import percentile, summarize_us

GROUP = "checkpoint"
SYSTEM = "shadowfs-fuse"
CHANGED = (1, 10, 100)
MIB = 1024 * 1024


def snapshot_case(k: int, n_files: int) -> str:
    """The row name of a through-mount checkpoint after a k-file step (bench.goals reads it)."""
    return f"snapshot after {k} changed files, {n_files:,}-file tree"


def restore_in_process_case(n_files: int) -> str:
    return (f"rollback to the previous checkpoint, 10 changed files, {n_files:,}-file tree, "
            "in process")


BIG_COPY_UP_CASE = "copy-up (1-byte append) + snapshot + commit"


def _change(mnt: Path, paths: list[str], k: int, round_: int) -> None:
    # The same step as the git baseline: k files edited in place, each differently every round.
    for i in range(k):
        rel = paths[(round_ * 7919 + i * 104729) % len(paths)]
        with open(mnt / rel, "a") as f:
            f.write(f"# round {round_} edit {i}\n")


def _tree(n_files: int) -> tuple[Path, list[str]]:
    lower = cached(f"small-tree-{n_files}", lambda tmp: write_small_tree(tmp, n_files))
    return lower, sorted(str(p.relative_to(lower)) for p in lower.rglob("*.py"))


def mount_samples(n_files: int, reps: int) -> dict[str, list[float]]:
    """µs per snapshot after a k-file step written through a real mount ("snapshot k"), and per
    rollback to the checkpoint before a 10-file step through the mount handle ("rollback 10")."""
    from shadowfs.layer import Layer
    from shadowfs.mountctl import mounted
    from shadowfs.store import Store

    lower, paths = _tree(n_files)
    scratch = Path(tempfile.mkdtemp(prefix="jukebox-bench-ckpt-fuse-"))
    samples: dict[str, list[float]] = {}
    try:
        mnt = scratch / "mnt"
        mnt.mkdir()
        with Store.open(scratch / "store", create=True) as store:
            layer = Layer(lower, store, scratch / "scratch")
            try:
                with mounted(layer, mnt):
                    round_ = 0
                    for k in CHANGED:
                        snaps = samples[f"snapshot {k}"] = []
                        for rep in range(reps + 1):  # the first round warms caches; dropped
                            round_ += 1
                            before, _ = layer.snapshot(durable=False)
                            _change(mnt, paths, k, round_)
                            t0 = time.perf_counter_ns()
                            layer.snapshot(durable=False)
                            t1 = time.perf_counter_ns()
                            if rep:
                                snaps.append((t1 - t0) / 1000.0)
                            if k == 10 and rep:
                                t0 = time.perf_counter_ns()
                                layer.restore(before)
                                samples.setdefault(f"rollback {k}", []).append(
                                    (time.perf_counter_ns() - t0) / 1000.0
                                )
            finally:
                layer.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return samples


def bench_tree(n_files: int, reps: int, git: dict[int, float], runs: int) -> list[dict[str, Any]]:
    """The through-mount rows, from ``runs`` fresh processes (see IN_PROCESS_RUNS)."""
    per_run: list[dict[str, list[float]]] = [
        _child(_SAMPLES_CHILD, "mount_samples", str(n_files), str(reps)) for _ in range(runs)
    ]
    rows: list[dict[str, Any]] = []
    for key in per_run[0]:
        what, k = key.split()[0], int(key.split()[1])
        row = {"group": GROUP, "system": SYSTEM, **_pooled([run[key] for run in per_run])}
        if what == "snapshot":
            row["case"] = snapshot_case(k, n_files)
            row["note"] = ("written via the mount; snapshot under the mount's lock; durable "
                           "within 50 ms (group commit)")
            if k in git:
                row["vs_git"] = round(git[k] / row["p50_us"], 1)
        else:
            row["case"] = (f"rollback to the previous checkpoint, {k} changed files, "
                           f"{n_files:,}-file tree, through the mount")
            row["note"] = "under the mount's lock + kernel cache invalidations"
        row["files_changed"] = k
        row["repo_files"] = n_files
        if runs > 1:
            row["note"] += f"; p50: median of {runs} fresh processes' p50s (runs_p50_us)"
        rows.append(row)
    return rows


@contextlib.contextmanager
def _unmounted_layer(n_files: int, prefix: str) -> Iterator[tuple[Any, list[str]]]:
    """A layer over the cached n-file tree with a fresh store, not mounted; and the tree's
    file paths."""
    from shadowfs.layer import Layer
    from shadowfs.store import Store

    lower, paths = _tree(n_files)
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        with Store.open(scratch / "store", create=True) as store:
            layer = Layer(lower, store, scratch / "scratch")
            try:
                yield layer, paths
            finally:
                layer.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _edit_in_process(layer: Any, paths: list[str], k: int, rep: int) -> None:
    # The same step as `_change` through the mount: k files edited, differently every round.
    for i in range(k):
        rel = paths[(rep * 7919 + i * 104729) % len(paths)]
        layer.write_file(rel, layer.read_file(rel) + f"# round {rep} edit {i}\n".encode())


def snapshot_samples(n_files: int, reps: int, k: int = 10) -> list[float]:
    """µs per `layer.snapshot` after a k-file step, on an unmounted layer."""
    samples: list[float] = []
    with _unmounted_layer(n_files, "jukebox-bench-snap-") as (layer, paths):
        for rep in range(reps + 1):
            layer.snapshot(durable=False)
            _edit_in_process(layer, paths, k, rep)
            t0 = time.perf_counter_ns()
            layer.snapshot(durable=False)
            if rep:
                samples.append((time.perf_counter_ns() - t0) / 1000.0)
    return samples


def restore_samples(n_files: int, reps: int, k: int = 10) -> list[float]:
    """µs per `layer.restore` to the checkpoint before a k-file step, on an unmounted layer."""
    samples: list[float] = []
    with _unmounted_layer(n_files, "jukebox-bench-restore-") as (layer, paths):
        for rep in range(reps + 1):
            before, _ = layer.snapshot()
            _edit_in_process(layer, paths, k, rep)
            layer.snapshot()
            t0 = time.perf_counter_ns()
            layer.restore(before)
            if rep:
                samples.append((time.perf_counter_ns() - t0) / 1000.0)
    return samples


# A fresh interpreter per run, for the through-mount and the in-process rows alike: none of the
# bench's own threads, mounts or heap. On this kind of VM a whole process sometimes runs up to
# twice as slow as the next one, so a row's p50 is the median of the runs' p50s (p99 and mean
# are over all samples).
IN_PROCESS_RUNS = 3
_SAMPLES_CHILD = (
    "import json, sys\n"
    "from bench import bench_checkpoint_fuse as b\n"
    "print(json.dumps(getattr(b, sys.argv[1])(int(sys.argv[2]), int(sys.argv[3]))))\n"
)


def _pooled(per_run: list[list[float]]) -> dict[str, Any]:
    """p99 and mean over all runs' samples; p50 the median of the runs' p50s."""
    row = summarize_us([x for run in per_run for x in run])
    row["p50_us"] = statistics.median(percentile(run, 50) for run in per_run)
    row["runs_p50_us"] = ", ".join(f"{percentile(run, 50):.0f}" for run in per_run)
    return row


def _in_children(fn: str, n_files: int, reps: int, runs: int) -> dict[str, Any]:
    return _pooled([
        _child(_SAMPLES_CHILD, fn, str(n_files), str(reps)) for _ in range(runs)  # type: ignore[misc]
    ])


def bench_snapshot_in_process(
    n_files: int, reps: int, runs: int = IN_PROCESS_RUNS
) -> dict[str, Any]:
    return {
        "group": GROUP,
        "case": f"snapshot after 10 changed files, {n_files:,}-file tree, in process",
        "system": SYSTEM,
        **_in_children("snapshot_samples", n_files, reps, runs),
        "files_changed": 10,
        "repo_files": n_files,
        "note": f"layer.snapshot on an unmounted layer; durable within 50 ms; p50: median of "
                f"{runs} fresh processes' p50s (runs_p50_us); target <= 1 ms",
    }


def bench_restore_in_process(
    n_files: int, reps: int, runs: int = IN_PROCESS_RUNS
) -> dict[str, Any]:
    return {
        "group": GROUP,
        "case": restore_in_process_case(n_files),
        "system": SYSTEM,
        **_in_children("restore_samples", n_files, reps, runs),
        "files_changed": 10,
        "repo_files": n_files,
        "note": "layer.restore on an unmounted layer, durable=True as a booth calls it; right "
                "after a snapshot there is nothing to fold, so no store flush; p50: median of "
                f"{runs} fresh processes' p50s (runs_p50_us); target <= 200 µs",
    }


# ---------------------------------------------------------------------------- memory (children)

_WALK_CHILD = r"""
import json, os, subprocess, sys
from pathlib import Path
from shadowfs.layer import Layer
from shadowfs.mountctl import mounted
from shadowfs.store import Store

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
lower, state = sys.argv[1:3]
state = Path(state)
(state / "mnt").mkdir()
with Store.open(state / "store", create=True) as store:
    layer = Layer(lower, store, state / "scratch")
    with mounted(layer, state / "mnt"):
        built = rss()
        subprocess.run(["find", str(state / "mnt"), "-printf", "%s\n"], check=True,
                       stdout=subprocess.DEVNULL)
        walked = rss()
        nodes = len(layer.inodes)
    layer.close()
print(json.dumps({"built": built, "walked": walked, "nodes": nodes}))
"""

_TREE_CHILD = r"""
import json, sys
from shadowfs.store import Store
from shadowfs.tree import build_tree
with Store.open(sys.argv[2], create=True) as store:
    tree = build_tree(store, sys.argv[1])
    store.flush()
print(json.dumps({"tree": tree.hex()}))
"""

_BIG_CHILD = r"""
import json, os, resource, sys
from pathlib import Path
from shadowfs.commit import apply
from shadowfs.layer import Layer
from shadowfs.mountctl import mounted
from shadowfs.oid import ObjectId
from shadowfs.store import Store

def reset_peak():
    # A child's ru_maxrss starts at its parent's peak; VmHWM after clear_refs is our own.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def peak():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base, state, tree_hex = sys.argv[1:4]
state = Path(state)
(state / "mnt").mkdir()
with Store.open(state / "store") as store:
    layer = Layer(base, store, state / "scratch", base_tree=ObjectId.from_hex(tree_hex))
    try:
        with mounted(layer, state / "mnt"):
            reset_peak()
            before = peak()
            with open(state / "mnt" / "big.bin", "ab") as f:  # copy-up of the whole file
                f.write(b"!")
            tree_id, _ = layer.snapshot()
        report = apply(store, base, layer.base_tree, tree_id, journal_dir=state / "journal")
        after = peak()
    finally:
        layer.close()
print(json.dumps({"before": before, "after": after, "written": report.bytes_written,
                  "size": os.stat(os.path.join(base, "big.bin")).st_size}))
"""


def _child(code: str, *args: str) -> Any:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench child failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_walk_rss(n_files: int) -> dict[str, Any]:
    lower, _ = _tree(n_files)
    state = Path(tempfile.mkdtemp(prefix="jukebox-bench-rss-"))
    try:
        got = _child(_WALK_CHILD, str(lower), str(state))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return {
        "group": GROUP,
        "case": f"serving process RSS after a full walk, {n_files:,}-file tree",
        "system": SYSTEM,
        "rss_mib": round(got["walked"] / MIB, 1),
        "repo_files": n_files,
        "note": f"{got['nodes']:,} inodes known; RSS mounted before the walk "
                f"{got['built'] / MIB:.1f} MiB",
    }


def bench_big_copy_up(size: int) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="jukebox-bench-big-"))
    try:
        base = state / "base"
        base.mkdir()
        block = os.urandom(MIB)
        with open(base / "big.bin", "wb") as f:
            for i in range(size // MIB):
                # Distinct blocks, so the store cannot shrink the file to a few references.
                f.write(i.to_bytes(8, "little") + block[8:])
        inner = state / "state"
        inner.mkdir()
        # The base tree is built in its own process: hashing the base file must not set the
        # measuring process's peak before the copy-up even starts.
        tree_hex = _child(_TREE_CHILD, str(base), str(inner / "store"))["tree"]
        t0 = time.perf_counter()
        got = _child(_BIG_CHILD, str(base), str(inner), tree_hex)
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(state, ignore_errors=True)
    if got["size"] != size + 1:
        raise RuntimeError(f"commit left big.bin at {got['size']} bytes, expected {size + 1}")
    extra = (got["after"] - got["before"]) / MIB
    return {
        "group": GROUP,
        "case": f"{BIG_COPY_UP_CASE} of a {size // MIB:,} MiB file",
        "system": SYSTEM,
        "seconds": round(seconds, 2),
        "rss_mib": round(extra, 1),
        "note": f"peak RSS above the mounted baseline ({got['before'] / MIB:.0f} MiB); "
                f"goal <= 64 MiB: {'met' if extra <= 64 else 'not met'}",
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    sizes = [(1_000, 5 if quick else 40)]
    if not quick:
        sizes.append((100_000, 20))
    rows: list[dict[str, Any]] = []
    for n_files, reps in sizes:
        t0 = time.perf_counter()
        git = {r["files_changed"]: r["p50_us"] for r in git_rows(n_files, 3 if quick else 5)}
        runs = 1 if quick else IN_PROCESS_RUNS
        rows += bench_tree(n_files, reps, git, runs)
        rows.append(bench_snapshot_in_process(n_files, 10 if quick else 50, runs))
        rows.append(bench_restore_in_process(n_files, 10 if quick else 50, runs))
        print(f"bench: checkpoint_fuse {n_files:,}-file tree {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    if not quick:
        rows.append(bench_walk_rss(100_000))
    rows.append(bench_big_copy_up((256 if quick else 2048) * MIB))
    return rows
