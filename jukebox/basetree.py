"""The tree a run starts from, built with the previous build of the same path as a stat cache.

A file whose size, mtime and mode match the previous base tree keeps its object id unread
(``build_tree(previous=, previous_started_ns=)``; racily-clean files are re-read), so a second run
over an unchanged big tree costs a stat walk, not a read of every file. The previous tree id and
the time its build started live in the tape dir's state, per tree path, for booths and Python
transactions alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jukebox.tapedir import TapeDir
from shadowfs.oid import ObjectId


def _cache_path(tape_dir: TapeDir) -> Path:
    return tape_dir.state / "base-trees.json"


def _read(tape_dir: TapeDir) -> dict[str, Any]:
    try:
        known = json.loads(_cache_path(tape_dir).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write(tape_dir: TapeDir, known: dict[str, Any]) -> None:
    path = _cache_path(tape_dir)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        # A cache: losing it (or a race between two runs) costs one full read, nothing more.
        tape_dir.private_dir()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "w") as f:
            f.write(json.dumps(known, sort_keys=True))
        os.replace(tmp, path)


def build_base_tree(
    store: Any,
    tape_dir: TapeDir,
    tree_path: str,
    *,
    exclude: Callable[[bytes], bool] | None = None,
) -> ObjectId:
    """The tree id of ``tree_path`` now, reusing the last build of the same path."""
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
    if previous is not None and started is not None and store.has(previous):
        # gc may have taken sub-trees of an unreferenced previous tree: then build afresh.
        with contextlib.suppress(StoreError):
            tree = build_tree(
                store, tree_path, previous=previous, previous_started_ns=started, exclude=exclude
            )
    if tree is None:
        tree = build_tree(store, tree_path, exclude=exclude)
    known[tree_path] = {"tree": tree.hex(), "started_ns": began}
    _write(tape_dir, known)
    return tree


def forget_base_tree(tape_dir: TapeDir, tree_path: str) -> None:
    """Drop the cached build of ``tree_path`` (its files were just rewritten by a commit)."""
    known = _read(tape_dir)
    if known.pop(tree_path, None) is not None:
        _write(tape_dir, known)
