"""The tree a run starts from, built with the previous build of the same path as a stat cache.

A file whose size, mtime and mode match the previous base tree, whose ctime is older than that
build, and which is still the same inode (dev, inode and ctime as that build recorded them)
keeps its object id unread (``build_tree(previous=, previous_started_ns=, known=)``; racily-clean
files are re-read), so a second run over an unchanged big tree costs a stat walk, not a read of
every file. The previous tree id and the time its build started live in the tape dir's state
(``base-trees.json``), per tree path, for booths and Python transactions alike; the file
identities in ``base-tree-stats/<hash of the tree path>``, one record per regular file::

    file    := magic "JBXSTAT2" tree:oid[32] record*     the tree these identities were built with
    record  := path_len:u16 dev:u64 ino:u64 ctime_ns:i64 path[path_len]     (big-endian)

A commit drops the records of the paths it touched (``forget_base_paths``). Anything unreadable
is an empty cache: the next build reads every file.

The directories' signatures (shadowfs.tree.DirSignatures) live in ``base-tree-dirs/<same
name>``, one record per directory whose listing was not racily clean::

    file    := magic "JBXDIRS1" tree:oid[32] dev:u64 record*     the build's tree and device
    record  := path_len:u16 sig[16] tree:oid[32] path[path_len]     (big-endian)

An unchanged directory is then taken whole, unread: a warm build of an unchanged tree is its
stat walk, and the identities above are read only when some directory changed.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from blake3 import blake3

from jukebox.tape.tapedir import TapeDir
from shadowfs.oid import ObjectId
from shadowfs.privacy import make_private_dirs

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

    from shadowfs.objects import ObjectReader, ObjectStore

_STATS_MAGIC = b"JBXSTAT2"
_RECORD = struct.Struct(">HQQq")
_DIRS_MAGIC = b"JBXDIRS1"
_DIRS_HEAD = struct.Struct(">32sQ")
_DIR_RECORD = struct.Struct(">H16s32s")
FileIdentity = tuple[int, int, int]


def _cache_path(tape_dir: TapeDir) -> Path:
    return tape_dir.state / "base-trees.json"


def _read(tape_dir: TapeDir) -> dict[str, Any]:
    try:
        known = json.loads(_cache_path(tape_dir).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        # A cache: losing it (or a race between two runs) costs one full read, nothing more.
        make_private_dirs(path.parent)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)


def _write(tape_dir: TapeDir, known: dict[str, Any]) -> None:
    _replace(_cache_path(tape_dir), json.dumps(known, sort_keys=True).encode())


def _stats_path(tape_dir: TapeDir, tree_path: str) -> Path:
    # Named from the tree path, never from the JSON: a received tape dir names no file here.
    return tape_dir.state / "base-tree-stats" / blake3(os.fsencode(tree_path)).hexdigest()[:32]


def _read_stats(tape_dir: TapeDir, tree_path: str) -> tuple[bytes, dict[bytes, FileIdentity]]:
    """(the tree id the identities go with, the identities by path); (b"", {}) if unreadable."""
    try:
        data = _stats_path(tape_dir, tree_path).read_bytes()
    except OSError:
        return b"", {}
    head = len(_STATS_MAGIC) + 32
    if not data.startswith(_STATS_MAGIC) or len(data) < head:
        return b"", {}
    stats: dict[bytes, FileIdentity] = {}
    at, end = head, len(data)
    unpack, size = _RECORD.unpack_from, _RECORD.size
    try:
        while at < end:
            n, dev, ino, ctime = unpack(data, at)
            at += size + n
            if at > end:
                return b"", {}
            stats[data[at - n : at]] = (dev, ino, ctime)
    except struct.error:
        return b"", {}
    return data[len(_STATS_MAGIC) : head], stats


def _identities(tape_dir: TapeDir, tree_path: str, tree: ObjectId) -> dict[bytes, FileIdentity]:
    """The identities recorded with ``tree``: none when the file goes with another build (two
    runs racing over base-trees.json and this file), so that no file is trusted on a mismatch."""
    built_with, stats = _read_stats(tape_dir, tree_path)
    return stats if built_with == tree else {}


def _write_stats(
    tape_dir: TapeDir, tree_path: str, tree: bytes, stats: dict[bytes, FileIdentity]
) -> None:
    pack = _RECORD.pack
    records = b"".join(pack(len(p), *ident) + p for p, ident in stats.items())
    _replace(_stats_path(tape_dir, tree_path), _STATS_MAGIC + bytes(tree) + records)


class _Identities(Mapping[bytes, FileIdentity]):
    """The identities recorded with a tree, read on first use: a build whose directories all
    match their signatures never asks (100,000 records are a good part of a warm build)."""

    def __init__(self, tape_dir: TapeDir, tree_path: str, tree: ObjectId) -> None:
        self._args = (tape_dir, tree_path, tree)
        self._loaded: dict[bytes, FileIdentity] | None = None

    def load(self) -> dict[bytes, FileIdentity]:
        if self._loaded is None:
            self._loaded = _identities(*self._args)
        return self._loaded

    def __getitem__(self, path: bytes) -> FileIdentity:
        return self.load()[path]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.load())

    def __len__(self) -> int:
        return len(self.load())


def _dirs_path(tape_dir: TapeDir, tree_path: str) -> Path:
    return tape_dir.state / "base-tree-dirs" / _stats_path(tape_dir, tree_path).name


def _read_dirs(
    tape_dir: TapeDir, tree_path: str, tree: ObjectId, dev: int
) -> dict[bytes, tuple[bytes, ObjectId]]:
    """The signatures recorded with ``tree`` on device ``dev``; none on any mismatch."""
    try:
        data = _dirs_path(tape_dir, tree_path).read_bytes()
    except OSError:
        return {}
    at = len(_DIRS_MAGIC) + _DIRS_HEAD.size
    if not data.startswith(_DIRS_MAGIC) or len(data) < at:
        return {}
    built_with, built_dev = _DIRS_HEAD.unpack_from(data, len(_DIRS_MAGIC))
    if built_with != bytes(tree) or built_dev != dev:
        return {}
    out: dict[bytes, tuple[bytes, ObjectId]] = {}
    unpack, size, end = _DIR_RECORD.unpack_from, _DIR_RECORD.size, len(data)
    try:
        while at < end:
            n, sig, oid = unpack(data, at)
            at += size + n
            if at > end:
                return {}
            out[data[at - n : at]] = (sig, ObjectId(oid))
    except struct.error:
        return {}
    return out


def _write_dirs(
    tape_dir: TapeDir, tree_path: str, tree: ObjectId, dev: int,
    sigs: dict[bytes, tuple[bytes, ObjectId]],
) -> None:  # fmt: skip
    pack = _DIR_RECORD.pack
    records = b"".join(pack(len(p), sig, bytes(oid)) + p for p, (sig, oid) in sigs.items())
    head = _DIRS_MAGIC + _DIRS_HEAD.pack(bytes(tree), dev)
    _replace(_dirs_path(tape_dir, tree_path), head + records)


def build_base_tree(
    store: ObjectStore,
    tape_dir: TapeDir,
    tree_path: str,
    *,
    exclude: Callable[[bytes], bool] | None = None,
) -> ObjectId:
    """The tree id of ``tree_path`` now, reusing the last build of the same path."""
    from jukebox.display.progress import step
    from shadowfs.errors import StoreError
    from shadowfs.tree import DirSignatures, build_tree

    known = _read(tape_dir)
    prev = known.get(tree_path)
    previous = started = None
    if isinstance(prev, dict):
        with contextlib.suppress(TypeError, ValueError, KeyError):
            previous = ObjectId.from_hex(prev["tree"])
            started = int(prev["started_ns"])
    began = time.time_ns()
    try:
        dev = os.stat(tree_path).st_dev
    except OSError:
        dev = -1  # build_tree says what is wrong with the path
    tree = None
    seen: dict[bytes, FileIdentity] = {}
    trusted: _Identities | None = None
    sigs = DirSignatures({}, began)
    with step("hashing the tree", "entries", done="hashed the tree") as tick:
        if previous is not None and started is not None and store.has(previous):
            # gc may have taken sub-trees of an unreferenced previous tree: then build afresh.
            trusted = _Identities(tape_dir, tree_path, previous)
            sigs = DirSignatures(_read_dirs(tape_dir, tree_path, previous, dev), began)
            with contextlib.suppress(StoreError):
                tree = build_tree(
                    store,
                    tree_path,
                    previous=previous,
                    previous_started_ns=started,
                    exclude=exclude,
                    progress=tick,
                    known=trusted,
                    seen=seen,
                    signatures=sigs,
                )
        if tree is None:
            seen.clear()
            trusted = None
            sigs = DirSignatures({}, began)
            tree = build_tree(
                store, tree_path, exclude=exclude, seen=seen, progress=tick, signatures=sigs
            )
    unchanged = tree == previous and trusted is not None
    # unchanged implies trusted is not None
    if not (unchanged and sigs.rebuilt == 0) and not (unchanged and seen == trusted.load()):  # type: ignore[union-attr]
        # An unchanged tree leaves the file as it is: 100,000 records are not worth rewriting.
        _write_stats(tape_dir, tree_path, tree, seen)
    if sigs.new != sigs.old and dev >= 0:
        _write_dirs(tape_dir, tree_path, tree, dev, sigs.new)
    if unchanged and sigs.rebuilt == 0 and sigs.new == sigs.old:
        # Every directory was taken whole from its signature, and a signature is recorded only
        # for a directory none of whose entries was racily clean: the later start time would
        # let the next build trust no file it cannot trust now. The record stays as it is (an
        # older reference only ever trusts fewer files), and the file is not rewritten.
        return tree
    known[tree_path] = {"tree": tree.hex(), "started_ns": began}
    _write(tape_dir, known)
    return tree


Stats = tuple[bytes, dict[bytes, FileIdentity]]
"""What `read_stats` gives: the tree the identities were built with, the identities by path."""


def read_stats(tape_dir: TapeDir, tree_path: str) -> Stats:
    """The identities recorded for ``tree_path``, read once for a commit's `known_files` and its
    `forget_committed` (50,000 records: about 0.03 s each time they are read)."""
    return _read_stats(tape_dir, tree_path)


def known_files(
    tape_dir: TapeDir, tree_path: str, tree: ObjectId, stats: Stats | None = None
) -> dict[bytes, FileIdentity]:
    """The files the last build of ``tree_path`` read whole into ``tree`` (it must be that
    build's tree), with their identities then, leaving out those racily clean at the build
    (a ctime within the tree's racy window of the build's start, shadowfs.tree.racy_window): a
    commit from ``tree`` trusts these unread (shadowfs.commit.apply's ``known``). ``stats``:
    what `read_stats` gave, or None to read them here."""
    from shadowfs.tree import RacyWindow, racy_window

    prev = _read(tape_dir).get(tree_path)
    try:
        # prev None raises TypeError, caught below as an unusable record
        started = int(prev["started_ns"])  # type: ignore[index]
    except (TypeError, ValueError, KeyError):
        return {}
    built_with, identities = stats if stats is not None else _read_stats(tape_dir, tree_path)
    if built_with != tree:  # another build's: no file is trusted on a mismatch
        return {}
    try:
        fd = os.open(tree_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        window = RacyWindow()  # RACY_NS for all; the commit says what is wrong with the tree
    else:
        try:
            window = racy_window(fd)
        finally:
            os.close(fd)
    racy_ns = window.racy_ns
    return {
        p: ident
        for p, ident in identities.items()
        if ident[2] < started - racy_ns(ident[0], ident[2])
    }


def forget_base_paths(
    tape_dir: TapeDir, tree_path: str, touched: Iterable[bytes], stats: Stats | None = None
) -> None:
    """Drop the cached identities of ``touched`` paths of ``tree_path`` and of everything beneath
    them (a commit just rewrote them): the next build reads those files, and trusts the rest.
    ``stats``: what `read_stats` gave before the commit (a commit writes no record), or None
    to read them here."""
    tree, records = stats if stats is not None else _read_stats(tape_dir, tree_path)
    gone = set(touched)
    if not records or not gone:
        return
    # Only a gone path that is the directory of some record has records beneath it, and most
    # of a commit's paths are files: the records' directories (and theirs) are gathered once,
    # and the sort and bisections are left to the few gone directories. The paths beneath one
    # sort right after it, between it + "/" and it + "0" ("/" is 0x2F, "0" 0x30).
    dirs: set[bytes] = set()
    for parent in {path.rpartition(b"/")[0] for path in records}:
        while parent and parent not in dirs:
            dirs.add(parent)
            parent = parent.rpartition(b"/")[0]
    drop = gone
    gone_dirs = gone.intersection(dirs)
    if gone_dirs:
        paths = sorted(records)
        for g in gone_dirs:
            lo = bisect.bisect_left(paths, g + b"/")
            hi = bisect.bisect_left(paths, g + b"0", lo)
            drop.update(paths[lo:hi])
    kept = {path: ident for path, ident in records.items() if path not in drop}
    if len(kept) != len(records):
        _write_stats(tape_dir, tree_path, tree, kept)


def forget_committed(
    tape_dir: TapeDir,
    tree_path: str,
    store: ObjectReader,
    base: ObjectId,
    final: ObjectId,
    stats: Stats | None = None,
) -> None:
    """``forget_base_paths`` for every path a commit from ``base`` to ``final`` touched."""
    from shadowfs.tree import diff_trees

    if base != final:
        touched = (c.path for c in diff_trees(store, base, final))
        forget_base_paths(tape_dir, tree_path, touched, stats)
