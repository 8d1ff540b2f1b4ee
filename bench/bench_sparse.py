"""Sparse files: hashing one (what every snapshot and base-tree build does) and committing one.

An agent's `truncate -s 2G` makes a file of 2 GiB that holds no block. `Store.put_file` finds
its holes with SEEK_DATA and takes the id of a chunk of zeros without reading them; the commit
seeks over whole chunks of zeros, so the file stays sparse in the real tree. The baseline row
reads and hashes every byte, as put_file did before (the ids are the same either way).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from blake3 import blake3

from bench.harness import summarize_us
from shadowfs import tree
from shadowfs.commit import apply
from shadowfs.store import CHUNK_SIZE, Store

GiB = 1 << 30


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(size // 2)
        f.write(b"one line of data in the middle\n")


def _read_and_hash(path: Path) -> None:
    h = blake3()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            h.update(chunk)


def _us(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def run(quick: bool = False) -> list[dict]:
    size = GiB // 4 if quick else 2 * GiB
    n = 1 if quick else 3
    label = f"{size // (1 << 20):,} MiB" if size < GiB else f"{size // GiB} GiB"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-sparse-") as tmp:
        base = Path(tmp)
        src = base / "src"
        src.mkdir()
        _sparse(src / "big.bin", size)
        with Store.open(base / "store", create=True) as store:
            case = f"hash a {label} sparse file (31 B of data)"
            rows.append({
                "case": case, "system": "Store.put_file", **summarize_us(
                    _us(lambda: store.put_file(src / "big.bin"), n)),
                "note": "holes found with SEEK_DATA, not read",
            })  # fmt: skip
            rows.append({
                "case": case, "system": "read + BLAKE3 every byte", **summarize_us(
                    _us(lambda: _read_and_hash(src / "big.bin"), n)),
                "note": "what put_file cost before",
            })  # fmt: skip
            (base / "nothing").mkdir()
            empty, full = tree.build_tree(store, base / "nothing"), tree.build_tree(store, src)
            samples, disk = [], []
            for i in range(n):
                target = base / f"target{i}"
                target.mkdir()
                t0 = time.perf_counter_ns()
                apply(store, target, empty, full, journal_dir=base / f"journal{i}")
                samples.append((time.perf_counter_ns() - t0) / 1000.0)
                disk.append(os.stat(target / "big.bin").st_blocks * 512)
            rows.append({
                "case": f"commit a {label} sparse file", "system": "shadowfs commit",
                **summarize_us(samples), "disk_bytes": max(disk),
                "note": f"{max(disk) // 1024:,} KiB of disk after, for {label} of content",
            })  # fmt: skip
    return rows
