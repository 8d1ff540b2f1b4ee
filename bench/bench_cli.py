"""The CLI as a user meets it: whole processes, interpreter start included.

`jukebox replay` of a 50-frame tape must finish in at most 150 ms; `python -c pass` and
`jukebox --version` are the floor it stands on.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import summarize_us

FRAMES = 50


def record_tape(tape_dir: Path) -> None:
    from jukebox.tape.tape import TapeWriter
    from jukebox.tape.tapedir import TapeDir
    from shadowfs import tree
    from shadowfs.store import Store

    home = TapeDir(tape_dir)
    work = tape_dir.parent / "work"
    work.mkdir()
    with Store.open(home.store_path) as store:
        writer = TapeWriter.create(home.tape_path("bench"), store, "bench", fsync=False)
        writer.append("run_start", {"tape_id": "bench", "name": "bench-agent", "argv": ["agent"]})
        previous = None
        for i in range(1, FRAMES):
            if i % 10 == 0:
                (work / f"step{i}.txt").write_text(f"step {i}\n" * 20)
                previous = tree.build_tree(store, work, previous=previous)
                writer.append("checkpoint", {"id": i // 10, "label": f"step-{i}"}, tree=previous)
            else:
                writer.append(
                    "llm_turn",
                    {
                        "provider": "openai",
                        "model": "gpt-4o",
                        "tokens_in": 900 + i,
                        "tokens_out": 40,
                        "cost_usd": 0.0012,
                        "response": {"content": f"turn {i}: working on it"},
                    },
                )
        writer.close()


def time_process(argv: list[str], runs: int) -> list[float]:
    samples = []
    for i in range(runs + 1):
        start = time.perf_counter()
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        elapsed = (time.perf_counter() - start) * 1e6
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.decode().strip()}")
        if i:  # the first run warms the page cache
            samples.append(elapsed)
    return samples


def run(quick: bool = False) -> list[dict[str, Any]]:
    import compileall

    from bench.harness import REPO

    # An installed jukebox has bytecode (pip compiles it); without it every start recompiles
    # every module (PYTHONDONTWRITEBYTECODE is set on some machines), which is not the product.
    for package in ("jukebox", "shadowfs"):
        compileall.compile_dir(REPO / package, quiet=1)
    runs = 5 if quick else 30
    jukebox = str(Path(sys.executable).parent / "jukebox")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jukebox-bench-cli-") as tmp:
        tapes = Path(tmp) / "tapes"
        record_tape(tapes)
        cases = [
            ("python -c pass (floor)", [sys.executable, "-c", "pass"]),
            ("jukebox --version", [jukebox, "--version"]),
            (
                f"jukebox replay, {FRAMES}-frame tape",
                [jukebox, "replay", "--tape-dir", str(tapes), "bench"],
            ),
            (
                f"jukebox verify, {FRAMES}-frame tape",
                [jukebox, "verify", "--tape-dir", str(tapes), "bench"],
            ),
            ("jukebox ls, one tape", [jukebox, "ls", "--tape-dir", str(tapes)]),
        ]
        floor = None
        for case, argv in cases:
            stats = summarize_us(time_process(argv, runs))
            floor = floor or stats["p50_us"]
            rows.append(
                {
                    "group": "cli",
                    "case": case,
                    "system": "whole process",
                    **stats,
                    "ratio": stats["p50_us"] / floor,
                    "note": "target ≤ 150 ms" if "replay" in case else "",
                }
            )
    return rows
