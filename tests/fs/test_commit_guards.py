"""shadowfs.commit's guards, driven directly: a commit through a directory fd, the lock timeout
that names its holder, the interrupted() callback, the keyed journal seal, and holds_tree.
(The same guards through the `jukebox` command are tests/reliability/test_commit_*.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadowfs import commit, tree
from shadowfs.commit import CRASH_ENV, JOURNAL_NAME, apply, holds_tree, lock_holders, recover
from shadowfs.errors import CommitInterrupted, ShadowfsError, TargetBusy
from shadowfs.nofollow import open_dir_nofollow
from shadowfs.store import Store
from tests.fs.test_commit import REPO, Scenario, base_tree, everything, snapshot

KEY = bytes(range(32))


@pytest.fixture
def scenario(tmp_path: Path) -> Iterator[Scenario]:
    tree.clear_cache()
    with Store.open(tmp_path / "store", create=True) as store:
        yield Scenario(tmp_path, store, base_tree, everything)


def test_a_commit_through_an_fd_writes_the_directory_not_the_path(scenario: Scenario) -> None:
    fd = open_dir_nofollow(scenario.target)
    try:
        moved = scenario.tmp / "moved"
        scenario.target.rename(moved)  # the path now leads nowhere; the fd still is the tree
        apply(scenario.store, fd, scenario.base, scenario.new, journal_dir=scenario.journal)
    finally:
        os.close(fd)
    assert snapshot(moved) == snapshot(scenario.reference)
    assert not scenario.target.exists()


def test_the_lock_timeout_names_the_holder_and_writes_nothing(scenario: Scenario) -> None:
    before = snapshot(scenario.target)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import fcntl, os, sys, time
            fd = os.open(sys.argv[1], os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            print("locked", flush=True)
            time.sleep(60)
            """), str(scenario.target)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        fd = os.open(scenario.target, os.O_RDONLY)
        try:
            [held] = lock_holders(fd)
            assert held.startswith(f"pid {holder.pid} ({sys.executable} -c ")
        finally:
            os.close(fd)
        with pytest.raises(TargetBusy) as caught:
            apply(scenario.store, scenario.target, scenario.base, scenario.new,
                  journal_dir=scenario.journal, lock_timeout=0.2)
        assert f"pid {holder.pid}" in str(caught.value) and "\n" not in str(caught.value)
        assert snapshot(scenario.target) == before
        assert not commit.pending(scenario.journal)
    finally:
        holder.kill()
        holder.wait()


def test_interrupted_before_the_commit_point_undoes_everything(scenario: Scenario) -> None:
    before = snapshot(scenario.target)
    asked = []

    def interrupted() -> bool:
        asked.append(1)
        return len(asked) > 2  # a signal arrives while the commit stages

    with pytest.raises(CommitInterrupted):
        apply(scenario.store, scenario.target, scenario.base, scenario.new,
              journal_dir=scenario.journal, interrupted=interrupted)
    assert snapshot(scenario.target) == before
    assert os.listdir(scenario.journal) == []


def test_recovery_runs_only_a_journal_sealed_with_its_key(scenario: Scenario) -> None:
    """A journal killed past its commit point, sealed with KEY: recovery without a key refuses
    to guess, with another key treats it as no commit (never runs it), with KEY finishes it."""
    script = textwrap.dedent("""
        import sys
        from shadowfs.commit import apply
        from shadowfs.oid import ObjectId
        from shadowfs.store import Store
        store_dir, target, base, new, journal = sys.argv[1:]
        with Store.open(store_dir) as store:
            apply(store, target, ObjectId.from_hex(base), ObjectId.from_hex(new),
                  journal_dir=journal, key=bytes(range(32)))
    """)
    args = [str(scenario.tmp / "store"), str(scenario.target), scenario.base.hex(),
            scenario.new.hex(), str(scenario.journal)]
    env = dict(os.environ, **{CRASH_ENV: "op:2"})
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=REPO)
    assert proc.returncode == -9
    assert (scenario.journal / JOURNAL_NAME).exists()
    with pytest.raises(ShadowfsError, match="sealed with a key"):
        recover(scenario.target, scenario.journal)
    assert (scenario.journal / JOURNAL_NAME).exists()
    with pytest.raises(ShadowfsError, match="belongs to another directory"):
        recover(scenario.fresh_target("other"), scenario.journal, key=KEY)
    # Another key, on a copy of the journal directory (recovery retires what it cannot use).
    copy = scenario.tmp / "journal-copy"
    copy.mkdir()
    for name in os.listdir(scenario.journal):
        if (scenario.journal / name).is_file():  # the records, not the trash of replaced files
            (copy / name).write_bytes((scenario.journal / name).read_bytes())
    torn = snapshot(scenario.target)
    assert recover(scenario.target, copy, key=bytes(32)) is False
    assert snapshot(scenario.target) == torn  # not one operation run
    assert recover(scenario.target, scenario.journal, key=KEY) is True
    assert snapshot(scenario.target) == snapshot(scenario.reference)


def test_holds_tree_tells_finished_from_never_begun(scenario: Scenario) -> None:
    store = scenario.store
    assert holds_tree(store, scenario.target, scenario.base, scenario.new) is False
    assert holds_tree(store, scenario.reference, scenario.base, scenario.new) is True
    apply(store, scenario.target, scenario.base, scenario.new, journal_dir=scenario.journal)
    assert holds_tree(store, scenario.target, scenario.base, scenario.new) is True
