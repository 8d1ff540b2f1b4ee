"""The Python API: checkpoint and rollback_to on a transaction with 10 staged files and 1,000 keys.

The transaction's root holds 50 small files; 10 more are staged through `tx.fs`, and `tx.state`
holds 1,000 keys of small dicts. Two checkpoints differ in all 10 staged files and 10 state keys.

* `rollback_to` alternates between the two checkpoints: the layer restores the 10 files (new
  nodes, the rest shared), the memory is a pointer swap, and a rollback frame is written. Target:
  p50 <= 190 us, the announced figure.
* `checkpoint` follows a step that rewrites one staged file and one state key: the changed state
  nodes and the file go to the store, the store is flushed (its fsync is the durability boundary
  of a checkpoint), and a checkpoint frame naming the tree and the state version is written.
  Target: p50 <= 1 ms.
* `fsync floor` is a plain 4 KiB write + fsync in the same directory: what any durable
  checkpoint pays there, so the rest of the checkpoint cost can be read off.

Each case runs in the system temp dir and, when /dev/shm exists, on tmpfs: a loaded disk's fsync
latency swings by milliseconds, and the tmpfs rows show the cost of the code itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import summarize_us
from jukebox.api.api import Jukebox, SandboxPolicy

FILES = 10
KEYS = 1000
BASE_FILES = 50
ROLLBACK_TARGET_US = 190.0
CHECKPOINT_TARGET_US = 1000.0


def _fsync_floor(directory: Path, n: int) -> list[float]:
    path = directory / "fsync-floor"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    out = []
    try:
        block = b"x" * 4096
        for _ in range(n):
            t0 = time.perf_counter_ns()
            os.write(fd, block)
            os.fsync(fd)
            out.append((time.perf_counter_ns() - t0) / 1000.0)
    finally:
        os.close(fd)
        path.unlink()
    return out


def _measure(where: Path, reps: int) -> dict[str, list[float]]:
    work = Path(tempfile.mkdtemp(prefix="jukebox-bench-api-", dir=where))
    try:
        root = work / "proj"
        root.mkdir()
        for i in range(BASE_FILES):
            (root / f"module_{i}.py").write_text(f"def f():\n    return {i}\n")
        jb = Jukebox(tape_dir=work / "tapes", sandbox=SandboxPolicy(root=root))
        try:
            with jb.transaction(tape_id="bench") as tx:
                tx.state.update({f"key{i}": {"step": i, "note": "seen"} for i in range(KEYS)})
                for i in range(FILES):
                    tx.fs.write(root / f"staged_{i}.txt", f"first version of file {i}\n" * 8)
                a = tx.checkpoint("a")
                for i in range(FILES):
                    tx.fs.write(root / f"staged_{i}.txt", f"second version of file {i}\n" * 8)
                    tx.state[f"key{i}"] = {"step": -i, "note": "changed"}
                b = tx.checkpoint("b")

                rollback: list[float] = []
                clock = time.perf_counter_ns
                for r in range(reps + 2):
                    target = a if r % 2 == 0 else b
                    t0 = clock()
                    tx.rollback_to(target)
                    if r >= 2:  # the first two warm the caches
                        rollback.append((clock() - t0) / 1000.0)

                checkpoint: list[float] = []
                for r in range(reps + 2):
                    tx.fs.write(root / f"staged_{r % FILES}.txt", f"step {r}\n")
                    tx.state[f"key{r % KEYS}"] = {"step": r, "note": "stepped"}
                    t0 = clock()
                    tx.checkpoint()
                    if r >= 2:
                        checkpoint.append((clock() - t0) / 1000.0)
                tx.rollback("benchmark done")
        finally:
            jb.close()
        return {
            "rollback": rollback,
            "checkpoint": checkpoint,
            "fsync": _fsync_floor(work, max(20, reps // 4)),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(quick: bool = False) -> list[dict[str, Any]]:
    reps = 60 if quick else 400
    places = [("tmp", Path(tempfile.gettempdir()))]
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        places.append(("tmpfs", Path("/dev/shm")))
    rows: list[dict[str, Any]] = []
    setup = f"{FILES} staged files over {BASE_FILES}, {KEYS:,}-key state"
    for place, directory in places:
        samples = _measure(directory, reps)
        rb = summarize_us(samples["rollback"])
        cp = summarize_us(samples["checkpoint"])
        rows.append({
            "group": "api",
            "case": f"rollback_to ({setup}) [{place}]",
            "system": "jukebox-api",
            **rb,
            "target_us": ROLLBACK_TARGET_US,
            "ok": rb["p50_us"] <= ROLLBACK_TARGET_US,
        })
        rows.append({
            "group": "api",
            "case": f"checkpoint ({setup}) [{place}]",
            "system": "jukebox-api",
            **cp,
            "target_us": CHECKPOINT_TARGET_US,
            "ok": cp["p50_us"] <= CHECKPOINT_TARGET_US,
        })
        rows.append({
            "group": "api",
            "case": f"fsync floor (4 KiB write + fsync) [{place}]",
            "system": "native",
            **summarize_us(samples["fsync"]),
        })
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(row)
