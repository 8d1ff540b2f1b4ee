"""Attacks on `jukebox booth commit` from the host, each performed for real and its outcome
checked by hashed walks:

- the owner of the tree's parent (nobody) swaps the tree for a symlink to a root-owned
  directory, then for another directory, between the booth and root's commit;
- a file the commit will replace is edited on the host while the commit stages (the commit
  stops itself at an injected pause, a helper process edits, the commit resumes);
- a reader (nobody) holds a shared flock on the tree: the commit gives up after its lock
  timeout, naming the holder.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadowfs.commit import PAUSE_ENV, SYNCFS_FROM
from tests.booth.conftest import nobody_dir  # noqa: F401  (fixture)
from tests.reliability.conftest import AGENT_PYTHON, NOBODY, booth_argv, jb, tree_state
from tests.reliability.pending_booth import PendingBooth, resume, wait_stopped

pytestmark = pytest.mark.usefixtures("booth_ready")


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
        capture_output=True, text=True, timeout=30,
    )


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_tree_swapped_by_its_parents_owner_is_refused(
    nobody_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    parent = nobody_dir  # owned by nobody, who may rename and replace entries in it
    tree = parent / "tree"
    tree.mkdir()  # root's
    (tree / "README").write_text("root's project\n")
    tapes = tmp_path / "tapes"
    run = jb(*booth_argv(tree, tapes, "swap", "--commit", "never"),
             "sh", "-c", "echo ssh-ed25519 AAAA attacker > authorized_keys; echo x >> README",
             cwd=tree)
    assert run.returncode == 0, run.stderr
    victim = tmp_path / "victim"  # a root-owned directory nobody may not write
    victim.mkdir()
    (victim / "README").write_text("root's project\n")  # what the conflict check would expect
    victim_before = tree_state(victim)
    original_before = tree_state(tree)

    moved = as_nobody("sh", "-c", f"mv {tree} {parent}/tree.old && ln -s {victim} {tree}")
    assert moved.returncode == 0, moved.stderr
    refused = jb("booth", "commit", "swap", "--tape-dir", str(tapes))
    assert refused.returncode == 1, refused.stderr
    assert "nothing was written" in one_line(refused.stderr)
    assert tree_state(victim) == victim_before
    assert tree_state(parent / "tree.old") == original_before

    # Another directory at the same path: a different inode, also refused.
    swapped = as_nobody("sh", "-c", f"rm {tree} && mkdir {tree} && echo decoy > {tree}/README")
    assert swapped.returncode == 0, swapped.stderr
    decoy_before = tree_state(tree)
    refused = jb("booth", "commit", "swap", "--tape-dir", str(tapes))
    assert refused.returncode == 1, refused.stderr
    assert "no longer the directory" in one_line(refused.stderr)
    assert tree_state(tree) == decoy_before
    assert not list((tapes / ".jukebox" / "commit-journals").glob("*"))

    # The original put back: the booth, still pending, commits into it.
    back = as_nobody("sh", "-c", f"rm -r {tree} && mv {parent}/tree.old {tree}")
    assert back.returncode == 0, back.stderr
    done = jb("booth", "commit", "swap", "--tape-dir", str(tapes))
    assert done.returncode == 0, done.stderr
    assert (tree / "authorized_keys").read_text().startswith("ssh-ed25519")
    assert tree_state(victim) == victim_before


def _recorded_in_tmp(prefix: str, per_dir: int = 30) -> Iterator[PendingBooth]:
    # Under a directory nobody can reach (pytest's own are 0700), so that nobody can open the
    # tree and lock it.
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(work, 0o755)
    try:
        yield PendingBooth.record(work, "edit", per_dir=per_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def recorded() -> Iterator[PendingBooth]:
    yield from _recorded_in_tmp("jukebox-commit-attacks-")


@pytest.fixture
def world(recorded: PendingBooth) -> PendingBooth:
    recorded.reset()
    return recorded


@pytest.fixture(scope="module")
def recorded_big() -> Iterator[PendingBooth]:
    """A booth of 264 changed files, past SYNCFS_FROM: its commit stages in threads, checks
    beside the staging with batched lstats and renames a chunk at a time."""
    yield from _recorded_in_tmp("jukebox-commit-attacks-big-", per_dir=88)


@pytest.fixture
def big_world(recorded_big: PendingBooth) -> PendingBooth:
    recorded_big.reset()
    return recorded_big


@pytest.mark.parametrize(
    ("pause", "size"), [("stage:0", "small"), ("staged", "small"), ("stage:0", "big")]
)
def test_a_host_edit_during_staging_is_a_conflict_not_overwritten(
    request: pytest.FixtureRequest, pause: str, size: str
) -> None:
    world: PendingBooth = request.getfixturevalue("world" if size == "small" else "big_world")
    changed = sum(1 for k, v in world.new.items() if world.old.get(k) != v)
    assert (changed >= SYNCFS_FROM) == (size == "big")
    victim = world.tree / "d3" / "f4.txt"  # the booth appended to it: the commit replaces it
    proc = world.start_commit({PAUSE_ENV: pause})
    wait_stopped(proc)
    # Someone else, in another process, edits the file mid-commit.
    subprocess.run(["sh", "-c", f"echo host edit >> {victim}"], check=True)
    # The tree as the host left it: the old one with that file edited.
    edited = dict(world.old, **{"d3/f4.txt": tree_state(world.tree)["d3/f4.txt"]})
    resume(proc)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "d3/f4.txt" in one_line(stderr)
    assert tree_state(world.tree) == edited  # the edit kept, nothing else applied, no residue
    assert victim.read_text().endswith("host edit\n")
    assert world.pending()
    assert world.frames()[-1]["kind"] == "note"
    assert world.journals() == []


def test_a_readers_shared_flock_times_out_naming_the_holder(world: PendingBooth) -> None:
    holder = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", AGENT_PYTHON,
         "-c", "import fcntl, os, sys, time\n"
               "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
               "fcntl.flock(fd, fcntl.LOCK_SH)\n"
               "print('locked', flush=True)\n"
               "time.sleep(120)\n",
         str(world.tree)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        refused = world.commit("--lock-timeout", "300ms")
        assert refused.returncode == 1, refused.stderr
        line = one_line(refused.stderr)
        assert f"pid {holder.pid} (" in line and "flock" in line, line
        assert world.state() == "old"
        assert world.pending()
        # The environment sets the default the flag overrides.
        refused = world.commit(env={"JUKEBOX_LOCK_TIMEOUT": "0.2"})
        assert refused.returncode == 1 and f"pid {holder.pid}" in refused.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    done = world.commit()
    assert done.returncode == 0, done.stderr
    assert world.state() == "new"


def test_a_bad_lock_timeout_is_a_usage_error(tmp_path: Path) -> None:
    proc = jb("booth", "commit", "any", "--tape-dir", str(tmp_path), "--lock-timeout", "soon")
    assert proc.returncode == 2
    assert "is not a duration" in one_line(proc.stderr)
    assert list(tmp_path.iterdir()) == []
