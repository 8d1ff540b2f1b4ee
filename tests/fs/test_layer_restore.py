"""Layer.restore: what a rollback leaves behind, on the fast paths (a step the layer built, files
nobody holds) and the slow ones (trees it never built, files the kernel or a handle knows)."""

from __future__ import annotations

import os
import random
import stat
import time
from pathlib import Path

import pytest

from shadowfs import tree
from shadowfs.layer import SRC_BASE, SRC_STORE, Layer
from shadowfs.mountctl import Mount
from shadowfs.oid import ObjectId, hash_object
from shadowfs.store import Store
from tests.fs.conftest import needs_fuse

View = dict[bytes, tuple[object, ...]]


def layer_view(layer: Layer) -> View:
    """Every path as the layer serves it: kind, mode, size, mtime and content or link target."""
    out: View = {}
    for path, node in layer.walk():
        st = layer.stat(path)
        kind = stat.S_IFMT(st.st_mode)
        if kind == stat.S_IFREG:
            body: object = layer.read_file(path)
        elif kind == stat.S_IFLNK:
            body = layer.readlink(node.ino)
        else:
            body = None
        size = 0 if kind == stat.S_IFDIR else st.st_size
        out[path] = (kind, stat.S_IMODE(st.st_mode), size, st.st_mtime_ns, body)
    return out


def tree_view(store: Store, tree_id: ObjectId) -> View:
    """The same, read from the tree in the store."""
    kinds = {tree.FILE: stat.S_IFREG, tree.DIR: stat.S_IFDIR, tree.SYMLINK: stat.S_IFLNK}
    out: View = {}
    for path, e in tree.walk(store, tree_id):
        if e.kind == tree.FILE:
            body: object = store.read_bytes(e.oid)  # type: ignore[arg-type]
        elif e.kind == tree.SYMLINK:
            body = e.target
        else:
            body = None
        out[path] = (kinds[e.kind], e.mode, e.size, e.mtime_ns, body)
    return out


def test_rollback_to_the_previous_snapshot_restores_every_kind_of_change(
    layer: Layer, store: Store
) -> None:
    before, _ = layer.snapshot()
    expected = tree_view(store, before)
    unchanged = {p: layer.resolve(p).ino for p in ("src/util.py", "docs", "docs/deep")}
    layer.write_file("src/main.py", b"edited\n")
    layer.write_file("src/added.py", b"new\n")
    layer.delete("README")
    layer.delete("docs/deep", recursive=True)
    layer.mkdir("made/deeper", parents=True)
    layer.write_file("made/deeper/f", b"f")
    root = layer.root.ino
    layer.setattr(layer.resolve("run.sh").ino, mode=0o700)
    layer.rename(root, b"with space.txt", root, b"renamed.txt")
    layer.delete("link")
    layer.symlink(root, b"link", b"src/main.py")
    layer.snapshot()

    layer.restore(before)

    assert layer_view(layer) == expected
    assert layer.resolve("src/util.py").ino == unchanged["src/util.py"]
    assert layer.resolve("docs").ino == unchanged["docs"], "directories keep their inode"
    assert layer.resolve("docs/deep").ino != unchanged["docs/deep"], "a deleted dir comes back new"
    assert layer.resolve("src/main.py").src == SRC_BASE, "base content is served from the base"
    # The layer keeps working from the restored state: a new change snapshots as expected.
    layer.write_file("src/main.py", b"again\n")
    t, _ = layer.snapshot()
    assert tree_view(store, t)[b"src/main.py"][4] == b"again\n"
    assert tree_view(store, t)[b"README"] == expected[b"README"]


def test_a_rolled_back_file_gets_a_new_inode_number_and_the_old_one_is_gone(
    layer: Layer, tmp_path: Path
) -> None:
    layer.write_file("notes.txt", b"one\n")
    first, _ = layer.snapshot()
    old = layer.resolve("notes.txt")
    old_ino = old.ino
    layer.write_file("notes.txt", b"two, longer\n")
    layer.snapshot()

    layer.restore(first)

    node = layer.resolve("notes.txt")
    assert node.ino != old_ino
    assert layer.node(node.ino) is node
    with pytest.raises(FileNotFoundError):
        layer.node(old_ino)
    assert node.src == SRC_STORE and not node.dirty
    st = layer.stat("notes.txt")
    assert (st.st_size, st.st_nlink) == (4, 1)
    assert layer.read_file("notes.txt") == b"one\n"
    staged = tmp_path / "scratch" / str(old_ino)
    # The scratch worker removes it in the background, at its next wake-up: at the latest
    # when the layer closes.
    assert staged.exists()
    layer.close()
    deadline = time.monotonic() + 10
    while staged.exists():
        assert time.monotonic() < deadline, "the old inode's staged file was never removed"
        time.sleep(0.002)


def test_a_handle_open_across_a_rollback_keeps_what_it_opened(layer: Layer) -> None:
    layer.write_file("held.txt", b"version one\n")
    first, _ = layer.snapshot()
    layer.write_file("held.txt", b"version two\n")
    layer.snapshot()
    held = layer.resolve("held.txt")
    h = layer.open(held.ino, os.O_RDONLY)
    try:
        layer.restore(first)
        assert layer.read(h, 0, 100) == b"version two\n", "open files act as unlinked ones"
        assert layer.read_file("held.txt") == b"version one\n"
        assert layer.resolve("held.txt") is not held
        assert layer.alive(held) and not held.links
    finally:
        layer.release(h.fh)
    assert not layer.alive(held), "dropped once its last handle closes"


def test_hard_links_come_back_as_one_file(layer: Layer, store: Store) -> None:
    root = layer.root.ino
    readme = layer.resolve("README")
    layer.link(readme.ino, root, b"hard")
    first, _ = layer.snapshot()
    h = layer.open(readme.ino, os.O_WRONLY | os.O_TRUNC)
    layer.write(h, 0, b"both names\n")
    layer.release(h.fh)
    layer.snapshot()

    layer.restore(first)

    assert layer.read_file("README") == layer.read_file("hard") == b"readme\n"
    node = layer.resolve("hard")
    assert layer.resolve("README") is node and layer.nlink(node) == 2
    h = layer.open(node.ino, os.O_WRONLY | os.O_TRUNC)
    layer.write(h, 0, b"through hard\n")
    layer.release(h.fh)
    assert layer.read_file("README") == b"through hard\n", "trees carry link identity"
    again, _ = layer.snapshot()
    e1, e2 = tree.lookup(store, again, b"README"), tree.lookup(store, again, b"hard")
    assert e1 is not None and e2 is not None and e1.link == e2.link != 0
    assert e1.oid == e2.oid


def test_nodes_the_kernel_knows_are_replaced_and_their_caches_invalidated(layer: Layer) -> None:
    layer.write_file("src/main.py", b"changed\n")
    layer.snapshot()
    first = layer.last_tree
    layer.write_file("src/main.py", b"changed again\n")
    layer.snapshot()
    src = layer.resolve("src")
    known = layer.resolve("src/main.py")
    # What the FUSE server does when it answers a lookup: the kernel now holds a reference.
    for node in (layer.root, src, known):
        node.lookups += 1
    layer.take_invalidations()

    layer.restore(first)

    fresh = layer.resolve("src/main.py")
    assert fresh is not known and fresh.ino != known.ino
    inval = layer.take_invalidations()
    assert ("entry", src.ino, b"main.py") in inval
    assert ("inode", src.ino, True) in inval
    assert layer.alive(known), "kept until the kernel forgets it"
    layer.forget(known.ino, 1)
    assert not layer.alive(known)
    assert layer.read_file("src/main.py") == b"changed\n"


def test_restores_between_any_snapshots_match_their_trees(layer: Layer, store: Store) -> None:
    # Random steps and snapshots, then restores in every direction: back one step (the
    # remembered build), several steps, forward, and to the base. Each must serve exactly the
    # target tree, and the layer must go on producing correct snapshots afterwards.
    rng = random.Random(7)
    snaps = [layer.snapshot()[0]]
    files = ["README", "src/main.py", "src/util.py", "docs/deep/er/note.md", "run.sh"]
    for step in range(40):
        for _ in range(rng.randint(1, 4)):
            roll = rng.random()
            path = rng.choice(files)
            if roll < 0.5:
                if layer.exists(os.path.dirname(path) or "."):
                    layer.write_file(path, f"step {step} {rng.random()}\n".encode())
            elif roll < 0.65 and layer.exists(path):
                layer.delete(path, recursive=True)
            elif roll < 0.8:
                d = f"dir{rng.randint(0, 3)}"
                layer.mkdir(f"{d}/sub", parents=True, exist_ok=True)
                layer.write_file(f"{d}/f{step}", b"x")
            elif layer.exists(path):
                layer.setattr(layer.resolve(path).ino, mode=rng.choice([0o600, 0o644, 0o755]))
        if rng.random() < 0.3:
            if layer.exists("src"):
                layer.delete("src", recursive=True)
            else:
                layer.mkdir("src")
        snaps.append(layer.snapshot()[0])
        if rng.random() < 0.4:
            target = snaps[-2] if rng.random() < 0.5 else rng.choice(snaps)
            layer.restore(target)
            assert layer_view(layer) == tree_view(store, target)
            snaps.append(target)
    for target in (snaps[0], snaps[-1], layer.base_tree, snaps[len(snaps) // 2]):
        layer.restore(target)
        assert layer_view(layer) == tree_view(store, target)
    layer.write_file("after.txt", b"after\n")
    t, _ = layer.snapshot()
    assert tree_view(store, t) == {
        **tree_view(store, snaps[len(snaps) // 2]),
        b"after.txt": tree_view(store, t)[b"after.txt"],
    }


def test_restore_with_unsnapshotted_work_stores_it_durably(
    layer: Layer, store: Store, tmp_path: Path
) -> None:
    first, _ = layer.snapshot()
    layer.write_file("README", b"unsaved\n")
    layer.restore(first)  # durable=True: what it folded is on disk and indexed
    unsaved = hash_object("blob", b"unsaved\n")
    with Store.open(tmp_path / "store", create=False) as other:
        assert other.read_bytes(unsaved) == b"unsaved\n"
    assert layer.read_file("README") == b"readme\n"


@needs_fuse
@pytest.mark.fuse
def test_through_a_mount_stat_and_open_see_the_rollback(layer: Layer, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with Mount(layer, mnt):
        (mnt / "a.txt").write_bytes(b"first\n")
        (mnt / "same.txt").write_bytes(b"same\n")
        first, _ = layer.snapshot()
        (mnt / "a.txt").write_bytes(b"second, longer\n")
        layer.snapshot()
        before = os.stat(mnt / "a.txt")
        same = os.stat(mnt / "same.txt").st_ino
        with open(mnt / "a.txt", "rb") as held:
            layer.restore(first)
            assert held.read() == b"second, longer\n"
        after = os.stat(mnt / "a.txt")
        assert after.st_ino != before.st_ino and after.st_size == 6
        assert (mnt / "a.txt").read_bytes() == b"first\n"
        assert os.stat(mnt / "same.txt").st_ino == same


def test_snapshots_after_rollbacks_encode_only_their_own_changes(
    layer: Layer, store: Store, tmp_path: Path
) -> None:
    # Each step edits a different file of one directory from the same starting tree, the way an
    # agent retries after a rollback; a directory's kept entry records must stay those of the
    # tree they were made for, whichever build reused them.
    start, _ = layer.snapshot()
    names = [
        p for p, node in layer.walk()
        if node.fmt == stat.S_IFREG and b"/" not in p and p != b"big.bin"
    ][:4]
    assert len(names) == 4
    original = {p: layer.read_file(p) for p in names}
    for step, edited in enumerate(names):
        layer.write_file(edited, b"step %d\n" % step)
        tree_id, _ = layer.snapshot()
        # Decoded from the stored bytes: the tree cache holds what the build meant to encode.
        got = {e.name: store.read_bytes(e.oid) for e in tree.decode_tree(store.get(tree_id))
               if e.kind == tree.FILE}
        for p in names:
            assert got[p] == (b"step %d\n" % step if p == edited else original[p]), (step, p)
        layer.restore(start)
        assert tree_view(store, layer.snapshot()[0]) == tree_view(store, start)


def test_a_restored_name_of_a_loaded_file_joins_it_before_any_write(layer: Layer) -> None:
    root = layer.root.ino
    layer.write_file("f", b"one\n")
    layer.mkdir("newdir")
    layer.link(layer.resolve("f").ino, layer.resolve("newdir").ino, b"g")
    with_g, _ = layer.snapshot()
    layer.delete("newdir", recursive=True)
    layer.snapshot()
    # Back to with_g: newdir comes back unloaded, f's node stays as it was.
    layer.restore(with_g)
    node = layer.resolve("f")
    h = layer.open(node.ino, os.O_WRONLY | os.O_TRUNC)
    layer.write(h, 0, b"two\n")
    layer.release(h.fh)
    assert layer.read_file("newdir/g") == b"two\n"
    assert layer.resolve("newdir/g") is node and layer.nlink(node) == 2
    assert root == layer.root.ino


def test_a_fifo_with_two_names_comes_back_as_one(layer: Layer, store: Store) -> None:
    root = layer.root.ino
    start, _ = layer.snapshot()
    pipe = layer.mknod(root, b"pipe", stat.S_IFIFO | 0o600)
    layer.link(pipe.ino, layer.resolve("src").ino, b"pipe2")
    both, _ = layer.snapshot()
    e1, e2 = tree.lookup(store, both, b"pipe"), tree.lookup(store, both, b"src/pipe2")
    assert e1 is not None and e2 is not None and e1.kind == "fifo" and e1.link == e2.link != 0
    layer.restore(start)
    assert not layer.exists("pipe")
    layer.restore(both)
    node = layer.resolve("pipe")
    assert layer.resolve("src/pipe2") is node and layer.nlink(node) == 2
