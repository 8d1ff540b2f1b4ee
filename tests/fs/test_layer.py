"""The copy-on-write layer used in process, with no mount: reads, writes, snapshots, restores."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import stat
import time
from pathlib import Path

import pytest

from shadowfs import tree
from shadowfs.journal import Journal, JournalOp, decode_journal, encode_journal
from shadowfs.layer import RENAME_EXCHANGE, RENAME_NOREPLACE, SRC_BASE, Layer
from shadowfs.oid import ObjectId
from shadowfs.store import FLUSH_DELAY, Store

BAD = b"bad-\xff\xfe.txt"


def scratch_files(tmp_path: Path) -> list[str]:
    d = tmp_path / "scratch"
    return sorted(os.listdir(d)) if d.exists() else []


def test_reads_the_base_through_the_layer(layer: Layer, base: Path) -> None:
    assert layer.read_file("src/main.py") == b"print('hello')\n"
    assert layer.read_file("big.bin") == (base / "big.bin").read_bytes()
    assert layer.listdir("") == sorted(os.listdir(base))
    assert layer.listdir(b"") == sorted(os.listdir(os.fsencode(base)))
    assert layer.read_file(BAD) == b"invalid utf-8 name\n"
    assert layer.read_file("new\nline.txt") == b"newline\n"
    assert layer.exists("docs/deep/er/note.md") and not layer.exists("docs/nope")
    st = layer.stat("run.sh")
    assert st.st_mode & 0o777 == 0o755
    assert st.st_mtime_ns == os.stat(base / "run.sh").st_mtime_ns
    assert st.st_uid == os.stat(base / "run.sh").st_uid


def test_writes_stay_in_the_layer(layer: Layer, base: Path) -> None:
    # The fixture asserts the base is unchanged at the end.
    layer.write_file("README", b"changed\n")
    layer.write_file("src/new.py", b"x = 1\n")
    layer.delete("src/util.py")
    layer.mkdir("made/deeper", parents=True)
    layer.delete("docs", recursive=True)
    assert layer.read_file("README") == b"changed\n"
    assert layer.read_file("src/new.py") == b"x = 1\n"
    assert not layer.exists("src/util.py") and not layer.exists("docs")
    assert layer.listdir("made") == ["deeper"]
    with pytest.raises(FileNotFoundError):
        layer.read_file("src/util.py")
    with pytest.raises(FileNotFoundError):
        layer.write_file("no/such/dir.txt", b"")


def test_copy_up_only_on_write_intent_and_inode_numbers_stay(layer: Layer, tmp_path: Path) -> None:
    node = layer.resolve("README")
    ino = node.ino
    h = layer.open(ino, os.O_RDONLY)
    assert layer.read(h, 0, 100) == b"readme\n"
    layer.release(h.fh)
    assert node.src == SRC_BASE and scratch_files(tmp_path) == []
    h = layer.open(ino, os.O_RDWR)
    assert scratch_files(tmp_path) == [str(ino)]
    layer.write(h, 0, b"R")
    layer.release(h.fh)
    assert layer.resolve("README").ino == ino
    assert layer.read_file("README") == b"Readme\n"


def test_truncating_copy_up_copies_only_what_it_keeps(layer: Layer, tmp_path: Path) -> None:
    node = layer.resolve("big.bin")
    layer.setattr(node.ino, size=10)
    assert os.path.getsize(tmp_path / "scratch" / str(node.ino)) == 10
    assert layer.stat("big.bin").st_size == 10
    layer.write_file("README", b"")
    assert layer.read_file("README") == b""


def test_snapshot_costs_nothing_when_nothing_changed(layer: Layer) -> None:
    t0, j0 = layer.snapshot()
    assert t0 == layer.base_tree and j0 is None
    layer.read_file("README")
    assert layer.snapshot() == (t0, None)


def test_checkpoints_and_rollbacks_keep_the_cyclic_collector_out(
    layer: Layer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a 100,000-file tree a young-generation pass cost ~0.5 ms inside one snapshot in five:
    # the collector is off while a snapshot folds and a restore reconciles, and back on after.
    seen: list[tuple[str, bool]] = []
    fold, reconcile = Layer._fold, Layer._reconcile

    def folding(self: Layer) -> ObjectId:
        seen.append(("fold", gc.isenabled()))
        return fold(self)

    def reconciling(self: Layer, *args: object) -> None:
        seen.append(("reconcile", gc.isenabled()))
        reconcile(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Layer, "_fold", folding)
    monkeypatch.setattr(Layer, "_reconcile", reconciling)
    assert gc.isenabled()
    t0, _ = layer.snapshot()
    layer.write_file("README", b"changed\n")
    layer.snapshot(durable=False)
    assert gc.isenabled()
    layer.restore(t0)
    assert gc.isenabled()
    assert ("fold", False) in seen and ("reconcile", False) in seen
    assert all(not on for _, on in seen)
    assert layer.read_file("README") == b"readme\n"
    # A collector the program turned off stays off.
    gc.disable()
    try:
        layer.write_file("README", b"again\n")
        layer.snapshot()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_snapshot_records_exactly_the_changes(layer: Layer, store: Store) -> None:
    t0, _ = layer.snapshot()
    layer.write_file("src/main.py", b"print('bye')\n")
    layer.write_file("added.txt", b"a")
    layer.delete("link")
    t1, j1 = layer.snapshot()
    changes = {(c.path, c.status) for c in tree.diff_trees(store, t0, t1)}
    assert changes == {(b"src/main.py", "modified"), (b"added.txt", "added"), (b"link", "deleted")}
    # Untouched sub-trees keep their ids (path copying, not a rebuild).
    assert tree.lookup(store, t1, b"docs") == tree.lookup(store, t0, b"docs")
    assert tree.lookup(store, t1, b"src").oid != tree.lookup(store, t0, b"src").oid
    assert store.read_bytes(tree.lookup(store, t1, b"added.txt").oid) == b"a"
    ops = decode_journal(store.get(j1))
    assert [(o.op, o.paths, o.offset, o.length) for o in ops] == [
        ("truncate", (b"src/main.py",), 0, 0),
        ("write", (b"src/main.py",), 0, 13),
        ("create", (b"added.txt",), 0, 0),
        ("write", (b"added.txt",), 0, 1),
        ("unlink", (b"link",), 0, 0),
    ]
    assert all(o.pid == os.getpid() for o in ops)
    assert layer.snapshot() == (t1, None), "the journal was taken by the snapshot"


def test_snapshot_matches_a_fresh_build_of_the_same_tree(
    layer: Layer, store: Store, tmp_path: Path
) -> None:
    layer.write_file("src/main.py", b"v2\n")
    layer.write_file(b"fresh \xff name", b"odd")
    layer.delete("docs/deep", recursive=True)
    layer.mkdir("docs/deep")
    layer.write_file("docs/deep/only.txt", b"only")
    t1, _ = layer.snapshot()
    out = tmp_path / "out"
    tree.materialize(store, t1, out)
    assert (out / "docs" / "deep" / "only.txt").read_bytes() == b"only"
    assert not (out / "docs" / "deep" / "er").exists(), "a re-created dir must be opaque"
    assert (out / "src" / "main.py").read_bytes() == b"v2\n"
    assert (out / "big.bin").read_bytes() == layer.read_file("big.bin")
    assert os.readlink(out / "link") == "README"


def test_restore_goes_back_and_forth(layer: Layer, store: Store) -> None:
    t0, _ = layer.snapshot()
    readme_ino = layer.resolve("README").ino
    src_ino = layer.resolve("src").ino
    layer.write_file("src/main.py", b"changed\n")
    layer.delete("docs", recursive=True)
    layer.write_file("new.txt", b"new")
    t1, _ = layer.snapshot()
    layer.restore(t0)
    assert layer.read_file("src/main.py") == b"print('hello')\n"
    assert layer.read_file("docs/deep/er/note.md") == b"# note\n"
    assert not layer.exists("new.txt")
    assert layer.resolve("README").ino == readme_ino, "unchanged paths keep their inode"
    assert layer.resolve("src").ino == src_ino, "directories keep their inode"
    assert layer.snapshot()[0] == t0
    layer.restore(t1)
    assert layer.read_file("src/main.py") == b"changed\n"
    assert layer.read_file("new.txt") == b"new"
    assert not layer.exists("docs")
    # Content restored from the store is written through a copy from the store.
    layer.restore(t0)
    node = layer.resolve("src/main.py")
    assert node.src == SRC_BASE, "content equal to the base is served from the base again"
    layer.restore(t1)
    h = layer.open(layer.resolve("new.txt").ino, os.O_RDWR)
    layer.write(h, 3, b"er")
    layer.release(h.fh)
    assert layer.read_file("new.txt") == b"newer"
    t2, _ = layer.snapshot()
    assert store.read_bytes(tree.lookup(store, t2, b"new.txt").oid) == b"newer"


def test_restore_folds_unsnapshotted_work_into_the_store(layer: Layer, store: Store) -> None:
    t0, _ = layer.snapshot()
    layer.write_file("README", b"unsaved work\n")
    layer.restore(t0)
    assert layer.read_file("README") == b"readme\n"
    _, journal = layer.snapshot()
    ops = [o.op for o in decode_journal(store.get(journal))]
    assert ops[-1] == "restore" and "truncate" in ops


def test_restore_to_an_unrelated_tree(layer: Layer, store: Store, tmp_path: Path) -> None:
    other = tmp_path / "other"
    (other / "src").mkdir(parents=True)
    (other / "src" / "main.py").write_text("other\n")
    (other / "README").mkdir()
    target = tree.build_tree(store, other)
    layer.restore(target)
    assert layer.listdir("") == ["README", "src"]
    assert layer.listdir("README") == []
    assert layer.read_file("src/main.py") == b"other\n"
    assert layer.snapshot()[0] == target


def test_hard_links_share_content(layer: Layer, store: Store) -> None:
    readme = layer.resolve("README")
    root = layer.root.ino
    layer.link(readme.ino, root, b"hard")
    assert layer.stat("hard").st_nlink == 2 and layer.stat("hard").st_ino == readme.ino
    h = layer.open(readme.ino, os.O_WRONLY)
    layer.write(h, 0, b"X")
    layer.release(h.fh)
    assert layer.read_file("hard") == b"Xeadme\n"
    t, _ = layer.snapshot()
    assert tree.lookup(store, t, b"hard").oid == tree.lookup(store, t, b"README").oid
    layer.delete("README")
    assert layer.stat("hard").st_nlink == 1 and layer.read_file("hard") == b"Xeadme\n"


def test_rename_rules(layer: Layer) -> None:
    root = layer.root.ino
    src = layer.resolve("src").ino
    with pytest.raises(OSError) as e:
        layer.rename(root, b"README", root, b"run.sh", RENAME_NOREPLACE)
    assert e.value.errno == errno.EEXIST
    layer.rename(root, b"README", root, b"run.sh", RENAME_EXCHANGE)
    assert layer.read_file("run.sh") == b"readme\n"
    assert layer.read_file("README").startswith(b"#!/bin/sh")
    with pytest.raises(OSError) as e:
        layer.rename(root, b"src", src, b"inside")
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:
        layer.rename(root, b"empty", root, b"docs")
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as e:
        layer.rename(root, b"README", root, b"empty")
    assert e.value.errno == errno.EISDIR
    layer.rename(root, b"docs", src, b"docs")
    assert layer.read_file("src/docs/deep/er/note.md") == b"# note\n"
    layer.rename(src, b"main.py", root, b"main.py")
    assert layer.read_file("main.py") == b"print('hello')\n"


def test_rename_of_an_unloaded_base_directory_keeps_its_content(layer: Layer) -> None:
    root = layer.root.ino
    layer.rename(root, b"docs", root, b"moved")
    layer.write_file("moved/deep/er/more.md", b"more")
    t, _ = layer.snapshot()
    layer.restore(layer.base_tree)
    assert layer.read_file("docs/deep/er/note.md") == b"# note\n"
    layer.restore(t)
    assert layer.read_file("moved/deep/er/note.md") == b"# note\n"
    assert layer.read_file("moved/deep/er/more.md") == b"more"


def test_symlinks(layer: Layer, store: Store) -> None:
    root = layer.root.ino
    assert layer.readlink(layer.resolve("link").ino) == b"README"
    layer.symlink(root, b"l2", b"src/main.py")
    t, _ = layer.snapshot()
    e = tree.lookup(store, t, b"l2")
    assert e.kind == tree.SYMLINK and e.target == b"src/main.py"
    with pytest.raises(OSError):
        layer.symlink(root, b"l3", b"")


def test_xattrs_are_kept_in_the_layer(layer: Layer, base: Path) -> None:
    try:
        os.setxattr(base / "README", "user.origin", b"base")
    except OSError:
        pytest.skip("the temp file system has no user xattrs")
    node = layer.resolve("README")
    assert layer.getxattr(node.ino, b"user.origin") == b"base"
    layer.setxattr(node.ino, b"user.added", b"layer")
    assert sorted(layer.listxattr(node.ino)) == [b"user.added", b"user.origin"]
    layer.removexattr(node.ino, b"user.origin")
    with pytest.raises(OSError):
        layer.getxattr(node.ino, b"user.origin")
    assert os.getxattr(base / "README", "user.origin") == b"base"
    assert os.listxattr(base / "README") == ["user.origin"]


def test_given_base_tree_is_used_as_is(base: Path, store: Store, tmp_path: Path) -> None:
    built = tree.build_tree(store, base)
    with Layer(base, store, tmp_path / "s2", base_tree=built) as lay:
        assert lay.base_tree == built and lay.snapshot()[0] == built


def test_close_leaves_no_residue(base: Path, store: Store, tmp_path: Path) -> None:
    lay = Layer(base, store, tmp_path / "scratch2")
    lay.write_file("README", b"x")
    lay.write_file("n.txt", b"y")
    assert os.listdir(tmp_path / "scratch2")
    lay.close()
    assert not (tmp_path / "scratch2").exists()


def test_journal_coalesces_sequential_writes_and_round_trips() -> None:
    j = Journal()
    j.record("create", (b"a",), 7, arg=0o644)
    for i in range(100):
        j.write(3, b"a", 7, i * 10, 10)
    j.write(3, b"a", 7, 5000, 1)
    j.write(4, b"b \xff\n", 8, 0, 2)
    j.record("rename", (b"a", b"c"), 9, arg=1)
    ops = j.take()
    assert len(j) == 0
    assert [(o.op, o.offset, o.length) for o in ops] == [
        ("create", 0, 0),
        ("write", 0, 1000),
        ("write", 5000, 1),
        ("write", 0, 2),
        ("rename", 0, 0),
    ]
    data = encode_journal(ops)
    assert decode_journal(data) == ops
    assert encode_journal(decode_journal(data)) == data
    with pytest.raises(ValueError):
        decode_journal(data[:-1])
    with pytest.raises(ValueError):
        decode_journal(b"XXXX\x01")
    with pytest.raises(ValueError):
        encode_journal([JournalOp("explode", (), 0, 0)])


BIG_CHILD = r"""
import os, resource, sys
from shadowfs.layer import Layer
from shadowfs.oid import ObjectId
from shadowfs.store import Store
base, store_dir, scratch, tree_hex, size = sys.argv[1:6]
size = int(size)
st = Store.open(store_dir)
lay = Layer(base, st, scratch, base_tree=ObjectId.from_hex(tree_hex))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
node = lay.resolve("huge")
h = lay.open(node.ino, os.O_RDWR)  # copy-up, streamed
lay.write(h, size - 4, b"tail")
lay.release(h.fh)
tree_id, _ = lay.snapshot()  # the rewritten file streams into the store
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before, after, tree_id.hex())
"""


def test_big_file_copy_up_and_snapshot_in_constant_memory(tmp_path: Path, store: Store) -> None:
    import subprocess
    import sys

    size = 256 * 1024 * 1024
    base = tmp_path / "bigbase"
    base.mkdir()
    with open(base / "huge", "wb") as f:
        f.write(os.urandom(1 << 20))
        f.truncate(size)
    base_tree = tree.build_tree(store, base)
    store.flush()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            BIG_CHILD,
            str(base),
            str(store.root),
            str(tmp_path / "sc"),
            base_tree.hex(),
            str(size),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    before, after, tree_hex = out.stdout.split()
    assert int(after) - int(before) < 64 * 1024, "peak RSS grew by more than 64 MiB"
    e = tree.lookup(store, ObjectId.from_hex(tree_hex), b"huge")
    assert e is not None and e.size == size and store.size(e.oid) == size
    assert os.path.getsize(base / "huge") == size


# --- snapshots: byte-level path copying and group-commit durability ----------------------------


def test_snapshot_repacks_records_to_the_canonical_tree(layer: Layer, base: Path, tmp_path: Path,
                                                        store: Store) -> None:
    """Snapshots re-encode from cached records; every one must equal a from-scratch build."""
    layer.snapshot()
    steps = [
        lambda: layer.write_file("src/main.py", b"print('changed')\n"),  # an existing name
        lambda: layer.write_file("src/zz_new.py", b"new\n"),  # a name added at the end
        lambda: layer.write_file("src/AA_new.py", b"first\n"),  # ... and at the front
        lambda: layer.delete("src/zz_new.py"),
        lambda: layer.mkdir("docs/fresh"),
        lambda: layer.write_file("docs/fresh/x", b"x"),
    ]
    for i, step in enumerate(steps):
        step()
        tree_id, _ = layer.snapshot()
        out = tmp_path / f"out{i}"
        tree.materialize(store, tree_id, out)
        # Built from the files themselves, with a cold cache: the same bytes, so the same id.
        assert tree.build_tree(store, out) == tree_id
        for e in tree.read_tree(store, tree_id):
            assert tree.check_entry(e) is None
    tree.clear_cache()
    assert tree.read_tree(store, tree_id) == tree.decode_tree(store.get(tree_id))


def test_records_follow_a_restore(layer: Layer) -> None:
    first, _ = layer.snapshot()
    layer.write_file("src/main.py", b"one\n")
    second, _ = layer.snapshot()
    layer.restore(first)
    layer.write_file("src/other.py", b"two\n")
    third, _ = layer.snapshot()
    # src/ was last encoded from `second`'s entries; after the restore, `first`'s must be used.
    assert layer.read_file("src/main.py") == b"print('hello')\n"
    assert tree.lookup(layer.store, third, b"src/main.py") == tree.lookup(
        layer.store, first, b"src/main.py"
    )
    assert third not in (first, second)


def test_entry_records_pack_like_encode_tree() -> None:
    oid = ObjectId(bytes(range(32)))
    entries = [
        tree.Entry(b"b", tree.FILE, 0o644, 3, 5, oid, None),
        tree.Entry(b"a", tree.SYMLINK, 0o777, 2, -7, None, b"to"),
        tree.Entry(b"c", tree.DIR, 0o755, 0, 0, oid, None),
    ]
    ordered = sorted(entries, key=lambda e: e.name)
    want = tree.encode_tree(entries)
    assert tree.pack_records(tree.entry_record(e) for e in ordered) == want
    assert tree.pack_entries(ordered) == want
    assert tree.check_entry(tree.Entry(b"a/b", tree.FILE, 0, 0, 0, oid, None)) is not None


SNAPSHOT_AND_EXIT = r"""
import sys
from shadowfs.layer import Layer
from shadowfs.store import Store
base, store_dir, scratch = sys.argv[1:4]
st = Store.open(store_dir)
lay = Layer(base, st, scratch)
lay.write_file("src/main.py", b"from a child\n")
tree_id, journal = lay.snapshot(durable=False)  # not flushed yet when this returns
print(tree_id.hex(), journal.hex())
"""


def test_group_commit_flushes_in_the_background_and_at_exit(
    layer: Layer, base: Path, tmp_path: Path, store: Store
) -> None:
    import subprocess
    import sys
    import time

    layer.write_file("src/main.py", b"soon durable\n")
    tree_id, journal = layer.snapshot(durable=False)
    # Readable at once through this store; in the index (what other processes read) in a moment.
    assert layer.store.get(tree_id)
    other = Store.open(store.root)
    try:
        deadline = time.monotonic() + 5
        while not other.has(tree_id) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.has(tree_id) and journal is not None and other.has(journal)
    finally:
        other.close()
    layer.write_file("src/main.py", b"durable now\n")
    now_id, _ = layer.snapshot()  # durable by default
    with Store.open(store.root) as third:
        assert third.has(now_id)
    # A program that snapshots and returns without closing its store still gets the flush.
    out = subprocess.run(
        [sys.executable, "-c", SNAPSHOT_AND_EXIT, str(base), str(store.root),
         str(tmp_path / "child-scratch")],
        capture_output=True, text=True, check=True, timeout=60,
    )
    child_tree, child_journal = (ObjectId.from_hex(h) for h in out.stdout.split())
    with Store.open(store.root) as fresh:
        assert fresh.has(child_tree) and fresh.has(child_journal)
        e = tree.lookup(fresh, child_tree, b"src/main.py")
        assert e is not None and fresh.read_bytes(e.oid) == b"from a child\n"


RAPID_CHECKPOINTS = r"""
import os, sys
from jukebox.booth.control import request
i = 0
while True:
    with open("f%d" % (i % 7), "w") as f:
        f.write("x" * (i % 50) + str(i))
    request({"op": "checkpoint", "label": "c%d" % i})
    i += 1
    os.write(1, b"%d\n" % i)
"""


def test_booth_killed_during_rapid_checkpoints_leaves_a_verifiable_tape(tmp_path: Path) -> None:
    """SIGKILL the booth supervisor mid-burst: the frames on disk verify, objects present."""
    import signal
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("needs root for the booth's mount namespace")
    from jukebox.booth.isolation import remove_stale_socket_dirs
    from jukebox.tape.tape import Tape

    work, tapes = tmp_path / "tree", tmp_path / "tapes"
    work.mkdir()
    (work / "a.txt").write_text("a\n")
    jukebox = str(Path(sys.executable).parent / "jukebox")
    proc = subprocess.Popen(
        [jukebox, "booth", "run", "--tree", str(work), "--tape-dir", str(tapes),
         "--tape-id", "crash", "--commit", "never", "--", sys.executable, "-c", RAPID_CHECKPOINTS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        acked = 0
        started = 0.0
        # Checkpoints are group commits, durable within FLUSH_DELAY: let several land while the
        # burst goes on (60 checkpoints can take less than one delay), then kill mid-burst.
        while acked < 60 or time.monotonic() - started < 6 * FLUSH_DELAY:
            line = proc.stdout.readline()
            assert line, f"the agent stopped early: {proc.stderr.read().decode()[-2000:]}"
            acked = int(line)
            if not started:
                started = time.monotonic()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # The killed supervisor's empty socket mount point, which its next run would remove.
        remove_stale_socket_dirs("jukebox-crash-")
    with Store.open(tapes / ".jukebox" / "store") as st:
        tape = Tape.load(tapes / "crash.jbx", store=st)
        report = tape.verify(check_objects=True, deep=True)
        # A kill mid-write may tear the last record; nothing else may be wrong.
        problems = [p for p in report.problems if type(p).__name__ != "TornTape"]
        assert not problems, problems
        kinds = [f.kind for f in tape.frames]
        assert kinds[0] == "run_start" and kinds.count("checkpoint") >= 1
        for f in tape.frames:
            for oid in f.refs:
                assert st.get(oid) is not None


def test_booth_base_tree_reuses_the_previous_build(tmp_path: Path) -> None:
    import json

    from jukebox.tape.tapedir import TapeDir
    from jukebox.trees.basetree import build_base_tree, forget_base_paths

    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "a.txt").write_bytes(b"aaaa")
    (work / "b.txt").write_bytes(b"bbbb")
    old = 1_000_000_000_000_000_000  # far from now: not racily clean
    for p in (work / "sub" / "a.txt", work / "b.txt"):
        os.utime(p, ns=(old, old))
    tapes = TapeDir(tmp_path / "tapes")
    cache = tapes.state / "base-trees.json"

    def started_later() -> None:
        # The files' ctimes are from just now, within the racy window of the build that just
        # ran: move its start 10 s on, as a build seconds after the last write would have it.
        known = json.loads(cache.read_text())
        known[str(work)]["started_ns"] = time.time_ns() + 10_000_000_000
        cache.write_text(json.dumps(known))

    def content(root: ObjectId, path: bytes) -> bytes:
        e = tree.lookup(st, root, path)
        assert e is not None and e.oid is not None
        return st.read_bytes(e.oid)

    with Store.open(tapes.store_path) as st:
        reads: list[bytes] = []
        put_file = st.put_file

        def counting(fd: int) -> ObjectId:
            reads.append(os.pread(fd, 64, 0))
            return put_file(fd)

        st.put_file = counting  # type: ignore[method-assign]
        first = build_base_tree(st, tapes, str(work))
        assert first == tree.build_tree(st, work)
        started_later()
        # Unchanged: the same tree, and no file is read.
        reads.clear()
        assert build_base_tree(st, tapes, str(work)) == first
        assert reads == []
        # An agent rewrites a file and puts its mtime back: size, mtime and mode are the
        # previous build's, the ctime is not; the base shows the new content.
        started_later()
        (work / "b.txt").write_bytes(b"BBBB")
        os.utime(work / "b.txt", ns=(old, old))
        second = build_base_tree(st, tapes, str(work))
        assert content(second, b"b.txt") == b"BBBB" and reads == [b"BBBB"]
        # A commit drops the entries of what it touched: those files are read again, only.
        started_later()
        reads.clear()
        forget_base_paths(tapes, str(work), [b"sub"])
        assert build_base_tree(st, tapes, str(work)) == second and reads == [b"aaaa"]
        # Identities recorded with another build than the tree the cache names (two runs
        # raced over the two files) are not trusted: every file is read.
        started_later()
        known = json.loads(cache.read_text())
        known[str(work)]["tree"] = first.hex()
        cache.write_text(json.dumps(known))
        reads.clear()
        assert build_base_tree(st, tapes, str(work)) == second
        assert sorted(reads) == [b"BBBB", b"aaaa"]
        # A real change (new mtime) is seen.
        (work / "sub" / "a.txt").write_bytes(b"changed")
        assert content(build_base_tree(st, tapes, str(work)), b"sub/a.txt") == b"changed"
        # A cache naming a tree the store lost falls back to a full build.
        lost = {str(work): {"tree": "00" * 32, "started_ns": 1}}
        cache.write_text(json.dumps(lost))
        assert build_base_tree(st, tapes, str(work)) == tree.build_tree(st, work)


def _grid(base: Path, dirs: int, files: int) -> None:
    """``dirs`` directories d0.. of ``files`` small files f00.. each under ``base``."""
    for d in range(dirs):
        (base / f"d{d}").mkdir(parents=True)
        for f in range(files):
            (base / f"d{d}" / f"f{f:02d}.txt").write_text(f"{d}/{f}\n")


def test_forgotten_base_paths_take_exactly_what_lies_beneath_them(tmp_path: Path) -> None:
    import random

    from jukebox.tape.tapedir import TapeDir
    from jukebox.trees import basetree

    tapes = TapeDir(tmp_path / "tapes")
    rng = random.Random(7)
    names = [b"a", b"a.txt", b"a0", b"b", b"sub", b"sub2"]
    paths = {b"/".join(rng.choices(names, k=rng.randint(1, 4))) for _ in range(400)}
    records = {p: (1, i, 2) for i, p in enumerate(sorted(paths))}
    for trial in range(30):
        basetree._write_stats(tapes, "/t", b"\1" * 32, records)
        # gone paths: recorded files, directories of records, and paths recorded nowhere
        gone = set(rng.sample(sorted(paths), trial % 5))
        gone |= {p.rpartition(b"/")[0] for p in rng.sample(sorted(paths), trial % 4)} - {b""}
        gone |= {b"absent", b"a/absent"}
        basetree.forget_base_paths(tapes, "/t", gone)
        beneath = {p for p in records if any(p.startswith(g + b"/") for g in gone)}
        want = {p: i for p, i in records.items() if p not in gone | beneath}
        assert basetree._read_stats(tapes, "/t") == (b"\1" * 32, want)


def test_every_snapshot_tree_is_canonical_across_many_small_steps(
    tmp_path: Path, store: Store
) -> None:
    # Rebuilds join the bytes entries keep (`Entry.record`) with the few they encode anew, or
    # swap changed records into the directory's previous bytes (`tree.splice_records`) when no
    # name came or went and no record changed length: each stored tree must still be the
    # canonical encoding of what the layer holds, which a fresh decode and encode checks.
    import random

    base = tmp_path / "many"
    _grid(base, 3, 25)
    lay = Layer(base, store, tmp_path / "scratch-many")
    rnd = random.Random(11)
    names = [f"d{d}/f{f:02d}.txt" for d in range(3) for f in range(25)]
    try:
        for step in range(60):
            for _ in range(rnd.randint(1, 4)):
                lay.write_file(rnd.choice(names), f"step {step} {rnd.random()}\n".encode())
            if step % 7 == 3:
                new = f"d{rnd.randrange(3)}/new{step}.txt"
                lay.write_file(new, b"added")
                names.append(new)
            if step % 11 == 5:
                lay.setattr(lay.resolve(rnd.choice(names)).ino, mode=0o600)
            if step % 9 == 4:
                gone = names.pop(rnd.randrange(len(names)))
                lay.delete(gone)
            if step % 6 == 1:
                # A symlink's record changes length with its target: no swap in place then.
                d = lay.resolve(f"d{step % 3}").ino
                with contextlib.suppress(FileNotFoundError):
                    lay.delete(f"d{step % 3}/link")
                lay.symlink(d, b"link", b"t" * (1 + step % 5))
            t, _ = lay.snapshot()
            tree.clear_cache()
            for oid in tree.reachable(store, t):
                if store.kind(oid) != "tree":
                    continue
                raw = store.get(oid)
                assert tree.encode_tree(tree.decode_tree(raw)) == raw
            for path, node in lay.walk():
                e = tree.lookup(store, t, path)
                assert e is not None and e.mode == node.mode, path
                if node.fmt == 0o100000:
                    assert store.read_bytes(e.oid) == lay.read_file(path), path
    finally:
        lay.close()


def test_a_directory_first_changed_since_it_was_built_or_read_swaps_into_its_stored_bytes(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a big tree most directories a step touches were last encoded by the initial build (or
    # read from the store): their first rebuild swaps the changed records into those bytes
    # instead of joining every record again, and must still give the canonical tree.
    base = tmp_path / "wide"
    _grid(base, 4, 40)
    joins: list[int] = []
    real_join = tree.pack_records

    def counting_join(records):  # type: ignore[no-untyped-def]
        joins.append(1)
        return real_join(records)

    lay = Layer(base, store, tmp_path / "scratch-wide")
    try:
        first, _ = lay.snapshot()
        monkeypatch.setattr("shadowfs.layer.pack_records", counting_join)
        lay.write_file("d1/f07.txt", b"seven\n")
        lay.write_file("d3/f30.txt", b"thirty\n")
        second, _ = lay.snapshot()
        assert joins == []  # d1, d3 and the root: all swapped into bytes built at the start
        # After a rollback to the start, with the cache emptied: the root's and d2's trees are
        # read back from the store, and swapped into just the same.
        lay.restore(first)
        tree.clear_cache()
        lay.write_file("d2/f11.txt", b"eleven\n")
        third, _ = lay.snapshot()
        assert joins == []
        out = tmp_path / "out"
        out.mkdir()
        for oid, name in ((second, "second"), (third, "third")):
            tree.materialize(store, oid, out / name)
            assert tree.build_tree(store, out / name) == oid
        assert tree.lookup(store, third, b"d1/f07.txt") == tree.lookup(store, first, b"d1/f07.txt")
    finally:
        lay.close()


def test_a_whole_file_write_kept_for_the_snapshot_yields_to_any_later_change(
    layer: Layer, store: Store
) -> None:
    # A file written whole keeps those bytes for the next snapshot (no read back); every
    # later change to its content must win over them.
    def snapshotted(path: str) -> bytes:
        t, _ = layer.snapshot()
        return store.read_bytes(tree.lookup(store, t, path.encode()).oid)

    layer.write_file("README", b"whole\n")
    assert snapshotted("README") == b"whole\n"

    layer.write_file("README", b"whole again\n")
    layer.setattr(layer.resolve("README").ino, size=5)
    assert snapshotted("README") == b"whole"

    layer.write_file("README", b"0123456789")
    h = layer.open(layer.resolve("README").ino, os.O_WRONLY)
    layer.write(h, 4, b"xy")
    layer.release(h.fh)
    assert snapshotted("README") == b"0123xy6789"

    node = layer.resolve("README")
    layer.write_node(node, 0, b"abcdefghij", 0)  # whole again, through the node
    layer.write_node(node, 10, b"KL", 0)  # then grown past it
    assert snapshotted("README") == b"abcdefghijKL"

    # Kept bytes of files deleted before a snapshot are let go by it.
    for i in range(50):
        layer.write_file(f"gone{i}", b"x" * 1000)
        layer.delete(f"gone{i}")
    layer.snapshot()
    assert layer._image_bytes == 0 and not layer._imaged


def test_link_counts_of_directories_a_restore_changed_before_anything_read_them(
    layer: Layer, base: Path, store: Store, tmp_path: Path
) -> None:
    layer.mkdir("docs/new")
    layer.mkdir("src/sub")
    changed, _ = layer.snapshot()
    # A second layer over the same base: its nodes for docs and src come from the base and are
    # not loaded yet when the restore gives them other sub-trees.
    with Layer(base, store, tmp_path / "scratch2") as fresh:
        assert fresh.stat("README").st_nlink == 1
        fresh.restore(changed)
        assert fresh.stat("docs").st_nlink == 4 and fresh.stat("src").st_nlink == 3
        assert fresh.stat("").st_nlink == 5
        fresh.restore(fresh.base_tree)
        assert fresh.stat("docs").st_nlink == 3 and fresh.stat("src").st_nlink == 2


def test_a_special_file_makes_its_directory_a_version_2_tree_while_it_is_there(
    layer: Layer, store: Store
) -> None:
    start, _ = layer.snapshot()
    src = layer.resolve("src").ino
    layer.mknod(src, b"pipe", stat.S_IFIFO | 0o600)
    layer.mknod(layer.root.ino, b"null", stat.S_IFCHR | 0o600, rdev=os.makedev(1, 3))
    with_them, _ = layer.snapshot()
    src_tree = tree.lookup(store, with_them, b"src")
    assert src_tree is not None and store.get(src_tree.oid)[0] == 2  # type: ignore[arg-type]
    null = tree.lookup(store, with_them, b"null")
    assert null is not None and (null.kind, null.rdev) == ("chardev", os.makedev(1, 3))
    layer.unlink(src, b"pipe")
    layer.unlink(layer.root.ino, b"null")
    # Gone again: the directories are version 1 trees again, the very ones of the start.
    after = tree.lookup(store, layer.snapshot()[0], b"src")
    before = tree.lookup(store, start, b"src")
    assert after is not None and before is not None and after.oid == before.oid
