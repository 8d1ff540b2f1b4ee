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
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from blake3 import blake3

from jukebox.tapedir import TapeDir
from shadowfs.oid import ObjectId
from shadowfs.privacy import make_private_dirs

_STATS_MAGIC = b"JBXSTAT2"
_RECORD = struct.Struct(">HQQq")
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


def build_base_tree(
    store: Any,
    tape_dir: TapeDir,
    tree_path: str,
    *,
    exclude: Callable[[bytes], bool] | None = None,
) -> ObjectId:
    """The tree id of ``tree_path`` now, reusing the last build of the same path."""
    from jukebox.progress import step
    from shadowfs.errors import StoreError
    from shadowfs.tree import build_tree

    known = _read(tape_dir)
    prev = known.get(tree_path)
    previous = started = None
    if isinstance(prev, dict):
        with contextlib.suppress(TypeError, ValueError, KeyError):
            previous = ObjectId.from_hex(prev["tree"])
            started = int(prev["started_ns"])
    began = time.time_ns()
    tree = None
    seen: dict[bytes, FileIdentity] = {}
    trusted: dict[bytes, FileIdentity] = {}
    with step("hashing the tree", "entries", done="hashed the tree") as tick:
        if previous is not None and started is not None and store.has(previous):
            # gc may have taken sub-trees of an unreferenced previous tree: then build afresh.
            trusted = _identities(tape_dir, tree_path, previous)
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
                )
        if tree is None:
            seen.clear()
            tree = build_tree(store, tree_path, exclude=exclude, seen=seen, progress=tick)
    if tree != previous or seen != trusted:
        # An unchanged tree leaves the file as it is: 100,000 records are not worth rewriting.
        _write_stats(tape_dir, tree_path, tree, seen)
    known[tree_path] = {"tree": tree.hex(), "started_ns": began}
    _write(tape_dir, known)
    return tree


def known_files(tape_dir: TapeDir, tree_path: str, tree: ObjectId) -> dict[bytes, FileIdentity]:
    """The files the last build of ``tree_path`` read whole into ``tree`` (it must be that
    build's tree), with their identities then, leaving out those racily clean at the build: a
    commit from ``tree`` trusts these unread (shadowfs.commit.apply's ``known``)."""
    from shadowfs.tree import RACY_NS

    prev = _read(tape_dir).get(tree_path)
    try:
        cutoff = int(prev["started_ns"]) - RACY_NS  # type: ignore[index]
    except (TypeError, ValueError, KeyError):
        return {}
    return {p: ident for p, ident in _identities(tape_dir, tree_path, tree).items()
            if ident[2] < cutoff}  # fmt: skip


def forget_base_paths(tape_dir: TapeDir, tree_path: str, touched: Iterable[bytes]) -> None:
    """Drop the cached identities of ``touched`` paths of ``tree_path`` and of everything beneath
    them (a commit just rewrote them): the next build reads those files, and trusts the rest."""
    tree, stats = _read_stats(tape_dir, tree_path)
    gone = set(touched)
    if not stats or not gone:
        return
    kept = {
        path: ident
        for path, ident in stats.items()
        if not any(path[:i] in gone for i in _prefix_ends(path))
    }
    if len(kept) != len(stats):
        _write_stats(tape_dir, tree_path, tree, kept)


def forget_committed(
    tape_dir: TapeDir, tree_path: str, store: Any, base: ObjectId, final: ObjectId
) -> None:
    """``forget_base_paths`` for every path a commit from ``base`` to ``final`` touched."""
    from shadowfs.tree import diff_trees

    if base != final:
        forget_base_paths(tape_dir, tree_path, (c.path for c in diff_trees(store, base, final)))


def _prefix_ends(path: bytes) -> list[int]:
    """Where each of ``path``'s ancestors and itself ends: b"a/b/c" -> [1, 3, 5]."""
    ends = [i for i, byte in enumerate(path) if byte == 0x2F]
    return [*ends, len(path)]
