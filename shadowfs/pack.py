"""Pack files: the store's on-disk record format, its payload codec and the append-only writer.

A pack is an 8-byte file header followed by records. Each record describes itself, so the index
can be rebuilt from the packs alone:

    fixed part, 68 bytes, little-endian:
        magic b"SFo\\x01" | flags u8 | kind_len u8 | reserved u16 (0) | created u64 (unix s)
        | raw_len u64 | stored_len u64 | oid (32 bytes) | crc32 of the 64 bytes before it
    kind        kind_len ASCII bytes
    delta base  32 bytes, present only when FLAG_DELTA is set
    payload     stored_len bytes: the raw bytes, a zstd frame, or a zstd frame compressed with
                the delta base's raw bytes as a raw-content dictionary

The crc guards the framing: a flipped length must not derail a scan. The kind, the base and the
payload need no crc of their own because the object id covers them and is checked on every read.
"""

from __future__ import annotations

import fcntl
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from shadowfs.errors import StoreError
from shadowfs.oid import OID_SIZE, ObjectId
from shadowfs.values import Value, setfield
from shadowfs.zstd import zstandard

PACK_MAGIC = b"SFPACK\x00\x01"
PACK_HEADER_LEN = len(PACK_MAGIC)
RECORD_MAGIC = b"SFo\x01"

FLAG_ZSTD = 0x01
FLAG_DELTA = 0x02
KNOWN_FLAGS = FLAG_ZSTD | FLAG_DELTA
MAX_KIND_LEN = 32

_FIXED = struct.Struct("<4sBBHQQQ32s")
_CRC = struct.Struct("<I")
FIXED_LEN = _FIXED.size + _CRC.size  # 68

# Small records gather in memory and reach the kernel in one write; big ones go straight through.
WRITE_BUFFER = 1 << 20
_SCAN_BLOCK = 1 << 20


class RecordError(StoreError):
    """A pack record whose bytes do not parse; the message says what is wrong with it."""


def pack_name_ok(name: object) -> bool:
    # Names also come from the index, which is only a cache and may be damaged: one holding "/"
    # or NUL must never steer a read or an append outside packs/.
    return (
        isinstance(name, str)
        and name.startswith("pack-")
        and name.endswith(".pack")
        and "/" not in name
        and "\0" not in name
    )


class RecordHeader(Value):
    __slots__ = FIELDS = ("oid", "kind", "flags", "created", "raw_len", "stored_len", "base")
    oid: ObjectId
    kind: str
    flags: int
    created: int
    raw_len: int
    stored_len: int
    base: ObjectId | None

    def __init__(
        self, oid: ObjectId, kind: str, flags: int, created: int, raw_len: int, stored_len: int,
        base: ObjectId | None,
    ) -> None:  # fmt: skip
        setfield(self, "oid", oid)
        setfield(self, "kind", kind)
        setfield(self, "flags", flags)
        setfield(self, "created", created)
        setfield(self, "raw_len", raw_len)
        setfield(self, "stored_len", stored_len)
        setfield(self, "base", base)

    @property
    def header_len(self) -> int:
        return header_len(self.kind, self.base is not None)


def header_len(kind: str, delta: bool) -> int:
    return FIXED_LEN + len(kind) + (OID_SIZE if delta else 0)


def check_kind(kind: str) -> None:
    if kind in GOOD_KINDS:
        return
    kind_b = kind.encode("ascii", "replace")
    if not (0 < len(kind_b) <= MAX_KIND_LEN and _plain_word(kind_b)):
        raise StoreError(
            f"object kind {kind!r} must be 1 to {MAX_KIND_LEN} ASCII letters, digits or '_'"
        )
    GOOD_KINDS.add(kind)


# Kinds already checked; a caller on a hot path tests membership itself before calling.
GOOD_KINDS: set[str] = set()


def encode_header(
    oid: ObjectId,
    kind: str,
    flags: int,
    created: int,
    raw_len: int,
    stored_len: int,
    base: ObjectId | None,
) -> bytes:
    check_kind(kind)
    kind_b = kind.encode("ascii")
    fixed = _FIXED.pack(RECORD_MAGIC, flags, len(kind_b), 0, created, raw_len, stored_len, oid)
    return b"".join((fixed, _CRC.pack(zlib.crc32(fixed)), kind_b, base or b""))


def _parse_fixed(buf: bytes | memoryview) -> tuple[int, int, int, int, int, bytes] | str:
    """The fixed part's fields, or a string saying why they cannot be trusted."""
    if len(buf) < FIXED_LEN:
        return "record header cut short"
    magic, flags, kind_len, reserved, created, raw_len, stored_len, oid = _FIXED.unpack_from(buf)
    if magic != RECORD_MAGIC:
        return "no record starts here (bad record magic)"
    (crc,) = _CRC.unpack_from(buf, _FIXED.size)
    if crc != zlib.crc32(buf[: _FIXED.size]):
        return "record header checksum mismatch"
    if flags & ~KNOWN_FLAGS or reserved or not 0 < kind_len <= MAX_KIND_LEN:
        return "record header has unknown flags or a bad kind length"
    if flags & FLAG_DELTA and not flags & FLAG_ZSTD:
        return "record header marks a delta that is not zstd"
    return flags, kind_len, created, raw_len, stored_len, oid


_BLOB_KIND = b"blob"
_BLOB_HEADER_LEN = FIXED_LEN + len(_BLOB_KIND)


def plain_blob_payload(
    buf: bytes | memoryview, at: int, oid: bytes, raw_len: int, stored_len: int
) -> tuple[bool, int] | None:
    """For the record at ``buf[at:]`` that should be the plain (non-delta) blob ``oid`` of
    these lengths: (zstd, offset of its payload in buf), or None when it is anything else.
    For a bulk read that checks every payload against its id, which covers what the header's
    crc would (parse_header is the full check)."""
    try:
        magic, flags, kind_len, _, _, raw, stored, got = _FIXED.unpack_from(buf, at)
    except struct.error:
        return None
    end = at + _BLOB_HEADER_LEN
    if (
        magic != RECORD_MAGIC
        or got != oid
        or raw != raw_len
        or stored != stored_len
        or flags & ~FLAG_ZSTD
        or kind_len != len(_BLOB_KIND)
        or buf[end - len(_BLOB_KIND) : end] != _BLOB_KIND
        or len(buf) < end + stored_len
    ):
        return None
    return bool(flags), end


def _plain_word(kind: bytes) -> bool:
    return kind.isascii() and kind.replace(b"_", b"").isalnum()


def parse_header(buf: bytes | memoryview) -> RecordHeader:
    """Parses a full record header from the start of buf; raises RecordError if it is damaged."""
    fixed = _parse_fixed(buf)
    if isinstance(fixed, str):
        raise RecordError(fixed)
    flags, kind_len, created, raw_len, stored_len, oid = fixed
    kind_b = bytes(buf[FIXED_LEN : FIXED_LEN + kind_len])
    base: ObjectId | None = None
    end = FIXED_LEN + kind_len
    if flags & FLAG_DELTA:
        base_b = bytes(buf[end : end + OID_SIZE])
        if len(base_b) != OID_SIZE:
            raise RecordError("record header cut short")
        base = ObjectId(base_b)
    if len(kind_b) != kind_len:
        raise RecordError("record header cut short")
    if not _plain_word(kind_b):
        raise RecordError("record kind is not a plain ASCII word")
    kind = kind_b.decode("ascii")
    return RecordHeader(ObjectId(oid), kind, flags, created, raw_len, stored_len, base)


# --------------------------------------------------------------------------- payload codec


def encode_plain(data: bytes, cctx: zstandard.ZstdCompressor) -> tuple[int, bytes]:
    """(flags, payload): zstd when it saves space, else the raw bytes (no decompression later)."""
    if not data:
        return 0, b""
    packed = cctx.compress(data)
    if len(packed) < len(data):
        return FLAG_ZSTD, packed
    return 0, data


def encode_delta(data: bytes, base_raw: bytes, level: int) -> bytes:
    # Raw-content dictionary: zstd matches against the base's bytes as if they preceded the data.
    zdict = zstandard.ZstdCompressionDict(base_raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    return zstandard.ZstdCompressor(level=level, dict_data=zdict).compress(data)


def decode_payload(
    header: RecordHeader,
    payload: bytes | memoryview,
    base_raw: bytes | None,
    dctx: zstandard.ZstdDecompressor,
) -> bytes:
    """The raw bytes of a record; RecordError if the payload does not decode to raw_len bytes."""
    if not header.flags & FLAG_ZSTD:
        raw = bytes(payload)
    else:
        try:
            # Checked before decompressing: a flipped content size must not become a huge alloc.
            if zstandard.frame_content_size(payload) != header.raw_len:
                raise RecordError("zstd frame size disagrees with the record header")
            if header.flags & FLAG_DELTA:
                if base_raw is None:
                    raise RecordError("delta record read without its base")
                zdict = zstandard.ZstdCompressionDict(
                    base_raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT
                )
                raw = zstandard.ZstdDecompressor(dict_data=zdict).decompress(payload)
            else:
                raw = dctx.decompress(payload)
        except zstandard.ZstdError as exc:
            raise RecordError(f"zstd payload does not decode ({exc})") from None
    if len(raw) != header.raw_len:
        raise RecordError(f"payload decodes to {len(raw)} bytes, header says {header.raw_len}")
    return raw


# --------------------------------------------------------------------------- scanning


class Found(Value):
    """An intact record header (its payload is not checked yet)."""

    __slots__ = FIELDS = ("offset", "header")
    offset: int
    header: RecordHeader

    def __init__(self, offset: int, header: RecordHeader) -> None:
        setfield(self, "offset", offset)
        setfield(self, "header", header)

    @property
    def payload_offset(self) -> int:
        return self.offset + self.header.header_len

    @property
    def end(self) -> int:
        return self.payload_offset + self.header.stored_len


class Damaged(Value):
    """Bytes from offset to end that hold no intact record."""

    __slots__ = FIELDS = ("offset", "end", "reason")
    offset: int
    end: int
    reason: str

    def __init__(self, offset: int, end: int, reason: str) -> None:
        setfield(self, "offset", offset)
        setfield(self, "end", end)
        setfield(self, "reason", reason)


class TornTail(Value):
    """An unfinished final record: a write cut short by a crash, never indexed."""

    __slots__ = FIELDS = ("offset",)
    offset: int

    def __init__(self, offset: int) -> None:
        setfield(self, "offset", offset)


ScanItem = Found | Damaged | TornTail


def _all_zero(fd: int, start: int, end: int) -> bool:
    pos = start
    while pos < end:
        block = os.pread(fd, min(_SCAN_BLOCK, end - pos), pos)
        if not block or block.count(0) != len(block):
            return False
        pos += len(block)
    return True


def _resync(fd: int, start: int, end: int) -> int:
    """The next offset at or after start where an intact record header begins, else end."""
    pos = start
    keep = len(RECORD_MAGIC) - 1
    while pos < end:
        block = os.pread(fd, min(_SCAN_BLOCK, end - pos), pos)
        if not block:
            break
        at = block.find(RECORD_MAGIC)
        while at != -1:
            cand = pos + at
            if not isinstance(_parse_fixed(os.pread(fd, FIXED_LEN, cand)), str):
                return cand
            at = block.find(RECORD_MAGIC, at + 1)
        if len(block) <= keep:
            break
        pos += len(block) - keep  # a magic split across two blocks is found in the next one
    return end


def scan(fd: int, start: int, end: int) -> Iterator[ScanItem]:
    """Walks the records of a pack from start to end, resynchronising after damage."""
    off = start
    while off < end:
        if end - off < FIXED_LEN:
            yield TornTail(off)
            return
        head = os.pread(fd, FIXED_LEN + MAX_KIND_LEN + OID_SIZE, off)
        fixed = _parse_fixed(head)
        if isinstance(fixed, str):
            # A crash on some file systems leaves a zero-filled tail where a write was lost.
            if _all_zero(fd, off, end):
                yield TornTail(off)
                return
            nxt = _resync(fd, off + 1, end)
            yield Damaged(off, nxt, fixed)
            off = nxt
            continue
        flags, kind_len, _, _, stored_len, _ = fixed
        rec_end = off + FIXED_LEN + kind_len + (OID_SIZE if flags & FLAG_DELTA else 0) + stored_len
        if rec_end > end:
            yield TornTail(off)
            return
        try:
            header = parse_header(head)
        except RecordError as exc:
            yield Damaged(off, rec_end, str(exc))
        else:
            yield Found(off, header)
        off = rec_end


def read_pack_magic(fd: int) -> bool:
    return os.pread(fd, PACK_HEADER_LEN, 0) == PACK_MAGIC


# --------------------------------------------------------------------------- writing


class PackWriter:
    """Appends records to one pack this process holds an exclusive flock on.

    Offsets are tracked here rather than with O_APPEND so a record's offset is known before the
    bytes reach the kernel; small records wait in a buffer that readers of this process consult.
    """

    def __init__(self, path: Path, fd: int, end: int, fresh: bool) -> None:
        self.path = path
        self.name = path.name
        self.fd = fd
        self.end = end
        self._buf = bytearray()
        self._buf_start = end
        self._fresh = fresh  # the directory entry still needs an fsync
        self.dirty = False

    @classmethod
    def create(cls, packs_dir: Path) -> PackWriter:
        """A new empty pack, named only once its header is written and it is locked."""
        name = f"pack-{os.urandom(16).hex()}.pack"
        tmp = packs_dir / (name + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.pwrite(fd, PACK_MAGIC, 0)
            os.rename(tmp, packs_dir / name)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return cls(packs_dir / name, fd, PACK_HEADER_LEN, fresh=True)

    def append(self, parts: Sequence[bytes | memoryview]) -> int:
        """Queues a record made of parts; returns its offset."""
        offset = self.end
        size = sum(len(p) for p in parts)
        if size >= WRITE_BUFFER:
            self.drain()
            _pwritev_all(self.fd, parts, offset)
            self.end = self._buf_start = offset + size
        else:
            for p in parts:
                self._buf += p
            self.end = offset + size
            if len(self._buf) >= WRITE_BUFFER:
                self.drain()
        self.dirty = True
        return offset

    def buffered(self, offset: int, length: int) -> bytes | None:
        """The bytes at offset if they are still in the write buffer, else None."""
        if offset < self._buf_start:
            return None
        rel = offset - self._buf_start
        return bytes(self._buf[rel : rel + length])

    def drain(self) -> None:
        if self._buf:
            _pwritev_all(self.fd, [self._buf], self._buf_start)
            self._buf_start += len(self._buf)
            self._buf = bytearray()

    def sync(self) -> None:
        """Makes every appended record durable: one fsync of the pack (plus its directory once)."""
        self.drain()
        if self.dirty:
            os.fsync(self.fd)
            self.dirty = False
        if self._fresh:
            dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._fresh = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock
            self.fd = -1


def _pwritev_all(fd: int, parts: Sequence[bytes | memoryview | bytearray], offset: int) -> None:
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
