"""Crash torture for shadowfs.commit: kill a real commit at injected points, recover, and demand
the tree be exactly the old or exactly the new state (no stray files, modes and mtimes included).

The default sample is quick. JUKEBOX_TORTURE_TRIALS=N adds N random step indices on top of the
named points (`make torture` runs 200+); JUKEBOX_TORTURE_SEED picks the sample.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shadowfs import commit, tree
from shadowfs.commit import CRASH_ENV, recover
from shadowfs.oid import ObjectId
from shadowfs.store import Store
from shadowfs.tree import build_tree, materialize
from tests.fs.test_commit import REPO, Snapshot, base_tree, everything, snapshot
from tests.reliability.pending_booth import resume, wait_stopped

TRIALS = int(os.environ.get("JUKEBOX_TORTURE_TRIALS", "6"))
SEED = int(os.environ.get("JUKEBOX_TORTURE_SEED", "20240611"))

_APPLY = textwrap.dedent(
    """
    import sys
    from shadowfs.commit import apply
    from shadowfs.oid import ObjectId
    from shadowfs.store import Store
    store_dir, target, base, new, journal = sys.argv[1:]
    with Store.open(store_dir) as store:
        apply(store, target, ObjectId.from_hex(base), ObjectId.from_hex(new), journal_dir=journal)
    """
)
_RECOVER = "import sys; from shadowfs.commit import recover; recover(sys.argv[1], sys.argv[2])"


@dataclass
class World:
    tmp: Path
    store: Store
    base: ObjectId
    new: ObjectId
    old_state: Snapshot
    new_state: Snapshot
    stages: int
    ops: int
    asides: list[int]  # ops that move the file they replace into the trash

    @property
    def sequence(self) -> list[str]:
        """apply's crash points in step order (a step index N names sequence[N])."""
        return [
            "prepare",
            *(f"stage:{i}" for i in range(self.stages)),
            # Staged in threads, the conflict check runs beside the staging and ends here.
            *(["checked"] if self.stages >= commit.SYNCFS_FROM else []),
            "staged",
            "journal",
            *(f"op:{i}" for i in range(self.ops)),
            "applied",
            "prepare-deleted",
            "freeing",
        ]


def _world(
    tmp: Path, make_base: Callable[[Path], None], change: Callable[[Path], None]
) -> Iterator[World]:
    tree.clear_cache()
    with Store.open(tmp / "store", create=True) as store:
        src = tmp / "src"
        src.mkdir()
        make_base(src)
        base = build_tree(store, src)
        change(src)
        new = build_tree(store, src)
        store.flush()
        materialize(store, base, tmp / "old")
        materialize(store, new, tmp / "new")
        plan = commit._plan(store, new, commit._changes(store, base, new), "x")
        old = {c.path: c.old for c in plan.changes}
        asides = [
            k for k, op in enumerate(plan.ops)
            if op[0] == "rename" and (o := old.get(op[3])) is not None and o.kind != tree.DIR
        ]  # fmt: skip
        yield World(
            tmp, store, base, new, snapshot(tmp / "old"), snapshot(tmp / "new"),
            len(plan.stages), len(plan.ops), asides,
        )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    yield from _world(tmp_path_factory.mktemp("torture"), base_tree, everything)


def _many_dirs(src: Path) -> None:
    for i in range(commit.SYNCFS_FROM + 20):
        (src / f"d{i:03d}").mkdir()
        (src / f"d{i:03d}" / "f").write_text(f"old {i}\n")
        (src / f"d{i:03d}" / "gone").write_text(f"gone {i}\n")
    (src / "big").write_bytes(b"b" * (3 << 20))  # past what a thread stages whole
    os.link(src / "d000" / "f", src / "d001" / "link-to-f")


def _rewrite_many(src: Path) -> None:
    """Rewrites, adds and removes past the threshold from which commit runs them in threads,
    with a hard link, a symlink and a big file among them: staged one by one."""
    for i in range(commit.SYNCFS_FROM + 20):
        (src / f"d{i:03d}" / "f").write_text(f"new {i}\n")
        (src / f"d{i:03d}" / "added").write_text(f"added {i}\n")
        (src / f"d{i:03d}" / "gone").unlink()
    (src / "big").write_bytes(b"B" * (3 << 20))
    (src / "d002" / "sym").symlink_to("f")


@pytest.fixture(scope="module")
def big_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A commit past SYNCFS_FROM staged files and directories: one syncfs stands for their
    fsyncs, which must not move the commit point."""
    yield from _world(tmp_path_factory.mktemp("torture-big"), _many_dirs, _rewrite_many)


_counter = iter(range(1 << 30))


def _run(script: str, args: list[str], point: str | None) -> int:
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    if point is not None:
        env[CRASH_ENV] = point
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, cwd=REPO, capture_output=True, timeout=60
    )
    assert proc.returncode in (0, -9), proc.stderr.decode()
    return proc.returncode


def _trial(
    w: World,
    point: str,
    recover_point: str | None = None,
    between: Callable[[Path, Path], None] | None = None,
) -> tuple[int, bool]:
    """Crash apply at ``point`` (and recovery at ``recover_point``), then recover for real;
    ``between(target, journal_dir)`` runs after the crash, before any recovery.
    Returns (apply's exit status, whether the tree ended in the new state)."""
    n = next(_counter)
    target = w.tmp / f"target-{n}"
    journal = w.tmp / f"journal-{n}"
    materialize(w.store, w.base, target)
    args = [str(w.tmp / "store"), str(target), w.base.hex(), w.new.hex(), str(journal)]
    status = _run(_APPLY, args, point)
    if between is not None:
        between(target, journal)
    if recover_point is not None:
        assert _run(_RECOVER, [str(target), str(journal)], recover_point) == -9
    recover(target, journal)
    state = snapshot(target)
    assert state in (w.old_state, w.new_state), f"neither old nor new after a crash at {point}"
    assert not os.listdir(journal)
    assert recover(target, journal) is False  # nothing left to do
    return status, state == w.new_state


def _committed_at(w: World, point: str) -> bool:
    """Whether a crash at ``point`` happens at or after the commit point."""
    seq = w.sequence
    step = seq.index(point) if point in seq else int(point)
    return step >= seq.index("journal")


def test_named_points(world: World) -> None:
    mid_stage, mid_op = world.stages // 2, world.ops // 2
    points = [
        "prepare", "stage:0", f"stage:{mid_stage}", f"stage:{world.stages - 1}", "staged",
        "journal", "op:0", f"op:{mid_op}", f"op:{world.ops - 1}", "applied", "prepare-deleted",
        "freeing",
    ]
    for point in points:
        status, new = _trial(world, point)
        assert status == -9, f"no crash at {point}"
        assert new == _committed_at(world, point), point


def test_named_points_of_a_commit_synced_as_a_whole(big_world: World) -> None:
    w = big_world
    assert w.stages >= commit.SYNCFS_FROM
    for point in ("stage:0", f"stage:{w.stages - 1}", "staged", "journal",
                  f"op:{w.ops // 2}", "applied"):  # fmt: skip
        status, new = _trial(w, point)
        assert status == -9, f"no crash at {point}"
        assert new == _committed_at(w, point), point
    # Recovery redoes a big journal in threads too; killed midway, it is run again.
    assert _trial(w, f"op:{w.ops // 3}", f"recover-op:{w.ops // 2}") == (-9, True)
    assert _trial(w, "no-such-point") == (0, True)


def test_a_crash_while_the_check_runs_beside_the_staging(big_world: World) -> None:
    """Killed in the conflict check's thread (at its middle and last path, the staging going
    on in the other threads) or once both ended (by name and by step index): the prepare
    record undoes whatever was staged, and the tree is exactly the old one."""
    w = big_world
    staged: list[int] = []

    def count_staged(target: Path, journal: Path) -> None:
        staged.append(sum(1 for _, _, names in os.walk(target)
                          for n in names if n.startswith(".jbx-stage-")))  # fmt: skip

    checked = len(_world_changes(w))
    for point in (f"check:{checked // 2}", f"check:{checked - 1}"):
        assert _trial(w, point, between=count_staged) == (-9, False), point
    assert _trial(w, str(w.sequence.index("checked")), between=count_staged) == (-9, False)
    assert staged[-1] == w.stages  # at "checked" everything is staged, and then undone


def test_a_staging_directory_removed_before_the_staging_is_reported_as_conflicts(
    big_world: World,
) -> None:
    """The host removes a directory the commit stages into once the commit has planned (it
    stops itself at "prepare"): the staging fails there, and the check running beside it
    says why, as conflicts; what was staged elsewhere is undone and nothing else changes."""
    w = big_world
    target, journal = w.tmp / "target-removed-dir", w.tmp / "journal-removed-dir"
    materialize(w.store, w.base, target)
    env = dict(os.environ, **{commit.PAUSE_ENV: "prepare"})
    env.pop(CRASH_ENV, None)
    args = [str(w.tmp / "store"), str(target), w.base.hex(), w.new.hex(), str(journal)]
    proc = subprocess.Popen([sys.executable, "-c", _APPLY, *args], env=env, cwd=REPO,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_stopped(proc)
        shutil.rmtree(target / "d005")
        left = snapshot(target)
    finally:
        resume(proc)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "ConflictError" in stderr and "(d005, d005/added, d005/f, d005/gone)" in stderr, stderr
    assert snapshot(target) == left
    assert not os.listdir(journal)
    assert recover(target, journal) is False


def _world_changes(w: World) -> list[tree.Change]:
    return commit._changes(w.store, w.base, w.new)


def test_a_crash_between_moving_a_file_aside_and_renaming_in_its_successor(
    world: World, big_world: World
) -> None:
    """The replaced file is linked into the trash and still at its path: past the commit
    point, so the redo renames the staged file in and recovery frees the trash."""
    for w in (world, big_world):  # one by one, and in threads
        assert len(w.asides) > 2
        for k in (w.asides[0], w.asides[len(w.asides) // 2], w.asides[-1]):
            assert _trial(w, f"aside:{k}") == (-9, True), k
    # Recovery killed right after its own aside, then run again.
    k = world.asides[1]
    assert _trial(world, f"aside:{world.asides[0]}", f"aside:{k}") == (-9, True)


def test_the_renames_run_a_chunk_at_a_time(big_world: World) -> None:
    """A big commit's renames run in threads a chunk at a time; the next chunk is made ready
    while one runs, but started only once it has ended: killed at a chunk's last op, every
    rename before it is done and every one after it still waits at its staging name."""
    w = big_world
    plan = commit._plan(w.store, w.new, _world_changes(w), "x")
    first = next(k for k, op in enumerate(plan.ops) if op[0] == "rename")
    end = commit._chunk_end(plan.ops, first)
    later = [op for op in plan.ops[end:] if op[0] == "rename"]
    assert later and plan.ops[end - 1][0] == "rename"
    waiting: list[list[bool]] = []

    def staged(target: Path, journal: Path) -> None:
        def there(op: list[bytes]) -> bool:  # a rename: [kind, staging dir, staged name, path]
            d = target / os.fsdecode(op[1])
            suffix = b"-" + op[2].rpartition(b"-")[2]
            return any(
                n.startswith(commit.STAGE_PREFIX) and n.endswith(suffix)
                for n in map(os.fsencode, os.listdir(d))
            )

        waiting.append([there(op) for op in plan.ops[first:end]])
        waiting.append([there(op) for op in later])

    assert _trial(w, f"op:{end - 1}", between=staged) == (-9, True)
    done, after = waiting
    assert not any(done)
    assert all(after)


def test_a_redo_needs_nothing_from_the_trash(big_world: World) -> None:
    """Killed in threads between linking a replaced file into the (sharded) trash and renaming
    its successor in: the old file is at both names. With the trash then gone altogether, the
    redo's unchecked links put the already renamed new files into a fresh trash, which is
    freed: harmless, the tree still ends exactly new."""
    w = big_world
    k = w.asides[len(w.asides) // 2]
    linked: list[int] = []

    def inspect_and_wipe(target: Path, journal: Path) -> None:
        trash = journal / commit.TRASH_NAME
        kept = [p for p in trash.rglob(f"*-{k}") if p.is_file()]
        assert len(kept) == 1 and kept[0].parent.name == str(k % 16), kept
        linked.append(kept[0].stat().st_nlink)
        shutil.rmtree(trash)

    assert _trial(w, f"aside:{k}", between=inspect_and_wipe) == (-9, True)
    assert linked == [2]  # the trash's name and the path's: nothing freed, nothing moved yet


def test_a_torn_journal_is_no_commit(world: World) -> None:
    status, new = _trial(world, "torn-journal")
    assert status == -9
    assert new is False


def test_crash_during_recovery_then_recover_again(world: World) -> None:
    for point, again in [("op:0", "recover-op:0"), (f"op:{world.ops // 2}", "recover-op:1"),
                         ("journal", "recover-applied"), ("applied", "recover-prepare-deleted")]:
        status, new = _trial(world, point, again)
        assert (status, new) == (-9, True), (point, again)


def test_random_step_indices(world: World) -> None:
    rng = random.Random(SEED)
    steps = len(world.sequence)
    for _ in range(TRIALS):
        step = rng.randrange(steps + 1)  # one past the end: no crash, a clean commit
        status, new = _trial(world, str(step))
        if step == steps:
            assert (status, new) == (0, True)
        else:
            assert status == -9, f"no crash at step {step}"
            assert new == _committed_at(world, str(step)), step
