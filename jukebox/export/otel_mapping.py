"""Frames to OpenTelemetry spans, as plain data: the whole mapping, without the SDK.

The run is one `invoke_agent` span (the GenAI conventions' agent span) from `run_start` to the
last frame; every other frame is one span under it:

* `llm_turn` -> `chat` / `text_completion` / `embeddings` / `generate_content` `{model}`, kind
  CLIENT, timed by the recorded latency, with the conventions' gen_ai.* attributes, and the two
  client metrics (`gen_ai.client.operation.duration`, `gen_ai.client.token.usage`);
* `tool_call` -> `execute_tool {tool}`;
* Jukebox's own frames -> `jukebox.{kind}` spans with `jukebox.*` attributes, the files a
  frame's tree changed as `jukebox.file.change` events.

Message content (prompts, replies, tool arguments and results, verifier output) is added only
with ``capture=True``, scrubbed (jukebox.export.otel_content). Timestamps are the recorded ones;
ids come from the tape id (jukebox.export.otel_ids). docs/otel.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeGuard

from jukebox.export import otel_ids
from jukebox.export.otel_content import content_attributes, json_attribute
from jukebox.export.otel_llm import call_facts, operation, provider_name, request_settings
from jukebox.redact import Scrubber, redact_argv, redact_text
from jukebox.tape.frame import KNOWN_KINDS

# A frame that changed more files than this shows the first ones as events and the count.
FILE_EVENTS = 100
# Free-text attributes from Jukebox's own frames (notes, details) are cut at this length.
TEXT_LIMIT = 2000

TOKEN_USAGE = "gen_ai.client.token.usage"
OPERATION_DURATION = "gen_ai.client.operation.duration"


@dataclass
class EventPlan:
    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class SpanPlan:
    name: str
    span_id: int
    parent_id: int | None
    start_ns: int
    end_ns: int
    kind: str = "internal"  # or "client"
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[EventPlan] = field(default_factory=list)
    error: str | None = None  # the status description when the span failed
    links: list[tuple[int, int]] = field(default_factory=list)  # (trace id, span id)


@dataclass
class MetricPoint:
    name: str  # TOKEN_USAGE or OPERATION_DURATION
    value: float
    attributes: dict[str, Any]


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


_INT64 = (-(2**63), 2**63 - 1)
_TIME = (0, 2**64 - 1)  # OTLP times are unsigned 64-bit nanoseconds


def _ns(value: Any, scale: float) -> int:
    """A recorded duration (`latency_ms`, `seconds`) in nanoseconds; 0 for what is not one."""
    if not _number(value) or not 0 <= value * scale < 2**64:
        return 0
    return int(value * scale)


def _when(ns: int) -> int:
    """A time OTLP can carry: a hostile tape's frame time may be negative or past 2^64."""
    return min(max(ns, _TIME[0]), _TIME[1])


def _attribute(value: Any) -> Any:
    """A value OTLP can carry: integers past 64 bits as text, lists of one type."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if _INT64[0] <= value <= _INT64[1] else str(value)
    if isinstance(value, list):
        items = [_attribute(v) for v in value]
        if len({type(v) for v in items}) > 1 or any(isinstance(v, list | dict) for v in items):
            return [str(v) for v in items]
        return items
    return value


def _clean(plan: SpanPlan) -> SpanPlan:
    plan.attributes = {k: _attribute(v) for k, v in plan.attributes.items() if v is not None}
    plan.start_ns, plan.end_ns = _when(plan.start_ns), _when(plan.end_ns)
    for event in plan.events:
        event.time_ns = _when(event.time_ns)
        event.attributes = {k: _attribute(v) for k, v in event.attributes.items()}
    return plan


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return redact_text(text[:TEXT_LIMIT])


def _scalars(prefix: str, payload: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A payload's plain fields as attributes; strings pass jukebox.redact (notes quote paths
    and errors, which can carry a key)."""
    out: dict[str, Any] = {}
    for key, value in payload.items():
        if key in skip or key.endswith("headers"):
            continue
        if isinstance(value, bool) or _number(value):
            out[f"{prefix}.{key}"] = value
        elif isinstance(value, str):
            out[f"{prefix}.{key}"] = _text(value)
    return out


class TapeMapper:
    """Maps one tape's frames, in order, to span plans; ``finish`` gives the run's span.

    Holds what the run's span needs from the frames seen (its start, the totals, the verdict),
    so the same object serves a whole-tape export and a live one.
    """

    def __init__(
        self, tape_id: str, *, capture: bool = False, scrubber: Scrubber | None = None
    ) -> None:
        self.tape_id = tape_id
        self.trace_id = otel_ids.trace_id(tape_id)
        self.run_span_id = otel_ids.run_span_id(tape_id)
        self.capture = capture
        self.scrubber = scrubber if scrubber is not None else Scrubber()
        self.metrics: list[MetricPoint] = []
        self._start: int | None = None
        self._end: int | None = None
        self._frames = 0
        self._root: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.id": tape_id,
            "gen_ai.conversation.id": tape_id,
            "jukebox.tape.id": tape_id,
        }
        self._links: list[tuple[int, int]] = []
        self._providers: set[str] = set()
        self._tokens: list[int | float] = [0, 0]
        self._cost = 0.0
        self._status: str | None = None
        self._exited = False
        self._trip: str | None = None

    # -- frames --------------------------------------------------------------------------------

    def frame(
        self,
        seq: int,
        kind: str,
        time_ns: int,
        payload: dict[str, Any],
        files: list[dict[str, Any]] | None = None,
        tree: str | None = None,
    ) -> SpanPlan | None:
        """The span of one frame (None for `run_start`: it opens the run's span)."""
        self._frames += 1
        if self._start is None:
            self._start = time_ns
        self._end = max(self._end or time_ns, time_ns)
        cost = payload.get("cost_usd")
        if _number(cost):
            self._cost += cost
        if kind == "run_start":
            self._run_start(payload)
            return None
        self._verdict(kind, payload)
        handler = self._HANDLERS.get(kind)
        span = getattr(self, handler)(seq, time_ns, payload) if handler is not None else None
        if span is None:
            span = self._span(seq, f"jukebox.{kind}", time_ns, time_ns)
            fields = _scalars(f"jukebox.{kind}", payload, skip=("cost_usd",))
            if kind not in KNOWN_KINDS and not self.capture:
                # A kind from a later Jukebox: its text could be content this one cannot tell.
                fields = {k: v for k, v in fields.items() if not isinstance(v, str)}
            span.attributes.update(fields)
        span.attributes["jukebox.frame.seq"] = seq
        span.attributes["jukebox.frame.kind"] = kind
        if _number(cost):
            span.attributes["jukebox.cost_usd"] = cost
        if tree is not None:
            span.attributes["jukebox.tree"] = tree
        if files is not None:
            self._files(span, time_ns, files)
        return _clean(span)

    # The frame kinds with a mapping of their own; any other kind is a plain `jukebox.{kind}`.
    _HANDLERS = {
        kind: f"_{kind}"
        for kind in ("llm_turn", "tool_call", "agent_turn", "checkpoint", "rollback", "verify",
                     "breaker", "exit", "fork", "note", "sql")
    }  # fmt: skip

    def _span(self, seq: int, name: str, start: int, end: int, kind: str = "internal") -> SpanPlan:
        return SpanPlan(
            name=name,
            span_id=otel_ids.span_id(self.tape_id, seq),
            parent_id=self.run_span_id,
            start_ns=min(start, end),
            end_ns=end,
            kind=kind,
        )

    def _run_start(self, p: dict[str, Any]) -> None:
        given = p["argv"] if isinstance(p.get("argv"), list) else []
        argv = [str(a) for a in given if isinstance(a, str | int | float)]
        name = p["name"] if isinstance(p.get("name"), str) else None
        if name is None and argv:
            name = argv[0].rsplit("/", 1)[-1]
        self._root["gen_ai.agent.name"] = name or "agent"
        if argv:
            self._root["jukebox.run.argv"] = redact_argv(argv)
        for key in ("cwd", "image", "function"):
            if isinstance(p.get(key), str):
                self._root[f"jukebox.run.{key}"] = _text(p[key])

    def _verdict(self, kind: str, p: dict[str, Any]) -> None:
        # The same reading as `jukebox ls` (jukebox.tape.tape.Tape.summary).
        if kind == "commit":
            self._status = "COMMITTED"
        elif kind == "discard":
            self._status = "DISCARDED"
        elif kind == "rollback" and p.get("final") is True:
            self._status = "ROLLED_BACK"
        elif kind == "exit":
            self._exited = True
        elif kind == "fork":
            self._status, self._exited = None, False

    def _llm_turn(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        endpoint = str(p.get("endpoint") or "")
        op = operation(endpoint)
        provider = provider_name(str(p.get("provider") or ""), p.get("upstream"))
        request = p.get("request")
        model = request.get("model") if isinstance(request, dict) else None
        if not isinstance(model, str):
            model = p["model"] if isinstance(p.get("model"), str) else None
        facts = call_facts(endpoint, p.get("response"))
        latency = _ns(p.get("latency_ms"), 1e6)
        start = time_ns - latency
        span = self._span(seq, f"{op} {model}" if model else op, start, time_ns, "client")
        a = span.attributes
        a["gen_ai.operation.name"] = op
        a["gen_ai.provider.name"] = provider
        common = {"gen_ai.operation.name": op, "gen_ai.provider.name": provider}
        if model:
            a["gen_ai.request.model"] = common["gen_ai.request.model"] = model
        usage = p["usage"] if isinstance(p.get("usage"), dict) else {}
        status = p.get("status")
        failed = not (isinstance(status, int) and 200 <= status < 300)
        # The frame's `model` is the answer's, else the request's: only an answer names one.
        recorded = p["model"] if isinstance(p.get("model"), str) and not failed else None
        if facts.response_model or recorded:
            response_model = str(facts.response_model or recorded)
            a["gen_ai.response.model"] = common["gen_ai.response.model"] = response_model
        if facts.response_id:
            a["gen_ai.response.id"] = facts.response_id
        if facts.finish_reasons:
            a["gen_ai.response.finish_reasons"] = facts.finish_reasons
        a.update(request_settings(request))
        if failed:
            error = str(status) if isinstance(status, int) and status else "no_response"
            a["error.type"] = common["error.type"] = error
            span.error = _text(p.get("error") or f"the upstream answered {status}")
        counts = (usage.get("input"), usage.get("output"))
        for key, value in zip(("input", "output"), counts, strict=True):
            if _number(value):
                a[f"gen_ai.usage.{key}_tokens"] = value
        if _number(usage.get("cached")) and usage["cached"]:
            a["gen_ai.usage.cache_read.input_tokens"] = usage["cached"]
        if _number(usage.get("cache_write")) and usage["cache_write"]:
            a["gen_ai.usage.cache_creation.input_tokens"] = usage["cache_write"]
        a["jukebox.llm.endpoint"] = endpoint
        a["jukebox.llm.stream"] = bool(p.get("stream"))
        a["jukebox.llm.status"] = status if isinstance(status, int) else 0
        for key in ("upstream", "replayed_from", "usage_estimated", "rewritten"):
            value = p.get(key)
            if isinstance(value, str | int | bool) and value is not None:
                a[f"jukebox.llm.{key}"] = value
        calls = p["tool_calls"] if isinstance(p.get("tool_calls"), list) else []
        names = [c.get("name") for c in calls if isinstance(c, dict)]
        if names and all(isinstance(n, str) for n in names):
            a["jukebox.llm.tool_calls"] = names
        if self.capture and op != "embeddings":  # an embedding's input is no conversation
            a.update(content_attributes(p, facts.finish_reasons, self.scrubber))
        # The run's totals and the client metrics.
        self._providers.add(provider)
        self.metrics.append(MetricPoint(OPERATION_DURATION, latency / 1e9, dict(common)))
        for i, (key, value) in enumerate(zip(("input", "output"), counts, strict=True)):
            if _number(value) and not failed:
                self._tokens[i] += value
                self.metrics.append(
                    MetricPoint(TOKEN_USAGE, value, {**common, "gen_ai.token.type": key})
                )
        return span

    def _tool_call(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        tool = str(p.get("tool") or "tool")
        mcp = isinstance(p.get("server"), str)  # a call through the MCP gateway (docs/mcp.md)
        took = _ns(p.get("latency_ms"), 1e6) or _ns(p.get("seconds"), 1e9)
        span = self._span(
            seq, f"execute_tool {tool}", time_ns - took, time_ns, "client" if mcp else "internal"
        )
        a = span.attributes
        a["gen_ai.operation.name"] = "execute_tool"
        a["gen_ai.tool.name"] = tool
        a["gen_ai.tool.type"] = "extension" if mcp else "function"
        for key in ("call_id", "id", "tool_call_id"):
            if isinstance(p.get(key), str):
                a["gen_ai.tool.call.id"] = p[key]
                break
        error = p["error"] if isinstance(p.get("error"), dict) else None
        result = p["result"] if isinstance(p.get("result"), dict) else {}
        if mcp:
            # The MCP conventions' client attributes, on the execute_tool span they extend.
            a["mcp.method.name"] = "tools/call"
            a["network.transport"] = "pipe"
            skip = ("tool", "ok", "latency_ms", "cost_usd", "args", "result")  # content: opt-in
            a.update(_scalars("jukebox.mcp", p, skip=skip))
        if error is not None:
            code = error.get("code")
            a["error.type"] = str(code) if code is not None else "_OTHER"
            if code is not None:
                a["rpc.response.status_code"] = str(code)
            span.error = _text(error.get("message") or f"the tool {tool} failed")
        elif p.get("ok") is False or result.get("isError") is True:
            a["error.type"] = "tool_error"
            span.error = f"the tool {tool} failed"
        if self.capture:
            if "args" in p:
                a["gen_ai.tool.call.arguments"] = json_attribute(p["args"], self.scrubber)
            if "result" in p:
                a["gen_ai.tool.call.result"] = json_attribute(p["result"], self.scrubber)
        return span

    def _sql(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        """A statement through the SQL proxy (docs/sql.md), as the database conventions' client
        span; the statement's text and parameters are content (literals, rows' values)."""
        tag = p["tag"] if isinstance(p.get("tag"), str) else ""
        op = tag.split(" ", 1)[0] if tag else ""
        db = p["db"] if isinstance(p.get("db"), str) else None
        name = " ".join(x for x in (op, db) if x) or "postgresql"
        span = self._span(seq, name, time_ns - _ns(p.get("ms"), 1e6), time_ns, "client")
        a = span.attributes
        a["db.system.name"] = "postgresql"
        if db:
            a["db.namespace"] = db
        if op:
            a["db.operation.name"] = op
        if _number(p.get("rows")):
            a["db.response.returned_rows"] = p["rows"]
        a.update(_scalars("jukebox.sql", p, skip=("statement", "db", "tag", "rows")))
        error = p["error"] if isinstance(p.get("error"), dict) else None
        if error is not None:
            code = str(error.get("code") or "_OTHER")
            a["error.type"] = a["db.response.status_code"] = code
            span.error = _text(error.get("message") or f"the statement failed ({code})")
        if self.capture and isinstance(p.get("statement"), str):
            a["db.query.text"] = json_attribute(p["statement"], self.scrubber)
        return span

    def _agent_turn(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        span = self._span(seq, "jukebox.agent_turn", time_ns, time_ns)
        a = span.attributes
        agent = p.get("agent_name", p.get("agent"))
        if isinstance(agent, str):
            a["gen_ai.agent.name"] = agent
        if isinstance(p.get("model"), str):
            a["gen_ai.request.model"] = p["model"]
        if _number(p.get("tokens")):
            a["jukebox.agent_turn.tokens"] = p["tokens"]
        if p.get("failed") is True:
            a["error.type"] = "agent_turn_failed"
            span.error = "the agent reported a failed turn"
        message = p.get("message", p.get("text"))
        if self.capture and message is not None:
            a["jukebox.agent_turn.message"] = json_attribute(message, self.scrubber)
        return span

    def _checkpoint(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        span = self._span(seq, "jukebox.checkpoint", time_ns, time_ns)
        span.attributes.update(_scalars("jukebox.checkpoint", p, skip=("journal",)))
        return span

    def _rollback(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        span = self._span(seq, "jukebox.rollback", time_ns, time_ns)
        span.attributes.update(_scalars("jukebox.rollback", p))
        return span

    def _verify(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        span = self._span(seq, "jukebox.verify", time_ns - _ns(p.get("seconds"), 1e9), time_ns)
        a = span.attributes
        a.update(_scalars("jukebox.verify", p, skip=("output",)))
        cmd = p.get("cmd")
        if isinstance(cmd, list):
            a["jukebox.verify.cmd"] = redact_argv([str(c) for c in cmd])
        if p.get("ok") is False and not p.get("skipped"):
            a["error.type"] = "verifier_failed"
            span.error = f"the verifier failed (exit {p.get('exit')})"
        if self.capture and isinstance(p.get("output"), str):
            a["jukebox.verify.output"] = json_attribute(p["output"], self.scrubber)
        return span

    def _breaker(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        span = self._span(seq, "jukebox.breaker", time_ns, time_ns)
        span.attributes.update(_scalars("jukebox.breaker", p))
        rule = str(p.get("rule") or "?")
        span.attributes["error.type"] = "breaker_tripped"
        span.error = self._trip = f"the circuit breaker tripped: {rule}"
        return span

    def _exit(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        # The agent process's own lifetime.
        span = self._span(seq, "jukebox.exit", time_ns - _ns(p.get("seconds"), 1e9), time_ns)
        span.attributes.update(_scalars("jukebox.exit", p))
        if p.get("code") not in (0, None) or p.get("signal"):
            span.attributes["error.type"] = "exit_status"
            span.error = f"the agent exited with code {p.get('code')}, signal {p.get('signal')}"
        return span

    def _fork(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        span = self._span(seq, "jukebox.fork", time_ns, time_ns)
        origin = p["forked_from"] if isinstance(p.get("forked_from"), dict) else {}
        original = origin.get("tape")
        if isinstance(original, str):
            span.attributes["jukebox.fork.from"] = original
            self._root["jukebox.fork.from"] = original
            link = (otel_ids.trace_id(original), otel_ids.run_span_id(original))
            self._links.append(link)
            span.links.append(link)
        if isinstance(origin.get("at"), int):
            span.attributes["jukebox.fork.at"] = origin["at"]
        return span

    def _note(self, seq: int, time_ns: int, p: dict[str, Any]) -> SpanPlan:
        event = str(p.get("event") or "note")
        span = self._span(seq, f"jukebox.note {event}", time_ns, time_ns)
        span.attributes.update(_scalars("jukebox.note", p))
        return span

    def _files(self, span: SpanPlan, time_ns: int, files: list[dict[str, Any]]) -> None:
        span.attributes["jukebox.files.changed"] = len(files)
        for row in files[:FILE_EVENTS]:
            attrs: dict[str, Any] = {
                "jukebox.file.path": str(row.get("path")),
                "jukebox.file.status": str(row.get("status")),
            }
            if _number(row.get("size")):
                attrs["jukebox.file.size"] = row["size"]
            span.events.append(EventPlan("jukebox.file.change", time_ns, attrs))

    # -- the run -------------------------------------------------------------------------------

    def finish(self, end_ns: int | None = None) -> SpanPlan:
        """The run's `invoke_agent` span, from the first frame to the last (or ``end_ns``)."""
        start = self._start if self._start is not None else (end_ns or 0)
        end = max(end_ns or 0, self._end or start)
        name = self._root.get("gen_ai.agent.name", "agent")
        span = SpanPlan(
            name=f"invoke_agent {name}",
            span_id=self.run_span_id,
            parent_id=None,
            start_ns=start,
            end_ns=end,
            attributes=dict(self._root),
            links=list(self._links),
        )
        a = span.attributes
        if len(self._providers) == 1:
            a["gen_ai.provider.name"] = next(iter(self._providers))
        elif self._providers:
            a["jukebox.providers"] = sorted(self._providers)
        a["gen_ai.usage.input_tokens"] = self._tokens[0]
        a["gen_ai.usage.output_tokens"] = self._tokens[1]
        a["jukebox.cost_usd"] = round(self._cost, 10)
        a["jukebox.frames"] = self._frames
        a["jukebox.status"] = self._status or ("EXITED" if self._exited else "RUNNING")
        if self._trip is not None:
            a["error.type"] = "breaker_tripped"
            span.error = self._trip
        return _clean(span)

