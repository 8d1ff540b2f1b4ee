"""Streamable-HTTP MCP servers through the stage gate, in the booth's supervisor.

`jukebox booth run --mcp-upstream NAME=URL` (or an entry with a `url` in `--mcp-config`): the
supervisor connects to the upstream server with the SDK's streamable-HTTP client and serves the
agent the same server, gated and recorded by jukebox.mcp.gateway.Gateway, with the SDK's own
streamable-HTTP server (`StreamableHTTPSessionManager`, run by uvicorn) at

    http://127.0.0.1:PORT/SECRET/mcp/NAME/

on a listener the agent can reach (inside its network namespace under `--net none`). Anyone on
the host can connect to 127.0.0.1, so the path starts with a secret, as the LLM proxy's does: a
request without it is answered 404 and reaches nothing. The gateway runs in the supervisor, so
its frames and staged calls go straight to the booth's stage gate (jukebox.mcp.staging), not
over the control socket.

Everything runs on one event loop in a thread of its own; `stop()` ends it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from secrets import token_urlsafe
from typing import Any

from jukebox.errors import JukeboxError
from jukebox.mcp.policy import Policy

START_TIMEOUT = 30.0
# How long the gateway waits for a server to answer its standalone GET before serving the agent
# all the same (a server that holds the GET without a word delays the booth that long, once).
LISTEN_WAIT = 5.0
NO_RESUME = (
    b'{"jsonrpc": "2.0", "id": null, "error": {"code": -32600, "message": "jukebox: the MCP '
    b"gateway does not resume event streams (Last-Event-ID): its answers carry no event ids, "
    b'so a call whose answer was lost must be made again"}}'
)


class HttpGatewayError(JukeboxError):
    exit_code = 1


class HttpGateways:
    def __init__(self, upstreams: dict[str, str], gate: Any, policy: Policy,
                 stage: Callable[[str, str, dict[str, Any]], str],
                 scrub: Callable[[dict[str, Any]], Any],
                 timeout: float = 60.0, ask_timeout: float = 300.0,
                 replay: Any = None, scrubber: Any = None,
                 headers: dict[str, dict[str, str]] | None = None) -> None:  # fmt: skip
        from jukebox.mcp.servers import ServerSpec

        self.upstreams = upstreams
        # NAME -> the server as declared: its URL, and the headers sent with every request.
        self.specs = {name: ServerSpec(name, "", url=url, headers=dict((headers or {}).get(name)
                                                                      or {}))
                      for name, url in upstreams.items()}  # fmt: skip
        self.gate = gate  # jukebox.mcp.staging.StageGate
        self.policy = policy
        self.stage = stage  # (server, tool, args) -> the staged call's id, under the booth's lock
        self.scrub = scrub
        self.timeout = timeout
        self.ask_timeout = ask_timeout
        # A replay or fork (jukebox.mcp.booth_replay.ToolReplay): the tape answers, and an
        # upstream is reached only past the recording.
        self.replay = replay
        self.secret = token_urlsafe(24)
        # jukebox.redact.Scrubber: the secrets `scrub` takes out of every frame. A replay
        # compares the agent's arguments with the recorded ones through it (the tape holds them
        # redacted), and the gateway's own URL secret is one of them.
        from jukebox.redact import Scrubber

        self.scrubber = scrubber if scrubber is not None else Scrubber()
        self.scrubber.add([self.secret])
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._sink: Any = None  # a jukebox.mcp.record.DeferredSink, made on the gateways' loop

    def urls(self) -> dict[str, str]:
        """NAME -> the URL the agent connects to."""
        return {name: f"{self.base_url()}{name}/" for name in self.upstreams}

    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.secret}/mcp/"

    def start(self, listener: socket.socket) -> HttpGateways:
        """Connects to every upstream and serves the agent on `listener` (a bound, listening
        socket); raises HttpGatewayError when an upstream does not answer."""
        # A socket object made from the descriptor learns its protocol from the kernel: asyncio
        # sets TCP_NODELAY only on connections whose proto says TCP, and without it every SSE
        # event the agent waits for sat ~40 ms behind the headers (Nagle, delayed ACK).
        listener = socket.socket(fileno=listener.detach())
        self.port = listener.getsockname()[1]
        self._thread = threading.Thread(target=self._run, args=(listener,),
                                        name="jukebox-mcp-http", daemon=True)  # fmt: skip
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join(timeout=5)
            raise HttpGatewayError(str(self._error))
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self, listener: socket.socket) -> None:
        import anyio

        try:
            anyio.run(self._main, listener)
        except BaseException as error:  # reported to start(), or lost at exit
            if not self._ready.is_set():
                self._error = _first(error)
        finally:
            self._ready.set()

    # -- the loop ------------------------------------------------------------------------------

    async def _main(self, listener: socket.socket) -> None:
        import anyio
        import uvicorn
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
        from mcp.shared.exceptions import MCPError

        from jukebox.mcp.back_channel import BackChannel
        from jukebox.mcp.gateway import Gateway, UpstreamSession
        from jukebox.mcp.http_relay import HttpRelay
        from jukebox.mcp.record import DeferredSink, wire
        from jukebox.mcp.relay import RELAY_ID_BASE

        managers: dict[str, StreamableHTTPSessionManager] = {}
        relays: dict[str, HttpRelay] = {}
        # Frames go to the tape after the agent has its answer (jukebox.mcp.record.DeferredSink).
        self._sink = DeferredSink(_Sink(self))
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self._sink.close)
            for name, url in self.upstreams.items():
                if self.replay is not None:
                    served = await self._replayed(name, url, stack)
                    if served is not None:
                        managers[name] = served
                        continue
                # The server's requests outside a relayed call go on to the agent; so the
                # gateway's client declares what they need (sampling, elicitation, roots).
                back = BackChannel(name, self._sink, self.ask_timeout)
                try:
                    read, write, link = await stack.enter_async_context(
                        self.specs[name].http_transport()
                    )
                    upstream = await stack.enter_async_context(
                        UpstreamSession(read, write, **back.callbacks())
                    )
                    back.upstream = upstream
                    # Its own requests numbered apart from the agents' relayed ones, which
                    # reach the server in the same session.
                    upstream._dispatcher._next_id = RELAY_ID_BASE  # type: ignore[attr-defined]
                    with anyio.fail_after(START_TIMEOUT):
                        init = await upstream.initialize()
                    # The server's standalone stream open (or refused) before the agent is
                    # served: what the server asks there from the first call on is heard.
                    with anyio.move_on_after(LISTEN_WAIT):
                        await link.listening.wait()
                except (TimeoutError, MCPError, OSError, Exception) as error:
                    raise HttpGatewayError(
                        f"the MCP server {name!r} at {_origin(url)} did not start a session "
                        f"({_first(error).__class__.__name__}: {_first(error)}): check "
                        "--mcp-upstream"
                    ) from None
                self._record("note", {"event": "mcp_server", "server": name,
                                      "initialize": wire(init), "transport": "http"})  # fmt: skip
                gateway = Gateway(name, upstream, self._sink, self.policy, self.timeout,
                                  self._stage, None, self._ask, timeout_hint="",
                                  back=back)  # fmt: skip
                manager = _manager(gateway, init)
                back.stream_open = _stream_opened(manager)
                back.open = _session_open(manager)
                await stack.enter_async_context(manager.run())
                managers[name] = manager
                relays[name] = HttpRelay(gateway, link, _sessions_of(manager), self.ask_timeout)
                stack.callback(relays[name].close)
            # No proxy headers (nothing stands between the agent and this listener, and the
            # peer's address is not used), no `server` or `date` header on each answer: work
            # per request for nobody.
            config = uvicorn.Config(_Router(self.secret, managers, relays), log_level="warning",
                                    lifespan="off", access_log=False, proxy_headers=False,
                                    server_header=False, date_header=False)  # fmt: skip
            self._server = uvicorn.Server(config)
            self._ready.set()
            await self._server.serve(sockets=[listener])

    async def _replayed(self, name: str, url: str, stack: contextlib.AsyncExitStack) -> Any:
        """NAME's session manager with the tape answering (jukebox.mcp.booth_upstream), or None
        when its recording had ended before the fork (then it is served live)."""
        import anyio

        from jukebox.mcp.booth_upstream import BoothReplayUpstream
        from jukebox.mcp.gateway import Gateway
        from jukebox.mcp.record import wire

        upstream = BoothReplayUpstream(
            name, [], self.scrubber, START_TIMEOUT, ask=self.replay.handle,
            connect=self.specs[name].http_transport,
        )  # fmt: skip
        init = await upstream.initialize_result()
        if init is None:
            return None
        self._record("note", {"event": "mcp_server", "server": name, "initialize": wire(init),
                              "transport": "http", "replayed": True})  # fmt: skip
        tasks = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(upstream.close)  # left before the task group: the live task ends first
        upstream.attach(tasks)
        # A BoothReplayUpstream answers the calls Gateway makes of a ClientSession.
        gateway = Gateway(name, upstream, self._sink, self.policy, self.timeout, self._stage,  # type: ignore[arg-type]
                          None, self._ask, replay=upstream, timeout_hint="")  # fmt: skip
        manager = _manager(gateway, init)
        await stack.enter_async_context(manager.run())
        return manager

    # -- what the gateways ask of the booth -----------------------------------------------------

    def _record(self, kind: str, payload: dict[str, Any]) -> None:
        from jukebox.booth.control import RequestError

        try:
            self.gate.handle_record({"kind": kind, "payload": self.scrub(payload)})
        except RequestError as error:  # a breaker trip: the agent hears why
            raise HttpGatewayError(str(error)) from None

    def _stage(self, server: str, tool: str, args: dict[str, Any]) -> str:
        from jukebox.booth.control import RequestError

        try:
            # After the frames queued before it, as the booth must see them.
            return str(self._sink.call(self.stage, server, tool, args))
        except RequestError as error:
            raise HttpGatewayError(str(error)) from None

    def _ask(self, server: str, tool: str, args: dict[str, Any]) -> str:
        asked = self._sink.call(self.gate.handle_ask, {"server": server, "tool": tool,
                                                       "args": args})  # fmt: skip
        deadline = time.monotonic() + self.ask_timeout
        while time.monotonic() < deadline:
            answer = self.gate.handle_ask_status({"id": asked["id"]}).get("answer")
            if answer is not None:
                return str(answer)
            time.sleep(0.2)
        return "deny"


class _Sink:
    def __init__(self, gateways: HttpGateways) -> None:
        self.gateways = gateways

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        from jukebox.mcp.record import wire

        self.gateways._record(kind, {k: wire(v) for k, v in payload.items()})

    def close(self) -> None:
        pass


class _Router:
    """ASGI: /SECRET/mcp/NAME[/...] to NAME's session manager, a tool call the policy allows
    through NAME's relay (jukebox.mcp.http_relay); anything else 404."""

    def __init__(self, secret: str, managers: dict[str, Any],
                 relays: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.secret = secret
        self.managers = managers
        self.relays = relays or {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        parts = scope["path"].split("/")
        # ["", SECRET, "mcp", NAME, ...]
        import hmac

        manager = None
        if len(parts) >= 4 and hmac.compare_digest(parts[1], self.secret) and parts[2] == "mcp":
            manager = self.managers.get(parts[3])
        if manager is None:
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"text/plain")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"not found\n"})
            return
        if scope["method"] == "GET" and any(k == b"last-event-id" for k, _ in scope["headers"]):
            # The gateway's answers carry no event ids (it keeps no history of them), so there
            # is nothing to resume: said plainly (the SDK's server, without an event store,
            # would send no answer at all).
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": NO_RESUME})
            return
        relay = self.relays.get(parts[3])
        if relay is not None and scope["method"] == "POST":
            body = await _body(receive)
            if body is None:
                return  # the agent left
            if await relay.handle(scope, body, send):
                return
            receive = _again(body, receive)
        await manager.handle_request(scope, receive, send)


async def _body(receive: Any) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _again(body: bytes, receive: Any) -> Any:
    """`receive` for a request whose body was read already: the body, then what comes."""
    given = False

    async def again() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _sessions_of(manager: Any) -> Any:
    """Whether the SDK's server `manager` holds the session of this id (its own table)."""
    held = manager._server_instances

    def holds(session: str) -> bool:
        return session in held

    return holds


def _session_open(manager: Any) -> Any:
    """Whether the SDK's server `manager` holds this session, not ended (its transport's own
    flag, set before the answer to the agent's DELETE)."""
    held = manager._server_instances

    def open_(session: str | None) -> bool:
        transport = held.get(session)
        return transport is not None and not transport.is_terminated

    return open_


def _stream_opened(manager: Any) -> Any:
    """Waits until the agent session's standalone stream (its GET) is open, at most
    back_channel.STREAM_WAIT: the SDK's server drops what it sends on that stream before
    (without an event store), and the agent's client opens it only after `initialize`, beside
    its first requests. The SDK says it nowhere but in its transport's table of streams."""
    import anyio
    from mcp.server.streamable_http import GET_STREAM_KEY

    from jukebox.mcp.back_channel import STREAM_WAIT

    async def opened(session: str | None) -> None:
        with anyio.move_on_after(STREAM_WAIT):
            while True:
                transport = manager._server_instances.get(session)
                if transport is None or GET_STREAM_KEY in transport._request_streams:
                    return
                await anyio.sleep(0.005)

    return opened


def _manager(gateway: Any, init: Any) -> Any:
    """The SDK's streamable-HTTP server for one gateway. Its answers are plain JSON bodies, not
    a server-sent event stream per request: the gateway sends nothing to the agent while a call
    runs (no progress, no logging), and the stream's setup cost ~1 ms a call (bench/bench_mcp.py;
    the spec lets a server answer a POST either way, and the SDK's client takes both)."""
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    return StreamableHTTPSessionManager(app=gateway.server(init), json_response=True)


def _origin(url: str) -> str:
    from jukebox.redact import url_origin

    return url_origin(url)


def _first(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error
