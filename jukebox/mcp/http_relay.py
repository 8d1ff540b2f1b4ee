"""The booth's HTTP gateway's path for a tool call the policy allows: relayed as it came.

As for stdio (jukebox.mcp.relay), the gateway's sessions with the agent and with the server are
the SDK's (jukebox.mcp.http_gateway): initialize, the lists, every call staged, refused or asked
about. A `tools/call` POST of a session the SDK's server made, which the policy lets through as
it is, is parsed once with the SDK's models, then POSTed as it came to the server, in the
session the gateway's SDK client holds with it (its id and protocol version as seen on the wire:
jukebox.mcp.servers.HttpLink); the server's answer (a JSON body, or the event that answers it
in an event stream) is recorded and is the agent's JSON body. One more SDK server and client per
call was most of what the gateway executed per call (docs/mcp.md, "Speed").

The gateway's own client numbers its requests from jukebox.mcp.relay.RELAY_ID_BASE up, and an
id already in flight here goes through the SDK's path, so that no two requests in the server's
session share an id.

What the SDK's client did for a call, the relay does too. A request the server makes in the
middle of the call (sampling, elicitation) goes on to the agent: the agent's answer then becomes
an event stream (the request, under an id of the relay's own so that it meets none of the
gateway's SDK server, then the call's answer), and the agent's answer to it, POSTed to the
gateway, goes back to the server under the server's id; the gateway's timeout waits for the
server, not for the agent. A call's event stream that the server ends before the answer, having
given event ids, is resumed with Last-Event-ID (GET), as the SDK's client resumes it. The
gateway's own answers carry no event ids: it keeps no event history, so an agent's
Last-Event-ID is refused with a clear error (jukebox.mcp.http_gateway).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import mcp_types as types
from mcp.shared.dispatcher import as_request_id, coerce_request_id

from jukebox.errors import JukeboxError
from jukebox.mcp.policy import Decision
from jukebox.mcp.relay import CANCELLED, RELAY_ID_BASE, answered, as_response, ms_since

Send = Callable[[dict[str, Any]], Awaitable[None]]


class RelayFailed(JukeboxError):
    """The server's answer was not one: said to the agent as this JSON-RPC error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Reply:
    """The agent's answer to its POST: a JSON body, or, once the server has something to say to
    the agent before the call's answer, an event stream (the agent's SDK client accepts both)."""

    __slots__ = ("can_stream", "send", "session", "streaming")

    def __init__(self, send: Send, session: bytes, can_stream: bool) -> None:
        self.send = send
        self.session = session
        self.can_stream = can_stream
        self.streaming = False

    async def event(self, data: bytes) -> None:
        if not self.streaming:
            self.streaming = True
            await self.send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"mcp-session-id", self.session)]})  # fmt: skip
        await self.send({"type": "http.response.body", "body": _event(data), "more_body": True})

    async def end(self, data: bytes) -> None:
        if self.streaming:
            await self.send({"type": "http.response.body", "body": _event(_one_line(data))})
        else:
            await _reply(self.send, self.session, data)

    async def end_empty(self) -> None:
        """No answer (a call the agent cancelled): 202, or the stream's end."""
        if self.streaming:
            await self.send({"type": "http.response.body", "body": b""})
        else:
            await self.send({"type": "http.response.start", "status": 202, "headers": [
                (b"content-length", b"0"), (b"mcp-session-id", self.session)]})  # fmt: skip
            await self.send({"type": "http.response.body", "body": b""})


class _Call:
    """A relayed call in flight."""

    __slots__ = ("cancelled", "deadline", "frame", "last_event_id", "reply", "retry", "session")

    def __init__(self, frame: dict[str, Any], reply: _Reply, session: bytes) -> None:
        self.frame = frame
        self.reply = reply
        self.session = session
        self.deadline: Any = None  # the call's anyio CancelScope, past which it times out
        self.last_event_id: str | None = None  # the server's, to resume its stream
        self.retry: int | None = None  # ms, the server's wish before a resumption
        self.cancelled = False  # by the agent (HttpRelay._cancelled)


class _Asked:
    """A request of the server's gone on to the agent, under the relay's id."""

    __slots__ = ("call", "id", "said")

    def __init__(self, id: Any, call: _Call, said: dict[str, Any]) -> None:
        self.id = id  # the server's
        self.call = call
        self.said = said  # its entry in the call's frame (`asked`)


class HttpRelay:
    def __init__(self, gateway: Any, link: Any, sessions: Callable[[str], bool],
                 agent_timeout: float = 300.0) -> None:  # fmt: skip
        self.gateway = gateway
        # How long the agent may take to answer a request of the server's.
        self.agent_timeout = agent_timeout
        self.link = link  # jukebox.mcp.servers.HttpLink
        self.sessions = sessions  # whether the SDK's server holds this agent session
        self.in_flight: dict[Any, _Call] = {}  # by the agent's request id
        # The server's requests the agent has not answered yet, by the id the agent saw.
        self.asked: dict[str, _Asked] = {}
        self._asked_count = 0
        self._direct_cache: Any = False  # _direct, worked out at the first call
        # (ours, with the client's, as (name, value) pairs)
        self._merged: tuple[dict[str, str], list[tuple[str, str]]] | None = None
        self._plain_cache: Any = False  # _plain, worked out at the first call

    async def handle(self, scope: dict[str, Any], body: bytes, send: Send) -> bool:
        """Answers a tools/call POST the policy allows, and an agent's answer to a request the
        server made in one; False leaves it to the SDK's server."""
        if b'"tools/call"' not in body:
            if self.asked and b'"jukebox-' in body:
                return await self._answered(scope, body, send)
            if self.in_flight and b'"notifications/cancelled"' in body:
                return await self._cancelled(scope, body, send)
            return False
        link = self.link
        if link.session_id is None:
            return False
        session = _header(scope, b"mcp-session-id")
        if session is None or not self.sessions(session.decode("latin-1")):
            return False
        try:
            request = types.JSONRPCRequest.model_validate_json(body)
            if request.method != "tools/call":
                return False
            params = types.CallToolRequestParams.model_validate(request.params or {})
        except ValueError:
            return False  # a batch, or a bad request: the SDK's server says what is wrong
        key = coerce_request_id(request.id)
        if key in self.in_flight or (isinstance(key, int) and key >= RELAY_ID_BASE):
            return False
        gateway = self.gateway
        tool = params.name
        if tool not in gateway.annotations:
            return False  # the SDK's path lists the tools first, to learn its annotations
        decision: Decision = gateway.decide(tool)
        if decision.decision != "allow":
            return False
        args = dict(params.arguments or {})
        frame: dict[str, Any] = {"server": gateway.name, "tool": tool, "args": args,
                                 **decision.as_dict()}  # fmt: skip
        gateway.calls += 1
        started = time.perf_counter()
        limits = gateway.limits
        trip = limits.observe(gateway.name, tool, args) if limits is not None else None
        if trip is not None:
            refused = Decision("deny", f"circuit breaker: {trip.detail}")
            result = gateway.refuse(tool, frame, refused, started, breaker=trip.to_payload())
            answer = types.JSONRPCResponse(jsonrpc="2.0", id=request.id, result=result.model_dump(
                by_alias=True, mode="json", exclude_none=True))  # fmt: skip
            await _reply(send, session, answer.model_dump_json(by_alias=True).encode())
            return True
        accept = _header(scope, b"accept") or b""
        call = _Call(frame, _Reply(send, session, b"text/event-stream" in accept
                                   or b"*/*" in accept), session)  # fmt: skip
        self.in_flight[key] = call
        data = message = None
        # What is left of the server's answer (the end of its event stream, read so that the
        # connection is kept: jukebox.mcp.servers._keep_alive) is read after the agent has its
        # answer, not before.
        later = contextlib.AsyncExitStack()
        try:
            with anyio.fail_after(gateway.timeout) as call.deadline:
                data, message = await self._post(body, request.id, call, later)
        except TimeoutError:
            data = self._error(frame, request.id, gateway.TIMEOUT_CODE,
                               gateway.timeout_message(f"tools/call {tool!r}"))  # fmt: skip
        except RelayFailed as error:
            data = self._error(frame, request.id, error.code, error.message)
        except Exception as error:  # httpx's errors: the connection, the protocol
            failed = (
                f"jukebox: the MCP server {gateway.name!r} failed: {type(error).__name__}: {error}"
            )
            data = self._error(frame, request.id, types.INTERNAL_ERROR, failed)
        finally:
            self.in_flight.pop(key, None)
            if self.asked:
                for left in [i for i, a in self.asked.items() if a.call is call]:
                    del self.asked[left]
        if call.cancelled:
            # No answer is due, whatever the server said: it may answer its own cancellation
            # (the SDK's server does, "Request cancelled") before the call has ended here.
            data = None
            frame.update(error={"message": CANCELLED}, ok=False, cancelled=True)
        elif message is not None:
            answered(frame, message)
        frame["latency_ms"] = ms_since(started)
        gateway.sink.record("tool_call", frame)
        try:
            if data is None:
                await call.reply.end_empty()
            else:
                await call.reply.end(data)
        finally:
            await later.aclose()
        return True

    def _error(self, frame: dict[str, Any], id: Any, code: int, message: str) -> bytes:
        frame.update(error={"code": code, "message": message}, ok=False)
        error = types.JSONRPCError(jsonrpc="2.0", id=id,
                                   error=types.ErrorData(code=code, message=message))  # fmt: skip
        return error.model_dump_json(by_alias=True).encode()

    def _headers(self, accept: str) -> dict[str, str]:
        link = self.link
        headers = {"accept": accept, "content-type": "application/json",
                   "mcp-session-id": link.session_id}  # fmt: skip
        if link.protocol_version is not None:
            headers["mcp-protocol-version"] = link.protocol_version
        return headers

    async def _post(self, body: bytes, id: Any, call: _Call,
                    later: contextlib.AsyncExitStack) -> tuple[bytes, dict[str, Any]]:  # fmt: skip
        """The server's answer to the request `body`: its JSON text and the message; the
        response is closed by `later`. What goes wrong is said as the SDK's client says it
        (RelayFailed)."""
        from mcp.client.streamable_http import (
            DEFAULT_RECONNECTION_DELAY_MS,
            MAX_RECONNECTION_ATTEMPTS,
        )

        link = self.link
        headers = self._headers("application/json, text/event-stream")
        want = coerce_request_id(id)
        server = f"jukebox: the MCP server {self.gateway.name!r}"
        response = await self._send(body, headers, later)
        if response.status_code != 200:
            failed = f"{server} answered HTTP {response.status_code}"
            raise RelayFailed(types.INTERNAL_ERROR, failed)
        kind = response.headers.get("content-type", "")
        if kind.startswith("application/json"):
            data = await response.aread()
            try:
                message = json.loads(data)
            except ValueError as error:  # as the SDK's client says it
                failed = f"Failed to parse JSON response: {error}"
                raise RelayFailed(types.PARSE_ERROR, failed) from None
            if not isinstance(message, dict) or _id(message) != want:
                failed = f"{server} answered another request than this call"
                raise RelayFailed(types.INTERNAL_ERROR, failed)
            return data, message
        found = await self._events(response, want, call)
        if found is not None:
            return found
        # The stream ended before the answer: resumed where it stopped, if the server gave
        # event ids (the SDK's client's rule: a few tries, the server's `retry` apart).
        attempts = 0
        while call.last_event_id is not None and attempts < MAX_RECONNECTION_ATTEMPTS:
            await anyio.sleep((call.retry or DEFAULT_RECONNECTION_DELAY_MS) / 1000)
            resume = {**self._headers("text/event-stream"), "last-event-id": call.last_event_id}
            del resume["content-type"]
            try:
                async with link.client.stream("GET", link.url, headers=resume) as response:
                    kind = response.headers.get("content-type", "")
                    if response.status_code == 200 and kind.startswith("text/event-stream"):
                        found = await self._events(response, want, call)
                        if found is not None:
                            return found
                        attempts = 0  # resumed, then ended again: resumed again
                        continue
            except RelayFailed:
                raise
            except Exception:  # httpx's errors: tried again, as the SDK's client does
                pass
            attempts += 1
        raise RelayFailed(types.CONNECTION_CLOSED, "SSE stream ended without a response")

    async def _send(self, body: bytes, headers: dict[str, str],
                    later: contextlib.AsyncExitStack) -> Any:  # fmt: skip
        """POSTs `body` to the server; the response, its body not read yet, closed by `later`.

        The request goes straight to the transport the gateway's client would have chosen
        (its connection pool), built once per session: what the client does per request
        besides (merging the URL, headers, cookies and timeouts, the auth and redirect
        hooks, the response's timer) was a fifth of what the gateway executed per call
        (docs/mcp.md, "Speed"). Unless its cookie jar holds something (a server that set
        one): then through the client, which sends them."""
        link = self.link
        client = link.client
        direct = self._direct
        if direct is None or client.cookies:
            return await later.enter_async_context(
                client.stream("POST", link.url, content=body, headers=headers)
            )
        merged = self._merged
        if merged is None or merged[0] != headers:
            merged = self._merged = (headers, _merged(client.headers, headers))
        plain = self._plain
        if plain is not None:
            response: Any = await plain.post(body, merged[1])
            later.push_async_callback(response.aclose)
            if "set-cookie" in response.headers:
                self._cookies(response)
            return response
        import httpx2

        transport, url, extensions = direct
        request = httpx2.Request("POST", url, content=body, headers=merged[1],
                                 extensions=extensions)  # fmt: skip
        response = await transport.handle_async_request(request)
        later.push_async_callback(response.aclose)
        response.request = request
        if "set-cookie" in response.headers:
            client.cookies.extract_cookies(response)
        return response

    def _cookies(self, response: Any) -> None:
        """The cookies a server set in an answer to the plain path: into the client's jar (the
        next requests then go through the client, which sends them)."""
        import httpx2

        request = httpx2.Request("POST", self.link.url)
        headers = [(k, v) for k, v in response.headers.items() if k != "set-cookie"]
        headers += [("set-cookie", v.strip()) for v in response.headers["set-cookie"].split(", ")]
        self.link.client.cookies.extract_cookies(
            httpx2.Response(response.status_code, headers=headers, request=request)
        )

    @property
    def _plain(self) -> Any:
        """The plain-HTTP path (jukebox.mcp.http_upstream.PlainUpstream) for this server, or
        None: TLS, credentials in the URL."""
        if self._plain_cache is False:
            from jukebox.mcp.http_upstream import PlainUpstream

            url = self.link.url
            self._plain_cache = PlainUpstream(url) if PlainUpstream.serves(url) else None
        return self._plain_cache

    def close(self) -> None:
        """Closes the plain path's kept connections (the gateway's end)."""
        if self._plain_cache:
            self._plain_cache.close()

    @property
    def _direct(self) -> tuple[Any, Any, dict[str, Any]] | None:
        """(the transport, the URL, the request's extensions) of the fast path (_send), or
        None: no transport known (a link made elsewhere), or a proxy's (the client's own
        choice is then kept)."""
        if self._direct_cache is False:
            link = self.link
            transport = getattr(link, "transport", None)
            found = None
            if transport is not None:
                import httpx2

                url = httpx2.URL(link.url)
                # The client's own choice of transport for this URL (a proxy of the
                # environment's is a mount of its).
                if link.client._transport_for_url(url) is transport:
                    found = (transport, url, {"timeout": link.client.timeout.as_dict()})
            self._direct_cache = found
        return self._direct_cache

    async def _events(self, response: Any, want: Any,
                      call: _Call) -> tuple[bytes, dict[str, Any]] | None:  # fmt: skip
        """The answer among the server's events in `response`; what comes before it goes on to
        the agent; None when the stream ends first."""
        import httpx2
        from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE

        try:
            events: Any
            if response.headers.get("content-encoding", "identity") == "identity":
                events = _events_of(response, DEFAULT_MAX_SSE_EVENT_SIZE)
            else:
                events = httpx2.EventSource(response, max_event_size=DEFAULT_MAX_SSE_EVENT_SIZE)
            async for event in events:
                if event.id:
                    call.last_event_id = event.id
                if event.retry is not None:
                    call.retry = event.retry
                if not event.data:
                    continue  # a priming event: an id to resume from, nothing said
                message = json.loads(event.data)
                if not isinstance(message, dict):
                    continue
                if "method" in message:
                    await self._from_server(message, event.data, call)
                elif _id(message) == want:
                    return event.data.encode(), message
        except httpx2.SSEError as error:
            raise RelayFailed(types.CONNECTION_CLOSED, f"SSE stream failed: {error}") from None
        except httpx2.TransportError:
            pass  # the stream broke: resumed if it can be (_post)
        return None

    # -- the server's requests, the agent's answers ------------------------------------------

    async def _from_server(self, message: dict[str, Any], data: str, call: _Call) -> None:
        """A message of the server's within the call: a request goes on to the agent under an
        id of the relay's; a notification (progress, logging) as it came."""
        if "id" not in message:
            if call.reply.can_stream:
                await call.reply.event(_one_line(data))
            return
        said: dict[str, Any] = {"method": message.get("method"), "params": message.get("params")}
        call.frame.setdefault("asked", []).append(said)
        if not call.reply.can_stream:
            said["answer"] = {"error": {"code": types.INVALID_REQUEST, "message": (
                "jukebox: the agent's client takes no event stream, so nothing could be asked "
                "of it")}}  # fmt: skip
            await self._to_server({"jsonrpc": "2.0", "id": message["id"], **said["answer"]})
            return
        self._asked_count += 1
        ours = f"jukebox-{self._asked_count}"
        self.asked[ours] = _Asked(message["id"], call, said)
        # The agent's turn (a person may be asked): as long as an operator's answer may take;
        # the gateway's own timeout is the server's, and starts again with the answer.
        call.deadline.deadline = anyio.current_time() + self.agent_timeout
        await call.reply.event(json.dumps({**message, "id": ours}).encode())

    async def _answered(self, scope: dict[str, Any], body: bytes, send: Send) -> bool:
        """The agent's answer to a request of the server's: on to the server, under its id."""
        message = as_response(body)
        if message is None:
            return False
        ours = message.get("id")
        if not isinstance(ours, str):
            return False
        asked = self.asked.get(ours)
        if asked is None or _header(scope, b"mcp-session-id") != asked.call.session:
            return False
        del self.asked[ours]
        answer: dict[str, Any] = {k: message[k] for k in ("result", "error") if k in message}
        asked.said["answer"] = answer
        asked.call.deadline.deadline = anyio.current_time() + self.gateway.timeout
        status = await self._to_server({"jsonrpc": "2.0", "id": asked.id, **answer})
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-length", b"0"), (b"mcp-session-id", asked.call.session)]})  # fmt: skip
        await send({"type": "http.response.body", "body": b""})
        return True

    async def _cancelled(self, scope: dict[str, Any], body: bytes, send: Send) -> bool:
        """The agent's notifications/cancelled of a relayed call: on to the server (the call
        has the same id there), and the call ends, recorded so."""
        try:
            note = json.loads(body)
            # An untrusted value: a wrong type raises below and the note goes to the SDK.
            key = coerce_request_id(as_request_id(note["params"]["requestId"]))  # type: ignore[arg-type]
        except (ValueError, KeyError, TypeError):
            return False
        call = self.in_flight.get(key)
        if call is None or _header(scope, b"mcp-session-id") != call.session:
            return False
        call.cancelled = True
        await self._to_server(note)
        call.deadline.cancel()
        await send({"type": "http.response.start", "status": 202, "headers": [
            (b"content-length", b"0"), (b"mcp-session-id", call.session)]})  # fmt: skip
        await send({"type": "http.response.body", "body": b""})
        return True

    async def _to_server(self, message: dict[str, Any]) -> int:
        """POSTs `message` (an answer) to the server; its HTTP status (502: no answer)."""
        try:
            response = await self.link.client.post(
                self.link.url, content=json.dumps(message).encode(),
                headers=self._headers("application/json, text/event-stream"),
            )  # fmt: skip
        except Exception:  # httpx's errors: the call then ends in the server's own time
            return 502
        return 202 if response.status_code in (200, 202) else 502


async def _events_of(response: Any, max_event_size: int) -> AsyncIterator[Any]:
    """The events of `response` (not content-encoded) as httpx's EventSource gives them, by
    its own parser, from the body's bytes as they come: without the response's layers of
    iterators (raw, decoded, text), each a step per chunk."""
    import codecs

    from httpx2._sse import _SSEParser

    parser = _SSEParser(max_event_size)
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    async for chunk in response.stream:
        for event in parser.decode(text.decode(chunk)):
            yield event
    for event in parser.flush():
        yield event


def _merged(client: Any, ours: dict[str, str]) -> list[tuple[str, str]]:
    """The client's headers (the server's own, from the config) with ours over them, as pairs.
    No accept-encoding: the server's events are read as they come, not decoded."""
    import httpx2

    merged = httpx2.Headers(client)
    merged.update(ours)
    return [(k, v) for k, v in merged.multi_items() if k not in ("accept-encoding", "host")]


def _id(message: dict[str, Any]) -> Any:
    found = as_request_id(message.get("id"))
    return None if found is None else coerce_request_id(found)


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _one_line(data: str | bytes) -> bytes:
    """JSON text as one line: an event's `data:` field."""
    raw = data.encode() if isinstance(data, str) else data
    return raw if b"\n" not in raw else json.dumps(json.loads(raw)).encode()


def _event(data: bytes) -> bytes:
    return b"event: message\ndata: " + data + b"\n\n"


async def _reply(send: Send, session: bytes, data: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        (b"mcp-session-id", session)]})  # fmt: skip
    await send({"type": "http.response.body", "body": data})

