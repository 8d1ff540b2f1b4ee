"""Interrupted commits: a `jukebox booth commit` killed (SIGKILL at an injected point) or
interrupted (SIGINT at an injected pause) never leaves the real tree torn. The next command that
opens the tape dir (`booth ls`, `ls`, `log`) recovers it to exactly the old or the new tree, says
so in one line and writes the verdict on the tape; `booth discard` finishes or undoes the commit
first; two commands recovering at once recover once; a journal planted in the tape dir is never
run. Old and new are hashed walks of the tree (tests/reliability/pending_booth.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from shadowfs.commit import CRASH_ENV, JOURNAL_NAME, PAUSE_ENV, _seal
from tests.booth.conftest import nobody_dir  # noqa: F401  (fixture)
from tests.reliability.conftest import JUKEBOX, NOBODY, booth_argv, jb
from tests.reliability.pending_booth import PendingBooth, resume, wait_stopped

pytestmark = pytest.mark.usefixtures("booth_ready")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> PendingBooth:
    return PendingBooth.record(tmp_path_factory.mktemp("recovery"), "rc")


def killed_at(world: PendingBooth, point: str) -> None:
    world.reset()
    proc = world.commit(env={CRASH_ENV: point})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert world.journals() == ["rc"]


def recovery_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "recovered the interrupted commit" in ln]


@pytest.mark.parametrize(
    ("point", "command", "outcome"),
    [
        ("op:3", ("booth", "ls"), "new"),  # past the commit point: finished
        ("stage:2", ("booth", "ls"), "old"),  # before it: undone
        ("applied", ("ls",), "new"),
        ("prepare", ("ls", "--json"), "old"),
        ("prepare-deleted", ("log", "rc"), "new"),
    ],
)
def test_every_command_that_opens_the_tape_dir_recovers_first(
    world: PendingBooth, point: str, command: tuple[str, ...], outcome: str
) -> None:
    killed_at(world, point)
    assert world.state() == "torn" or point in ("prepare", "applied", "prepare-deleted")
    proc = jb(*command, "--tape-dir", str(world.tapes))
    assert proc.returncode == 0, proc.stderr
    [line] = recovery_lines(proc.stderr)
    assert ("finished" if outcome == "new" else "undone") in line
    assert world.state() == outcome
    assert world.journals() == []
    last = world.frames()[-1]
    if outcome == "new":
        assert last["kind"] == "commit" and last["payload"]["recovered"] is True
        assert not world.pending()
    else:
        assert last["kind"] == "note" and last["payload"]["event"] == "commit_interrupted"
        assert world.pending()
        # Still committable, and only once.
        again = world.commit()
        assert again.returncode == 0, again.stderr
        assert world.state() == "new"
    quiet = jb("booth", "ls", "--tape-dir", str(world.tapes))
    assert quiet.returncode == 0 and not recovery_lines(quiet.stderr)


def test_a_commit_killed_after_its_verdict_leaves_nothing_behind(world: PendingBooth) -> None:
    """Killed with the commit frame written and the record retired, before its journal directory
    went: the next command clears the directory, and the tape keeps its one commit frame."""
    killed_at(world, "retire")
    assert world.state() == "new" and not world.pending()
    proc = jb("booth", "ls", "--tape-dir", str(world.tapes))
    assert proc.returncode == 0, proc.stderr
    assert "could not recover" not in proc.stderr
    [line] = recovery_lines(proc.stderr)
    assert "finished" in line
    assert world.journals() == []
    assert world.state() == "new" and not world.pending()
    assert [f["kind"] for f in world.frames()].count("commit") == 1
    again = world.commit()
    assert again.returncode == 1 and "already committed" in again.stderr, again.stderr


def test_discard_finishes_a_commit_past_its_commit_point(world: PendingBooth) -> None:
    killed_at(world, "op:5")
    proc = jb("booth", "discard", "rc", "--tape-dir", str(world.tapes))
    assert proc.returncode == 1, proc.stderr
    assert "finished" in proc.stderr
    assert world.state() == "new"
    assert world.journals() == [] and not world.pending()


def test_discard_undoes_a_commit_before_its_commit_point(world: PendingBooth) -> None:
    killed_at(world, "staged")
    proc = jb("booth", "discard", "rc", "--tape-dir", str(world.tapes))
    assert proc.returncode == 0, proc.stderr
    assert world.state() == "old"
    assert world.journals() == [] and not world.pending()
    assert world.frames()[-1]["kind"] == "discard"


@pytest.mark.parametrize(("pause", "outcome"), [("stage:1", "old"), ("journal", "new")])
def test_sigint_during_a_commit_exits_130_with_the_old_or_new_tree(
    world: PendingBooth, pause: str, outcome: str
) -> None:
    world.reset()
    proc = world.start_commit({PAUSE_ENV: pause})
    wait_stopped(proc)
    resume(proc, signo=signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert world.state() == outcome
    assert world.journals() == []
    assert world.pending() == (outcome == "old")


def test_two_commands_recovering_at_once_recover_once(world: PendingBooth) -> None:
    killed_at(world, "op:1")
    procs = [
        subprocess.Popen([JUKEBOX, "booth", "ls", "--tape-dir", str(world.tapes)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert sum(len(recovery_lines(err)) for _, err in outputs) == 1
    assert world.state() == "new"
    assert [f["kind"] for f in world.frames()].count("commit") == 1


def test_a_journal_planted_in_the_tape_dir_is_never_run(world: PendingBooth) -> None:
    """A tape dir received from someone else carries a journal that would delete a file of the
    user's tree; it is not sealed with this user's key, so it is reported and left alone."""
    world.reset()
    record = json.loads((world.tapes / ".jukebox" / "booths" / "rc.json").read_text())
    planted = world.tapes / ".jukebox" / "commit-journals" / "rc"
    planted.mkdir(parents=True)
    st = world.tree.stat()
    ops = {"target": [st.st_dev, st.st_ino], "token": "0", "ops": [["unlink", "exec.sh"]],
           "fsync": [""]}
    (planted / JOURNAL_NAME).write_bytes(_seal(ops))
    intent = {"tree": str(world.tree), "tree_dev": st.st_dev, "tree_ino": st.st_ino,
              "base": record["base_tree"], "final": record["final_tree"], "by": "booth commit"}
    (planted / "intent.json").write_text(json.dumps({"intent": intent, "mac": None}))
    proc = jb("booth", "ls", "--tape-dir", str(world.tapes))
    assert proc.returncode == 0, proc.stderr
    assert "not sealed with this user's key" in proc.stderr
    assert world.state() == "old"
    assert (planted / JOURNAL_NAME).exists()


def test_a_tree_swapped_since_the_crash_is_not_recovered_into(
    world: PendingBooth, tmp_path: Path
) -> None:
    killed_at(world, "op:2")
    moved = world.tree.with_name("tree.moved")
    world.tree.rename(moved)
    world.tree.mkdir()
    try:
        proc = jb("booth", "ls", "--tape-dir", str(world.tapes))
        assert proc.returncode == 0, proc.stderr
        assert "could not recover" in proc.stderr and "no longer the directory" in proc.stderr
        assert list(world.tree.iterdir()) == []
        assert world.journals() == ["rc"]
        refused = jb("booth", "discard", "rc", "--tape-dir", str(world.tapes))
        assert refused.returncode == 1 and "torn" in refused.stderr
    finally:
        world.tree.rmdir()
        moved.rename(world.tree)
    proc = jb("booth", "ls", "--tape-dir", str(world.tapes))
    assert recovery_lines(proc.stderr) and world.state() == "new"


def test_a_booth_run_killed_in_its_auto_commit_is_recovered_and_stays_committable(
    tmp_path: Path,
) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("old\n")
    run = jb(*booth_argv(tree, tapes, "auto", "--commit", "auto"),
             "sh", "-c", "echo new > a.txt; echo more > b.txt",
             cwd=tree, env={CRASH_ENV: "stage:0"})
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert any(p.name.startswith(".jbx-stage-") for p in tree.iterdir())  # torn until recovered
    listed = jb("booth", "ls", "--tape-dir", str(tapes))
    assert listed.returncode == 0, listed.stderr
    assert "undone" in listed.stderr and re.search(r"^auto +pending ", listed.stdout, re.M)
    assert sorted(p.name for p in tree.iterdir()) == ["a.txt"]
    assert (tree / "a.txt").read_text() == "old\n"
    done = jb("booth", "commit", "auto", "--tape-dir", str(tapes))
    assert done.returncode == 0, done.stderr
    assert (tree / "a.txt").read_text() == "new\n" and (tree / "b.txt").exists()


def test_an_unprivileged_users_killed_commit_is_recovered_by_their_next_command(
    nobody_python: str, nobody_dir: Path, open_dev_fuse: None  # noqa: F811
) -> None:
    tree, tapes = nobody_dir / "tree", nobody_dir / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    for path in (tree, tree / "a.txt"):
        os.chown(path, NOBODY, NOBODY)

    def as_nobody(*args: str, env: dict[str, str] | None = None) -> CompletedProcess[str]:
        return jb(*args, python=nobody_python, user=NOBODY, cwd=nobody_dir, env=env)

    run = as_nobody(*booth_argv(tree, tapes, "u1", "--commit", "never"),
                    "sh", "-c", "echo two >> a.txt; echo new > b.txt; mkdir d; echo x > d/c")
    assert run.returncode == 0, run.stderr
    killed = as_nobody("booth", "commit", "u1", "--tape-dir", str(tapes), env={CRASH_ENV: "op:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    listed = as_nobody("booth", "ls", "--tape-dir", str(tapes))
    assert listed.returncode == 0, listed.stderr
    assert "finished" in listed.stderr and "no pending booths" in listed.stdout
    assert (tree / "a.txt").read_text() == "one\ntwo\n"
    assert sorted(p.name for p in tree.iterdir()) == ["a.txt", "b.txt", "d"]
