"""What in a store is still needed: everything tapes and pending booths reference.

gc keeps the closure of these roots; trees are expanded through shadowfs.tree, chunks and delta
bases are the store's own business.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection

from jukebox.tape.tapedir import TapeDir
from shadowfs.oid import ObjectId


def live_objects(
    tape_dir: TapeDir,
    store,
    progress: Callable[[int, int], None] | None = None,
    *,
    excluding: Collection[str] = (),
) -> set[ObjectId]:
    """``excluding``: names of tapes to count as gone (what a dry-run removal would free)."""
    from jukebox.tape.tape import Tape
    from shadowfs import tree

    live: set[ObjectId] = set()
    walked: set[ObjectId] = set()  # trees whose whole closure is in `live`

    def add_tree(oid: ObjectId) -> None:
        if oid not in walked and store.has(oid):
            live.update(tree.reachable(store, oid, walked))

    paths = [p for p in tape_dir.tape_paths() if p.name not in excluding]
    for done, path in enumerate(paths, 1):
        tape = Tape.load(path, store)
        for frame in tape.frames:
            for oid in frame.refs:
                live.add(oid)
                if store.has(oid) and store.kind(oid) == "tree":
                    add_tree(oid)
        if progress:
            progress(done, len(paths))
    if tape_dir.booths_path.is_dir():
        for record in tape_dir.booths_path.glob("*.json"):
            data = json.loads(record.read_text())
            for key in ("base_tree", "final_tree", "tree"):
                value = data.get(key)
                if isinstance(value, str) and len(value) == 64:
                    oid = ObjectId.from_hex(value)
                    live.add(oid)
                    add_tree(oid)
    return live
