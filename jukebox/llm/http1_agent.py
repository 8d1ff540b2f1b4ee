"""HTTP/1.1 on the server side, as the proxy's agent side needs it: a request's head parsed once
complete (so a request without the proxy's secret is refused before its body is read), its body
framed by length or by chunks, and a response's head, body and end framed for the agent.

h11 did this before, and on the path of every model call it cost more than anything else the
proxy did there (about 110 µs of a JSON call's CPU on the dev VM, warm: a regex per header, an
event object and a state machine step per head, chunk and end, both ways). What an agent sends
is untrusted, so this refuses what h11 refused, or more: a request line or header that is not
HTTP/1.x (400), a folded header line, a control character in a value, a missing or repeated
`Host` in HTTP/1.1, conflicting or invalid lengths, both a length and chunks (400), any
transfer-coding but `chunked` (501), a head past 64 KiB (431). A connection closed mid-request
is the agent gone. Keep-alive follows the request (HTTP/1.1 without `Connection: close`), and
the bytes after a request (a pipelined next one) wait for the next cycle. A response without a
length goes chunked to an HTTP/1.1 agent and to the close to an HTTP/1.0 one; a `HEAD` request,
204 and 304 get no body.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from jukebox.llm.http1 import (
    BAD_VALUE,
    HEAD_END,
    MAX_HEAD_BYTES,
    TOKEN,
    BodyReader,
    ProtocolError,
    parse_fields,
)

_REQUEST_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+) ([\x21-\x7e]+) HTTP/1\.([01])\r?")
# Framing is the writer's to set; a caller's own framing headers are dropped.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})


class BadRequest(ProtocolError):
    """What the agent sent is not a request the proxy reads; `status` is the answer's."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Request:
    method: str
    target: str  # as sent (latin-1)
    headers: list[tuple[str, str]]  # names lower-case
    http11: bool


class AgentConnection:
    """One connection from an agent: `feed` it what the socket gave (b"" at its end), take each
    request with `request()`, then its body with `body()` until `body_done`; answer with
    `head()`, `data()` and `end()`; `next_cycle()` before the next request, when `reusable`."""

    def __init__(self) -> None:
        self._reader = BodyReader()
        self._request: Request | None = None
        self.closed = False  # the agent's end is closed (no complete request will come)
        self.keep_alive = True
        self.started = False  # a response's head went out
        self._chunked = False
        self._no_body = False
        self._ended = False

    def feed(self, data: bytes) -> None:
        if not data:
            self.closed = True
        self._reader.feed(data)

    def request(self) -> Request | None:
        """The request, once its head is complete; None while more is needed (or, when
        `closed`, will never come). Raises BadRequest."""
        if self._request is not None:
            return self._request
        buf = self._reader.pending
        while buf[:2] == b"\r\n" or buf[:1] == b"\n":  # RFC 9112 2.2: ignore empty lines first
            del buf[: 2 if buf[:1] == b"\r" else 1]
        end = HEAD_END.search(buf)
        if end is None:
            if len(buf) > MAX_HEAD_BYTES:
                raise BadRequest("the request head is too large", 431)
            return None
        if end.start() > MAX_HEAD_BYTES:
            raise BadRequest("the request head is too large", 431)
        lines = bytes(buf[: end.start()]).split(b"\n")
        del buf[: end.end()]
        first = _REQUEST_LINE.fullmatch(lines[0])
        if first is None:
            raise BadRequest(f"invalid request line {lines[0][:60]!r}")
        try:
            headers = parse_fields(lines[1:])
        except ProtocolError as error:
            raise BadRequest(str(error)) from None
        http11 = first.group(3) == b"1"
        hosts = 0
        lengths: set[str] = set()
        codings: list[str] = []
        for name, value in headers:
            if name == "host":
                hosts += 1
            elif name == "content-length":
                lengths.update(v.strip() for v in value.split(","))
            elif name == "transfer-encoding":
                if codings:
                    raise BadRequest("more than one transfer-encoding header", 501)
                codings = [t.strip().lower() for t in value.split(",") if t.strip()] or [""]
            elif name == "connection" and "close" in _tokens(value):
                self.keep_alive = False
        if (http11 and hosts == 0) or hosts > 1:
            raise BadRequest("an HTTP/1.1 request needs exactly one Host header")
        if codings and codings != ["chunked"]:
            raise BadRequest("only transfer-encoding: chunked is supported", 501)
        if codings and lengths:  # RFC 9112 6.1: a server may refuse it, and a smuggler sends it
            raise BadRequest("a request with both transfer-encoding and content-length")
        try:
            self._reader.frame(codings, lengths, until_close=False)
        except ProtocolError as error:
            raise BadRequest(str(error)) from None
        self.keep_alive = self.keep_alive and http11
        self._request = Request(
            first.group(1).decode("ascii"), first.group(2).decode("latin-1"), headers, http11
        )
        return self._request

    def body(self) -> list[bytes]:
        """The request body's bytes that came since the last call (see `body_done`).
        Raises BadRequest."""
        try:
            return self._reader.body()
        except ProtocolError as error:
            if self.closed:
                return []  # cut short: the agent is gone (`body_done` stays false)
            raise BadRequest(str(error)) from None

    @property
    def body_done(self) -> bool:
        return self._reader.done

    def head(
        self,
        status: int,
        headers: Iterable[tuple[str, str]] = (),
        *,
        length: int | None = None,
        checked: Iterable[tuple[str, str]] = (),
        close: bool = False,
    ) -> bytes:
        """The response's head: `headers` validated, `checked` ones (an upstream's, parsed and
        validated by the proxy's client) as they are, and the framing: `length`, else chunked
        to an HTTP/1.1 agent, else the body runs to the close. Values go out as the bytes they
        were read from (latin-1), or as UTF-8 when they hold other characters."""
        request = self._request
        self.started = True
        self._no_body = status in (204, 304) or (request is not None and request.method == "HEAD")
        lines = [b"HTTP/1.1 %d \r\n" % status]
        for name, value in headers:
            if not TOKEN.fullmatch(name) or BAD_VALUE.search(value):
                raise ProtocolError(f"invalid response header {name!r}")
            if name.lower() not in _FRAMING:
                lines.append(_field(name, value))
        for name, value in checked:
            if name.lower() not in _FRAMING:
                lines.append(_field(name, value))
        if length is not None:
            lines.append(b"content-length: %d\r\n" % length)
        elif status not in (204, 304):
            if request is not None and request.http11:
                self._chunked = not self._no_body
                lines.append(b"transfer-encoding: chunked\r\n")
            elif not self._no_body:
                self.keep_alive = False  # the body runs to the close
        if close:
            self.keep_alive = False
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def data(self, data: bytes) -> bytes:
        """`data` framed as the body's next part."""
        if self._no_body or not data:
            return b""
        if self._chunked:
            return b"%x\r\n%b\r\n" % (len(data), data)
        return data

    def end(self) -> bytes:
        """The body's end."""
        self._ended = True
        return b"0\r\n\r\n" if self._chunked else b""

    @property
    def reusable(self) -> bool:
        """Whether another request may follow on this connection."""
        return self.keep_alive and self._ended and self._reader.done and not self.closed

    def next_cycle(self) -> None:
        """Ready for the next request; what came after this one (pipelined) is kept."""
        self._reader = BodyReader(self._reader.pending)
        self._request = None
        self.started = self._chunked = self._no_body = self._ended = False


def _tokens(value: str) -> list[str]:
    return [t.strip().lower() for t in value.split(",")]


def _field(name: str, value: str) -> bytes:
    try:
        raw = value.encode("latin-1")
    except UnicodeEncodeError:  # httpx decoded it as UTF-8
        raw = value.encode()
    return b"%b: %b\r\n" % (name.encode("latin-1"), raw)
