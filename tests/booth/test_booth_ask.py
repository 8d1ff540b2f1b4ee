"""`--commit ask`: the change summary on the terminal, and the answer decides the verdict."""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import termios
import time
from pathlib import Path

import pytest

from tests.booth.test_booth_run import JUKEBOX, frames

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


def run_on_a_terminal(argv: list[str], answer: str, env: dict[str, str]) -> tuple[int, str]:
    """Runs argv with a pty as its controlling terminal (what /dev/tty opens) and answers the
    question once it appears."""
    leader, follower = os.openpty()

    def take_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        argv, stdin=follower, stdout=follower, stderr=follower, env=env, preexec_fn=take_terminal
    )
    os.close(follower)
    seen, answered = b"", False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
                if not answered and b"commit these changes" in seen:
                    os.write(leader, answer.encode() + b"\n")
                    answered = True
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=30), seen.decode(errors="replace")
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()


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
