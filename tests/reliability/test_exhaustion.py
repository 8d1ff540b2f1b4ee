"""Exhaustion: a full disk under a commit and under the store, huge and deep trees, and names at
the edge of what a file system allows.

Disk-full cases mount a real tmpfs (root only) with a byte or inode limit and sweep that limit
across every point where a commit or a store write can run out, so the failure lands in staging,
in the redo journal and after the commit point. Each time: a one-line error naming the full disk,
the real tree exactly old (or exactly new once recovery finishes a committed journal), no
`.jbx-stage-*` residue after `recover`, and a store that still verifies.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadowfs import tree
from shadowfs.commit import apply, recover
from shadowfs.errors import ShadowfsError, StoreError, TreeError
from shadowfs.oid import ObjectId
from shadowfs.store import Store
from shadowfs.tree import (
    DIR,
    FILE,
    MAX_DEPTH,
    Entry,
    build_tree,
    diff_trees,
    encode_tree,
    materialize,
)

KiB = 1024
MiB = 1024 * KiB

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@contextlib.contextmanager
def tmpfs(path: Path, *options: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join(options) or "size=8m"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def remount(path: Path, *options: str) -> None:
    subprocess.run(["mount", "-o", ",".join(("remount", *options)), str(path)], check=True)


State = dict[bytes, tuple[object, ...]]


def state(root: Path | bytes) -> State:
    """Every path below root: type, mode, mtime (not root's own), content or link target."""
    top = os.fsencode(root)
    out: State = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    body: object = f.read()
            elif stat.S_ISLNK(st.st_mode):
                body = os.readlink(path)
            else:
                body = None
            rel = os.path.relpath(path, top)
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_mtime_ns, body)
    return out


def residue(root: Path) -> list[bytes]:
    return [p for p in state(root) if os.path.basename(p).startswith(b".jbx-stage")]


def is_disk_full(exc: BaseException) -> bool:
    text = str(exc)
    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "\n" not in text and (full or "No space left" in text or "space" in text)


# --------------------------------------------------------------------------- commit, disk full


def _base(src: Path) -> None:
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"alpha\n" * 100)
    (src / "b.txt").write_bytes(b"beta\n")
    (src / "sub" / "c.txt").write_bytes(b"gamma\n" * 1000)
    (src / "gone.txt").write_bytes(b"deleted by the commit\n")


def _change(src: Path) -> None:
    (src / "a.txt").write_bytes(os.urandom(300 * KiB))  # incompressible, a real page count
    (src / "gone.txt").unlink()
    (src / "new").mkdir()
    for i in range(3):
        (src / "new" / f"n{i}.bin").write_bytes(os.urandom(100 * KiB))
    (src / "sub" / "c.txt").chmod(0o600)
    (src / "big.bin").write_bytes(os.urandom(1 * MiB))


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, ObjectId, ObjectId]]:
    tmp = tmp_path_factory.mktemp("exhaust")
    src = tmp / "src"
    with Store.open(tmp / "store") as store:
        _base(src)
        base = build_tree(store, src)
        _change(src)
        new = build_tree(store, src)
        store.flush()
        yield store, base, new


def _commit_under_limit(
    store: Store, base: ObjectId, new: ObjectId, mnt: Path, options: tuple[str, ...]
) -> str:
    """One commit on a tmpfs with the given limit; returns how it ended."""
    with tmpfs(mnt, *options):
        target, journal = mnt / "tree", mnt / "journal"
        try:
            materialize(store, base, target)
        except OSError:
            return "base does not fit"
        old_state = state(target)
        try:
            apply(store, target, base, new, journal_dir=journal)
        except (ShadowfsError, OSError) as exc:
            assert is_disk_full(exc), f"not a clear disk-full error: {exc!r}"
            committed = "recorded" in str(exc)
            assert committed or isinstance(exc, ShadowfsError), f"a raw error escaped: {exc!r}"
        else:
            assert build_tree(store, target) == new
            assert residue(target) == []
            return "fit"
        # Space comes back (the user frees some), then recovery, as at the next open.
        remount(mnt, "size=64m", "nr_inodes=100000")
        redone = recover(target, journal)
        assert residue(target) == []
        if redone:
            assert build_tree(store, target) == new
            return "full after the commit point; recovery finished it"
        assert not committed, "a recorded commit was rolled back"
        assert state(target) == old_state
        return "full before the commit point; tree untouched"


@root_only
def test_disk_full_anywhere_in_a_commit_leaves_the_old_or_the_new_tree(
    trees: tuple[Store, ObjectId, ObjectId], tmp_path: Path
) -> None:
    store, base, new = trees
    outcomes: dict[str, int] = {}
    # Byte limits from "the base barely fits" to "everything fits", 64 KiB apart.
    for size_kib in range(64, 2 * 1024, 64):
        how = _commit_under_limit(store, base, new, tmp_path / "m", (f"size={size_kib}k",))
        outcomes[how] = outcomes.get(how, 0) + 1
    # Inode limits: the new files, the journal and the new directory each need one.
    for inodes in range(8, 24):
        how = _commit_under_limit(
            store, base, new, tmp_path / "m", ("size=64m", f"nr_inodes={inodes}")
        )
        outcomes[how] = outcomes.get(how, 0) + 1
    print(f"commit on a full disk: {outcomes}")
    assert outcomes.get("full before the commit point; tree untouched", 0) > 0
    assert outcomes.get("fit", 0) > 0
    assert store.verify() == []


# --------------------------------------------------------------------------- store, disk full


@root_only
def test_store_running_out_of_space_mid_put_and_flush(tmp_path: Path) -> None:
    mnt = tmp_path / "m"
    with tmpfs(mnt, "size=8m"):
        durable: list[ObjectId] = []
        failure: StoreError | None = None
        store = Store.open(mnt / "store")
        try:
            batch: list[ObjectId] = []
            for i in range(200):
                batch.append(store.put("blob", os.urandom(64 * KiB if i % 3 else 700 * KiB)))
                if i % 4 == 3:
                    store.flush()
                    durable += batch
                    batch = []
        except StoreError as exc:
            failure = exc
        finally:
            with contextlib.suppress(StoreError):
                store.close()
        assert failure is not None, "8 MiB held 200 incompressible objects"
        assert is_disk_full(failure) or "full" in str(failure), str(failure)
        assert "\n" not in str(failure)
        assert durable, "nothing fitted before the disk filled"
        remount(mnt, "size=256m")
        with Store.open(mnt / "store") as store:
            assert store.verify() == []
            for oid in durable:
                store.get(oid)
            again = store.put("blob", b"space is back")
            store.flush()
        with Store.open(mnt / "store") as store:
            assert store.get(again) == b"space is back"
            assert store.verify() == []
    print(f"store on a full disk: {len(durable)} flushed objects kept; error: {failure}")


# --------------------------------------------------------------------------- huge and deep trees


@pytest.fixture
def roomy(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs when root: 100,000 file creations cost 40 s on a busy disk, 2 s in memory."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    with tmpfs(tmp_path / "roomy", "size=1g", "nr_inodes=400000") as mnt:
        yield mnt


@pytest.mark.slow
def test_a_100000_file_tree_builds_diffs_and_materializes(roomy: Path) -> None:
    tmp_path = roomy
    src = tmp_path / "src"
    for d in range(100):
        sub = src / f"d{d:02}"
        sub.mkdir(parents=True)
        for f in range(1000):
            # Empty files: the cost under test is per entry, not per byte.
            os.close(os.open(sub / f"f{f:03}", os.O_CREAT | os.O_WRONLY, 0o644))
    with Store.open(tmp_path / "store") as store:
        first = build_tree(store, src)
        for d in (3, 50, 99):
            (src / f"d{d:02}" / "f500").write_bytes(b"changed")
        (src / "d07" / "f001").unlink()
        second = build_tree(store, src, previous=first)
        changes = diff_trees(store, first, second)
        assert sorted((c.path, c.status) for c in changes) == [
            (b"d03/f500", "modified"),
            (b"d07/f001", "deleted"),
            (b"d50/f500", "modified"),
            (b"d99/f500", "modified"),
        ]
        dest = tmp_path / "dest"
        materialize(store, second, dest)
        assert sum(len(files) for _, _, files in os.walk(dest)) == 100_000 - 1
        assert (dest / "d50" / "f500").read_bytes() == b"changed"
        assert build_tree(store, dest) == second


def _nest(top: Path, depth: int) -> bytes:
    """depth nested directories below top, made through dir fds; returns the relative path."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        leaf = os.open("leaf.txt", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
        os.write(leaf, b"at the bottom")
        os.close(leaf)
    finally:
        os.close(fd)
    return b"/".join([b"d"] * depth + [b"leaf.txt"])


def test_300_levels_go_through_store_tree_materialize_and_commit(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    leaf = _nest(src, 300)
    target = tmp_path / "target"
    target.mkdir()
    with Store.open(tmp_path / "store") as store:
        empty = build_tree(store, target)
        deep = build_tree(store, src)
        assert tree.lookup(store, deep, leaf) is not None
        assert len(diff_trees(store, empty, deep)) == 301
        materialize(store, deep, tmp_path / "copy")
        assert build_tree(store, tmp_path / "copy") == deep
        apply(store, target, empty, deep, journal_dir=tmp_path / "journal")
        assert build_tree(store, target) == deep
        apply(store, target, deep, empty, journal_dir=tmp_path / "journal")
        assert os.listdir(target) == []


def test_deeper_than_the_limit_is_a_clean_tree_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _nest(src, MAX_DEPTH + 1)
    with Store.open(tmp_path / "store") as store:
        with pytest.raises(TreeError, match=f"deeper than {MAX_DEPTH}"):
            build_tree(store, src)
        # The same depth arriving as hostile tree objects: refused when materialized.
        oid = store.put("tree", encode_tree([]))
        for _ in range(MAX_DEPTH + 2):
            oid = store.put("tree", encode_tree([Entry(b"d", DIR, 0o755, 0, 0, oid, None)]))
        with pytest.raises(TreeError, match=f"deeper than {MAX_DEPTH}"):
            materialize(store, oid, tmp_path / "out")


# --------------------------------------------------------------------------- names at the edge

NAMES = [
    b"n" * 255,
    b"line\nbreak",
    b"\nleading newline",
    b"invalid \xff\xfe utf-8",
    b"\xc3\x28 truncated sequence",
    b"tab\there and \x01 control",
    b" spaces ",
    b"-dash",
    "caf\u00e9 \u2603".encode(),
]


def test_edge_names_through_store_tree_materialize_and_commit(tmp_path: Path) -> None:
    src = os.fsencode(tmp_path / "src")
    os.mkdir(src)
    for i, name in enumerate(NAMES):
        with open(os.path.join(src, name), "wb") as f:
            f.write(b"content %d" % i)
    os.mkdir(os.path.join(src, b"dir \xff\n" + b"x" * 200))
    with open(os.path.join(src, b"dir \xff\n" + b"x" * 200, b"x" * 255), "wb") as f:
        f.write(b"nested")
    os.symlink(b"invalid \xff\xfe utf-8", os.path.join(src, b"link \xfe"))
    target = tmp_path / "target"
    target.mkdir()
    with Store.open(tmp_path / "store") as store:
        empty = build_tree(store, target)
        full = build_tree(store, src)
        names = {e.name for e in tree.read_tree(store, full)}
        assert set(NAMES) <= names
        assert {c.path for c in diff_trees(store, empty, full)} >= set(NAMES)
        materialize(store, full, tmp_path / "copy")
        assert state(tmp_path / "copy") == state(src)
        apply(store, target, empty, full, journal_dir=tmp_path / "journal")
        assert state(target) == state(src)
        assert residue(target) == []
        with pytest.raises(TreeError, match="longer than 255"):
            encode_tree([Entry(b"n" * 256, FILE, 0o644, 0, 0, ObjectId(bytes(32)), None)])
