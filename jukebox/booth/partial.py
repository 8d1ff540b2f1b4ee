"""`jukebox booth commit ID --only PATH...`: commit part of a pending booth, keep the rest.

A partial commit applies, of the booth's changes, only those at or under the given paths: the
tree it applies is the booth's base with those paths grafted from its target (its final state or
checkpoint `--at`), shadowfs.graft. It goes through the same commit as a whole one: the same
conflict check on the paths it touches, the same hook-like-files check, journal, lock and
recovery.

What it did is recorded on the booth's tape, never only in the booth's record (a plain file
outside the hash chain, jukebox.booth.record_binding): a `note` frame with `event: partial_commit`,
`paths`, `changes`, `by`, `peer` and `committed_tree`, the tree the real tree now holds for the
booth, referenced by the frame's `refs` so that gc keeps it. From then on the booth's base is
that tree: `booth diff`, `export` and the next `commit` show and apply only what is still
pending. The booth stays pending until a commit takes what is left (a partial commit that
selects everything left is a whole commit, with its `commit` verdict) or it is discarded,
which leaves the committed part in place.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jukebox.errors import UsageError
from shadowfs.oid import ObjectId

if TYPE_CHECKING:
    from shadowfs.objects import ObjectStore

PARTIAL_EVENT = "partial_commit"


def partial_base(tape_path: str, base_tree: str) -> ObjectId:
    """The booth's base: the tree its last partial commit left in the real tree, else the tree
    it started from."""
    from jukebox.tape.tape import Tape

    base = base_tree
    for frame in Tape.load(tape_path).frames:
        if frame.kind == "note" and frame.payload.get("event") == PARTIAL_EVENT:
            committed = frame.payload.get("committed_tree")
            if isinstance(committed, str) and bytes.fromhex(committed) in frame.refs:
                base = committed
    return ObjectId.from_hex(base)


def tree_paths(paths: Sequence[str], tree_root: str, cwd: str | None = None) -> list[bytes]:
    """``paths`` as the tree's relative paths: an absolute path must lie in the tree; a relative
    one is taken from the current directory when that is inside the tree (as git does), else
    from the tree's root."""
    root = os.path.realpath(tree_root)
    here = os.path.realpath(cwd if cwd is not None else os.getcwd())
    inside = here == root or here.startswith(root + os.sep)
    out = []
    for given in paths:
        if not given.strip("/"):
            raise UsageError(f"--only {given!r} names no path: give a file or a directory")
        if os.path.isabs(given):
            full = os.path.normpath(given)
        else:
            full = os.path.normpath(os.path.join(here if inside else root, given))
        relative = os.path.relpath(full, root)
        if relative == os.curdir or relative.split(os.sep)[0] == os.pardir:
            raise UsageError(
                f"--only {given!r} is not a path inside the booth's tree {tree_root}: give "
                "paths from its root, like src/main.py"
            )
        out.append(os.fsencode(relative))
    return out


def select(
    store: ObjectStore, booth_id: str, base: ObjectId, target: ObjectId, paths: list[bytes]
) -> tuple[ObjectId, bool]:
    """(the tree a commit of only ``paths`` applies, whether that is all of the booth's
    pending changes). A path at or under which the booth changes nothing is refused."""
    from jukebox.display.names import visible
    from shadowfs.graft import graft
    from shadowfs.tree import diff_trees

    changed = [c.path for c in diff_trees(store, base, target)]
    for path in paths:
        if not any(p == path or p.startswith(path + b"/") for p in changed):
            raise UsageError(
                f"booth {booth_id} changes nothing at {visible(path)}: see what it changes with "
                f"`jukebox booth diff {booth_id}`"
            )
    partial = graft(store, base, target, paths)
    # Durable before the commit's intent names it: recovery of a killed commit writes a frame
    # that references it, and a frame never names an object that did not reach the disk.
    store.flush()
    return partial, partial == target


def partial_note(commit: dict[str, Any], paths: list[str], tree: ObjectId) -> dict[str, Any]:
    """The payload of the `note` a partial commit writes, from the ``commit`` payload a whole
    one would have (`ok`, `changes`, `by`, `peer`, `checkpoint`)."""
    return {**commit, "event": PARTIAL_EVENT, "paths": paths, "committed_tree": tree.hex()}
