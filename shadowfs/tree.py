"""Immutable Merkle directory trees: encode, build from a directory, walk, diff, materialize.

A tree object lists one directory's entries; a sub-directory entry points at the sub-tree's id, so
a tree id commits to every byte and every piece of metadata beneath it, and an unchanged sub-tree
keeps its id (git's object model). Trees are stored as objects of kind ``tree``.

Encoding (version 2; version 1 is its first three kinds). Integers are big-endian and unsigned
unless noted::

    tree    := version:u8 entry*                  entries strictly ascending by name bytes
    entry   := kind:u8 mode:u16 name_len:u8 size:u64 mtime_ns:i64 name[name_len] ref
    ref     := oid[32]                            kind 1 (file): blob or chunks id
                                                  kind 2 (dir):  tree id
             | target_len:u16 target[target_len]  kind 3 (symlink)
             | (nothing)                          kind 4 (fifo), kind 5 (unix socket)
             | rdev:u64                           kind 6 (character device), 7 (block device)
             | oid[32] link:u64                   kind 8 (file with hard links)
             | link:u64                           kinds 9, 10 (fifo, socket with hard links)
             | rdev:u64 link:u64                  kinds 11, 12 (devices with hard links)

- ``version`` is 1 when every entry is of kinds 1-3, else 2: a tree an older Jukebox could write
  keeps its bytes, hence its id, and an older reader refuses only trees it could not represent.
- Kinds 8-12 are kinds 1 and 4-7 with hard links: the entry shares its inode with every other
  entry of the same ``link`` (non-zero) anywhere under the same root tree. ``link`` is an opaque
  group key, meaningful only within one root tree. A group may have one member (its other names lie
  outside the tree, or were removed).
- ``rdev`` is the device number as Linux encodes it (``st_rdev``); fifos, sockets and devices
  have size 0.

- ``name`` is 1..255 bytes (NAME_MAX), never ``.`` or ``..``, never containing ``/`` or NUL; any
  other bytes are allowed (spaces, newlines, invalid UTF-8).
- ``mode`` is the permission part of st_mode (``st_mode & 0o7777``, setuid/setgid/sticky included);
  the file type lives in ``kind`` alone.
- ``size`` is the file size for files, the target length for symlinks, and 0 for directories (a
  directory's st_size depends on the file system, not on its contents).
- ``mtime_ns`` is signed nanoseconds since the epoch.
- ``target`` is 1..4095 bytes without NUL (Linux's limit for a symlink target).
- No trailing bytes. An empty directory encodes as the single version byte.

The encoding is canonical: one directory state has exactly one encoding, hence one id. Decoding
rejects anything that does not re-encode to the same bytes.
"""

from __future__ import annotations

import contextlib
import errno
import operator
import os
import stat
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from operator import attrgetter

from blake3 import blake3

from shadowfs.bounded import BoundedMap
from shadowfs.errors import TreeError
from shadowfs.oid import OID_SIZE, ObjectId, unchecked_oid
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader, ObjectStore
    from shadowfs.progress import Progress

FILE = "file"
DIR = "dir"
SYMLINK = "symlink"
FIFO = "fifo"
SOCKET = "socket"
CHARDEV = "chardev"
BLOCKDEV = "blockdev"
# Nodes with no content: the kernel carries a fifo's or socket's data, a device's is elsewhere.
SPECIALS = (FIFO, SOCKET, CHARDEV, BLOCKDEV)
DEVICES = (CHARDEV, BLOCKDEV)
# st_mode's file type of each special kind, and back.
SPECIAL_FMT = {
    FIFO: stat.S_IFIFO, SOCKET: stat.S_IFSOCK, CHARDEV: stat.S_IFCHR, BLOCKDEV: stat.S_IFBLK
}
FMT_SPECIAL = {fmt: kind for kind, fmt in SPECIAL_FMT.items()}

TREE_VERSION = 2
NAME_MAX = 255
TARGET_MAX = 4095
MODE_MASK = 0o7777

# A file whose mtime lies this close to (or after) the reference time may have been written again
# within the same timestamp tick after it was read, so its stat alone cannot prove it unchanged
# (git's "racily clean" entries). Two seconds covers coarse file systems (1 s, FAT's 2 s).
RACY_NS = 2_000_000_000

# Local file systems whose inodes take their times from the kernel's clock, in nanoseconds
# (statfs f_type): ext2/3/4, XFS, Btrfs, tmpfs. A write at instant t is stamped with the coarse
# clock (or, since Linux 6.13, a finer one), which lags t by less than a few ticks: the kernel
# forces the jiffies forward after 5 stalled ticks (MAX_STALLED_JIFFIES), when the CPU that
# keeps time is held up, a VM's exit for one. So a file whose ctime lies FINE_RACY_TICKS ticks
# before a reference instant cannot be written after that instant and keep its ctime. An ext4
# made with 128-byte inodes keeps whole seconds: a ctime with no sub-second part gets RACY_NS.
FINE_FS_TYPES = frozenset({0xEF53, 0x58465342, 0x9123683E, 0x01021994})
FINE_RACY_TICKS = 20
_MAX_TICK_NS = 10_000_000  # HZ=100; a coarser clock gets RACY_NS
_CLOCK_REALTIME_COARSE = 5  # linux/time.h; the os module does not name it


class RacyWindow:
    """How close to a reference instant a file's ctime may lie before its stat no longer proves
    it unwritten since (`racy_ns`): RACY_NS, but for the files of one device (``dev``) on a
    file system of FINE_FS_TYPES, whose nanosecond stamps get ``fine_ns`` (FINE_RACY_TICKS of
    the kernel's coarse clock). Made by `racy_window`."""

    __slots__ = ("dev", "fine_ns")

    def __init__(self, dev: int = -1, fine_ns: int = RACY_NS) -> None:
        self.dev = dev
        self.fine_ns = fine_ns

    def racy_ns(self, dev: int, ctime_ns: int) -> int:
        """The window for a file of device ``dev`` whose ctime is ``ctime_ns``."""
        if dev == self.dev and ctime_ns % 1_000_000_000:
            return self.fine_ns
        return RACY_NS


def racy_window(fd: int) -> RacyWindow:
    """The racy window of the files on ``fd``'s device (a directory of the tree): the fine one
    where its file system is one of FINE_FS_TYPES and the coarse clock ticks at least every
    10 ms, else RACY_NS for all. Any doubt (no statfs, no clock) keeps RACY_NS."""
    from shadowfs.libc import fstatfs_type

    try:
        tick = round(time.clock_getres(_CLOCK_REALTIME_COARSE) * 1e9)
        fs_type = fstatfs_type(fd)
        dev = os.fstat(fd).st_dev
    except (OSError, ValueError):
        return RacyWindow()
    if fs_type not in FINE_FS_TYPES or not 0 < tick <= _MAX_TICK_NS:
        return RacyWindow()
    return RacyWindow(dev, FINE_RACY_TICKS * tick)


# Recursion in build_tree/materialize is bounded so a hostile tree cannot exhaust the stack or
# the fd table; real trees stay far below this (PATH_MAX alone caps path-based access).
MAX_DEPTH = 400

_KIND_CODES = {FILE: 1, DIR: 2, SYMLINK: 3, FIFO: 4, SOCKET: 5, CHARDEV: 6, BLOCKDEV: 7}
_LINKED_FILE = 8
# Kinds that may have hard links, and their codes when they do (kind + 8 for the special ones).
_LINKED_CODES = {FILE: _LINKED_FILE, FIFO: 9, SOCKET: 10, CHARDEV: 11, BLOCKDEV: 12}
_KINDS = {code: kind for kind, code in (*_KIND_CODES.items(), *_LINKED_CODES.items())}
# The lowest kind code only version 2 knows: a tree holding one is written as version 2.
_V2_CODE = 4
_HEAD = struct.Struct(">BHBQq")
_TARGET_LEN = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_VERSION_BYTES = (b"", b"\x01", b"\x02")
_FIRST_BYTE = operator.itemgetter(0)
_U64_MAX = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1

# scandir on a dir fd yields str names decoded this way; encoding back is exact (os.fsencode
# without its per-call type checks, which showed up in profiles of 1,000-file builds).
_FS_ENCODING = sys.getfilesystemencoding()
_FS_ERRORS = sys.getfilesystemencodeerrors()

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: should a regular file be swapped for a fifo between lstat and open, do not hang.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

_ENTRY_FIELDS = ("name", "kind", "mode", "size", "mtime_ns", "oid", "target", "rdev", "link")


class Entry(Value):
    __slots__ = (*_ENTRY_FIELDS, "record")
    FIELDS = _ENTRY_FIELDS
    name: bytes
    kind: str
    mode: int
    size: int
    mtime_ns: int
    oid: ObjectId | None
    target: bytes | None
    # A device's number (st_rdev); 0 for every other kind.
    rdev: int
    # A hard-link group key within the root tree (kinds 8-12: a file, fifo, socket or device
    # with other names); 0 for none.
    link: int
    # The entry's encoded bytes once known (decoded from, or packed into, a tree): a directory
    # re-encoded after a change then joins its unchanged entries' bytes instead of packing each
    # again. Not part of the entry's value; never set it by hand (`entry_record` fills it).
    record: bytes | None

    def __init__(
        self, name: bytes, kind: str, mode: int, size: int, mtime_ns: int, oid: ObjectId | None,
        target: bytes | None, rdev: int = 0, link: int = 0,
    ) -> None:  # fmt: skip
        setfield(self, "name", name)
        setfield(self, "kind", kind)
        setfield(self, "mode", mode)
        setfield(self, "size", size)
        setfield(self, "mtime_ns", mtime_ns)
        setfield(self, "oid", oid)
        setfield(self, "target", target)
        setfield(self, "rdev", rdev)
        setfield(self, "link", link)
        setfield(self, "record", None)



class Change(Value):
    """One path that differs between two trees.

    status: ``added`` | ``deleted`` | ``modified`` (content, symlink target or device number; the
    mode may have changed too) | ``link`` (same content, another hard-link group: a name linked
    to it, or the group left) | ``mode`` (only the permission bits) | ``type`` (kind changed).
    Apply ``new`` wholesale; ``old`` is what was there.
    """

    __slots__ = FIELDS = ("path", "status", "old", "new")
    path: bytes
    status: str
    old: Entry | None
    new: Entry | None

    def __init__(self, path: bytes, status: str, old: Entry | None, new: Entry | None) -> None:
        setfield(self, "path", path)
        setfield(self, "status", status)
        setfield(self, "old", old)
        setfield(self, "new", new)


SkipCallback = Callable[[bytes, str], None]

# Which inode a regular file was when a build read it, and its last status change: (st_dev,
# st_ino, st_ctime_ns). A build records these for every file (`build_tree(seen=)`); the next
# build trusts an unread file's previous id only when they still match (`build_tree(known=)`).
FileIdentity = tuple[int, int, int]


# --- encoding ---------------------------------------------------------------------------------


def clamp_time_ns(ns: int) -> int:
    """A timestamp in the range a tree records: signed 64-bit nanoseconds, years 1677 to 2262.
    Times beyond it are clamped to its ends, as a file system clamps times beyond its own range
    (`touch -d 2300-01-01` works, and reads back as 2262)."""
    return _I64_MIN if ns < _I64_MIN else _I64_MAX if ns > _I64_MAX else ns


def stat_entry(
    name: bytes, kind: str, st: os.stat_result, oid: ObjectId | None, target: bytes | None = None
) -> Entry:
    """The entry for a file system object from its lstat: the one place entries are made from
    the outside world, so its time is clamped (`clamp_time_ns`) here and nowhere else. A
    regular file, fifo, socket or device with other names gets its inode's link key
    (`link_key`)."""
    mtime = clamp_time_ns(st.st_mtime_ns)
    mode = st.st_mode & MODE_MASK
    if kind == FILE:
        link = link_key(st) if st.st_nlink > 1 else 0
        return Entry(name, kind, mode, st.st_size, mtime, oid, target, 0, link)
    if kind == SYMLINK:
        # a symlink always has a target (Entry.target is None for the other kinds)
        return Entry(name, kind, mode, len(target), mtime, oid, target)  # type: ignore[arg-type]
    if kind == DIR:
        return Entry(name, kind, mode, 0, mtime, oid, target)
    rdev = st.st_rdev if kind in DEVICES else 0
    link = link_key(st) if st.st_nlink > 1 else 0
    return Entry(name, kind, mode, 0, mtime, oid, target, rdev, link)


def link_key(st: os.stat_result) -> int:
    """The hard-link group key of an inode seen on disk: the same for all its names, and, being
    a hash of device and inode number, apart from keys of other file systems and from those a
    layer draws at random for links it makes."""
    digest = blake3(b"shadowfs link\0" + _U64.pack(st.st_dev) + _U64.pack(st.st_ino)).digest()
    return int.from_bytes(digest[:8], "big") or 1


def new_link_key() -> int:
    """A fresh hard-link group key, for a group made by a layer."""
    return int.from_bytes(os.urandom(8), "big") or 1


def _check_name(name: bytes) -> str | None:
    """Why a name is not a safe single path component, or None when it is."""
    if not name:
        return "an empty name"
    if len(name) > NAME_MAX:
        return f"a name longer than {NAME_MAX} bytes"
    if name == b"." or name == b"..":
        return f"the name {name!r}"
    if b"/" in name:
        return f"the name {name!r}, which contains '/'"
    if b"\0" in name:
        return f"the name {name!r}, which contains NUL"
    return None


def check_entry(e: Entry) -> str | None:
    """Why an entry cannot be encoded (one phrase), or None when it can."""
    bad = _check_name(e.name)
    if bad:
        return bad
    if e.kind not in _KIND_CODES:
        return f"unknown kind {e.kind!r} for {e.name!r}"
    if not 0 <= e.mode <= MODE_MASK:
        return f"mode {e.mode:#o} of {e.name!r} has bits outside 0o7777"
    if not 0 <= e.size <= _U64_MAX:
        return f"size {e.size} of {e.name!r} is out of range"
    if not _I64_MIN <= e.mtime_ns <= _I64_MAX:
        return f"mtime_ns {e.mtime_ns} of {e.name!r} is out of range"
    if (e.rdev and e.kind not in DEVICES) or not 0 <= e.rdev <= _U64_MAX:
        return f"{e.kind} {e.name!r} has a device number {e.rdev}"
    if (e.link and e.kind not in _LINKED_CODES) or not 0 <= e.link <= _U64_MAX:
        return f"{e.kind} {e.name!r} has a hard-link key {e.link}; its kind has none"
    if e.kind in SPECIALS:
        if e.oid is not None or e.target is not None or e.size != 0:
            return f"{e.kind} {e.name!r} must have no oid, no target and size 0"
    elif e.kind == SYMLINK:
        t = e.target
        if e.oid is not None or t is None:
            return f"symlink {e.name!r} must have a target and no oid"
        if not 0 < len(t) <= TARGET_MAX or b"\0" in t:
            return f"symlink {e.name!r} has an invalid target {t[:64]!r}"
        if e.size != len(t):
            return f"symlink {e.name!r} has size {e.size}, not its target length {len(t)}"
    else:
        if e.target is not None or e.oid is None or len(e.oid) != OID_SIZE:
            return f"{e.kind} {e.name!r} must have a {OID_SIZE}-byte oid and no target"
        if e.kind == DIR and e.size != 0:
            return f"directory {e.name!r} has size {e.size}; directories are stored with size 0"
    return None


def entry_record(e: Entry) -> bytes:
    """The encoded bytes of one entry that `check_entry` accepts (not checked again here).

    A tree's bytes are the version byte followed by its entries' records in name order, so a
    caller that keeps the records of a directory can re-encode it after a change by re-packing
    only the changed records (`pack_records`). Computed once per entry object, then kept."""
    rec = e.record
    if rec is not None:
        return rec
    link = e.link
    code = _LINKED_CODES[e.kind] if link else _KIND_CODES[e.kind]
    head = _HEAD.pack(code, e.mode, len(e.name), e.size, e.mtime_ns)
    if e.target is not None:
        rec = head + e.name + _TARGET_LEN.pack(len(e.target)) + e.target
    elif e.oid is not None:
        rec = head + e.name + e.oid
    elif e.kind in DEVICES:
        rec = head + e.name + _U64.pack(e.rdev)
    else:
        rec = head + e.name
    if link:
        rec += _U64.pack(link)
    _set_record(e, rec)
    return rec


def pack_entries(entries: Iterable[Entry], version: int = 0) -> bytes:
    """Tree bytes from entries already validated (`check_entry`) and sorted by name.

    For callers that built the entries themselves or took them from decoded trees; anything else
    goes through `encode_tree`, which checks and sorts. Each entry keeps its record, so packing
    a directory again after a change only encodes the entries that changed. ``version`` is as
    for `pack_records`."""
    return pack_records([e.record or entry_record(e) for e in entries], version)


def pack_records(records: Iterable[bytes], version: int = 0) -> bytes:
    """Tree bytes from entry records (`entry_record`) already in strictly ascending name order.

    ``version`` is the tree version the records need, when the caller knows it (see
    `records_version`); 0 has it found here, at a pass over the records."""
    parts = [b""]
    parts.extend(records)  # one join: no copy of the joined records behind the version byte
    if not version:
        version = 2 if len(parts) > 1 and max(map(_FIRST_BYTE, parts[1:])) >= _V2_CODE else 1
    parts[0] = _VERSION_BYTES[version]
    return b"".join(parts)


def records_version(changed: Iterable[bytes], previous: bytes | None) -> int:
    """The version of a tree re-encoded from the tree ``previous`` (its bytes) with the records
    ``changed`` new or replaced, or 0 when only a pass over all its records can tell (a name of
    a version 2 tree removed or replaced). A directory re-encoded after a change then costs no
    pass over its unchanged records."""
    if any(r[0] >= _V2_CODE for r in changed):
        return 2
    return 1 if previous is not None and previous[0] == 1 else 0


def splice_records(packed: bytes, swaps: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The tree bytes ``packed`` with records swapped in place: each (old record, new record)
    pair's old one becomes the new one. None when a new record's length differs, which would
    move every record after it, or when an old record's bytes occur more than once in
    ``packed`` (a stretch across neighbouring records could repeat them), which leaves its
    place in doubt.

    A directory rebuilt after a few entries changed (a file's id, size or mtime: same length)
    then costs a search and two copies of its bytes instead of a join of all its records, and
    nothing is kept per record to find it again: a record holds its entry's name and a 32-byte
    id, so its bytes are unique but for hostile trees."""
    out = bytearray(packed)
    for old, rec in swaps:
        n = len(rec)
        if n != len(old):
            return None
        # The version byte follows the kinds present: re-pack when a swap may change it.
        if (rec[0] >= _V2_CODE) != (old[0] >= _V2_CODE):
            return None
        at = packed.find(old)
        if at < 0 or packed.find(old, at + 1) >= 0:
            return None
        out[at : at + n] = rec
    return bytes(out)


def encode_tree(entries: list[Entry] | tuple[Entry, ...]) -> bytes:
    """The canonical bytes of a directory holding ``entries`` (any order; names must be unique)."""
    ordered = sorted(entries, key=attrgetter("name"))
    prev: bytes | None = None
    for e in ordered:
        bad = check_entry(e)
        if bad:
            raise TreeError(f"cannot encode a tree entry with {bad}; fix the entry")
        if e.name == prev:
            raise TreeError(f"cannot encode a tree with two entries named {e.name!r}; keep one")
        prev = e.name
    return pack_entries(ordered)


def decode_tree(data: bytes) -> list[Entry]:
    """Parse tree bytes, refusing anything that is not the canonical encoding of a safe tree."""
    return list(_decode(data).values())


def _malformed(why: str) -> TreeError:
    return TreeError(f"malformed tree object: {why}; the store holds a bad or hostile tree")


_entry_new = Entry.__new__
_SETTERS = tuple(Entry.__dict__[f].__set__ for f in _ENTRY_FIELDS)
_set_record = Entry.__dict__["record"].__set__
_DOTS = (b".", b"..")


def make_entry(
    name: bytes, kind: str, mode: int, size: int, mtime_ns: int, oid: ObjectId | None,
    target: bytes | None,
    record: bytes | None = None,
    *,
    rdev: int = 0,
    link: int = 0,
) -> Entry:
    """Entry(...) without its __init__, which costs 2.5x as much through
    object.__setattr__: decoding big directories and building a snapshot's trees make many."""
    e = _entry_new(Entry)
    s_name, s_kind, s_mode, s_size, s_mtime, s_oid, s_target, s_rdev, s_link = _SETTERS
    s_name(e, name)
    s_kind(e, kind)
    s_mode(e, mode)
    s_size(e, size)
    s_mtime(e, mtime_ns)
    s_oid(e, oid)
    s_target(e, target)
    s_rdev(e, rdev)
    s_link(e, link)
    _set_record(e, record)
    return e


def _decode(data: bytes) -> dict[bytes, Entry]:
    n = len(data)
    if n == 0 or not 1 <= data[0] <= TREE_VERSION:
        got = "no bytes" if n == 0 else f"version {data[0]}"
        raise _malformed(f"expected version 1 to {TREE_VERSION}, found {got}")
    last_code = 3 if data[0] == 1 else 12
    newer = False  # an entry only version 2 can hold: a version 2 tree must have one
    out: dict[bytes, Entry] = {}
    unpack_head = _HEAD.unpack_from
    head_size = _HEAD.size
    kinds = _KINDS
    make = make_entry
    pos = 1
    prev = b""
    while pos < n:
        start = pos
        if pos + head_size > n:
            raise _malformed(f"truncated entry header at byte {pos}")
        code, mode, name_len, size, mtime_ns = unpack_head(data, pos)
        pos += head_size
        end = pos + name_len
        if end > n:
            raise _malformed(f"name at byte {pos} runs past the end")
        name = data[pos:end]
        pos = end
        if not name_len or b"/" in name or b"\0" in name or name in _DOTS:
            raise _malformed(f"it holds {_check_name(name)}")
        if name <= prev:
            what = "a duplicate" if name == prev else "an out-of-order"
            raise _malformed(f"{what} entry {name!r} after {prev!r}")
        prev = name
        kind = kinds.get(code)
        if kind is None or (code > 3 and code > last_code):
            raise _malformed(f"unknown kind code {code} for {name!r} in version {data[0]}")
        if mode > MODE_MASK:
            raise _malformed(f"mode {mode:#o} of {name!r} has bits outside 0o7777")
        if code == 3:
            if pos + 2 > n:
                raise _malformed(f"truncated symlink target length for {name!r}")
            tlen = (data[pos] << 8) | data[pos + 1]
            pos += 2
            end = pos + tlen
            if end > n:
                raise _malformed(f"symlink target of {name!r} runs past the end")
            target = data[pos:end]
            pos = end
            if not 0 < tlen <= TARGET_MAX or b"\0" in target:
                raise _malformed(f"symlink {name!r} has an invalid target {target[:64]!r}")
            if size != tlen:
                raise _malformed(f"symlink {name!r} has size {size}, not its target length {tlen}")
            out[name] = make(name, kind, mode, size, mtime_ns, None, target, data[start:pos])
        elif code >= _V2_CODE:
            newer = True
            if code == _LINKED_FILE:
                end = pos + OID_SIZE + 8
                if end > n:
                    raise _malformed(f"object id and link of {name!r} run past the end")
                oid = unchecked_oid(ObjectId, data[pos : pos + OID_SIZE])
                link = _U64.unpack_from(data, pos + OID_SIZE)[0]
                if not link:
                    raise _malformed(f"linked file {name!r} has link key 0")
                pos = end
                out[name] = make(name, kind, mode, size, mtime_ns, oid, None, data[start:pos],
                                 link=link)
                continue
            if size != 0:
                raise _malformed(f"{kind} {name!r} has size {size}, not 0")
            rdev = link = 0
            if kind in DEVICES:
                if pos + 8 > n:
                    raise _malformed(f"device number of {name!r} runs past the end")
                rdev = _U64.unpack_from(data, pos)[0]
                pos += 8
            if code > _LINKED_FILE:
                if pos + 8 > n:
                    raise _malformed(f"link of {name!r} runs past the end")
                link = _U64.unpack_from(data, pos)[0]
                pos += 8
                if not link:
                    raise _malformed(f"linked {kind} {name!r} has link key 0")
            out[name] = make(name, kind, mode, 0, mtime_ns, None, None, data[start:pos],
                             rdev=rdev, link=link)
        else:
            end = pos + OID_SIZE
            if end > n:
                raise _malformed(f"object id of {name!r} runs past the end")
            if code == 2 and size != 0:
                raise _malformed(f"directory {name!r} has size {size}, not 0")
            # The slice is exactly OID_SIZE long: no length check (`unchecked_oid`).
            oid = unchecked_oid(ObjectId, data[pos:end])
            out[name] = make(name, kind, mode, size, mtime_ns, oid, None, data[start:end])
            pos = end
    if data[0] == 2 and not newer:
        raise _malformed("version 2 without an entry that needs it (canonical is version 1)")
    return out


# --- reading, with a cache --------------------------------------------------------------------

_CACHE_SIZE = 4096
_CACHE_SLACK = 1024  # trees a snapshot may leave over _CACHE_SIZE for later calls to let go
_EVICT_PER_CALL = 8
_cache: OrderedDict[bytes, dict[bytes, Entry]] = OrderedDict()
_cache_lock = threading.Lock()
# The encoded bytes of trees built or read lately, by id, within a byte budget. Re-encoding a
# directory after a change then swaps its changed records into these bytes (`splice_records`)
# instead of joining every record: a record is an object of its own, and on a big tree most
# directories a step touches were last touched at the initial build, so joining them reads
# a hundred cold objects apiece (20-55 µs of a 10-file checkpoint on 100,000 files).
_PACKED_BUDGET = 16 * 1024 * 1024
_packed: BoundedMap[bytes, bytes] = BoundedMap(None, _PACKED_BUDGET)
# The last diffs (see diff_trees), each at most this many changes.
_DIFF_MEMO_SIZE = 4
_DIFF_MEMO_MAX_CHANGES = 200_000
_diffs: OrderedDict[tuple[ObjectId | None, ObjectId | None], tuple[Change, ...]] = OrderedDict()


def remember(
    oid: ObjectId,
    entries: dict[bytes, Entry],
    *,
    evict: bool = True,
    packed: bytes | None = None,
) -> None:
    """Remember the entries of a tree just written, so reading it back costs no decode.

    ``entries`` maps names to entries in name order and must be exactly what ``oid`` encodes; the
    cache keeps the dict itself, so the caller must not change it afterwards. ``packed``, the
    tree's bytes, is kept too (see `packed_bytes`) when given.

    Letting the oldest trees go frees their entries, memory untouched for long: a few µs per
    tree. ``evict=False`` (a snapshot's builds) leaves that to later calls, up to _CACHE_SLACK
    trees over the size; each later call lets go of up to _EVICT_PER_CALL of them."""
    with _cache_lock:
        _cache[oid] = entries
        if packed is not None:
            _packed.put(oid, packed, len(packed))
        over = len(_cache) - _CACHE_SIZE
        if over <= 0:
            return
        n = max(over - _CACHE_SLACK, min(over, _EVICT_PER_CALL if evict else 0))
        for _ in range(n):
            _cache.popitem(last=False)


def entries(store: ObjectReader, tree_id: ObjectId) -> dict[bytes, Entry]:
    """Entries of a tree by name, in name order. Cached by id: a tree's id fixes its bytes, so the
    cache can never go stale; the dict is shared, so callers must not change it."""
    with _cache_lock:
        hit = _cache.get(tree_id)
        if hit is not None:
            _cache.move_to_end(tree_id)
            return hit
    data = store.get(tree_id)
    found = _decode(data)
    remember(tree_id, found, packed=data)
    return found


def packed_bytes(tree_id: ObjectId) -> bytes | None:
    """The encoded bytes of a tree remembered lately (built, or read through `entries`), or
    None: what a caller holding the tree's entries splices a change into."""
    with _cache_lock:
        return _packed.get(tree_id)


# Internal callers, some of which hold a local named ``entries``.
_entries = entries


def read_tree(store: ObjectReader, tree_id: ObjectId) -> list[Entry]:
    """The entries of one tree, sorted by name."""
    return list(_entries(store, tree_id).values())


def clear_cache() -> None:
    """Forget cached trees (for benchmarks measuring cold reads)."""
    with _cache_lock:
        _cache.clear()
        _packed.clear()
        _diffs.clear()


def _join(prefix: bytes, name: bytes) -> bytes:
    return prefix + b"/" + name if prefix else name


def walk(
    store: ObjectReader, tree_id: ObjectId, prefix: bytes = b""
) -> Iterator[tuple[bytes, Entry]]:
    """Every entry under a tree, depth first (a directory before its contents), names in order."""
    stack = [(prefix, iter(_entries(store, tree_id).values()))]
    while stack:
        base, it = stack[-1]
        e = next(it, None)
        if e is None:
            stack.pop()
            continue
        path = _join(base, e.name)
        yield path, e
        if e.kind == DIR:
            # a file or directory entry has an oid (only a symlink's is None)
            stack.append((path, iter(_entries(store, e.oid).values())))  # type: ignore[arg-type]


def lookup(store: ObjectReader, tree_id: ObjectId, path: bytes) -> Entry | None:
    """The entry at a relative path (b"a/b/c"), or None when nothing is there."""
    parts = [p for p in path.split(b"/") if p]
    if not parts:
        return None
    tree = tree_id
    for i, part in enumerate(parts):
        e = _entries(store, tree).get(part)
        if e is None:
            return None
        if i == len(parts) - 1:
            return e
        if e.kind != DIR:
            return None
        # a file or directory entry has an oid (only a symlink's is None)
        tree = e.oid  # type: ignore[assignment]
    return None


def reachable(
    store: ObjectReader, tree_id: ObjectId, walked: set[ObjectId] | None = None
) -> set[ObjectId]:
    """The tree's own id and every tree, blob and chunks id beneath it.

    ``walked``: trees whose closure the caller already holds, updated with every tree this call
    walks. Their contents are left out, so the checkpoints of one big tree, which share all but
    a few sub-trees, cost the walk of what differs, not of the whole tree each."""
    walked = set() if walked is None else walked
    if tree_id in walked:
        return {tree_id}
    walked.add(tree_id)
    seen: set[ObjectId] = {tree_id}
    stack = [tree_id]
    while stack:
        for e in _entries(store, stack.pop()).values():
            oid = e.oid
            if oid is not None and oid not in seen:
                seen.add(oid)
                if e.kind == DIR and oid not in walked:
                    walked.add(oid)
                    stack.append(oid)
    return seen


# --- building from a directory ----------------------------------------------------------------


Listed = list[tuple[bytes, os.DirEntry[str], os.stat_result]]


class DirSignatures:
    """What a build with a stat cache of directories reads and leaves (`build_tree`'s
    ``signatures``): by directory path relative to the root, a digest of the directory's listing
    (each entry's name, inode, size, mtime, ctime, mode, link count and rdev, in the order the
    directory lists them) and the tree id built for it.

    A directory whose listing digests to its ``old`` signature, and whose sub-directories all
    come out as the trees recorded with theirs, *is* that tree: it is neither decoded, compared
    entry by entry nor stored again. A content write moves a file's ctime, which no writer can
    set back; a rename or an added entry changes the listing. ``new`` receives the signature of
    every directory built, but only of those all of whose entries are older than
    ``started_ns - RACY_NS`` (``started_ns``: this build's start, the reference of the next one;
    see `build_tree` on racily clean files). ``old`` must come from one build of the same
    directory, on the same file system (its device), and be kept as a whole."""

    def __init__(
        self,
        old: Mapping[bytes, tuple[bytes, ObjectId]],
        started_ns: int,
        new: dict[bytes, tuple[bytes, ObjectId]] | None = None,
        reused: int = 0,
        rebuilt: int = 0,
    ) -> None:
        self.old = old
        self.started_ns = started_ns
        self.new: dict[bytes, tuple[bytes, ObjectId]] = {} if new is None else new
        self.reused = reused  # directories taken from ``old`` as they were
        self.rebuilt = rebuilt  # directories built entry by entry

    def __repr__(self) -> str:
        return (
            f"DirSignatures(old={self.old!r}, started_ns={self.started_ns!r}, new={self.new!r}, "
            f"reused={self.reused!r}, rebuilt={self.rebuilt!r})"
        )


def _listing_digest(listed: Listed) -> bytes:
    # repr of ints and bytes is the same in every process (hash() is salted per process).
    rows = [
        (n, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_nlink,
         st.st_rdev)
        for n, _, st in listed
    ]  # fmt: skip
    return blake3(repr(rows).encode()).digest(length=16)


def build_tree(
    store: ObjectStore,
    path: str | bytes | os.PathLike[str] | os.PathLike[bytes],
    *,
    previous: ObjectId | None = None,
    previous_started_ns: int | None = None,
    on_skip: SkipCallback | None = None,
    exclude: Callable[[bytes], bool] | None = None,
    known: Mapping[bytes, FileIdentity] | None = None,
    seen: dict[bytes, FileIdentity] | None = None,
    progress: Progress | None = None,
    signatures: DirSignatures | None = None,
) -> ObjectId:
    """Store the directory at ``path`` and everything beneath it; return the root tree id.

    Symlinks are recorded, never followed; so are fifos, sockets and device nodes (as what they
    are), and hard links (`link_key`). Entries that vanish during the scan are skipped and
    reported to ``on_skip(relative_path, reason)``.

    With ``previous`` (a tree built earlier from the same directory), a regular file whose size,
    mtime_ns and mode equal the previous entry's, and whose ctime is older than the reference
    time, keeps that entry's object id without being read. The ctime is what a writer cannot set:
    rewriting a file and restoring its mtime with utime() moves the ctime to now. Like git's
    racily-clean rule, a file whose mtime or ctime is within RACY_NS of the reference time is
    always re-read: it could have been rewritten within the same timestamp tick right after the
    earlier build read it, leaving its stat unchanged. The reference is ``previous_started_ns``
    (``time.time_ns()`` taken just before the earlier build) when given, which makes the rule
    exact; otherwise it is this build's start, which covers back-to-back builds but not a
    same-size rewrite within one tick of an earlier build long ago.

    ``seen`` (a dict) receives each regular file's FileIdentity by relative path; given back as
    ``known`` to the next build with ``previous``, a file is trusted only if it is still the same
    inode with the same ctime: a directory moved in from elsewhere with old, equal stats is read.

    ``exclude(relative_path)`` returning True leaves that entry (and all beneath it) out, silently:
    for state that lives inside a tree but is not part of it (a tape dir inside a project).

    ``progress(entries_scanned, None)`` is told of every entry as the scan reaches it.

    ``signatures`` (see DirSignatures) takes unchanged directories whole from the last build
    with them: a warm build of a big tree costs its stat walk. The previous trees are then read
    only for directories that changed. When no directory changed (``signatures.rebuilt == 0``),
    ``seen`` is left empty: the identities are those of the build the signatures come from.
    """
    root = os.fsencode(path)
    ref = previous_started_ns if previous_started_ns is not None else time.time_ns()
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise TreeError(
            f"cannot read directory {os.fsdecode(root)!r} ({exc.strerror}); "
            "pass an existing, readable directory"
        ) from None
    if previous is not None or signatures is not None:
        # Unchanged directories keep the previous tree's objects without putting them again:
        # hold the store as a writer from before reading them, so gc cannot remove them.
        hold = getattr(store, "hold_shared", None)
        if hold is not None:
            hold()
    if signatures is not None and signatures.old:
        # A signature is trusted only with its tree still stored (gc takes unreferenced ones).
        oids = {oid for _, oid in signatures.old.values()}
        present = getattr(store, "present", None)
        kept = present(oids) if present is not None else {o for o in oids if _has(store, o)}
        if len(kept) != len(oids):
            signatures.old = {r: v for r, v in signatures.old.items() if v[1] in kept}
    try:
        builder = _Builder(root, store, ref - RACY_NS, on_skip, exclude, known, seen, progress)
        builder.sigs = signatures
        oid = builder.build(fd, b"", previous, 0)
    finally:
        os.close(fd)
    if signatures is not None and signatures.rebuilt and seen is not None:
        for rel, listed in builder.reused:
            for name, _, st in listed:
                if stat.S_ISREG(st.st_mode):
                    seen[_join(rel, name)] = (st.st_dev, st.st_ino, st.st_ctime_ns)
    return oid


def _has(store: ObjectReader, oid: ObjectId) -> bool:
    try:
        store.get(oid)
    except Exception:  # any store's "missing": the signature is not trusted
        return False
    return True


class _Builder:
    __slots__ = (
        "cutoff", "exclude", "known", "on_skip", "progress", "reused", "root", "scanned", "seen",
        "sigs", "store",
    )  # fmt: skip

    def __init__(
        self,
        root: bytes,
        store: ObjectStore,
        cutoff: int,
        on_skip: SkipCallback | None,
        exclude: Callable[[bytes], bool] | None = None,
        known: Mapping[bytes, FileIdentity] | None = None,
        seen: dict[bytes, FileIdentity] | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.root = root
        self.progress = progress
        self.scanned = 0
        self.store = store
        self.cutoff = cutoff
        self.on_skip = on_skip
        self.exclude = exclude
        self.known = known
        self.seen = seen
        self.sigs: DirSignatures | None = None
        # Directories taken whole from their signatures, with their entries' stats.
        self.reused: list[tuple[bytes, Listed]] = []

    def skip(self, rel: bytes, reason: str) -> None:
        if self.on_skip is not None:
            self.on_skip(rel, reason)

    def build(self, dfd: int, rel: bytes, previous: ObjectId | None, depth: int) -> ObjectId:
        if depth > MAX_DEPTH:
            shown = os.fsdecode(rel[:80]) + ("..." if len(rel) > 80 else "")
            raise TreeError(
                f"{os.fsdecode(self.root)!r} nests directories deeper than {MAX_DEPTH} levels "
                f"(at {shown!r}), more than a tree records: flatten it, or pick a directory "
                "inside it"
            )
        if self.sigs is not None:
            return self.build_signed(dfd, rel, previous, depth, self.sigs)
        prev = _entries(self.store, previous) if previous is not None else None
        entries: list[Entry] = []
        subs = [e.oid for e in prev.values() if e.kind == DIR] if prev is not None else []
        bulk = getattr(self.store, "prefetched", None) if len(subs) > 1 else None
        # The previous sub-trees' index entries in one query, not one each: a warm build of
        # 100,000 files in 1,100 directories spent 1.9 of its 13 s in those queries.
        with bulk(subs) if bulk is not None else contextlib.nullcontext(), os.scandir(dfd) as it:
            for de in it:
                name = de.name.encode(_FS_ENCODING, _FS_ERRORS)
                if self.exclude is not None and self.exclude(_join(rel, name)):
                    continue
                if self.progress is not None:
                    self.scanned += 1
                    self.progress(self.scanned, None)
                try:
                    e = self.entry(dfd, name, de, rel, prev, depth)
                except FileNotFoundError:
                    self.skip(_join(rel, name), "vanished during the scan")
                    continue
                if e is not None:
                    entries.append(e)
        entries.sort(key=attrgetter("name"))
        if (
            prev is not None
            and len(entries) == len(prev)
            and all(e is p or e == p for e, p in zip(entries, prev.values(), strict=True))
        ):
            # Nothing changed here (the usual case of a build with `previous`): the previous
            # tree as it is, neither packed nor hashed nor put again (see `build_tree` for why
            # it cannot be collected meanwhile).
            # unchanged entries mean previous is the tree id they were read from
            return previous  # type: ignore[return-value]
        data = pack_entries(entries)
        oid = self.store.put("tree", data)
        remember(oid, {e.name: e for e in entries}, packed=data)
        return oid

    def build_signed(
        self, dfd: int, rel: bytes, previous: ObjectId | None, depth: int, sigs: DirSignatures
    ) -> ObjectId:
        """`build` with a stat cache of directories (see DirSignatures)."""
        listed: Listed = []
        add = listed.append
        exclude = self.exclude
        prefix = rel + b"/" if rel else b""
        with os.scandir(dfd) as it:
            for de in it:
                name = de.name.encode(_FS_ENCODING, _FS_ERRORS)
                if exclude is not None and exclude(prefix + name):
                    continue
                try:
                    add((name, de, de.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    self.skip(prefix + name, "vanished during the scan")
        if self.progress is not None:  # once a directory: a call per entry shows in profiles
            self.scanned += len(listed)
            self.progress(self.scanned, None)
        sig = _listing_digest(listed)
        old = sigs.old.get(rel)
        same = old is not None and old[0] == sig
        prev: dict[bytes, Entry] | None = None
        subs: dict[bytes, ObjectId] = {}
        for name, _, st in listed:
            if not stat.S_ISDIR(st.st_mode):
                continue
            sub_rel = _join(rel, name)
            sub_old = sigs.old.get(sub_rel)
            if sub_old is not None:
                sub_prev: ObjectId | None = sub_old[1]
            else:
                if prev is None and previous is not None:
                    prev = _entries(self.store, previous)
                e = prev.get(name) if prev is not None else None
                sub_prev = e.oid if e is not None and e.kind == DIR else None
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                self.skip(sub_rel, "vanished during the scan")
                same = False
                continue
            try:
                subs[name] = oid = self.build(sub, sub_rel, sub_prev, depth + 1)
            finally:
                os.close(sub)
            same = same and sub_old is not None and sub_old[1] == oid
        if same:
            assert old is not None
            sigs.reused += 1
            sigs.new[rel] = old
            self.reused.append((rel, listed))
            return old[1]
        sigs.rebuilt += 1
        if prev is None and previous is not None:
            prev = _entries(self.store, previous)
        entries: list[Entry] = []
        for name, de, st in listed:
            if stat.S_ISDIR(st.st_mode):
                if name in subs:
                    entries.append(stat_entry(name, DIR, st, subs[name]))
                continue
            try:
                e = self.entry(dfd, name, de, rel, prev, depth)
            except FileNotFoundError:
                self.skip(_join(rel, name), "vanished during the scan")
                continue
            if e is not None:
                entries.append(e)
        entries.sort(key=attrgetter("name"))
        if (
            prev is not None
            and len(entries) == len(prev)
            and all(e is p or e == p for e, p in zip(entries, prev.values(), strict=True))
        ):
            # prev holds previous's entries, so previous is not None here.
            oid = previous  # type: ignore[assignment]
        else:
            data = pack_entries(entries)
            oid = self.store.put("tree", data)
            remember(oid, {e.name: e for e in entries}, packed=data)
        assert oid is not None
        cutoff = sigs.started_ns - RACY_NS
        if all(st.st_mtime_ns < cutoff and st.st_ctime_ns < cutoff for _, _, st in listed):
            sigs.new[rel] = (sig, oid)
        return oid

    def entry(
        self,
        dfd: int,
        name: bytes,
        de: os.DirEntry[str],
        rel: bytes,
        prev: dict[bytes, Entry] | None,
        depth: int,
    ) -> Entry | None:
        st = de.stat(follow_symlinks=False)
        fmt = stat.S_IFMT(st.st_mode)
        mode = st.st_mode & MODE_MASK
        if fmt == stat.S_IFREG:
            old = prev.get(name) if prev is not None else None
            if (
                old is not None
                and old.kind == FILE
                and old.size == st.st_size
                and old.mtime_ns == clamp_time_ns(st.st_mtime_ns)
                and old.mode == mode
                and old.link == (link_key(st) if st.st_nlink > 1 else 0)
                and st.st_mtime_ns < self.cutoff
                and st.st_ctime_ns < self.cutoff
            ):
                identity = (st.st_dev, st.st_ino, st.st_ctime_ns)
                path = _join(rel, name)
                if self.known is None or self.known.get(path) == identity:
                    if self.seen is not None:
                        self.seen[path] = identity
                    return old
            return self.file(dfd, name, rel)
        if fmt == stat.S_IFDIR:
            old = prev.get(name) if prev is not None else None
            sub_prev = old.oid if old is not None and old.kind == DIR else None
            sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                oid = self.build(sub, _join(rel, name), sub_prev, depth + 1)
            finally:
                os.close(sub)
            return stat_entry(name, DIR, st, oid)
        if fmt == stat.S_IFLNK:
            target = os.readlink(name, dir_fd=dfd)
            return stat_entry(name, SYMLINK, st, None, target)
        special = FMT_SPECIAL.get(fmt)
        if special is not None:
            return stat_entry(name, special, st, None)
        self.skip(_join(rel, name), f"file type {fmt:#o}")
        return None

    def file(self, dfd: int, name: bytes, rel: bytes) -> Entry | None:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):
                self.skip(_join(rel, name), "changed type during the scan")
                return None
            if isinstance(exc, FileNotFoundError):
                raise
            raise TreeError(
                f"cannot read {os.fsdecode(_join(rel, name))!r} ({exc.strerror}); "
                "make it readable or remove it"
            ) from None
        try:
            # Stat before reading: a write racing the read then leaves a newer mtime behind, so
            # the next build with `previous` re-reads the file instead of trusting a stale id.
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self.skip(_join(rel, name), "changed type during the scan")
                return None
            oid = self.store.put_file(fd)
        finally:
            os.close(fd)
        if self.seen is not None:
            self.seen[_join(rel, name)] = (st.st_dev, st.st_ino, st.st_ctime_ns)
        return stat_entry(name, FILE, st, oid)


# --- diff -------------------------------------------------------------------------------------


def _under(store: ObjectReader, e: Entry, path: bytes, status: str, out: list[Change]) -> None:
    if e.kind != DIR:
        return
    added = status == "added"
    # a file or directory entry has an oid (only a symlink's is None)
    for p, sub in walk(store, e.oid, path):  # type: ignore[arg-type]
        out.append(Change(p, status, None, sub) if added else Change(p, status, sub, None))


def diff_trees(store: ObjectReader, a: ObjectId | None, b: ObjectId | None) -> list[Change]:
    """What changed from tree ``a`` to tree ``b`` (None is the empty tree), sorted by path.

    Sub-trees with equal ids are skipped unread. An added or deleted directory is listed along with
    every path beneath it; so is the directory side of a ``type`` change. A directory whose
    contents changed appears only through its contents (plus ``mode`` if its bits changed).
    mtime-only differences are not changes.

    The last few results are remembered (trees never change under an id): a booth's commit asks
    for the same diff four times (summary, host hooks, the commit, the stat cache), which on
    50,000 changed files cost seconds each.
    """
    key = (a, b)
    with _cache_lock:
        hit = _diffs.get(key)
        if hit is not None:
            _diffs.move_to_end(key)
            return list(hit)
    out = _diff_trees(store, a, b)
    if len(out) <= _DIFF_MEMO_MAX_CHANGES:
        with _cache_lock:
            _diffs[key] = tuple(out)
            while len(_diffs) > _DIFF_MEMO_SIZE:
                _diffs.popitem(last=False)
    return out


def _uncached(oids: Iterable[ObjectId | None]) -> list[ObjectId]:
    with _cache_lock:
        return [o for o in oids if o is not None and o not in _cache]


def _diff_trees(store: ObjectReader, a: ObjectId | None, b: ObjectId | None) -> list[Change]:
    """Level by level, each level's unread trees looked up in the index in bulk (one query per
    500, not one each): the diff of a 50,000-file booth reads 1,100 trees on either side."""
    out: list[Change] = []
    level = [(b"", a, b)]
    bulk = getattr(store, "prefetched", None)
    while level:
        wanted = _uncached(t for _, ta, tb in level if ta != tb for t in (ta, tb)) if bulk else []
        deeper: list[tuple[bytes, ObjectId | None, ObjectId | None]] = []
        with bulk(wanted) if bulk is not None and len(wanted) > 1 else contextlib.nullcontext():
            for prefix, ta, tb in level:
                _diff_level(store, prefix, ta, tb, out, deeper)
        level = deeper
    out.sort(key=attrgetter("path"))
    return out


def _diff_level(
    store: ObjectReader,
    prefix: bytes,
    ta: ObjectId | None,
    tb: ObjectId | None,
    out: list[Change],
    stack: list[tuple[bytes, ObjectId | None, ObjectId | None]],
) -> None:
    """The changes between trees ``ta`` and ``tb`` at ``prefix`` into ``out``; the pairs of
    differing sub-trees onto ``stack``."""
    if ta == tb:
        return
    old_entries = _entries(store, ta) if ta is not None else {}
    new_entries = _entries(store, tb) if tb is not None else {}
    for name, old in old_entries.items():
        new = new_entries.get(name)
        path = _join(prefix, name)
        if new is None:
            out.append(Change(path, "deleted", old, None))
            _under(store, old, path, "deleted", out)
        elif old.kind != new.kind:
            out.append(Change(path, "type", old, new))
            _under(store, old, path, "deleted", out)
            _under(store, new, path, "added", out)
        elif old.kind == DIR:
            if old.mode != new.mode:
                out.append(Change(path, "mode", old, new))
            if old.oid != new.oid:
                stack.append((path, old.oid, new.oid))
        elif old.oid != new.oid or old.target != new.target or old.rdev != new.rdev:
            out.append(Change(path, "modified", old, new))
        elif old.link != new.link:
            out.append(Change(path, "link", old, new))
        elif old.mode != new.mode:
            out.append(Change(path, "mode", old, new))
    for name, new in new_entries.items():
        if name not in old_entries:
            path = _join(prefix, name)
            out.append(Change(path, "added", None, new))
            _under(store, new, path, "added", out)


# --- materialize ------------------------------------------------------------------------------


def materialize(
    store: ObjectReader,
    tree_id: ObjectId,
    dest: str | bytes | os.PathLike[str] | os.PathLike[bytes],
) -> None:
    """Recreate a tree in ``dest``, which must be absent or an empty directory.

    Every write goes through a directory fd with O_NOFOLLOW/O_EXCL, and names are validated when
    the tree is decoded, so a hostile tree cannot place anything outside ``dest``. Modes and mtimes
    are restored; a directory's are set after its contents. ``dest`` itself keeps its own. Hard
    links are made again; device nodes need CAP_MKNOD. On error ``dest`` is left partly filled;
    remove it.
    """
    root = os.fsencode(dest)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if os.listdir(fd):
            raise TreeError(
                f"cannot materialize into {os.fsdecode(root)!r}: it is not empty; "
                "pass an empty or absent directory"
            )
        _fill(store, tree_id, fd, 0, _Linker(fd))
    finally:
        os.close(fd)


class _Linker:
    """Where the first name of each hard-link group went, to link the others to it."""

    __slots__ = ("first", "root_fd")

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.first: dict[int, bytes] = {}

    def link(self, e: Entry, dfd: int, rel: bytes) -> bool:
        """Link ``e`` to its group's first name, if one was made; else remember ``rel`` as it."""
        first = self.first.get(e.link)
        if first is None:
            self.first[e.link] = rel
            return False
        os.link(first, e.name, src_dir_fd=self.root_fd, dst_dir_fd=dfd, follow_symlinks=False)
        return True


def _fill(
    store: ObjectReader, tree_id: ObjectId, dfd: int, depth: int, linker: _Linker, rel: bytes = b""
) -> None:
    if depth > MAX_DEPTH:
        raise TreeError(f"tree {tree_id} nests deeper than {MAX_DEPTH} levels; refusing it")
    for e in _entries(store, tree_id).values():
        name = e.name
        times = (e.mtime_ns, e.mtime_ns)
        if e.link and linker.link(e, dfd, _join(rel, name)):
            continue
        if e.kind == FILE:
            fd = os.open(name, _CREATE_FLAGS, 0o600, dir_fd=dfd)
            with open(fd, "wb", closefd=True) as f:
                # a file or directory entry has an oid (only a symlink's is None)
                store.read_file_into(e.oid, f)  # type: ignore[arg-type]
                f.flush()
                # After the data: a write by a non-root owner would clear setuid/setgid bits.
                os.fchmod(fd, e.mode)
                os.utime(fd, ns=times)
        elif e.kind == DIR:
            os.mkdir(name, 0o700, dir_fd=dfd)
            sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                # a file or directory entry has an oid (only a symlink's is None)
                _fill(store, e.oid, sub, depth + 1, linker, _join(rel, name))  # type: ignore[arg-type]
                # After the contents: creating them would bump the mtime, and a read-only mode
                # would forbid creating them.
                os.fchmod(sub, e.mode)
                os.utime(sub, ns=times)
            finally:
                os.close(sub)
        elif e.kind == SYMLINK:
            # a symlink always has a target (Entry.target is None for the other kinds)
            os.symlink(e.target, name, dir_fd=dfd)  # type: ignore[arg-type]
            os.utime(name, ns=times, dir_fd=dfd, follow_symlinks=False)
        else:
            make_special(e, name, dfd)
            os.utime(name, ns=times, dir_fd=dfd, follow_symlinks=False)


def make_special(e: Entry, name: bytes, dfd: int) -> None:
    """Create the fifo, socket or device node of entry ``e`` as ``name`` in ``dfd``, with its mode.

    A socket is made as an inode with nothing listening on it (connecting is refused until a
    server binds a new one), as the kernel overlay's copy-up makes it; a device needs
    CAP_MKNOD."""
    fmt = SPECIAL_FMT[e.kind]
    os.mknod(name, fmt | 0o600, e.rdev, dir_fd=dfd)
    # mknod's mode passes through the umask. The mode is set through an O_PATH fd of what was
    # just made, never by name: a name swapped for a symlink meanwhile would redirect a chmod.
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        if stat.S_IFMT(os.fstat(fd).st_mode) != fmt:
            raise TreeError(f"{e.kind} {e.name!r} was replaced while it was made; try again")
        os.chmod(f"/proc/self/fd/{fd}", e.mode)
    finally:
        os.close(fd)
