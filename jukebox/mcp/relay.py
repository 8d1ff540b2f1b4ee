"""The stdio gateway's path for a tool call the policy allows: relayed as it came.

The gateway's session with the agent and with the real server are the SDK's (initialize, the
lists, capabilities, every call the policy stages, refuses or asks about: jukebox.mcp.gateway).
A `tools/call` the policy lets through as it is does not need them: its line from the agent is
parsed once with the SDK's models (to know the tool, its arguments and the decision), then
written to the server as it came; the server's answer, found by its id, is recorded and written
back to the agent as it came. One more SDK server and client per call was most of what the
gateway added to a call (docs/mcp.md, "Speed").

What the SDK's path did for such a call, the relay does too: a call the server does not answer
within the gateway's timeout gets the same error; a server that closes its pipe fails the calls
it held; an agent's `notifications/cancelled` of a relayed call reaches the server. The
gateway's own client of the server numbers its requests from RELAY_ID_BASE up, so that the
agent's ids (below it) and its own never meet on the server's pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import mcp_types as types
from mcp.shared.dispatcher import as_request_id, coerce_request_id

from jukebox.mcp.fdstdio import LinePipe, session_streams
from jukebox.mcp.policy import Decision

# The gateway's client of the server takes ids from here (below 2**53: a JavaScript server
# reads them exactly); an agent's id at or past it goes through the SDK's path.
RELAY_ID_BASE = 1 << 40
# A server that does not leave when its stdin closes gets SIGTERM, then SIGKILL (as the SDK's).
STOP_WAIT = 2.0
# What a tool_call frame says of a call nobody waits for any more (with `cancelled: true`).
CANCELLED = "cancelled by the agent"
LEFT = "the agent closed the connection first"


class _Call:
    __slots__ = ("deadline", "frame", "id", "started", "tool")

    def __init__(self, id: Any, tool: str, frame: dict[str, Any], started: float,
                 deadline: float) -> None:  # fmt: skip
        self.id = id
        self.tool = tool
        self.frame = frame
        self.started = started
        self.deadline = deadline


class Relay:
    """Relays the allowed tool calls of one gateway (jukebox.mcp.gateway.Gateway) between the
    agent's pipe and the server's."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
        self.agent: LinePipe | None = None
        self.upstream: LinePipe | None = None
        # Set once the agent has said its session is initialized (before that the SDK's
        # session answers everything, as the protocol's order wants).
        self.ready = False
        # The calls the server has not answered, by id, oldest first (so by deadline).
        self.pending: dict[Any, _Call] = {}

    # -- from the agent --------------------------------------------------------------------------

    async def from_agent(self, line: bytes) -> bool:
        """Takes a tools/call line the policy allows as it is; False leaves it to the SDK."""
        if b'"tools/call"' not in line:
            if not self.ready and b'"notifications/initialized"' in line:
                self.ready = True
            elif self.pending and b'"notifications/cancelled"' in line:
                return await self._cancelled(line)
            return False
        if not self.ready or self.agent is None or self.upstream is None:
            return False
        try:
            request = types.JSONRPCRequest.model_validate_json(line)
            if request.method != "tools/call":
                return False
            params = types.CallToolRequestParams.model_validate(request.params or {})
        except ValueError:
            return False  # the SDK's session says what is wrong with it
        key = coerce_request_id(request.id)
        if key in self.pending or (isinstance(key, int) and key >= RELAY_ID_BASE):
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
            await self.agent.write(_response(request.id, result.model_dump(
                by_alias=True, mode="json", exclude_none=True)))  # fmt: skip
            return True
        self.pending[key] = _Call(request.id, tool, frame, started,
                                  time.monotonic() + gateway.timeout)  # fmt: skip
        if not await self.upstream.write(line + b"\n"):
            await self._fail(
                key,
                types.CONNECTION_CLOSED,
                f"jukebox: the MCP server {gateway.name!r} closed its connection",
            )
        return True

    async def _cancelled(self, line: bytes) -> bool:
        try:
            note = json.loads(line)
            # An untrusted value: a wrong type raises below and the note is passed on as it is.
            key = coerce_request_id(as_request_id(note["params"]["requestId"]))  # type: ignore[arg-type]
        except (ValueError, KeyError, TypeError):
            return False
        call = self.pending.pop(key, None)
        if call is None:
            return False
        assert self.upstream is not None
        await self.upstream.write(line + b"\n")
        call.frame.update(error={"message": CANCELLED}, ok=False, cancelled=True,
                          latency_ms=ms_since(call.started))  # fmt: skip
        self.gateway.sink.record("tool_call", call.frame)
        return True

    # -- from the server -------------------------------------------------------------------------

    async def from_upstream(self, line: bytes) -> bool:
        """Takes the server's answer to a relayed call; False leaves the line to the SDK."""
        if not self.pending:
            return False
        message = as_response(line)
        if message is None:
            return False
        found = as_request_id(message.get("id"))
        if found is None:
            return False
        call = self.pending.pop(coerce_request_id(found), None)
        if call is None:
            return False
        frame = call.frame
        answered(frame, message)
        frame["latency_ms"] = ms_since(call.started)
        # Recorded before the agent has its answer: inside a booth that is a write to the
        # supervisor's socket (jukebox.mcp.record.BoothSink), which outlives this process.
        self.gateway.sink.record("tool_call", frame)
        assert self.agent is not None
        await self.agent.write(line + b"\n")
        return True

    async def upstream_closed(self) -> None:
        for key in list(self.pending):
            await self._fail(key, types.CONNECTION_CLOSED,
                             f"jukebox: the MCP server {self.gateway.name!r} closed its "
                             "connection before answering")  # fmt: skip

    # -- the calls not answered ------------------------------------------------------------------

    async def watch(self) -> None:
        """Answers each call the server has not answered within the timeout with the SDK's path's
        error. Calls are pending oldest first, and all wait as long: the first is the next due."""
        gateway = self.gateway
        while True:
            now = time.monotonic()
            wait = gateway.timeout
            while self.pending:
                key, call = next(iter(self.pending.items()))
                if call.deadline > now:
                    wait = call.deadline - now
                    break
                await self._fail(key, gateway.TIMEOUT_CODE, gateway.timeout_message(
                    f"tools/call {call.tool!r}"))  # fmt: skip
            await anyio.sleep(wait)

    async def _fail(self, key: Any, code: int, message: str) -> None:
        call = self.pending.pop(key, None)
        if call is None:
            return
        call.frame.update(error={"code": code, "message": message}, ok=False,
                          latency_ms=ms_since(call.started))  # fmt: skip
        self.gateway.sink.record("tool_call", call.frame)
        if self.agent is not None:
            error = types.JSONRPCError(
                jsonrpc="2.0", id=call.id, error=types.ErrorData(code=code, message=message)
            )
            await self.agent.write(error.model_dump_json(by_alias=True).encode() + b"\n")

    def close(self) -> None:
        """The agent is gone: the calls it did not get an answer to are recorded so."""
        for call in self.pending.values():
            call.frame.update(error={"message": LEFT}, ok=False, cancelled=True,
                              latency_ms=ms_since(call.started))  # fmt: skip
            self.gateway.sink.record("tool_call", call.frame)
        self.pending.clear()


def answered(frame: dict[str, Any], message: dict[str, Any]) -> None:
    """The frame of a relayed call says what the server's answer `message` says."""
    error = message.get("error")
    if error is not None:
        said = error if isinstance(error, dict) else {"message": str(error)}
        frame.update(error={"code": said.get("code"), "message": said.get("message")}, ok=False)
    else:
        result = message.get("result")
        frame.update(result=result, ok=not (isinstance(result, dict) and result.get("isError")))


def _response(id: Any, result: dict[str, Any]) -> bytes:
    message = types.JSONRPCResponse(jsonrpc="2.0", id=id, result=result)
    return message.model_dump_json(by_alias=True).encode() + b"\n"


def ms_since(started: float) -> float:
    """Milliseconds since `started` (a `time.perf_counter()`), as a tool_call frame keeps them."""
    return round((time.perf_counter() - started) * 1000, 3)


def as_response(data: bytes | str) -> dict[str, Any] | None:
    """`data` as a JSON-RPC message that answers a request (no "method"), or None: not JSON,
    not an object, or a request or notification of its own."""
    try:
        message = json.loads(data)
    except ValueError:
        return None
    if not isinstance(message, dict) or "method" in message:
        return None
    return message


@contextlib.asynccontextmanager
async def upstream_stdio(argv: list[str], relay: Relay) -> AsyncIterator[tuple[Any, Any]]:
    """Starts the real server `argv` and gives the SDK's session with it (read stream, write
    stream) over its pipes, through `relay`. At the end the server's stdin is closed; a server
    still there after STOP_WAIT seconds gets SIGTERM, then SIGKILL (its process group)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=sys.stderr, env=dict(os.environ), start_new_session=True,
                            close_fds=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    pipe = LinePipe(proc.stdout.fileno(), proc.stdin.fileno())
    relay.upstream = pipe
    try:
        async with session_streams(pipe, relay.from_upstream, relay.upstream_closed) as streams:
            try:
                yield streams
            finally:
                with anyio.CancelScope(shield=True):
                    await _stop(proc)
    finally:
        relay.upstream = None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


async def _stop(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.close()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + STOP_WAIT
        while proc.poll() is None and time.monotonic() < deadline:
            await anyio.sleep(0.01)
        if proc.returncode is not None:
            return
