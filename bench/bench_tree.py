"""Merkle trees: build a 1,000-file directory cold and with `previous`, diff, materialize.

Native baselines sit beside the shadowfs rows: reading every file (what a cold build cannot avoid)
and `shutil.copytree` (what materialize competes with).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import summarize_us
from shadowfs import tree
from shadowfs.store import Store

FILES = 1_000
PER_DIR = 50
OLD_NS = 1_600_000_000_000_000_000  # settled mtimes, outside the racy window


def _make_source(root: Path) -> list[Path]:
    """1,000 small source-like files in 20 directories, with old mtimes so `previous` applies."""
    files = []
    for i in range(FILES):
        d = root / f"pkg{i // PER_DIR:02d}"
        d.mkdir(parents=True, exist_ok=True)
        f = d / f"module_{i:04d}.py"
        f.write_bytes(b"def f_%d(x):\n    return x + %d\n" % (i, i) * (8 + i % 40))
        files.append(f)
    for dirpath, _dirs, names in os.walk(root, topdown=False):
        for name in names:
            os.utime(os.path.join(dirpath, name), ns=(OLD_NS, OLD_NS))
        os.utime(dirpath, ns=(OLD_NS, OLD_NS))
    return files


def _timed(n: int, setup: Callable[[], Any], fn: Callable[[Any], object]) -> list[float]:
    """µs per call of fn(setup()), with setup outside the clock; one untimed warm-up."""
    fn(setup())
    out = []
    for _ in range(n):
        arg = setup()
        t0 = time.perf_counter_ns()
        fn(arg)
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def _row(case: str, system: str, samples: list[float], note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"group": "tree", "case": case, "system": system, **summarize_us(samples)}
    if note:
        row["note"] = note
    return row


def run(quick: bool = False) -> list[dict]:
    n = 3 if quick else 15
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-tree-") as tmp:
        base = Path(tmp)
        src = base / "src"
        files = _make_source(src)
        counter = iter(range(1_000_000))

        def fresh_store() -> Store:
            tree.clear_cache()
            return Store.open(base / f"store-{next(counter)}", create=True)

        def cold(store: Store) -> None:
            tree.build_tree(store, src)
            store.flush()
            store.close()

        rows.append(
            _row(
                "build 1,000 files, cold",
                "shadowfs",
                _timed(n, fresh_store, cold),
                "new store each run; includes flush",
            )
        )

        def read_all(_: None) -> None:
            for f in files:
                with open(f, "rb") as fh:
                    fh.read()

        rows.append(
            _row(
                "build 1,000 files, cold",
                "native read of every file",
                _timed(n, lambda: None, read_all),
            )
        )

        store = Store.open(base / "store", create=True)
        # A file changed (ctime) within RACY_NS before a build is re-read by the next one: a tree
        # written seconds ago is not what an incremental build meets, so let the source age.
        newest = max(os.stat(f).st_ctime_ns for f in files)
        time.sleep(max(0.0, (newest + tree.RACY_NS - time.time_ns()) / 1e9 + 0.05))
        started = time.time_ns()
        known: dict[bytes, tree.FileIdentity] = {}
        first = tree.build_tree(store, src, seen=known)
        store.flush()

        def incremental(_: None) -> None:
            tree.build_tree(store, src, previous=first, previous_started_ns=started, known=known)
            store.flush()

        rows.append(
            _row(
                "build 1,000 files, with previous",
                "shadowfs",
                _timed(n, tree.clear_cache, incremental),
                "stat only, inode and ctime checked; tree cache cleared before each run",
            )
        )

        for f in files[::100]:
            f.write_bytes(f.read_bytes() + b"# changed\n")
        second = tree.build_tree(store, src, previous=first, previous_started_ns=started)
        store.flush()
        assert len(tree.diff_trees(store, first, second)) == 10

        rows.append(
            _row(
                "diff, 10 of 1,000 files changed",
                "shadowfs",
                _timed(n * 10, tree.clear_cache, lambda _: tree.diff_trees(store, first, second)),
                "trees read from the store",
            )
        )
        rows.append(
            _row(
                "diff, 10 of 1,000 files changed, cached",
                "shadowfs",
                _timed(n * 10, lambda: None, lambda _: tree.diff_trees(store, first, second)),
            )
        )

        def fresh_dest() -> Path:
            dest = base / "dest"
            if dest.exists():
                shutil.rmtree(dest)
            return dest

        rows.append(
            _row(
                "materialize 1,000 files",
                "shadowfs",
                _timed(n, fresh_dest, lambda d: tree.materialize(store, second, d)),
            )
        )
        rows.append(
            _row(
                "materialize 1,000 files",
                "native shutil.copytree",
                _timed(n, fresh_dest, lambda d: shutil.copytree(src, d, symlinks=True)),
            )
        )
        store.close()
    return rows
