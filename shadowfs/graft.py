"""A tree made of one tree with some paths taken from another: what a partial commit applies.

`graft(store, base, source, paths)` is ``base`` except at each of ``paths``, where it holds
exactly what ``source`` holds there: the entry with everything beneath it, or nothing when
``source`` has nothing there. Directories on the way to a path that ``base`` lacks are made as
``source`` has them (mode and time), holding only what was taken. Only the directories on the
way are re-encoded; everything else is shared with ``base`` by id.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from shadowfs import tree
from shadowfs.errors import ShadowfsError
from shadowfs.oid import ObjectId

if TYPE_CHECKING:
    from shadowfs.objects import ObjectStore

_WHOLE: dict[bytes, Any] = {}  # a trie leaf: the path is taken whole


class GraftError(ShadowfsError):
    """A path whose parent is not a directory on one side: it cannot be taken on its own."""

    def __init__(self, parent: bytes, path: bytes) -> None:
        shown = parent.decode("utf-8", "backslashreplace")
        super().__init__(
            f"{path.decode('utf-8', 'backslashreplace')} cannot be taken alone: {shown} is not "
            f"a directory on both sides (its type changed); take {shown} itself"
        )
        self.parent = parent


def _trie(paths: Iterable[bytes]) -> dict[bytes, Any]:
    root: dict[bytes, Any] = {}
    for path in sorted(set(paths), key=lambda p: p.count(b"/")):  # ancestors first
        parts = [p for p in path.split(b"/") if p]
        if not parts:
            raise ValueError("an empty path cannot be grafted")
        node = root
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if child is _WHOLE:
                break  # an ancestor is taken whole already
            node = child
        else:
            node[parts[-1]] = _WHOLE
    return root


def graft(store: ObjectStore, base: ObjectId, source: ObjectId, paths: Iterable[bytes]) -> ObjectId:
    """The id of ``base`` with ``paths`` (relative, `/`-separated) as in ``source``; the trees
    it makes are put in ``store``. Raises GraftError when a path's parent is a directory on
    one side only."""
    return _graft(store, base, source, _trie(paths), b"")


def _graft(
    store: ObjectStore, base: ObjectId | None, source: ObjectId | None, trie: dict[bytes, Any],
    prefix: bytes,
) -> ObjectId:  # fmt: skip
    entries = dict(tree.entries(store, base)) if base is not None else {}
    theirs = tree.entries(store, source) if source is not None else {}
    for name, below in trie.items():
        path = prefix + b"/" + name if prefix else name
        taken = theirs.get(name)
        if below is _WHOLE:
            if taken is None:
                entries.pop(name, None)
            else:
                entries[name] = taken
            continue
        mine = entries.get(name)
        if (mine is not None and mine.kind != tree.DIR) or (
            taken is not None and taken.kind != tree.DIR
        ):
            raise GraftError(path, path + b"/" + next(iter(below)))
        if mine is None and taken is None:
            continue
        child = _graft(store, mine.oid if mine else None, taken.oid if taken else None, below, path)
        shape = mine if mine is not None else taken
        assert shape is not None
        entries[name] = tree.make_entry(name, tree.DIR, shape.mode, 0, shape.mtime_ns, child, None)
    oid: ObjectId = store.put("tree", tree.encode_tree(list(entries.values())))
    return oid
