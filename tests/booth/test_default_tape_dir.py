"""The first command a user types: `cd repo && jukebox booth run -- CMD`, with no tape dir named.

The default tape dir was `./tapes`, inside the tree: that run always failed (the two overlap) and
left an empty `tapes/` in the repo. It is now `$JUKEBOX_TAPE_DIR`, else the XDG data dir, for the
CLI and the Python API alike; and no refused run leaves a tape dir behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.booth.test_booth_run import jb

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


def user_env(tmp_path: Path) -> dict[str, str]:
    """A user with no JUKEBOX_TAPE_DIR and a data dir of their own."""
    return {"JUKEBOX_TAPE_DIR": "", "XDG_DATA_HOME": str(tmp_path / "data")}


def test_booth_run_in_the_tree_records_in_the_data_dir(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.txt").write_text("one\n")
    env = user_env(tmp_path)
    done = jb("booth", "run", "--", "sh", "-c", "echo two >> a.txt", cwd=repo, env=env)
    assert done.returncode == 0, done.stderr
    assert f"jukebox: committed 1 change to {repo} " in done.stderr
    assert (repo / "a.txt").read_text() == "one\ntwo\n"
    assert sorted(os.listdir(repo)) == ["a.txt"]  # no tapes/ in the repo
    tapes = tmp_path / "data" / "jukebox" / "tapes"
    (tape,) = tapes.glob("*.jbx")
    listed = jb("ls", cwd=repo, env=env)
    assert listed.returncode == 0 and tape.stem in listed.stdout, listed.stderr


def test_python_api_uses_the_same_default(tmp_path: Path) -> None:
    code = "from jukebox.api.api import Jukebox; print(Jukebox().tapes.path)"
    for env, want in (
        (user_env(tmp_path), tmp_path / "data" / "jukebox" / "tapes"),
        ({"JUKEBOX_TAPE_DIR": str(tmp_path / "mine")}, tmp_path / "mine"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, **env},
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(want)


def test_a_refused_run_leaves_no_tape_dir(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    env = user_env(tmp_path)
    overlap = jb("booth", "run", "--tree", str(tree), "--tape-dir", str(tree / "tapes"), "--",
                 "true", env=env)
    assert overlap.returncode == 2 and "overlap" in overlap.stderr, overlap.stderr
    assert sorted(os.listdir(tree)) == ["a.txt"]
    for refused in (["--image", "nope"], ["--net", "moon"], ["--tape-id", "../x"]):
        done = jb("booth", "run", "--tree", str(tree), *refused, "--", "true", env=env)
        assert done.returncode == 2, done.stderr
        assert not (tmp_path / "data").exists(), refused


def test_a_user_who_cannot_see_the_default_config_has_none(nobody_python, nobody_dir) -> None:
    # `sudo -u nobody jukebox …` keeps HOME=/root, which nobody cannot search: that is no
    # config of theirs, not an error. A config file they can see but not read still is one.
    from tests.booth.conftest import NOBODY

    cli = "from jukebox.cli import main; main()"
    env = {"PATH": os.environ["PATH"], "HOME": "/root", "JUKEBOX_TAPE_DIR": str(nobody_dir)}

    def as_nobody(**extra: str) -> subprocess.CompletedProcess[str]:
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        return subprocess.run(
            [*cmd, nobody_python, "-c", cli, "ls"], capture_output=True, text=True,
            env=dict(env, **extra), cwd="/", timeout=60,
        )  # fmt: skip

    listed = as_nobody()
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == f"no tapes in {nobody_dir}\n"
    unreadable = nobody_dir / "config" / "jukebox" / "config.toml"
    unreadable.parent.mkdir(parents=True)
    os.chown(unreadable.parent.parent, NOBODY, NOBODY)
    os.chown(unreadable.parent, NOBODY, NOBODY)
    unreadable.write_text('fs = "overlay"\n')
    unreadable.chmod(0o600)  # root's file in nobody's config dir
    refused = as_nobody(XDG_CONFIG_HOME=str(nobody_dir / "config"))
    assert refused.returncode == 2, refused.stderr
    want = f"jukebox: {unreadable}: cannot be read (Permission denied): check it\n"
    assert refused.stderr == want
