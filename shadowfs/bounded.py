"""A dict that forgets its oldest entries past a number of entries or a total weight.

For memories keyed by tree id (how two trees differ, a tree's encoded bytes): a
tree id fixes its content, so an entry never goes stale, and forgetting one only costs the work
of computing it again.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Generic, TypeVar

    K = TypeVar("K")
    V = TypeVar("V")
else:
    # typing.Generic's subscription, for a class every booth and replay builds, without
    # importing typing: `BoundedMap[K, V]` is BoundedMap itself at run time.
    K = V = None

    class Generic:
        __slots__ = ()

        def __class_getitem__(cls, params: object) -> type:
            return cls


class BoundedMap(Generic[K, V]):
    """Insertion-ordered; `put` makes a key the newest. The newest entry is never dropped."""

    __slots__ = ("_items", "_max_items", "_max_weight", "_weight", "_weights")

    def __init__(self, max_items: int | None, max_weight: int) -> None:
        self._items: dict[K, V] = {}
        self._weights: dict[K, int] = {}
        self._max_items = max_items
        self._max_weight = max_weight
        self._weight = 0

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def clear(self) -> None:
        self._items.clear()
        self._weights.clear()
        self._weight = 0

    def put(self, key: K, value: V, weight: int) -> None:
        items, weights = self._items, self._weights
        if key in items:
            del items[key]
            self._weight -= weights.pop(key)
        items[key] = value
        weights[key] = weight
        self._weight += weight
        while len(items) > 1 and (
            self._weight > self._max_weight
            or (self._max_items is not None and len(items) > self._max_items)
        ):
            oldest = next(iter(items))
            del items[oldest]
            self._weight -= weights.pop(oldest)
