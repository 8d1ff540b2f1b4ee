"""Commit: applying 1,000 changed small files to a real tree against `cp` plus fsync of the same.

`shadowfs.commit.apply` does more than the copy: it hashes every touched file to prove nothing
changed underneath, stages the new contents beside their targets, writes and fsyncs a redo
journal, renames into place and fsyncs every touched directory. The baseline is one `cp -r` of
the changed files over the tree followed by an fsync of each file and directory, which is
durable but neither atomic nor checked. The ratio is time over the baseline's. The commit issues
its staging fsyncs concurrently (the file system folds them into shared journal commits), so a
third row gives the baseline the same advantage.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shadowfs.commit import apply
from shadowfs.oid import ObjectId
from shadowfs.store import Store
from shadowfs.tree import build_tree, materialize

FILES = 1_000
DIRS = 10
CASE = f"commit {FILES:,} changed files"


def _write_tree(root: Path, version: int) -> None:
    rng = random.Random(11)
    for i in range(FILES):
        d = root / f"pkg{i % DIRS}"
        d.mkdir(parents=True, exist_ok=True)
        line = b"def handler_%d(request):  # v%d\n    return respond(request)\n" % (i, version)
        (d / f"mod{i}.py").write_bytes(line * rng.randint(10, 100))


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path, threads: int) -> None:
    paths = []
    for dirpath, _, names in os.walk(root):
        paths.extend(os.path.join(dirpath, name) for name in names)
        paths.append(dirpath)
    if threads == 1:
        for p in paths:
            _fsync_path(p)
        return
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(_fsync_path, paths):
            pass


def _copy(store: Store, base: ObjectId, src: Path, target: Path, threads: int) -> float:
    materialize(store, base, target)
    os.sync()  # start each run with nothing dirty in the page cache
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", "--", f"{src}/.", str(target)], check=True)
    _fsync_tree(target, threads)
    return time.perf_counter() - t0


def run(quick: bool = False) -> list[dict[str, Any]]:
    rounds = 2 if quick else 7
    commit_s: list[float] = []
    copy_s: list[float] = []
    copy_par_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-commit-") as tmp_name:
        tmp = Path(tmp_name)
        with Store.open(tmp / "store", create=True) as store:
            _write_tree(tmp / "old", 1)
            _write_tree(tmp / "new", 2)
            base = build_tree(store, tmp / "old")
            new = build_tree(store, tmp / "new")
            store.flush()
            for i in range(rounds):
                target = tmp / f"commit-{i}"
                materialize(store, base, target)
                os.sync()
                t0 = time.perf_counter()
                apply(store, target, base, new, journal_dir=tmp / f"journal-{i}")
                commit_s.append(time.perf_counter() - t0)

                copy_s.append(_copy(store, base, tmp / "new", tmp / f"copy-{i}", 1))
                copy_par_s.append(_copy(store, base, tmp / "new", tmp / f"copy-par-{i}", 16))
    commit_t = statistics.median(commit_s)
    copy_t = statistics.median(copy_s)
    copy_par_t = statistics.median(copy_par_s)
    return [
        {
            "group": "commit",
            "case": CASE,
            "system": "shadowfs.commit",
            "seconds": commit_t,
            "ratio": commit_t / copy_t,
            "note": "conflict check, staging, redo journal, renames, dir fsyncs; atomic",
        },
        {
            "group": "commit",
            "case": CASE,
            "system": "cp + fsync",
            "seconds": copy_t,
            "ratio": 1.0,
            "note": "cp -r of the changed files, then fsync of each file and directory",
        },
        {
            "group": "commit",
            "case": CASE,
            "system": "cp + fsync, 16 threads",
            "seconds": copy_par_t,
            "ratio": copy_par_t / copy_t,
            "note": "the same fsyncs issued concurrently, as the commit's staging does",
        },
    ]


if __name__ == "__main__":
    for row in run(quick=True):
        print(row)
