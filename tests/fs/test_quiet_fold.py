"""A layer's changes stored ahead of the snapshot (`Layer.fold`, `shadowfs.quiet_fold`): the
snapshot after a fold holds exactly what it would have held, and changes made after the fold
are in it too."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shadowfs import tree
from shadowfs.journal import decode_journal
from shadowfs.layer import Layer
from shadowfs.mountctl import Mount
from shadowfs.oid import ObjectId
from shadowfs.quiet_fold import QuietFold
from shadowfs.store import Store
from tests.conftest import slow
from tests.fs.conftest import needs_fuse


def content(store: Store, tree_id: ObjectId, path: str) -> bytes:
    e = tree.lookup(store, tree_id, path.encode())
    assert e is not None and e.oid is not None, f"{path} is not in the tree"
    return store.read_bytes(e.oid)


def ops(store: Store, journal: ObjectId | None) -> list[tuple[str, tuple[bytes, ...]]]:
    assert journal is not None
    return [(o.op, o.paths) for o in decode_journal(store.get(journal))]


def until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + slow(10)
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


@pytest.fixture
def mnt(tmp_path: Path) -> Path:
    """An empty mount point."""
    path = tmp_path / "mnt"
    path.mkdir()
    return path


def test_a_snapshot_after_a_fold_takes_what_the_fold_stored(layer: Layer, store: Store) -> None:
    t0, _ = layer.snapshot()
    layer.write_file("src/main.py", b"folded\n")
    layer.write_file("added.txt", b"a")
    layer.fold()
    assert not layer.root.dirty_names, "the fold built the trees"
    assert len(layer.journal) == 4, "the journal stays for the snapshot to take"
    t1, j1 = layer.snapshot()
    assert {(c.path, c.status) for c in tree.diff_trees(store, t0, t1)} == {
        (b"src/main.py", "modified"),
        (b"added.txt", "added"),
    }
    assert content(store, t1, "src/main.py") == b"folded\n"
    assert ops(store, j1) == [
        ("truncate", (b"src/main.py",)),
        ("write", (b"src/main.py",)),
        ("create", (b"added.txt",)),
        ("write", (b"added.txt",)),
    ]
    assert layer.snapshot() == (t1, None), "the snapshot took the journal"


def test_changes_after_a_fold_are_in_the_next_snapshot(layer: Layer, store: Store) -> None:
    layer.snapshot()
    layer.write_file("src/main.py", b"first\n")
    layer.fold()
    folded = layer.last_tree
    h = layer.open(layer.resolve("src/main.py").ino, os.O_RDWR)
    layer.write(h, 6, b"second\n")
    layer.release(h.fh)
    layer.write_file("late.txt", b"late")
    t1, j1 = layer.snapshot()
    assert t1 != folded
    assert content(store, t1, "src/main.py") == b"first\nsecond\n"
    assert content(store, t1, "late.txt") == b"late"
    assert ops(store, j1)[:2] == [("truncate", (b"src/main.py",)), ("write", (b"src/main.py",))]
    assert ("create", (b"late.txt",)) in ops(store, j1)


def test_a_write_extending_the_folded_journal_is_not_lost(layer: Layer, store: Store) -> None:
    layer.write_file("notes.txt", b"")
    layer.snapshot()
    h = layer.open(layer.resolve("notes.txt").ino, os.O_RDWR)
    layer.write(h, 0, b"one ")
    layer.fold()  # the journal's open write record may still grow
    layer.write(h, 4, b"two")
    layer.release(h.fh)
    t1, j1 = layer.snapshot()
    assert content(store, t1, "notes.txt") == b"one two"
    writes = [o for o in decode_journal(store.get(j1)) if o.op == "write"]
    assert [(o.offset, o.length) for o in writes] == [(0, 7)]


def test_a_rollback_after_a_fold_is_in_the_next_snapshot(layer: Layer, store: Store) -> None:
    t0, _ = layer.snapshot()
    layer.write_file("src/main.py", b"undone\n")
    layer.fold()
    layer.restore(t0)  # records an op, changes no name: only the journal says it happened
    t1, j1 = layer.snapshot()
    assert t1 == t0
    assert [op for op, _ in ops(store, j1)] == ["truncate", "write", "restore"]


def test_quiet_fold_folds_once_writes_stop_and_again_after_new_ones(
    layer: Layer, store: Store
) -> None:
    # Unmounted, the layer has no lock of its own: the test's writes and the folds share one.
    lock = threading.Lock()

    def fold() -> None:
        with lock:
            layer.fold()

    layer.snapshot()
    quiet = QuietFold(layer, quiet=0.01, fold=fold).start()
    try:
        for round_ in (1, 2):
            with lock:
                layer.write_file("src/main.py", b"round %d\n" % round_)
                assert layer.root.dirty_names
            until(lambda: not layer.root.dirty_names, f"round {round_}'s changes are folded")
            with lock:
                t, j = layer.snapshot()
            assert content(store, t, "src/main.py") == b"round %d\n" % round_
            assert ops(store, j)[0] == ("truncate", (b"src/main.py",))
    finally:
        quiet.close()
    assert layer.on_dirty is None


@pytest.mark.fuse
@needs_fuse
def test_a_checkpoint_through_a_mount_after_a_quiet_fold(
    layer: Layer, store: Store, mnt: Path
) -> None:
    with Mount(layer, mnt):
        layer.snapshot()
        quiet = QuietFold(layer, quiet=0.01).start()
        try:
            for i in range(10):
                (mnt / f"f{i}.txt").write_text(f"step one {i}\n")
            until(lambda: not layer.root.dirty_names, "the step is folded")
            t1, j1 = layer.snapshot(durable=False)
            with open(mnt / "f3.txt", "a") as f:  # then a change the fold has not seen
                f.write("step two\n")
            t2, j2 = layer.snapshot(durable=False)
        finally:
            quiet.close()
    assert [content(store, t1, f"f{i}.txt") for i in range(10)] == [
        f"step one {i}\n".encode() for i in range(10)
    ]
    assert {op for op, _ in ops(store, j1)} >= {"create", "write"}
    assert content(store, t2, "f3.txt") == b"step one 3\nstep two\n"
    assert ("write", (b"f3.txt",)) in ops(store, j2)


def test_a_snapshot_answers_with_its_ids_before_its_bookkeeping(layer: Layer, store: Store) -> None:
    layer.snapshot()
    seen: list[tuple[ObjectId, ObjectId | None, int]] = []

    def answer(tree_id: ObjectId, journal_id: ObjectId | None) -> None:
        assert journal_id is not None
        decode_journal(store.get(journal_id))  # readable through the store already
        seen.append((tree_id, journal_id, len(layer.journal)))

    layer.write_file("src/main.py", b"folded\n")
    layer.fold()
    folded = layer.snapshot(answer=answer)  # the fold left it all: only a marker
    layer.write_file("src/main.py", b"not folded\n")
    plain = layer.snapshot(answer=answer)
    assert [(t, j) for t, j, _ in seen] == [folded, plain]
    assert seen[0][2] > 0, "after a fold the answer comes before the journal is let go"
    assert content(store, folded[0], "src/main.py") == b"folded\n"
    assert content(store, plain[0], "src/main.py") == b"not folded\n"


@pytest.mark.fuse
@needs_fuse
def test_a_write_racing_an_answered_checkpoint_is_in_the_next_one(
    layer: Layer, store: Store, mnt: Path
) -> None:
    racer: list[threading.Thread] = []

    def race(tree_id: ObjectId, journal_id: ObjectId | None) -> None:
        # Sent while the snapshot still holds the layer: the write waits for its end.
        def write() -> None:
            with open(mnt / "racing.txt", "w") as f:
                f.write("raced\n")

        racer.append(threading.Thread(target=write))
        racer[0].start()
        time.sleep(0.05)  # long enough for the write to reach the layer lock; either way right

    with Mount(layer, mnt):
        layer.snapshot()
        quiet = QuietFold(layer, quiet=0.01).start()
        try:
            (mnt / "step.txt").write_text("step\n")
            until(lambda: not layer.root.dirty_names, "the step is folded")
            t1, j1 = layer.snapshot(durable=False, answer=race)
            racer[0].join(slow(10))
            t2, j2 = layer.snapshot(durable=False)
        finally:
            quiet.close()
    assert content(store, t1, "step.txt") == b"step\n"
    assert tree.lookup(store, t1, b"racing.txt") is None
    assert ("create", (b"racing.txt",)) not in ops(store, j1)
    assert content(store, t2, "racing.txt") == b"raced\n"
    assert ("create", (b"racing.txt",)) in ops(store, j2)
