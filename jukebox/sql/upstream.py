"""The proxy's connection to the real PostgreSQL server: the URL it is named by, startup, TLS
and authentication (trust, password, md5, SCRAM-SHA-256 through `scramp`), and simple queries
of the proxy's own.

After startup the connection is a plain message stream: the agent's messages are forwarded on
it byte for byte, so types, formats and errors reach the agent exactly as the server made them.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket
import ssl
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from jukebox.errors import JukeboxError
from jukebox.spin import CPUS, Spin, runnable
from jukebox.sql import messages as m

# The savepoint of the agent's unit of work or transaction block (jukebox.sql.session).
SAVEPOINT_TX = "SAVEPOINT jukebox_tx"
RELEASE_TX = "RELEASE SAVEPOINT jukebox_tx"


class UpstreamError(JukeboxError):
    """The server refused or failed something the proxy itself asked."""

    def __init__(self, text: str, fields: dict[str, str] | None = None) -> None:
        super().__init__(text)
        self.fields = fields or {}

    @property
    def code(self) -> str:
        return self.fields.get("C", "")


@dataclass(frozen=True)
class Target:
    """Where `--pg NAME=postgresql://user[:password]@host[:port]/db[?sslmode=…]` points."""

    host: str
    port: int
    user: str
    database: str
    password: str | None = None
    sslmode: str = "prefer"
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError("it is not a postgresql:// URL")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        # A Unix socket's directory is the host, percent-encoded in the authority
        # (postgresql://me@%2Fvar%2Frun%2Fpostgresql/db) or as ?host=/var/run/postgresql.
        netloc_host = unquote(parts.netloc.rpartition("@")[2].partition(":")[0])
        host = (netloc_host if netloc_host.startswith("/") else parts.hostname) or query.pop(
            "host", "") or "127.0.0.1"
        query.pop("host", None)
        if host.startswith("/") and not os.path.isabs(os.path.normpath(host)):
            raise ValueError(f"the socket directory {host} is not an absolute path")
        try:
            port = parts.port or int(query.pop("port", "5432"))
        except ValueError:
            raise ValueError("its port is not a number") from None
        user = unquote(parts.username or "") or os.environ.get("PGUSER", "") or "postgres"
        database = unquote(parts.path.lstrip("/")) or user
        password = unquote(parts.password) if parts.password is not None else None
        if password is None:
            password = os.environ.get("PGPASSWORD")
        sslmode = query.pop("sslmode", os.environ.get("PGSSLMODE", "prefer"))
        if sslmode not in ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"):
            raise ValueError(f"sslmode={sslmode} is not one PostgreSQL knows")
        return cls(host, port, user, database, password, sslmode, query)

    @property
    def unix_socket(self) -> str | None:
        """The server's socket file, when the host is a directory (libpq's convention)."""
        if self.host.startswith("/"):
            return os.path.join(self.host, f".s.PGSQL.{self.port}")
        return None

    def public_url(self) -> str:
        """The URL without its password: what a tape or a message may show."""
        host = quote(self.host, safe="") if self.unix_socket else self.host
        return f"postgresql://{self.user}@{host}:{self.port}/{self.database}"

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A plain connection to the server, by TCP or its Unix socket."""
        path = self.unix_socket
        if path is not None:
            return await asyncio.open_unix_connection(path)
        return await asyncio.open_connection(self.host, self.port)


    async def open_socket(self) -> socket.socket:
        """A connected non-blocking socket to the server, by TCP or its Unix socket."""
        loop = asyncio.get_running_loop()
        path = self.unix_socket
        if path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            where: tuple[Any, ...] | str = path
        else:
            info = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, kind, proto, _, where = info[0]
            sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, where)
            if path is None:
                # The proxy's own SAVEPOINT and the agent's message go at once.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        return sock


class Wire:
    """The server connection's bytes, read and written on the socket itself (an
    ssl.SSLSocket in non-blocking mode once TLS is on), waiting through the event loop's
    add_reader/add_writer only when the socket has nothing.

    asyncio's streams cost the proxy its largest share per statement: with TLS their
    Python protocol layers (sslproto) about doubled what a statement's round trip to the
    server took, even without TLS StreamReader's futures added turns of the loop."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket = sock
        self.fd = sock.fileno()
        self.loop = asyncio.get_running_loop()
        self.buf = bytearray()
        self.at = 0  # what of `buf` was read already
        self.out = bytearray()
        # A TLS write that could not finish is retried with the very same bytes (OpenSSL's
        # rule), before anything else.
        self.retry: bytes | None = None
        self.writing = False  # waiting for the socket to take `out`
        self.error: BaseException | None = None
        # The socket stays registered for reading with the loop between waits (`_readable`):
        # adding and removing it around every wait cost two epoll_ctl calls a statement.
        self.watching = False
        self.waiter: _Waiter | None = None
        self.unasked = 0  # calls of `_readable` in a row with nobody waiting
        # While an agent connection reads the server's answer to its statement: how long to
        # poll for it before sleeping (its own, learnt from its last answers); None: sleep.
        self.spin: Spin | None = None
        # Whether a wait teaches `spin` how long the next may take: not a wait for the
        # replies to the proxy's own bookkeeping (Upstream.settle), which come before the
        # statement's (Upstream.take_ahead's, when the unit is a Query).
        self.learning = True

    # ------------------------------------------------------------------ reading

    def pending(self) -> bool:
        """Whether more bytes are here already (the agent pipelined its next message)."""
        return len(self.buf) > self.at

    async def read_message(self) -> tuple[bytes, bytes]:
        """(type byte, body) of the next message, waiting for the socket as long as it is not
        all here: one coroutine, where m.read_message and its two readexactly were three
        (and their copies), at each of a statement's two waits."""
        while True:
            found = self.next_message()
            if found is not None:
                return found
            if len(self.buf) - self.at >= 5:
                (length,) = _LENGTH.unpack_from(self.buf, self.at + 1)
                if length < 4 or length > m.MAX_MESSAGE:
                    return await m.read_message(self)  # its ProtocolError
            await self._fill()

    async def readexactly(self, n: int) -> bytes:
        while len(self.buf) - self.at < n:
            await self._fill()
        data = bytes(self.buf[self.at : self.at + n])
        self.at += n
        if self.at == len(self.buf):
            self.buf.clear()
            self.at = 0
        return data

    def take_run(self) -> bytes:
        """The messages here in full, up to the first the proxy looks into (`_LOOKED_AT`),
        as they came: they are passed on to the agent in one piece."""
        buf = self.buf
        at = start = self.at
        size = len(buf)
        while size - at >= 5 and buf[at] not in _LOOKED_AT:
            (length,) = _LENGTH.unpack_from(buf, at + 1)
            if length < 4 or length > m.MAX_MESSAGE or at + 1 + length > size:
                break
            at += 1 + length
        if at == start:
            return b""
        data = bytes(buf[start:at])
        if at == size:
            buf.clear()
            self.at = 0
        else:
            self.at = at
        return data

    def skip_own(self, count: int) -> int:
        """Drops the ParseComplete, BindComplete and CommandComplete replies to up to `count`
        of the proxy's own statements here (their notices or an error are left to be read
        one by one); returns how many statements' replies ended."""
        buf = self.buf
        at = self.at
        size = len(buf)
        done = 0
        while done < count and size - at >= 5 and buf[at] in _OWN_REPLIES:
            (length,) = _LENGTH.unpack_from(buf, at + 1)
            if length < 4 or at + 1 + length > size:
                break
            if buf[at] == _COMMAND_COMPLETE:
                done += 1
            at += 1 + length
        if at == size:
            buf.clear()
            self.at = 0
        else:
            self.at = at
        return done

    def next_message(self) -> tuple[bytes, bytes] | None:
        """(type byte, body) of the next message when all of it is here already, else None:
        a statement's replies come in one read, and taking them from the buffer without a
        coroutine per message (m.read_message and its two readexactly) is most of reading
        them."""
        buf, at = self.buf, self.at
        size = len(buf)
        if size - at < 5:
            return None
        (length,) = _LENGTH.unpack_from(buf, at + 1)
        end = at + 1 + length
        if length < 4 or length > m.MAX_MESSAGE or size < end:
            return None  # too long or too short: m.read_message says so
        kind, body = bytes(buf[at : at + 1]), bytes(buf[at + 5 : end])
        if end == size:
            buf.clear()
            self.at = 0
        else:
            self.at = end
        return kind, body

    async def _fill(self) -> None:
        while True:
            if self.error is not None:
                raise self.error
            try:
                chunk = self.sock.recv(262_144)
            except (BlockingIOError, ssl.SSLWantReadError):
                spin = self.spin
                if spin is None:
                    await self._wait_readable()
                    continue
                # The server's answer to a statement: polled for when the answers of this
                # agent connection come quickly (jukebox.spin.Spin), slept for otherwise.
                started = time.monotonic_ns()
                got = (self._poll(spin.budget_ns)
                       if spin.budget_ns and runnable() <= CPUS else None)
                if got is None:
                    await self._wait_readable()
                if self.learning:
                    spin.observed(time.monotonic_ns() - started)
                if got is None:
                    continue
                chunk = got
            except ssl.SSLWantWriteError:
                await self._ready(self.loop.add_writer, self.loop.remove_writer)
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                chunk = b""  # the server closed the session, as a plain EOF says
            if not chunk:
                raise asyncio.IncompleteReadError(b"", None)
            if self.at:
                del self.buf[: self.at]
                self.at = 0
            self.buf += chunk
            return

    def _poll(self, budget_ns: int) -> bytes | None:
        """`recv` again and again for up to `budget_ns`, yielding the CPU between tries (to the
        server's backend, when it shares this CPU): the bytes, or None when the budget ran out
        or the socket has something else to say (the caller's next `recv` reads it as usual).
        Blocks the event loop meanwhile: callers poll only while no other agent connection is
        at work (SqlProxy.busy), and only while no more tasks are runnable than there are CPUs
        (else no CPU would go idle for the poll to save a wake-up of)."""
        end = time.monotonic_ns() + budget_ns
        recv, pause, now = self.sock.recv, os.sched_yield, time.monotonic_ns
        while True:
            try:
                return recv(262_144)
            except (BlockingIOError, ssl.SSLWantReadError):
                pass
            except OSError:  # an end, a reset, a TLS error: `_fill` says it as it always does
                return None
            if now() >= end:
                return None
            pause()

    async def _wait_readable(self) -> None:
        if not self.watching:
            self.loop.add_reader(self.fd, self._readable)
            self.watching = True
        self.waiter = _Waiter(self.loop)
        self.unasked = 0
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _readable(self) -> None:
        waiter = self.waiter
        if waiter is None:
            # Once after every wait (the loop had the readiness that woke it twice, and the
            # reader took the data in between): nothing. Twice in a row, nobody reads (the
            # server closed, or said something unasked): stop watching, or the loop would
            # call this at every turn until someone reads.
            self.unasked += 1
            if self.unasked > 1:
                self.loop.remove_reader(self.fd)
                self.watching = False
        elif not waiter.done():
            waiter.wake()

    async def _ready(self, add: Any, remove: Any) -> None:
        done = self.loop.create_future()
        add(self.fd, _settle, done)
        try:
            await done
        finally:
            remove(self.fd)

    # ------------------------------------------------------------------ writing

    def write(self, data: bytes | bytearray) -> None:
        self.out += data
        if not self.writing:
            self._send()

    def _send(self) -> None:
        try:
            while self.retry is not None or self.out:
                chunk = self.retry
                if chunk is None:
                    chunk = bytes(self.out[:65_536])
                    del self.out[: len(chunk)]
                self.retry = chunk
                sent = self.sock.send(chunk)  # TLS: all of it, or SSLWantWriteError
                self.retry = chunk[sent:] or None
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            if not self.writing:
                self.writing = True
                self.loop.add_writer(self.fd, self._writable)
            return
        except OSError as error:
            # The next read says so, as a lost connection (a TLS error is an OSError too).
            self.error = ConnectionResetError(f"the server's connection failed: {error}")
            self.out.clear()
            self.retry = None
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)

    def _writable(self) -> None:
        self._send()

    async def drain(self) -> None:
        while self.writing and self.error is None:
            await asyncio.sleep(0.001)
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ TLS and closing

    async def start_tls(self, context: ssl.SSLContext, hostname: str) -> None:
        if self.buf or self.out or self.retry:
            raise UpstreamError("the server sent more than its answer to the TLS request")
        tls = context.wrap_socket(self.sock, server_hostname=hostname,
                                  do_handshake_on_connect=False)
        self.sock = tls
        while True:
            try:
                tls.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._wait_readable()
            except ssl.SSLWantWriteError:
                await self._ready(self.loop.add_writer, self.loop.remove_writer)

    def close(self) -> None:
        if self.watching:
            self.watching = False
            self.loop.remove_reader(self.fd)
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)
        self.sock.close()


_LENGTH = struct.Struct("!i")
# The server's messages the relay reads (AgentConnection.relay): CommandComplete, an error,
# ReadyForQuery, CopyInResponse, EmptyQueryResponse, PortalSuspended. The others pass on as
# they are.
_LOOKED_AT = frozenset(b"CEZGIs")
# What the server answers a bookkeeping statement that succeeds (Upstream.skip_prefix).
_OWN_REPLIES = frozenset(b"12C")
_COMMAND_COMPLETE = ord("C")
# The agent's extended-query messages a bookkeeping query can go ahead of (`Upstream.send`).
_EXTENDED = (b"P", b"B", b"D", b"E", b"C")
# Those that may follow the bookkeeping `Upstream.take_ahead` sent before a Sync.
_EXTENDED_AHEAD = (*_EXTENDED, b"H")
SYNC = m.message(b"S")


@functools.lru_cache(maxsize=64)
def _extended(sql: str) -> tuple[bytes, int]:
    """Parse, Bind and Execute of each statement of the proxy's own `sql` (statements joined
    by "; "), unnamed (as a Query would, they replace the agent's unnamed statement and
    portal; the agent's messages that follow make their own), and how many statements."""
    parts = sql.split("; ")
    return b"".join(m.message(b"P", b"\0" + part.encode() + b"\0\0\0")
                    + m.message(b"B", b"\0\0" + b"\0\0" * 3)
                    + m.message(b"E", b"\0\0\0\0\0") for part in parts), len(parts)


class _Waiter:
    """What a Wire's reader waits on until its socket is readable: an awaitable the event
    loop's Task takes as it takes a Future, except that the readiness callback resumes the
    waiting task at once, in the same turn of the loop. A Future's set_result schedules the
    task for the next turn instead: a second epoll and a turn of Python's loop on each of the
    two waits of every statement (the agent's message, the server's answer), and a readiness
    callback for nothing in between, as the socket was still unread."""

    _asyncio_future_blocking = False

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._callbacks: list[tuple[Any, Any]] = []
        self._done = False
        self._cancelled = False

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        if self._done:
            self._loop.call_soon(fn, self, context=context)
        else:
            self._callbacks.append((fn, context))

    def remove_done_callback(self, fn: Any) -> int:
        before = len(self._callbacks)
        self._callbacks = [(f, c) for f, c in self._callbacks if f != fn]
        return before - len(self._callbacks)

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self, msg: Any = None) -> bool:
        if self._done:
            return False
        self._done = self._cancelled = True
        callbacks, self._callbacks = self._callbacks, []
        for fn, context in callbacks:  # as a Future does: on the next turn
            self._loop.call_soon(fn, self, context=context)
        return True

    def result(self) -> None:
        if self._cancelled:
            raise asyncio.CancelledError
        return None

    def exception(self) -> BaseException | None:
        if self._cancelled:
            raise asyncio.CancelledError
        return None

    def wake(self) -> None:
        """Readable: the waiting task runs now (only ever called by the loop's readiness
        callback, never from inside a task)."""
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        for fn, context in callbacks:
            if context is None:
                fn(self)
            else:
                context.run(fn, self)

    def __await__(self) -> Any:
        if not self._done:
            self._asyncio_future_blocking = True
            yield self
        return self.result()


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


class Upstream:
    """One authenticated server session, read and written as messages."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.parameters: dict[str, str] = {}
        self.backend_key: tuple[int, int] = (0, 0)
        self.status = "I"
        # Bookkeeping queries of the proxy's own (SAVEPOINT, RELEASE) sent without waiting:
        # their replies are read, and dropped, before anything else is read. One entry per
        # Query sent: whose it is (an agent connection, or None: the booth's own step).
        self.unread: deque[Any] = deque()
        # Bookkeeping queries not yet in `out`, with whose they are: always the last thing to
        # send (see send_own).
        self.own: list[tuple[str, Any]] = []
        # The owners of the bookkeeping statements `send_query` put ahead of the agent's in
        # its Query, one per statement, until their replies are read (by the relay).
        self.prefix: deque[Any] = deque()
        # An agent connection's bookkeeping query failed, which aborted the booth's
        # transaction: (its number, the server's message), until the session is out of that
        # state. Statements sent in the same round trip fail for that cause, and say so.
        self.spoiled: tuple[int, str] | None = None
        # What the proxy sends is gathered and written when it next waits for the server (or
        # at 64 KiB): the agent's Parse, Bind, Execute and Sync, with the proxy's SAVEPOINT
        # before them, go as one TLS record and one segment, not one system call each.
        self.out = bytearray()
        # Which agent connection's unnamed statement the server's unnamed statement is (its
        # AgentConnection.unnamed), None when it is nobody's: a Query and any Parse of the
        # unnamed statement (the proxy's bookkeeping) replace it.
        self.unnamed: Any = None
        # Replies to the proxy's Parse or Close of the agent's unnamed statement sent again
        # (b"1", b"3"), for the relay to drop, until the unit's ReadyForQuery.
        self.dropping: list[bytes] = []
        # The agent connection that took the next unit's savepoint jukebox_tx ahead, at the
        # end of its last unit (`take_ahead`), until a unit asks for its savepoint (`send_own`)
        # or anything else is sent, which releases it first (`_unstand`).
        self.standing: Any = None
        # The savepoint taken ahead went as extended messages with no Sync after them yet: the
        # server ran them and holds their replies until the next Sync, for the relay of the
        # unit that takes that savepoint to read (`prefix`). Anything else that reads the
        # server sends that Sync first (`_sync_ahead`): a Query after them would otherwise be
        # skipped by the server, were they to fail.
        self.unsynced = False

    @classmethod
    async def connect(cls, target: Target, application_name: str = "jukebox") -> Upstream:
        wire = Wire(await target.open_socket())
        try:
            # No TLS on a Unix socket (the server offers none there, libpq asks for none).
            if target.sslmode != "disable" and target.unix_socket is None:
                await _start_tls(wire, target)
            self = cls(wire)
            params = {"user": target.user, "database": target.database,
                      "application_name": application_name, "client_encoding": "UTF8"}
            wire.write(m.startup_message(params))
            await self._authenticate(target)
            return self
        except BaseException:
            wire.close()
            raise

    async def _authenticate(self, target: Target) -> None:
        scram = None
        while True:
            kind, body = await self.read()
            if kind == b"E":
                fields = m.decode_fields(body)
                raise UpstreamError(fields.get("M", "refused"), fields)
            if kind == b"S":
                name, _, value = body.rstrip(b"\0").partition(b"\0")
                self.parameters[name.decode()] = value.decode()
            elif kind == b"K":
                self.backend_key = struct.unpack("!ii", body)
            elif kind == b"Z":
                self.status = body.decode()
                return
            elif kind == b"R":
                (code,) = struct.unpack("!i", body[:4])
                if code == 0:
                    continue
                if target.password is None:
                    raise UpstreamError(
                        f"the server asks {target.user} for a password: put it in the URL or "
                        "in PGPASSWORD"
                    )
                if code == 3:  # cleartext
                    self.send(m.message(b"p", target.password.encode() + b"\0"))
                elif code == 5:  # md5
                    inner = hashlib.md5((target.password + target.user).encode()).hexdigest()
                    outer = hashlib.md5(inner.encode() + body[4:8]).hexdigest()
                    self.send(m.message(b"p", b"md5" + outer.encode() + b"\0"))
                elif code == 10:  # SASL: the mechanisms offered
                    import scramp

                    offered = [x.decode() for x in body[4:].split(b"\0") if x]
                    scram = scramp.ScramClient(offered, target.user, target.password)
                    first = scram.get_client_first().encode()
                    self.send(m.message(
                        b"p",
                        scram.mechanism_name.encode() + b"\0" + struct.pack("!i", len(first))
                        + first,
                    ))
                elif code == 11 and scram is not None:
                    scram.set_server_first(body[4:].decode())
                    self.send(m.message(b"p", scram.get_client_final().encode()))
                elif code == 12 and scram is not None:
                    scram.set_server_final(body[4:].decode())
                else:
                    raise UpstreamError(f"the server asks for an authentication ({code}) the "
                                        "proxy does not speak")

    def send(self, data: bytes) -> None:
        if self.standing is not None:
            self._unstand()
        if self.unsynced:
            if data[:1] == b"S":
                self.unsynced = False  # the unit's own Sync: its relay reads them
            elif data[:1] not in _EXTENDED_AHEAD:
                self._sync_ahead()
        if data[:1] == b"Q":
            self.unnamed = None
        if self.own:
            self.unnamed = None
            # A loop rather than all() over a generator: this runs before every statement
            # an agent sends outside a transaction block.
            ahead = data[:1] in _EXTENDED and not self.prefix
            if ahead:
                for _, owner in self.own:
                    if owner is None:
                        ahead = False
                        break
            if ahead:
                # Ahead of the agent's extended-query messages, as extended messages of their
                # own: the server flushes once, at the agent's Sync, where a Query of them
                # was answered with a flush (a wake-up of the proxy, a TLS record) of its own.
                # Their replies are the reader's to drop (`prefix`), as `send_query`'s.
                for sql, owner in self.own:
                    messages, count = _extended(sql)
                    self.out += messages
                    self.prefix.extend((owner,) * count)
                self.own.clear()
            else:
                self._put_own()
        self.out += data
        if len(self.out) >= 65536:
            self.flush()

    def flush(self) -> None:
        if self.own:
            self._put_own()
        if self.out:
            self.wire.write(bytes(self.out))
            self.out.clear()

    def send_query(self, text: str) -> int:
        """The agent's simple Query, with the bookkeeping queries waiting (`send_own`) ahead of
        it in the same query string: the server answers one Query with one flush, where it
        flushed once for the bookkeeping and once for the statement (a wake-up of the proxy
        and a TLS record each). Their replies are the reader's to drop (`prefix`). Returns
        how many characters went ahead of the agent's text (an error's position is shifted
        back by as many)."""
        if self.standing is not None:
            self._unstand()
        if self.unsynced:
            self._sync_ahead()
        own = self.own
        self.unnamed = None
        if not own or self.prefix or any(owner is None for _, owner in own):
            self.send(m.message(b"Q", text.encode() + b"\0"))
            return 0
        head = "; ".join(sql for sql, _ in own) + "; "
        for sql, owner in own:
            self.prefix.extend([owner] * (sql.count(";") + 1))
        own.clear()
        self.out += m.message(b"Q", (head + text).encode() + b"\0")
        return len(head)

    def close_portals(self, names: list[str]) -> None:
        """Closes of these portals ahead of the proxy's next `query`, which reads their
        CloseComplete with its own replies; the bookkeeping waiting goes first, as a Query of
        its own (`settle` reads it), so no reply of theirs is left for a reader to expect."""
        if not names:
            return
        if self.standing is not None:
            self._unstand()
        if self.own:
            self._put_own()
        for name in names:
            self.out += m.Close("P", name).encode()

    def send_own(self, sql: str, owner: Any = None) -> None:
        """A bookkeeping query of the proxy's own for `owner` (the agent connection whose unit
        it keeps or undoes; None: the booth's own step), its reply read (and dropped) later,
        by whoever reads next. Consecutive ones of one owner go as one Query: the server
        answers a Query with a flush of its own, which is a wake-up of the proxy, and a
        savepoint taken and released with nothing in between (the agent's COMMIT, then the
        end of its unit) is not sent at all. Those of different owners go as Queries of their
        own, still in the same write, so that an error names its owner (see `settle`).
        A savepoint taken ahead (`take_ahead`) is the SAVEPOINT jukebox_tx of the next unit,
        whichever connection's it is: nothing ran since it was taken."""
        if self.standing is not None:
            if sql == SAVEPOINT_TX:
                self.standing = None
                return
            self._unstand()
        if sql == RELEASE_TX and self.own and self.own[-1] == (SAVEPOINT_TX, owner):
            self.own.pop()
            return
        self.own.append((sql, owner))

    def take_ahead(self, owner: Any) -> None:
        """At the end of `owner`'s unit, once its answer has left (its RELEASE waiting in
        `own`): the savepoint of the next unit is taken now, with that RELEASE, as extended
        messages the server runs while the agent reads its answer and writes its next
        statement, rather than ahead of that statement, on its path. No Sync follows them:
        the server sends their replies with the next unit's, in the same write, where the
        relay drops them as it drops the bookkeeping sent ahead of a statement (`prefix`);
        an error in them is `owner`'s. The next unit, whichever connection's, takes that
        savepoint as its own (`send_own`): nothing ran since. Anything else sent first
        releases it (`_unstand`): the session's savepoints are then as they would have been.
        Only when nothing else is waiting to be sent or read; else the RELEASE stays queued."""
        own = self.own
        if self.prefix or self.out or self.unread or any(o is not owner for _, o in own):
            return
        own.append((SAVEPOINT_TX, owner))
        for sql, _ in own:
            messages, count = _extended(sql)
            self.out += messages
            self.prefix.extend((owner,) * count)
        own.clear()
        self.unnamed = None
        self.flush()
        self.standing = owner
        self.unsynced = True

    def _unstand(self) -> None:
        """The savepoint taken ahead for a unit that has not come, released before anything
        else goes (a checkpoint, another connection's unit, the verdict)."""
        owner, self.standing = self.standing, None
        self._sync_ahead()
        self.own.append((RELEASE_TX, owner))

    def _sync_ahead(self) -> None:
        """A Sync after the bookkeeping `take_ahead` sent, before something other than the
        unit's own extended messages: their replies, up to its ReadyForQuery, are then read
        as a bookkeeping Query's are (`settle`)."""
        if self.unsynced:
            self.unsynced = False
            self.out += SYNC
            self.unread.append(self.prefix[0])
            self.prefix.clear()

    def _put_own(self) -> None:
        if self.unsynced:
            self._sync_ahead()
        self.unnamed = None
        own = self.own
        first = own[0][1]
        if len(own) == 1 or (len(own) == 2 and own[1][1] is first):  # one owner: the usual
            sql = own[0][0] if len(own) == 1 else f"{own[0][0]}; {own[1][0]}"
            self.out += m.message(b"Q", sql.encode() + b"\0")
            self.unread.append(first)
            own.clear()
            return
        start = 0
        for i in range(1, len(self.own) + 1):
            if i == len(self.own) or self.own[i][1] is not self.own[start][1]:
                sql = "; ".join(q for q, _ in self.own[start:i])
                self.out += m.message(b"Q", sql.encode() + b"\0")
                self.unread.append(self.own[start][1])
                start = i
        self.own.clear()

    async def settle(self) -> None:
        """Reads the replies of the queries `send_own` sent. An error of an agent
        connection's query goes to that connection (its `own_failed`), whoever is reading:
        the reader is often another connection, whose own statements are not at fault. The
        first error of the booth's own steps is raised, once every reply is read."""
        self.flush()
        raised: dict[str, str] | None = None
        while self.unread:
            owner = self.unread.popleft()
            failed: dict[str, str] | None = None
            while True:
                found = self.wire.next_message()
                if found is None:
                    self.wire.learning = False
                    try:
                        found = await self.wire.read_message()
                    finally:
                        self.wire.learning = True
                kind, body = found
                if kind == b"E" and failed is None:
                    failed = m.decode_fields(body)
                if kind == b"Z":
                    self.status = body.decode()
                    break
            if self.status != "E":
                self.spoiled = None
            if failed is not None and owner is not None:
                if self.spoiled is None and self.status == "E":
                    self.spoiled = (owner.number, failed.get("M", "error"))
                owner.own_failed(failed)
            elif failed is not None and raised is None:
                raised = failed
        if raised is not None:
            raise UpstreamError(raised.get("M", "error"), raised)

    def passthrough(self) -> bytes:
        """The replies here that pass on as they are (Wire.take_run), when nothing is to be
        sent or settled first."""
        if self.own or self.out or self.unread:
            return b""
        return self.wire.take_run()

    def skip_prefix(self) -> None:
        """The replies of the bookkeeping ahead of the agent's statement that are here and
        succeeded, dropped at once (Wire.skip_own), when nothing is to be sent or settled
        first: two statements of it, as six extended-query replies, are read before every
        statement of an agent outside a transaction block."""
        if self.own or self.out or self.unread:
            return
        for _ in range(self.wire.skip_own(len(self.prefix))):
            self.prefix.popleft()

    def ready(self) -> tuple[bytes, bytes] | None:
        """The next message when it is here and nothing is to be sent or settled first."""
        if self.own or self.out or self.unread:
            return None
        return self.wire.next_message()

    async def read(self) -> tuple[bytes, bytes]:
        if self.own or self.out:
            self.flush()
        if self.unread:
            await self.settle()
        return self.wire.next_message() or await self.wire.read_message()

    async def query(self, sql: str) -> list[tuple[bytes, bytes]]:
        """Runs the proxy's own `sql` (simple protocol); raises UpstreamError on its error.
        Returns the messages before ReadyForQuery."""
        # Sent with the bookkeeping queries still unanswered: one round trip for all of them.
        self.send(m.message(b"Q", sql.encode() + b"\0"))
        earlier: UpstreamError | None = None
        try:
            await self.settle()
        except UpstreamError as error:
            earlier = error  # this query's replies are still read, so the stream stays whole
        out: list[tuple[bytes, bytes]] = []
        failed: dict[str, str] | None = None
        while True:
            kind, body = await m.read_message(self.wire)
            if kind == b"Z":
                self.status = body.decode()
                if earlier is not None:
                    raise earlier
                if failed is not None:
                    raise UpstreamError(failed.get("M", "error"), failed)
                return out
            if kind == b"E" and failed is None:
                failed = m.decode_fields(body)
            out.append((kind, body))

    async def scalar(self, sql: str) -> str | None:
        for kind, body in await self.query(sql):
            if kind == b"D":
                (n,) = struct.unpack("!h", body[:2])
                if n < 1:
                    return None
                (size,) = struct.unpack("!i", body[2:6])
                return None if size < 0 else body[6 : 6 + size].decode()
        return None

    async def close(self) -> None:
        try:
            self.send(m.message(b"X"))
            self.flush()
            await asyncio.wait_for(self.wire.drain(), 5)
        except (OSError, ConnectionError, TimeoutError):
            pass
        finally:
            self.wire.close()


async def _start_tls(wire: Wire, target: Target) -> None:
    wire.write(struct.pack("!ii", 8, m.SSL_REQUEST))
    answer = await wire.readexactly(1)
    if answer != b"S":
        if target.sslmode in ("require", "verify-ca", "verify-full"):
            raise UpstreamError(f"the server at {target.host}:{target.port} does not offer TLS "
                                f"and the URL says sslmode={target.sslmode}")
        return
    context = ssl.create_default_context()
    if target.sslmode != "verify-full":
        context.check_hostname = False
    if target.sslmode not in ("verify-ca", "verify-full"):
        context.verify_mode = ssl.CERT_NONE
    await wire.start_tls(context, target.host)


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"

