"""The server's requests of its client that come outside a relayed call's stream: to the agent.

A server asks its client things (`sampling/createMessage`, `elicitation/create`, `roots/list`).
One it sends on a relayed call's own event stream goes on to the agent by the relay
(jukebox.mcp.http_relay). Any other reaches the gateway's own SDK client of the server
(jukebox.mcp.gateway.UpstreamSession): one the server sends on its standalone stream (the GET
stream, outside any call), or on the stream of a call the gateway's SDK client makes. Those
come here, through the client's callbacks, and go on to the agent's session through the SDK's
server, on the agent's standalone stream; the agent's answer goes back as the client's.

So the gateway's client declares sampling, elicitation and roots to the server (the SDK's
client declares a capability for each callback it is given): what the agent can answer. Which
agent: the server's session with the gateway is one, shared by every agent session the gateway
serves, so a request outside a call names no agent. It goes to the agent session when exactly
one is open (when none is yet, to the first that opens, within the agent's timeout), and is
refused (an MCP error to the server) when several are, or none came: the
gateway does not hand what a server asks, nor the right to answer it, to a session it cannot
tell is the one meant. A request is asked only of an agent whose client declared that
capability. Each one is recorded (a `note`, `event: mcp_asked`).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import mcp_types as types

from jukebox.mcp.relay import ms_since

# What each request needs the agent's client to have declared.
CAPABILITY = {"sampling/createMessage": "sampling", "elicitation/create": "elicitation",
              "roots/list": "roots"}  # fmt: skip
# How long an agent that has just opened its session may take to open its standalone stream
# (the SDK's client opens it after `initialize`), before a request for it is refused.
STREAM_WAIT = 10.0


class BackChannel:
    def __init__(self, name: str, sink: Any, timeout: float) -> None:
        self.name = name
        self.sink = sink
        self.timeout = timeout  # how long the agent may take to answer (a person may be asked)
        self.agents: list[Any] = []  # the open agent sessions (the SDK's Connection of each)
        self.upstream: Any = None  # the gateway's client: the agent's roots changes go to it
        # Waits until an agent session's standalone stream is open (the HTTP gateway's: the
        # SDK's server drops a request sent before it is); None: always open (stdio).
        self.stream_open: Any = None
        # Whether an agent session (by its id) is still open: one that ended (an HTTP DELETE)
        # counts no more, even before the SDK has torn its connection down; None: all are.
        self.open: Any = None
        self._joined = anyio.Event()  # set (and made anew) when an agent session opens

    def callbacks(self) -> dict[str, Any]:
        """The SDK client's callbacks (ClientSession's keywords)."""
        return {"sampling_callback": self._sampling, "elicitation_callback": self._elicitation,
                "list_roots_callback": self._roots}  # fmt: skip

    # -- the agent's sessions (a middleware of the gateway's SDK server) ------------------------

    async def __call__(self, ctx: Any, call_next: Any) -> Any:
        result = await call_next(ctx)
        if ctx.request_id is None:
            if ctx.method == "notifications/initialized":
                # The SDK's per-connection state, which its ServerSession keeps privately.
                connection = ctx.session._connection
                if connection not in self.agents:
                    self.agents.append(connection)
                    connection.exit_stack.callback(self._left, connection)
                    joined, self._joined = self._joined, anyio.Event()
                    joined.set()
            elif ctx.method == "notifications/roots/list_changed" and self.upstream is not None:
                await self.upstream.send_roots_list_changed()
        return result

    def _left(self, connection: Any) -> None:
        if connection in self.agents:
            self.agents.remove(connection)

    # -- the server's requests -------------------------------------------------------------------

    async def _sampling(self, ctx: Any, params: Any) -> Any:
        answer = await self._ask("sampling/createMessage", params)
        if isinstance(answer, types.ErrorData):
            return answer
        if isinstance(answer.get("content"), list):
            return types.CreateMessageResultWithTools.model_validate(answer)
        return types.CreateMessageResult.model_validate(answer)

    async def _elicitation(self, ctx: Any, params: Any) -> Any:
        answer = await self._ask("elicitation/create", params)
        if isinstance(answer, types.ErrorData):
            return answer
        return types.ElicitResult.model_validate(answer)

    async def _roots(self, ctx: Any) -> Any:
        answer = await self._ask("roots/list", None)
        if isinstance(answer, types.ErrorData):
            return answer
        return types.ListRootsResult.model_validate(answer)

    async def _ask(self, method: str, params: Any) -> dict[str, Any] | types.ErrorData:
        from mcp.shared.exceptions import MCPError

        started = time.perf_counter()
        data = None if params is None else params.model_dump(by_alias=True, mode="json",
                                                             exclude_none=True)  # fmt: skip
        said: dict[str, Any] = {"event": "mcp_asked", "server": self.name, "method": method,
                                "params": data}  # fmt: skip
        answer: dict[str, Any] | types.ErrorData
        if not self._live():
            # Asked before any agent came (a server that asks for the roots as its session
            # starts, before the agent's): the first agent to come is asked.
            with anyio.move_on_after(self.timeout):
                while not self._live():
                    await self._joined.wait()
        refused = self._refusal(method)
        if refused is not None:
            answer = types.ErrorData(code=types.INVALID_REQUEST, message=refused)
        else:
            agent = self.agents[0]
            try:
                with anyio.fail_after(self.timeout):
                    if self.stream_open is not None:
                        await self.stream_open(agent.session_id)
                    answer = await agent.outbound.send_raw_request(method, data)
            except TimeoutError:
                answer = types.ErrorData(code=types.INTERNAL_ERROR, message=(
                    f"jukebox: the agent did not answer {method} within {self.timeout:g}s"))
            except MCPError as error:  # the agent's refusal, or no stream to ask it on
                answer = types.ErrorData(code=error.code, message=error.message)
        if isinstance(answer, types.ErrorData):
            said["answer"] = {"error": answer.model_dump(mode="json", exclude_none=True)}
        else:
            said["answer"] = {"result": answer}
        said["latency_ms"] = ms_since(started)
        self.sink.record("note", said)
        return answer

    def _live(self) -> list[Any]:
        if self.open is not None:
            self.agents = [a for a in self.agents if self.open(a.session_id)]
        return self.agents

    def _refusal(self, method: str) -> str | None:
        """Why nobody is asked `method`, or None: the one open agent session is asked."""
        why = f"jukebox: the MCP gateway asks no agent this {method}"
        if not self._live():
            return f"{why}: no agent session opened within {self.timeout:g}s"
        if len(self.agents) > 1:
            return (f"{why}: it came outside any call and {len(self.agents)} agent sessions "
                    "are open, so which one it is meant for is not known")  # fmt: skip
        capabilities = self.agents[0].client_capabilities
        wanted = CAPABILITY.get(method)
        if wanted is None or capabilities is None or getattr(capabilities, wanted) is None:
            return f"{why}: the agent's client did not declare {wanted or method}"
        return None
