"""The store: putting 1,000 small files against plain writes with fsync, and put throughput.

The ratio in the first case is store time over native time for the same batch (below 1 means the
store is faster: one fsync per batch instead of one per file). Throughput rows time `Store.put`
(hash + zstd + append to the pack, no flush) over 64 KiB objects, with BLAKE3 alone and zstd alone
beside it; their ratio is stored bytes over raw bytes.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zstandard

from bench.harness import summarize_us
from shadowfs.oid import hash_object
from shadowfs.store import Store

FILES = 1_000
OBJECT = 64 * 1024


def _small_files() -> list[bytes]:
    rng = random.Random(7)
    out = []
    for i in range(FILES):
        line = b"def handler_%d(request):\n    return respond(request, code=%d)\n" % (i, i % 500)
        out.append(line * rng.randint(3, 120))
    return out


def _store_batch(root: Path, files: list[bytes], lat: list[float]) -> float:
    t0 = time.perf_counter()
    with Store.open(root) as store:
        for data in files:
            s = time.perf_counter_ns()
            store.put("blob", data)
            lat.append((time.perf_counter_ns() - s) / 1000.0)
        store.flush()
    return time.perf_counter() - t0


def _native_batch(root: Path, files: list[bytes], lat: list[float]) -> float:
    root.mkdir()
    t0 = time.perf_counter()
    for i, data in enumerate(files):
        s = time.perf_counter_ns()
        fd = os.open(root / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        lat.append((time.perf_counter_ns() - s) / 1000.0)
    return time.perf_counter() - t0


def _corpora(size: int) -> dict[str, bytes]:
    src = bytearray()
    stdlib = Path(os.__file__).parent
    for path in sorted(stdlib.glob("*.py")):
        src += path.read_bytes()
        if len(src) >= size:
            break
    rng = random.Random(11)
    records = [
        {"id": i, "role": rng.choice(["user", "assistant", "tool"]), "tokens": rng.randint(1, 4000),
         "text": " ".join(rng.choice(["read", "file", "patch", "test", "ok", "error"])
                          for _ in range(rng.randint(5, 40)))}
        for i in range(size // 100)
    ]
    js = json.dumps(records).encode()
    return {"source text": bytes(src[:size]), "JSON": js[:size], "random bytes": os.urandom(size)}


def _pieces(data: bytes) -> list[bytes]:
    return [data[i : i + OBJECT] for i in range(0, len(data), OBJECT)]


def _mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def run(quick: bool = False) -> list[dict]:
    rows: list[dict[str, Any]] = []
    reps = 1 if quick else 7
    files = _small_files()
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        base = Path(tmp)
        store_lat: list[float] = []
        native_lat: list[float] = []
        store_s: list[float] = []
        native_s: list[float] = []
        for r in range(reps):
            # Alternate which goes first so neither always meets a cold page cache or journal.
            order = [("s", _store_batch), ("n", _native_batch)]
            for tag, fn in order if r % 2 == 0 else order[::-1]:
                target = base / f"{tag}{r}"
                if tag == "s":
                    store_s.append(fn(target, files, store_lat))
                else:
                    native_s.append(fn(target, files, native_lat))
        s_med, n_med = statistics.median(store_s), statistics.median(native_s)
        case = f"put {FILES:,} small files + flush"
        rows.append({
            "case": case, "system": "shadowfs store", **summarize_us(store_lat),
            "seconds": s_med, "ratio": s_med / n_med,
            "note": "p50/p99 per put; seconds per batch incl. the one flush",
        })
        rows.append({
            "case": case, "system": "write + fsync per file", **summarize_us(native_lat),
            "seconds": n_med, "ratio": 1.0, "note": "p50/p99 per file",
        })

        size = (4 if quick else 32) * 1024 * 1024
        cctx = zstandard.ZstdCompressor(level=3)
        for name, data in _corpora(size).items():
            pieces = _pieces(data)
            with Store.open(base / f"tp-{name.replace(' ', '-')}") as store:
                t0 = time.perf_counter()
                for p in pieces:
                    store.put("blob", p)
                put_s = time.perf_counter() - t0
                stats = store.stats()
            t0 = time.perf_counter()
            for p in pieces:
                hash_object("blob", p)
            hash_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            packed = sum(len(cctx.compress(p)) for p in pieces)
            zstd_s = time.perf_counter() - t0
            n = len(data)
            case = f"throughput: {name}"
            rows.append({"case": case, "system": "shadowfs store put", "mb_s": _mb_s(n, put_s),
                         "ratio": stats.stored_bytes / max(1, stats.raw_bytes)})
            rows.append({"case": case, "system": "BLAKE3 alone", "mb_s": _mb_s(n, hash_s)})
            rows.append({"case": case, "system": "zstd-3 alone", "mb_s": _mb_s(n, zstd_s),
                         "ratio": packed / n})
    for row in rows:
        row["group"] = "store"
    return rows


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
