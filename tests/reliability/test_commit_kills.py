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

import pytest

from tests.reliability.conftest import jb
from tests.reliability.pending_booth import PendingBooth

TRIALS = int(os.environ.get("JUKEBOX_CLI_KILL_TRIALS", "3"))
SEED = int(os.environ.get("JUKEBOX_TORTURE_SEED", "20261204"))

pytestmark = pytest.mark.usefixtures("booth_ready")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[PendingBooth, float]:
    """The pending booth, and how long a whole commit of it takes (interpreter start to exit)."""
    # Big enough that most of a commit's life is its work, not the interpreter's start (the
    # few trials of `make test` get a smaller one, for time).
    per_dir = 150 if TRIALS > 5 else 60
    booth = PendingBooth.record(tmp_path_factory.mktemp("kills"), "kill", per_dir=per_dir)
    spans = []
    for _ in range(2):  # the slower of two: a kill meant for the end must not land before it
        booth.reset()
        began = time.monotonic()
        whole = booth.commit()
        spans.append(time.monotonic() - began)
        assert whole.returncode == 0, whole.stderr
    return booth, max(spans)


_seen: Counter[tuple[str, str]] = Counter()


@pytest.mark.parametrize("trial", range(TRIALS))
def test_commit_command_killed_at_random_times_recovers_to_old_or_new(
    world: tuple[PendingBooth, float], trial: int
) -> None:
    booth, span = world
    booth.reset()
    # Stratified: trial i lands in the i-th slice of the commit's life (and a little past it:
    # a commit can run slower than the one measured), so even a few trials reach its end.
    delay = 1.2 * span * (trial + random.Random(SEED + trial).random()) / TRIALS
    proc = booth.start_commit()
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    before = booth.state()
    ls = jb("booth", "ls", "--tape-dir", str(booth.tapes))
    assert ls.returncode == 0, ls.stderr
    after = booth.state()
    where = f"killed after {delay:.3f} s of {span:.3f} s, the tree was {before}"
    assert after in ("old", "new"), where
    assert booth.journals() == [], where
    assert booth.pending() == (after == "old"), where
    if before == "torn":
        assert "recovered the interrupted commit" in ls.stderr, where
    _seen[(before, after)] += 1
    if trial == TRIALS - 1:
        print(f"\n{TRIALS} random kills over {span:.3f} s: "
              + ", ".join(f"{b}->{a}: {n}" for (b, a), n in sorted(_seen.items())))


def _drained(path: os.PathLike[str], timeout: float = 60) -> bool:
    """Whether the directory ``path`` is gone or empty within ``timeout`` (a background process
    empties it; waiting, not timing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not os.listdir(path):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_replaced_files_are_freed_by_a_background_process(
    world: tuple[PendingBooth, float],
) -> None:
    booth, _ = world
    booth.reset()
    done = booth.commit()
    assert done.returncode == 0, done.stderr
    assert booth.state() == "new"
    assert booth.journals() == []
    trash = booth.tapes / ".jukebox" / "commit-trash"
    assert trash.is_dir()  # the commit's trash went there, for a process of its own to free
    assert _drained(trash)
    # That process killed midway: the next command that opens the tape dir starts another.
    left = trash / "kill-0123abcd"
    (left / "sub").mkdir(parents=True)
    for i in range(100):
        (left / f"old-{i}").write_bytes(b"x" * 5000)
    (left / "sub" / "old").write_bytes(b"y")
    ls = jb("booth", "ls", "--tape-dir", str(booth.tapes))
    assert ls.returncode == 0, ls.stderr
    assert _drained(trash)
    assert booth.state() == "new"
