"""Tapes: load + verify a 50-frame tape in process, and append one frame.

The 50-frame tape mimics a short agent run: LLM turns whose prompts went to the store, tool calls,
file-system frames with blob refs, checkpoints with trees, a verify, a commit and an exit. The
native row beside the append rows is a plain `write` + `fdatasync` of the same number of bytes:
the floor any durable append pays.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import summarize_us
from jukebox.tape.tape import Tape, TapeWriter
from shadowfs.store import Store

FRAMES = 50
LARGE_FRAMES = 10_000


def build_tape(path: Path, store: Store, frames: int = FRAMES) -> None:
    """A realistic run of `frames` frames (fsync off: only the reading side is timed here)."""
    t = 1_767_225_600_000_000_000
    prompt = "You are a coding agent working in /work/repo. Keep changes small. " * 80
    with TapeWriter.create(path, store, "bench-tape", fsync=False) as w:
        w.append("run_start", {"name": "bench-agent", "argv": ["python", "agent.py"]}, time_ns=t)
        i = 1
        while w.count < frames - 3:
            step = i % 5
            t += 1_000_000
            if step == 1:
                w.append(
                    "llm_turn",
                    {
                        "model": "gpt-4o-mini",
                        "request": {"messages": [{"role": "system", "content": prompt},
                                                 {"role": "user", "content": f"step {i}"}]},
                        "response": {"content": f"Editing module_{i}.py to fix the failing test "
                                     "by handling the empty-input case first.", "finish": "stop"},
                        "tokens_in": 2000 + i,
                        "tokens_out": 40,
                        "cost_usd": 0.0003,
                        "latency_ms": 812,
                    },
                    time_ns=t,
                )
            elif step == 2:
                w.append("tool_call", {"tool": "edit_file", "args": {"path": f"module_{i}.py"},
                                       "result": "ok", "ms": 3}, time_ns=t)
            elif step == 3:
                blob = store.put("blob", b"def f(x):\n    return x + %d\n" % i)
                w.append("fs", {"ops": 1, "paths": [f"module_{i}.py"], "bytes": 30},
                         refs=[blob], time_ns=t)
            elif step == 4:
                tree = store.put("tree", b"tree %d" % i)
                w.append("checkpoint", {"label": f"step-{i}", "id": i}, tree=tree, time_ns=t)
            else:
                w.append("agent_turn", {"text": f"turn {i} done", "turn": i}, time_ns=t)
            i += 1
        w.append("verify", {"cmd": ["pytest", "-q"], "exit": 0, "ok": True}, time_ns=t + 1)
        w.append("commit", {"changes": 12}, time_ns=t + 2)
        w.append("exit", {"code": 0}, time_ns=t + 3)


def _samples(n: int, fn: Any) -> list[float]:
    fn()
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000.0)
    return out


def _row(case: str, system: str, samples: list[float], note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"group": "tape", "case": case, "system": system,
                           **summarize_us(samples)}
    if note:
        row["note"] = note
    return row


def run(quick: bool = False) -> list[dict[str, Any]]:
    n_read = 300 if quick else 3000
    n_append = 100 if quick else 1000
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-tape-") as tmp:
        root = Path(tmp)
        with Store.open(root / "store") as store:
            path = root / "run.jbx"
            build_tape(path, store)
            size = path.stat().st_size

            def load_verify() -> None:
                report = Tape.load(path).verify()
                assert report.ok

            rows.append(_row(f"load + verify, {FRAMES} frames", "jukebox",
                             _samples(n_read, load_verify),
                             f"{size} B tape; record ids, parent links, seq, Merkle roots"))
            rows.append(_row(f"load only, {FRAMES} frames", "jukebox",
                             _samples(n_read, lambda: Tape.load(path))))

            # What every reading command (log, ls, diff, mount, replay, fork) pays on a long
            # run: the hash chain checked as the tape is read (`Tape.damage`), beside the load.
            large = root / "large.jbx"
            build_tape(large, store, LARGE_FRAMES)
            large_size = large.stat().st_size
            n_large = max(5, n_read // 100)
            rows.append(_row(f"load only, {LARGE_FRAMES} frames", "jukebox",
                             _samples(n_large, lambda: Tape.load(large)),
                             f"{large_size} B tape"))

            def load_checked() -> None:
                assert Tape.load(large).damage is None

            rows.append(_row(f"load + chain check, {LARGE_FRAMES} frames", "jukebox",
                             _samples(n_large, load_checked),
                             "what every command that reads a tape pays (Tape.damage)"))

            def load_verify_store() -> None:
                report = Tape.load(path, store).verify()
                assert report.ok

            rows.append(_row(f"load + verify with objects, {FRAMES} frames", "jukebox",
                             _samples(max(50, n_read // 10), load_verify_store),
                             "also decodes every frame and reads every referenced object"))

            payload = {"tool": "edit_file", "args": {"path": "module_7.py"}, "result": "ok"}
            for fsync in (True, False):
                tape_path = root / f"append-{fsync}.jbx"
                with TapeWriter.create(tape_path, store, "append", fsync=fsync) as w:
                    w.append("run_start", {"name": "bench"})
                    samples = _samples(n_append, lambda w=w: w.append("tool_call", payload))
                    frame_bytes = (os.path.getsize(tape_path) - 16) // w.count
                label = "append a frame" + (" (fdatasync)" if fsync else " (no fsync)")
                rows.append(_row(label, "jukebox", samples, f"~{frame_bytes} B per record"))

                native = root / f"native-{fsync}.bin"
                fd = os.open(native, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                record = b"x" * frame_bytes

                def write_native(fd: int = fd, record: bytes = record, fsync: bool = fsync) -> None:
                    os.write(fd, record)
                    if fsync:
                        os.fdatasync(fd)

                try:
                    samples = _samples(n_append, write_native)
                finally:
                    os.close(fd)
                label = "write same bytes" + (" + fdatasync" if fsync else "")
                rows.append(_row(label, "native", samples))

            with TapeWriter.create(root / "refs.jbx", store, "refs") as w:
                w.append("run_start", {"name": "bench"})
                counter = iter(range(10**9))

                def append_with_blob() -> None:
                    blob = store.put("blob", b"content %d" % next(counter))
                    w.append("fs", {"ops": 1}, refs=[blob])

                rows.append(_row("put a blob + append a frame referencing it", "jukebox",
                                 _samples(max(50, n_append // 4), append_with_blob),
                                 "store flush (pack fsync + index commit) then frame fdatasync"))
    return rows


if __name__ == "__main__":
    for r in run(quick=True):
        print(f"{r['case']:<48} {r['system']:<8} p50 {r['p50_us']:9.1f} µs"
              f"  p99 {r['p99_us']:9.1f} µs")
