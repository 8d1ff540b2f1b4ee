"""What code that reads or writes objects needs from a store, as protocols defined once.

`ObjectReader` reads objects by id, `ObjectWriter` puts them, `ObjectStore` is both;
`shadowfs.store.Store` provides all three. Trees, views, layers, commits and tapes are typed
against these rather than against `Store`, so a signature says which half it uses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from shadowfs.oid import ObjectId


class ByteSink(Protocol):
    """Where `read_file_into` streams a blob: a file opened for writing, or anything with its
    `write`. One that also has `skip(n)` is given each whole chunk of zeros as a skip, unread."""

    def write(self, data: memoryview, /) -> int | None: ...


class ObjectReader(Protocol):
    """Objects by id: trees read, commits write back, tapes resolve their payloads."""

    def get(self, oid: ObjectId) -> bytes:
        """The object's bytes; ObjectMissing (shadowfs.errors) when the store lacks it."""
        ...

    def has(self, oid: ObjectId) -> bool: ...

    def kind(self, oid: ObjectId) -> str:
        """`blob`, `tree`, ... as the object was put."""
        ...

    def read_file_into(self, oid: ObjectId, fileobj: ByteSink) -> int:
        """Streams a blob or a chunked file into `fileobj`; returns its size."""
        ...

    def read_bytes(self, oid: ObjectId) -> bytes:
        """A blob's or a chunked file's whole content in memory (content known to be small)."""
        ...

    def read_blobs(self, oids: Sequence[ObjectId]) -> list[bytes]:
        """Many blobs at once, in the order asked: one pass over each pack."""
        ...


class ObjectWriter(Protocol):
    """Objects put by content: trees built, files staged, payloads spilled from frames."""

    def put(self, kind: str, data: bytes, delta_base: ObjectId | None = None) -> ObjectId:
        """`data` as an object of `kind`, put once; with `delta_base` (a file's previous
        content), kept as a delta against it when that is smaller."""
        ...

    def put_file(self, path_or_fd: int | str | bytes | os.PathLike[str]) -> ObjectId:
        """A file's content as a blob, read from a path or an open descriptor."""
        ...

    def flush(self) -> None:
        """Makes what was put durable: the pack's fsync, then its index."""
        ...


class ObjectStore(ObjectReader, ObjectWriter, Protocol):
    """Both halves, for code that reads objects and writes new ones (a tree built over an
    older one, a tape that spills payloads and reads them back)."""
