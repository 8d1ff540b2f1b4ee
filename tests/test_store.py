"""The content-addressed store, against real packs, a real sqlite index and real processes."""

from __future__ import annotations

import filecmp
import io
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from shadowfs.errors import ObjectCorrupt, ObjectMissing, StoreBusy, StoreError
from shadowfs.oid import ObjectId, hash_object
from shadowfs.pack import PACK_HEADER_LEN
from shadowfs.store import (
    CHUNK_SIZE,
    MAX_DELTA_DEPTH,
    STAGE_LIMIT,
    STAGE_MAX,
    Store,
    decode_chunks,
    encode_chunks,
)
from shadowfs.store_index import StoreIndex

REPO = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


def packs(root: Path) -> list[Path]:
    return sorted((root / "packs").glob("pack-*.pack"))


def text(n: int, seed: int = 0) -> bytes:
    """Compressible, source-like bytes that differ by seed."""
    line = f"def f_{seed}(x):\n    return x * {seed} + 1  # a comment\n".encode()
    return (line * (n // len(line) + 1))[:n]


def run_py(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )


def drop_index(root: Path) -> None:
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (root / name).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "size",
    [0, 1, 1000, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 2 * CHUNK_SIZE, 9 * MiB],
)
def test_file_round_trip(tmp_path: Path, size: int) -> None:
    data = os.urandom(size // 2) + text(size - size // 2)
    src = tmp_path / "src"
    src.write_bytes(data)
    with Store.open(tmp_path / "store") as store:
        oid = store.put_file(src)
        if size <= CHUNK_SIZE:
            assert store.kind(oid) == "blob"
            assert oid == hash_object("blob", data) == store.put("blob", data)
        else:
            assert store.kind(oid) == "chunks"
            chunks = decode_chunks(store.get(oid))
            assert [n for _, n in chunks] == [
                min(CHUNK_SIZE, size - i) for i in range(0, size, CHUNK_SIZE)
            ]
        assert store.size(oid) == size
        out = io.BytesIO()
        assert store.read_file_into(oid, out) == size
        assert out.getvalue() == data
    with Store.open(tmp_path / "store", create=False) as store:
        assert store.read_bytes(oid) == data
        assert store.verify() == []


def _bytes_read() -> int:
    """What this process has read through read(2) and friends so far (/proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_put_file_hashes_holes_without_reading_them(tmp_path: Path) -> None:
    """A 2 GiB sparse file with a little data: every chunk has the id its bytes have (the one
    reading them would give), and only the chunks that hold data are read."""
    sparse = tmp_path / "sparse"
    size = 2 << 30
    layout = [(CHUNK_SIZE * 101 - MiB, os.urandom(3 * MiB)), (size - 10, b"tail")]
    with open(sparse, "wb") as f:
        f.truncate(size)
        for offset, piece in layout:
            f.seek(offset)
            f.write(piece)
    if os.stat(sparse).st_blocks * 512 > 64 * MiB:
        pytest.skip("this file system does not keep the file sparse")

    def chunk_bytes(i: int) -> bytes:
        out = bytearray(CHUNK_SIZE)
        for offset, piece in layout:
            lo, hi = max(offset, i * CHUNK_SIZE), min(offset + len(piece), (i + 1) * CHUNK_SIZE)
            if lo < hi:
                out[lo - i * CHUNK_SIZE : hi - i * CHUNK_SIZE] = piece[lo - offset : hi - offset]
        return bytes(out)

    with Store.open(tmp_path / "store") as store:
        before = _bytes_read()
        oid = store.put_file(sparse)
        assert _bytes_read() - before < 4 * CHUNK_SIZE  # chunks 100, 101, the last (of 512)
        assert store.size(oid) == size
        chunks = decode_chunks(store.get(oid))
        assert len(chunks) == size // CHUNK_SIZE
        for i in (0, 99, 100, 101, 102, len(chunks) - 1):
            assert chunks[i] == (hash_object("blob", chunk_bytes(i)), CHUNK_SIZE)
        assert len({c for c, _ in chunks}) == 4  # the zero chunk and three with data
        assert store.verify() == []


def test_put_file_reads_from_an_fd_and_leaves_it_open(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"abc" * 1000)
    fd = os.open(src, os.O_RDONLY)
    try:
        with Store.open(tmp_path / "store") as store:
            oid = store.put_file(fd)
            assert store.get(oid) == b"abc" * 1000
        os.fstat(fd)  # still open
    finally:
        os.close(fd)


def test_kinds_are_part_of_the_id_and_objects_survive_reopen(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        a = store.put("blob", b"same bytes")
        b = store.put("tree", b"same bytes")
        assert a != b
        assert (store.kind(a), store.kind(b)) == ("blob", "tree")
    with Store.open(tmp_path) as store:
        assert store.get(a) == store.get(b) == b"same bytes"
        assert set(store.iter_oids()) == {a, b}


def test_a_blob_over_the_chunk_size_is_refused(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store, pytest.raises(StoreError, match="put_file"):
        store.put("blob", bytes(CHUNK_SIZE + 1))


def test_open_without_create_and_use_after_close_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no store at"):
        Store.open(tmp_path / "nowhere", create=False)
    store = Store.open(tmp_path / "s")
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get(hash_object("blob", b""))


# ---------------------------------------------------------------------------- dedup and deltas


def test_put_dedups_within_a_batch_and_across_opens(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        oids = {store.put("json", b'{"n": %d}' % (i % 10)) for i in range(100)}
        assert len(oids) == 10
        store.flush()
        before = store.stats()
    with Store.open(tmp_path) as store:
        for i in range(10):
            store.put("json", b'{"n": %d}' % i)
        store.flush()
        after = store.stats()
    assert after.objects == before.objects == 10
    assert after.pack_bytes == before.pack_bytes


def test_delta_round_trip_is_smaller_than_plain(tmp_path: Path) -> None:
    base_data = os.urandom(64 * 1024)  # incompressible alone, so only a delta can shrink an edit
    edited = base_data[:1000] + b"EDIT" + base_data[1004:]
    with Store.open(tmp_path) as store:
        base = store.put("blob", base_data)
        oid = store.put("blob", edited, delta_base=base)
        plain = store.put("blob", edited[::-1])
        assert store.get(oid) == edited
        store.flush()
        stats = store.stats()
    idx = StoreIndex.open(tmp_path / "index.sqlite")
    try:
        entry, plain_entry = idx.lookup(oid), idx.lookup(plain)
        assert entry is not None and plain_entry is not None
        assert entry.delta_base == base and entry.depth == 1
        assert entry.stored_len < 1000 < plain_entry.stored_len
    finally:
        idx.close()
    assert stats.stored_bytes < stats.raw_bytes
    with Store.open(tmp_path) as store:
        assert store.get(oid) == edited
        assert store.verify() == []


def test_delta_chains_are_capped_and_survive_a_rebuild(tmp_path: Path) -> None:
    versions = [text(20_000, 1) + b"v%d" % i for i in range(3 * MAX_DELTA_DEPTH)]
    with Store.open(tmp_path) as store:
        prev = None
        oids = []
        for v in versions:
            prev = store.put("blob", v, delta_base=prev)
            oids.append(prev)
        assert [store.get(o) for o in oids] == versions
    idx = StoreIndex.open(tmp_path / "index.sqlite")
    try:
        depths = [idx.lookup(o).depth for o in oids]  # type: ignore[union-attr]
    finally:
        idx.close()
    assert max(depths) == MAX_DELTA_DEPTH
    assert depths[MAX_DELTA_DEPTH + 1] == 0  # past the cap the next version starts a new chain
    drop_index(tmp_path)
    with Store.open(tmp_path) as store:
        assert [store.get(o) for o in oids] == versions
        assert store.verify() == []
    idx = StoreIndex.open(tmp_path / "index.sqlite")
    try:
        assert [idx.lookup(o).depth for o in oids] == depths  # type: ignore[union-attr]
    finally:
        idx.close()


def test_a_missing_delta_base_stores_plainly(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        ghost = hash_object("blob", b"never stored")
        oid = store.put("blob", b"data" * 100, delta_base=ghost)
        assert store.get(oid) == b"data" * 100


# ---------------------------------------------------------------------------- missing and corrupt


def test_missing_object(tmp_path: Path) -> None:
    ghost = hash_object("blob", b"nope")
    with Store.open(tmp_path) as store:
        assert not store.has(ghost)
        for call in (store.get, store.kind, store.size):
            with pytest.raises(ObjectMissing, match=str(ghost)):
                call(ghost)


def test_a_flipped_payload_byte_names_the_pack_and_offset(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        keep = store.put("blob", b"fine" * 50)
        bad = store.put("blob", text(5000))
    pack = packs(tmp_path)[0]
    raw = bytearray(pack.read_bytes())
    raw[-10] ^= 0x01  # inside the last record's payload
    pack.write_bytes(raw)
    with Store.open(tmp_path) as store:
        assert store.get(keep) == b"fine" * 50
        with pytest.raises(ObjectCorrupt) as info:
            store.get(bad)
        assert pack.name in str(info.value) and "offset" in str(info.value)
        problems = store.verify()
        assert [(p.oid, p.pack) for p in problems] == [(bad, pack.name)]
        assert problems[0].offset > 0


def test_read_blobs_reads_many_files_at_once_as_read_file_into_does(tmp_path: Path) -> None:
    """The commit's bulk read: plain and raw blobs from the pack, a delta, a chunked file and a
    blob not flushed yet, in the order asked; a damaged record or a tree is refused."""
    with Store.open(tmp_path / "store") as store:
        plain = [store.put("blob", text(500, seed)) for seed in range(40)]
        raw = store.put("blob", os.urandom(64))
        delta = store.put("blob", text(500, 3) + b"edit", delta_base=plain[3])
        big = tmp_path / "big"
        big.write_bytes(os.urandom(CHUNK_SIZE + 10))
        chunked = store.put_file(big)
        tree = store.put("tree", b"\x01")
        store.flush()
        waiting = store.put("blob", b"not flushed yet")
        asked = [plain[7], raw, delta, *plain, chunked, waiting, plain[7]]
        want = []
        for oid in asked:
            sink = io.BytesIO()
            store.read_file_into(oid, sink)
            want.append(sink.getvalue())
        assert store.read_blobs(asked) == want
        with store.prefetched_blobs(asked):  # places found ahead, as a commit's staging does
            assert store.read_blobs(asked) == want
        with pytest.raises(StoreError, match="not file content"):
            store.read_blobs([plain[0], tree])
    pack = packs(tmp_path / "store")[0]
    data = bytearray(pack.read_bytes())
    at = data.index(bytes(plain[20]))  # the record's header names its id
    data[at + 40] ^= 0x01  # its payload
    pack.write_bytes(data)
    with Store.open(tmp_path / "store") as store:
        assert store.read_blobs(plain[:20]) == [text(500, seed) for seed in range(20)]
        with pytest.raises(ObjectCorrupt, match=str(plain[20])):
            store.read_blobs(plain)
        with store.prefetched_blobs(plain), pytest.raises(ObjectCorrupt, match=str(plain[20])):
            store.read_blobs(plain)


def _small_mixed_store(root: Path) -> dict[ObjectId, bytes]:
    """One small pack holding every record shape: zstd, raw, empty, delta, chunks, another kind."""
    contents: dict[ObjectId, bytes] = {}
    with Store.open(root) as store:
        a = store.put("blob", text(300))
        contents[a] = text(300)
        r = os.urandom(40)
        contents[store.put("blob", r)] = r
        contents[store.put("blob", b"")] = b""
        d = text(300) + b"tail"
        contents[store.put("blob", d, delta_base=a)] = d
        c = encode_chunks([(a, 300)])
        contents[store.put("chunks", c)] = c
        contents[store.put("tree", b"t" * 20)] = b"t" * 20
    assert len(packs(root)) == 1
    return contents


def _check_damage_is_caught(store: Store, contents: dict[ObjectId, bytes]) -> bool:
    for oid, data in contents.items():
        try:
            got = store.get(oid)
        except StoreError:
            continue
        assert got == data, "damage returned wrong bytes silently"
    return bool(store.verify())


def test_every_flipped_byte_of_a_pack_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "store"
    contents = _small_mixed_store(root)
    pack = packs(root)[0]
    original = pack.read_bytes()
    missed = []
    fd = os.open(pack, os.O_WRONLY)
    try:
        with Store.open(root) as store:
            for offset in range(len(original)):
                for mask in (0x01, 0xFF) if offset % 5 == 0 else (0x01,):
                    os.pwrite(fd, bytes([original[offset] ^ mask]), offset)
                    if not _check_damage_is_caught(store, contents):
                        missed.append((offset, mask))
                    if offset % 13 == 0:
                        # A copy with no index: rebuilding it must not launder the damage.
                        copy = tmp_path / "copy" / f"{offset}-{mask}"
                        (copy / "packs").mkdir(parents=True)
                        (copy / "packs" / pack.name).write_bytes(pack.read_bytes())
                        try:
                            fresh = Store.open(copy)
                        except StoreError:
                            pass
                        else:
                            with fresh:
                                if not _check_damage_is_caught(fresh, contents):
                                    missed.append((offset, mask))
                    os.pwrite(fd, original[offset : offset + 1], offset)
    finally:
        os.close(fd)
    assert missed == []
    assert pack.read_bytes() == original
    with Store.open(root) as store:
        assert store.verify() == []


def test_verify_checks_packs_the_index_does_not_know(tmp_path: Path) -> None:
    contents = _small_mixed_store(tmp_path)
    pack = packs(tmp_path)[0]
    stray = pack.with_name("pack-" + "ab" * 16 + ".pack")
    raw = bytearray(pack.read_bytes())
    raw[-3] ^= 0x01
    stray.write_bytes(raw)
    with Store.open(tmp_path) as store:
        problems = store.verify()
        assert [p.pack for p in problems] == [stray.name]
        for oid, data in contents.items():
            assert store.get(oid) == data  # the index still points at the intact copies


# ---------------------------------------------------------------------------- index and crashes


def test_index_is_rebuilt_from_packs_when_deleted(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        blobs = {store.put("blob", text(100 + i, i)): text(100 + i, i) for i in range(200)}
        big = tmp_path / "big"
        big.write_bytes(os.urandom(CHUNK_SIZE + 10))
        chunked = store.put_file(big)
    drop_index(tmp_path)
    with Store.open(tmp_path) as store:
        for oid, data in blobs.items():
            assert store.get(oid) == data
        assert store.size(chunked) == CHUNK_SIZE + 10
        seen: list[tuple[int, int]] = []
        assert store.verify(progress=lambda d, t: seen.append((d, t))) == []
        assert seen[-1][0] == seen[-1][1] == store.stats().pack_bytes
        assert store.rebuild_index() == len(blobs) + 3  # two chunks and the chunks object
        assert store.stats().objects == len(blobs) + 3


def test_damaged_index_is_a_clear_error(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        store.put("blob", b"x")
    drop_index(tmp_path)
    (tmp_path / "index.sqlite").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="delete it and reopen"):
        Store.open(tmp_path)


def _journal_mode(path: Path) -> str:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    finally:
        conn.close()


def test_a_rebuilt_index_is_in_wal_mode_before_anyone_opens_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes opening a new store at once each switched its index to WAL, and two switching
    together failed one of them at once ("database is locked": sqlite's deadlock avoidance
    skips the busy wait there), which stopped one of eight booths starting on a fresh tape dir.
    The index is now switched before it is named, so no opener has anything to switch."""
    with Store.open(tmp_path) as store:
        store.put("blob", b"x")
    drop_index(tmp_path)
    built: list[str] = []
    real_rename = os.rename

    def watch(src: str | Path, dst: str | Path) -> None:
        if Path(dst).name == "index.sqlite":
            built.append(_journal_mode(Path(src)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", watch)  # watched: the real rename runs
    Store.open(tmp_path).close()
    assert built == ["wal"]


def test_an_index_in_another_journal_mode_is_switched_while_a_writer_holds_it(
    tmp_path: Path,
) -> None:
    """An index made in rollback mode (by hand, or by an older version) is switched at open.
    With another connection holding the write lock, sqlite fails the switch at once instead of
    waiting: the open waits for the writer instead of calling a healthy index unusable."""
    with Store.open(tmp_path) as store:
        oid = store.put("blob", b"kept")
    index = tmp_path / "index.sqlite"
    conn = sqlite3.connect(index, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.3, conn.rollback)
    release.start()
    try:
        with Store.open(tmp_path) as store:
            assert store.get(oid) == b"kept"
    finally:
        release.join()
        conn.close()
    assert _journal_mode(index) == "wal"


CRASH_WRITER = """
import os, sys
from shadowfs.store import Store
root = sys.argv[1]
store = Store.open(root)
store.put("blob", b"flushed")
store.flush()
# Big enough to bypass the write buffer, so the records reach the pack but are never indexed.
store.put("blob", os.urandom(2 << 20))
store.put("blob", os.urandom(2 << 20))
os._exit(0)
"""


def test_torn_pack_tail_is_cut_and_intact_unflushed_records_adopted(tmp_path: Path) -> None:
    proc = run_py(CRASH_WRITER, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    pack = packs(tmp_path)[0]
    full = pack.stat().st_size
    os.truncate(pack, full - 1000)  # the second big record was cut short by the "crash"
    with Store.open(tmp_path) as store:
        assert store.get(hash_object("blob", b"flushed")) == b"flushed"
        assert store.stats().objects == 2  # the flushed one and the intact unflushed one
        assert store.verify() == []
    cut = pack.stat().st_size
    assert cut < full - 1000
    # A zero-filled tail (lost data blocks after a crash) is also an unfinished write.
    with open(pack, "ab") as f:
        f.write(bytes(4096))
    drop_index(tmp_path)  # and rebuild skips it too
    with Store.open(tmp_path) as store:
        assert store.stats().objects == 2
        assert store.verify() == []
        oid = store.put("blob", b"after the crash")
        store.flush()
    with Store.open(tmp_path) as store:
        assert store.get(oid) == b"after the crash"
        assert store.verify() == []


def test_small_puts_wait_in_memory_until_a_flush_but_never_more_than_the_limit(
    tmp_path: Path,
) -> None:
    with Store.open(tmp_path) as store, Store.open(tmp_path) as other:
        first = store.put("blob", b"waiting")
        assert store.get(first) == b"waiting" and store.kind(first) == "blob"
        assert store.size(first) == 7 and store.has(first)
        assert not other.has(first)
        assert sum(p.stat().st_size for p in packs(tmp_path)) <= PACK_HEADER_LEN
        # Random bytes (no compression): once more than the limit waits, it is written out.
        count = 3 * STAGE_LIMIT // STAGE_MAX
        many = [store.put("blob", os.urandom(STAGE_MAX // 2)) for _ in range(count)]
        on_disk = sum(p.stat().st_size for p in packs(tmp_path))
        assert on_disk >= 3 * STAGE_LIMIT // 2 - STAGE_LIMIT - 2 * MiB
        assert not other.has(many[0])  # written, not yet indexed: a flush vouches for it
        store.flush()
        assert other.has(first) and other.has(many[-1])
        assert other.get(many[0]) == store.get(many[0])
    with Store.open(tmp_path) as store:
        assert store.verify() == []


def test_a_writer_reuses_an_unlocked_pack(tmp_path: Path) -> None:
    for i in range(3):
        with Store.open(tmp_path) as store:
            store.put("blob", b"object %d" % i)
    assert len(packs(tmp_path)) == 1
    with Store.open(tmp_path) as one, Store.open(tmp_path) as two:
        one.put("blob", b"from one")
        two.put("blob", b"from two")
        one.flush()  # a put is staged in memory; its pack is taken when it is written
        two.flush()  # the shared pack is taken: a second one appears
        assert len(packs(tmp_path)) == 2


def test_objects_become_visible_to_other_stores_at_flush(tmp_path: Path) -> None:
    with Store.open(tmp_path) as writer, Store.open(tmp_path) as reader:
        oid = writer.put("blob", b"soon")
        assert not reader.has(oid)
        writer.flush()
        assert reader.get(oid) == b"soon"


CONCURRENT_WRITER = """
import sys
from shadowfs.store import Store
root, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Store.open(root) as store:
    for i in range(n):
        store.put("blob", b"%s own object %d " % (tag.encode(), i) * 3)
        store.put("blob", b"shared object %d" % i)
        if i % 50 == 0:
            store.flush()
"""


def test_two_processes_write_one_store_at_once(tmp_path: Path) -> None:
    n = 3000
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_WRITER, str(tmp_path), tag, str(n)],
            cwd=REPO, stderr=subprocess.PIPE, text=True,
        )
        for tag in ("a", "b")
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    with Store.open(tmp_path) as store:
        for i in range(n):
            for tag in (b"a", b"b"):
                data = b"%s own object %d " % (tag, i) * 3
                assert store.get(hash_object("blob", data)) == data
            shared = b"shared object %d" % i
            assert store.get(hash_object("blob", shared)) == shared
        assert store.stats().objects == 3 * n
        assert store.verify() == []


# ---------------------------------------------------------------------------- gc


def _gc_fixture(root: Path) -> tuple[dict[str, ObjectId], Path]:
    big = root.parent / "big"
    big.write_bytes(os.urandom(CHUNK_SIZE) + b"tail")
    with Store.open(root) as store:
        oids = {
            "live": store.put("blob", text(3000, 1)),
            "dead": store.put("blob", text(3000, 2)),
            "base": store.put("blob", text(3000, 3)),
            "chunked": store.put_file(big),
        }
        oids["delta"] = store.put("blob", text(3000, 3) + b"!", delta_base=oids["base"])
        oids["dead_delta"] = store.put("blob", text(3000, 3) + b"?", delta_base=oids["base"])
        chunks = decode_chunks(store.get(oids["chunked"]))
        oids["chunk0"], oids["chunk1"] = chunks[0][0], chunks[1][0]
    return oids, big


def test_gc_keeps_young_objects_within_the_grace_period(tmp_path: Path) -> None:
    root = tmp_path / "store"
    oids, _ = _gc_fixture(root)
    with Store.open(root) as store:
        report = store.gc({oids["live"]})
        assert (report.removed, report.kept) == (0, len(oids))
        assert all(store.has(o) for o in oids.values())


def test_gc_removes_what_nothing_live_needs(tmp_path: Path) -> None:
    root = tmp_path / "store"
    oids, big = _gc_fixture(root)
    live = {oids["live"], oids["delta"], oids["chunked"]}
    with Store.open(root) as store:
        before = store.stats()
        dry = store.gc(live, grace_seconds=0, dry_run=True)
        assert (dry.kept, dry.removed) == (6, 2)
        assert store.stats() == before
        seen: list[tuple[int, int]] = []
        report = store.gc(live, grace_seconds=0, progress=lambda d, t: seen.append((d, t)))
        assert (report.kept, report.removed) == (6, 2)
        assert report.bytes_freed > 0
        assert seen and seen[-1][0] == seen[-1][1]
        for name in ("dead", "dead_delta"):
            with pytest.raises(ObjectMissing):
                store.get(oids[name])
        assert store.get(oids["live"]) == text(3000, 1)
        assert store.get(oids["delta"]) == text(3000, 3) + b"!"
        out = io.BytesIO()
        store.read_file_into(oids["chunked"], out)
        assert out.getvalue() == big.read_bytes()
        assert store.verify() == []
        after = store.stats()
        assert after.objects == 6 and after.pack_bytes < before.pack_bytes
        # The store keeps working after its writer's pack was rewritten.
        again = store.put("blob", b"written after gc")
    drop_index(root)  # the rewritten packs alone describe the same store
    with Store.open(root) as store:
        assert store.stats().objects == 7
        assert store.get(again) == b"written after gc"
        assert store.verify() == []


def test_gc_leaves_a_pack_little_of_which_is_garbage_and_forgets_the_garbage(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    oids, big = _gc_fixture(root)  # the 4 MiB file outweighs the dead objects by far
    live = {oids["live"], oids["delta"], oids["chunked"]}
    pack_bytes = {p: p.read_bytes() for p in packs(root)}
    with Store.open(root) as store:
        report = store.gc(live, grace_seconds=0, min_waste=0.25)
        assert (report.kept, report.removed, report.bytes_freed) == (6, 2, 0)
        assert report.bytes_left > 0
        assert {p: p.read_bytes() for p in packs(root)} == pack_bytes  # nothing copied
        for name in ("dead", "dead_delta"):
            assert not store.has(oids[name])
            with pytest.raises(ObjectMissing):
                store.get(oids[name])
        assert store.get(oids["delta"]) == text(3000, 3) + b"!"
        assert store.verify() == []
        assert store.gc(live, grace_seconds=0, min_waste=0.25).removed == 0
        compacted = store.gc(live, grace_seconds=0)  # min_waste 0: every wasteful pack
        assert (compacted.removed, compacted.bytes_freed) == (0, report.bytes_left)
        assert sum(p.stat().st_size for p in packs(root)) < sum(map(len, pack_bytes.values()))
        out = io.BytesIO()
        store.read_file_into(oids["chunked"], out)
        assert out.getvalue() == big.read_bytes()


def test_a_reader_keeps_reading_across_a_gc(tmp_path: Path) -> None:
    root = tmp_path / "store"
    oids, _ = _gc_fixture(root)
    with Store.open(root) as reader, Store.open(root) as collector:
        assert reader.get(oids["live"]) == text(3000, 1)  # caches the old pack's fd
        collector.gc({oids["live"]}, grace_seconds=0)
        assert reader.get(oids["live"]) == text(3000, 1)
        with pytest.raises(ObjectMissing):
            reader.get(oids["dead"])


def test_gc_interrupted_before_deleting_old_packs_leaves_a_sound_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    oids, _ = _gc_fixture(root)
    old = {p: p.read_bytes() for p in packs(root)}
    with Store.open(root) as store:
        store.gc({oids["live"]}, grace_seconds=0)
    for path, data in old.items():  # as if the process died between commit and unlink
        path.write_bytes(data)
    with Store.open(root) as store:
        assert store.get(oids["live"]) == text(3000, 1)
        assert store.verify() == []
        store.gc({oids["live"]}, grace_seconds=0)
        assert [p for p in packs(root) if p in old] == []
        assert store.get(oids["live"]) == text(3000, 1)
        assert store.stats().objects == 1
        assert store.verify() == []


def test_gc_refuses_while_another_store_is_writing(tmp_path: Path) -> None:
    with Store.open(tmp_path) as writer, Store.open(tmp_path) as other:
        writer.put("blob", b"in flight")
        with pytest.raises(StoreBusy, match="retry"):
            other.gc(set(), grace_seconds=0)
        writer.flush()
    with Store.open(tmp_path) as store:
        assert store.gc(set(), grace_seconds=0).removed == 1


# ---------------------------------------------------------------------------- bounded memory


# A child's ru_maxrss is useless here: Linux carries the pre-exec address space's high-water mark
# across execve, so a child of a big pytest process starts at the parent's peak and shows no
# growth whatever it does. VmHWM belongs to the child's own address space, and writing 5 to
# clear_refs resets it to the current RSS: growth is VmHWM after the work minus that baseline.
PEAK = """
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmHWM")

def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise SystemExit(f"no {key} in /proc/self/status")
"""

STREAMER = PEAK + """
import json, os, sys
from shadowfs.store import Store
root, src, dst = sys.argv[1:4]
with open(src, "wb") as f:
    for i in range(64):
        f.write(os.urandom(1 << 19) + bytes([i]) * (1 << 19))
with Store.open(root) as store:
    store.put("blob", b"warm up the compressor")
    before = reset_peak()
    oid = store.put_file(src)
    store.flush()
    with open(dst, "wb") as f:
        size = store.read_file_into(oid, f)
    after = status_kib("VmHWM")
    print(json.dumps({"growth_kib": after - before, "size": size, "kind": store.kind(oid)}))
"""


def test_a_64_mib_file_streams_in_bounded_memory(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    proc = run_py(STREAMER, str(tmp_path / "store"), str(src), str(dst))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["size"] == 64 * MiB and result["kind"] == "chunks"
    assert result["growth_kib"] < 40 * 1024, result  # well under the 64 MiB file
    assert filecmp.cmp(src, dst, shallow=False)


BIG_FILE_MIB = 256  # four times the RSS bound: a file held whole would show

BIG_PUTTER = PEAK + """
import json, os, sys
from shadowfs.store import Store
from shadowfs.tree import build_tree, lookup
work, mib = sys.argv[1], int(sys.argv[2])
os.mkdir(f"{work}/dir")
src = f"{work}/dir/big.bin"
with open(src, "wb") as f:
    for _ in range(mib):
        f.write(os.urandom(1 << 20))  # incompressible, every chunk distinct: nothing to hide it
out = {}
with Store.open(f"{work}/file-store") as store:
    store.put("blob", b"warm up the compressor")
    before = reset_peak()
    oid = store.put_file(src)
    store.flush()
    out["put_file_kib"] = status_kib("VmHWM") - before
    out["kind"], out["size"] = store.kind(oid), store.size(oid)
# A second store, so build_tree writes every chunk again instead of finding them stored.
with Store.open(f"{work}/tree-store") as store:
    store.put("blob", b"warm up the compressor")
    before = reset_peak()
    tree = build_tree(store, f"{work}/dir")
    store.flush()
    out["build_tree_kib"] = status_kib("VmHWM") - before
    out["same_id"] = lookup(store, tree, b"big.bin").oid == oid
print(json.dumps(out))
"""


@pytest.mark.slow
def test_put_file_and_build_tree_of_a_big_file_grow_rss_by_under_64_mib(
    tmp_path: Path,
) -> None:
    proc = run_py(BIG_PUTTER, str(tmp_path), str(BIG_FILE_MIB))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["kind"] == "chunks" and got["size"] == BIG_FILE_MIB * MiB
    assert got["same_id"], "build_tree stored the file under another id than put_file"
    assert got["put_file_kib"] < 64 * 1024, got
    assert got["build_tree_kib"] < 64 * 1024, got


def test_pack_files_start_with_their_header(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        store.put("blob", b"x")
    assert packs(tmp_path)[0].read_bytes()[:PACK_HEADER_LEN] == b"SFPACK\x00\x01"


def _indexed(root: Path, oids: list[ObjectId], within: float) -> bool:
    """Whether another Store (which reads only the index) sees all of ``oids`` within seconds."""
    import time

    deadline = time.monotonic() + within
    with Store.open(root) as other:
        while True:
            if all(other.has(o) for o in oids):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


def test_the_group_commit_stands_aside_for_a_foreground_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from shadowfs import store as store_mod

    monkeypatch.setattr(store_mod, "FOREGROUND_WAIT", 1.0)
    with Store.open(tmp_path / "s", create=True) as st:
        with st.foreground():
            oid = st.put("blob", b"put in the foreground")
            st.flush_soon(delay=0)
            assert not _indexed(st.root, [oid], within=0.05)  # waiting for the section to end
        left = time.monotonic()
        assert _indexed(st.root, [oid], within=5)
        assert time.monotonic() - left < 0.5  # woken when the section ended, not timed out


def test_the_group_commit_waits_out_a_foreground_section_only_so_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shadowfs import store as store_mod

    monkeypatch.setattr(store_mod, "FOREGROUND_WAIT", 0.05)
    with Store.open(tmp_path / "s", create=True) as st, st.foreground():
        oids = [st.put("blob", b"in a section that never ends %d" % i) for i in range(3)]
        st.flush_soon(delay=0)
        assert _indexed(st.root, oids, within=5)


def test_a_put_over_the_stage_limit_does_not_wait_for_a_flusher_standing_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot whose puts pass the stage limit drains inline, under the flush lock; a flusher
    holding that lock while it stands aside for the snapshot must give way at once."""
    import time

    from shadowfs import store as store_mod

    monkeypatch.setattr(store_mod, "FOREGROUND_WAIT", 5.0)
    monkeypatch.setattr(store_mod, "STAGE_LIMIT", 64 * 1024)
    with Store.open(tmp_path / "s", create=True) as st, st.foreground():
        st.put("blob", b"staged before the flusher starts")
        st.flush_soon(delay=0)
        deadline = time.monotonic() + 5
        while st._flush_lock.acquire(blocking=False):  # free: the flusher is not in yet
            st._flush_lock.release()
            assert time.monotonic() < deadline, "the group commit never started"
            time.sleep(0.001)
        t0 = time.monotonic()
        data = [os.urandom(16 * 1024) for _ in range(8)]
        oids = [st.put("blob", d) for d in data]
        assert time.monotonic() - t0 < 2.5, "the put waited out the flusher's stand-aside"
        assert [st.get(oid) for oid in oids] == data


def test_puts_go_on_while_a_flush_writes_the_index(tmp_path: Path) -> None:
    """A snapshot on another thread must not wait for the group commit's index write, which
    takes milliseconds whenever sqlite checkpoints its WAL. The write is held open here."""
    import threading

    with Store.open(tmp_path / "s", create=True) as st:
        first = st.put("blob", b"in the flush's batch")
        idx = st._idx()
        inside, release = threading.Event(), threading.Event()
        plain_insert = idx.insert

        def held_insert(entries):  # type: ignore[no-untyped-def]
            plain_insert(entries)
            inside.set()
            release.wait(10)

        idx.insert = held_insert  # type: ignore[method-assign]
        flusher = threading.Thread(target=st.flush)
        putter: threading.Thread | None = None
        flusher.start()
        try:
            assert inside.wait(10)
            done = threading.Event()

            def put_and_read() -> None:
                oid = st.put("blob", b"put while the index is being written")
                assert st.read_bytes(oid) == b"put while the index is being written"
                assert st.read_bytes(first) == b"in the flush's batch"
                done.set()

            putter = threading.Thread(target=put_and_read)
            putter.start()
            assert done.wait(5), "a put waited for the index write"
        finally:
            release.set()
            flusher.join(10)
            if putter is not None:
                putter.join(10)
        assert not flusher.is_alive()
        st.flush()
        assert _indexed(st.root, [first], within=5)


ZSTD_IN_A_FRESH_PROCESS = r"""
import json, sys
from shadowfs.store import Store
store = Store.open(sys.argv[1], create=True)
oid = store.put("blob", b"compressible " * 4096)
store.flush()
store.close()
before = sorted(m for m in ("platform", "zstandard") if m in sys.modules)
again = Store.open(sys.argv[1])
data = again.get(oid)
again.close()
import zstandard
from shadowfs.zstd import zstandard as used
print(json.dumps({"before": before, "same": zstandard.ZstdCompressor is used.ZstdCompressor,
                  "ok": data == b"compressible " * 4096}))
"""


def test_the_store_compresses_through_zstandards_c_backend_alone(tmp_path: Path) -> None:
    # shadowfs.zstd: the package's __init__ (with `platform`) is not imported by a process
    # that only opens a store, puts, flushes and reads back; a later `import zstandard` gets
    # the very classes the store used.
    proc = subprocess.run(
        [sys.executable, "-c", ZSTD_IN_A_FRESH_PROCESS, str(tmp_path / "store")],
        capture_output=True, text=True, cwd="/", env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"before": [], "same": True, "ok": True}
