"""`jukebox booth run` as a person sees it: progress on a terminal and only there, --quiet,
--verbose, and the config file's defaults for its flags."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.booth.test_booth_run import JUKEBOX
from tests.on_terminal import plain, run_on_terminal

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    return tree


def user_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JUKEBOX_CONFIG", "NO_COLOR")}
    env.update(
        PATH=f"{Path(JUKEBOX).parent}:{os.environ.get('PATH', '')}",
        JUKEBOX_TAPE_DIR=str(tmp_path / "tapes"),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        JUKEBOX_PROGRESS_DELAY="0",  # every bar drawn at once, however quick the step
        TERM="xterm-256color",  # whatever the terminal running the tests is (CI: none)
    )
    env.update(extra)
    return env


def jb(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The command with its output piped, as in a script."""
    return subprocess.run(
        [JUKEBOX, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=60
    )


def test_progress_is_drawn_on_a_terminal_and_nowhere_else(tmp_path: Path, tree: Path) -> None:
    env = user_env(tmp_path)
    run = [JUKEBOX, "booth", "run", "--", "sh", "-c", "echo two >> a.txt"]
    code, screen = run_on_terminal(run, env, cwd=tree)
    assert code == 0, screen
    text = plain(screen)
    assert "hashing the tree" in text and "committing: apply" in text
    assert f"jukebox: committed 1 change to {tree}" in text
    assert (tree / "a.txt").read_text() == "one\ntwo\n"

    # --quiet: neither the bars nor the note, and the run still commits.
    code, screen = run_on_terminal([*run[:3], "--quiet", *run[3:]], env, cwd=tree)
    assert code == 0, screen
    assert "hashing" not in screen and "committ" not in screen
    assert (tree / "a.txt").read_text() == "one\ntwo\ntwo\n"

    # Piped: no bar, no colour; --verbose says what each long step did, as plain lines.
    done = jb("-v", "booth", "run", "--", "sh", "-c", "echo two >> a.txt", cwd=tree, env=env)
    assert done.returncode == 0, done.stderr
    assert "hashing the tree" not in done.stderr and "\x1b[" not in done.stderr
    lines = done.stderr.splitlines()
    assert any(line.startswith("jukebox: hashed the tree: ") for line in lines), lines
    assert any(line.startswith("jukebox: committed: ") for line in lines), lines
    assert any(line.startswith(f"jukebox: committed 1 change to {tree}") for line in lines)


def test_the_config_file_sets_the_image_and_a_flag_beats_it(tmp_path: Path, tree: Path) -> None:
    config = tmp_path / "config" / "jukebox" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('image = "minimal"\n')
    env = user_env(tmp_path, HOME="/root")
    script = 'echo "$HOME" > home.txt'
    done = jb("booth", "run", "--", "sh", "-c", script, cwd=tree, env=env)
    assert done.returncode == 0, done.stderr
    assert (tree / "home.txt").read_text() == "/tmp\n"  # the minimal image's HOME
    done = jb("booth", "run", "--image", "host", "--", "sh", "-c", script, cwd=tree, env=env)
    assert done.returncode == 0, done.stderr
    assert (tree / "home.txt").read_text() == "/root\n"
