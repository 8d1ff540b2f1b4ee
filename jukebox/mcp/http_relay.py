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
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import mcp_types as types
from mcp.shared.dispatcher import as_request_id, coerce_request_id

from jukebox.errors import JukeboxError
from jukebox.mcp.policy import Decision
from jukebox.mcp.relay import RELAY_ID_BASE, answered

Send = Callable[[dict[str, Any]], Awaitable[None]]


class RelayFailed(JukeboxError):
    """The server's answer was not one: said to the agent as this JSON-RPC error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class HttpRelay:
    def __init__(self, gateway: Any, link: Any, sessions: Callable[[str], bool]) -> None:
        self.gateway = gateway
        self.link = link  # jukebox.mcp.servers.HttpLink
        self.sessions = sessions  # whether the SDK's server holds this agent session
        self.in_flight: set[Any] = set()

    async def handle(self, scope: dict[str, Any], body: bytes, send: Send) -> bool:
        """Answers a tools/call POST the policy allows; False leaves it to the SDK's server."""
        if b'"tools/call"' not in body:
            return False
        link = self.link
        if link.session_id is None:
            return False
        session = None
        for name, value in scope["headers"]:
            if name == b"mcp-session-id":
                session = value
                break
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
        self.in_flight.add(key)
        try:
            with anyio.fail_after(gateway.timeout):
                data, message = await self._post(body, request.id)
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
        else:
            answered(frame, message)
        finally:
            self.in_flight.discard(key)
        frame["latency_ms"] = _ms(started)
        gateway.sink.record("tool_call", frame)
        await _reply(send, session, data)
        return True

    def _error(self, frame: dict[str, Any], id: Any, code: int, message: str) -> bytes:
        frame.update(error={"code": code, "message": message}, ok=False)
        error = types.JSONRPCError(jsonrpc="2.0", id=id,
                                   error=types.ErrorData(code=code, message=message))  # fmt: skip
        return error.model_dump_json(by_alias=True).encode()

    async def _post(self, body: bytes, id: Any) -> tuple[bytes, dict[str, Any]]:
        """The server's answer to the request `body`: its JSON text and the message. What
        goes wrong is said as the SDK's client says it (RelayFailed)."""
        import httpx2
        from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE

        link = self.link
        headers = {
            "accept": "application/json, text/event-stream",
            "content-type": "application/json",
            "mcp-session-id": link.session_id,
        }
        if link.protocol_version is not None:
            headers["mcp-protocol-version"] = link.protocol_version
        want = coerce_request_id(id)
        async with link.client.stream("POST", link.url, content=body, headers=headers) as response:
            server = f"jukebox: the MCP server {self.gateway.name!r}"
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
            try:
                events = httpx2.EventSource(response, max_event_size=DEFAULT_MAX_SSE_EVENT_SIZE)
                async for event in events:
                    if not event.data:
                        continue
                    message = json.loads(event.data)
                    if (
                        isinstance(message, dict)
                        and "method" not in message
                        and _id(message) == want
                    ):
                        return event.data.encode(), message
                    # A notification about the call (progress, logging): the SDK's client
                    # would have dropped it too (the gateway asks for none).
            except httpx2.SSEError as error:
                raise RelayFailed(types.CONNECTION_CLOSED, f"SSE stream failed: {error}") from None
        raise RelayFailed(types.CONNECTION_CLOSED, "SSE stream ended without a response")


def _id(message: dict[str, Any]) -> Any:
    found = as_request_id(message.get("id"))
    return None if found is None else coerce_request_id(found)


async def _reply(send: Send, session: bytes, data: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        (b"mcp-session-id", session)]})  # fmt: skip
    await send({"type": "http.response.body", "body": data})


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
