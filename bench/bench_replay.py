"""`jukebox replay --exec` against the live run it replays.

The agent is the time-travel tests' (tests/timetravel/agent.py --sdk: the real openai SDK, one tool
call, one file and one checkpoint per turn, then a streamed Responses call). It is recorded in a
booth against the fake upstream (tests/llm/upstream.py, a process of its own) answering each call
after 500 ms, as a remote model would; then the tape is replayed offline with `--exec`. Both are
timed as whole commands (booth start, SDK import, the run, the verdict), so the ratio is what a
person waits for. Rows: the live run, and the replay with its own time and its speed-up over
live. Quick: 10 turns; full: 50.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "tests" / "llm" / "upstream.py"
AGENT = REPO / "tests" / "timetravel" / "agent.py"
JUKEBOX = str(Path(sys.executable).parent / "jukebox")
DELAY_MS = 500


def _timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/", timeout=600)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:3])} failed ({proc.returncode}): {proc.stderr[-2000:]}"
        )
    return seconds


def run(quick: bool = False) -> list[dict[str, Any]]:
    group = "replay"
    if os.geteuid() != 0:
        return [{"group": group, "case": "all", "system": "-", "note": "skipped: booths need root"}]
    turns = 10 if quick else 50
    case = f"{turns}-turn run + 1 streamed call, upstream {DELAY_MS} ms per call"
    base = Path(tempfile.mkdtemp(prefix="jukebox-bench-replay-"))
    server = subprocess.Popen(
        [sys.executable, str(UPSTREAM), "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline())}"
        tree, tapes = base / "tree", base / "tapes"
        tree.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("JB_")}
        env.update(
            OPENAI_BASE_URL=url + "/v1",
            ANTHROPIC_BASE_URL=url,
            JB_TURNS=str(turns),
            JB_DELAY_MS=str(DELAY_MS),
            PYTHONPATH=str(REPO),
        )
        live = _timed(
            [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes),
             "--tape-id", "live", "--", sys.executable, str(AGENT), "--sdk"],
            env,
        )  # fmt: skip
        # Offline: the replay must not need the upstream at all.
        server.kill()
        server.wait()
        env.update(OPENAI_BASE_URL="http://127.0.0.1:9/v1", ANTHROPIC_BASE_URL="http://127.0.0.1:9")
        replay = _timed([JUKEBOX, "replay", str(tapes / "live.jbx"), "--exec"], env)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(base, ignore_errors=True)
    calls = turns + 1
    return [
        {"group": group, "case": case, "system": "live (recording)", "seconds": round(live, 3),
         "calls": calls},
        {"group": group, "case": case, "system": "replay --exec", "seconds": round(replay, 3),
         "calls": calls, "speedup_vs_live": round(live / replay, 2)},
    ]  # fmt: skip


if __name__ == "__main__":
    for r in run(quick="--quick" in sys.argv):
        print(r)
