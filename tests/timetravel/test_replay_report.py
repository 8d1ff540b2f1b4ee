"""What a replay or fork reports, and what it needs from the caller: a relative tape dir, an
agent that fails or catches a refused call, no API key in the environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.timetravel.conftest import JUKEBOX, Recording


def run_in(
    recording: Recording, cwd: str | Path, *args: str, live: bool = False, **extra: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [JUKEBOX, *args], capture_output=True, text=True, env=recording.env(live, **extra),
        timeout=90, cwd=cwd,
    )  # fmt: skip


def test_a_relative_tape_dir_is_resolved_once_where_the_command_started(
    recording: Recording, tmp_path: Path
) -> None:
    root = recording.tapes.parent
    for args in (("--tape-dir", "tapes"), ()):
        proc = run_in(recording, root, "replay", "rec", "--exec", "--no-record", *args,
                      JUKEBOX_TAPE_DIR="tapes")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    proc = run_in(
        recording, root, "fork", "rec", "--at", "3", "--exec", "--tape-dir", "tapes",
        "--tape-id", "relative-fork", live=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (recording.tapes / "relative-fork.jbx").is_file()
    # An agent (a nested jukebox among them) inherits the tape dir as the command resolved it.
    tree = tmp_path / "tree"
    tree.mkdir()
    proc = run_in(
        recording, tmp_path, "booth", "run", "--tree", "tree", "--commit", "never", "--",
        sys.executable, "-c", "import os; print(os.environ['JUKEBOX_TAPE_DIR'])",
        JUKEBOX_TAPE_DIR="tapes",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == str(tmp_path / "tapes")
