"""Merkle trees: canonical encoding, building from real directories, diff, materialize, safety."""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowfs import tree
from shadowfs.bounded import BoundedMap
from shadowfs.errors import TreeError
from shadowfs.oid import ObjectId, hash_object
from shadowfs.store import CHUNK_SIZE, Store
from shadowfs.tree import (
    Change,
    Entry,
    build_tree,
    decode_tree,
    diff_trees,
    encode_tree,
    lookup,
    materialize,
    reachable,
    read_tree,
    walk,
)

OLD_NS = 1_600_000_000_123_456_789  # 2020: well outside the racy window
OID_A = hash_object("blob", b"a")
OID_B = hash_object("blob", b"b")


class CountingStore(Store):
    """The real store, recording which objects are read (to prove what diff skips)."""

    gets: list[ObjectId]

    def get(self, oid: ObjectId) -> bytes:
        self.gets.append(oid)
        return super().get(oid)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CountingStore]:
    # Trees decoded by earlier tests must not hide reads from this store.
    tree.clear_cache()
    s = CountingStore.open(tmp_path / "store", create=True)
    s.gets = []
    try:
        yield s
    finally:
        s.close()


# --- helpers ----------------------------------------------------------------------------------


def raw_entry(
    name: bytes,
    code: int = 1,
    mode: int = 0o644,
    size: int = 1,
    mtime: int = 0,
    ref: bytes = bytes(OID_A),
) -> bytes:
    """One entry in the documented layout, written independently of the encoder under test."""
    return struct.pack(">BHBQq", code, mode, len(name), size, mtime) + name + ref


def raw_tree(*entries: bytes, version: int = 1) -> bytes:
    return bytes([version]) + b"".join(entries)


def snapshot(root: Path) -> dict[bytes, tuple]:
    """Everything lstat and read can tell about a directory tree, keyed by relative bytes path."""
    out: dict[bytes, tuple] = {}

    def visit(dirpath: bytes, rel: bytes) -> None:
        for name in os.listdir(dirpath):
            full = os.path.join(dirpath, name)
            path = rel + b"/" + name if rel else name
            st = os.lstat(full)
            fmt = stat.S_IFMT(st.st_mode)
            if fmt == stat.S_IFDIR:
                visit(full, path)
                out[path] = ("dir", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            elif fmt == stat.S_IFLNK:
                out[path] = ("symlink", os.readlink(full), st.st_mtime_ns)
            else:
                with open(full, "rb") as f:
                    data = f.read()
                out[path] = ("file", stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, data)

    visit(os.fsencode(root), b"")
    return out


def settle(root: Path, mtime_ns: int = OLD_NS) -> None:
    """Give every entry under root an old, fixed mtime, directories after their contents."""
    for dirpath, dirnames, filenames in os.walk(os.fsencode(root), topdown=False):
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), ns=(mtime_ns, mtime_ns), follow_symlinks=False)


ODD_NAMES = [b"with space", b"new\nline", b"\xff\xfe", b"x" * 255, b"-dash", b".hidden", b"tab\tx"]


def make_sample(root: Path) -> None:
    root.mkdir()
    r = os.fsencode(root)
    (root / "empty").write_bytes(b"")
    (root / "hello.txt").write_text("hello\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "suid").write_bytes(b"s")
    os.chmod(root / "suid", 0o4750)
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "a" / "b" / "c" / "deep.bin").write_bytes(os.urandom(3000))
    (root / "a" / "b" / "empty-dir").mkdir()
    (root / "sticky").mkdir()
    os.chmod(root / "sticky", 0o1777)
    os.symlink("hello.txt", root / "link-rel")
    os.symlink("/etc/passwd", root / "link-abs")
    os.symlink("nowhere/at/all", root / "a" / "dangling")
    os.symlink("b", root / "a" / "link-to-dir")
    for i, name in enumerate(ODD_NAMES):
        with open(os.path.join(r, name), "wb") as f:
            f.write(b"odd %d" % i)
    os.mkdir(os.path.join(r, b"dir \xff\n"))
    with open(os.path.join(r, b"dir \xff\n", b"inner"), "wb") as f:
        f.write(b"inner")
    settle(root)


# --- encoding ---------------------------------------------------------------------------------

valid_names = st.binary(min_size=1, max_size=255).filter(
    lambda n: n not in (b".", b"..") and b"/" not in n and b"\0" not in n
)


@st.composite
def entries(draw: st.DrawFn) -> list[Entry]:
    names = draw(st.lists(valid_names, max_size=12, unique=True))
    out = []
    for name in names:
        kind = draw(st.sampled_from(["file", "dir", "symlink", *tree.SPECIALS, "linked"]))
        mode = draw(st.integers(0, 0o7777))
        mtime = draw(st.integers(-(1 << 63), (1 << 63) - 1))
        if kind in tree.SPECIALS:
            rdev = draw(st.integers(0, (1 << 64) - 1)) if kind in tree.DEVICES else 0
            link = draw(st.sampled_from([0, 0, 1, (1 << 64) - 1]))
            out.append(Entry(name, kind, mode, 0, mtime, None, None, rdev, link))
        elif kind == "linked":
            oid = ObjectId(draw(st.binary(min_size=32, max_size=32)))
            link = draw(st.integers(1, (1 << 64) - 1))
            out.append(Entry(name, "file", mode, 5, mtime, oid, None, 0, link))
        elif kind == "symlink":
            target = draw(st.binary(min_size=1, max_size=300).filter(lambda t: b"\0" not in t))
            out.append(Entry(name, kind, mode, len(target), mtime, None, target))
        else:
            oid = ObjectId(draw(st.binary(min_size=32, max_size=32)))
            size = 0 if kind == "dir" else draw(st.integers(0, (1 << 64) - 1))
            out.append(Entry(name, kind, mode, size, mtime, oid, None))
    return out


@settings(max_examples=200, deadline=None)
@given(entries(), st.randoms())
def test_encode_decode_round_trip_is_canonical(items: list[Entry], rnd) -> None:  # type: ignore[no-untyped-def]
    data = encode_tree(items)
    shuffled = list(items)
    rnd.shuffle(shuffled)
    assert encode_tree(shuffled) == data
    decoded = decode_tree(data)
    assert decoded == sorted(items, key=lambda e: e.name)
    assert all(isinstance(e.oid, ObjectId) for e in decoded if e.kind in ("file", "dir"))
    assert encode_tree(decoded) == data


@settings(max_examples=100, deadline=None)
@given(entries(), st.integers(0, 1 << 30))
def test_a_decoded_tree_re_encodes_with_one_entry_changed_from_its_kept_records(
    items: list[Entry], mtime: int
) -> None:
    # Entries keep the bytes they were decoded from; re-packing after a change must give the
    # same bytes as encoding from scratch, and a changed copy must not inherit the old bytes.
    decoded = decode_tree(encode_tree(items))
    assert all(e.record is not None for e in decoded)
    if decoded:
        victim = decoded[len(decoded) // 2]
        changed = victim.replace(mtime_ns=mtime)
        assert changed.record is None
        decoded[len(decoded) // 2] = changed
    fresh = [
        Entry(e.name, e.kind, e.mode, e.size, e.mtime_ns, e.oid, e.target, e.rdev, e.link)
        for e in decoded
    ]
    assert tree.pack_entries(decoded) == encode_tree(fresh)
    assert [e.record for e in decode_tree(encode_tree(fresh))] == [
        tree.entry_record(e) for e in fresh
    ]


def test_splice_swaps_same_length_records_and_gives_up_when_in_doubt() -> None:
    a = Entry(b"a.txt", "file", 0o644, 1, OLD_NS, OID_A, None)
    b = Entry(b"b.txt", "file", 0o644, 1, OLD_NS, OID_B, None)
    packed = encode_tree([a, b])
    b2 = b.replace(mtime_ns=OLD_NS + 1, oid=OID_A)
    old, new = tree.entry_record(b), tree.entry_record(b2)
    assert tree.splice_records(packed, [(old, new)]) == encode_tree([a, b2])
    assert tree.splice_records(packed, []) == packed
    # A record of another length would move everything after it.
    longer = b.replace(name=b"bb.txt")
    assert tree.splice_records(packed, [(old, tree.entry_record(longer))]) is None
    # A record that is not there, or whose bytes occur twice, has no certain place.
    assert tree.splice_records(packed, [(tree.entry_record(b2), old)]) is None
    assert tree.splice_records(b"\x01" + old + b"-" + old, [(old, new)]) is None
    assert tree.splice_records(b"\x01" + old + b"-", [(old, new)]) == b"\x01" + new + b"-"


def test_the_bytes_of_trees_built_or_read_are_kept_within_a_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "a.txt").write_text("a\n")
    (tmp_path / "src" / "sub" / "b.txt").write_text("b\n")
    with Store.open(tmp_path / "store", create=True) as store:
        tree.clear_cache()
        root = build_tree(store, tmp_path / "src")
        sub = tree.lookup(store, root, b"sub").oid  # type: ignore[union-attr]
        assert tree.packed_bytes(root) == store.get(root)
        assert tree.packed_bytes(sub) == store.get(sub)
        tree.clear_cache()
        assert tree.packed_bytes(root) is None
        tree.read_tree(store, root)  # read back from the store: its bytes are kept again
        assert tree.packed_bytes(root) == store.get(root)
        # Past the budget the oldest bytes go first.
        monkeypatch.setattr(tree, "_packed", BoundedMap(None, len(store.get(root))))
        tree.clear_cache()
        tree.read_tree(store, root)
        tree.read_tree(store, sub)
        assert tree.packed_bytes(root) is None
        assert tree.packed_bytes(sub) == store.get(sub)
    tree.clear_cache()


def test_the_cache_lets_a_snapshots_trees_go_later_and_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tree, "_CACHE_SIZE", 4)
    monkeypatch.setattr(tree, "_CACHE_SLACK", 3)
    monkeypatch.setattr(tree, "_EVICT_PER_CALL", 2)
    tree.clear_cache()
    try:
        ids = [hash_object("tree", bytes([1, i])) for i in range(12)]
        for oid in ids[:4]:
            tree.remember(oid, {})
        for oid in ids[4:8]:  # a snapshot's builds: up to the slack over, then the oldest go
            tree.remember(oid, {}, evict=False)
        assert list(tree._cache) == ids[1:8]
        tree.remember(ids[8], {})  # each later call lets go of up to two
        assert list(tree._cache) == ids[3:9]
        tree.remember(ids[9], {})
        assert list(tree._cache) == ids[5:10]
        tree.remember(ids[10], {})
        assert list(tree._cache) == ids[7:11]
    finally:
        tree.clear_cache()


def test_empty_tree_is_the_version_byte() -> None:
    assert encode_tree([]) == b"\x01"
    assert decode_tree(b"\x01") == []


def test_layout_matches_the_documented_bytes() -> None:
    e = Entry(b"f", "file", 0o755, 3, -5, OID_A, None)
    link = Entry(b"l", "symlink", 0o777, 2, 7, None, b"/x")
    expected = raw_tree(
        raw_entry(b"f", 1, 0o755, 3, -5, bytes(OID_A)),
        raw_entry(b"l", 3, 0o777, 2, 7, b"\x00\x02/x"),
    )
    assert encode_tree([link, e]) == expected


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "version"),
        (b"\x03", "version"),
        (b"\x02", "canonical is version 1"),
        (raw_tree(raw_entry(b"a"), version=2), "canonical is version 1"),
        (raw_tree(raw_entry(b"a", code=4, size=0, ref=b"")), "unknown kind code 4 for b'a'"),
        (raw_tree(raw_entry(b"a", code=4, size=3, ref=b""), version=2), "size 3"),
        (raw_tree(raw_entry(b"a", code=6, size=0, ref=b"\x00"), version=2), "past the end"),
        (raw_tree(raw_entry(b"a", code=8, ref=bytes(OID_A) + bytes(8)), version=2), "link key 0"),
        (raw_tree(raw_entry(b"a", code=8), version=2), "past the end"),
        (raw_tree(raw_entry(b"..")), ".."),
        (raw_tree(raw_entry(b".")), "'.'"),
        (raw_tree(raw_entry(b"")), "empty name"),
        (raw_tree(raw_entry(b"a/b")), "contains '/'"),
        (raw_tree(raw_entry(b"a\0b")), "contains NUL"),
        (raw_tree(raw_entry(b"b"), raw_entry(b"a")), "out-of-order"),
        (raw_tree(raw_entry(b"a"), raw_entry(b"a")), "duplicate"),
        (raw_tree(raw_entry(b"a", code=9)), "unknown kind"),
        (raw_tree(raw_entry(b"a", mode=0o17777)), "mode"),
        (raw_tree(raw_entry(b"a", code=2, size=4096)), "size 4096"),
        (raw_tree(raw_entry(b"a", code=3, size=5, ref=b"\x00\x02ab")), "target length"),
        (raw_tree(raw_entry(b"a", code=3, size=0, ref=b"\x00\x00")), "invalid target"),
        (raw_tree(raw_entry(b"a", code=3, size=3, ref=b"\x00\x03a\0b")), "invalid target"),
        (raw_tree(raw_entry(b"a", code=3, size=9, ref=b"\x00\x09ab")), "past the end"),
        (raw_tree(raw_entry(b"a"))[:-1], "past the end"),
        (raw_tree(raw_entry(b"a")) + b"\x01\x00", "truncated entry header"),
        (b"\x01" + struct.pack(">BHBQq", 1, 0o644, 10, 0, 0) + b"abc", "past the end"),
    ],
)
def test_decode_rejects_malformed_and_hostile_trees(data: bytes, why: str) -> None:
    with pytest.raises(TreeError, match="malformed tree object") as info:
        decode_tree(data)
    assert why in str(info.value)


@pytest.mark.parametrize(
    "bad",
    [
        Entry(b"..", "file", 0o644, 1, 0, OID_A, None),
        Entry(b"a/b", "file", 0o644, 1, 0, OID_A, None),
        Entry(b"x" * 256, "file", 0o644, 1, 0, OID_A, None),
        Entry(b"a", "fifo", 0o644, 1, 0, OID_A, None),
        Entry(b"a", "file", 0o644, 1, 0, None, None),
        Entry(b"a", "file", 0o100644, 1, 0, OID_A, None),
        Entry(b"a", "dir", 0o755, 4096, 0, OID_A, None),
        Entry(b"a", "symlink", 0o777, 1, 0, OID_A, b"x"),
        Entry(b"a", "symlink", 0o777, 3, 0, None, b"x"),
    ],
)
def test_encode_refuses_invalid_entries(bad: Entry) -> None:
    with pytest.raises(TreeError, match="cannot encode"):
        encode_tree([bad])


def test_encode_refuses_duplicate_names() -> None:
    e = Entry(b"a", "file", 0o644, 1, 0, OID_A, None)
    with pytest.raises(TreeError, match="two entries named"):
        encode_tree([e, Entry(b"a", "file", 0o644, 1, 0, OID_B, None)])


# --- build, walk, materialize ----------------------------------------------------------------


def test_build_and_materialize_reproduce_a_dir(tmp_path: Path, store: CountingStore) -> None:
    src, dest = tmp_path / "src", tmp_path / "out" / "dest"
    make_sample(src)
    (tmp_path / "out").mkdir()
    root = build_tree(store, src)

    expected = snapshot(src)
    walked = {path: e for path, e in walk(store, root)}
    assert set(walked) == set(expected)
    for path, e in walked.items():
        want = expected[path]
        assert e.kind == want[0], path
        if e.kind == "file":
            assert (e.mode, e.size, e.mtime_ns) == want[1:4], path
        elif e.kind == "symlink":
            assert (e.target, e.mtime_ns, e.size) == (want[1], want[2], len(want[1])), path
        else:
            assert (e.mode, e.mtime_ns) == want[1:], path

    materialize(store, root, dest)
    assert snapshot(dest) == expected
    assert build_tree(store, dest) == root


def test_walk_is_depth_first_with_relative_paths(tmp_path: Path, store: CountingStore) -> None:
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f").write_bytes(b"1")
    (src / "a-c").write_bytes(b"2")
    (src / "z").write_bytes(b"3")
    root = build_tree(store, src)
    assert [p for p, _ in walk(store, root)] == [b"a", b"a/b", b"a/b/f", b"a-c", b"z"]
    sub = lookup(store, root, b"a")
    assert sub is not None and sub.oid is not None
    assert [p for p, _ in walk(store, sub.oid, b"a")] == [b"a/b", b"a/b/f"]


def test_lookup_and_read_tree(tmp_path: Path, store: CountingStore) -> None:
    src = tmp_path / "src"
    make_sample(src)
    root = build_tree(store, src)
    deep = lookup(store, root, b"a/b/c/deep.bin")
    assert deep is not None and deep.kind == "file" and deep.size == 3000
    assert lookup(store, root, b"/a/b/c/deep.bin/") == deep
    assert lookup(store, root, b"a/b/nope") is None
    assert lookup(store, root, b"hello.txt/x") is None  # through a file
    assert lookup(store, root, b"link-to-dir/c") is None  # symlinks are never followed
    assert lookup(store, root, b"") is None
    assert lookup(store, root, b"x" * 255) is not None
    names = [e.name for e in read_tree(store, root)]
    assert names == sorted(names) and b"\xff\xfe" in names and b"new\nline" in names


def test_materialize_streams_large_files(tmp_path: Path, store: CountingStore) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    big = os.urandom(2 * CHUNK_SIZE + 17)
    (src / "big").write_bytes(big)
    root = build_tree(store, src)
    entry = lookup(store, root, b"big")
    assert entry is not None and entry.oid is not None and store.kind(entry.oid) == "chunks"
    materialize(store, root, dest)
    assert (dest / "big").read_bytes() == big
    # gc keeps chunk members itself; reachable names the chunks object.
    assert entry.oid in reachable(store, root)


def test_materialize_refuses_a_non_empty_destination(tmp_path: Path, store: CountingStore) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    dest.mkdir()
    (dest / "keep").write_bytes(b"mine")
    with pytest.raises(TreeError, match="not empty"):
        materialize(store, build_tree(store, src), dest)
    assert os.listdir(dest) == ["keep"]


def test_build_refuses_a_missing_directory(tmp_path: Path, store: CountingStore) -> None:
    with pytest.raises(TreeError, match="cannot read directory"):
        build_tree(store, tmp_path / "absent")


def test_special_files_and_hard_links_are_recorded_and_made_again(
    tmp_path: Path, store: CountingStore
) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "keep").write_bytes(b"k")
    (src / "one").write_bytes(b"linked")
    os.link(src / "one", src / "sub" / "two")
    os.mkfifo(src / "sub" / "pipe", 0o640)
    os.link(src / "sub" / "pipe", src / "pipe-too")
    devices = os.geteuid() == 0
    if devices:
        os.mknod(src / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(src / "sock"))
        skipped: list[tuple[bytes, str]] = []
        root = build_tree(store, src, on_skip=lambda p, why: skipped.append((p, why)))
    finally:
        sock.close()
    assert skipped == []
    got = dict(walk(store, root))
    assert (got[b"sock"].kind, got[b"sub/pipe"].kind, got[b"sub/pipe"].mode) == (
        "socket", "fifo", 0o640
    )
    assert got[b"one"].link == got[b"sub/two"].link != 0 and got[b"keep"].link == 0
    assert got[b"sub/pipe"].link == got[b"pipe-too"].link not in (0, got[b"one"].link)
    assert store.get(root)[0] == 2  # it holds kinds only version 2 knows
    if devices:
        assert (got[b"null"].kind, got[b"null"].rdev) == ("chardev", os.makedev(1, 3))
    dest = tmp_path / "dest"
    materialize(store, root, dest)
    assert stat.S_ISFIFO(os.lstat(dest / "sub" / "pipe").st_mode)
    assert stat.S_ISSOCK(os.lstat(dest / "sock").st_mode)
    assert os.lstat(dest / "one").st_ino == os.lstat(dest / "sub" / "two").st_ino
    assert os.lstat(dest / "one").st_nlink == 2 and (dest / "sub" / "two").read_bytes() == b"linked"
    assert os.lstat(dest / "pipe-too").st_ino == os.lstat(dest / "sub" / "pipe").st_ino
    if devices:
        assert os.lstat(dest / "null").st_rdev == os.makedev(1, 3)
    # The copy's links are another inode's (another key), the rest is the same.
    again = dict(walk(store, build_tree(store, dest)))

    def unlinked(entries: dict[bytes, Entry]) -> dict[bytes, Entry]:
        return {
            p: e.replace(link=0, oid=None if e.kind == "dir" else e.oid)
            for p, e in entries.items()
        }

    assert unlinked(again) == unlinked(got)
    assert again[b"one"].link == again[b"sub/two"].link != got[b"one"].link


def test_a_tree_of_version_1_kinds_keeps_version_1_bytes() -> None:
    # Ids of trees written before version 2 stay what they were (the golden tape's among them).
    plain = [Entry(b"f", "file", 0o644, 3, 0, OID_A, None)]
    assert encode_tree(plain) == raw_tree(raw_entry(b"f", 1, 0o644, 3, 0, bytes(OID_A)))
    fifo = Entry(b"p", "fifo", 0o600, 0, 0, None, None)
    dev = Entry(b"d", "blockdev", 0o600, 0, 0, None, None, os.makedev(7, 1))
    linked = Entry(b"g", "file", 0o644, 3, 0, OID_A, None, 0, 5)
    assert encode_tree([*plain, fifo, dev, linked]) == raw_tree(
        raw_entry(b"d", 7, 0o600, 0, 0, struct.pack(">Q", os.makedev(7, 1))),
        raw_entry(b"f", 1, 0o644, 3, 0, bytes(OID_A)),
        raw_entry(b"g", 8, 0o644, 3, 0, bytes(OID_A) + struct.pack(">Q", 5)),
        raw_entry(b"p", 4, 0o600, 0, 0, b""),
        version=2,
    )
    # A swap that adds or removes a version 2 entry (same record length) is left to a re-pack,
    # which sets the version byte.
    sym = Entry(b"g", "symlink", 0o777, 38, 0, None, b"t" * 38)
    assert len(tree.entry_record(sym)) == len(tree.entry_record(linked))
    packed = encode_tree([plain[0], sym])
    swap = (tree.entry_record(sym), tree.entry_record(linked))
    assert tree.splice_records(packed, [swap]) is None
    assert tree.pack_entries([plain[0], linked])[0] == 2


# --- sharing and reuse ------------------------------------------------------------------------


def test_unchanged_subtrees_share_ids(tmp_path: Path, store: CountingStore) -> None:
    src = tmp_path / "src"
    make_sample(src)
    first = build_tree(store, src)
    (src / "a" / "b" / "c" / "deep.bin").write_bytes(b"changed")
    settle(src)
    second = build_tree(store, src)

    def ids(root: ObjectId) -> dict[bytes, ObjectId | None]:
        return {p: e.oid for p, e in walk(store, root) if e.kind == "dir"}

    one, two = ids(first), ids(second)
    assert first != second
    for changed in (b"a", b"a/b", b"a/b/c"):
        assert one[changed] != two[changed]
    for same in (b"sticky", b"a/b/empty-dir", b"dir \xff\n"):
        assert one[same] == two[same]

    # Identical content and metadata at two places is one object.
    twin = tmp_path / "twin"
    (twin / "x").mkdir(parents=True)
    (twin / "y").mkdir()
    for d in ("x", "y"):
        (twin / d / "f").write_bytes(b"same")
    settle(twin)
    root = build_tree(store, twin)
    x, y = lookup(store, root, b"x"), lookup(store, root, b"y")
    assert x is not None and y is not None and x.oid == y.oid


def test_previous_reuses_files_without_reading_them(tmp_path: Path, store: CountingStore) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "kept").write_bytes(b"original")
    (src / "touched").write_bytes(b"original")
    settle(src)
    seen: dict[bytes, tree.FileIdentity] = {}
    first = build_tree(store, src, seen=seen)
    assert set(seen) == {b"d/kept", b"touched"}
    # As if the first build had started 10 s from now: the files' ctimes (just now) are then
    # older than it, as any file's is that nothing touched for a few seconds before a build.
    started = time.time_ns() + 5 * tree.RACY_NS
    reads = _count_file_reads(store)
    again: dict[bytes, tree.FileIdentity] = {}
    assert build_tree(store, src, previous=first, previous_started_ns=started, known=seen,
                      seen=again) == first  # fmt: skip
    assert reads == [] and again == seen

    # Same size, same mtime (put back with utime), same mode, different bytes: the ctime moved.
    (src / "d" / "kept").write_bytes(b"ORIGINAL")
    os.utime(src / "d" / "kept", ns=(OLD_NS, OLD_NS))
    second = build_tree(store, src, previous=first, previous_started_ns=started, known=seen)
    kept = lookup(store, second, b"d/kept")
    assert kept is not None and kept.oid == hash_object("blob", b"ORIGINAL")
    assert reads == [b"ORIGINAL"]
    # Without the identities, the ctime against the earlier build's real start catches it too.
    (src / "touched").write_bytes(b"ORIGINAL")
    os.utime(src / "touched", ns=(OLD_NS, OLD_NS))
    third = build_tree(store, src, previous=first, previous_started_ns=time.time_ns())
    touched = lookup(store, third, b"touched")
    assert touched is not None and touched.oid == hash_object("blob", b"ORIGINAL")


def test_previous_reads_a_file_that_is_another_inode(tmp_path: Path, store: CountingStore) -> None:
    """A directory swapped for a copy with equal stats (size, mtime, mode, even an old ctime
    relative to the build) is other inodes: its files are read."""
    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    (src / "d").mkdir(parents=True)
    (elsewhere / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"real")
    (elsewhere / "d" / "f").write_bytes(b"fake")
    settle(src)
    settle(elsewhere)
    seen: dict[bytes, tree.FileIdentity] = {}
    first = build_tree(store, src, seen=seen)
    os.rename(src / "d", tmp_path / "old-d")
    os.rename(elsewhere / "d", src / "d")
    started = time.time_ns() + 5 * tree.RACY_NS
    second = build_tree(store, src, previous=first, previous_started_ns=started, known=seen)
    f = lookup(store, second, b"d/f")
    assert f is not None and f.oid == hash_object("blob", b"fake")


def _count_file_reads(store: CountingStore) -> list[bytes]:
    """Records the content of every file `store.put_file` reads from now on."""
    reads: list[bytes] = []
    put_file = store.put_file

    def counting(fd: int) -> ObjectId:  # type: ignore[override]
        reads.append(os.pread(fd, 1 << 20, 0))
        return put_file(fd)

    store.put_file = counting  # type: ignore[method-assign]
    return reads


def test_previous_not_trusted_for_racy_or_chmod_files(tmp_path: Path, store: CountingStore) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "recent").write_bytes(b"aaaa")
    (src / "chmod").write_bytes(b"aaaa")
    os.utime(src / "chmod", ns=(OLD_NS, OLD_NS))
    first = build_tree(store, src)
    recent = lookup(store, first, b"recent")
    assert recent is not None

    # Rewritten within the racy window with stat unchanged: must be re-read.
    (src / "recent").write_bytes(b"bbbb")
    os.utime(src / "recent", ns=(recent.mtime_ns, recent.mtime_ns))
    # A mode change alone also forces a fresh entry.
    (src / "chmod").write_bytes(b"cccc")
    os.utime(src / "chmod", ns=(OLD_NS, OLD_NS))
    os.chmod(src / "chmod", 0o600)

    second = build_tree(store, src, previous=first)
    assert lookup(store, second, b"recent").oid == hash_object("blob", b"bbbb")  # type: ignore[union-attr]
    chmod = lookup(store, second, b"chmod")
    assert chmod is not None and (chmod.mode, chmod.oid) == (0o600, hash_object("blob", b"cccc"))

    # With the earlier build's start time the rule is exact: a file whose mtime and ctime are
    # older than that start is trusted, unread.
    reads = _count_file_reads(store)
    later = time.time_ns() + 5 * tree.RACY_NS
    third = build_tree(store, src, previous=second, previous_started_ns=later)
    assert lookup(store, third, b"chmod") == chmod and b"cccc" not in reads


def _signed_src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for d in ("a", "a/deep", "b"):
        (src / d).mkdir(parents=True)
    for rel in ("a/f", "a/deep/g", "b/h", "top"):
        (src / rel).write_bytes(b"original " + rel.encode())
    os.symlink("top", src / "link")
    settle(src)
    return src


def _later() -> int:
    # As if the build had started 10 s from now: everything here is then older than it.
    return time.time_ns() + 5 * tree.RACY_NS


def test_signatures_take_unchanged_directories_whole(tmp_path: Path, store: CountingStore) -> None:
    src = _signed_src(tmp_path)
    first_sigs = tree.DirSignatures({}, _later())
    first = build_tree(store, src, signatures=first_sigs)
    assert set(first_sigs.new) == {b"", b"a", b"a/deep", b"b"}
    assert first_sigs.rebuilt == 4 and first_sigs.reused == 0
    store.flush()
    tree.clear_cache()
    store.gets.clear()
    reads = _count_file_reads(store)
    sigs = tree.DirSignatures(first_sigs.new, _later())
    seen: dict[bytes, tree.FileIdentity] = {}
    assert build_tree(store, src, previous=first, signatures=sigs, seen=seen) == first
    # Not a tree decoded, not a file read; the identities stand as the signing build left them.
    assert (sigs.reused, sigs.rebuilt) == (4, 0)
    assert store.gets == [] and reads == [] and seen == {}
    assert sigs.new == first_sigs.new


def test_a_rewrite_with_its_mtime_put_back_breaks_the_signature(
    tmp_path: Path, store: CountingStore
) -> None:
    src = _signed_src(tmp_path)
    first_sigs = tree.DirSignatures({}, _later())
    first = build_tree(store, src, signatures=first_sigs)
    target = src / "a" / "deep" / "g"
    st = os.stat(target)
    target.write_bytes(b"ORIGINAL a/deep/g")  # same size
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    sigs = tree.DirSignatures(first_sigs.new, _later())
    seen: dict[bytes, tree.FileIdentity] = {}
    second = build_tree(store, src, previous=first, signatures=sigs, seen=seen)
    g = lookup(store, second, b"a/deep/g")
    assert g is not None and g.oid == hash_object("blob", b"ORIGINAL a/deep/g")
    # Its directory and those above it are built again; the others are taken whole.
    assert (sigs.rebuilt, sigs.reused) == (3, 1)
    assert lookup(store, second, b"b") == lookup(store, first, b"b")
    # Something changed: the identities of every file, reused ones too, for the next build.
    assert set(seen) == {b"a/f", b"a/deep/g", b"b/h", b"top"}


def test_a_directory_swapped_for_an_equal_copy_is_read(
    tmp_path: Path, store: CountingStore
) -> None:
    src = _signed_src(tmp_path)
    first_sigs = tree.DirSignatures({}, _later())
    first = build_tree(store, src, signatures=first_sigs)
    copy = tmp_path / "copy"
    (copy / "b").mkdir(parents=True)
    (copy / "b" / "h").write_bytes(b"ORIGINAL b/h")
    os.utime(copy / "b" / "h", ns=(OLD_NS, OLD_NS))
    os.utime(copy / "b", ns=(OLD_NS, OLD_NS))
    os.rename(src / "b", tmp_path / "old-b")
    os.rename(copy / "b", src / "b")
    sigs = tree.DirSignatures(first_sigs.new, _later())
    second = build_tree(store, src, previous=first, signatures=sigs)
    h = lookup(store, second, b"b/h")
    assert h is not None and h.oid == hash_object("blob", b"ORIGINAL b/h")


def test_racy_directories_are_not_signed_and_gone_trees_not_trusted(
    tmp_path: Path, store: CountingStore
) -> None:
    src = _signed_src(tmp_path)
    # Written (ctime) within RACY_NS of the build's start: each could still change unseen.
    racy = tree.DirSignatures({}, time.time_ns())
    build_tree(store, src, signatures=racy)
    assert racy.new == {}
    sigs = tree.DirSignatures({}, _later())
    first = build_tree(store, src, signatures=sigs)
    # A signature naming a tree the store no longer holds is ignored: the directory is built.
    bogus = {rel: (sig, hash_object("tree", b"gone " + rel)) for rel, (sig, _) in sigs.new.items()}
    again = tree.DirSignatures(bogus, _later())
    assert build_tree(store, src, previous=first, signatures=again) == first
    assert again.reused == 0 and again.rebuilt == 4


# --- diff -------------------------------------------------------------------------------------


def statuses(changes: list[Change]) -> list[tuple[bytes, str]]:
    return [(c.path, c.status) for c in changes]


def test_diff_reports_every_kind_of_change(tmp_path: Path, store: CountingStore) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("content", "mode", "to-link", "to-dir", "deleted", "same"):
        (src / name).write_bytes(b"v1")
    (src / "gone" / "inner").mkdir(parents=True)
    (src / "gone" / "inner" / "f").write_bytes(b"g")
    (src / "dir-to-file").mkdir()
    (src / "dir-to-file" / "x").write_bytes(b"x")
    (src / "keep").mkdir()
    (src / "keep" / "k").write_bytes(b"k")
    (src / "chmod-dir").mkdir()
    os.symlink("t1", src / "retarget")
    settle(src)
    a = build_tree(store, src)

    (src / "content").write_bytes(b"v2!")
    os.chmod(src / "mode", 0o755)
    os.unlink(src / "to-link")
    os.symlink("same", src / "to-link")
    os.unlink(src / "to-dir")
    (src / "to-dir").mkdir()
    (src / "to-dir" / "new").write_bytes(b"n")
    os.unlink(src / "deleted")
    (src / "gone" / "inner" / "f").unlink()
    (src / "gone" / "inner").rmdir()
    (src / "gone").rmdir()
    (src / "dir-to-file" / "x").unlink()
    (src / "dir-to-file").rmdir()
    (src / "dir-to-file").write_bytes(b"now a file")
    (src / "added" / "sub").mkdir(parents=True)
    (src / "added" / "sub" / "f").write_bytes(b"a")
    os.chmod(src / "chmod-dir", 0o700)
    os.unlink(src / "retarget")
    os.symlink("t2", src / "retarget")
    settle(src)
    os.utime(src / "same", ns=(OLD_NS + 5, OLD_NS + 5))  # an mtime-only change is not a change
    b = build_tree(store, src)

    changes = diff_trees(store, a, b)
    assert statuses(changes) == [
        (b"added", "added"),
        (b"added/sub", "added"),
        (b"added/sub/f", "added"),
        (b"chmod-dir", "mode"),
        (b"content", "modified"),
        (b"deleted", "deleted"),
        (b"dir-to-file", "type"),
        (b"dir-to-file/x", "deleted"),
        (b"gone", "deleted"),
        (b"gone/inner", "deleted"),
        (b"gone/inner/f", "deleted"),
        (b"mode", "mode"),
        (b"retarget", "modified"),
        (b"to-dir", "type"),
        (b"to-dir/new", "added"),
        (b"to-link", "type"),
    ]
    by_path = {c.path: c for c in changes}
    assert by_path[b"content"].old.size == 2 and by_path[b"content"].new.size == 3  # type: ignore[union-attr]
    assert by_path[b"to-link"].new.target == b"same"  # type: ignore[union-attr]
    assert by_path[b"gone/inner/f"].new is None and by_path[b"added"].old is None

    # Reversed, every addition is a deletion and vice versa.
    back = {c.path: c.status for c in diff_trees(store, b, a)}
    assert back[b"added/sub/f"] == "deleted" and back[b"gone/inner/f"] == "added"
    assert diff_trees(store, a, a) == []
    assert diff_trees(store, None, None) == []
    assert statuses(diff_trees(store, None, a)) == [(p, "added") for p, _ in sorted(walk(store, a))]


def test_diff_does_not_read_identical_subtrees(tmp_path: Path, store: CountingStore) -> None:
    src = tmp_path / "src"
    (src / "big" / "deeper").mkdir(parents=True)
    (src / "big" / "deeper" / "f").write_bytes(b"f")
    (src / "small").write_bytes(b"1")
    settle(src)
    a = build_tree(store, src)
    (src / "small").write_bytes(b"2")
    settle(src)
    b = build_tree(store, src)
    shared = lookup(store, a, b"big")
    assert shared is not None and shared.oid is not None

    tree.clear_cache()
    store.gets.clear()
    assert statuses(diff_trees(store, a, b)) == [(b"small", "modified")]
    assert store.gets == [a, b]

    # The same diff again (a commit asks for it four times) reads nothing, and a caller that
    # changes its list changes no one else's.
    tree._cache.clear()  # the decoded trees, not the remembered diffs
    first = diff_trees(store, a, b)
    first.clear()
    assert statuses(diff_trees(store, a, b)) == [(b"small", "modified")]
    assert store.gets == [a, b]


# --- hostile trees ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [b"..", b"a/b", b".", b"x\0y"])
def test_materialize_refuses_bad_name(tmp_path: Path, store: CountingStore, name: bytes) -> None:
    blob = store.put("blob", b"pwned")
    inner = store.put("tree", raw_tree(raw_entry(name, 1, 0o644, 5, 0, bytes(blob))))
    outer = store.put("tree", raw_tree(raw_entry(b"sub", 2, 0o755, 0, 0, bytes(inner))))
    arena = tmp_path / "arena"
    arena.mkdir()
    with pytest.raises(TreeError, match="malformed tree object"):
        materialize(store, outer, arena / "dest")
    # It stopped at the bad tree: nothing was written inside or outside the destination.
    assert os.listdir(arena) == ["dest"]
    assert os.listdir(arena / "dest") == ["sub"]
    assert os.listdir(arena / "dest" / "sub") == []
    assert sorted(os.listdir(tmp_path)) == ["arena", "store"]


def test_materialize_never_follows_its_symlinks(tmp_path: Path, store: CountingStore) -> None:
    # A symlink cannot be used to redirect a later entry: names never contain "/" and the
    # link's own name cannot repeat in one tree, so the tree below is the worst that decodes.
    outside = tmp_path / "outside"
    outside.mkdir()
    link = Entry(b"esc", "symlink", 0o777, len(os.fsencode(outside)), 0, None, os.fsencode(outside))
    root = store.put("tree", encode_tree([link]))
    materialize(store, root, tmp_path / "dest")
    assert os.readlink(tmp_path / "dest" / "esc") == str(outside)
    assert os.listdir(outside) == []
    dup = raw_tree(
        raw_entry(b"esc", 3, 0o777, 1, 0, b"\x00\x01/"),
        raw_entry(b"esc", 1, 0o644, 1, 0, bytes(OID_A)),
    )
    with pytest.raises(TreeError, match="duplicate"):
        materialize(store, store.put("tree", dup), tmp_path / "dest2")


# --- reachability -----------------------------------------------------------------------------


def test_reachable_lists_every_tree_and_file_object(tmp_path: Path, store: CountingStore) -> None:
    src = tmp_path / "src"
    make_sample(src)
    root = build_tree(store, src)
    expected = {root} | {e.oid for _, e in walk(store, root) if e.oid is not None}
    assert reachable(store, root) == expected
    assert {store.kind(o) for o in expected} == {"tree", "blob"}


def test_reachable_with_walked_skips_the_shared_subtrees_of_a_second_tree(
    tmp_path: Path, store: CountingStore
) -> None:
    src = tmp_path / "src"
    for d in ("a", "b", "c"):
        (src / d).mkdir(parents=True)
        for i in range(3):
            (src / d / f"f{i}").write_text(f"{d} {i}\n")
    first = build_tree(store, src)
    (src / "c" / "f0").write_text("changed\n")
    second = build_tree(store, src)
    shared = {lookup(store, first, b"a").oid, lookup(store, first, b"b").oid}

    walked: set[ObjectId] = set()
    closure = reachable(store, first, walked) | reachable(store, second, walked)
    tree.clear_cache()
    store.gets = []
    again = reachable(store, second, {first, *shared})
    read = set(store.gets)

    assert not shared & read  # the shared sub-trees were not read again
    assert closure == reachable(store, first) | reachable(store, second)
    assert shared <= walked and {first, second} <= walked
    below_shared = set().union(*(reachable(store, t) for t in shared)) - shared
    assert again == reachable(store, second) - below_shared


def test_build_tree_exclude_leaves_paths_out(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "tapes" / ".jukebox").mkdir(parents=True)
    (src / "tapes" / "run.jbx").write_bytes(b"tape")
    (src / "tapes" / "kept.json").write_text("{}")
    (src / "code.py").write_text("x = 1\n")
    with Store.open(tmp_path / "store") as store:
        root = build_tree(
            store, src, exclude=lambda p: p == b"tapes/.jukebox" or p.endswith(b".jbx")
        )
        assert sorted(p for p, _ in walk(store, root)) == [b"code.py", b"tapes", b"tapes/kept.json"]


def test_times_beyond_what_a_tree_records_are_clamped_not_refused(
    tmp_path: Path, store: CountingStore
) -> None:
    # ext4 keeps times to the year 2446; a tree keeps signed 64-bit nanoseconds (1677 to 2262).
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    late = 10_413_792_000 * 10**9  # 2300-01-01
    (src / "sub" / "future.txt").write_text("from the future\n")
    os.utime(src / "sub" / "future.txt", ns=(late, late))
    os.symlink("future.txt", src / "sub" / "link")
    os.utime(src / "sub" / "link", ns=(late, late), follow_symlinks=False)
    os.utime(src / "sub", ns=(late, late))
    root = build_tree(store, src)
    i64_max = (1 << 63) - 1
    for path in (b"sub", b"sub/future.txt", b"sub/link"):
        e = lookup(store, root, path)
        assert e is not None and e.mtime_ns == i64_max, path
    assert build_tree(store, src, previous=root) == root
    assert tree.clamp_time_ns(-late) == -(1 << 63)
