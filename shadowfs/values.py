"""Small immutable value classes without `dataclasses`.

Importing `dataclasses` costs about 42 M instructions (it imports `inspect`, `ast`, `dis` and
`tokenize`) and each class it builds 2.4-3.5 M more (every generated method is source text
compiled with `exec`): together about a third of a whole `jukebox replay` of a short tape
(docs/benchmarks.md, "Where a user waits"). The classes on the read side's path derive from
`Value` instead and write their `__init__` by hand; what a frozen dataclass gave them is kept:
equality with an instance of the same class by the value's fields, a hash of them, the same
repr, and no assignment after `__init__` (AttributeError, with the dataclass's wording).

A subclass lists its value's fields in `FIELDS`, in order (compared, hashed and shown), and
assigns every slot in `__init__` through `setfield` (`object.__setattr__`, which is what a frozen
dataclass's own `__init__` does). A slot outside `FIELDS` (a cache) is left out of the value.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

setfield = object.__setattr__

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:  # annotations only: a bound named by a string is compiled at runtime
    from typing import Any, ClassVar, TypeVar

    V = TypeVar("V", bound="Value")
    F = TypeVar("F", bound="_Fields")


def _key_of(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if not names:  # a base class
        return lambda obj: ()
    if len(names) == 1:  # attrgetter of one name gives the value, not a 1-tuple
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return attrgetter(*names)


def _rebuild(cls: type[V], state: tuple[tuple[str, Any], ...]) -> V:
    obj = object.__new__(cls)
    for name, value in state:
        setfield(obj, name, value)
    return obj


class _Fields:
    """Equality and repr by the value's fields, as a dataclass has them."""

    __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ()
    # Every parameter of the class's `__init__`, in order: FIELDS unless a class says otherwise
    # (a field left out of the value but given at construction; `dataclasses.fields`' list).
    INIT: ClassVar[tuple[str, ...]] = ()
    # Set on each subclass (a class attribute); typed as an instance's so that mypy does not
    # take it for a method bound to the instance.
    _key: Callable[[Any], tuple[Any, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A plain function as a class attribute would bind as a method; the key is kept in a
        # staticmethod so `type(self)._key(self)` and `self._key(self)` both work.
        cls._key = staticmethod(_key_of(cls.FIELDS))
        if "INIT" not in cls.__dict__:
            cls.INIT = cls.FIELDS

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return self._key(self) == self._key(other)
        return NotImplemented

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(self.FIELDS, self._key(self), strict=True))
        return f"{type(self).__qualname__}({shown})"

    def replace(self: F, **changes: Any) -> F:
        """A new instance with `changes` to its fields (`dataclasses.replace`'s contract: built
        through `__init__`, so what it does not take, a cache, is not carried over; an unknown
        name is a TypeError)."""
        return type(self)(**{**{name: getattr(self, name) for name in self.INIT}, **changes})

    def fields_dict(self) -> dict[str, Any]:
        """The fields by name, one level deep (what `dataclasses.asdict` gives of a value whose
        fields hold no dataclass, list or dict to copy)."""
        return dict(zip(self.FIELDS, self._key(self), strict=True))


class Record(_Fields):
    """A mutable value (a dataclass with ``eq`` and not ``frozen``): unhashable, and its
    `__init__` assigns as any class's does."""

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]  # mutable and compared by value: unhashable


class Value(_Fields):
    """An immutable value: see the module's docstring."""

    __slots__ = ()

    def __hash__(self) -> int:
        return hash(self._key(self))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        # copy and pickle would restore the state through __setattr__, which refuses.
        state: list[tuple[str, Any]] = []
        for klass in type(self).__mro__:
            for name in klass.__dict__.get("__slots__", ()):
                if hasattr(self, name):
                    state.append((name, getattr(self, name)))
        state.extend(getattr(self, "__dict__", {}).items())
        return (_rebuild, (type(self), tuple(state)))
