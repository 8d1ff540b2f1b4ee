"""The store's index: sqlite3 in WAL mode mapping object ids to their place in the packs.

The index is a cache of what the packs already say about themselves, so losing it costs a rebuild,
never data. Writers batch their rows and commit once per flush; sqlite serialises writers of
different processes (busy_timeout) while readers keep reading the last committed state.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shadowfs.errors import StoreError
from shadowfs.oid import ObjectId
from shadowfs.pack import header_len

FORMAT = "1"
BUSY_TIMEOUT_S = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    oid BLOB PRIMARY KEY,
    kind TEXT NOT NULL,
    pack TEXT NOT NULL,
    offset INTEGER NOT NULL,
    stored_len INTEGER NOT NULL,
    raw_len INTEGER NOT NULL,
    size INTEGER NOT NULL,
    delta_base BLOB,
    depth INTEGER NOT NULL,
    created INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS packs (name TEXT PRIMARY KEY, size INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""

_COLUMNS = "oid, kind, pack, offset, stored_len, raw_len, size, delta_base, depth, created"


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """Where an object lives. `size` is the content size: the file size for a `chunks` object."""

    oid: ObjectId
    kind: str
    pack: str
    offset: int
    stored_len: int
    raw_len: int
    size: int
    delta_base: ObjectId | None
    depth: int
    created: int

    @property
    def record_len(self) -> int:
        return header_len(self.kind, self.delta_base is not None) + self.stored_len

    def moved(self, pack: str, offset: int) -> IndexEntry:
        return replace(self, pack=pack, offset=offset)

    def row(self) -> tuple[object, ...]:
        return (
            bytes(self.oid), self.kind, self.pack, self.offset, self.stored_len, self.raw_len,
            self.size, None if self.delta_base is None else bytes(self.delta_base), self.depth,
            self.created,
        )


def _entry(row: tuple[object, ...]) -> IndexEntry:
    oid, kind, pack, offset, stored_len, raw_len, size, base, depth, created = row
    return IndexEntry(
        ObjectId(oid), kind, pack, offset, stored_len, raw_len, size,  # type: ignore[arg-type]
        None if base is None else ObjectId(base), depth, created,  # type: ignore[arg-type]
    )


def _damaged(path: Path, exc: Exception) -> StoreError:
    return StoreError(
        f"the store index {path} is unusable ({exc}); delete it and reopen the store, "
        "which rebuilds it from the packs"
    )


class StoreIndex:
    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn

    @classmethod
    def open(cls, path: Path, wal: bool = True) -> StoreIndex:
        try:
            conn = sqlite3.connect(
                path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise _damaged(path, exc) from None
        try:
            if wal:
                conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL loses at most the last commits on power loss; the packs hold those records
            # and Store re-adopts any pack tail the index does not cover.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)", (FORMAT,))
            (fmt,) = conn.execute("SELECT value FROM meta WHERE key='format'").fetchone()
        except sqlite3.Error as exc:
            conn.close()
            raise _damaged(path, exc) from None
        if fmt != FORMAT:
            conn.close()
            raise StoreError(
                f"the store index {path} has format {fmt}, this version reads {FORMAT}; "
                "delete it and reopen the store to rebuild it"
            )
        return cls(path, conn)

    def close(self) -> None:
        self._conn.close()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """One write transaction, taken up front so it waits for other writers, not deadlocks."""
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise StoreError(
                f"cannot write the store index {self.path} ({exc}); another process holds it "
                "too long — retry"
            ) from None
        try:
            yield
        except sqlite3.Error as exc:
            self._rollback()
            raise _damaged(self.path, exc) from None
        except BaseException:
            self._rollback()
            raise
        try:
            self._conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise StoreError(f"cannot commit the store index {self.path} ({exc}); retry") from None

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._conn.execute("ROLLBACK")

    def _all(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise _damaged(self.path, exc) from None

    # ---- reads

    def lookup(self, oid: ObjectId) -> IndexEntry | None:
        rows = self._all(f"SELECT {_COLUMNS} FROM objects WHERE oid=?", (bytes(oid),))
        return _entry(rows[0]) if rows else None

    def has(self, oid: ObjectId) -> bool:
        return bool(self._all("SELECT 1 FROM objects WHERE oid=?", (bytes(oid),)))

    def entries(self) -> Iterator[IndexEntry]:
        for row in self._all(f"SELECT {_COLUMNS} FROM objects"):
            yield _entry(row)

    def oids(self) -> list[ObjectId]:
        return [ObjectId(r[0]) for r in self._all("SELECT oid FROM objects")]

    def locations(self) -> list[tuple[ObjectId, str, int]]:
        rows = self._all("SELECT oid, pack, offset FROM objects")
        return [(ObjectId(o), p, off) for o, p, off in rows]

    def pack_sizes(self) -> dict[str, int]:
        return dict(self._all("SELECT name, size FROM packs"))

    def totals(self) -> tuple[int, int, int]:
        """(objects, raw bytes, stored bytes)."""
        [(count, raw, stored)] = self._all(
            "SELECT count(*), coalesce(sum(raw_len), 0), coalesce(sum(stored_len), 0) FROM objects"
        )
        return count, raw, stored

    # ---- writes (inside write())

    def insert(self, entries: Iterable[IndexEntry]) -> None:
        """Adds rows; an id already present keeps its row (a concurrent writer stored it too)."""
        self._conn.executemany(
            f"INSERT OR IGNORE INTO objects ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (e.row() for e in entries),
        )

    def upsert(self, entries: Iterable[IndexEntry]) -> None:
        self._conn.executemany(
            f"INSERT OR REPLACE INTO objects ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (e.row() for e in entries),
        )

    def delete(self, oids: Iterable[ObjectId]) -> None:
        self._conn.executemany("DELETE FROM objects WHERE oid=?", ((bytes(o),) for o in oids))

    def set_pack_size(self, name: str, size: int) -> None:
        self._conn.execute("INSERT OR REPLACE INTO packs VALUES (?, ?)", (name, size))

    def drop_packs(self, names: Iterable[str]) -> None:
        self._conn.executemany("DELETE FROM packs WHERE name=?", ((n,) for n in names))

    def clear(self) -> None:
        self._conn.execute("DELETE FROM objects")
        self._conn.execute("DELETE FROM packs")
