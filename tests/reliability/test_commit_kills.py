"""Random kills of the real `jukebox booth commit` process, not only at injected points.

Each trial puts a pending booth back (tests/reliability/pending_booth.py), starts `jukebox booth
commit` as a user would, SIGKILLs it after a random delay somewhere in its life (interpreter
start, conflict check, staging, journal, renames, verdict), then runs `jukebox booth ls`, which
must recover the tree to exactly the old or exactly the new state (hashed walks), leave no
journal, and leave the booth pending exactly when the tree is the old one.

`make test` runs a few trials; JUKEBOX_CLI_KILL_TRIALS=N runs N (`make torture` runs 40);
JUKEBOX_TORTURE_SEED picks the delays.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.reliability.conftest import jb
from tests.reliability.pending_booth import PendingBooth

TRIALS = int(os.environ.get("JUKEBOX_CLI_KILL_TRIALS", "3"))
SEED = int(os.environ.get("JUKEBOX_TORTURE_SEED", "20261204"))

pytestmark = pytest.mark.usefixtures("booth_ready")


def test_commit_command_killed_at_random_times_recovers_to_old_or_new(tmp_path: Path) -> None:
    # Big enough that most of a commit's life is its work, not the interpreter's start.
    world = PendingBooth.record(tmp_path, "kill", per_dir=150)
    began = time.monotonic()
    whole = world.commit()
    span = time.monotonic() - began  # a whole commit, interpreter start to exit
    assert whole.returncode == 0, whole.stderr
    rng = random.Random(SEED)
    seen: Counter[tuple[str, str]] = Counter()
    for trial in range(TRIALS):
        world.reset()
        # Stratified: trial i lands in the i-th slice of the commit's life, so even a few
        # trials reach its middle and its end.
        delay = span * (trial + rng.random()) / TRIALS
        proc = world.start_commit()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        before = world.state()
        ls = jb("booth", "ls", "--tape-dir", str(world.tapes))
        assert ls.returncode == 0, ls.stderr
        after = world.state()
        where = f"trial {trial}: killed after {delay:.3f} s of {span:.3f} s, tree was {before}"
        assert after in ("old", "new"), where
        assert world.journals() == [], where
        assert world.pending() == (after == "old"), where
        if before == "torn":
            assert "recovered the interrupted commit" in ls.stderr, where
        seen[(before, after)] += 1
    print(f"\n{TRIALS} random kills over {span:.3f} s: "
          + ", ".join(f"{b}->{a}: {n}" for (b, a), n in sorted(seen.items())))
