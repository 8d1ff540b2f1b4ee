"""The store: pack record parsing and scanning, opening a store over a hostile pack (index built
from it, tail recovery, reuse of the pack by a writer), `rebuild_index`, and a damaged index.

Allowed outcome: a `ShadowfsError` (StoreError, ObjectCorrupt, ObjectMissing, RecordError ...).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import shutil
from functools import cache
from pathlib import Path

import zstandard

from shadowfs import pack as pk
from shadowfs.errors import ShadowfsError
from shadowfs.store import Store, encode_chunks
from tests.fuzz.common import Target
from tests.fuzz.scratch import scratch

PACK_NAME = "pack-" + "ab" * 16 + ".pack"
_counter = itertools.count()


def _fill(store: Store) -> None:
    text = b"def f(x):\n    return x + 1\n" * 40
    small = store.put("blob", b"hi")
    base = store.put("blob", text)
    store.put("blob", text + b"# one more line\n", delta_base=base)
    store.put("blob", os.urandom(100))  # stored plain: zstd would not save space
    store.put("chunks", encode_chunks([(small, 2), (base, len(text))]))
    store.put("tree", b"\x01")
    store.put("json", b'{"k": [1, 2, 3]}')


@cache
def _seed_store() -> Path:
    root = scratch() / "seed-store"
    with Store.open(root) as store:
        _fill(store)
    return root


def _seed_pack() -> bytes:
    [pack] = (_seed_store() / "packs").glob("pack-*.pack")
    return pack.read_bytes()


def _seed_index() -> bytes:
    root = _seed_store()
    with Store.open(root) as store:
        store.flush()
    # Fold the WAL in so the seed is the whole index in one file.
    import sqlite3

    conn = sqlite3.connect(root / "index.sqlite")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return (root / "index.sqlite").read_bytes()


def _exercise(store: Store) -> None:
    for oid in list(store.iter_oids()):
        try:
            store.get(oid)
            store.kind(oid)
            store.size(oid)
            store.read_file_into(oid, io.BytesIO())
        except ShadowfsError:
            pass
    store.stats()
    store.verify()


def store_input(data: bytes) -> None:
    """A store whose only pack holds `data`."""
    root = scratch() / f"store-{next(_counter)}"
    (root / "packs").mkdir(parents=True)
    (root / "packs" / PACK_NAME).write_bytes(data)
    try:
        try:
            with Store.open(root) as store:
                _exercise(store)
                store.rebuild_index()
                _exercise(store)
                # A writer may adopt the hostile pack and append to it.
                store.put("blob", b"written after the damage")
                store.flush()
            with Store.open(root) as store:
                _exercise(store)
        except ShadowfsError:
            pass
    finally:
        shutil.rmtree(root, ignore_errors=True)


def pack_input(data: bytes) -> None:
    """Record parsing and scanning without a store around it."""
    try:
        h = pk.parse_header(data)
    except ShadowfsError:
        h = None
    if h is not None:
        payload = data[h.header_len : h.header_len + h.stored_len]
        with contextlib.suppress(ShadowfsError):
            pk.decode_payload(h, payload, b"base bytes", zstandard.ZstdDecompressor())
    path = scratch() / "scan.pack"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        pk.read_pack_magic(fd)
        end = len(data)
        pos = pk.PACK_HEADER_LEN
        for item in pk.scan(fd, pk.PACK_HEADER_LEN, end):
            if not pos <= item.offset < end:
                raise AssertionError(f"scan went backwards or past the end: {item}")
            pos = item.offset + 1
    finally:
        os.close(fd)


def index_input(data: bytes) -> None:
    """The seed store's packs with `data` as index.sqlite."""
    root = scratch() / f"index-{next(_counter)}"
    shutil.copytree(_seed_store() / "packs", root / "packs")
    (root / "index.sqlite").write_bytes(data)
    try:
        try:
            with Store.open(root) as store:
                _exercise(store)
                store.put("blob", b"written over a hostile index")
                store.flush()
        except ShadowfsError:
            pass
    finally:
        shutil.rmtree(root, ignore_errors=True)


_COLUMNS = (
    "oid",
    "kind",
    "pack",
    "offset",
    "stored_len",
    "raw_len",
    "size",
    "delta_base",
    "depth",
    "created",
)


def _decode_edits(data: bytes) -> list[tuple[str, int, object]]:
    """Fuzz bytes as edits of the seed index: (column, row number, new value) records of
    `column:u8 row:u8 type:u8 len:u8 value[len]`, the value an int, text, blob or NULL."""
    edits: list[tuple[str, int, object]] = []
    pos = 0
    while pos + 4 <= len(data):
        col, row, typ, n = data[pos : pos + 4]
        raw = data[pos + 4 : pos + 4 + n]
        pos += 4 + n
        value: object
        if typ % 4 == 0:
            value = int.from_bytes(raw[:8], "little", signed=True)
        elif typ % 4 == 1:
            value = raw.decode("utf-8", "replace")
        elif typ % 4 == 2:
            value = bytes(raw)
        else:
            value = None
        edits.append((_COLUMNS[col % len(_COLUMNS)], row, value))
    return edits


def index_rows_input(data: bytes) -> None:
    """The seed store with some index rows rewritten to hostile values."""
    import sqlite3

    root = scratch() / f"rows-{next(_counter)}"
    shutil.copytree(_seed_store() / "packs", root / "packs")
    (root / "index.sqlite").write_bytes(_seed_index_bytes())
    conn = sqlite3.connect(root / "index.sqlite")
    oids = [r[0] for r in conn.execute("SELECT oid FROM objects ORDER BY oid")]
    for column, row, value in _decode_edits(data):
        # NOT NULL and PRIMARY KEY constraints refuse some edits; those rows stay as they were.
        with contextlib.suppress(sqlite3.Error):
            if column in ("pack", "size") and row % 2:
                conn.execute(
                    f"UPDATE packs SET {'name' if column == 'pack' else 'size'}=?", (value,)
                )
            else:
                conn.execute(
                    f"UPDATE objects SET {column}=? WHERE oid=?", (value, oids[row % len(oids)])
                )
    conn.commit()
    conn.close()
    try:
        try:
            with Store.open(root) as store:
                _exercise(store)
                store.put("blob", b"written over a hostile index")
                store.flush()
        except ShadowfsError:
            pass
    finally:
        shutil.rmtree(root, ignore_errors=True)


@cache
def _seed_index_bytes() -> bytes:
    return _seed_index()


def _seed_edits() -> list[bytes]:
    return [
        bytes([2, 0, 1, 12]) + b"../../passwd",
        bytes([4, 1, 0, 8]) + (1 << 62).to_bytes(8, "little"),
        bytes([0, 2, 2, 3]) + b"abc",
        bytes([3, 3, 0, 8]) + (-5).to_bytes(8, "little", signed=True),
        bytes([2, 1, 1, 9]) + b"pack-\x00.pack",
        bytes([7, 4, 2, 32]) + bytes(32),
    ]


TARGETS = [
    Target("pack", pack_input, lambda: [_seed_pack()], "parse_header, decode_payload, scan"),
    Target("store", store_input, lambda: [_seed_pack()], "Store.open/get/verify/rebuild on a pack"),
    Target("index", index_input, lambda: [_seed_index_bytes()], "a hostile index.sqlite file"),
    Target("index-rows", index_rows_input, _seed_edits, "hostile values in index rows"),
]
