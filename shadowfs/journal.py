"""The write journal: every mutating file-system operation, in order, between two snapshots.

The layer appends one `JournalOp` per mutating operation (create, write, truncate, rename, ...)
with the paths involved (bytes, relative to the layer root), the pid of the process that asked
(from the FUSE request context; 0 for in-process callers), the wall-clock time in nanoseconds, and
for writes the offset and length. Data bytes are not journalled: the snapshot's tree holds the
resulting content, the journal says who changed what, where and when.

A setattr that changes nothing but ctime records nothing: with the writeback cache the kernel
sends a file's unchanged mtime back after every unlink and rename of it.

Consecutive writes through the same open file that continue exactly where the previous one ended
are coalesced into one record (``length`` grows, ``time_ns`` stays the first write's), so a
sequential 100 MB write costs one record, not 800.

Through the FUSE mount a write's path is the file's path when the write reaches the layer, and
its pid is the writer's when the kernel says it; with the writeback cache the kernel writes most
pages back on its own, with no process, and those writes carry the last process seen on the file
(its create, lookup, read or truncate). In process, a write's path is the path the file had when
its handle was opened.

Encoding (version 1), canonical: one op list has exactly one encoding. ``uv`` is an unsigned
LEB128 varint in its shortest form::

    journal := b"SJNL" version:u8 (= 1) record*
    record  := op:u8 pid:uv time_ns:uv npaths:u8 (len:uv bytes)*npaths
               offset:uv length:uv arg:uv extra_len:uv extra

``op`` codes are listed in ``OPS`` (index = code). ``arg`` carries a mode (create, mkdir,
symlink's 0, chmod), rename flags, or a uid/gid pair packed as ``uid << 32 | gid`` (chown);
``extra`` carries an xattr name, a symlink target, or a tree id (restore). Unused fields are 0 or
empty. Decoding refuses non-minimal varints, unknown ops and trailing bytes.
"""

from __future__ import annotations

import time

from shadowfs.values import Record

MAGIC = b"SJNL"
VERSION = 1

OPS: tuple[str, ...] = (
    "create",
    "write",
    "truncate",
    "unlink",
    "mkdir",
    "rmdir",
    "rename",
    "link",
    "symlink",
    "chmod",
    "chown",
    "utimens",
    "setxattr",
    "removexattr",
    "restore",
)
_CODES = {name: i for i, name in enumerate(OPS)}


class JournalOp(Record):
    __slots__ = FIELDS = ("op", "paths", "pid", "time_ns", "offset", "length", "arg", "extra")

    def __init__(
        self, op: str, paths: tuple[bytes, ...], pid: int, time_ns: int, offset: int = 0,
        length: int = 0, arg: int = 0, extra: bytes = b"",
    ) -> None:  # fmt: skip
        self.op = op
        self.paths = paths
        self.pid = pid
        self.time_ns = time_ns
        self.offset = offset
        self.length = length
        self.arg = arg
        self.extra = extra


def _uv(n: int, out: bytearray) -> None:
    if n < 0:
        raise ValueError(f"journal fields are unsigned, got {n}; this is a bug in the caller")
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


class Journal:
    """The operations since the last snapshot, encoded as they are recorded, with write
    coalescing.

    Each operation is encoded when the next one is recorded (the latest stays open for a
    continuing write to extend), so taking the journal at a snapshot costs one record's
    encoding, not all of them."""

    __slots__ = ("_buf", "_count", "_last", "_last_write_fh", "changes")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._count = 0
        # Operations recorded and writes extended, ever (not reset by a take): whether the
        # layer changed between two looks (`shadowfs.quiet_fold`).
        self.changes = 0
        self._last: JournalOp | None = None
        self._last_write_fh = -1
        self._reset()

    def _reset(self) -> None:
        self._buf = bytearray(MAGIC)
        self._buf.append(VERSION)
        self._count = 0
        self._last = None
        self._last_write_fh = -1

    def __len__(self) -> int:
        return self._count

    def _open(self, op: JournalOp) -> None:
        last = self._last
        if last is not None:
            _encode_op(last, self._buf)
        self._last = op
        self._count += 1
        self.changes += 1

    def record(
        self,
        op: str,
        paths: tuple[bytes, ...],
        pid: int,
        *,
        offset: int = 0,
        length: int = 0,
        arg: int = 0,
        extra: bytes = b"",
    ) -> None:
        self._last_write_fh = -1
        self._open(JournalOp(op, paths, pid, time.time_ns(), offset, length, arg, extra))

    def write(self, fh: int, path: bytes, pid: int, offset: int, length: int) -> None:
        """Record a write through open file ``fh``, extending the previous record when the write
        continues it (same handle, next byte)."""
        if self.extend(fh, offset, length):
            return
        self._open(JournalOp("write", (path,), pid, time.time_ns(), offset, length))
        self._last_write_fh = fh

    def extend(self, fh: int, offset: int, length: int) -> bool:
        """Extend the previous record when it is a write through ``fh`` ending at ``offset``;
        whether it did (else the caller records the write with `write`)."""
        if self._last_write_fh == fh:
            last = self._last
            if last is not None and last.offset + last.length == offset:
                last.length += length
                self.changes += 1
                return True
        return False

    def take_encoded(self) -> bytes:
        """The journal's bytes (`encode_journal` of its operations); starts an empty one."""
        last = self._last
        if last is not None:
            _encode_op(last, self._buf)
        data = bytes(self._buf)
        self._reset()
        return data

    def encoded(self) -> bytes:
        """What `take_encoded` would give now, the journal left as it is."""
        data = bytearray(self._buf)
        if self._last is not None:
            _encode_op(self._last, data)
        return bytes(data)

    def clear(self) -> None:
        """Start an empty journal, its bytes taken through `encoded`."""
        self._reset()

    def take(self) -> list[JournalOp]:
        """Hand over the recorded operations and start an empty journal."""
        return decode_journal(self.take_encoded())


def _encode_op(op: JournalOp, out: bytearray) -> None:
    code = _CODES.get(op.op)
    if code is None:
        raise ValueError(f"unknown journal op {op.op!r}; use one of {', '.join(OPS)}")
    if len(op.paths) > 255:
        raise ValueError(f"a journal op holds at most 255 paths, got {len(op.paths)}")
    out.append(code)
    _uv(op.pid, out)
    _uv(op.time_ns, out)
    out.append(len(op.paths))
    for p in op.paths:
        _uv(len(p), out)
        out += p
    _uv(op.offset, out)
    _uv(op.length, out)
    _uv(op.arg, out)
    _uv(len(op.extra), out)
    out += op.extra


def encode_journal(ops: list[JournalOp]) -> bytes:
    out = bytearray(MAGIC)
    out.append(VERSION)
    for op in ops:
        _encode_op(op, out)
    return bytes(out)


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int) -> None:
        self.data = data
        self.pos = pos

    def fail(self, why: str) -> ValueError:
        return ValueError(
            f"malformed journal object at byte {self.pos}: {why}; the store is damaged"
        )

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise self.fail("truncated record")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def uv(self) -> int:
        n = shift = 0
        start = self.pos
        while True:
            b = self.byte()
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if self.pos - start > 1 and b == 0:
            raise self.fail("non-minimal varint")
        return n

    def raw(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise self.fail("field runs past the end")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk


def decode_journal(data: bytes) -> list[JournalOp]:
    if data[:4] != MAGIC or len(data) < 5 or data[4] != VERSION:
        raise ValueError(
            "not a version-1 shadowfs journal (bad magic or version); check the object id"
        )
    r = _Reader(data, 5)
    ops: list[JournalOp] = []
    while r.pos < len(data):
        code = r.byte()
        if code >= len(OPS):
            raise r.fail(f"unknown op code {code}")
        pid = r.uv()
        t = r.uv()
        paths = tuple(r.raw(r.uv()) for _ in range(r.byte()))
        offset = r.uv()
        length = r.uv()
        arg = r.uv()
        extra = r.raw(r.uv())
        ops.append(JournalOp(OPS[code], paths, pid, t, offset, length, arg, extra))
    return ops
