"""The booth's side of the stage gate: calls held back until the verdict, then run or dropped.

The supervisor keeps one `StageGate` per booth. The gateway inside the booth (jukebox.mcp.gateway
with a `BoothSink`) asks it over the control socket to record frames (`mcp_record`) and to stage
calls (`mcp_stage`). A staged call is accepted only for a server the operator declared
(`--mcp-config`), and only from a gateway that serves that very command, because the commit
runs it on the host: the agent names arguments, never programs.

Rollback to checkpoint N drops the calls staged after N was taken; discard drops all; a pending
booth keeps them in its (sealed) record. On a passing verdict `run_staged` runs them in the order
they were staged, against the declared servers, after the file commit point; the first failure
stops the rest. Their effects are outside the booth: nothing here can undo them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from jukebox.booth.control import RequestError
from jukebox.mcp.record import FRAME_KINDS, MAX_BLOB, NOTE_EVENTS, blob_ref, wire
from jukebox.mcp.servers import ServerSpec
from shadowfs import values

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

MAX_STAGED = 10_000
# How long a question waits on the terminal (the gateway's --ask-timeout is 300 s by default).
ASK_WAIT = 300.0
# Pieces of big results held until their frame comes (jukebox.mcp.record.BoothSink._fit).
MAX_BLOBS = 8
MAX_BLOB_HELD = 2 * MAX_BLOB
RUN_TIMEOUT = 60.0
# The note written before a commit runs its staged calls (their ids, in order).
MCP_COMMIT_BEGIN = "mcp_commit_begin"

Record = Callable[[str, dict[str, "Any"]], "Any"]  # (kind, payload): append a frame


class StagedCall(values.Record):
    __slots__ = FIELDS = ("id", "server", "tool", "args", "after_checkpoint", "shown", "compensate")

    def __init__(
        self, id: str, server: str, tool: str, args: dict[str, Any], after_checkpoint: int,
        shown: dict[str, Any] | None = None, compensate: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.id = id
        self.server = server
        self.tool = tool
        self.args = args
        # The newest checkpoint when it was staged: rolling back to it or later keeps the call.
        self.after_checkpoint = after_checkpoint
        # The arguments as a frame may show them (the secrets known when it was staged
        # replaced), when they differ: the commit runs `args`, and its frame shows these, even
        # when it runs from a pending booth's record, after the secrets of its run (the
        # gateway's) are gone.
        self.shown = shown
        # The compensating call the operator's policy declares for it ({"tool", "args"}): run
        # if a later staged call fails at the commit.
        self.compensate = compensate

    def to_json(self) -> dict[str, Any]:
        # A copy as deep as dataclasses.asdict's: the caller may change what it gets. `copy`
        # (with `weakref`) is imported here, by a booth whose agent stages a call: every booth
        # imports this module at its start.
        import copy

        return copy.deepcopy(self.fields_dict())

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StagedCall:
        return cls(str(data["id"]), str(data["server"]), str(data["tool"]), dict(data["args"]),
                   int(data["after_checkpoint"]), data.get("shown"),
                   data.get("compensate"))  # fmt: skip


def _str(request: dict[str, Any], key: str, limit: int = 256) -> str:
    value = request.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise RequestError(f"{key!r} must be a non-empty string of at most {limit} characters")
    return value


class StageGate:
    def __init__(self, servers: dict[str, ServerSpec], record: Record, limits: Any = None,
                 on_trip: Callable[[Any], None] | None = None) -> None:  # fmt: skip
        self.servers = servers
        self.record = record
        # jukebox.mcp.limits.ToolCallLimits: the booth's breaker for tool calls; a trip goes to
        # on_trip (the booth records it and stops the agent, as for a model call's).
        self.limits = limits
        self.on_trip = on_trip
        self.trip: Any = None
        self.asks: dict[str, str | None] = {}
        # tell(ask id, what): show the operator a question; answer_of(ask id): their answer.
        self.tell: Callable[[str, str], None] | None = None
        # on_change(staged calls): the booth keeps them in its record as they change, so a
        # booth whose supervisor died still has them for `booth commit`.
        self.on_change: Callable[[list[StagedCall]], None] | None = None
        self.answer_of: Callable[[str], str | None] | None = None
        # ask_terminal(question, wait): the line the operator typed on the booth's terminal, or
        # None (no terminal, no answer in time); jukebox.booth.terminal.AgentTerminal.ask.
        self.ask_terminal: Callable[[str, float], str | None] | None = None
        self._next_ask = 1
        # A replay or fork: the recorded answers (jukebox.mcp.booth_replay.ToolReplay).
        self.replay: Any = None
        self.staged: list[StagedCall] = []
        self.blobs: dict[str, list[str]] = {}
        self.blob_chars = 0
        self.tool_calls = 0
        # The jukebox.redact.Scrubber `record` applies (the booth's): the secrets found later
        # (the HTTP gateway's path secret) are added to it, so that every frame loses them.
        from jukebox.redact import Scrubber

        self.secrets = Scrubber()
        # The booth's jukebox.mcp.policy.Policy: the compensations its file declares.
        self.policy: Any = None
        self._next = 1
        self._unframed: set[str] = set()  # the staged calls whose frame has not come yet
        self._lock = threading.Lock()

    # -- control socket handlers (the request is untrusted: the agent wrote it) ------------------

    def handle_record(self, request: dict[str, Any]) -> dict[str, Any]:
        kind, payload = request.get("kind"), request.get("payload")
        if kind not in FRAME_KINDS or not isinstance(payload, dict):
            raise RequestError(f"mcp_record needs 'kind' ({', '.join(FRAME_KINDS)}) and a payload")
        if kind == "note" and payload.get("event") not in NOTE_EVENTS:
            raise RequestError(f"an MCP note's event must be one of {', '.join(NOTE_EVENTS)}")
        if kind == "tool_call" and payload.get("decision") == "stage":
            # A staged call's frame names a call this gate staged, once. That call may be gone
            # already: the gateway sends its frame after the agent has its answer, and the
            # agent's rollback, on its own connection, can be served first.
            with self._lock:
                if payload.get("staged_id") not in self._unframed:
                    raise RequestError(
                        "a staged tool_call frame must name a call staged here, once"
                    )
                self._unframed.discard(payload["staged_id"])
        result = payload.get("result")
        if isinstance(result, dict) and "blob" in result:
            payload = {**payload, "result": self._take_blob(result)}
        # The gateway wrote it, inside the booth: the tape says so.
        self.record(kind, {**payload, "reported_by": "gateway"})
        if kind == "tool_call":
            self.tool_calls += 1
            # A call that asked to be staged was counted then, whether or not it was.
            if payload.get("decision") != "stage" and not str(payload.get("why", "")).startswith(
                "stage refused"
            ):
                self._observe(payload.get("server"), payload.get("tool"), payload.get("args"))
        return {}

    def handle_blob(self, request: dict[str, Any]) -> dict[str, Any]:
        """A piece of a result too big for one control line; its frame comes after the pieces."""
        blob, data = _str(request, "id", 64), request.get("data")
        if not isinstance(data, str) or not data:
            raise RequestError("'data' must be a non-empty string")
        with self._lock:
            if blob not in self.blobs and len(self.blobs) >= MAX_BLOBS:
                raise RequestError(f"{MAX_BLOBS} results are being sent already")
            if self.blob_chars + len(data) > MAX_BLOB_HELD:
                raise RequestError("too many bytes of results are being sent at once")
            self.blobs.setdefault(blob, []).append(data)
            self.blob_chars += len(data)
        return {}

    def _take_blob(self, ref: dict[str, Any]) -> Any:
        """The result a frame names by its blob, checked against the size and hash it says; a
        blob missing or not matching is recorded as a truncated result (size and hash only)."""
        with self._lock:
            pieces = self.blobs.pop(str(ref.get("blob")), [])
            self.blob_chars -= sum(map(len, pieces))
        text = "".join(pieces)
        said = {"bytes": ref.get("bytes"), "blake3": ref.get("blake3")}
        if text and len(text) <= MAX_BLOB and blob_ref(text) == said:
            import json

            try:
                return json.loads(text)
            except ValueError:
                pass
        return {"truncated": True, **said}

    def _observe(self, server: Any, tool: Any, args: Any) -> None:
        if self.limits is None:
            return
        if self.trip is not None:  # the agent is being stopped: nothing more runs or stages
            raise RequestError(f"the circuit breaker tripped: {self.trip.detail}")
        trip = self.limits.observe(str(server), str(tool), args)
        if trip is not None:
            self.trip = trip
            if self.on_trip is not None:
                self.on_trip(trip)
            raise RequestError(f"the circuit breaker tripped: {trip.detail}")

    def handle_stage(self, request: dict[str, Any], newest_checkpoint: int) -> dict[str, Any]:
        server, tool = _str(request, "server"), _str(request, "tool")
        args, argv = request.get("args"), request.get("argv")
        if not isinstance(args, dict):
            raise RequestError("'args' must be an object")
        spec = self.servers.get(server)
        if spec is None:
            declared = ", ".join(sorted(self.servers)) or "none"
            raise RequestError(
                f"the MCP server {server!r} was not declared by the operator (declared: "
                f"{declared}; `jukebox booth run --mcp-config FILE`): its calls cannot be staged"
            )
        if spec.url is not None or argv != spec.argv:
            raise RequestError(
                f"this gateway does not serve the declared command of {server!r}: a staged call "
                "runs against the declared server only"
            )
        return self.stage_declared(server, tool, args, newest_checkpoint)

    def stage_declared(self, server: str, tool: str, args: dict[str, Any],
                       newest_checkpoint: int) -> dict[str, Any]:  # fmt: skip
        """Stages a call for a declared server (the supervisor's own HTTP gateway calls this
        directly; a gateway in the booth through handle_stage, which checks its command)."""
        if server not in self.servers:
            raise RequestError(f"the MCP server {server!r} was not declared by the operator")
        self._observe(server, tool, args)
        with self._lock:
            if len(self.staged) >= MAX_STAGED:
                raise RequestError(f"{MAX_STAGED} calls are staged already")
            from jukebox.mcp.record import scrub

            shown = scrub({"a": args}, self.secrets)["a"]
            compensate = (self.policy.compensation(server, tool, args)
                          if self.policy is not None else None)  # fmt: skip
            call = StagedCall(f"stage-{self._next}", server, tool, args, newest_checkpoint,
                              shown if shown != args else None, compensate)  # fmt: skip
            self._next += 1
            self.staged.append(call)
            self._unframed.add(call.id)
            self._changed()
        return {"id": call.id}

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(list(self.staged))

    def handle_ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """A call the policy says to ask about: recorded, shown to the operator, answered later
        (jukebox.mcp.approvals)."""
        server, tool, args = _str(request, "server"), _str(request, "tool"), request.get("args")
        if not isinstance(args, dict):
            raise RequestError("'args' must be an object")
        with self._lock:
            ask_id = f"ask-{self._next_ask}"
            self._next_ask += 1
            self.asks[ask_id] = None
        self.record("note", {"event": "mcp_ask", "id": ask_id, "server": server, "tool": tool,
                             "args": args})  # fmt: skip
        if self.tell is not None:
            self.tell(ask_id, f"{server}/{tool}")
        if self.ask_terminal is not None:
            threading.Thread(target=self._ask_on_terminal, args=(ask_id, f"{server}/{tool}"),
                             name="jukebox-mcp-ask", daemon=True).start()  # fmt: skip
        return {"id": ask_id}

    def _ask_on_terminal(self, ask_id: str, what: str) -> None:
        """The same question on the booth's terminal; the first answer, from here or from
        `jukebox booth approve`, is the one taken."""
        assert self.ask_terminal is not None
        from jukebox.display.names import printable

        line = self.ask_terminal(
            printable(f"the agent asks to call {what} ({ask_id}): allow it? [y/N]"), ASK_WAIT
        )
        if line is None:
            return  # nobody here to ask, or no answer: `booth approve` may still answer
        answer = "approve" if line.lower() in ("y", "yes") else "deny"
        with self._lock:
            if self.asks.get(ask_id) is not None:
                return
            self.asks[ask_id] = answer
        self.record("note", {"event": "mcp_answer", "id": ask_id, "answer": answer,
                             "by": "terminal"})  # fmt: skip

    def handle_ask_status(self, request: dict[str, Any]) -> dict[str, Any]:
        ask_id = request.get("id")
        if not isinstance(ask_id, str) or ask_id not in self.asks:
            raise RequestError("'id' must name a question this booth asked")
        answer = self.asks[ask_id]
        if answer is None and self.answer_of is not None:
            answer = self.answer_of(ask_id)
            if answer is not None:
                self.asks[ask_id] = answer
                self.record("note", {"event": "mcp_answer", "id": ask_id, "answer": answer,
                                     "by": "booth approve"})  # fmt: skip
        return {"answer": answer}

    def handle_replay(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.replay is None:
            raise RequestError("this booth is no replay: mcp_replay is served in a replay only")
        from jukebox.mcp.record import scrub

        # The tape holds arguments without the booth's secrets (this replay's HTTP gateway path
        # secret among them, which a wrapper inside does not know): compare them the same way.
        return self.replay.handle(scrub(request, self.secrets))

    # -- the lifecycle ----------------------------------------------------------------------------

    def drop_after(self, checkpoint: int, reason: str) -> list[str]:
        """A rollback to `checkpoint`: the calls staged after it was taken go."""
        with self._lock:
            dropped = [c.id for c in self.staged if c.after_checkpoint >= checkpoint]
            self.staged = [c for c in self.staged if c.after_checkpoint < checkpoint]
            if dropped:
                self._changed()
        if dropped:
            self.record("note", {"event": "mcp_dropped", "ids": dropped, "reason": reason})
        return dropped

    def drop_all(self, reason: str) -> list[str]:
        with self._lock:
            dropped = [c.id for c in self.staged]
            self.staged = []
        if dropped:
            self.record("note", {"event": "mcp_dropped", "ids": dropped, "reason": reason})
        return dropped


def calls_up_to(calls: list[StagedCall], checkpoint: int | None) -> list[StagedCall]:
    """The calls a commit at `checkpoint` (None: the end) carries: those staged before it."""
    if checkpoint is None:
        return list(calls)
    return [c for c in calls if c.after_checkpoint < checkpoint]


def run_staged(
    calls: list[StagedCall],
    servers: dict[str, ServerSpec],
    record: Record,
    cwd: str,
    environ: dict[str, str],
    timeout: float = RUN_TIMEOUT,
) -> dict[str, Any]:
    """Runs `calls` in order against the declared servers; the first failure stops the rest.
    An `mcp_commit_begin` note names them first, each call is a `tool_call` frame (decision
    `commit`), then one `mcp_commit` note says which ran. Returns that note's payload.

    `record` must make each frame durable before it returns (the booth syncs its tape): a
    process killed midway leaves a tape that says which calls finished, that the first one
    without a frame may have reached its server, and that the rest never started
    (jukebox.booth.finished.unfinished_calls). Nothing runs them again."""
    import anyio

    report: dict[str, Any] = {"event": "mcp_commit", "ran": [], "failed": None, "not_run": []}
    if not calls:
        return report
    record("note", {"event": MCP_COMMIT_BEGIN, "ids": [c.id for c in calls]})
    anyio.run(_run_all, calls, servers, record, cwd, environ, timeout, report)
    record("note", report)
    return report


async def _run_all(calls: list[StagedCall], servers: dict[str, ServerSpec], record: Record,
                   cwd: str, environ: dict[str, str], timeout: float,
                   report: dict[str, Any]) -> None:  # fmt: skip
    import contextlib

    import anyio
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    sessions: dict[str, ClientSession] = {}
    async with contextlib.AsyncExitStack() as stack:
        for i, call in enumerate(calls):
            shown = call.shown if call.shown is not None else call.args
            frame: dict[str, Any] = {"server": call.server, "tool": call.tool, "args": shown,
                                     "decision": "commit", "staged_id": call.id}  # fmt: skip
            started = time.perf_counter()
            error: str | None = None
            try:
                session = sessions.get(call.server)
                if session is None:
                    # Entered outside any timeout's scope: the stack leaves them at the end.
                    spec = servers[call.server]
                    if spec.url is not None:  # a streamable-HTTP server, with its headers
                        read, write, *_ = await stack.enter_async_context(spec.http_transport())
                    else:
                        params = StdioServerParameters(
                            command=spec.command, args=list(spec.args),
                            env={**environ, **spec.env}, cwd=cwd,
                        )  # fmt: skip
                        read, write = await stack.enter_async_context(stdio_client(params))
                    session = await stack.enter_async_context(ClientSession(read, write))
                    with anyio.fail_after(timeout):
                        await session.initialize()
                    sessions[call.server] = session
                with anyio.fail_after(timeout):
                    result = await session.call_tool(call.tool, call.args)
                frame["result"] = wire(result)
                if getattr(result, "is_error", False):
                    error = _text_of(result) or "the tool reported an error"
            except TimeoutError:
                error = f"no answer within {timeout:g}s"
            except Exception as exc:  # the server failed to start or broke the protocol
                error = f"{type(exc).__name__}: {exc}"
            elapsed = round((time.perf_counter() - started) * 1e3, 3)
            frame.update(ok=error is None, latency_ms=elapsed)
            if error is not None:
                frame["error"] = {"message": error}
            record("tool_call", frame)
            if error is not None:
                report["failed"] = call.id
                report["error"] = error
                report["not_run"] = [c.id for c in calls[i + 1 :]]
                await _compensate(calls[:i], sessions, record, timeout, report)
                return
            report["ran"].append(call.id)


async def _compensate(ran: list[StagedCall], sessions: dict[str, Any], record: Record,
                      timeout: float, report: dict[str, Any]) -> None:  # fmt: skip
    """A staged call failed: the calls that ran before it and declared a compensation get it,
    newest first, over the same sessions, once each; a compensation's failure does not stop
    the others. Another call with effects of its own, not an undo (docs/mcp.md)."""
    import anyio

    chosen = [c for c in reversed(ran) if c.compensate is not None]
    if not chosen:
        return
    report.update(compensated=[], compensation_failed=[])
    for call in chosen:
        assert call.compensate is not None
        tool, args = str(call.compensate["tool"]), dict(call.compensate.get("args") or {})
        frame: dict[str, Any] = {"server": call.server, "tool": tool, "args": args,
                                 "decision": "compensate", "staged_id": call.id}  # fmt: skip
        started = time.perf_counter()
        error: str | None = None
        try:
            with anyio.fail_after(timeout):
                result = await sessions[call.server].call_tool(tool, args)
            frame["result"] = wire(result)
            if getattr(result, "is_error", False):
                error = _text_of(result) or "the tool reported an error"
        except TimeoutError:
            error = f"no answer within {timeout:g}s"
        except Exception as exc:  # the server broke the protocol or went away
            error = f"{type(exc).__name__}: {exc}"
        frame.update(ok=error is None, latency_ms=round((time.perf_counter() - started) * 1e3, 3))
        if error is not None:
            frame["error"] = {"message": error}
        record("tool_call", frame)
        report["compensated" if error is None else "compensation_failed"].append(call.id)


def _text_of(result: Any) -> str:
    return " ".join(getattr(b, "text", "") for b in getattr(result, "content", []) or [])[:500]
