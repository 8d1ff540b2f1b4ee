"""The recording proxy: an HTTP/1.1 server on 127.0.0.1 between the agent and its model APIs.

It runs its own trio loop in a background thread (HTTP/1.1 of its own on both sides: the
agent's in jukebox.llm.http1_agent, the upstream's in jukebox.llm.upstream_client), so a booth
or a test just starts it and points the SDKs at `base_urls()`.

Anyone on the host can connect to 127.0.0.1, so each proxy has a secret, the first segment of
every path it serves (`base_urls()` carry it: `http://127.0.0.1:P/<secret>/openai/v1`, a base
URL every SDK keeps). A request without it is answered 403 and goes no further: it reaches no
tape, no breaker, no upstream. The secret is scrubbed from everything recorded.

Per model call, in order:

0. the path is confined to its provider's prefix (jukebox.llm.paths; 400 otherwise), and the
   bytes the proxy has recorded so far plus this request must stay within `record_limit`
   (otherwise the call is refused with 400 and the proxy trips, rule `recorded`);
1. the circuit breaker's verdict (a trip answers 400 in the provider's error shape);
2. replay: the call is served from the tape (or is a divergence, answered 400); or live: the
   request is rewritten (fork overrides) and forwarded, and a stream is passed on event by
   event, each as soon as it is complete;
3. the `llm_turn` frame is written *before* the agent sees the end of the response (the event
   that ends a stream, jukebox.llm.stream_end, and the end of any response are held back until
   then), so the tape's order of llm_turn and checkpoint frames is the order the agent observed;
4. the breaker observes the exchange; a trip fails the next call;
5. after a trip, `stop_agent` once the agent has the answer that explains it.

Errors the proxy itself answers use status 400 and `x-should-retry: false`, never
`retry-after`: the SDKs retry 408, 409, 429 and 5xx unless that header says otherwise, and a
retry would only repeat the refusal. An unreachable upstream is 502, which they do retry, as
they would without the proxy.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from secrets import token_urlsafe
from typing import Any

import trio

from jukebox.display import progress
from jukebox.display.names import printable
from jukebox.display.render import size as human
from jukebox.errors import JukeboxError
from jukebox.guard.breaker import Trip
from jukebox.llm.budget import worst_case
from jukebox.llm.fastio import fileno, read_some, read_spun, write_all
from jukebox.llm.http1_agent import AgentConnection, BadRequest, Request
from jukebox.llm.pacing import Pacer, headers_after_s, latency_s
from jukebox.llm.paths import PathRefused
from jukebox.llm.placeholder_keys import carries_placeholder
from jukebox.llm.pricing import PriceTable, per_million, warm_catalogue
from jukebox.llm.providers import (
    UNBILLED,
    Route,
    error_body,
    route,
)
from jukebox.llm.recorder import (
    DEFAULT_RECORD_LIMIT,
    LLM_TURN,
    Exchange,
    FrameSink,
    Turn,
    build_turn,
    parse_body,
    prepare_events,
    prepare_request,
)
from jukebox.llm.replay import LIVE, Divergence, Recorded, ReplaySource
from jukebox.llm.retries import RetryTracker, fingerprint
from jukebox.llm.rewrite import RequestRewriter
from jukebox.llm.sse import SSEEvent, SSEParser, encode_event
from jukebox.llm.stream_end import is_final
from jukebox.llm.telemetry import (
    AGENTS_TRACES,
    Source,
    proxy_warning,
    through_proxy,
    tracing_client,
)
from jukebox.llm.upstream_client import (
    Timeouts,
    UpstreamClient,
    UpstreamError,
    UpstreamRequest,
    UpstreamResponse,
)
from jukebox.llm.upstreams import proxy_env, upstreams_from_env
from jukebox.llm.upstreams import resolve as resolve_upstreams
from jukebox.llm.usage import ask_for_usage, is_usage_chunk
from jukebox.redact import Scrubber, redact_query, redact_text, url_origin, url_secrets
from jukebox.spin import Spin
from jukebox.tape.frame import encode_payload, spills
from shadowfs import wakeups

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the client library sets itself.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        # The upstream client negotiates and decodes compression; the agent gets plain bytes.
        "accept-encoding",
    }
)
_HOP_RESPONSE = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}
)
MAX_REQUEST_BYTES = 64 * 1024 * 1024
READ_SIZE = 65536
UPSTREAM_TIMEOUT = Timeouts(connect=30.0, read=600.0, write=60.0)
BREAKER_CODE = "jukebox_circuit_breaker"
REPLAY_CODE = "jukebox_replay_divergence"
RECORD_LIMIT_CODE = "jukebox_record_limit"
PATH_CODE = "jukebox_path_refused"
SECRET_CODE = "jukebox_proxy_secret"
# On every refusal of the proxy's own: the openai and anthropic SDKs obey this header before
# looking at the status, and no `retry-after` is ever sent with a refusal.
NO_RETRY = [("x-should-retry", "false")]
# Distinct stderr warnings one proxy prints at most (one per path an agent may invent).
MAX_WARNINGS = 20
# Exchanges up to this size (bodies) have their turn built on the proxy's loop when the sink
# allows it (`record_inline`): building a larger one would hold every other call up.
INLINE_TURN_BYTES = 64 * 1024
# How long a trip waits for the agent to take the answer that explains it before `stop_agent`
# is called anyway.
TRIP_NOTICE_S = 1.0
# The longest the proxy busy-polls for the rest of a request whose head came alone (httpx and
# the SDKs on it write a request's head and body apart, the body microseconds later): the
# poll spares the proxy a sleep and a wake-up on most calls (jukebox.spin.Spin).
AGENT_BODY_SPIN_CAP_NS = 500_000
# Set to 0, no busy-poll at all, `spin` or not: every wait sleeps (less CPU, one more wake-up
# per wait).
SPIN_ENV = "JUKEBOX_LLM_SPIN"
# How long stop() lets calls in flight finish: a client may return once it has what it needs
# (the last content chunk of a stream) while the proxy still reads the stream's end to record it.
STOP_GRACE_S = 3.0


def _failure(ex: Exchange) -> str | None:
    """How a call failed, worded so the same failure repeated reads the same (for the breaker)."""
    if ex.error is None and ex.status < 400:
        return None
    message = ex.error or ""
    if not message and ex.response_body:
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            message = json.loads(ex.response_body)["error"]["message"]
    return f"HTTP {ex.status}: {message}"[:500]


def _without_usage_chunk(events: list[SSEEvent], raw: bytes) -> bytes:
    """`events` (which `raw` holds, whole) as sent to an agent that did not ask for usage: the
    usage chunk marked hidden (recorded, never sent nor replayed). Without it, `raw` as it came;
    with it, the other events re-encoded (their data verbatim)."""
    hidden = False
    for event in events:
        event.hidden = is_usage_chunk(event)
        hidden = hidden or event.hidden
    if not hidden:
        return raw
    return b"".join(encode_event(event) for event in events if not event.hidden)


def _recorded_size(ex: Exchange) -> int:
    """The bytes a turn puts on the tape's side, bodies only (the frame's own keys are small)."""
    size = len(ex.request_body) + len(ex.response_body or b"")
    for event in ex.events or ():
        size += len(event.data)
    return size


def _peer_closed(stream: trio.SocketStream) -> bool:
    """Whether the agent has closed its end of the connection (or reset it), seen without
    reading: a request it sent meanwhile stays unread."""
    poller = select.poll()
    poller.register(stream.socket.fileno(), select.POLLRDHUP)
    gone = select.POLLRDHUP | select.POLLHUP | select.POLLERR
    return any(events & gone for _, events in poller.poll(0))


class _ClientGone(JukeboxError):
    pass


class _Stranger(JukeboxError):
    """A request without this proxy's secret: answered before its body is read."""


class ProxyServer:
    """Start with `start()`, point agents at `base_urls()`, stop with `stop()` (or `with`).

    `record(kind, payload)` receives each frame (`writer.append` of a TapeWriter fits); it is
    called from a worker thread, unless `record_inline` says that it never waits for the disk
    (it writes, and leaves the fsync to a group commit: a booth's GroupTape, a transaction's
    writer): then a small turn is recorded on the proxy's own loop, which spares every call a
    hand-off to a thread and back (see `_finish`). `spin`: a wait for what is about to come (a
    request's body, an upstream that answers fast) polls before it sleeps (see
    jukebox.spin.Spin), unless `JUKEBOX_LLM_SPIN=0`: for a proxy in a process apart from
    its agent, as a booth's is; a poll would fight an agent in the same process for the GIL.
    `secret` is the first path segment every
    request must carry (a fresh random one by default); `record_limit` the bytes of bodies
    the proxy records in all (DEFAULT_RECORD_LIMIT by default). `breaker` needs
    `admit(reservation) -> Trip | None`, `observe(cost_usd=, tokens=, text=, tool_calls=,
    failed=, reservation=, retry=) -> Trip | None` and `release(reservation)` (see
    jukebox.guard.breaker.CircuitBreaker). `on_trip(trip)` and `on_divergence(divergence)` are
    called once, from a worker thread, as soon as known; `stop_agent(trip)` once too, but only
    after the agent has been sent the refusal that explains the trip (and has read it, or
    TRIP_NOTICE_S has passed).
    """

    def __init__(
        self,
        *,
        upstreams: Mapping[str, str] | None = None,
        record: FrameSink | None = None,
        replay: ReplaySource | None = None,
        rewriter: RequestRewriter | None = None,
        breaker: Any = None,
        on_trip: Callable[[Any], Any] | None = None,
        stop_agent: Callable[[Any], Any] | None = None,
        on_divergence: Callable[[Divergence], Any] | None = None,
        secrets: list[str] | tuple[str, ...] = (),
        prices: PriceTable | None = None,
        sock: socket.socket | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        record_passthrough: bool = True,
        secret: str | None = None,
        record_limit: int | None = None,
        record_inline: bool = False,
        spin: bool = False,
    ) -> None:
        # Named upstreams: their protocols apart, their values plain URLs; a replay serves the
        # names its tape used, and nothing is forwarded to them.
        self.upstreams, self.protocols = resolve_upstreams(
            upstreams or upstreams_from_env({}),
            replay.upstream_protocols if replay is not None else None,
        )
        self.named = sorted(self.protocols)
        self.record = record
        self.record_inline = record_inline
        self.replay = replay
        # Replays answer at once, unless asked to keep the recorded latency and order.
        self._pacer = Pacer(replay.exchanges) if replay and replay.honor_timing else None
        self.rewriter = rewriter if rewriter is not None and rewriter.active else None
        self.breaker = breaker
        self.on_trip = on_trip
        self.stop_agent = stop_agent
        self.on_divergence = on_divergence
        self.secret = secret if secret is not None else token_urlsafe(32)
        if not self.secret or not self.secret.replace("-", "").replace("_", "").isalnum():
            raise ValueError("the proxy's secret must be a non-empty URL-safe token")
        self.record_limit = record_limit if record_limit is not None else DEFAULT_RECORD_LIMIT
        self.recorded_bytes = 0  # request bytes count when admitted, response bytes when recorded
        self.scrubber = Scrubber([*secrets, self.secret])
        for upstream in self.upstreams.values():
            self.scrubber.add(url_secrets(upstream))
        prices = prices if prices is not None else PriceTable.shipped()
        self.prices = prices.with_upstreams(self.upstreams)
        self._fallback_tables: dict[str, PriceTable] = {}
        self._unpriced_seen: set[str] = set()
        self._warned: set[tuple[str, ...]] = set()
        self._tracing_noted = False
        # The agent's environment, for what it turns off: this process's (the Python API), or
        # the one a booth's session gives its agent.
        self.agent_environ: Mapping[str, str] = os.environ
        self.record_passthrough = record_passthrough
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        sock.listen(128)
        self._sock = sock
        self.host, self.port = sock.getsockname()[:2]
        self.trip: Any = None
        self._stop_scheduled = False
        self._retries = RetryTracker()
        self.turns: list[Turn] = []  # every recorded turn, for callers without a tape
        self.keep_turns = record is None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._error: BaseException | None = None
        self._in_flight = 0  # requests being handled, changed on the proxy's event loop only
        # Busy-polls for what is about to come (jukebox.spin.Spin), unless turned off.
        self.spin = spin and os.environ.get(SPIN_ENV, "1") != "0"
        self._body_spin = Spin(AGENT_BODY_SPIN_CAP_NS if self.spin else 0)

    # ------------------------------------------------------------------ life cycle

    @property
    def origin(self) -> str:
        """`http://host:port`, without the secret: what may be shown or logged."""
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The root every request goes under, secret included: hand it to the agent only."""
        return f"{self.origin}/{self.secret}"

    def base_urls(self) -> dict[str, str]:
        """The environment that points an agent's SDKs at this proxy: every base-URL variable
        a popular client reads, each with the proxy's secret."""
        return proxy_env(self.url, self.protocols)

    def start(self) -> ProxyServer:
        self._thread = threading.Thread(target=self._run, name="jukebox-llm-proxy", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while self._in_flight and time.monotonic() < deadline:  # their frames are still to come
            time.sleep(0.005)
        if self._token is not None and self._scope is not None:
            # run_sync_soon, not trio.from_thread.run_sync: stop() may be called from inside
            # another trio run (an async agent ending its run), where the blocking form refuses.
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._scope.cancel)
        self._thread.join()
        self._thread = None
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as error:
            if not self._ready.is_set():  # start() raises it: the proxy never served
                self._error = error
                self._ready.set()
                return
            # After start, each connection's errors stay in it (`_connection`): reaching
            # here is a bug of ours, said once rather than raised in nobody's thread.
            print(
                f"jukebox: internal error: the LLM proxy stopped ({type(error).__name__}: "
                f"{error}); model calls from now on are refused",
                file=sys.stderr,
                flush=True,
            )

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock))
        self._client = UpstreamClient(UPSTREAM_TIMEOUT)
        # A busy-poll holds the loop: only while this call is the only one being served.
        self._client.may_spin = (lambda: self._in_flight <= 1) if self.spin else (lambda: False)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                with trio.CancelScope() as scope:
                    self._scope = scope
                    self._ready.set()
                    # Off the first call's path: loading the price catalogue takes ~0.2 s.
                    nursery.start_soon(_warm_quietly)
                    await trio.serve_listeners(self._connection, [listener])
        finally:
            with trio.CancelScope(shield=True):
                await self._client.aclose()

    # ------------------------------------------------------------------ one connection

    async def _connection(self, stream: trio.SocketStream) -> None:
        # One connection's unforeseen error must not end the proxy (serve_listeners' nursery
        # would take every other connection, and every later call, with it).
        try:
            await self._serve_connection(stream)
        except Exception as error:  # a bug of ours: said once, and this connection closed
            self._warn_once(
                ("internal error", type(error).__name__),
                f"internal error on one LLM request ({type(error).__name__}: {error}); "
                "its connection was closed (rerun with JUKEBOX_DEBUG=1 for a traceback)",
            )
            if os.environ.get("JUKEBOX_DEBUG"):
                import traceback

                traceback.print_exception(error, file=sys.stderr)
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        conn = AgentConnection()
        moved = trio.Event()  # set once the agent's next request (or its close) arrives here
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, _ClientGone):
            async with stream:
                while True:
                    try:
                        request, target, body = await self._read_request(conn, stream)
                    except BadRequest as error:
                        await self._fail_protocol(conn, stream, error)
                        return
                    except _Stranger:
                        await self._refuse_stranger(conn, stream)
                        return
                    finally:
                        moved.set()  # the agent has taken the answer to its last request
                        moved = trio.Event()
                    if request is None:
                        return
                    try:
                        self._in_flight += 1
                        try:
                            await self._handle(conn, stream, request, target, body)
                        finally:
                            self._in_flight -= 1
                    finally:
                        await self._stop_when_answered(moved)
                    if not conn.reusable:
                        if self.trip is not None:
                            # A client that closes after each response (`Connection: close`)
                            # has taken its answer once it closes its end.
                            await self._until_closed(stream)
                            moved.set()
                        return
                    conn.next_cycle()

    async def _until_closed(self, stream: trio.SocketStream) -> None:
        """Waits (at most TRIP_NOTICE_S) for the client to close its end, discarding data."""
        with trio.move_on_after(TRIP_NOTICE_S):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while await stream.receive_some(READ_SIZE):
                    pass

    async def _read_request(
        self, conn: AgentConnection, stream: trio.SocketStream
    ) -> tuple[Request | None, str, bytes]:
        """The request, its target after the secret, and its body. Without the secret the body
        is never read: a stranger cannot make the proxy hold 64 MiB per connection."""
        fd = fileno(stream)
        while (request := conn.request()) is None:
            if conn.closed:
                return None, "", b""
            conn.feed(await read_some(stream, fd, READ_SIZE))
        target = self._inside(request.target)
        if target is None:
            raise _Stranger()
        parts = conn.body()
        size = sum(map(len, parts))
        while not conn.body_done:
            if conn.closed:
                raise _ClientGone()
            if size > MAX_REQUEST_BYTES:
                break
            conn.feed(await read_spun(stream, fd, READ_SIZE, self._body_spin, not self._in_flight))
            for part in conn.body():
                size += len(part)
                parts.append(part)
        if size > MAX_REQUEST_BYTES:
            raise BadRequest("request body too large", 413)
        return request, target, parts[0] if len(parts) == 1 else b"".join(parts)

    async def _fail_protocol(
        self, conn: AgentConnection, stream: trio.SocketStream, error: BadRequest
    ) -> None:
        if not conn.started:
            body = json.dumps({"error": {"message": f"bad request: {error}"}}).encode()
            await self._write(
                stream, conn.head(error.status, [("content-type", "application/json")],
                                  length=len(body), close=True) + body
            )  # fmt: skip

    async def _refuse_stranger(self, conn: AgentConnection, stream: trio.SocketStream) -> None:
        """403, then the connection is closed: its body, if any, is never read."""
        message = (
            "jukebox proxy: this proxy serves only the agent of its own booth; use the "
            "OPENAI_BASE_URL and ANTHROPIC_BASE_URL the booth set, which carry its secret"
        )
        body = error_body("openai", message, SECRET_CODE)
        head = conn.head(403, [("content-type", "application/json")], length=len(body), close=True)
        await self._write(stream, head + body)

    async def _write(self, stream: trio.SocketStream, data: bytes) -> None:
        if data:
            try:
                await write_all(stream, fileno(stream), data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise _ClientGone() from None

    async def _send_simple(
        self,
        conn: AgentConnection,
        stream: trio.SocketStream,
        status: int,
        body: bytes,
        headers: list[tuple[str, str]] | None = None,
        checked: bool = False,
    ) -> None:
        """A whole response in one write (it wakes the agent once). `checked`: `headers` are
        an upstream's, parsed (and so validated) by the proxy's client, and go out as read."""
        hdrs = [(k, v) for k, v in (headers or []) if k.lower() not in _HOP_RESPONSE]
        if not any(k.lower() == "content-type" for k, _ in hdrs):
            hdrs.insert(0, ("content-type", "application/json"))
        if checked:
            head = conn.head(status, length=len(body), checked=hdrs)
        else:
            head = conn.head(status, hdrs, length=len(body))
        await self._write(stream, head + conn.data(body) + conn.end())

    # ------------------------------------------------------------------ one request

    async def _handle(
        self,
        conn: AgentConnection,
        stream: trio.SocketStream,
        request: Request,
        target: str,
        body: bytes,
    ) -> None:
        method = request.method
        headers = request.headers
        try:
            where = route(method, target, self.protocols)
        except PathRefused as refused:
            message = f"jukebox proxy: path refused: {refused}"
            provider = "anthropic" if target.startswith("/anthropic") else "openai"
            await self._send_simple(conn, stream, 400, error_body(provider, message, PATH_CODE))
            return
        if where is None:
            message = (
                f"jukebox proxy: no route for {target}; it serves /openai/v1/..., "
                "/anthropic/..., /gemini/... and /upstream/NAME/... for each --upstream NAME "
                "(use the OPENAI_BASE_URL, ANTHROPIC_BASE_URL, GOOGLE_GEMINI_BASE_URL and "
                "JUKEBOX_UPSTREAM_NAME_BASE_URL it set)"
            )
            await self._send_simple(conn, stream, 404, error_body("openai", message))
            return
        self.scrubber.learn_headers(headers)
        traced = tracing_client(headers, self.agent_environ)
        ex = Exchange(where.provider, where.endpoint, method, where.rest, headers, body)
        ex.upstream = where.named
        if traced is not None and not self._tracing_noted:
            self._tracing_noted = True
            self._warn_once(("tracing client",), traced)
            # On the tape too, once: the traces themselves never reach it.
            await self._note_request(
                "telemetry", where, ex, source=AGENTS_TRACES.who, seen="user-agent"
            )
        if not where.recorded:
            await self._passthrough(conn, stream, where, ex)
            return
        if self.trip is not None:
            await self._refuse_trip(conn, stream, where.provider)
            return
        if self.recorded_bytes + len(body) > self.record_limit:
            await self._refuse_record_limit(conn, stream, where.provider, len(body))
            return
        key = fingerprint(where.upstream, where.endpoint, body)
        ex.retry = self._retries.is_retry(key)
        # Free calls (moderations, token counts) are recorded but neither admitted nor counted.
        if self.breaker is not None and where.billed:
            request = parse_body(body)
            if self.rewriter is not None:  # budgeted as forwarded: a fork's --model is priced
                request = self.rewriter.apply(where.provider, where.endpoint, request)
            trip = await self._unpriced(where.provider, request, where.named)
            if trip is not None:
                await self._tripped(trip)
                await self._refuse_trip(conn, stream, where.provider)
                return
            ex.reservation = worst_case(
                request, len(body), self._price_table(), where.provider, where.named
            )
            trip = self.breaker.admit(ex.reservation)
            if trip is not None:
                await self._tripped(trip)
                await self._refuse_trip(conn, stream, where.provider)
                return
        # Counted now, before the call goes anywhere: calls in flight together cannot each
        # pass the check against the same total.
        self.recorded_bytes += len(body)
        try:
            await self._serve_call(conn, stream, where, ex, body)
        finally:
            if self.breaker is not None:
                self.breaker.release(ex.reservation)  # a call that ended without a turn
            self._retries.settled(key, ex.status, ex.error, ex.retry)

    async def _serve_call(
        self,
        conn: AgentConnection,
        stream: trio.SocketStream,
        where: Route,
        ex: Exchange,
        body: bytes,
    ) -> None:
        if self.replay is not None:
            request_json = parse_body(self.scrubber.bytes(body))
            try:
                served = self.replay.take(
                    where.provider, where.replay_endpoint, request_json, upstream=where.named
                )
            except Divergence as divergence:
                await self._diverged(divergence)
                message = f"jukebox {divergence.message()}"
                await self._send_simple(
                    conn, stream, 400, error_body(where.provider, message, REPLAY_CODE), NO_RETRY
                )
                return
            if served is not LIVE:
                assert isinstance(served, Recorded)
                await self._serve_recorded(conn, stream, ex, served)
                return
        if self.rewriter is not None:
            original = parse_body(body)
            changed = self.rewriter.apply(where.provider, where.endpoint, original)
            if changed != original:
                ex.request_body = json.dumps(changed, ensure_ascii=False).encode()
                ex.rewritten = True
            path = self.rewriter.path(where.provider, where.path, where.rest)
            if path is not None:  # Gemini's model is in the path: recorded as sent too
                ex.path = path
                ex.rewritten = True
        ex.usage_asked_body = ask_for_usage(where.provider, where.endpoint, ex.request_body)
        await self._forward(conn, stream, where, ex)

    # ------------------------------------------------------------------ live forwarding

    def _inside(self, target: str) -> str | None:
        """The target after this proxy's secret, or None when it does not start with it."""
        path, mark, query = target.partition("?")
        if not path.startswith("/"):
            return None
        first, _, rest = path[1:].partition("/")
        if not hmac.compare_digest(first.encode(), self.secret.encode()):
            return None
        return "/" + rest + mark + query

    def _upstream_failed(self, where: Route, error: UpstreamError) -> str:
        """What a failed upstream call says, to the agent and onto the tape: the upstream named
        by its origin only (its path may hold another proxy's secret, its userinfo a password)."""
        upstream = url_origin(self.upstreams[where.upstream])
        return redact_text(f"upstream {upstream} failed: {error!r}", self.scrubber)

    def _upstream_request(self, where: Route, ex: Exchange) -> UpstreamRequest:
        url = self.upstreams[where.upstream] + ex.path  # where.rest, or a fork's rewrite
        headers = [
            (k, v)
            for k, v in ex.request_headers
            if k.lower() not in _HOP and not carries_placeholder(v)
        ]
        body = ex.usage_asked_body if ex.usage_asked_body is not None else ex.request_body
        return self._client.request(ex.method, url, headers, body)

    async def _forward(
        self, conn: AgentConnection, stream: trio.SocketStream, where: Route, ex: Exchange
    ) -> None:
        started = time.perf_counter()
        ex.queued_ms = (started - ex.received) * 1000
        # The request's record is made while the upstream works on it, off the answer's path
        # (on the loop: when the turn is built on a thread, the thread does it).
        ahead = (lambda: prepare_request(ex, self.scrubber)) if self._record_inline(ex) else None
        try:
            upstream = await self._client.send(self._upstream_request(where, ex), ahead)
        except UpstreamError as error:
            ex.latency_ms = (time.perf_counter() - started) * 1000
            ex.status = 502
            ex.error = self._upstream_failed(where, error)
            message = f"jukebox proxy: {ex.error}"
            ex.response_body = error_body(where.provider, message, status=502)
            await self._finish(ex)
            await self._send_simple(conn, stream, 502, ex.response_body)
            return
        try:
            ex.status = upstream.status_code
            ex.response_headers = list(upstream.headers)
            out_headers = [(k, v) for k, v in ex.response_headers if k.lower() not in _HOP_RESPONSE]
            if (upstream.header("content-type") or "").startswith("text/event-stream"):
                await self._pipe_stream(conn, stream, upstream, ex, out_headers, started)
                return
            ex.response_body = await upstream.aread()
            ex.latency_ms = (time.perf_counter() - started) * 1000
        except UpstreamError as error:
            ex.latency_ms = (time.perf_counter() - started) * 1000
            ex.error = f"upstream read failed: {error!r}"
            await self._finish(ex)
            raise _ClientGone() from None  # the agent sees a broken response, as it would
        finally:
            await upstream.aclose()
        # The tape's flusher (a booth's GroupTape) woken once the answer has left, not while
        # it is on its way (shadowfs.wakeups): a thread woken then takes the GIL from this one.
        with wakeups.deferred():
            await self._finish(ex)
            await self._send_simple(conn, stream, ex.status, ex.response_body, out_headers, True)

    async def _pipe_stream(
        self,
        conn: AgentConnection,
        stream: trio.SocketStream,
        upstream: UpstreamResponse,
        ex: Exchange,
        headers: list[tuple[str, str]],
        started: float,
    ) -> None:
        parser = SSEParser()
        opened = time.perf_counter()
        ahead = self._record_inline(ex)
        # The head goes out at once, unless the upstream's first bytes came with it or are there
        # by now (`buffered`): then both go in one write, which wakes the agent once.
        head = conn.head(ex.status, checked=headers)
        held: list[bytes] = []  # from the event that ends the stream on: sent after the frame
        client_gone = False
        # An agent that did not ask for usage gets the events without the usage chunk.
        hide_usage = ex.usage_asked_body is not None
        try:
            parts = upstream.buffered()
            if not parts:
                await self._write(stream, head)
                head = b""
            while parts or (parts := await upstream.next_chunks()):
                # Each HTTP chunk is parsed and framed as it came; what one read brought goes
                # to the agent in one write.
                out: list[bytes] = [head] if head else []
                sent: list[SSEEvent] = []
                t_ms = (time.perf_counter() - opened) * 1000  # the read's: its chunks came at once
                for chunk in parts:
                    events = parser.feed(chunk, t_ms)
                    ready = parser.take_ready()
                    if hide_usage:
                        ready = _without_usage_chunk(events, ready)
                    if ready:
                        framed = conn.data(ready)
                        if held or any(map(is_final, events)):
                            held.append(framed)
                            continue
                        out.append(framed)
                    sent += events
                parts = []
                if len(out) > bool(head) and not client_gone:
                    head = b""
                    try:
                        await self._write(stream, b"".join(out))
                    except _ClientGone:
                        client_gone = True
                        break
                if ahead:  # their records, while the next events are on their way
                    prepare_events(ex, sent, self.scrubber)
        except UpstreamError as error:
            ex.error = f"upstream stream broke: {error!r}"
        tail = parser.close((time.perf_counter() - opened) * 1000)
        rest = parser.take_rest()
        rest = _without_usage_chunk(tail, rest) if ex.usage_asked_body is not None else rest
        if rest:
            held.append(conn.data(rest))
        ex.events = parser.events
        ex.latency_ms = (time.perf_counter() - started) * 1000
        # Fewer writes than events: a write to an agent that left may still have succeeded.
        client_gone = client_gone or _peer_closed(stream)
        if client_gone:
            ex.error = ex.error or "the agent closed the connection mid-stream"
        with wakeups.deferred():  # as a JSON answer's (`_forward`)
            await self._finish(ex)
            if client_gone or ex.error is not None:
                if head and not client_gone:  # a broken stream, as without the proxy
                    with contextlib.suppress(_ClientGone):
                        await self._write(stream, head)
                raise _ClientGone()
            end = conn.end()
            await self._write(stream, b"".join([head, *held, end]))

    async def _passthrough(
        self, conn: AgentConnection, stream: trio.SocketStream, where: Route, ex: Exchange
    ) -> None:
        """Paths that are not model calls: forwarded byte for byte, noted but not recorded, with
        one stderr line per path so that what a replay cannot serve is seen while recording."""
        source = through_proxy(where.provider, where.path)
        if source is not None:
            self._warn_once(
                ("telemetry", where.upstream, source.who),
                proxy_warning(
                    source, url_origin(self.upstreams[where.upstream]), self.replay is not None
                ),
            )
            if self.replay is not None:
                await self._telemetry_answered(conn, stream, where, ex, source)
                return
        elif self.replay is None:
            self._warn_once(
                ("passthrough", where.upstream, ex.method, where.path),
                f"note: {ex.method} {where.path} ({where.upstream}) is not a recorded endpoint: "
                "it passes through unrecorded, and a replay refuses it",
            )
        if self.replay is not None and self.replay.until is None:
            message = (
                f"jukebox replay: {ex.method} {where.rest} is not a recorded model call and a "
                "replay never reaches the network"
            )
            # Noted even when the agent catches the error: its run is not the recorded one.
            await self._note_request("replay_refused", where, ex)
            await self._send_simple(conn, stream, 400, error_body(where.provider, message))
            return
        started = time.perf_counter()
        try:
            upstream = await self._client.send(self._upstream_request(where, ex))
        except UpstreamError as error:
            message = f"jukebox proxy: {self._upstream_failed(where, error)}"
            body = error_body(where.provider, message, status=502)
            await self._send_simple(conn, stream, 502, body)
            return
        try:
            headers = [
                (k, v) for k, v in upstream.headers if k.lower() not in _HOP_RESPONSE
            ]
            await self._write(stream, conn.head(upstream.status_code, checked=headers))
            async for chunk in upstream.aiter_bytes():
                await self._write(stream, conn.data(chunk))
        finally:
            await upstream.aclose()
        # Noted before the agent sees the end, as model calls are: the tape's order is the
        # order the agent observed, and a proxy stopped right after the call loses nothing.
        if self.record_passthrough:
            await self._note_request(
                "llm_passthrough" if source is None else "telemetry",
                where,
                ex,
                status=upstream.status_code,
                latency_ms=round((time.perf_counter() - started) * 1000, 3),
            )
        await self._write(stream, conn.end())

    def _warn_once(self, key: tuple[str, ...], line: str) -> None:
        if key in self._warned or len(self._warned) > MAX_WARNINGS:
            return
        self._warned.add(key)
        if len(self._warned) > MAX_WARNINGS:  # an agent inventing paths fills no terminal
            line = "note: further warnings of this proxy are not shown (see the tape's notes)"
        # The line may quote what the agent sent (a path, a header): shown, escaped. Notes
        # go where --quiet drops them; warnings are always shown.
        shown = redact_text(line, self.scrubber)
        if line.startswith("note:"):
            progress.note(shown)
        else:
            print(f"jukebox: {printable(shown)}", file=sys.stderr, flush=True)

    async def _telemetry_answered(
        self,
        conn: AgentConnection,
        stream: trio.SocketStream,
        where: Route,
        ex: Exchange,
        source: Source,
    ) -> None:
        """During a replay: telemetry is accepted here, never forwarded, and noted apart from
        the calls a replay refuses (it is no part of what the agent did)."""
        await self._note_request("telemetry", where, ex, source=source.who, answered="locally")
        await self._send_simple(conn, stream, 200, b"{}")

    async def _note_request(self, event: str, where: Route, ex: Exchange, **extra: Any) -> None:
        """A `note` frame about a request that is not recorded as a turn (path redacted)."""
        if self.record is None:
            return
        note = {"event": event, "provider": where.provider}
        if where.named is not None:
            note["upstream"] = where.named
        note.update(method=ex.method, path=redact_query(self.scrubber.text(where.rest)), **extra)
        await trio.to_thread.run_sync(self.record, "note", note)

    # ------------------------------------------------------------------ replay

    async def _serve_recorded(
        self, conn: AgentConnection, stream: trio.SocketStream, ex: Exchange, rec: Recorded
    ) -> None:
        try:
            await self._send_recorded(conn, stream, ex, rec)
        finally:
            if self._pacer is not None:
                self._pacer.answered(rec)

    async def _send_recorded(
        self, conn: AgentConnection, stream: trio.SocketStream, ex: Exchange, rec: Recorded
    ) -> None:
        started = time.perf_counter()
        arrived = trio.current_time()
        pacer = self._pacer
        ex.status = rec.status
        ex.replayed_from = rec.seq
        headers = [(k, v) for k, v in rec.headers.items() if k not in _HOP_RESPONSE]
        if rec.events is None:
            if pacer is not None:
                await pacer.until(arrived, latency_s(rec))
                await pacer.in_turn(rec, arrived)
            ex.response_body = rec.body()
            ex.response_headers = headers
            ex.latency_ms = (time.perf_counter() - started) * 1000
            await self._finish(ex)
            await self._send_simple(conn, stream, rec.status, ex.response_body, headers)
            return
        if not any(k == "content-type" for k, _ in headers):
            headers.append(("content-type", "text/event-stream"))
        ex.response_headers = headers
        ex.events = rec.events
        if pacer is not None:
            await pacer.until(arrived, headers_after_s(rec))
        await self._write(stream, conn.head(rec.status, headers))
        opened = trio.current_time()
        chunks: list[list[bytes]] = []
        times: list[float] = []  # when each chunk came, in seconds after the headers
        last = None
        # A hidden event (the usage chunk the proxy asked for) was never sent to the agent, and
        # a chunk holding nothing else was never sent either.
        for event in (e for e in rec.events if not e.hidden):
            if event.chunk != last:
                chunks.append([])
                times.append(event.t_ms / 1000)
                last = event.chunk
            chunks[-1].append(encode_event(event))
        for i, parts in enumerate(chunks):
            if pacer is not None:
                await pacer.until(opened, times[i])
            if i == len(chunks) - 1:
                if pacer is not None:
                    await pacer.in_turn(rec, arrived)
                ex.latency_ms = (time.perf_counter() - started) * 1000
                await self._finish(ex)
                await self._write(stream, conn.data(b"".join(parts)) + conn.end())
                return
            await self._write(stream, conn.data(b"".join(parts)))
        await self._finish(ex)
        await self._write(stream, conn.end())

    # ------------------------------------------------------------------ bookkeeping

    async def _finish(self, ex: Exchange) -> None:
        """Records the exchange and lets the breaker see it. On the event loop when the sink
        only writes (`record_inline`) and the turn is small: a hand-off to a thread and back
        costs more than the write. Otherwise in a worker thread: a large exchange takes long
        to build, a body moved to the store makes the writer flush it (an fsync), and another
        sink may sync each frame."""
        size = _recorded_size(ex)  # once: it walks every event of a stream
        if self._record_inline(ex, size):
            turn = self._build_turn(ex)
            if self.record is not None:
                # Encoded once, here: the writer reuses it, and a value it moves to the store
                # makes it flush the store (an fsync), which goes to a thread.
                payload = encode_payload(turn.payload, turn.encoded)
                if spills(payload):
                    await trio.to_thread.run_sync(self.record, LLM_TURN, payload)
                else:
                    self.record(LLM_TURN, payload)
        else:
            turn = await trio.to_thread.run_sync(self._record_turn, ex)
        self.recorded_bytes += size - len(ex.request_body)
        if self.breaker is not None and self.trip is None and ex.endpoint not in UNBILLED:
            s = turn.summary
            trip = self.breaker.observe(
                cost_usd=turn.cost_usd or 0.0,
                tokens=s.input + s.output,
                text=s.text,
                tool_calls=s.tool_calls,
                failed=self._failure_text(ex),
                reservation=ex.reservation,
                retry=ex.retry,
            )
            if trip is not None:
                # The call that tripped still gets its answer; the agent is stopped after.
                await self._tripped(trip)

    def _record_inline(self, ex: Exchange, size: int | None = None) -> bool:
        """Whether `ex`'s turn is built on the loop (see `_finish`); `size`: its
        `_recorded_size`, when known."""
        inline = self.record_inline or self.record is None
        if size is None:
            size = _recorded_size(ex)
        return inline and size <= INLINE_TURN_BYTES

    def _price_table(self) -> PriceTable:
        """The prices, with the breaker's `--unknown-cost price=IN/OUT` as the fallback (read
        per call: the Python API's breaker is the current run's)."""
        policy = getattr(self.breaker, "unknown_cost", None)
        if not (isinstance(policy, str) and policy.startswith("price=")):
            return self.prices
        table = self._fallback_tables.get(policy)
        if table is None:
            fallback = per_million(policy.removeprefix("price="))
            table = self._fallback_tables[policy] = self.prices.with_fallback(fallback)
        return table

    async def _unpriced(
        self, provider: str, request: Any, upstream: str | None = None
    ) -> Trip | None:
        """A call to a model without a price, under a cost limit, is the breaker's decision
        (`unknown_cost`): a trip for `deny`; for `warn` one stderr line and for `price=` none,
        and for both a `note` frame, once per model."""
        policy = getattr(self.breaker, "unknown_cost", None)
        model = request.get("model") if isinstance(request, dict) else None
        if policy is None or not isinstance(model, str):
            return None
        if self.prices.known(model, provider, upstream) is not None:
            return None
        if getattr(self.breaker, "max_cost_usd", None) is None and policy in ("deny", "warn"):
            return None  # no cost limit: a missing price decides nothing
        if policy == "deny":
            detail = (
                f"{provider} model {model!r} has no price, so --max-cost-usd cannot count its "
                "calls (--unknown-cost deny); give it a price in prices.toml or pass "
                "--unknown-cost price=IN/OUT"
            )
            return Trip("unknown_cost", 0, 0, detail)
        if model in self._unpriced_seen:
            return None
        self._unpriced_seen.add(model)
        if policy == "warn":
            print(
                f"jukebox: warning: {provider} model {model!r} has no price; --max-cost-usd "
                "counts its calls as $0 (give it a price in prices.toml, or pass --unknown-cost "
                "deny or price=IN/OUT)",
                file=sys.stderr,
                flush=True,
            )
        if self.record is not None:
            counted = "$0" if policy == "warn" else policy.removeprefix("price=") + " per Mtok"
            note = {"event": "unknown_price", "model": model, "policy": policy, "counted": counted}
            await trio.to_thread.run_sync(self.record, "note", note)
        return None

    def _failure_text(self, ex: Exchange) -> str | None:
        """How the call failed, for the breaker, whose trip detail reaches the tape."""
        failure = _failure(ex)
        return None if failure is None else redact_text(failure, self.scrubber)

    def _build_turn(self, ex: Exchange) -> Turn:
        turn = build_turn(ex, self.scrubber, self._price_table())
        if self.keep_turns:
            self.turns.append(turn)
        return turn

    def _record_turn(self, ex: Exchange) -> Turn:
        turn = self._build_turn(ex)
        if self.record is not None:
            self.record(LLM_TURN, turn.payload)
        return turn

    async def _tripped(self, trip: Any) -> None:
        """Holds the first trip and reports it to `on_trip` at once, before any answer goes
        out (so its frame precedes what the agent does next). `stop_agent` is called later,
        by `_stop_when_answered`, once the answer that tells the agent why has been sent."""
        if self.trip is not None:
            return
        self.trip = trip
        if self.on_trip is not None:
            await trio.to_thread.run_sync(self.on_trip, trip)

    async def _stop_when_answered(self, answered: trio.Event) -> None:
        """After a response went out: the first time a trip stands, `stop_agent` is called in
        the background once the agent has taken that answer (`answered`: its next request or
        its close on the same connection) or TRIP_NOTICE_S has passed, whichever is first."""
        if self.trip is None or self._stop_scheduled or self.stop_agent is None:
            return
        self._stop_scheduled = True
        self._nursery.start_soon(self._stop_after, self.trip, answered)

    async def _stop_after(self, trip: Any, answered: trio.Event) -> None:
        with trio.move_on_after(TRIP_NOTICE_S):
            await answered.wait()
        with trio.CancelScope(shield=True):  # a proxy stopping meanwhile still stops it
            # stop_agent is Callable[[Any], Any]; trio's stub wants a typed one
            await trio.to_thread.run_sync(self.stop_agent, trip)  # type: ignore[arg-type]

    async def _diverged(self, divergence: Divergence) -> None:
        first = getattr(self, "_divergence_seen", None) is None
        self._divergence_seen = divergence
        if not first:
            return
        if self.record is not None:
            await trio.to_thread.run_sync(self.record, "note", divergence.to_payload())
        if self.on_divergence is not None:
            await trio.to_thread.run_sync(self.on_divergence, divergence)

    async def _refuse_record_limit(
        self, conn: AgentConnection, stream: trio.SocketStream, provider: str, size: int
    ) -> None:
        """The call would take the recorded bodies past the limit: refused, not recorded, and
        the proxy trips (in a booth: a `breaker` frame, the agent stopped, the run rolled back)
        since an agent that records this much is runaway or hostile."""
        total = self.recorded_bytes + size
        detail = (
            f"model calls would record {human(total)}, past the booth's limit of "
            f"{human(self.record_limit)} (--max-scratch, else {human(DEFAULT_RECORD_LIMIT)}); "
            f"this request is {human(size)}"
        )
        await self._tripped(Trip("recorded", self.record_limit, total, detail))
        message = f"jukebox proxy: refused: {detail}; the booth stops this agent"
        await self._send_simple(
            conn, stream, 400, error_body(provider, message, RECORD_LIMIT_CODE), NO_RETRY
        )

    async def _refuse_trip(
        self, conn: AgentConnection, stream: trio.SocketStream, provider: str
    ) -> None:
        trip = self.trip
        rule = getattr(trip, "rule", "?")
        limit = getattr(trip, "limit", None)
        value = getattr(trip, "value", None)
        detail = getattr(trip, "detail", "") or ""
        message = (
            f"jukebox circuit breaker tripped: {rule} (limit {limit}, reached {value})"
            + (f": {detail}" if detail else "")
            + "; the booth stops this agent"
        )
        await self._send_simple(
            conn, stream, 400, error_body(provider, message, BREAKER_CODE), NO_RETRY
        )


async def _warm_quietly() -> None:
    # A catalogue that fails to load fails the first priced call, where it is reported.
    with contextlib.suppress(Exception):
        await trio.to_thread.run_sync(warm_catalogue)
