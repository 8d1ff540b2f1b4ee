"""The proxy's HTTP client to its upstreams: HTTP/1.1 (jukebox.llm.http1) over trio streams,
with a pool of kept-alive connections.

The proxy forwards every model call, so what its client does per request is added to every
call. httpx's transport (httpcore under it) spent about half of the proxy's CPU per call on the
dev VM: a pool built for limits the proxy does not set, a request and response model per call,
a timeout scope around every read and write, and its own h11 bookkeeping. This client keeps
what matters and nothing else: one connection per upstream socket, kept alive and reused (no
TCP or TLS handshake per call once one is open), the timeouts, and the decoding of the
compressions the proxy asks for (gzip, deflate). Requests and responses are encoded and parsed
by jukebox.llm.http1 (h11's events cost about 150 µs a streamed call), and a plain TCP socket
is read and written without trio's scheduling rounds when it is ready (jukebox.llm.fastio).
When the caller allows it (`may_spin`), a wait for an upstream that answered fast last time
polls the socket before it sleeps (jukebox.spin.Spin), learnt per origin for the head
and for the body's next bytes apart.

Bytes go upstream as the agent sent them: the target is the agent's own
(jukebox.llm.http1_agent validated it on the way in), never re-encoded. An idle connection is
reused only if it is younger than KEEPALIVE_EXPIRY_S and the upstream has not closed it (its
socket is not readable), as httpx's pool does.

The environment's proxy variables (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`) still
apply: an upstream origin that `urllib.request` says is not bypassed goes through httpx's
transport with that proxy (decided once per origin); its response is adapted to this module's.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
import urllib.request
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import trio

from jukebox.errors import JukeboxError
from jukebox.llm.fastio import fileno, read_some, spin_read, try_read, try_write, write_all
from jukebox.llm.http1 import ClosedEarly, Head, ProtocolError, ResponseReader, encode_request
from jukebox.spin import Spin

# What the client asks upstream for (the agent's own accept-encoding is not forwarded: it gets
# the decoded bytes the tape records).
ACCEPT_ENCODING = ("accept-encoding", "gzip, deflate")
READ_SIZE = 65536
# Idle connections kept per origin, and for how long (httpx's defaults): an upstream or a NAT on
# the way forgets an idle connection sooner or later, and a request sent on one it forgot would
# wait for the read timeout.
MAX_IDLE_PER_ORIGIN = 20
KEEPALIVE_EXPIRY_S = 5.0
# URLs parsed once: an agent calls the same few endpoints again and again.
_URL_CACHE_SIZE = 256
# The longest the client busy-polls for an upstream's answer (jukebox.spin.Spin): its
# head after the request, and the body's next bytes. An upstream on this host (a local model
# server, the tests' fake one) answers within it, a remote API never does, and from its
# second call on costs no spinning at all.
SPIN_CAP_NS = 2_000_000


@dataclass(frozen=True)
class Timeouts:
    connect: float = 30.0
    read: float = 600.0
    write: float = 60.0


class UpstreamError(JukeboxError):
    """The upstream could not be reached, or broke off a response. The message names the
    upstream by host and port only (never a path, which may hold a secret)."""


@dataclass(frozen=True)
class UpstreamRequest:
    method: str
    url: str
    headers: list[tuple[str, str]]
    content: bytes


class UpstreamResponse(Protocol):
    status_code: int
    headers: list[tuple[str, str]]  # names lower-case, as received

    def header(self, name: str) -> str | None: ...

    def buffered(self) -> list[bytes]: ...

    async def next_chunks(self) -> list[bytes]: ...

    def aiter_chunks(self) -> AsyncIterator[list[bytes]]: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    @property
    def name(self) -> str:
        return f"{self.scheme}://{self.netloc}"


class _Decoder:
    """Undoes the content-encodings of a response (gzip, deflate; identity)."""

    def __init__(self, encodings: list[str]) -> None:
        self._steps: list[Any] = []
        for encoding in reversed(encodings):  # the last applied is undone first
            if encoding in ("gzip", "x-gzip"):
                self._steps.append(zlib.decompressobj(zlib.MAX_WBITS | 16))
            elif encoding == "deflate":
                self._steps.append(_Deflate())
            elif encoding not in ("identity", ""):
                raise UpstreamError(
                    f"the upstream answered with content-encoding {encoding!r}, which the proxy "
                    "did not ask for and cannot decode"
                )

    def decode(self, data: bytes) -> bytes:
        try:
            for step in self._steps:
                data = step.decompress(data)
        except zlib.error as error:
            raise UpstreamError(f"the upstream's compressed body is corrupt: {error}") from None
        return data

    def flush(self) -> bytes:
        data = b""
        try:
            for step in self._steps:
                data = step.decompress(data) + step.flush()
        except zlib.error as error:
            raise UpstreamError(f"the upstream's compressed body is corrupt: {error}") from None
        return data


class _Deflate:
    """'deflate' is zlib-wrapped by the standard and raw in some servers: tried in that order."""

    def __init__(self) -> None:
        self._inner = zlib.decompressobj()
        self._first = True

    def decompress(self, data: bytes) -> bytes:
        if self._first and data:
            self._first = False
            try:
                return self._inner.decompress(data)
            except zlib.error:
                self._inner = zlib.decompressobj(-zlib.MAX_WBITS)
        return self._inner.decompress(data)

    def flush(self) -> bytes:
        return self._inner.flush()


class _Connection:
    """One socket to an upstream, with the response being read on it; back in the pool after
    a clean cycle."""

    def __init__(self, stream: trio.abc.Stream, sock: trio.socket.SocketType) -> None:
        self.stream = stream
        self.sock = sock  # the TCP socket under the stream, for the liveness check
        self.fd = fileno(stream)  # a plain TCP stream's, read and written without trio's rounds
        self.reader = ResponseReader()
        self.idle_since = 0.0
        # The origin's (shared by its connections): how long its head, and its body's next
        # bytes, were last waited for.
        self.head_spin = self.body_spin = _NO_SPIN

    def usable(self, now: float) -> bool:
        """An idle connection the upstream still holds open (nothing to read, no EOF)."""
        if now - self.idle_since > KEEPALIVE_EXPIRY_S:
            return False
        try:
            readable, _, _ = select.select([self.sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable  # EOF, or bytes nobody asked for: not reusable

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await trio.aclose_forcefully(self.stream)


_NO_SPIN = Spin(0)


class _Response:
    """A response on one of the pool's connections, its body read on demand."""

    def __init__(
        self, client: UpstreamClient, origin: _Origin, conn: _Connection, head: Head
    ) -> None:
        self._client = client
        self._origin = origin
        self._conn: _Connection | None = conn
        self.status_code = head.status
        self.headers = head.headers
        encodings = [
            part.strip().lower()
            for k, v in self.headers
            if k == "content-encoding"
            for part in v.split(",")
        ]
        self._decoder = _Decoder(encodings) if encodings else None
        self._done = conn.reader.done

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def buffered(self) -> list[bytes]:
        """The body's HTTP chunks already received, decoded, taken without waiting: those that
        came with the head, else those the socket holds by now (one read that does not wait).
        An upstream that writes its head and its first events apart has often sent both by
        the time the proxy is scheduled to pass the head on: taken now, they go to the agent
        with the head in one write, which wakes it once instead of twice."""
        conn = self._conn
        if conn is None or self._done:
            return []
        parts = self._drain(conn)
        if parts or self._done:
            return parts
        spin = conn.body_spin
        try:
            data = try_read(conn.fd, READ_SIZE)
            if data is None and conn.fd is not None and spin.budget_ns and self._client.may_spin():
                started = time.monotonic_ns()
                data = spin_read(conn.fd, READ_SIZE, spin.budget_ns)
                # Not there within the budget: no poll again until a wait is short again.
                waited = time.monotonic_ns() - started if data is not None else spin.cap_ns + 1
                spin.observed(waited)
        except (trio.BrokenResourceError, OSError) as error:
            raise UpstreamError(f"{self._origin.name} broke the connection: {error}") from None
        if data is None:
            return []
        conn.reader.feed(data)
        return self._drain(conn)

    def _drain(self, conn: _Connection) -> list[bytes]:
        """The HTTP chunks the last reads brought, all of them: an upstream writing each SSE
        event as a chunk of its own sends several per read, and the proxy passes them on in
        one write (framed as they came) rather than one write, and one wake-up of the agent,
        each. Sets `_done` at the end of the body."""
        try:
            parts = conn.reader.body()
        except ProtocolError as error:
            raise UpstreamError(f"{self._origin.name} broke off the response: {error}") from None
        decoder = self._decoder
        if decoder is not None:
            parts = [data for data in map(decoder.decode, parts) if data]
        if conn.reader.done:
            self._done = True
            tail = decoder.flush() if decoder is not None else b""
            if tail:
                parts.append(tail)
        return parts

    async def next_chunks(self) -> list[bytes]:
        """The body's next HTTP chunks, decoded: those received and not yet taken, else those
        the next read brings; [] at the end of the body. A plain call per read, where an async
        generator costs two of them per step on every stream's path."""
        conn = self._conn
        while conn is not None and not self._done:
            parts = self._drain(conn)
            if parts:
                return parts
            if self._done:
                break
            await self._client._receive(conn, self._origin, conn.body_spin)
        return []

    async def aiter_chunks(self) -> AsyncIterator[list[bytes]]:
        """The body's HTTP chunks, decoded, as each read brings them (never an empty list)."""
        while parts := await self.next_chunks():
            yield parts

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for parts in self.aiter_chunks():
            yield b"".join(parts)

    async def aread(self) -> bytes:
        """The whole body: at once when it came with the head, as a JSON answer mostly does
        (two async generators a call cost more than the rest of taking it)."""
        conn = self._conn
        parts: list[bytes] = []
        while conn is not None and not self._done:
            parts += self._drain(conn)
            if not self._done:
                await self._client._receive(conn, self._origin, conn.body_spin)
        return b"".join(parts)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done:
            self._client._release(self._origin, conn)
        else:  # the body was not read to its end: the connection is in no state to reuse
            await conn.aclose()


class _ProxiedResponse:
    """httpx's response through an environment proxy, as this module's."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self.status_code = response.status_code
        self.headers = list(response.headers.multi_items())
        self._chunks: AsyncGenerator[bytes, None] | None = None  # next_chunks' place in the body

    def buffered(self) -> list[bytes]:
        return []

    def header(self, name: str) -> str | None:
        value = self._response.headers.get(name)
        return value if isinstance(value, str) else None

    async def aiter_bytes(self) -> AsyncGenerator[bytes, None]:
        import httpx

        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as error:
            raise UpstreamError(repr(error)) from None

    async def next_chunks(self) -> list[bytes]:
        if self._chunks is None:
            self._chunks = self.aiter_bytes()
        async for chunk in self._chunks:  # resumed where the last call left it
            if chunk:
                return [chunk]
        return []

    async def aiter_chunks(self) -> AsyncIterator[list[bytes]]:
        async for chunk in self.aiter_bytes():
            if chunk:
                yield [chunk]

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aclose(self) -> None:
        if self._chunks is not None:
            await self._chunks.aclose()
        await self._response.aclose()


class UpstreamClient:
    def __init__(self, timeouts: Timeouts | None = None) -> None:
        self._timeouts = timeouts or Timeouts()
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._urls: dict[str, tuple[_Origin, str]] = {}
        # {(scheme, host, port): an httpx transport through the environment's proxy, or None}
        self._routes: dict[tuple[str, str, int], Any] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        self._spins: dict[tuple[str, str, int], tuple[Spin, Spin]] = {}
        # Whether a wait may busy-poll (never, unless the caller says): a poll holds the event
        # loop, so the caller says when no other exchange is being served (the proxy: one call
        # in flight).
        self.may_spin: Callable[[], bool] = lambda: False

    def request(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], content: bytes
    ) -> UpstreamRequest:
        return UpstreamRequest(method, url, [*headers, ACCEPT_ENCODING], content)

    async def send(
        self, request: UpstreamRequest, meanwhile: Callable[[], object] | None = None
    ) -> UpstreamResponse:
        """The response with its body unread (`aiter_bytes`, `aread`; then `aclose`).
        `meanwhile()` is called once the request is on its way, before its answer is awaited:
        work that would otherwise wait for the answer and then delay it."""
        origin, target = self._split(request.url)
        proxied = self._proxied(origin)
        if proxied is not None:
            if meanwhile is not None:
                meanwhile()
            return await self._send_proxied(proxied, request)
        try:
            data = encode_request(
                request.method,
                target,
                [
                    ("host", origin.netloc),
                    *request.headers,
                    ("content-length", str(len(request.content))),
                ],
                request.content,
            )
        except ProtocolError as error:
            raise UpstreamError(f"the request cannot be sent as HTTP/1.1: {error}") from None
        conn = await self._connection(origin)
        conn.reader = ResponseReader(head_request=request.method == "HEAD")
        try:
            sent = try_write(conn.fd, data)  # nearly always all of it: no deadline needed
            if sent < len(data):
                with trio.fail_after(self._timeouts.write):  # a scope only: no checkpoint
                    await write_all(conn.stream, conn.fd, data[sent:])
            if meanwhile is not None:
                meanwhile()
            while True:
                head = conn.reader.head()
                if head is not None:
                    return _Response(self, origin, conn, head)
                await self._receive(conn, origin, conn.head_spin)
        except trio.TooSlowError:
            await conn.aclose()
            raise UpstreamError(f"sending to {origin.name} timed out") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            await conn.aclose()
            raise UpstreamError(f"{origin.name} broke the connection: {error}") from None
        except ClosedEarly:
            await conn.aclose()
            raise UpstreamError(f"{origin.name} closed the connection without answering") from None
        except ProtocolError as error:
            await conn.aclose()
            raise UpstreamError(f"{origin.name} answered invalid HTTP: {error}") from None
        except UpstreamError:
            await conn.aclose()
            raise

    async def _receive(self, conn: _Connection, origin: _Origin, spin: Spin) -> None:
        try:
            data = try_read(conn.fd, READ_SIZE)  # there already: no deadline needed
            if data is None and conn.fd is not None:  # not tried again before the wait
                started = time.monotonic_ns()
                if spin.budget_ns and self.may_spin():
                    data = spin_read(conn.fd, READ_SIZE, spin.budget_ns)
                if data is None:
                    with trio.fail_after(self._timeouts.read):
                        data = await read_some(conn.stream, conn.fd, READ_SIZE, wait_first=True)
                spin.observed(time.monotonic_ns() - started)
            elif data is None:
                with trio.fail_after(self._timeouts.read):
                    data = await read_some(conn.stream, conn.fd, READ_SIZE)
        except trio.TooSlowError:
            raise UpstreamError(
                f"{origin.name} sent nothing for {self._timeouts.read:g} s"
            ) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            raise UpstreamError(f"{origin.name} broke the connection: {error}") from None
        conn.reader.feed(data)

    def _split(self, url: str) -> tuple[_Origin, str]:
        """(origin, request target) of an upstream URL, parsed once per URL."""
        cached = self._urls.get(url)
        if cached is not None:
            return cached
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"the upstream URL is not http(s)://HOST/...: {parts.scheme}://")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise UpstreamError("the upstream URL has an invalid port") from None
        origin = _Origin(parts.scheme, parts.hostname, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if len(self._urls) >= _URL_CACHE_SIZE:
            self._urls.clear()
        self._urls[url] = (origin, target)
        return origin, target

    async def _connection(self, origin: _Origin) -> _Connection:
        idle = self._idle.get(origin.key)
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if conn.usable(now):
                    return conn
                await conn.aclose()
        conn = await self._connect(origin)
        spins = self._spins.get(origin.key)
        if spins is None:
            spins = self._spins[origin.key] = (Spin(SPIN_CAP_NS), Spin(SPIN_CAP_NS))
        conn.head_spin, conn.body_spin = spins
        return conn

    async def _connect(self, origin: _Origin) -> _Connection:
        try:
            with trio.fail_after(self._timeouts.connect):
                tcp = await trio.open_tcp_stream(origin.host, origin.port)
                tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                stream: trio.abc.Stream = tcp
                if origin.scheme == "https":
                    tls = trio.SSLStream(
                        tcp, self._ssl_context(), server_hostname=origin.host,
                        https_compatible=True,
                    )
                    await tls.do_handshake()
                    stream = tls
        except trio.TooSlowError:
            raise UpstreamError(f"connecting to {origin.name} timed out") from None
        except (OSError, trio.BrokenResourceError) as error:
            raise UpstreamError(f"could not connect to {origin.name}: {error}") from None
        return _Connection(stream, tcp.socket)

    def _release(self, origin: _Origin, conn: _Connection) -> None:
        """Back to the pool after a complete exchange, if both sides may go on."""
        if self._closed or not conn.reader.reusable:
            self._close_later(conn)
            return
        idle = self._idle.setdefault(origin.key, [])
        if len(idle) >= MAX_IDLE_PER_ORIGIN:
            self._close_later(conn)
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _close_later(self, conn: _Connection) -> None:
        # Closing a plain socket needs no await; a TLS stream's close_notify is skipped (the
        # upstream sees the TCP close, as when httpx's pool drops a connection).
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            import httpx  # its trust store (certifi, SSL_CERT_FILE), as before this client

            self._ssl = httpx.create_ssl_context()
        return self._ssl

    # ------------------------------------------------------------------ environment proxies

    def _proxied(self, origin: _Origin) -> Any:
        key = origin.key
        if key not in self._routes:
            self._routes[key] = self._route(origin)
        return self._routes[key]

    def _route(self, origin: _Origin) -> Any:
        proxies = urllib.request.getproxies()
        proxy = proxies.get(origin.scheme) or proxies.get("all")
        if not proxy or urllib.request.proxy_bypass(origin.host):
            return None
        import httpx

        return httpx.AsyncHTTPTransport(
            http2=False, proxy=proxy if "://" in proxy else f"http://{proxy}"
        )

    async def _send_proxied(self, transport: Any, request: UpstreamRequest) -> UpstreamResponse:
        import httpx

        try:
            sent = httpx.Request(
                request.method, request.url, headers=request.headers, content=request.content
            )
            t = self._timeouts
            sent.extensions["timeout"] = {
                "connect": t.connect, "read": t.read, "write": t.write, "pool": t.connect
            }
            response = await transport.handle_async_request(sent)
        except httpx.HTTPError as error:
            raise UpstreamError(repr(error)) from None
        response.request = sent
        return _ProxiedResponse(response)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                await conn.aclose()
        self._idle.clear()
        for transport in self._routes.values():
            if transport is not None:
                await transport.aclose()
