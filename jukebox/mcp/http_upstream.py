"""The HTTP relay's POSTs to a plain-HTTP server (jukebox.mcp.http_relay): HTTP/1.1 by the
project's own parser (jukebox.llm.http1, the LLM proxy's, careful with what an untrusted
upstream sends) over kept-alive TCP sockets of the gateway's event loop.

httpx and httpcore under it were a third of the booth's HTTP gateway's CPU per relayed call
(cProfile, docs/mcp.md "Speed"): a request and a response model per call, a timeout scope
around every read and write, h11's state machine and its regex per header on both ways, the
head and the body written apart (two segments, so the server woke twice). Here a request is one
write, a response head one parse, and the body's bytes are handed on as they come. The relay's
own deadline bounds the whole exchange, so no read needs a timeout of its own.

Only where httpx would have done nothing more: an `http://` URL (TLS stays with httpx), no
proxy of the environment's for it (HttpRelay._direct), no cookie set by the server. A response
is handed back as httpx's errors would have said it (httpx2.TransportError), so the relay treats
both paths alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncGenerator
from urllib.parse import urlsplit

import anyio

from jukebox.llm.http1 import ProtocolError, ResponseReader, encode_request

# Read size per recv: an MCP answer rarely holds more, and a larger one is read in turns.
READ_BYTES = 256 * 1024
# Idle connections kept for the next calls; more (many calls at once) are closed when done.
IDLE_KEPT = 8
# How long the end of a server's event stream is waited for once the call's answer came, and
# how many bytes of it are read, before the connection is closed instead of kept (as
# jukebox.mcp.servers._keep_alive does for the SDK's client).
DRAIN_WAIT = 0.1
DRAIN_BYTES = 64 * 1024


class Headers(dict[str, str]):
    """A response's headers by lower-case name (a repeated one: its values joined by ', ')."""


class Response:
    """One response to a POST: its status and headers, its body as it comes (`stream`);
    `aclose` gives its connection back (read to its end) or closes it."""

    def __init__(self, upstream: PlainUpstream, sock: socket.socket, reader: ResponseReader,
                 status: int, headers: Headers) -> None:  # fmt: skip
        self._upstream = upstream
        self._sock = sock
        self._reader = reader
        self.status_code = status
        self.headers = headers
        self._closed = False
        self.stream = self._body()

    async def _body(self) -> AsyncGenerator[bytes, None]:
        import httpx2

        reader = self._reader
        loop = asyncio.get_running_loop()
        try:
            while True:
                for part in reader.body():
                    yield part
                if reader.done:
                    return
                data = await loop.sock_recv(self._sock, READ_BYTES)
                reader.feed(data)
        except ProtocolError as error:
            raise httpx2.RemoteProtocolError(str(error)) from None
        except OSError as error:
            raise httpx2.ReadError(str(error)) from None

    async def aread(self) -> bytes:
        return b"".join([part async for part in self.stream])

    async def aclose(self) -> None:
        """Reads what is left of the body (at most DRAIN_BYTES within DRAIN_WAIT), so that the
        connection serves the next call; closes it otherwise."""
        if self._closed:
            return
        self._closed = True
        reader = self._reader
        if not reader.done and self._upstream.drain:
            seen = 0
            try:
                with anyio.move_on_after(DRAIN_WAIT) as waited:
                    async for part in self.stream:
                        seen += len(part)
                        if seen > DRAIN_BYTES:
                            break
                if waited.cancelled_caught:
                    # A server that holds its stream open past the answer: not waited for again.
                    self._upstream.drain = False
            except Exception:  # a broken stream: the connection is closed below
                pass
        with contextlib.suppress(Exception):
            await self.stream.aclose()
        self._upstream.release(self._sock, reader.reusable)


class PlainUpstream:
    """Kept-alive connections to one plain-HTTP origin, and the POST the relay makes on them."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.authority = parts.netloc.rpartition("@")[2]
        self.idle: list[socket.socket] = []
        self.drain = True

    @staticmethod
    def serves(url: str) -> bool:
        parts = urlsplit(url)
        return parts.scheme == "http" and not parts.username and not parts.password

    async def post(self, body: bytes, headers: list[tuple[str, str]]) -> Response:
        """POSTs `body` with `headers` (host and content-length added here); the response with
        its head read. Raises httpx2's errors for what httpx would have refused."""
        import httpx2

        fields = [("host", self.authority), *headers, ("content-length", str(len(body)))]
        request = encode_request("POST", self.target, fields, body)
        loop = asyncio.get_running_loop()
        sock = self._idle()
        if sock is None:
            sock = await self._connect()
        reader = ResponseReader()
        try:
            await loop.sock_sendall(sock, request)
            while True:
                head = reader.head()
                if head is not None:
                    break
                reader.feed(await loop.sock_recv(sock, READ_BYTES))
        except BaseException as error:
            sock.close()
            if isinstance(error, ProtocolError):
                raise httpx2.RemoteProtocolError(str(error)) from None
            if isinstance(error, OSError):
                raise httpx2.ReadError(str(error)) from None
            raise
        found = Headers()
        for name, value in head.headers:
            found[name] = f"{found[name]}, {value}" if name in found else value
        return Response(self, sock, reader, head.status, found)

    def _idle(self) -> socket.socket | None:
        """A kept connection the server has not closed (its socket not readable), or None."""
        while self.idle:
            sock = self.idle.pop()
            try:
                sock.recv(1, socket.MSG_PEEK)  # non-blocking: raises while nothing came
            except BlockingIOError:
                return sock
            except OSError:
                pass
            sock.close()  # closed by the server (b""), or it sent what nobody asked for
        return None

    async def _connect(self) -> socket.socket:
        import httpx2

        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                           proto=socket.IPPROTO_TCP)  # fmt: skip
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as error:
            raise httpx2.ConnectError(str(error)) from None
        try:
            sock.setblocking(False)
            # Each request is one write and waits for its answer: nothing gained by Nagle.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
        except BaseException as error:
            sock.close()
            if isinstance(error, OSError):
                raise httpx2.ConnectError(str(error)) from None
            raise
        return sock

    def release(self, sock: socket.socket, reusable: bool) -> None:
        if reusable and len(self.idle) < IDLE_KEPT:
            self.idle.append(sock)
        else:
            sock.close()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()
