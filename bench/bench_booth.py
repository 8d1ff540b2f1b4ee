"""Booth overheads: start to the agent's first instruction, exit to verdict, and a checkpoint
requested from inside over the control socket — next to `bash -c` run directly.

The agent is `bash -c 'echo $EPOCHREALTIME'`: its first instruction stamps the wall clock, so
start latency is that stamp minus the launch time, and exit-to-verdict is the moment the
`jukebox` process ends minus the stamp (the agent exits right after it). The booths run one after
another over the same tree, so all but the first reuse the previous base tree's stat cache.

A checkpoint is acknowledged once its snapshot is in the store and its frame queued; the store's
fsync, the frame's write and the tape's fdatasync follow within 50 ms (the booth's group commit,
`jukebox.booth.GroupTape`), so the row is what the agent waits for, not the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import percentile

JUKEBOX = str(Path(sys.executable).parent / "jukebox")

CHECKPOINTS = r"""
import json, sys, time
from jukebox.control import request
n = int(sys.argv[1])
out = []
for i in range(n):
    with open("f%d" % (i % 10), "w") as f:
        f.write("x" * 100 + str(i))
    t = time.perf_counter()
    request({"op": "checkpoint"})
    out.append((time.perf_counter() - t) * 1e6)
print(json.dumps(out))
"""


def _stamped(cmd: list[str]) -> tuple[float, float]:
    """(start->first instruction, first instruction->process end), in microseconds."""
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    t1 = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}): {proc.stderr.strip()[-300:]}")
    stamp = float(proc.stdout.strip().splitlines()[-1])
    return (stamp - t0) * 1e6, (t1 - stamp) * 1e6


def _row(case: str, system: str, samples: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "group": "booth",
        "case": case,
        "system": system,
        "p50_us": percentile(samples, 50),
        "p99_us": percentile(samples, 99),
        "n": len(samples),
        **extra,
    }


def run(quick: bool = False) -> list[dict]:
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return [
            {
                "group": "booth",
                "case": "all",
                "system": "jukebox booth",
                "note": "skipped: /dev/fuse not usable by this user",
            }
        ]
    runs = 3 if quick else 10
    n_checkpoints = 50 if quick else 300
    base = Path(tempfile.mkdtemp(prefix="jukebox-bench-booth-"))
    rows: list[dict] = []
    try:
        tree, tapes = base / "tree", base / "tapes"
        tree.mkdir()
        for i in range(100):
            (tree / f"file{i}.txt").write_text(f"content {i}\n" * 20)
        agent = ["bash", "-c", "echo $EPOCHREALTIME"]
        direct = [_stamped(agent) for _ in range(runs)]
        booth = []
        for i in range(runs):
            booth.append(
                _stamped(
                    [
                        JUKEBOX,
                        "booth",
                        "run",
                        "--tree",
                        str(tree),
                        "--tape-dir",
                        str(tapes),
                        "--tape-id",
                        f"b{i}",
                        "--",
                        *agent,
                    ]
                )
            )
        rows.append(_row("start to first instruction", "bash -c (direct)", [d[0] for d in direct]))
        rows.append(
            _row("start to first instruction", "jukebox booth (fuse)", [b[0] for b in booth])
        )
        rows.append(_row("exit to verdict", "bash -c (direct)", [d[1] for d in direct]))
        rows.append(
            _row(
                "exit to verdict",
                "jukebox booth (fuse)",
                [b[1] for b in booth],
                note="auto commit, no changes",
            )
        )

        proc = subprocess.run(
            [
                JUKEBOX,
                "booth",
                "run",
                "--tree",
                str(tree),
                "--tape-dir",
                str(tapes),
                "--tape-id",
                "cp",
                "--commit",
                "never",
                "--",
                sys.executable,
                "-c",
                CHECKPOINTS,
                str(n_checkpoints),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"checkpoint run failed: {proc.stderr.strip()[-300:]}")
        samples = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(
            _row(
                "checkpoint over the socket (1 dirty file)",
                "jukebox booth (fuse)",
                samples,
                note="jukebox.control.request over the agent's kept connection: snapshot + "
                "ack; objects and frame durable within 50 ms (group commit); target <= 3 ms",
            )
        )
    finally:
        subprocess.run(
            [JUKEBOX, "booth", "discard", "cp", "--tape-dir", str(base / "tapes")],
            capture_output=True,
        )
        shutil.rmtree(base, ignore_errors=True)
    return rows


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
