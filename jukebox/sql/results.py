"""What a statement answered, kept on its `sql` frame (`booth run --record-sql-results`) so
`replay --exec` can serve it again with no server (jukebox.sql.replay).

A statement's replies are kept as the agent received them, message by message (row
descriptions, data rows, command tag or error, notices, COPY), base64 in the frame's `result`:
types, formats and text reach the replayed agent exactly as the server made them. Data rows
have their text values scrubbed as the frame's parameters are (the booth's secret values,
key-shaped text): a replay serves the scrubbed text. Protocol acknowledgements the replay makes
itself (ParseComplete, BindComplete, CloseComplete, ReadyForQuery) are not kept.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from typing import Any

from jukebox.redact import Scrubber, redact_text
from jukebox.sql import messages as m

# One statement's replies above this are not kept (the frame says `result_truncated`): a replay
# stops there rather than serve part of a result.
MAX_RESULT_BYTES = 4 * 1024 * 1024
ACKS = frozenset({b"1", b"2", b"3", b"Z"})


class Results:
    """The replies of the statement on its way, gathered until its frame is written."""

    def __init__(self, scrubber: Scrubber) -> None:
        self.scrubber = scrubber
        self.parts: list[bytes] = []
        self.size = 0
        self.truncated = False

    def add(self, kind: bytes, data: bytes) -> None:
        if kind in ACKS:
            return
        if kind == b"D":
            data = self._scrub_row(data)
        self.size += len(data)
        if self.size > MAX_RESULT_BYTES:
            self.truncated = True
            self.parts.clear()
            return
        self.parts.append(data)

    def take(self) -> dict[str, Any]:
        """What the statement's frame keeps; the gathering starts again for the next one."""
        if self.truncated:
            out: dict[str, Any] = {"result_truncated": True}
        else:
            out = {"result": base64.b64encode(b"".join(self.parts)).decode()}
        self.parts, self.size, self.truncated = [], 0, False
        return out

    def _scrub_row(self, data: bytes) -> bytes:
        values = list(row_values(data[5:]))
        scrubbed = []
        changed = False
        for value in values:
            if value is not None:
                try:
                    text = value.decode()
                except UnicodeDecodeError:
                    text = None
                if text is not None:
                    clean = redact_text(text, self.scrubber)
                    if clean != text:
                        value, changed = clean.encode(), True
            scrubbed.append(value)
        return encode_row(scrubbed) if changed else data


def row_values(body: bytes) -> Iterator[bytes | None]:
    (count,) = struct.unpack_from("!h", body, 0)
    at = 2
    for _ in range(count):
        (size,) = struct.unpack_from("!i", body, at)
        at += 4
        if size < 0:
            yield None
        else:
            yield body[at : at + size]
            at += size


def encode_row(values: list[bytes | None]) -> bytes:
    out = [struct.pack("!h", len(values))]
    for value in values:
        out.append(struct.pack("!i", -1) if value is None
                   else struct.pack("!i", len(value)) + value)
    return m.message(b"D", b"".join(out))


def split(raw: bytes) -> list[tuple[bytes, bytes]]:
    """The messages of a kept result, as (type byte, whole message)."""
    out = []
    at = 0
    while at + 5 <= len(raw):
        (length,) = struct.unpack_from("!i", raw, at + 1)
        out.append((raw[at : at + 1], raw[at : at + 1 + length]))
        at += 1 + length
    return out


def decode(payload: dict[str, Any]) -> list[tuple[bytes, bytes]] | None:
    """A frame's kept replies, or None when it has none (recorded without
    --record-sql-results, or too large)."""
    raw = payload.get("result")
    if not isinstance(raw, str):
        return None
    return split(base64.b64decode(raw))
