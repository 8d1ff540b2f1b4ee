"""PostgreSQL wire messages (protocol 3.0): reading frames off a stream, decoding the frontend
messages the proxy looks into, and encoding what it sends.

The agent's side of the proxy is untrusted: every decoder here raises ProtocolError (and
nothing else) on bytes that are not a well-formed message, and lengths are capped before
anything is allocated. Reference: the "Frontend/Backend Protocol" chapter of the PostgreSQL
manual.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

from jukebox.errors import JukeboxError

PROTOCOL_3 = 196608
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102

# PostgreSQL itself refuses startup packets over 10000 bytes.
MAX_STARTUP = 10_000
# One message: a huge COPY row or bound parameter still fits; a hostile length does not make
# the proxy allocate gigabytes.
MAX_MESSAGE = 64 * 1024 * 1024


class ProtocolError(JukeboxError, ValueError):
    """Bytes that are not the message they claim to be."""


@dataclass
class Startup:
    code: int
    params: dict[str, str]
    body: bytes  # what follows the code (a cancel request's pid and key)


class Reads(Protocol):
    """What messages are read from: an asyncio.StreamReader or a socket's Wire (the agent's,
    the server's)."""

    async def readexactly(self, n: int) -> bytes: ...


async def read_startup(reader: Reads) -> Startup:
    head = await reader.readexactly(8)
    length, code = struct.unpack("!ii", head)
    if length < 8 or length > MAX_STARTUP:
        raise ProtocolError(f"startup packet of {length} bytes")
    body = await reader.readexactly(length - 8)
    return decode_startup(code, body)


def decode_startup(code: int, body: bytes) -> Startup:
    params: dict[str, str] = {}
    if code == PROTOCOL_3:
        fields = body.split(b"\0")
        # name\0value\0 ... \0: an even count of fields before the final empty ones.
        if len(fields) < 2 or fields[-1] != b"" or fields[-2] != b"":
            raise ProtocolError("startup parameters are not terminated")
        fields = fields[:-2]
        if len(fields) % 2:
            raise ProtocolError("a startup parameter has no value")
        for name, value in zip(fields[::2], fields[1::2], strict=True):
            params[_text(name)] = _text(value)
    return Startup(code, params, body)


async def read_message(reader: Reads) -> tuple[bytes, bytes]:
    """(type byte, body) of the next message."""
    head = await reader.readexactly(5)
    kind = head[:1]
    (length,) = struct.unpack("!i", head[1:])
    if length < 4 or length > MAX_MESSAGE:
        raise ProtocolError(f"message {kind!r} claims {length} bytes")
    return kind, await reader.readexactly(length - 4)


_LENGTH = struct.Struct("!i")


def message(kind: bytes, body: bytes = b"") -> bytes:
    return kind + _LENGTH.pack(len(body) + 4) + body


def startup_message(params: dict[str, str]) -> bytes:
    body = struct.pack("!i", PROTOCOL_3)
    for name, value in params.items():
        body += name.encode() + b"\0" + value.encode() + b"\0"
    body += b"\0"
    return struct.pack("!i", len(body) + 4) + body


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ProtocolError("text that is not UTF-8") from None


class _Cursor:
    """Reads a message body field by field; every short read is a ProtocolError."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.at = 0

    def cstring(self) -> str:
        end = self.body.find(b"\0", self.at)
        if end < 0:
            raise ProtocolError("a string is not terminated")
        raw = self.body[self.at : end]
        self.at = end + 1
        return _text(raw)

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.body):
            raise ProtocolError("a message is shorter than its fields")
        raw = self.body[self.at : self.at + n]
        self.at += n
        return raw

    def int16(self) -> int:
        return struct.unpack("!h", self.take(2))[0]

    def int32(self) -> int:
        return struct.unpack("!i", self.take(4))[0]

    def count(self) -> int:
        n = self.int16()
        if n < 0:
            raise ProtocolError("a negative count")
        return n

    def end(self) -> None:
        if self.at != len(self.body):
            raise ProtocolError("a message is longer than its fields")


# --------------------------------------------------------------------------- frontend messages


@dataclass
class Parse:
    name: str
    query: str
    types: list[int]

    def encode(self) -> bytes:
        body = self.name.encode() + b"\0" + self.query.encode() + b"\0"
        body += struct.pack(f"!h{len(self.types)}I", len(self.types), *self.types)
        return message(b"P", body)


@dataclass
class Bind:
    portal: str
    statement: str
    param_formats: list[int]
    params: list[bytes | None]
    result_formats: list[int]

    def encode(self) -> bytes:
        out = [self.portal.encode(), b"\0", self.statement.encode(), b"\0"]
        out.append(struct.pack(f"!h{len(self.param_formats)}h", len(self.param_formats),
                               *self.param_formats))
        out.append(struct.pack("!h", len(self.params)))
        for value in self.params:
            out.append(struct.pack("!i", -1) if value is None
                       else struct.pack("!i", len(value)) + value)
        out.append(struct.pack(f"!h{len(self.result_formats)}h", len(self.result_formats),
                               *self.result_formats))
        return message(b"B", b"".join(out))

    def param_format(self, i: int) -> int:
        if not self.param_formats:
            return 0
        return self.param_formats[0] if len(self.param_formats) == 1 else self.param_formats[i]


@dataclass
class Describe:
    what: str  # "S" a statement, "P" a portal
    name: str

    def encode(self, kind: bytes = b"D") -> bytes:
        return message(kind, self.what.encode() + self.name.encode() + b"\0")


class Close(Describe):
    def encode(self, kind: bytes = b"C") -> bytes:
        return super().encode(kind)


@dataclass
class Execute:
    portal: str
    max_rows: int

    def encode(self) -> bytes:
        return message(b"E", self.portal.encode() + b"\0" + struct.pack("!i", self.max_rows))


def decode_query(body: bytes) -> str:
    c = _Cursor(body)
    text = c.cstring()
    c.end()
    return text


def decode_parse(body: bytes) -> Parse:
    c = _Cursor(body)
    name, query = c.cstring(), c.cstring()
    types = [c.int32() & 0xFFFFFFFF for _ in range(c.count())]
    c.end()
    return Parse(name, query, types)


def decode_bind(body: bytes) -> Bind:
    # Field by field with struct rather than _Cursor's method calls: a Bind comes with every
    # statement an agent sends with parameters.
    end = body.find(b"\0")
    mid = body.find(b"\0", end + 1) if end >= 0 else -1
    if mid < 0:
        raise ProtocolError("a string is not terminated")
    portal, statement = _text(body[:end]), _text(body[end + 1 : mid])
    at, size = mid + 1, len(body)
    params: list[bytes | None] = []
    try:
        formats, at = _codes(body, at)
        (n,) = _INT16.unpack_from(body, at)
        at += 2
        for _ in range(_count(n)):
            (length,) = _LENGTH.unpack_from(body, at)
            at += 4
            if length == -1:
                params.append(None)
                continue
            if length < 0 or at + length > size:
                raise ProtocolError("a message is shorter than its fields")
            params.append(body[at : at + length])
            at += length
        results, at = _codes(body, at)
    except struct.error:
        raise ProtocolError("a message is shorter than its fields") from None
    if at != size:
        raise ProtocolError("a message is longer than its fields")
    if (formats and not _FORMATS.issuperset(formats)) or (
            results and not _FORMATS.issuperset(results)):
        raise ProtocolError("a format code other than text (0) or binary (1)")
    if len(formats) not in (0, 1, len(params)):
        raise ProtocolError("parameter formats do not match the parameters")
    return Bind(portal, statement, formats, params, results)


_FORMATS = frozenset((0, 1))


def _codes(body: bytes, at: int) -> tuple[list[int], int]:
    """A Bind's format codes at `at` (a count, then as many int16), and where they end: none
    or one, as almost every Bind has, without a struct format built for the count."""
    (n,) = _INT16.unpack_from(body, at)
    if n == 0:
        return [], at + 2
    if n == 1:
        return [_INT16.unpack_from(body, at + 2)[0]], at + 4
    return list(struct.unpack_from(f"!{_count(n)}h", body, at + 2)), at + 2 + 2 * n


def _count(n: int) -> int:
    if n < 0:
        raise ProtocolError("a negative count")
    return n


_INT16 = struct.Struct("!h")


def _decode_target(body: bytes, cls: type[Describe]) -> Describe:
    c = _Cursor(body)
    what = c.take(1).decode("latin-1")
    if what not in ("S", "P"):
        raise ProtocolError(f"describe or close of {what!r}, not S or P")
    name = c.cstring()
    c.end()
    return cls(what, name)


def decode_describe(body: bytes) -> Describe:
    return _decode_target(body, Describe)


def decode_close(body: bytes) -> Close:
    # _decode_target builds the class it is given: a Close
    return _decode_target(body, Close)  # type: ignore[return-value]


def decode_execute(body: bytes) -> Execute:
    c = _Cursor(body)
    portal = c.cstring()
    max_rows = c.int32()
    c.end()
    return Execute(portal, max_rows)


def decode_cancel(body: bytes) -> tuple[int, int]:
    c = _Cursor(body)
    pid, key = c.int32(), c.int32()
    c.end()
    return pid, key


# --------------------------------------------------------------------------- backend messages

AUTH_OK = message(b"R", struct.pack("!i", 0))
PARSE_COMPLETE = message(b"1")
BIND_COMPLETE = message(b"2")
CLOSE_COMPLETE = message(b"3")
NO_DATA = message(b"n")
NO_PARAMETERS = message(b"t", struct.pack("!h", 0))


_READY = {status: message(b"Z", status.encode()) for status in ("I", "T", "E")}


def ready(status: str) -> bytes:
    # Made once: the proxy says it at the end of every statement.
    return _READY.get(status) or message(b"Z", status.encode())


def command_complete(tag: str) -> bytes:
    return message(b"C", tag.encode() + b"\0")


def parameter_status(name: str, value: str) -> bytes:
    return message(b"S", name.encode() + b"\0" + value.encode() + b"\0")


def backend_key(pid: int, key: int) -> bytes:
    return message(b"K", struct.pack("!ii", pid, key))


def _fields(severity: str, code: str, text: str, **extra: str) -> bytes:
    out = [b"S", severity.encode(), b"\0", b"V", severity.encode(), b"\0",
           b"C", code.encode(), b"\0", b"M", text.encode(), b"\0"]
    for key, value in extra.items():
        out += [key.encode(), value.encode(), b"\0"]
    return b"".join(out) + b"\0"


def error(code: str, text: str, severity: str = "ERROR", **extra: str) -> bytes:
    return message(b"E", _fields(severity, code, text, **extra))


def notice(code: str, text: str, severity: str = "WARNING") -> bytes:
    return message(b"N", _fields(severity, code, text))


def decode_fields(body: bytes) -> dict[str, str]:
    """An ErrorResponse's or NoticeResponse's fields by their code letter."""
    out: dict[str, str] = {}
    for part in body.split(b"\0"):
        if part:
            out[part[:1].decode("latin-1")] = part[1:].decode("utf-8", "replace")
    return out


def decode_tag(body: bytes) -> str:
    return body.rstrip(b"\0").decode("utf-8", "replace")
