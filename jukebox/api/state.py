"""The agent's memory: a persistent map whose versions share structure and hash into the store.

`State` is what a transaction hands the agent as ``tx.state``: a mutable-looking map of string
keys to JSON-like values (conversation, plan, tool results). Underneath, every change makes a new
immutable `StateVersion` and moves one pointer, so a checkpoint keeps a version by reference and a
rollback swaps the pointer back: O(1), whatever the map holds.

Versions are a hash array mapped trie (HAMT): 32-way nodes indexed by 5-bit slices of a stable
key hash (CRC-32, the same in every process), with a sorted collision bucket once the 32 bits run
out. Setting a key copies only the nodes on its path (at most 7), every other node is shared with
the previous version. The layout depends only on the set of keys, never on the order of changes
(a deletion folds a node left holding one entry back into its parent), so equal maps have equal
trees and equal ids.

`StateVersion.save(store)` writes each node as a canonical ``json`` object whose child slots name
their child by id: a Merkle tree. The root's id is the version id a frame records. A node knows
its id once saved, so saving the next version stores only the nodes the changes created.

Values are frozen on the way in: lists become `FrozenList`, dicts `FrozenDict` (they compare equal
to, and serialise like, the plain ones but refuse changes), so a version can never change under a
checkpoint that holds it.
"""

from __future__ import annotations

import json
import math
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from typing import TYPE_CHECKING, Any, NoReturn
from zlib import crc32

from shadowfs.oid import ObjectId

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader, ObjectWriter

__all__ = ["FrozenDict", "FrozenList", "State", "StateVersion", "freeze", "thaw"]

_BITS = 5
_MASK = (1 << _BITS) - 1
# Shifts 0, 5, ..., 30 consume the 32 hash bits; a node deeper than that is a collision bucket.
_LAST_SHIFT = 30


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()

# The canonical JSON of a state value (the same rules as a frame payload's).
_ENCODER = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
)


# --------------------------------------------------------------------------- frozen values


class FrozenDict(dict):
    """A dict that refuses changes: the form nested dicts take inside the state.

    It stays a dict subclass so it serialises with `json` and compares equal to plain dicts.
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "state values are immutable: build a new value and store it with state.set(key, value)"
        )

    __setitem__ = __delitem__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    # Mapping declares __hash__ None; a frozen value is hashable on purpose
    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenDict:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self),))


class FrozenList(list):
    """A list that refuses changes: the form nested lists take inside the state (equal to the
    plain list it came from, and serialised by `json` like one)."""

    __slots__ = ()

    _refuse = FrozenDict._refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse

    # Sequence declares __hash__ None; a frozen value is hashable on purpose
    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self))

    def __copy__(self) -> FrozenList:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenList:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenList, (list(self),))


_SCALARS = (str, int, bool, type(None))


def freeze(value: Any) -> Any:
    """The immutable form of a JSON-like value; anything else is refused with a TypeError."""
    t = type(value)
    if t in _SCALARS:
        return value
    if t is float:
        if not math.isfinite(value):
            raise ValueError(
                f"state values must be finite numbers, got {value!r}: store it as a string"
            )
        return value
    if t is FrozenDict or t is FrozenList:
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise TypeError(
                    f"state dict keys must be strings, got {type(k).__name__} {k!r}: "
                    "convert the key to str"
                )
            out[k] = freeze(v)
        return FrozenDict(out)
    if isinstance(value, list | tuple):
        return FrozenList([freeze(v) for v in value])
    raise TypeError(
        f"state values are JSON-like data (None, bool, int, float, str, list, dict); got "
        f"{type(value).__name__}: convert it to one of those first"
    )


def thaw(value: Any) -> Any:
    """A plain, mutable copy of a frozen value."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [thaw(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    # 1 == True == 1.0 in Python, but they are different JSON values and must not dedup.
    return a is b or (type(a) is type(b) and a == b)


# --------------------------------------------------------------------------- the trie


class _Node:
    """One trie node. ``items`` holds, in bit order, leaves and child nodes. A leaf is a tuple
    ``(key, value, encoded)``: its canonical JSON is made once, when it is set, so saving a
    version only joins strings.

    A collision bucket (below the last shift) has bitmap 0 and only leaves, sorted by key.
    """

    __slots__ = ("bitmap", "home", "items", "oid")

    def __init__(self, bitmap: int, items: tuple[Any, ...]) -> None:
        self.bitmap = bitmap
        self.items = items
        # The id and the store it was saved in (an id alone does not say the object is there).
        self.oid: ObjectId | None = None
        self.home: Any = None


_EMPTY = _Node(0, ())


def _leaf(key: str, value: Any) -> tuple[str, Any, str]:
    return (key, value, _ENCODER.encode([key, value]))


def _first(leaf: tuple[str, Any, str]) -> str:
    return leaf[0]


def _hash(key: str) -> int:
    return crc32(key.encode("utf-8", "surrogatepass"))


def _get(node: _Node, key: str, h: int) -> Any:
    shift = 0
    while True:
        if shift > _LAST_SHIFT:
            for leaf in node.items:
                if leaf[0] == key:
                    return leaf[1]
            return _MISSING
        bit = 1 << ((h >> shift) & _MASK)
        bitmap = node.bitmap
        if not bitmap & bit:
            return _MISSING
        item = node.items[(bitmap & (bit - 1)).bit_count()]
        if type(item) is _Node:
            node = item
            shift += _BITS
            continue
        return item[1] if item[0] == key else _MISSING


def _pair(a: tuple[str, Any, str], ha: int, b: tuple[str, Any, str], hb: int, shift: int
          ) -> _Node:
    """The smallest subtree at ``shift`` holding two leaves whose hashes agree above it."""
    if shift > _LAST_SHIFT:
        return _Node(0, (a, b) if a[0] < b[0] else (b, a))
    ia = (ha >> shift) & _MASK
    ib = (hb >> shift) & _MASK
    if ia == ib:
        return _Node(1 << ia, (_pair(a, ha, b, hb, shift + _BITS),))
    return _Node((1 << ia) | (1 << ib), (a, b) if ia < ib else (b, a))


def _set(node: _Node, key: str, h: int, value: Any, shift: int) -> tuple[_Node, bool]:
    """(new node, whether the key is new). Returns ``node`` itself when nothing changes."""
    items = node.items
    if shift > _LAST_SHIFT:
        for i, leaf in enumerate(items):
            if leaf[0] == key:
                if _same(leaf[1], value):
                    return node, False
                return _Node(0, (*items[:i], _leaf(key, value), *items[i + 1 :])), False
        return _Node(0, tuple(sorted((*items, _leaf(key, value)), key=_first))), True
    bit = 1 << ((h >> shift) & _MASK)
    bitmap = node.bitmap
    idx = (bitmap & (bit - 1)).bit_count()
    if not bitmap & bit:
        return _Node(bitmap | bit, (*items[:idx], _leaf(key, value), *items[idx:])), True
    item = items[idx]
    if type(item) is _Node:
        child, added = _set(item, key, h, value, shift + _BITS)
        if child is item:
            return node, False
    elif item[0] == key:
        if _same(item[1], value):
            return node, False
        # a leaf stands where a node was: _set's slots hold either
        child, added = _leaf(key, value), False  # type: ignore[assignment]
    else:
        child, added = _pair(item, _hash(item[0]), _leaf(key, value), h, shift + _BITS), True
    return _Node(bitmap, (*items[:idx], child, *items[idx + 1 :])), added


def _delete(node: _Node, key: str, h: int, shift: int) -> _Node:
    """The node without ``key``; ``node`` itself when the key is absent."""
    items = node.items
    if shift > _LAST_SHIFT:
        for i, leaf in enumerate(items):
            if leaf[0] == key:
                return _Node(0, (*items[:i], *items[i + 1 :]))
        return node
    bit = 1 << ((h >> shift) & _MASK)
    bitmap = node.bitmap
    if not bitmap & bit:
        return node
    idx = (bitmap & (bit - 1)).bit_count()
    item = items[idx]
    if type(item) is _Node:
        child = _delete(item, key, h, shift + _BITS)
        if child is item:
            return node
        # Canonical form: a child left with a single leaf folds into this slot.
        if len(child.items) == 1 and type(child.items[0]) is not _Node:
            return _Node(bitmap, (*items[:idx], child.items[0], *items[idx + 1 :]))
        return _Node(bitmap, (*items[:idx], child, *items[idx + 1 :]))
    if item[0] != key:
        return node
    return _Node(bitmap & ~bit, (*items[:idx], *items[idx + 1 :]))


def _leaves(node: _Node) -> Iterator[tuple[str, Any]]:
    stack = [node]
    while stack:
        n = stack.pop()
        for item in reversed(n.items):
            if type(item) is _Node:
                stack.append(item)
            else:
                yield item[0], item[1]


# --------------------------------------------------------------------------- store encoding



def _save(root: _Node, store: ObjectWriter, written: list[ObjectId] | None = None) -> ObjectId:
    """Store every node of ``root`` not yet in ``store`` (children first); the root's id.
    The ids of the nodes stored now are appended to ``written``."""
    if root.home is store:
        # a root already stored in this store has its id
        return root.oid  # type: ignore[return-value]
    stack: list[tuple[_Node, bool]] = [(root, False)]
    while stack:
        node, ready = stack.pop()
        if node.home is store:
            continue
        if not ready:
            stack.append((node, True))
            stack.extend(
                (c, False) for c in node.items if type(c) is _Node and c.home is not store
            )
            continue
        # The canonical encoding of {"b": bitmap, "e": [leaf | {"n": child id}, ...]}.
        slots = ",".join(
            # A child node was saved before its parent (children first), so it has its id.
            f'{{"n":"{item.oid.hex()}"}}' if type(item) is _Node else item[2]  # type: ignore[union-attr]
            for item in node.items
        )
        data = f'{{"b":{node.bitmap},"e":[{slots}]}}'.encode()
        node.oid = store.put("json", data)
        node.home = store
        if written is not None:
            written.append(node.oid)
    # saved just above (children first): the root has its id
    return root.oid  # type: ignore[return-value]


def _load(store: ObjectReader, oid: ObjectId, depth: int = 0) -> tuple[_Node, int]:
    if depth > _LAST_SHIFT // _BITS + 2:
        raise ValueError(f"state node {oid.hex()} nests deeper than any state version can")
    try:
        raw = json.loads(store.get(oid))
        bitmap = raw["b"]
        slots = raw["e"]
        if type(bitmap) is not int or not isinstance(slots, list):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"store object {oid.hex()} is not a state version node; pass the id a checkpoint "
            "frame's `state` field names"
        ) from None
    items: list[Any] = []
    count = 0
    for slot in slots:
        if isinstance(slot, dict):
            ref = slot.get("n")
            if not isinstance(ref, str) or len(ref) != 64:
                raise ValueError(f"state node {oid.hex()} holds a malformed child {slot!r:.80}")
            child, n = _load(store, ObjectId.from_hex(ref), depth + 1)
            items.append(child)
            count += n
        else:
            if not isinstance(slot, list) or len(slot) != 2 or type(slot[0]) is not str:
                raise ValueError(f"state node {oid.hex()} holds a malformed entry {slot!r:.80}")
            items.append(_leaf(slot[0], freeze(slot[1])))
            count += 1
    node = _Node(bitmap, tuple(items))
    node.oid, node.home = oid, store
    return node, count


# --------------------------------------------------------------------------- public types


class StateVersion(Mapping[str, Any]):
    """One immutable version of the state. Cheap to keep: versions share unchanged nodes."""

    __slots__ = ("_count", "_root")

    def __init__(self, _root: _Node = _EMPTY, _count: int = 0) -> None:
        self._root = _root
        self._count = _count

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> StateVersion:
        v = cls()
        pairs = data.items() if isinstance(data, Mapping) else data
        for k, value in pairs:
            v = v.set(k, value)
        return v

    @classmethod
    def load(cls, store: ObjectReader, oid: ObjectId | str) -> StateVersion:
        """The version a checkpoint saved (``oid``: its id, or the id's hex)."""
        if isinstance(oid, str):
            oid = ObjectId.from_hex(oid)
        root, count = _load(store, oid)
        return cls(root, count)

    # -- reading -----------------------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        if type(key) is not str:
            raise KeyError(key)
        v = _get(self._root, key, _hash(key))
        if v is _MISSING:
            raise KeyError(key)
        return v

    def get(self, key: str, default: Any = None) -> Any:
        if type(key) is not str:
            return default
        v = _get(self._root, key, _hash(key))
        return default if v is _MISSING else v

    def __contains__(self, key: object) -> bool:
        return type(key) is str and _get(self._root, key, _hash(key)) is not _MISSING

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in _leaves(self._root))

    def items(self) -> ItemsView[str, Any]:
        return _Items(self)

    def to_dict(self) -> dict[str, Any]:
        """A plain, mutable copy (nested values thawed)."""
        return {k: thaw(v) for k, v in _leaves(self._root)}

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StateVersion):
            if other._root is self._root:
                return True
            return self._count == other._count and dict(_leaves(self._root)) == dict(
                _leaves(other._root)
            )
        return Mapping.__eq__(self, other)

    # mutable-looking mapping: unhashable, as dict is (Mapping types __hash__ as a method)
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<StateVersion {self._count} key(s)>"

    # -- new versions ------------------------------------------------------------------------

    def set(self, key: str, value: Any) -> StateVersion:
        if type(key) is not str:
            raise TypeError(f"state keys are strings, got {type(key).__name__} {key!r}")
        root, added = _set(self._root, key, _hash(key), freeze(value), 0)
        if root is self._root:
            return self
        return StateVersion(root, self._count + 1 if added else self._count)

    def delete(self, key: str) -> StateVersion:
        if type(key) is not str:
            return self
        root = _delete(self._root, key, _hash(key), 0)
        if root is self._root:
            return self
        return StateVersion(root, self._count - 1)

    # -- the store ---------------------------------------------------------------------------

    def save(self, store: ObjectWriter, written: list[ObjectId] | None = None) -> ObjectId:
        """Store this version (only nodes not yet in ``store``) and return its id; the ids of
        the nodes stored by this call are appended to ``written``. A frame lists those in its
        refs, so `jukebox gc` (which expands trees, not state nodes) keeps every node a tape's
        versions need."""
        return _save(self._root, store, written)

    @property
    def saved_id(self) -> ObjectId | None:
        """The id, if this version was saved already (in any store)."""
        return self._root.oid

    def diff(self, other: StateVersion) -> dict[str, list[str]]:
        """Keys ``added``, ``removed`` and ``changed`` going from this version to ``other``;
        subtrees the two share are skipped unread."""
        added: list[str] = []
        removed: list[str] = []
        changed: list[str] = []
        _diff(self._root, other._root, 0, added, removed, changed)
        return {"added": sorted(added), "removed": sorted(removed), "changed": sorted(changed)}


class _Items(ItemsView[str, Any]):
    def __init__(self, version: StateVersion) -> None:
        super().__init__(version)
        self._version = version

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return _leaves(self._version._root)


def _slot_map(node: _Node) -> dict[int, Any]:
    out: dict[int, Any] = {}
    bitmap = node.bitmap
    for item in node.items:
        low = bitmap & -bitmap
        out[low.bit_length() - 1] = item
        bitmap ^= low
    return out


def _subtree(item: Any) -> dict[str, Any]:
    if type(item) is _Node:
        return dict(_leaves(item))
    return {item[0]: item[1]}


def _diff(
    a: _Node, b: _Node, shift: int, added: list[str], removed: list[str], changed: list[str]
) -> None:
    if a is b or (a.oid is not None and a.oid == b.oid):
        return
    if shift > _LAST_SHIFT:
        pairs = [({x[0]: x[1] for x in a.items}, {x[0]: x[1] for x in b.items})]
    else:
        sa, sb = _slot_map(a), _slot_map(b)
        pairs = []
        for slot in sa.keys() | sb.keys():
            x, y = sa.get(slot), sb.get(slot)
            if x is y:
                continue
            if type(x) is _Node and type(y) is _Node:
                _diff(x, y, shift + _BITS, added, removed, changed)
                continue
            old = _subtree(x) if x is not None else {}
            pairs.append((old, _subtree(y) if y is not None else {}))
    for old, new in pairs:
        for k, v in old.items():
            if k not in new:
                removed.append(k)
            elif not _same(v, new[k]):
                changed.append(k)
        added.extend(k for k in new if k not in old)


class State:
    """The transaction's memory: a map that records every change as a new `StateVersion`.

    Reads and writes look like a dict's; ``version`` is the current immutable version (keep it
    and `restore` it later in O(1)).
    """

    __slots__ = ("_v",)

    def __init__(self, initial: StateVersion | Mapping[str, Any] | None = None) -> None:
        if initial is None:
            self._v = StateVersion()
        elif isinstance(initial, StateVersion):
            self._v = initial
        else:
            self._v = StateVersion.from_mapping(initial)

    @property
    def version(self) -> StateVersion:
        return self._v

    def restore(self, version: StateVersion) -> None:
        """Make ``version`` current again: one pointer swap."""
        if not isinstance(version, StateVersion):
            raise TypeError(
                f"restore() takes a StateVersion (state.version), got {type(version).__name__}"
            )
        self._v = version

    def get(self, key: str, default: Any = None) -> Any:
        return self._v.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self._v = self._v.set(key, value)

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        self._v = self._v.delete(key)

    def update(self, data: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), **kw: Any) -> None:
        v = self._v
        pairs = data.items() if isinstance(data, Mapping) else data
        for k, value in (*pairs, *kw.items()):
            v = v.set(k, value)
        self._v = v

    def __getitem__(self, key: str) -> Any:
        return self._v[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._v = self._v.set(key, value)

    def __delitem__(self, key: str) -> None:
        if key not in self._v:
            raise KeyError(key)
        self._v = self._v.delete(key)

    def __contains__(self, key: object) -> bool:
        return key in self._v

    def __len__(self) -> int:
        return len(self._v)

    def __iter__(self) -> Iterator[str]:
        return iter(self._v)

    def keys(self) -> KeysView[str]:
        return self._v.keys()

    def values(self) -> ValuesView[Any]:
        return self._v.values()

    def items(self) -> ItemsView[str, Any]:
        return self._v.items()

    def to_dict(self) -> dict[str, Any]:
        return self._v.to_dict()

    def __repr__(self) -> str:
        return f"<State {len(self._v)} key(s)>"
