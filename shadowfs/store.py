"""The content-addressed store: objects in append-only packs, found through a sqlite index.

    STORE/
      packs/pack-<random>.pack   records (see shadowfs.pack); one writer per pack, flock-ed
      index.sqlite               WAL; oid -> place in a pack; rebuilt from the packs when missing
      index.lock                 serialises that rebuild
      lock                       flock: writers hold it shared, gc exclusive

Every read re-hashes the object against its id. Durability is per batch: `flush()` fsyncs the
writer's pack once, then commits the index rows of everything put since the last flush. A crash
before that loses the batch but cannot damage the store: the unindexed tail of a pack is adopted
(when intact) or cut off the next time a process opens the store or writes to that pack.

Group commit: `flush_soon()` asks for that same flush on a background thread within
`FLUSH_DELAY` seconds instead of now, so a burst of checkpoints shares one fsync and none of them
waits for the disk. Small objects (up to `STAGE_MAX`) are only hashed when put: they wait in
memory, uncompressed, and the next flush (or `STAGE_LIMIT` bytes of them) checks the index for
them, compresses and appends them, so a checkpoint pays for neither sqlite nor zstd.

The group commit's thread stands aside while a caller runs a `foreground()` section (a
snapshot or a restore): with one interpreter lock, every system call the snapshot made let the
flusher run Python until its next call, and a 10-file snapshot took a third longer for it.

Until the flush, what was put is readable through this `Store` only (other processes read
through the index); whoever makes something durable that refers to those objects
(a tape frame, a commit to the real tree) calls `flush()` first — it returns once they are on disk.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import io
import os
import struct
import threading
import time

# weakref.WeakSet is this class (weakref re-exports it); the weakref module itself, which a
# command reading a tape needs nothing else of, costs about 2.5 M instructions to import, and
# _weakrefset is loaded already (threading, abc).
from _weakrefset import WeakSet
from collections import namedtuple
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from stat import S_ISREG

from shadowfs import pack as pk
from shadowfs import wakeups
from shadowfs.errors import ObjectCorrupt, ObjectMissing, StoreBusy, StoreError
from shadowfs.oid import OID_SIZE, ObjectHasher, ObjectId, hash_object
from shadowfs.privacy import is_loose, make_private_dirs, tighten_tree
from shadowfs.store_index import IndexEntry, StoreIndex, make_wal
from shadowfs.values import Value, setfield
from shadowfs.zstd import zstandard

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import BinaryIO, NamedTuple

    from shadowfs.objects import ByteSink
    from shadowfs.progress import Progress

CHUNK_SIZE = 4 * 1024 * 1024
# The longest a `flush_soon()` leaves objects unflushed (plus at most FOREGROUND_WAIT).
FLUSH_DELAY = 0.05
# The longest the group commit's thread waits for a `foreground()` section to end before each
# object and before its index commit.
FOREGROUND_WAIT = 0.02
# Trees and chunk lists are mostly 32-byte ids, which no level compresses: zstd's fastest level
# packs their names as well as level 3 does, in a third of the time (on a snapshot's hot path).
FAST_LEVEL = -1
_FAST_KINDS = frozenset({"tree", "chunks"})
MAX_DELTA_DEPTH = 8
# Objects up to STAGE_MAX bytes are staged in memory by put; more than STAGE_LIMIT bytes staged
# are written out at once rather than at the next flush.
STAGE_MAX = 1024 * 1024
STAGE_LIMIT = 16 * 1024 * 1024
# A writer starts a new pack once its pack passes this size (checked at flush).
PACK_TARGET = 256 * 1024 * 1024
# How many existing packs a new writer tries before starting its own.
_REUSE_TRIES = 8
_MAX_OPEN_PACKS = 256


_CHUNK_ENTRY = struct.Struct("<32sQ")


class Problem(Value):
    """One bad thing verify found. oid is None when the damage hides which object it was."""

    __slots__ = FIELDS = ("oid", "pack", "offset", "reason")
    oid: ObjectId | None
    pack: str
    offset: int
    reason: str

    def __init__(self, oid: ObjectId | None, pack: str, offset: int, reason: str) -> None:
        setfield(self, "oid", oid)
        setfield(self, "pack", pack)
        setfield(self, "offset", offset)
        setfield(self, "reason", reason)

    def __str__(self) -> str:
        who = f"object {self.oid}" if self.oid is not None else "unknown object"
        return f"{who} in {self.pack} at offset {self.offset}: {self.reason}"


# An object put but not yet appended to a pack (see `Store._drain`). A tuple: a snapshot makes
# one per object, and a frozen dataclass costs several times as much to build. At run time the
# collections.namedtuple that typing.NamedTuple makes, without importing typing (a tenth of a
# replay's instructions) nor its class form, whose annotations are strings in this module that
# it compiles one by one (a process's first compile() sets up the AST types: about 10 M
# instructions, 2 ms; a booth's start compiles nothing else).
if TYPE_CHECKING:

    class _Staged(NamedTuple):
        kind: str
        data: bytes
        size: int
        delta_base: ObjectId | None

else:
    _Staged = namedtuple("_Staged", ("kind", "data", "size", "delta_base"))


# _Staged(...) goes through a generated Python __new__; this is the same tuple built in C.
_staged = functools.partial(tuple.__new__, _Staged)


class GcReport(Value):
    __slots__ = FIELDS = ("kept", "removed", "bytes_freed", "bytes_left")
    kept: int
    removed: int
    bytes_freed: int
    # Garbage bytes left in packs too little of which is garbage to be worth rewriting (see
    # `Store.gc`'s min_waste); their objects are gone from the index all the same.
    bytes_left: int

    def __init__(self, kept: int, removed: int, bytes_freed: int, bytes_left: int = 0) -> None:
        setfield(self, "kept", kept)
        setfield(self, "removed", removed)
        setfield(self, "bytes_freed", bytes_freed)
        setfield(self, "bytes_left", bytes_left)


class StoreStats(Value):
    __slots__ = FIELDS = ("objects", "raw_bytes", "stored_bytes", "packs", "pack_bytes")
    objects: int
    raw_bytes: int
    stored_bytes: int
    packs: int
    pack_bytes: int

    def __init__(
        self, objects: int, raw_bytes: int, stored_bytes: int, packs: int, pack_bytes: int
    ) -> None:
        setfield(self, "objects", objects)
        setfield(self, "raw_bytes", raw_bytes)
        setfield(self, "stored_bytes", stored_bytes)
        setfield(self, "packs", packs)
        setfield(self, "pack_bytes", pack_bytes)


def encode_chunks(chunks: list[tuple[ObjectId, int]]) -> bytes:
    """The canonical `chunks` body: per chunk its 32-byte id and its size as u64 little-endian."""
    return b"".join(_CHUNK_ENTRY.pack(oid, size) for oid, size in chunks)


def decode_chunks(raw: bytes) -> list[tuple[ObjectId, int]]:
    if len(raw) % _CHUNK_ENTRY.size:
        raise StoreError(
            f"a chunks object must be a multiple of {_CHUNK_ENTRY.size} bytes, got {len(raw)}; "
            "it was not made by encode_chunks"
        )
    out = [(ObjectId(o), n) for o, n in _CHUNK_ENTRY.iter_unpack(raw)]
    if any(not 0 < n <= CHUNK_SIZE for _, n in out):
        raise StoreError(f"a chunks object lists a chunk size outside 1..{CHUNK_SIZE} bytes")
    return out


# Stores with a group flush possibly outstanding: a normal interpreter exit flushes them, so
# "durable within FLUSH_DELAY" holds for a program that snapshots and returns without close().
_SOON: WeakSet[Store] = WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for store in list(_SOON):
        if not store._closed and store._flusher_pid == os.getpid():
            try:
                store._stop_flusher()
                store.flush()
            except Exception:  # exiting: nothing left to tell
                pass


def _where(pack: str, offset: int) -> str:
    return f"pack {pack} offset {offset}"


class Store:
    """Use `Store.open(path)`; a context manager whose exit flushes and closes."""

    def __init__(self, root: Path, level: int) -> None:
        self.root = root
        self.level = level
        self._packs_dir = root / "packs"
        self._mutex = threading.RLock()
        # One flush at a time; taken before _mutex, never while holding it.
        self._flush_lock = threading.RLock()
        self._cctx = zstandard.ZstdCompressor(level=level)
        self._fast_cctx = zstandard.ZstdCompressor(level=min(level, FAST_LEVEL))
        # The drain's own (it compresses without _mutex, under _flush_lock): a compressor must
        # not be used by two threads at once.
        self._drain_cctx = zstandard.ZstdCompressor(level=level)
        self._drain_fast_cctx = zstandard.ZstdCompressor(level=min(level, FAST_LEVEL))
        self._dctx = zstandard.ZstdDecompressor()
        self._fds: dict[str, int] = {}
        self._pending: dict[ObjectId, IndexEntry] = {}
        # Index entries looked up in bulk by `prefetched()`, for the length of its block.
        self._prefetched: dict[ObjectId, IndexEntry] = {}
        # Plain blobs' places found ahead by `prefetched_blobs`: oid -> (pack, offset,
        # stored_len, raw_len).
        self._blob_places: dict[bytes, tuple[str, int, int, int]] = {}
        # In put order: a delta's base, staged before it, reaches the pack before it.
        self._staged: dict[ObjectId, _Staged] = {}
        self._staged_bytes = 0
        self._writer: pk.PackWriter | None = None
        self._lock_fd = -1
        self._lock_mode = 0
        self._lost: str | None = None
        self._index: StoreIndex | None = None
        self._closed = False
        # The group-commit flusher (see flush_soon); started on first use, per process.
        self._soon = threading.Condition(threading.Lock())
        self._due: float | None = None
        self._flusher: threading.Thread | None = None
        self._flusher_pid = -1
        self._stopping = False
        # Callers inside foreground(); the flusher waits on _quiet while there are any.
        self._foreground = 0
        self._quiet = threading.Condition(threading.Lock())
        self._hurry = False  # a put waits for the drain: the flusher stands aside for nobody

    # ------------------------------------------------------------------ opening and closing

    @classmethod
    def open(cls, path: str | os.PathLike[str], create: bool = True, level: int = 3) -> Store:
        root = Path(path)
        if not (root / "packs").is_dir():
            if not create:
                raise StoreError(
                    f"no store at {root}; check the path or open it with create=True"
                )
            try:
                make_private_dirs(root / "packs")
            except OSError as exc:
                raise StoreError(f"cannot create a store at {root} ({exc.strerror})") from None
        elif is_loose(root):
            # Made by a version that left it readable to all: every agent's file is in here.
            tighten_tree(root, depth=2)
        store = cls(root, level)
        try:
            store._open_index()
            store._recover_packs()
        except BaseException:
            store.close()
            raise
        return store

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flushes what was put, then lets go of packs, locks and the index. Idempotent."""
        if self._closed:
            return
        self._stop_flusher()
        try:
            if self._index is not None:
                self.flush()
        finally:
            self._closed = True
            self._drop_writer()
            self._unlock()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            if self._index is not None:
                self._index.close()

    def _idx(self) -> StoreIndex:
        if self._closed or self._index is None:
            raise StoreError(f"the store at {self.root} is closed; open it again to use it")
        return self._index

    def _open_index(self) -> None:
        path = self.root / "index.sqlite"
        if not path.exists():
            lfd = os.open(self.root / "index.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX)
                if not path.exists():
                    self._build_index_file(path)
            finally:
                os.close(lfd)
        self._index = StoreIndex.open(path)

    def _build_index_file(self, path: Path) -> None:
        """Builds a fresh index from the packs beside it and only then names it index.sqlite."""
        for stale in self.root.glob("index.sqlite.tmp-*"):
            stale.unlink(missing_ok=True)
        tmp = self.root / f"index.sqlite.tmp-{os.urandom(8).hex()}"
        self._index = StoreIndex.open(tmp, wal=False)
        try:
            with self._index.write():
                self._rebuild_rows(None)
        finally:
            self._index.close()
            self._index = None
        make_wal(tmp)
        # A WAL left by a deleted index would otherwise be replayed into the new one.
        for suffix in ("-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        os.rename(tmp, path)
        _fsync_dir(self.root)

    # ------------------------------------------------------------------ locks

    def _lock(self, mode: int, block: bool) -> bool:
        if self._lock_fd < 0:
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
            self._lock_fd = os.open(self.root / "lock", flags, 0o600)
        try:
            fcntl.flock(self._lock_fd, mode | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        self._lock_mode = mode
        return True

    def hold_shared(self) -> None:
        """Hold the store as a writer does, from now until it is closed: gc (which needs it
        alone) waits. For a caller that will refer to objects already stored without putting
        them again (`tree.build_tree` with a previous tree)."""
        with self._mutex:
            if self._lock_mode == 0:
                self._lock(fcntl.LOCK_SH, block=True)

    def _unlock(self) -> None:
        if self._lock_fd >= 0 and self._lock_mode:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        self._lock_mode = 0

    # ------------------------------------------------------------------ pack files

    def _pack_names(self) -> list[str]:
        return sorted(n for n in os.listdir(self._packs_dir) if pk.pack_name_ok(n))

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            if len(self._fds) >= _MAX_OPEN_PACKS:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = os.open(self._packs_dir / name, os.O_RDONLY | os.O_CLOEXEC)
            self._fds[name] = fd
        return fd

    def _forget_fd(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def _writer_for_put(self) -> pk.PackWriter:
        if self._writer is not None:
            return self._writer
        # Shared for as long as this store writes: gc (exclusive) then never runs under a writer.
        if self._lock_mode == 0:
            self._lock(fcntl.LOCK_SH, block=True)
        idx = self._idx()
        sizes = sorted(idx.pack_sizes().items(), key=lambda kv: kv[1])
        for name, size in [kv for kv in sizes if kv[1] < PACK_TARGET][:_REUSE_TRIES]:
            try:
                fd = os.open(self._packs_dir / name, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                end: int | None = os.fstat(fd).st_size
                if end != size:
                    end = self._recover_tail(name, fd, size)
                if end is not None:
                    self._writer = pk.PackWriter(self._packs_dir / name, fd, end, fresh=False)
                    return self._writer
            except BlockingIOError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        self._writer = pk.PackWriter.create(self._packs_dir)
        return self._writer

    def _drop_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _recover_packs(self) -> None:
        """Adopts intact records that a crashed writer left past what the index covers."""
        idx = self._idx()
        sizes = idx.pack_sizes()
        suspects = []
        for name in self._pack_names():
            try:
                if os.stat(self._packs_dir / name).st_size != sizes.get(name):
                    suspects.append(name)
            except FileNotFoundError:
                continue
        if not suspects:
            return
        had_lock = self._lock_mode
        if not had_lock and not self._lock(fcntl.LOCK_SH, block=False):
            return  # gc is running; the next open recovers
        try:
            for name in suspects:
                try:
                    fd = os.open(self._packs_dir / name, os.O_RDWR | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._recover_tail(name, fd, sizes.get(name))
                except BlockingIOError:
                    pass  # a live writer owns it
                finally:
                    os.close(fd)
        finally:
            if not had_lock:
                self._unlock()

    def _recover_tail(self, name: str, fd: int, known: int | None) -> int | None:
        """With the pack's flock held: indexes intact records past `known`, cuts a torn tail.

        Returns the pack's new end, or None when the pack is shorter than the index says or is
        not a pack at all (left alone for verify to report).
        """
        end = os.fstat(fd).st_size
        if known is None:
            if not pk.read_pack_magic(fd):
                return None
            known = pk.PACK_HEADER_LEN
        if end < known:
            return None
        idx = self._idx()
        new_end = end
        with idx.write():
            for item in pk.scan(fd, known, end):
                if isinstance(item, pk.TornTail):
                    new_end = item.offset
                elif isinstance(item, pk.Found) and not idx.has(item.header.oid):
                    payload = os.pread(fd, item.header.stored_len, item.payload_offset)
                    try:
                        raw = self._decode(item.header, payload, _where(name, item.offset))
                    except (StoreError, FileNotFoundError):
                        # Left in place; verify names it. FileNotFoundError: a damaged index
                        # placed its delta base in a pack that does not exist (found by fuzzing).
                        continue
                    idx.insert([self._entry_for(name, item.offset, item.header, raw)])
            if new_end < end:
                os.ftruncate(fd, new_end)
            # The crashed writer never fsynced these records: make them durable before the
            # index vouches for them.
            os.fsync(fd)
            idx.set_pack_size(name, new_end)
        return new_end

    def _entry_for(self, pack: str, offset: int, h: pk.RecordHeader, raw: bytes) -> IndexEntry:
        depth = 0
        if h.base is not None:
            base = self._locate(h.base)
            depth = (base.depth if base is not None else MAX_DELTA_DEPTH) + 1
        size = sum(n for _, n in decode_chunks(raw)) if h.kind == "chunks" else h.raw_len
        return IndexEntry(
            h.oid, h.kind, pack, offset, h.stored_len, h.raw_len, size, h.base, depth, h.created
        )

    # ------------------------------------------------------------------ reading

    def _locate(self, oid: ObjectId) -> IndexEntry | None:
        entry = self._pending.get(oid) or self._prefetched.get(oid)
        return entry if entry is not None else self._idx().lookup(oid)

    @contextlib.contextmanager
    def prefetched(self, oids: Iterable[ObjectId]) -> Iterator[None]:
        """Within the block, reads of ``oids`` find them without an index query each: one query
        per 500 up front. A commit of 50,000 files otherwise spends seconds in sqlite. An entry
        gc moves meanwhile is looked up again, as for any read."""
        wanted = [o for o in dict.fromkeys(oids) if o not in self._staged]
        idx = self._idx()
        found = idx.lookup_many(wanted)
        # Their delta bases too (a booth's changed files are deltas of the base's): reading a
        # delta looks its base up, one query each otherwise.
        bases = found
        for _ in range(MAX_DELTA_DEPTH):
            more = [
                o
                for o in {e.delta_base for e in bases.values() if e.delta_base is not None}
                if o not in found and o not in self._staged
            ]
            if not more:
                break
            bases = idx.lookup_many(more)
            found.update(bases)
        with self._mutex:
            self._prefetched.update(found)
        try:
            yield
        finally:
            with self._mutex:
                for oid in found:
                    self._prefetched.pop(oid, None)

    @contextlib.contextmanager
    def prefetched_blobs(self, oids: Iterable[ObjectId]) -> Iterator[None]:
        """Within the block, `read_blobs` of ``oids`` finds the places of those stored as
        plain blobs without asking the index: `StoreIndex.plain_blobs` up front, before a
        caller starts threads. sqlite lets go of the GIL for every row, and taking it back
        while 16 threads create files cost a commit's main thread about 1.9 s at load 4
        (cProfile), against about 0.3 s for the same rows asked alone."""
        wanted = [o for o in dict.fromkeys(oids) if o not in self._staged]
        found = {
            oid: (pack, offset, stored_len, raw_len)
            for oid, pack, offset, stored_len, raw_len in self._idx().plain_blobs(wanted)
        }
        with self._mutex:
            self._blob_places.update(found)
        try:
            yield
        finally:
            with self._mutex:
                for oid in found:
                    self._blob_places.pop(oid, None)

    def _read_record(self, e: IndexEntry) -> tuple[pk.RecordHeader, memoryview]:
        length = e.record_len
        buf = None
        w = self._writer
        if w is not None and e.pack == w.name:
            buf = w.buffered(e.offset, length)
        if buf is None:
            buf = os.pread(self._fd(e.pack), length, e.offset)
        where = _where(e.pack, e.offset)
        if len(buf) != length:
            raise ObjectCorrupt(e.oid, f"{where}: the pack ends before the object does")
        try:
            h = pk.parse_header(buf)
        except pk.RecordError as exc:
            raise ObjectCorrupt(e.oid, f"{where}: {exc}") from None
        if h.oid != e.oid or h.stored_len != e.stored_len or h.raw_len != e.raw_len:
            raise ObjectCorrupt(e.oid, f"{where}: the record there is not the one the index names")
        return h, memoryview(buf)[h.header_len :]

    def _decode(
        self, h: pk.RecordHeader, payload: bytes | memoryview, where: str, depth: int = 0
    ) -> bytes:
        if h.base is not None and depth == 0:
            raw = self._decode_chain(h, payload)
            if raw is not None:
                return raw
        base_raw = None
        if h.base is not None:
            if depth > MAX_DELTA_DEPTH:
                raise ObjectCorrupt(h.oid, f"{where}: its delta chain is longer than allowed")
            base = self._locate(h.base)
            if base is None:
                raise ObjectMissing(h.base, f"it is the delta base of {h.oid} ({where})")
            base_raw = self._raw(base, depth + 1)
        try:
            raw = pk.decode_payload(h, payload, base_raw, self._dctx)
        except pk.RecordError as exc:
            raise ObjectCorrupt(h.oid, f"{where}: {exc}") from None
        if hash_object(h.kind, raw) != h.oid:
            raise ObjectCorrupt(h.oid, where)
        return raw

    def _decode_chain(self, h: pk.RecordHeader, payload: bytes | memoryview) -> bytes | None:
        """A delta's bytes through its whole chain of bases in one zstd call, checked against
        its id only; None when the chain is not all zstd frames or anything is amiss, for
        `_decode` to go link by link (and name the object at fault).

        Link by link, each base becomes a dictionary and a decompressor of its own and is
        hashed itself: 100 µs for a 600-byte file, against 10 µs here. A base that does not
        hold its id cannot make the delta decode to the delta's id, so checking the end is
        enough to trust the bytes."""
        frames: list[bytes | memoryview] = [payload]
        lens = [h.raw_len]
        link = h
        try:
            while link.base is not None:
                if len(frames) > MAX_DELTA_DEPTH + 1:
                    return None
                entry = self._locate(link.base)
                if entry is None:
                    return None
                link, frame = self._read_record(entry)
                if not link.flags & pk.FLAG_ZSTD:
                    return None  # a base stored plain: no frame to chain
                frames.append(frame)
                lens.append(link.raw_len)
            for f, n in zip(frames, lens, strict=True):
                # Before decompressing: a flipped content size must not become a huge alloc.
                if zstandard.frame_content_size(f) != n:
                    return None
            # It takes bytes only.
            chain: list[bytes | bytearray | memoryview] = [bytes(f) for f in reversed(frames)]
            raw = self._dctx.decompress_content_dict_chain(chain)
        except (StoreError, OSError, zstandard.ZstdError):
            return None
        if len(raw) != h.raw_len or hash_object(h.kind, raw) != h.oid:
            return None
        return raw

    def _raw(self, e: IndexEntry, depth: int = 0) -> bytes:
        h, payload = self._read_record(e)
        return self._decode(h, payload, _where(e.pack, e.offset), depth)

    def get(self, oid: ObjectId) -> bytes:
        """The object's bytes, verified against its id."""
        with self._mutex:
            staged = self._staged.get(oid)
            if staged is not None:
                return staged.data  # hashed to this id by put, in this process
            entry = self._locate(oid)
            if entry is None:
                raise ObjectMissing(oid)
            try:
                return self._raw(entry)
            except FileNotFoundError:
                # gc moved it to a new pack between the lookup and the read: look again.
                self._prefetched.pop(oid, None)
                entry = self._idx().lookup(oid)
                if entry is None:
                    raise ObjectMissing(oid) from None
                try:
                    return self._raw(entry)
                except FileNotFoundError:
                    raise ObjectMissing(
                        oid, f"its pack {entry.pack} is gone; restore the store from a copy"
                    ) from None

    def has(self, oid: ObjectId) -> bool:
        with self._mutex:
            return oid in self._staged or oid in self._pending or self._idx().has(oid)

    def present(self, oids: Iterable[ObjectId]) -> set[ObjectId]:
        """Which of ``oids`` the store holds, in an index query per 500."""
        with self._mutex:
            wanted = list(dict.fromkeys(oids))
            found = {o for o in wanted if o in self._staged or o in self._pending}
            found.update(self._idx().present([o for o in wanted if o not in found]))
            return found

    def _entry(self, oid: ObjectId) -> IndexEntry:
        with self._mutex:
            entry = self._locate(oid)
        if entry is None:
            raise ObjectMissing(oid)
        return entry

    def kind(self, oid: ObjectId) -> str:
        staged = self._staged.get(oid)
        return staged.kind if staged is not None else self._entry(oid).kind

    def size(self, oid: ObjectId) -> int:
        """The content size: the raw size, or for a `chunks` object the size of the whole file."""
        staged = self._staged.get(oid)
        return staged.size if staged is not None else self._entry(oid).size

    def read_file_into(self, oid: ObjectId, fileobj: ByteSink) -> int:
        """Writes a blob's or chunked file's bytes to fileobj, chunk by chunk; returns the size.

        A ``fileobj`` with a ``skip(n)`` method (seek n bytes on, leaving a hole) is given each
        whole chunk of zeros as a skip, unread: a sparse file stays sparse where it is written."""
        kind = self.kind(oid)
        if kind == "blob":
            data = self.get(oid)
            _write_all(fileobj, data)
            return len(data)
        if kind != "chunks":
            raise StoreError(
                f"object {oid} is a {kind}, not file content; pass a blob or chunks id"
            )
        total = 0
        skip = getattr(fileobj, "skip", None)
        for chunk, size in decode_chunks(self.get(oid)):
            if skip is not None and size == CHUNK_SIZE and chunk == zero_chunk_oid():
                skip(size)
                total += size
                continue
            data = self.get(chunk)
            if len(data) != size:
                raise ObjectCorrupt(oid, f"chunk {chunk} holds {len(data)} bytes, listed as {size}")
            _write_all(fileobj, data)
            total += size
        return total

    def read_blobs(self, oids: Sequence[ObjectId]) -> list[bytes]:
        """The content of each file object of ``oids`` (as `read_file_into` writes it), read
        in one pass over the packs: records in pack order, neighbours in one pread, each
        checked against its id. A commit stages 50,000 small files from here; one `get` each
        spent most of that in per-object lookups, reads and parsing. Their index rows are
        looked up here too, in bulk (`StoreIndex.plain_blobs`), unless prefetched.

        Anything but a blob stored whole and already flushed (a delta, a `chunks` file, a
        record the checks refuse) goes through `read_file_into`, which says what is wrong."""
        out: list[bytes | None] = [None] * len(oids)
        with self._mutex:
            w = self._writer
            todo: list[_Span] = []
            ask: dict[ObjectId, list[int]] = {}
            for i, oid in enumerate(oids):
                staged = self._staged.get(oid)
                if staged is not None:
                    if staged.kind == "blob":
                        out[i] = staged.data  # hashed to this id by put, in this process
                    continue
                e = self._pending.get(oid) or self._prefetched.get(oid)
                if e is None:
                    place = self._blob_places.get(oid)
                    if place is None:
                        ask.setdefault(oid, []).append(i)
                    elif w is None or place[0] != w.name:
                        pack, offset, stored_len, raw_len = place
                        todo.append((pack, offset, i, oid, raw_len, stored_len))
                elif (
                    e.kind == "blob"
                    and e.delta_base is None
                    and (w is None or e.pack != w.name)
                ):
                    todo.append((e.pack, e.offset, i, e.oid, e.raw_len, e.stored_len))
            if ask:
                for oid_b, pack, offset, stored_len, raw_len in self._idx().plain_blobs(list(ask)):
                    if w is None or pack != w.name:
                        for i in ask[oid_b]:  # type: ignore[index]  # bytes hash as their ObjectId
                            todo.append((pack, offset, i, oid_b, raw_len, stored_len))
            todo.sort()  # by pack, then offset (an index apiece breaks every tie)
            for span in _spans(todo):
                self._read_span(span, out)
        left = [oid for oid, data in zip(oids, out, strict=True) if data is None]
        contents: list[bytes] = []
        with self.prefetched(left) if len(left) > 1 else contextlib.nullcontext():
            for oid, data in zip(oids, out, strict=True):
                if data is None:
                    sink = io.BytesIO()
                    self.read_file_into(oid, sink)
                    data = sink.getvalue()
                contents.append(data)
        return contents

    def _read_span(self, span: list[_Span], out: list[bytes | None]) -> None:
        """Decode the records of one span (see `_spans`) into ``out``; those it cannot stay None."""
        start = span[0][1]
        try:
            last = span[-1]
            end = last[1] + _BLOB_RECORD_HEADER + last[5]
            buf = os.pread(self._fd(span[0][0]), end - start, start)
        except OSError:
            return  # gone (gc moved it) or unreadable: `read_file_into` looks again
        # The span's zstd frames are decompressed in one call: each call lets go of the GIL,
        # and a commit's main thread, reading while 16 threads create files, waited to take
        # it back after every one of 51,000 (1.9 s of its time at load 4, cProfile).
        frames: list[bytes | bytearray | memoryview] = []
        wait: list[tuple[int, bytes, int]] = []  # (index, oid, raw_len) of each frame
        for _, offset, i, oid, raw_len, stored_len in span:
            found = pk.plain_blob_payload(buf, offset - start, oid, raw_len, stored_len)
            if found is None:
                continue
            zstd, at = found
            payload = memoryview(buf)[at : at + stored_len]
            if not zstd:
                raw = bytes(payload)
                if len(raw) == raw_len and hash_object("blob", raw) == oid:
                    out[i] = raw
                continue
            try:
                # Checked first: a flipped content size must not become a huge alloc.
                if zstandard.frame_content_size(payload) != raw_len:
                    continue
            except zstandard.ZstdError:
                continue
            frames.append(payload)
            wait.append((i, oid, raw_len))
        if not frames:
            return
        try:
            got = self._dctx.multi_decompress_to_buffer(frames)
            raws = [got[k].tobytes() for k in range(len(frames))]
        except zstandard.ZstdError:
            raws = []  # one bad frame fails them all: each alone, the bad ones left None
            for frame in frames:
                try:
                    raws.append(self._dctx.decompress(frame))
                except zstandard.ZstdError:
                    raws.append(b"")
        for (i, oid, raw_len), raw in zip(wait, raws, strict=True):
            if len(raw) == raw_len and hash_object("blob", raw) == oid:
                out[i] = raw

    def read_bytes(self, oid: ObjectId) -> bytes:
        """A blob's or chunked file's whole content in memory (for content known to be small)."""
        if self.kind(oid) != "chunks":
            return self.get(oid)
        return b"".join(self.get(c) for c, _ in decode_chunks(self.get(oid)))

    def iter_oids(self) -> Iterator[ObjectId]:
        with self._mutex:
            oids = set(self._pending)
            oids.update(self._staged)
            oids.update(self._idx().oids())
        yield from oids

    def stats(self) -> StoreStats:
        self._drain()  # stored sizes are known once compressed
        with self._mutex:
            count, raw, stored = self._idx().totals()
            count += len(self._pending)
            raw += sum(e.raw_len for e in self._pending.values())
            stored += sum(e.stored_len for e in self._pending.values())
            names = self._pack_names()
        pack_bytes = 0
        for name in names:
            try:
                pack_bytes += os.stat(self._packs_dir / name).st_size
            except FileNotFoundError:
                continue
        return StoreStats(count, raw, stored, len(names), pack_bytes)

    # ------------------------------------------------------------------ writing

    def put(self, kind: str, data: bytes, delta_base: ObjectId | None = None) -> ObjectId:
        """Stores data as an object of this kind (once: existing ids are not stored again).

        With delta_base, the object is stored as a zstd delta against that object when that is
        smaller than compressing it alone and the base's delta chain is not already at the cap.
        """
        if kind not in pk.GOOD_KINDS:
            pk.check_kind(kind)
        if not isinstance(data, bytes):
            data = bytes(data)
        if kind == "blob" and len(data) > CHUNK_SIZE:
            raise StoreError(
                f"a blob holds at most {CHUNK_SIZE} bytes, got {len(data)}; "
                "store large content with put_file, which chunks it"
            )
        size = sum(n for _, n in decode_chunks(data)) if kind == "chunks" else len(data)
        oid = hash_object(kind, data)
        with self._mutex:
            if oid in self._staged or oid in self._pending:
                return oid
            if len(data) <= STAGE_MAX:
                if self._lock_mode == 0:
                    # What a staged object refers to must outlive it: gc waits for writers.
                    self._lock(fcntl.LOCK_SH, block=True)
                self._staged[oid] = _staged((kind, data, size, delta_base))
                self._staged_bytes += len(data)
                if self._staged_bytes <= STAGE_LIMIT:
                    return oid
            elif self._idx().has(oid):
                return oid
            else:
                self._append(oid, kind, data, size, delta_base)
                return oid
        # Over the limit: drain here, and let a flusher that holds the drain stop standing aside
        # now, not when its wait for the foreground section runs out.
        self._hurry = True
        with self._quiet:
            self._quiet.notify_all()
        try:
            self._drain()
        finally:
            self._hurry = False
        return oid

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """A section the background flush stands aside for (up to FOREGROUND_WAIT at a time):
        latency-bound work such as a snapshot. Puts and flushes inside it work as usual."""
        with self._quiet:
            self._foreground += 1
        try:
            yield
        finally:
            with self._quiet:
                self._foreground -= 1
                if not self._foreground:
                    self._quiet.notify_all()

    def _stand_aside(self) -> None:
        """On the flusher (a no-op elsewhere): wait, without the GIL, for foreground sections
        to end."""
        if self._foreground and not self._hurry and threading.current_thread() is self._flusher:
            with self._quiet:
                if self._foreground and not self._hurry:
                    self._quiet.wait(FOREGROUND_WAIT)

    def _drain(self) -> None:
        """Appends the staged objects the index does not hold yet, in the order they were put.

        One index query for the whole batch, and each object is compressed without the store's
        lock (zstd lets go of the GIL too), so a snapshot on another thread puts and reads
        meanwhile instead of waiting for the batch; the lock is taken per object only to
        append it. On the group commit's own thread it also lets go of the GIL after each
        object: a thread waiting for the GIL would otherwise wait out the whole switch interval
        (5 ms) for it. One drain at a time (under the flush lock)."""
        with self._flush_lock:
            with self._mutex:
                batch = list(self._staged.items())
                if not batch:
                    return
                idx = self._idx()
            # Without the store's lock: only a flush (this one, under the flush lock) adds to
            # this writer's index rows, and the query can take milliseconds.
            indexed = idx.present([oid for oid, _ in batch])
            polite = threading.current_thread() is self._flusher
            for oid, staged in batch:
                if polite:
                    self._stand_aside()
                    time.sleep(0)
                encoded = None
                if oid not in indexed and staged.delta_base is None:
                    cctx = self._drain_fast_cctx if staged.kind in _FAST_KINDS else self._drain_cctx
                    encoded = pk.encode_plain(staged.data, cctx)
                with self._mutex:
                    if self._staged.get(oid) is not staged:
                        continue  # dropped with a failed batch (raised by flush)
                    if oid not in indexed and oid not in self._pending:
                        self._append(
                            oid, staged.kind, staged.data, staged.size, staged.delta_base, encoded
                        )
                    del self._staged[oid]
                    self._staged_bytes -= len(staged.data)

    def _append(
        self,
        oid: ObjectId,
        kind: str,
        data: bytes,
        size: int,
        delta_base: ObjectId | None,
        encoded: tuple[int, bytes] | None = None,
    ) -> None:
        if encoded is None:
            encoded = pk.encode_plain(data, self._fast_cctx if kind in _FAST_KINDS else self._cctx)
        flags, payload = encoded
        base_id: ObjectId | None = None
        depth = 0
        if delta_base is not None and data:
            base = self._locate(delta_base)
            if base is not None and base.depth < MAX_DELTA_DEPTH and base.raw_len:
                try:
                    base_raw = self._raw(base)
                except (StoreError, FileNotFoundError):
                    base_raw = None  # a damaged base only costs the delta
                if base_raw:
                    delta = pk.encode_delta(data, base_raw, self.level)
                    if len(delta) < len(payload):
                        flags, payload = pk.FLAG_ZSTD | pk.FLAG_DELTA, delta
                        base_id, depth = delta_base, base.depth + 1
        created = int(time.time())
        header = pk.encode_header(oid, kind, flags, created, len(data), len(payload), base_id)
        try:
            writer = self._writer_for_put()
        except OSError as exc:
            raise StoreError(
                f"cannot start a pack in {self._packs_dir} ({exc.strerror}); check its permissions"
            ) from None
        try:
            offset = writer.append([header, payload])
        except OSError as exc:
            self._lose_batch(exc)
            raise StoreError(
                f"cannot write to {writer.path} ({exc.strerror}); free space and retry"
            ) from None
        self._pending[oid] = IndexEntry(
            oid, kind, writer.name, offset, len(payload), len(data), size, base_id, depth, created
        )

    def _lose_batch(self, exc: OSError) -> None:
        """A failed write leaves the pack tail unknown: drop the writer and the unflushed batch."""
        self._lost = (
            f"{len(self._pending) + len(self._staged)} object(s) put since the last flush were "
            f"lost when a pack write failed ({exc.strerror}); put them again"
        )
        self._pending.clear()
        self._staged.clear()
        self._staged_bytes = 0
        self._drop_writer()

    def put_file(self, path_or_fd: int | str | bytes | os.PathLike[str]) -> ObjectId:
        """Stores a file's content, streaming; files over CHUNK_SIZE become a `chunks` object.

        An fd is read from its current position to its end and left open.
        """
        if isinstance(path_or_fd, int):
            f = open(path_or_fd, "rb", closefd=False)  # noqa: SIM115 - closed below
        else:
            f = open(path_or_fd, "rb")  # noqa: SIM115
        chunks: list[tuple[ObjectId, int]] = []
        with f:
            holes = _Holes.of(f)
            # One chunk in memory at a time: each is stored before the next is read. A file of
            # exactly one chunk is that chunk's blob, so storing it before knowing is no waste.
            while True:
                if holes is not None and holes.next_chunk_is_hole():
                    # Zeros the file system holds no block for: the id of a chunk of zeros,
                    # known without reading them (the same id reading them would give).
                    chunks.append((self._put_zero_chunk(), CHUNK_SIZE))
                    continue
                piece = _read_full(f, CHUNK_SIZE)
                if not chunks and len(piece) <= STAGE_MAX and len(piece) < CHUNK_SIZE:
                    # The whole file, and small: staged like any put (compressed later, off the
                    # caller's path) instead of appended now after an index query of its own.
                    return self.put("blob", piece)
                if not piece:
                    break
                chunks.append((self._put_blob(piece), len(piece)))
                if len(piece) < CHUNK_SIZE:
                    break
                piece = b""  # let the stored chunk go before the next one is read
        if len(chunks) == 1:
            return chunks[0][0]
        return self.put("chunks", encode_chunks(chunks))

    def _put_zero_chunk(self) -> ObjectId:
        oid = zero_chunk_oid()
        with self._mutex:
            if oid not in self._staged and oid not in self._pending and not self._idx().has(oid):
                self._append(oid, "blob", bytes(CHUNK_SIZE), CHUNK_SIZE, None)
        return oid

    def _put_blob(self, data: bytes) -> ObjectId:
        """put("blob", data) for put_file: hashed as a stream, so the chunk is never copied
        behind its type tag (a 4 MiB copy per chunk costs about as much as hashing it)."""
        hasher = ObjectHasher("blob", len(data))
        hasher.update(data)
        oid = hasher.oid()
        with self._mutex:
            if oid not in self._staged and oid not in self._pending and not self._idx().has(oid):
                self._append(oid, "blob", data, len(data), None)
        return oid

    def flush(self) -> None:
        """The durability boundary: one fsync of this writer's pack, then one index commit.

        The fsync runs without the store's lock, so puts (a snapshot on another thread) go on
        while the disk works; what they add joins the next flush."""
        with self._soon:
            self._due = None  # a flush requested for later is this one
        # _lose_batch() sets _lost behind mypy's back: it stays `str | None` here.
        lost: str | None
        with self._flush_lock:
            self._drain()
            with self._mutex:
                idx = self._idx()
                if self._lost is not None:
                    lost, self._lost = self._lost, None
                    raise StoreError(lost)
                w = self._writer
                if not self._pending and (w is None or not w.dirty):
                    return
                batch = list(self._pending.values())
                fd = -1
                if w is not None:
                    try:
                        w.drain()
                        # A dup: a failed put may drop the writer (and close its fd) meanwhile.
                        fd = os.dup(w.fd)
                    except OSError as exc:
                        self._lose_batch(exc)
                        lost, self._lost = self._lost, None
                        raise StoreError(lost or "a pack write failed") from None
                    # PackWriter.sync's two steps, split so the fsync can run unlocked; a new
                    # pack's directory entry needs one fsync of its own, once.
                    end, fresh = w.end, w._fresh
                    w.dirty = False
            if w is not None:
                try:
                    os.fsync(fd)
                    if fresh:
                        _fsync_dir(w.path.parent)
                        w._fresh = False
                except OSError as exc:
                    with self._mutex:
                        self._lose_batch(exc)
                        lost, self._lost = self._lost, None
                    raise StoreError(lost or "a pack write failed") from None
                finally:
                    os.close(fd)
            self._stand_aside()  # the commit holds up whoever reads the index meanwhile
            # Without the store's lock, which every put takes: the commit takes milliseconds
            # when sqlite checkpoints its WAL. Until `pending` lets go of them below, these
            # objects are found both there and in the index, with the same record.
            with idx.write():
                idx.insert(batch)
                if w is not None:
                    idx.set_pack_size(w.name, end)
            with self._mutex:
                pending = self._pending
                for e in batch:
                    # Put again meanwhile by a concurrent writer of the same id: same record.
                    if pending.get(e.oid) is e:
                        del pending[e.oid]
                if w is not None and w is self._writer and w.end >= PACK_TARGET and not pending:
                    self._drop_writer()

    def flush_soon(self, delay: float = FLUSH_DELAY) -> None:
        """Group commit: the same flush as `flush()`, on a background thread within ``delay``
        seconds (sooner if an earlier request is due first). Returns at once; a failure of that
        flush is raised by the next `flush()`."""
        with self._mutex:
            w = self._writer
            if not self._staged and not self._pending and (w is None or not w.dirty):
                return
        with self._soon:
            if self._stopping:
                return
            if self._flusher is None or self._flusher_pid != os.getpid():
                # None yet, or one that stayed behind in the parent of a fork.
                self._flusher = threading.Thread(
                    target=self._flush_loop, name="shadowfs-store-flush", daemon=True
                )
                self._flusher_pid = os.getpid()
                self._flusher.start()
                _SOON.add(self)
            due = time.monotonic() + delay
            if self._due is None or due < self._due:
                self._due = due
                # After the answer when a control request scheduled it (shadowfs.wakeups).
                wakeups.notify(self._soon)

    def _flush_loop(self) -> None:
        while True:
            with self._soon:
                while not self._stopping and (
                    self._due is None or self._due > time.monotonic()
                ):
                    wait = None if self._due is None else self._due - time.monotonic()
                    self._soon.wait(wait)
                if self._stopping:
                    return
                self._due = None
            try:
                self.flush()
            except StoreError as exc:
                # Nobody waits on this thread: keep the news for the next flush() to raise.
                with self._mutex:
                    if self._lost is None:
                        self._lost = str(exc)

    def _stop_flusher(self) -> None:
        with self._soon:
            self._stopping = True
            self._soon.notify()
        t = self._flusher
        mine = self._flusher_pid == os.getpid()
        if t is not None and mine and t is not threading.current_thread():
            t.join()
        self._flusher = None

    # ------------------------------------------------------------------ rebuild

    def rebuild_index(self, progress: Progress | None = None) -> int:
        """Rebuilds the index from the packs alone in one transaction; returns objects indexed.

        Records whose bytes do not verify are left out (verify names them).
        """
        with self._flush_lock, self._mutex:
            self.flush()
            idx = self._idx()
            with idx.write():
                return self._rebuild_rows(progress)

    def _rebuild_rows(self, progress: Progress | None) -> int:
        idx = self._idx()
        idx.clear()
        copies: dict[ObjectId, list[tuple[str, pk.Found]]] = {}
        ends: dict[str, int] = {}
        names = self._pack_names()
        total = sum(_size_or_zero(self._packs_dir / n) for n in names)
        done = 0
        for name in names:
            try:
                fd = os.open(self._packs_dir / name, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                end = os.fstat(fd).st_size
                valid_end = pk.PACK_HEADER_LEN
                for item in pk.scan(fd, pk.PACK_HEADER_LEN, end):
                    if isinstance(item, pk.Found):
                        copies.setdefault(item.header.oid, []).append((name, item))
                        valid_end = item.end
                    elif isinstance(item, pk.Damaged):
                        valid_end = item.end
            finally:
                os.close(fd)
            ends[name] = valid_end
            done += end
            if progress is not None:
                progress(done, total)
        # Every first copy goes in unverified so delta bases resolve through the index; then each
        # object is verified in base-first order, falling back to another copy if one is bad.
        first = [self._entry_guess(name, f) for name, f in (cps[0] for cps in copies.values())]
        idx.insert(first)
        verified: dict[ObjectId, IndexEntry | None] = {}

        def settle(oid: ObjectId, visiting: set[ObjectId]) -> IndexEntry | None:
            if oid in verified:
                return verified[oid]
            if oid in visiting or oid not in copies or len(visiting) > MAX_DELTA_DEPTH:
                return None
            visiting.add(oid)
            result = None
            for name, f in copies[oid]:
                h = f.header
                if h.base is not None and settle(h.base, visiting) is None:
                    continue
                entry = self._entry_guess(name, f)
                idx.upsert([entry])
                try:
                    raw = self._raw(entry)
                except (StoreError, OSError):
                    continue
                result = self._entry_for(name, f.offset, h, raw)
                idx.upsert([result])
                break
            visiting.discard(oid)
            if result is None:
                idx.delete([oid])
            verified[oid] = result
            return result

        for oid in copies:
            settle(oid, set())
        for name, end in ends.items():
            idx.set_pack_size(name, end)
        return sum(1 for e in verified.values() if e is not None)

    @staticmethod
    def _entry_guess(name: str, f: pk.Found) -> IndexEntry:
        h = f.header
        return IndexEntry(
            h.oid, h.kind, name, f.offset, h.stored_len, h.raw_len, h.raw_len, h.base, 0, h.created
        )

    # ------------------------------------------------------------------ verify

    def verify(self, progress: Progress | None = None) -> list[Problem]:
        """Re-hashes every record of every pack, indexed or not; returns what is bad.

        progress(done, total) counts pack bytes.
        """
        with self._flush_lock, self._mutex:
            self.flush()
            idx = self._idx()
            problems: list[Problem] = []
            by_pack: dict[str, dict[int, ObjectId]] = {}
            for oid, pack, offset in idx.locations():
                by_pack.setdefault(pack, {})[offset] = oid
            names = self._pack_names()
            total = sum(_size_or_zero(self._packs_dir / n) for n in names)
            done = 0
            for name in names:
                indexed = by_pack.pop(name, {})
                # Its own fd: reading delta bases may evict cached ones.
                try:
                    fd = os.open(self._packs_dir / name, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    by_pack[name] = indexed
                    continue
                try:
                    end = os.fstat(fd).st_size
                    problems.extend(self._verify_pack(name, fd, end, indexed))
                finally:
                    os.close(fd)
                done += end
                if progress is not None:
                    progress(done, total)
            for pack, offsets in by_pack.items():
                for offset, oid in sorted(offsets.items()):
                    problems.append(Problem(oid, pack, offset, "its pack file is missing"))
            return problems

    def _verify_pack(
        self, name: str, fd: int, end: int, indexed: dict[int, ObjectId]
    ) -> list[Problem]:
        problems: list[Problem] = []
        if not pk.read_pack_magic(fd):
            problems.append(Problem(None, name, 0, "the pack file header is damaged"))
        good: set[int] = set()
        bad: set[int] = set()
        for item in pk.scan(fd, pk.PACK_HEADER_LEN, end):
            if isinstance(item, pk.Damaged):
                problems.append(Problem(indexed.get(item.offset), name, item.offset, item.reason))
                bad.add(item.offset)
            elif isinstance(item, pk.Found):
                reason = self._check_record(name, fd, item, indexed.get(item.offset))
                if reason is None:
                    good.add(item.offset)
                else:
                    problems.append(Problem(item.header.oid, name, item.offset, reason))
                    bad.add(item.offset)
        for offset, oid in sorted(indexed.items()):
            if offset not in good and offset not in bad:
                reason = "the index points here but no intact record starts here"
                problems.append(Problem(oid, name, offset, reason))
        return problems

    def _check_record(self, name: str, fd: int, f: pk.Found, expect: ObjectId | None) -> str | None:
        h = f.header
        if expect is not None and expect != h.oid:
            return f"the index expects object {expect} here"
        try:
            payload = os.pread(fd, h.stored_len, f.payload_offset)
            raw = self._decode(h, payload, _where(name, f.offset))
            if h.kind == "chunks":
                for chunk, _ in decode_chunks(raw):
                    if not self.has(chunk):
                        return f"its chunk {chunk} is missing"
        except ObjectMissing as exc:
            return f"its delta base {exc.oid} is missing"
        except ObjectCorrupt as exc:
            if exc.oid != h.oid:
                return f"its delta base {exc.oid} is corrupt"
            detail = exc.where[len(_where(name, f.offset)) :].lstrip(": ")
            return detail or "its bytes do not hash to its id"
        except StoreError as exc:
            return str(exc)
        except OSError as exc:
            return f"unreadable ({exc.strerror})"
        return None

    # ------------------------------------------------------------------ gc

    def gc(
        self,
        live: set[ObjectId],
        grace_seconds: float = 3600,
        dry_run: bool = False,
        progress: Progress | None = None,
        min_waste: float = 0.0,
    ) -> GcReport:
        """Removes objects neither live, nor needed by a live object, nor younger than the grace.

        Packs at least ``min_waste`` of whose bytes are garbage (and packs with nothing live)
        are rewritten into a new pack and deleted; in the others the garbage's index rows are
        deleted and its bytes stay until a later gc finds the pack wasteful enough. With
        min_waste 0.25, a gc that finds a few objects of garbage in a 256 MiB pack costs the
        mark and an index write, not a copy of the pack. Raises StoreBusy while another process
        writes to the store. progress counts records copied.
        """
        with self._flush_lock, self._mutex:
            self.flush()
            self._drop_writer()  # its pack may be rewritten; the next put starts afresh
            self._unlock()
            if not self._lock(fcntl.LOCK_EX, block=False):
                raise StoreBusy(
                    f"gc needs the store at {self.root} to itself but another process is writing "
                    "to it; retry when that run ends"
                )
            try:
                self._recover_packs()
                return self._gc_locked(live, grace_seconds, dry_run, progress, min_waste)
            finally:
                self._unlock()

    def _gc_locked(
        self,
        live: set[ObjectId],
        grace: float,
        dry_run: bool,
        progress: Progress | None,
        min_waste: float = 0.0,
    ) -> GcReport:
        idx = self._idx()
        entries = {e.oid: e for e in idx.entries()}
        cutoff = time.time() - grace
        stack = [o for o in live if o in entries]
        stack += [o for o, e in entries.items() if e.created > cutoff]
        keep: set[ObjectId] = set()
        while stack:
            oid = stack.pop()
            if oid in keep:
                continue
            keep.add(oid)
            e = entries[oid]
            if e.delta_base is not None and e.delta_base in entries:
                stack.append(e.delta_base)
            if e.kind == "chunks":
                stack += [c for c, _ in decode_chunks(self._raw(e)) if c in entries]
        dead = [o for o in entries if o not in keep]

        per_pack: dict[str, list[IndexEntry]] = {}
        for oid in keep:
            per_pack.setdefault(entries[oid].pack, []).append(entries[oid])
        dead_packs = {entries[o].pack for o in dead}
        rewrite: list[str] = []
        old_bytes = left = 0
        for name in self._pack_names():
            size = _size_or_zero(self._packs_dir / name)
            kept_len = sum(e.record_len for e in per_pack.get(name, []))
            waste = size - pk.PACK_HEADER_LEN - kept_len
            if name not in dead_packs and waste == 0:
                continue
            if name in per_pack and waste < size * min_waste:
                left += waste
                continue
            rewrite.append(name)
            old_bytes += size
        moving = [e for name in rewrite for e in per_pack.get(name, [])]
        moving.sort(key=lambda e: (e.pack, e.offset))
        new_bytes = sum(e.record_len for e in moving)
        if moving:
            new_bytes += pk.PACK_HEADER_LEN * (1 + new_bytes // PACK_TARGET)
        report = GcReport(len(keep), len(dead), max(0, old_bytes - new_bytes), max(0, left))
        if progress is not None:
            progress(0, len(moving))  # the total is known: most gcs copy nothing at all
        if dry_run or not (rewrite or dead):
            return report

        moved: list[IndexEntry] = []
        writers: list[pk.PackWriter] = []
        try:
            for i, e in enumerate(moving):
                self._raw(e)  # never carry a damaged object into the new pack unnoticed
                record = os.pread(self._fd(e.pack), e.record_len, e.offset)
                if not writers or writers[-1].end >= PACK_TARGET:
                    writers.append(pk.PackWriter.create(self._packs_dir))
                w = writers[-1]
                moved.append(e.moved(w.name, w.append([record])))
                if progress is not None:
                    progress(i + 1, len(moving))
            for w in writers:
                w.sync()
            with idx.write():
                idx.upsert(moved)
                idx.delete(dead)
                idx.drop_packs(rewrite)
                for w in writers:
                    idx.set_pack_size(w.name, w.end)
        except BaseException:
            for w in writers:
                w.close()
                w.path.unlink(missing_ok=True)
            raise
        for w in writers:
            w.close()
        for name in rewrite:
            self._forget_fd(name)
            (self._packs_dir / name).unlink(missing_ok=True)
        for stale in self._packs_dir.glob("*.tmp"):
            stale.unlink(missing_ok=True)
        _fsync_dir(self._packs_dir)
        return report


def _read_full(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if data is None:  # a non-blocking fd with nothing ready
        raise StoreError(
            "put_file needs a blocking file descriptor; open the file without O_NONBLOCK"
        )
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = f.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


@functools.cache
def zero_chunk_oid() -> ObjectId:
    """The id of a whole chunk of zeros (a blob of CHUNK_SIZE zero bytes), hashed once."""
    return hash_object("blob", bytes(CHUNK_SIZE))


class _Holes:
    """Tells, chunk by chunk, whether the rest of a whole chunk of a file lies in a hole
    (SEEK_DATA), for files that have holes at all (fewer blocks than their size needs)."""

    __slots__ = ("f", "fd", "size")

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.fd = f.fileno()
        self.size = size

    @classmethod
    def of(cls, f: BinaryIO) -> _Holes | None:
        try:
            st = os.fstat(f.fileno())
        except (OSError, ValueError):
            return None
        if not S_ISREG(st.st_mode) or st.st_blocks * 512 >= st.st_size:
            return None  # no hole to find: no lseek per chunk
        return cls(f, st.st_size)

    def next_chunk_is_hole(self) -> bool:
        pos = self.f.tell()
        end = pos + CHUNK_SIZE
        if end > self.size:
            return False  # the short last chunk is read: its zeros are cheap
        try:
            data = os.lseek(self.fd, pos, os.SEEK_DATA)
        except OSError:
            data = self.size  # ENXIO: no data from pos on (other errors: read, as without us)
        if data < end:
            self.f.seek(pos)  # the buffered reader's position, whatever lseek did to the fd's
            return False
        self.f.seek(end)
        return True


# Records this close (bytes between them) share a pread in `read_blobs`, up to a span this big.
_SPAN_GAP = 64 << 10
_SPAN_MAX = 8 << 20


# A plain blob's record: (pack, offset, index in the caller's list, oid, raw_len, stored_len).
_Span = tuple[str, int, int, bytes, int, int]
_BLOB_RECORD_HEADER = pk.header_len("blob", False)


def _spans(todo: list[_Span]) -> Iterator[list[_Span]]:
    """Runs of plain blob records (see `_Span`), in pack order, close enough to read at once."""
    span: list[_Span] = []
    end = 0
    for item in todo:
        pack, offset = item[0], item[1]
        if span and (
            pack != span[0][0] or offset > end + _SPAN_GAP or offset - span[0][1] > _SPAN_MAX
        ):
            yield span
            span = []
        if not span:
            end = offset
        span.append(item)
        end = max(end, offset + _BLOB_RECORD_HEADER + item[5])
    if span:
        yield span


def _write_all(fileobj: ByteSink, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = fileobj.write(view)
        if n is None or n >= len(view):
            return
        view = view[n:]


def _size_or_zero(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "CHUNK_SIZE",
    "MAX_DELTA_DEPTH",
    "OID_SIZE",
    "GcReport",
    "Problem",
    "Store",
    "StoreStats",
    "decode_chunks",
    "encode_chunks",
]
