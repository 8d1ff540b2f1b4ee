"""What a scratch limit costs a FUSE booth: the same writes through a mount, without and with
`Layer(scratch_limit=...)`, interleaved run by run (this VM's speed drifts between runs).

The limit is a running total checked on each write, copy-up and truncate, so the figure to watch
is the ratio: 1.00 means no cost. The limit is set far above what the workload writes, so nothing
is refused and both sides do the same work.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

GROUP = "scratch_limit"
SMALL_FILES = 2_000
BIG_MIB = 100
MIB = 1 << 20
FAR_ABOVE = 1 << 40


def _one_run(limit: int | None) -> tuple[float, float]:
    """Seconds to create the small files, then to write and fsync the big one."""
    from shadowfs.layer import Layer
    from shadowfs.mountctl import mounted
    from shadowfs.store import Store

    scratch = Path(tempfile.mkdtemp(prefix="jukebox-bench-limit-"))
    try:
        base, mnt = scratch / "base", scratch / "mnt"
        base.mkdir()
        mnt.mkdir()
        with Store.open(scratch / "store", create=True) as store:
            layer = Layer(base, store, scratch / "scratch", scratch_limit=limit)
            try:
                with mounted(layer, mnt):
                    t0 = time.perf_counter()
                    for i in range(SMALL_FILES):
                        with open(mnt / f"f{i}", "wb") as f:
                            f.write(b"x" * 1000)
                    t1 = time.perf_counter()
                    chunk = b"y" * MIB
                    with open(mnt / "big", "wb") as f:
                        for _ in range(BIG_MIB):
                            f.write(chunk)
                        os.fsync(f.fileno())
                    t2 = time.perf_counter()
            finally:
                layer.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return t1 - t0, t2 - t1


def run(quick: bool = False) -> list[dict[str, Any]]:
    rounds = 2 if quick else 5
    runs: dict[str, list[tuple[float, float]]] = {"none": [], "limit": []}
    for _ in range(rounds):
        runs["none"].append(_one_run(None))
        runs["limit"].append(_one_run(FAR_ABOVE))
    rows = []
    cases = (f"create {SMALL_FILES:,} small files", f"{BIG_MIB} MiB sequential write + fsync")
    for i, case in enumerate(cases):
        without = statistics.median(r[i] for r in runs["none"])
        with_limit = statistics.median(r[i] for r in runs["limit"])
        for system, seconds in (("shadowfs-fuse", without),
                                ("shadowfs-fuse, scratch limit", with_limit)):
            rows.append({
                "group": GROUP,
                "case": case,
                "system": system,
                "seconds": seconds,
                "ratio": seconds / without,
                "note": f"median of {rounds} interleaved runs; ratio to no limit",
            })
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(row)
