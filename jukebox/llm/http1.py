"""HTTP/1.1 on the client side, as the proxy's upstream client needs it: a request encoded in one
go, and a response parsed incrementally (head, then a body framed by chunks, by length or by the
close of the connection). The body's decoding (`BodyReader`) serves the agent's side too
(jukebox.llm.http1_agent).

h11 did this before, and h11 is general and careful: a state machine per connection, an event
object per header block, per chunk and per end of message, each header validated by regex on
both sides. For a stream of a dozen SSE events that was about 150 µs of the proxy's CPU per
call on the dev VM, on the path of every call. This does what the upstream side needs and
refuses what it does not understand (an unknown transfer-encoding, conflicting lengths,
header folding, an oversized head), as h11 did: the proxy then answers 502.

"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from jukebox.errors import JukeboxError

# A response head, a chunk-size line or a trailer section longer than this is refused.
MAX_HEAD_BYTES = 64 * 1024
MAX_LINE_BYTES = 4096

TOKEN = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(r"[\x21-\x7e\x80-\xff]+")
# Control characters other than horizontal tab have no place in a field value.
BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_STATUS = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\r\n]*)?\r?")
HEAD_END = re.compile(rb"\r?\n\r?\n")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


class ProtocolError(JukeboxError):
    """The upstream's bytes are not HTTP/1.1 this client can read; or a request it cannot send."""


class ClosedEarly(ProtocolError):
    """The connection closed before a response head came."""


def encode_request(
    method: str, target: str, headers: Sequence[tuple[str, str]], content: bytes
) -> bytes:
    """The request's bytes, its body after the head (`content-length` is the caller's)."""
    if not TOKEN.fullmatch(method) or not _TARGET.fullmatch(target):
        raise ProtocolError(f"invalid request line: {method!r} {target!r}")
    lines = [f"{method} {target} HTTP/1.1"]
    for name, value in headers:
        if not TOKEN.fullmatch(name) or BAD_VALUE.search(value):
            raise ProtocolError(f"invalid header {name!r}")
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    try:
        return "\r\n".join(lines).encode("latin-1") + content
    except UnicodeEncodeError:
        raise ProtocolError("a header holds a character outside latin-1") from None


@dataclass
class Head:
    status: int
    headers: list[tuple[str, str]]  # names lower-case


# Body framings.
_NONE, _LENGTH, _CHUNKED, _CLOSE = range(4)
# Places in a chunked body.
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class BodyReader:
    """A message's body as its bytes come (`feed`; `feed(b"")` at the end of the connection):
    framed by chunks, by a length, or (a response's) by the close; `body()` gives what came."""

    def __init__(self, pending: bytearray | None = None) -> None:
        # `pending`: bytes that came after the previous message on the same connection.
        self._buf = pending if pending is not None else bytearray()
        self._eof = False
        self._framing = _NONE
        self._left = 0  # bytes of the current chunk, or of a length-framed body, still to come
        self._place = _SIZE
        self.done = False

    def feed(self, data: bytes) -> None:
        if data:
            self._buf += data
        else:
            self._eof = True

    @property
    def pending(self) -> bytearray:
        """The bytes received and not taken yet (the head's, before it is parsed)."""
        return self._buf

    def frame(self, codings: list[str], lengths: set[str], *, until_close: bool) -> None:
        """The body's framing from its transfer-codings and content-length values (chunked
        wins over a length, as RFC 9112 6.3 says); without either, the body runs to the close
        (`until_close`: a response's) or is empty (a request's)."""
        if codings:
            if codings != ["chunked"]:
                raise ProtocolError(f"unsupported transfer-encoding {', '.join(codings)!r}")
            self._framing = _CHUNKED
        elif lengths:
            value = next(iter(lengths))
            if len(lengths) != 1 or not value.isdigit() or len(value) > 20:
                raise ProtocolError("invalid or conflicting content-length")
            self._framing = _LENGTH
            self._left = int(value)
        else:
            self._framing = _CLOSE if until_close else _NONE
        if self._framing == _NONE or (self._framing == _LENGTH and self._left == 0):
            self.done = True

    def body(self) -> list[bytes]:
        """The body's bytes received since the last call: one part per chunk (a chunk split
        across reads gives a part per read). Sets `done` at the end of the body."""
        if self.done:
            return []
        if self._framing == _CHUNKED:
            return self._chunks()
        buf = self._buf
        if self._framing == _LENGTH:
            take = min(self._left, len(buf))
            part = bytes(buf[:take])
            del buf[:take]
            self._left -= take
            if self._left == 0:
                self.done = True
            elif self._eof:
                raise ProtocolError("the connection closed mid-message")
            return [part] if part else []
        part = bytes(buf)  # until the connection closes
        buf.clear()
        if self._eof:
            self.done = True
        return [part] if part else []

    def _chunks(self) -> list[bytes]:
        buf = self._buf
        parts: list[bytes] = []
        pos = 0
        size = len(buf)
        while True:
            if self._place == _DATA:
                take = min(self._left, size - pos)
                if take:
                    parts.append(bytes(buf[pos : pos + take]))
                    pos += take
                    self._left -= take
                if self._left:
                    break
                self._place = _DATA_END
            elif self._place == _DATA_END:
                if size - pos < 2 and buf[pos : pos + 1] != b"\n":
                    break
                if buf[pos : pos + 2] == b"\r\n":
                    pos += 2
                elif buf[pos : pos + 1] == b"\n":
                    pos += 1
                else:
                    raise ProtocolError("a chunk does not end where its size says")
                self._place = _SIZE
            else:
                nl = buf.find(b"\n", pos)
                if nl < 0:
                    if size - pos > MAX_LINE_BYTES:
                        raise ProtocolError("a chunk-size line is too long")
                    break
                line = bytes(buf[pos:nl]).rstrip(b"\r")
                pos = nl + 1
                if self._place == _TRAILER:
                    if not line:
                        self.done = True
                        break
                    continue  # trailer fields: nothing the proxy uses
                hex_size = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.fullmatch(hex_size):
                    raise ProtocolError(f"invalid chunk size {line[:40]!r}")
                self._left = int(hex_size, 16)
                self._place = _DATA if self._left else _TRAILER
        del buf[:pos]
        if not self.done and self._eof:
            raise ProtocolError("the connection closed mid-message")
        if self._place == _TRAILER and len(buf) > MAX_HEAD_BYTES:
            raise ProtocolError("the trailer section is too large")
        return parts


class ResponseReader(BodyReader):
    """One response: `feed` it bytes (`feed(b"")` at the end of the connection), take its
    `head()` once complete, then its body with `body()` as the bytes come, until `done`."""

    def __init__(self, head_request: bool = False) -> None:
        super().__init__()
        self._head_request = head_request
        self._head: Head | None = None
        self.keep_alive = False

    @property
    def reusable(self) -> bool:
        """Whether the connection may carry another request: the whole response read, framed
        by its own length or chunks, nothing after it, and the upstream keeping it alive."""
        return self.done and self.keep_alive and self._framing != _CLOSE and not self._buf

    def head(self) -> Head | None:
        """The head, once it is complete (informational 1xx heads skipped); None until then."""
        while self._head is None:
            end = HEAD_END.search(self._buf)
            if end is None:
                if len(self._buf) > MAX_HEAD_BYTES:
                    raise ProtocolError("the response head is too large")
                if self._eof:
                    raise ClosedEarly("the connection closed before a response")
                return None
            raw = bytes(self._buf[: end.start()])
            del self._buf[: end.end()]
            head, version = _parse_head(raw)
            if 100 <= head.status < 200:
                if head.status == 101:
                    raise ProtocolError("the upstream switched protocols, which nobody asked")
                continue  # the real answer follows
            self._head = head
            self._frame(head, version)
        return self._head

    def _frame(self, head: Head, version: str) -> None:
        connection: set[str] = set()
        lengths: set[str] = set()
        codings: list[str] = []
        for name, value in head.headers:
            if name == "connection":
                connection.update(t.strip().lower() for t in value.split(","))
            elif name == "content-length":
                lengths.update(v.strip() for v in value.split(","))
            elif name == "transfer-encoding":
                codings += [t.strip().lower() for t in value.split(",") if t.strip()]
        self.keep_alive = version == "1" and "close" not in connection
        if self._head_request or head.status in (204, 304):
            self.done = True
        else:
            self.frame(codings, lengths, until_close=True)


def _parse_head(raw: bytes) -> tuple[Head, str]:
    lines = raw.split(b"\n")
    status = _STATUS.fullmatch(lines[0])
    if status is None:
        raise ProtocolError(f"invalid status line {lines[0][:60]!r}")
    return Head(int(status.group(2)), parse_fields(lines[1:])), status.group(1).decode()


def parse_fields(lines: list[bytes]) -> list[tuple[str, str]]:
    """A head's header lines (each without its LF) as (lower-case name, value): a folded line,
    a name that is not a token or a control character in a value is refused."""
    headers: list[tuple[str, str]] = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise ProtocolError("folded header lines are not accepted")
        text = line.decode("latin-1").rstrip("\r")
        name, colon, value = text.partition(":")
        value = value.strip(" \t")
        if not colon or not TOKEN.fullmatch(name) or BAD_VALUE.search(value):
            raise ProtocolError(f"invalid header line {text[:60]!r}")
        headers.append((name.lower(), value))
    return headers
