"""`--commit ask`: the change summary on the terminal, and the answer decides the verdict."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.booth.test_booth_run import JUKEBOX, frames
from tests.on_terminal import run_on_terminal

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


def run_on_a_terminal(argv: list[str], answer: str, env: dict[str, str]) -> tuple[int, str]:
    """Runs argv on a pty and answers the question once it appears."""
    return run_on_terminal(argv, env, answer=(b"commit these changes", answer))


@pytest.mark.parametrize(
    ("answer", "committed", "status"), [("y", True, "COMMITTED"), ("n", False, "ROLLED_BACK")]
)
def test_ask_shows_the_changes_and_obeys_the_answer(
    tmp_path: Path, answer: str, committed: bool, status: str
) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    env = dict(os.environ, PATH=f"{Path(JUKEBOX).parent}:{os.environ.get('PATH', '')}")
    code, screen = run_on_a_terminal(
        [
            JUKEBOX,
            "booth",
            "run",
            "--tree",
            str(tree),
            "--tape-dir",
            str(tapes),
            "--tape-id",
            "t1",
            "--commit",
            "ask",
            "--",
            "sh",
            "-c",
            "echo two > a.txt && echo new > b.txt",
        ],
        answer,
        env,
    )
    assert "2 change(s)" in screen and "b.txt" in screen, screen
    assert (tree / "b.txt").exists() == committed
    assert (tree / "a.txt").read_text() == ("two\n" if committed else "one\n")
    listing = subprocess.run(
        [JUKEBOX, "ls", "--tape-dir", str(tapes)], capture_output=True, text=True, check=True
    ).stdout
    assert status in listing, listing
    assert frames(tapes)[-1]["kind"] in ("commit", "rollback", "discard")
    assert code in (0, 1)
