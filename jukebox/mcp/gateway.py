"""The stdio MCP gateway (`jukebox mcp wrap -- CMD ARGS...`): an MCP server facing the agent, an
MCP client facing the real server, both the official SDK's (`mcp.server.lowlevel.Server` and
`mcp.ClientSession`), so no JSON-RPC is written here.

The gateway connects to the real server first, then offers the agent exactly the capabilities
that server announced. Every request the agent makes is answered by forwarding it, except tool
calls, which the policy (jukebox.mcp.policy) may stage, deny, or refuse when nobody can be asked.
Each request becomes a frame (jukebox.mcp.record). Every wait on the real server is bounded:
a server that never answers costs the agent a clear error after `timeout` seconds, never a hang.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import mcp.types as types
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError

from jukebox.errors import JukeboxError
from jukebox.mcp.back_channel import BackChannel
from jukebox.mcp.policy import Decision, Policy
from jukebox.mcp.record import wire
from jukebox.mcp.relay import (
    CANCELLED,
    LEFT,
    RELAY_ID_BASE,
    Relay,
    ms_since,
    upstream_stdio,
)

if TYPE_CHECKING:
    from jukebox.mcp.record import Sink

T = TypeVar("T")


class UpstreamSession(ClientSession):
    """The gateway's client of the real server: the SDK's ClientSession without its check of
    a tool's result against the tool's `outputSchema`. The gateway passes results through
    as they came; the agent's own client checks them (the check, a JSON Schema validation per
    call, and a `tools/list` of its own for a tool it had not listed, cost every call)."""

    async def validate_tool_result(self, name: str, result: types.CallToolResult) -> None:
        return None


DEFAULT_TIMEOUT = 60.0
DEFAULT_START_TIMEOUT = 30.0
# How long the agent may take to answer what the server asks it (a person may be asked).
ASK_TIMEOUT = 300.0
# JSON-RPC's "server error" range, as the SDK uses it for its own request timeout.
TIMEOUT_CODE = -32001
STAGED_NOTICE = (
    "jukebox staged this call as {id}: it has not run. It runs against the MCP server {server!r} "
    "only if the booth's verdict commits, in the order it was staged; its result is not known yet."
)


class GatewayError(JukeboxError):
    """The real server could not be started or did not answer: exit 1, one line."""

    exit_code = 1


# stage(server, tool, args) -> the staged call's id; raises GatewayError when it cannot stage.
Stager = Callable[[str, str, dict[str, Any]], str]


@dataclass
class Gateway:
    name: str
    upstream: ClientSession
    sink: Sink
    policy: Policy
    timeout: float = DEFAULT_TIMEOUT
    stager: Stager | None = None
    limits: Any = None  # jukebox.mcp.limits.ToolCallLimits
    # ask(server, tool, args) -> "approve" | "deny": the operator, through the booth.
    asker: Callable[[str, str, dict[str, Any]], str] | None = None
    # In the booth of a replay or fork (jukebox.mcp.booth_upstream.BoothReplayUpstream): the
    # recorded answers come first; a call past the recording goes on through the policy, live.
    replay: Any = None
    # tool name -> its annotations as on the wire (None: unannotated), from the last listing.
    annotations: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    calls: int = 0
    # Where the operator sets the timeout, as the timeout's message says it.
    timeout_hint: str = " (jukebox mcp wrap --timeout)"
    # The server's requests outside a relayed call, to the agent (jukebox.mcp.back_channel): a
    # middleware of the agent-facing server, which learns the agent's sessions.
    back: Any = None

    TIMEOUT_CODE = TIMEOUT_CODE

    def timeout_message(self, what: str) -> str:
        return (f"jukebox: the MCP server {self.name!r} did not answer {what} within "
                f"{self.timeout:g}s{self.timeout_hint}")  # fmt: skip

    async def _bounded(self, what: str, call: Awaitable[T]) -> T:
        try:
            with anyio.fail_after(self.timeout):
                return await call
        except TimeoutError:
            raise MCPError(TIMEOUT_CODE, self.timeout_message(what)) from None

    async def _listed(self, what: str, call: Awaitable[Any]) -> Any:
        started = time.perf_counter()
        result = await self._bounded(what, call)
        self.sink.record("note", {
            "event": "mcp_list", "server": self.name, "what": what, "result": wire(result),
            "latency_ms": ms_since(started),
        })  # fmt: skip
        return result

    # -- handlers --------------------------------------------------------------------------------

    async def list_tools(self, ctx: Any, params: types.PaginatedRequestParams | None) -> Any:
        result = await self._listed("tools/list", self.upstream.list_tools(params=params))
        tools = []
        for tool in result.tools:
            notes = wire(tool.annotations) if tool.annotations is not None else None
            self.annotations[tool.name] = notes
            if tool.output_schema is not None and self.decide(tool.name).decision != "allow":
                # A staged or refused call has no output to match the schema: the agent's client
                # would reject the notice that stands in for it.
                tool = tool.model_copy(update={"output_schema": None})
            tools.append(tool)
        return result.model_copy(update={"tools": tools})

    def decide(self, tool: str) -> Decision:
        return self.policy.decide(self.name, tool, self.annotations.get(tool))

    async def call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> Any:
        started = time.perf_counter()
        # The call's frame once it has one; every path records it with no await after, so a
        # cancellation reaches the handler below only for a call not recorded yet.
        held: list[dict[str, Any]] = []
        try:
            return await self._call_tool(ctx, params, held)
        except anyio.get_cancelled_exc_class():
            # The agent's notifications/cancelled, or the agent gone (its session's end cancels
            # what it still runs): the SDK answers nobody, and the tape says which.
            frame: dict[str, Any] = held[0] if held else {
                "server": self.name, "tool": params.name, "args": dict(params.arguments or {})
            }  # fmt: skip
            why = CANCELLED if _cancel_requested(ctx) else LEFT
            frame.update(error={"message": why}, ok=False, cancelled=True,
                         latency_ms=ms_since(started))  # fmt: skip
            self.sink.record("tool_call", frame)
            raise

    async def _call_tool(self, ctx: Any, params: types.CallToolRequestParams,
                         held: list[dict[str, Any]]) -> Any:  # fmt: skip
        tool, args = params.name, dict(params.arguments or {})
        if self.replay is not None:
            served = await self._replayed_call(tool, args)
            if served is not None:
                return served
        if tool not in self.annotations:
            # Called without listing first: learn its annotations, so the default is its own.
            await self.list_tools(ctx, None)
        decision = self.decide(tool)
        frame: dict[str, Any] = {"server": self.name, "tool": tool, "args": args,
                                 **decision.as_dict()}  # fmt: skip
        held.append(frame)
        self.calls += 1
        started = time.perf_counter()
        trip = self.limits.observe(self.name, tool, args) if self.limits is not None else None
        if trip is not None:
            return self.refuse(tool, frame, Decision("deny", f"circuit breaker: {trip.detail}"),
                               started, breaker=trip.to_payload())  # fmt: skip
        if decision.decision == "ask":
            if self.asker is None:
                # Nobody can answer on a gateway's own stdio (it is the agent's pipe).
                decision = Decision("deny", "ask: no operator to ask here")
            else:
                answer = await anyio.to_thread.run_sync(self.asker, self.name, tool, args)
                approved = answer == "approve"
                decision = Decision("allow" if approved else "deny", "ask: the operator " + (
                    "approved" if approved else "refused, or did not answer"))  # fmt: skip
            frame.update(decision.as_dict())
        if decision.decision == "deny":
            return self.refuse(tool, frame, decision, started)
        if decision.decision == "stage":
            if self.stager is None:
                raise MCPError(types.INTERNAL_ERROR, "jukebox: no booth to stage this call in")
            try:
                staged_id = await anyio.to_thread.run_sync(self.stager, self.name, tool, args)
            except JukeboxError as error:  # the booth refused: the agent hears why
                result = _refusal(tool, self.name, str(error))
                frame.update(decision="deny", why=f"stage refused: {error}", result=wire(result),
                             ok=False, latency_ms=ms_since(started))  # fmt: skip
                self.sink.record("tool_call", frame)
                return result
            result = types.CallToolResult(
                content=[types.TextContent(
                    type="text", text=STAGED_NOTICE.format(id=staged_id, server=self.name)
                )],
                structured_content={"jukebox": {"staged": True, "id": staged_id}},
            )  # fmt: skip
            frame.update(result=wire(result), ok=True, staged_id=staged_id,
                         latency_ms=ms_since(started))  # fmt: skip
            self.sink.record("tool_call", frame)
            return result
        try:
            result = await self._bounded(
                f"tools/call {tool!r}", self.upstream.call_tool(tool, args)
            )
        except MCPError as error:
            frame.update(error={"code": error.code, "message": error.message}, ok=False,
                         latency_ms=ms_since(started))  # fmt: skip
            self.sink.record("tool_call", frame)
            raise
        except RuntimeError as error:  # the SDK's check of the result against its schema
            frame.update(error={"message": str(error)}, ok=False, latency_ms=ms_since(started))
            self.sink.record("tool_call", frame)
            raise MCPError(types.INTERNAL_ERROR, f"jukebox: {error}") from None
        # The model itself: the sink turns it into JSON after the agent has its answer.
        frame.update(result=result, ok=not getattr(result, "is_error", False),
                     latency_ms=ms_since(started))  # fmt: skip
        replayed = getattr(self.upstream, "replayed_from", None)
        if replayed is not None:
            frame["replayed_from"] = replayed
        self.sink.record("tool_call", frame)
        return result

    def refuse(self, tool: str, frame: dict[str, Any], decision: Decision, started: float,
               **extra: Any) -> types.CallToolResult:  # fmt: skip
        """The refusal the agent gets for a call `decision` denies, recorded."""
        result = _refusal(tool, self.name, decision.why)
        frame.update(decision.as_dict(), **extra)
        frame.update(result=wire(result), ok=False, latency_ms=ms_since(started))
        self.sink.record("tool_call", frame)
        return result

    async def _replayed_call(self, tool: str, args: dict[str, Any]) -> Any:
        """The recorded answer to this call, recorded again with the frame it came from (its
        decision was taken when it was recorded); None when the run has gone past its recording
        (a fork): the call then goes through the policy to the real server."""
        started = time.perf_counter()
        answer = await self.replay.recorded_call(tool, args)
        if answer is None:
            return None
        self.calls += 1
        frame: dict[str, Any] = {
            "server": self.name, "tool": tool, "args": args, "decision": "replay",
            "why": f"recorded: {answer.get('decision')} ({answer.get('why')})",
            "replayed_from": answer.get("frame"), "latency_ms": 0.0,
        }  # fmt: skip
        if answer.get("overridden"):
            frame["overridden"] = True
        if "error" in answer:
            error = answer["error"]
            frame.update(error=error, ok=False, latency_ms=ms_since(started))
            self.sink.record("tool_call", frame)
            raise MCPError(int(error.get("code", types.INTERNAL_ERROR)), str(error.get("message")))
        result = types.CallToolResult.model_validate(answer["result"])
        frame.update(result=answer["result"], ok=not result.is_error, latency_ms=ms_since(started))
        self.sink.record("tool_call", frame)
        return result

    async def list_resources(self, ctx: Any, params: Any) -> Any:
        return await self._listed("resources/list", self.upstream.list_resources(params=params))

    async def list_resource_templates(self, ctx: Any, params: Any) -> Any:
        return await self._listed(
            "resources/templates/list", self.upstream.list_resource_templates(params=params)
        )

    async def list_prompts(self, ctx: Any, params: Any) -> Any:
        return await self._listed("prompts/list", self.upstream.list_prompts(params=params))

    async def read_resource(self, ctx: Any, params: types.ReadResourceRequestParams) -> Any:
        started = time.perf_counter()
        uri = str(params.uri)
        result = await self._bounded(f"resources/read {uri}", self.upstream.read_resource(uri))
        self.sink.record("note", {"event": "mcp_read", "server": self.name, "uri": uri,
                                  "result": wire(result),
                                  "latency_ms": ms_since(started)})  # fmt: skip
        return result

    async def get_prompt(self, ctx: Any, params: types.GetPromptRequestParams) -> Any:
        started = time.perf_counter()
        result = await self._bounded(
            f"prompts/get {params.name!r}",
            self.upstream.get_prompt(params.name, params.arguments),
        )
        self.sink.record("note", {"event": "mcp_prompt", "server": self.name,
                                  "prompt": params.name, "args": params.arguments or {},
                                  "result": wire(result),
                                  "latency_ms": ms_since(started)})  # fmt: skip
        return result

    def server(self, init: types.InitializeResult) -> Server[Any]:
        """A server facing the agent that offers what the real one announced, no more."""
        caps = init.capabilities
        handlers: dict[str, Any] = {}
        if caps.tools is not None:
            handlers.update(on_list_tools=self.list_tools, on_call_tool=self.call_tool)
        if caps.resources is not None:
            handlers.update(
                on_list_resources=self.list_resources,
                on_list_resource_templates=self.list_resource_templates,
                on_read_resource=self.read_resource,
            )
        if caps.prompts is not None:
            handlers.update(on_list_prompts=self.list_prompts, on_get_prompt=self.get_prompt)
        info = init.server_info
        server: Server[Any] = Server(
            info.name, version=info.version, title=info.title,
            instructions=init.instructions, **handlers,
        )  # fmt: skip
        if self.back is not None:
            server.middleware.append(self.back)
        return server


def _refusal(tool: str, server: str, why: str) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=(
            f"jukebox refused this call of {tool!r} on the MCP server {server!r} ({why}); "
            "it did not run."
        ))],
        is_error=True,
    )  # fmt: skip


def _cancel_requested(ctx: Any) -> bool:
    """Whether the agent sent notifications/cancelled for the request of `ctx` (the SDK sets
    its dispatch context's event; the handler's context does not expose it, its session does,
    privately)."""
    outbound = getattr(getattr(ctx, "session", None), "_request_outbound", None)
    event = getattr(outbound, "cancel_requested", None)
    return bool(event is not None and event.is_set())



async def serve_stdio(
    name: str,
    argv: list[str],
    sink: Sink,
    policy: Policy,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    start_timeout: float = DEFAULT_START_TIMEOUT,
    stager: Stager | None = None,
    agent_streams: Any = None,
    replay: Any = None,
    limits: Any = None,
    asker: Any = None,
    booth_replay: Any = None,
) -> None:
    """Starts the real server `argv`, then serves the agent on this process's stdin and stdout
    (or `agent_streams`, a (read, write) pair) until the agent closes them. With `replay` (a
    jukebox.mcp.replay.RecordedServer) no server starts: the tape answers."""
    if booth_replay is not None:
        await _serve_booth_replay(
            name,
            argv,
            sink,
            policy,
            booth_replay,
            timeout=timeout,
            start_timeout=start_timeout,
            stager=stager,
            agent_streams=agent_streams,
            limits=limits,
            asker=asker,
        )
        return
    if replay is not None:
        init = replay.initialize_result()
        sink.record("note", {"event": "mcp_server", "server": name, "initialize": wire(init),
                             "replayed_from": str(replay.path)})  # fmt: skip
        gateway = Gateway(name, replay, sink, policy, timeout, stager, limits)
        await _serve_agent(gateway, init, agent_streams)
        return
    relay: Relay | None = None
    try:
        if agent_streams is None:
            # The agent's pipes and the server's, both read here: allowed calls are relayed.
            relay = Relay(None)
            transport: Any = upstream_stdio(argv, relay)
        else:
            params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ))
            transport = stdio_client(params, errlog=sys.stderr)
        # The server's requests of its client go on to the agent (the gateway's client then
        # declares sampling, elicitation and roots to it).
        back = BackChannel(name, sink, ASK_TIMEOUT)
        async with (
            transport as (read, write),
            UpstreamSession(read, write, **back.callbacks()) as upstream,
        ):
            back.upstream = upstream
            if relay is not None:
                # Its own requests numbered apart from the agent's, which reach the same pipe.
                upstream._dispatcher._next_id = RELAY_ID_BASE  # type: ignore[attr-defined]
            gateway = Gateway(name, upstream, sink, policy, timeout, stager, limits, asker,
                              back=back)  # fmt: skip
            if relay is not None:
                relay.gateway = gateway
            try:
                with anyio.fail_after(start_timeout):
                    init = await upstream.initialize()
            except TimeoutError:
                raise GatewayError(
                    f"the MCP server {name!r} ({argv[0]}) did not answer initialize within "
                    f"{start_timeout:g}s: check the command, or raise --start-timeout"
                ) from None
            except MCPError as error:
                raise GatewayError(
                    f"the MCP server {name!r} ({argv[0]}) refused to start a session: {error}"
                ) from None
            sink.record("note", {"event": "mcp_server", "server": name,
                                 "initialize": wire(init)})  # fmt: skip
            await _serve_agent(gateway, init, agent_streams, relay)
    except OSError as error:
        raise GatewayError(
            f"cannot start the MCP server {argv[0]!r}: {error.strerror or error}; check the "
            "command after `--`"
        ) from None


async def _serve_booth_replay(name: str, argv: list[str], sink: Sink, policy: Policy,
                              upstream: Any, *, timeout: float, start_timeout: float,
                              stager: Stager | None, agent_streams: Any, limits: Any,
                              asker: Any) -> None:  # fmt: skip
    """In the booth of a replay or fork: the tape answers (jukebox.mcp.booth_upstream), the real
    server starts only if the run goes past its recording."""
    init = await upstream.initialize_result()
    if init is None:  # this server's recording had already ended: a plain live gateway
        await serve_stdio(
            name,
            argv,
            sink,
            policy,
            timeout=timeout,
            start_timeout=start_timeout,
            stager=stager,
            agent_streams=agent_streams,
            limits=limits,
            asker=asker,
        )
        return
    sink.record("note", {"event": "mcp_server", "server": name, "initialize": wire(init),
                         "replayed": True})  # fmt: skip
    async with anyio.create_task_group() as tasks:
        upstream.attach(tasks)
        gateway = Gateway(name, upstream, sink, policy, timeout, stager, limits, asker,
                          replay=upstream)  # fmt: skip
        try:
            await _serve_agent(gateway, init, agent_streams)
        finally:
            upstream.close()


async def _serve_agent(gateway: Gateway, init: types.InitializeResult, streams: Any,
                       relay: Relay | None = None) -> None:  # fmt: skip
    server = gateway.server(init)
    options = server.create_initialization_options()
    if streams is not None:
        agent_read, agent_write = streams
        await server.run(agent_read, agent_write, options)
        return
    from jukebox.mcp.fdstdio import agent_stdio

    intercept = relay.from_agent if relay is not None else None
    async with agent_stdio(intercept) as (agent_read, agent_write, pipe):
        if relay is None or pipe is None:
            await server.run(agent_read, agent_write, options)
            return
        relay.agent = pipe
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(relay.watch)
                await server.run(agent_read, agent_write, options)
                tasks.cancel_scope.cancel()
        finally:
            relay.agent = None
            relay.close()
