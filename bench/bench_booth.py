"""Booth overheads: start to the agent's first instruction, exit to verdict, and a checkpoint
requested from inside over the control socket — next to `bash -c` run directly.

The agent is `bash -c 'echo $EPOCHREALTIME'`: its first instruction stamps the wall clock, so
start latency is that stamp minus the launch time, and exit-to-verdict is the moment the
`jukebox` process ends minus the stamp (the agent exits right after it). The booths run one after
another over the same tree, so all but the first reuse the previous base tree's stat cache.

A checkpoint is acknowledged once its snapshot is in the store and its frame queued; the store's
fsync, the frame's write and the tape's fdatasync follow within 50 ms (the booth's group commit,
`jukebox.booth.supervisor.GroupTape`), so the row is what the agent waits for, not the disk. The
checkpoints run back to back, each after a step that rewrites 1 or 10 of the tree's 100 files,
so some arrive during the group commit's fsync: p99, the slowest (max) and the mean show
whether they wait for it. The paused rows sleep 0.2 s between each step and its checkpoint, as
an agent does while a model answers: the checkpoint then wakes idle threads and cold caches. In
that pause the booth has stored the step's files, trees and journal already (50 ms after the
layer's last change, `shadowfs.quiet_fold`), as it would for any agent that pauses, so a paused
row times what is left of the checkpoint: the request and its answer, the syncfs, the frame.
The checkpoint rows' `agent_cpu_p50_us` is the CPU the agent's thread spent in the request:
its client's code and its poll for the answer (`jukebox.booth.control.SPIN`).

The wake-up floor rows are the paused row's anchor, in the same run: two C processes, a request
and its answer over a unix socket after the same pause, nothing else (bench/wakeup_floor.c,
built here with the C compiler the install needs). No design of the checkpoint's transport can
answer faster than this on the machine; what the paused checkpoint costs above it is the
booth's own work.
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
GROUP = "booth"
SYSTEM = "jukebox booth (fuse)"
PAUSE = 0.2  # seconds between a step and its checkpoint in the paused rows
FLOOR_SOURCE = Path(__file__).with_name("wakeup_floor.c")
FLOOR_CASE = f"wake-up floor: request and answer over a unix socket, {PAUSE} s after a pause"
TAPE_IDS = {(1, 0.0): "cp1", (10, 0.0): "cp10", (1, PAUSE): "cp1p", (10, PAUSE): "cp10p"}

CHECKPOINTS = r"""
import json, sys, time
from jukebox.booth.control import request
n, k, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
out = []
for i in range(n):
    for j in range(k):  # k of 100 files rewritten per step, different ones each step
        with open("file%d.txt" % ((i * k + j) % 100), "w") as f:
            f.write("x" * 100 + str(i))
    if pause:
        time.sleep(pause)
    t, c = time.perf_counter(), time.thread_time()
    request({"op": "checkpoint"})
    out.append(((time.perf_counter() - t) * 1e6, (time.thread_time() - c) * 1e6))
print(json.dumps(out))
"""


def checkpoint_case(k: int, pause: float = 0.0) -> str:
    """The row's case for k dirty files (and a pause before the request)."""
    files = f"{k} dirty file{'s' if k > 1 else ''}"
    when = f", {pause} s after the step" if pause else ""
    return f"checkpoint over the socket ({files}{when})"


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
        "group": GROUP,
        "case": case,
        "system": system,
        "p50_us": percentile(samples, 50),
        "p99_us": percentile(samples, 99),
        "max_us": max(samples),
        "mean_us": sum(samples) / len(samples),
        "n": len(samples),
        **extra,
    }


def _checkpoints(
    tree: Path, tapes: Path, tape_id: str, n: int, k: int, pause: float = 0.0
) -> list[list[float]]:
    """[wall µs, the agent's CPU µs] per checkpoint an agent in a booth asks for after each
    k-file step (and a pause)."""
    proc = subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id",
         tape_id, "--commit", "never", "--", sys.executable, "-c", CHECKPOINTS, str(n), str(k),
         str(pause)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"checkpoint run failed: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _floor_rows(base: Path, rounds: int) -> list[dict[str, Any]]:
    """The wake-up floor's two rows (bench/wakeup_floor.c), or one saying why not."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return [{"group": GROUP, "case": FLOOR_CASE, "system": "C", "note": "skipped: no cc"}]
    binary = base / "wakeup_floor"
    subprocess.run([compiler, "-O2", "-o", str(binary), str(FLOOR_SOURCE)], check=True)
    proc = subprocess.run(
        [str(binary), str(rounds), str(PAUSE)], capture_output=True, text=True, check=True
    )
    samples = json.loads(proc.stdout)
    return [
        _row(FLOOR_CASE, "C, both sides block in recv", samples["block"],
             note="the kernel's and the hypervisor's part of any paused request: two wake-ups"),
        _row(FLOOR_CASE, "C, the client polls 2 ms for the answer", samples["poll"],
             note="as jukebox.booth.control's client polls (control.SPIN)"),
    ]  # fmt: skip


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
    n_paused = 5 if quick else 40
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

        back_to_back = (
            0.0, n_checkpoints, "",
            "jukebox.booth.control.request over the agent's kept connection, back to back: "
            "snapshot + "
            "ack; objects and frame durable within 50 ms (group commit), whose fsync a "
            "checkpoint does not wait for; target <= 3 ms",
        )  # fmt: skip
        paused = (
            PAUSE, n_paused, f", {PAUSE} s after the step",
            "as above, but the agent sleeps between its step and the request, as it would "
            "while waiting for a model: idle threads and cold caches; the step's changes were "
            "stored in the pause (shadowfs.quiet_fold)",
        )  # fmt: skip
        for pause, n, _when, note in (back_to_back, paused):
            for k in (1, 10):
                pairs = _checkpoints(tree, tapes, TAPE_IDS[k, pause], n, k, pause)
                rows.append(_row(
                    checkpoint_case(k, pause), SYSTEM, [wall for wall, _ in pairs], note=note,
                    agent_cpu_p50_us=percentile([cpu for _, cpu in pairs], 50),
                ))  # fmt: skip
        rows.extend(_floor_rows(base, n_paused))
    finally:
        for tape_id in TAPE_IDS.values():
            subprocess.run(
                [JUKEBOX, "booth", "discard", tape_id, "--tape-dir", str(base / "tapes")],
                capture_output=True,
            )
        shutil.rmtree(base, ignore_errors=True)
    return rows


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
