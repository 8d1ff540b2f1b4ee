"""The layer's staged files (`shadowfs.layer.Scratch`): pre-created on a worker thread, taken by
`create`, unlinked on the worker when their node is dropped, all gone after `Layer.close`.

The worker runs in the background, so a test that must see its work done waits for it: the
worker handles jobs in order, so once a file removed later has vanished, every removal asked for
earlier has run too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadowfs import tree as trees
from shadowfs.layer import ROOT_INO, Layer, Scratch
from shadowfs.oid import ObjectId
from shadowfs.store import Store
from tests.fs.conftest import needs_fuse, tree_state

# Generous: the worker's jobs take microseconds; only a wedged worker comes near this.
WORKER_WAIT = 10.0


def wait_gone(path: Path) -> None:
    deadline = time.monotonic() + WORKER_WAIT
    while path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} was never unlinked by the scratch worker")
        time.sleep(0.002)


def fds_into(directory: Path) -> list[str]:
    """This process's open fds whose target lies in ``directory``."""
    out = []
    prefix = f"{directory}/"
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the fd listing itself, closed meanwhile
        if target.startswith(prefix):
            out.append(target)
    return out


def layer_in(base: Path, store: Store, scratch: Path) -> Layer:
    """A layer whose scratch directory exists beforehand, so close() keeps it to be checked."""
    scratch.mkdir()
    return Layer(base, store, scratch)


def staged(scratch: Path, layer: Layer, path: str) -> Path:
    return scratch / str(layer.stat(path).st_ino)


def file_in_tree(store: Store, tree_id: ObjectId, path: bytes) -> bytes:
    entry = trees.lookup(store, tree_id, path)
    assert entry is not None and entry.oid is not None, f"{path!r} is missing from the snapshot"
    return store.read_bytes(entry.oid)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    # Made beforehand, so close() keeps the directory and its emptiness can be checked.
    d = tmp_path / "scratch"
    d.mkdir()
    return d


@pytest.fixture
def own_layer(base: Path, store: Store, scratch: Path) -> Iterator[Layer]:
    before = tree_state(base)
    lay = Layer(base, store, scratch)
    yield lay
    lay.close()
    assert tree_state(base) == before, "the base changed"


# ---------------------------------------------------------------------------- close


def test_close_leaves_no_scratch_files_and_no_fds(own_layer: Layer, scratch: Path) -> None:
    own_layer.write_file("made.txt", b"made in the layer\n")  # takes a pre-created file
    own_layer.write_file("README", b"rewritten\n")  # copy-up of a base file
    own_layer.write_file("gone.txt", b"short-lived\n")
    own_layer.delete("gone.txt")
    h = own_layer.open(own_layer.resolve("made.txt").ino, os.O_RDWR)  # left open on purpose
    own_layer.snapshot()
    # One create reserved a whole batch: the files nobody took are on disk, open, until close.
    assert len(os.listdir(scratch)) > 2
    assert fds_into(scratch)
    assert own_layer.read(h, 0, 100) == b"made in the layer\n"

    own_layer.close()

    assert os.listdir(scratch) == []
    assert fds_into(scratch) == []


def test_close_removes_a_scratch_dir_it_made(base: Path, store: Store, tmp_path: Path) -> None:
    scratch = tmp_path / "made-by-layer"
    with Layer(base, store, scratch) as lay:
        for i in range(Scratch.BATCH + 5):
            lay.write_file(f"f{i}", b"x")
        assert scratch.is_dir()
    assert not scratch.exists()


def test_close_right_after_create_waits_for_the_worker(
    base: Path, store: Store, scratch: Path
) -> None:
    # The worker may still be pre-creating the batch the first create asked for: close must not
    # scan the directory before those files exist, or they would outlive the layer.
    for _ in range(20):
        lay = Layer(base, store, scratch)
        lay.write_file("one", b"1")
        lay.close()
        assert os.listdir(scratch) == []
        assert fds_into(scratch) == []


# ---------------------------------------------------------------------------- dropped nodes


def test_a_dropped_nodes_staged_file_waits_for_the_workers_next_wake_up(
    base: Path, store: Store, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch-wait"
    lay = layer_in(base, store, scratch)
    lay.write_file("gone", b"soon\n")
    doomed = staged(scratch, lay, "gone")
    lay.delete("gone")
    # Waking the worker for one file would cost more than the file's disk space is worth: once
    # it has done everything handed to it so far, the file is still there.
    lay._files.settle()
    assert doomed.exists()
    assert not lay.exists("gone")
    lay.close()
    assert not doomed.exists() and os.listdir(scratch) == []


def test_dropped_nodes_past_the_bound_are_handed_over_at_once(
    own_layer: Layer, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("p", "q", "r"):
        own_layer.write_file(name, name.encode())
    olds = [staged(scratch, own_layer, n) for n in ("p", "q", "r")]
    monkeypatch.setattr(Scratch, "LATER_FILES", 2)
    for name in ("p", "q", "r"):
        own_layer.delete(name)  # the third is one more than the bound
    for old in olds:
        wait_gone(old)


def test_a_deleted_big_file_frees_its_space_at_once(own_layer: Layer, scratch: Path) -> None:
    # The mount's statfs is the scratch file system's: deleting to free space must free it,
    # all but the last few MiB.
    own_layer.write_file("big", b"x" * (5 * 1024 * 1024))
    doomed = staged(scratch, own_layer, "big")
    own_layer.delete("big")
    wait_gone(doomed)


def test_a_dropped_nodes_staged_file_is_unlinked(
    own_layer: Layer, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Scratch, "LATER_FILES", 0)  # each removal handed over as it comes
    for name in ("a", "b", "c", "d"):
        own_layer.write_file(name, name.encode() * 10)
    a, b, c, d = (staged(scratch, own_layer, n) for n in ("a", "b", "c", "d"))
    assert a.read_bytes() == b"a" * 10  # the staged file is the content's home

    own_layer.delete("a")
    wait_gone(a)
    assert b.exists() and c.exists() and d.exists()

    # An open handle keeps an unlinked node, and its file, alive and readable.
    h = own_layer.open(own_layer.resolve("b").ino, os.O_RDONLY)
    own_layer.delete("b")
    own_layer.delete("c")
    wait_gone(c)  # removals run in order: had b's been asked for, it would have run by now
    assert b.exists()
    assert own_layer.read(h, 0, 100) == b"b" * 10
    own_layer.release(h.fh)
    wait_gone(b)
    assert d.read_bytes() == b"d" * 10


def test_restore_drops_the_replaced_nodes_file_with_the_workers_next_job(
    own_layer: Layer, scratch: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_layer.write_file("x", b"first\n")
    own_layer.write_file("y", b"y\n")
    first, _ = own_layer.snapshot()
    own_layer.write_file("x", b"second, longer\n")
    old = staged(scratch, own_layer, "x")
    other = staged(scratch, own_layer, "y")
    own_layer.snapshot()

    own_layer.restore(first)

    # The restored file is a new node; nothing holds the old one, so its file goes, but not
    # at once: waking the worker would cost the rollback a sixth of its time.
    assert own_layer.read_file("x") == b"first\n"
    assert staged(scratch, own_layer, "x") != old
    assert old.exists()
    monkeypatch.setattr(Scratch, "LATER_FILES", 1)
    own_layer.delete("y")  # the hand-over it makes takes the waiting removal along
    wait_gone(other)
    assert not old.exists()  # asked for before y's: gone by the time y's is


def test_removals_a_restore_leaves_waiting_go_at_close(
    base: Path, store: Store, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch-close"
    lay = layer_in(base, store, scratch)
    first, _ = lay.snapshot()
    lay.write_file("x", b"changed\n")
    old = staged(scratch, lay, "x")
    lay.snapshot()
    lay.restore(first)
    assert old.exists()
    lay.close()
    assert not old.exists() and os.listdir(scratch) == []


def test_removals_past_the_bound_are_handed_over_at_once(
    own_layer: Layer, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, _ = own_layer.snapshot()
    for name in ("p", "q", "r"):
        own_layer.write_file(name, name.encode())
    olds = [staged(scratch, own_layer, n) for n in ("p", "q", "r")]
    own_layer.snapshot()
    monkeypatch.setattr(Scratch, "LATER_FILES", 2)
    own_layer.restore(first)  # three files wait: one more than the bound
    for old in olds:
        wait_gone(old)


def test_removals_past_the_byte_bound_are_handed_over_at_once(
    own_layer: Layer, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_layer.write_file("big", b"b" * 1000)
    first, _ = own_layer.snapshot()
    own_layer.write_file("big", b"c" * 1001)
    old = staged(scratch, own_layer, "big")
    own_layer.snapshot()
    monkeypatch.setattr(Scratch, "LATER_BYTES", 1000)
    own_layer.restore(first)
    wait_gone(old)


# ---------------------------------------------------------------------------- many creates


def test_many_creates_in_a_row_get_distinct_files(
    own_layer: Layer, scratch: Path, store: Store
) -> None:
    # Far more than one batch, with no pause: some creates find a pre-created file ready and
    # some make their own; either way each gets a file of its own.
    n = 5 * Scratch.BATCH + 7
    handles = []
    for i in range(n):
        h, node = own_layer.create(ROOT_INO, b"new-%d" % i, 0o644, os.O_RDWR)
        own_layer.write(h, 0, b"content of file %d\n" % i)
        handles.append((h, node))
    inos = [node.ino for _, node in handles]
    assert len(set(inos)) == n
    for i, (h, node) in enumerate(handles):
        assert (scratch / str(node.ino)).read_bytes() == b"content of file %d\n" % i
        own_layer.release(h.fh)
    tree_id, _ = own_layer.snapshot()
    for i in (0, 1, Scratch.BATCH - 1, Scratch.BATCH, n // 2, n - 1):
        assert file_in_tree(store, tree_id, b"new-%d" % i) == b"content of file %d\n" % i
    assert len(own_layer.listdir()) >= n


def test_a_create_after_a_failed_precreate_still_works(
    own_layer: Layer, scratch: Path
) -> None:
    # Stray files squatting on the names of the next batch make the worker's O_EXCL creates
    # fail; create must then make its own files, never hand out a stranger's file.
    own_layer.write_file("first", b"1")
    nxt = max(int(n) for n in os.listdir(scratch))
    for ino in range(nxt + 1, nxt + 1 + 4 * Scratch.BATCH):
        (scratch / str(ino)).write_bytes(b"stranger")
    for i in range(2 * Scratch.BATCH):
        own_layer.write_file(f"g{i}", b"mine %d" % i)
    for i in range(2 * Scratch.BATCH):
        assert own_layer.read_file(f"g{i}") == b"mine %d" % i
        assert staged(scratch, own_layer, f"g{i}").read_bytes() == b"mine %d" % i


def test_failed_precreates_do_not_stop_the_worker_for_good(
    own_layer: Layer, scratch: Path
) -> None:
    # A scratch dir left by a crashed layer: its numeric files collide with the new layer's
    # inode numbers, so a whole batch of pre-creates fails. Creates must get ready files again
    # once the worker is past the squatters, not fall back to the slow path forever.
    own_layer.write_file("first", b"1")
    nxt = max(int(n) for n in os.listdir(scratch))
    for ino in range(nxt + 1, nxt + 1 + 2 * Scratch.BATCH):
        (scratch / str(ino)).write_bytes(b"stranger")
    files = own_layer._files
    for i in range(4 * Scratch.BATCH):
        own_layer.write_file(f"h{i}", b"x")
        files.settle()  # the worker keeps up, as it does between real requests
    assert files._ready or files.low(), "no file is ready and none will be asked for"
    assert files._outstanding - files._failed >= 0


# ---------------------------------------------------------------------------- forked child


@needs_fuse
def test_a_layer_in_a_forked_mount_creates_writes_and_snapshots(
    own_layer: Layer, scratch: Path, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shadowfs.mountctl import Mount, is_mounted

    monkeypatch.setattr(Scratch, "LATER_FILES", 0)  # the child removes each dropped file at once

    # Used before the fork, so the child inherits a running worker's state (and its fds).
    own_layer.write_file("before-fork", b"parent\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mount(own_layer, mnt, process=True).start()
    try:
        n = 2 * Scratch.BATCH + 3
        for i in range(n):
            (mnt / f"m{i}").write_bytes(b"through the mount %d\n" % i)
        own_layer.write_file("routed", b"through the layer api\n")  # forwarded to the child
        with open(mnt / "appended", "wb") as f:
            f.write(b"a" * 70_000)
            f.flush()
            os.fsync(f.fileno())
        tree_id, _ = own_layer.snapshot()
        for i in range(n):
            assert (mnt / f"m{i}").read_bytes() == b"through the mount %d\n" % i
        inos = {os.stat(mnt / f"m{i}").st_ino for i in range(n)}
        assert len(inos) == n
        # The child's own worker removes what it drops (the parent's worker is not in it).
        doomed = scratch / str(os.stat(mnt / "m0").st_ino)
        assert doomed.read_bytes() == b"through the mount 0\n"
        os.unlink(mnt / "m0")
        wait_gone(doomed)
    finally:
        m.stop()
    assert not is_mounted(mnt)

    for i in (1, Scratch.BATCH, n - 1):
        assert file_in_tree(store, tree_id, b"m%d" % i) == b"through the mount %d\n" % i
    assert file_in_tree(store, tree_id, b"routed") == b"through the layer api\n"
    assert file_in_tree(store, tree_id, b"appended") == b"a" * 70_000
    assert file_in_tree(store, tree_id, b"before-fork") == b"parent\n"

    own_layer.close()
    assert os.listdir(scratch) == [], "the child's staged files outlived the layer"
    assert fds_into(scratch) == []
