"""The store's index: sqlite3 in WAL mode mapping object ids to their place in the packs.

The index is a cache of what the packs already say about themselves, so losing it costs a rebuild,
never data. Writers batch their rows and commit once per flush; sqlite serialises writers of
different processes (busy_timeout) while readers keep reading the last committed state.
"""

from __future__ import annotations

# The C module the `sqlite3` package wraps: the package adds the default date and time adapters
# (importing `datetime`), which the index never stores; about 1 ms of every command that opens
# the store (a booth's start among them), for nothing.
import _sqlite3 as sqlite3
import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from shadowfs.errors import StoreError
from shadowfs.oid import OID_SIZE, ObjectId, unchecked_oid
from shadowfs.pack import header_len, pack_name_ok
from shadowfs.privacy import PRIVATE_FILE
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

FORMAT = "1"
BUSY_TIMEOUT_S = 60.0

# One statement each: executescript would commit the open's write transaction first.
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS objects (
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
) WITHOUT ROWID""",
    "CREATE TABLE IF NOT EXISTS packs (name TEXT PRIMARY KEY, size INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
)

_COLUMNS = "oid, kind, pack, offset, stored_len, raw_len, size, delta_base, depth, created"


class IndexEntry(Value):
    """Where an object lives. `size` is the content size: the file size for a `chunks` object."""

    __slots__ = FIELDS = (
        "oid", "kind", "pack", "offset", "stored_len", "raw_len", "size", "delta_base", "depth",
        "created",
    )  # fmt: skip
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

    def __init__(
        self, oid: ObjectId, kind: str, pack: str, offset: int, stored_len: int, raw_len: int,
        size: int, delta_base: ObjectId | None, depth: int, created: int,
    ) -> None:  # fmt: skip
        setfield(self, "oid", oid)
        setfield(self, "kind", kind)
        setfield(self, "pack", pack)
        setfield(self, "offset", offset)
        setfield(self, "stored_len", stored_len)
        setfield(self, "raw_len", raw_len)
        setfield(self, "size", size)
        setfield(self, "delta_base", delta_base)
        setfield(self, "depth", depth)
        setfield(self, "created", created)

    @property
    def record_len(self) -> int:
        return header_len(self.kind, self.delta_base is not None) + self.stored_len

    def moved(self, pack: str, offset: int) -> IndexEntry:
        return IndexEntry(
            self.oid, self.kind, pack, offset, self.stored_len, self.raw_len, self.size,
            self.delta_base, self.depth, self.created,
        )  # fmt: skip

    def row(self) -> tuple[object, ...]:
        return (
            bytes(self.oid), self.kind, self.pack, self.offset, self.stored_len, self.raw_len,
            self.size, None if self.delta_base is None else bytes(self.delta_base), self.depth,
            self.created,
        )


# No object the store writes comes near this; a larger length in a row is damage, and reading
# it would try to allocate that much memory.
MAX_RECORD_LEN = 1 << 31


def _is_oid(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == OID_SIZE


def _is_len(value: object, limit: int = MAX_RECORD_LEN) -> bool:
    return type(value) is int and 0 <= value <= limit


# Pack names `_entry` has checked: a store has a handful, and a commit reads 50,000 rows.
_GOOD_PACKS: set[str] = set()


def _entry(path: Path, row: tuple[object, ...]) -> IndexEntry:
    oid, kind, pack, offset, stored_len, raw_len, size, base, depth, created = row
    # The index is a cache anyone with access to the store dir can damage: a row must not turn
    # into a bare ValueError, a huge allocation or a path outside packs/ (found by fuzzing).
    # The checks inline (not a call each): bulk lookups build tens of thousands of entries.
    if not (
        isinstance(oid, bytes)
        and len(oid) == OID_SIZE
        and isinstance(kind, str)
        and isinstance(pack, str)
        and (pack in _GOOD_PACKS or _good_pack(pack))
        and type(offset) is int
        and 0 <= offset <= 1 << 62
        and type(stored_len) is int
        and 0 <= stored_len <= MAX_RECORD_LEN
        and type(raw_len) is int
        and 0 <= raw_len <= MAX_RECORD_LEN
        and type(size) is int
        and 0 <= size <= 1 << 62
        and (base is None or (isinstance(base, bytes) and len(base) == OID_SIZE))
        and type(depth) is int
        and 0 <= depth <= MAX_RECORD_LEN
        and type(created) is int
    ):
        raise _damaged(path, ValueError(f"a malformed row for object {oid!r:.80}"))
    return IndexEntry(
        unchecked_oid(ObjectId, oid), kind, pack, offset, stored_len, raw_len, size,
        None if base is None else unchecked_oid(ObjectId, base), depth, created,
    )  # fmt: skip


def _good_pack(pack: str) -> bool:
    if not pack_name_ok(pack):
        return False
    _GOOD_PACKS.add(pack)
    return True


# sqlite3 decodes TEXT values as UTF-8 as it reads them: a damaged file can hold invalid bytes
# there, and fuzzing found the UnicodeDecodeError escaping bare from the WAL pragma.
_UNREADABLE = (sqlite3.Error, UnicodeDecodeError)


def _create_private(path: Path) -> None:
    """sqlite would create the database 0644; its -wal and -shm files copy the database's mode,
    so creating it 0600 first keeps all three private. Failures are left for sqlite to report."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE))


def _damaged(path: Path, exc: Exception) -> StoreError:
    return StoreError(
        f"the store index {path} is unusable ({exc}); delete it and reopen the store, "
        "which rebuilds it from the packs"
    )


def make_wal(path: Path) -> None:
    """Puts an index file nobody else has open yet into WAL mode, which its header keeps: the
    store names a new index only once it is, so processes opening it at once never switch it."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()


def _switch_to_wal(conn: sqlite3.Connection, path: Path) -> None:
    """Switches an index in another journal mode (made by hand, or by an older version) to WAL.
    The switch needs the file alone, and two connections making it at once fail one of them with
    "database is locked" at once, without sqlite's busy wait (its deadlock avoidance): so it is
    retried, for as long as the busy timeout would have waited."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() == "wal":
                return
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY:
                raise
        if time.monotonic() > deadline:
            raise StoreError(
                f"cannot switch the store index {path} to WAL mode: another process holds it "
                f"({BUSY_TIMEOUT_S:.0f} s); retry when it is done"
            )
        time.sleep(0.005)


class StoreIndex:
    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn
        # One statement or write transaction at a time on the shared connection. Its own lock,
        # not the store's: a group commit's index write (milliseconds when sqlite checkpoints
        # its WAL) then holds up only other index users, never a snapshot's puts.
        self._lock = threading.RLock()

    @classmethod
    def open(cls, path: Path, wal: bool = True) -> StoreIndex:
        try:
            _create_private(path)
            conn = sqlite3.connect(
                path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise _damaged(path, exc) from None
        index = cls(path, conn)
        try:
            if wal and conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                _switch_to_wal(conn, path)
            # NORMAL loses at most the last commits on power loss; the packs hold those records
            # and Store re-adopts any pack tail the index does not cover.
            conn.execute("PRAGMA synchronous=NORMAL")
            # Up to 64 MiB of pages cached (sqlite's default is 2 MiB, taken only as read): a
            # commit looks up 100,000 random object ids, and with the default most lookups read
            # their pages again (110,000 preads in a 50,000-file commit; a quarter of the
            # lookups' CPU).
            conn.execute("PRAGMA cache_size=-65536")
            # In one write transaction taken up front, which waits out other writers: as
            # autocommit statements these began as readers, and one that found another
            # process's commit newer than its snapshot failed at once with "database is locked"
            # (a store opened while another process flushed into it).
            with index.write():
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)", (FORMAT,))
                (fmt,) = conn.execute("SELECT value FROM meta WHERE key='format'").fetchone()
        except StoreError:
            conn.close()
            raise
        except (*_UNREADABLE, TypeError, ValueError) as exc:
            conn.close()
            raise _damaged(path, exc) from None
        if fmt != FORMAT:
            conn.close()
            raise StoreError(
                f"the store index {path} has format {fmt}, this version reads {FORMAT}; "
                "delete it and reopen the store to rebuild it"
            )
        return index

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """One write transaction, taken up front so it waits for other writers, not deadlocks."""
        with self._lock:
            yield from self._transaction()

    def _transaction(self) -> Iterator[None]:
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
            with self._lock:
                return self._conn.execute(sql, params).fetchall()
        except _UNREADABLE as exc:
            raise _damaged(self.path, exc) from None

    # ---- reads

    def lookup(self, oid: ObjectId) -> IndexEntry | None:
        rows = self._all(f"SELECT {_COLUMNS} FROM objects WHERE oid=?", (bytes(oid),))
        return _entry(self.path, rows[0]) if rows else None

    def has(self, oid: ObjectId) -> bool:
        return bool(self._all("SELECT 1 FROM objects WHERE oid=?", (bytes(oid),)))

    def present(self, oids: list[ObjectId]) -> set[ObjectId]:
        """Which of ``oids`` the index holds, in a query per 500 (sqlite's parameter limit)."""
        found: set[ObjectId] = set()
        for i in range(0, len(oids), 500):
            part = oids[i : i + 500]
            marks = ",".join("?" * len(part))
            rows = self._all(
                f"SELECT oid FROM objects WHERE oid IN ({marks})", tuple(bytes(o) for o in part)
            )
            found.update(ObjectId(r[0]) for r in rows)
        return found

    def lookup_many(self, oids: list[ObjectId]) -> dict[ObjectId, IndexEntry]:
        """The entries of those of ``oids`` the index holds, in a query per 500."""
        found: dict[ObjectId, IndexEntry] = {}
        for i in range(0, len(oids), 500):
            part = oids[i : i + 500]
            marks = ",".join("?" * len(part))
            rows = self._all(
                f"SELECT {_COLUMNS} FROM objects WHERE oid IN ({marks})",
                tuple(bytes(o) for o in part),
            )
            for row in rows:
                e = _entry(self.path, row)
                found[e.oid] = e
        return found

    def plain_blobs(self, oids: list[ObjectId]) -> list[tuple[bytes, str, int, int, int]]:
        """(oid, pack, offset, stored_len, raw_len) of each of ``oids`` stored as a blob whole
        (no delta), in a query per 500, for a bulk read: no `IndexEntry` each (a third of the
        cost of looking up a commit's 50,000 files), the row checked by sqlite. A row that is
        anything else, or fails a check, is left out: the caller reads that object the usual
        way, whose lookup says what is wrong with it."""
        found: list[tuple[bytes, str, int, int, int]] = []
        for i in range(0, len(oids), 500):
            part = oids[i : i + 500]
            marks = ",".join("?" * len(part))
            rows = self._all(
                "SELECT oid, pack, offset, stored_len, raw_len FROM objects"
                f" WHERE oid IN ({marks}) AND kind = 'blob' AND delta_base IS NULL"
                f" AND typeof(oid) = 'blob' AND length(oid) = {OID_SIZE} AND typeof(pack) = 'text'"
                " AND typeof(offset) = 'integer' AND offset BETWEEN 0 AND 4611686018427387904"
                f" AND typeof(stored_len) = 'integer' AND stored_len BETWEEN 0 AND {MAX_RECORD_LEN}"
                f" AND typeof(raw_len) = 'integer' AND raw_len BETWEEN 0 AND {MAX_RECORD_LEN}",
                tuple(bytes(o) for o in part),
            )
            found += [r for r in rows if r[1] in _GOOD_PACKS or _good_pack(r[1])]
        return found

    def entries(self) -> Iterator[IndexEntry]:
        for row in self._all(f"SELECT {_COLUMNS} FROM objects"):
            yield _entry(self.path, row)

    def oids(self) -> list[ObjectId]:
        rows = self._all("SELECT oid FROM objects")
        if not all(_is_oid(r[0]) for r in rows):
            raise _damaged(self.path, ValueError("an object id that is not 32 bytes"))
        return [ObjectId(r[0]) for r in rows]

    def locations(self) -> list[tuple[ObjectId, str, int]]:
        rows = self._all("SELECT oid, pack, offset FROM objects")
        if not all(_is_oid(o) and pack_name_ok(p) and _is_len(off, 1 << 62) for o, p, off in rows):
            raise _damaged(self.path, ValueError("a malformed object location"))
        return [(ObjectId(o), p, off) for o, p, off in rows]

    def pack_sizes(self) -> dict[str, int]:
        rows = self._all("SELECT name, size FROM packs")
        if not all(pack_name_ok(n) and _is_len(size, 1 << 62) for n, size in rows):
            raise _damaged(self.path, ValueError("a malformed pack row"))
        return dict(rows)

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
