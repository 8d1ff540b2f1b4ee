"""The OpenTelemetry export in process: a tape recorded with the real openai and anthropic
clients through the real proxy, turned into the SDK's own spans (collected by its
InMemorySpanExporter) and metrics (its InMemoryMetricReader), attribute by attribute."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from jukebox.export import otel_ids
from jukebox.export.otel_content import environment_scrubber
from jukebox.export.otel_mapping import TapeMapper
from jukebox.export.otel_send import (
    collect_metrics,
    plan_tape,
    readable_span,
    resource,
    send_spans,
)
from jukebox.tape.tape import Tape, TapeWriter
from tests.export.conftest import ARGV_KEY, ENV_SECRET, KEY_SHAPED, Recorded


def exported(recorded: Recorded, **kwargs: Any) -> tuple[Any, dict[int, Any], Any]:
    """(the tape, its spans by frame seq with the run's span at -1, the plans)."""
    tape = recorded.load()
    plans = plan_tape(tape, **kwargs)
    res = resource(plans.tape_id)
    exporter = InMemorySpanExporter()
    assert send_spans([readable_span(p, plans.trace_id, res) for p in plans.spans], exporter)
    by_seq = {}
    for span in exporter.get_finished_spans():
        seq = span.attributes.get("jukebox.frame.seq", -1)
        by_seq[seq] = span
    return tape, by_seq, plans


def attrs(span: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in span.attributes.items()}


def everything(span: Any) -> str:
    """Every value a span carries, as one string to search."""
    values = [span.name, span.status.description or "", *map(str, span.attributes.values())]
    for event in span.events:
        values += [event.name, *map(str, event.attributes.values())]
    return "\n".join(values)


def test_model_calls_are_genai_client_spans_with_every_attribute(recorded: Recorded) -> None:
    tape, spans, _ = exported(recorded)
    root = spans[-1]
    trace = otel_ids.trace_id("otelrun")
    assert len(spans) == len(tape.frames)  # run_start opens the run's span, others are one each
    for seq, span in spans.items():
        assert span.context.trace_id == trace
        if seq >= 0:
            frame = tape.frames[seq]
            assert span.parent.span_id == root.context.span_id
            assert span.context.span_id == otel_ids.span_id("otelrun", seq)
            assert span.end_time == frame.time_ns  # the recorded time, not the export's
        assert span.resource.attributes["service.name"] == "jukebox"
        assert span.instrumentation_scope.name == "jukebox"

    chat = spans[1]  # OpenAI chat, JSON, answered with a tool call
    payload = tape.frames[1].payload
    assert chat.name == "chat gpt-4o-mini" and chat.kind == SpanKind.CLIENT
    assert chat.start_time == tape.frames[1].time_ns - int(payload["latency_ms"] * 1e6)
    assert attrs(chat) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-4o-mini",
        "gen_ai.response.model": "gpt-4o-mini",
        "gen_ai.response.id": "chatcmpl-fake",
        "gen_ai.response.finish_reasons": ["tool_calls"],
        "gen_ai.usage.input_tokens": payload["usage"]["input"],
        "gen_ai.usage.output_tokens": payload["usage"]["output"],
        "jukebox.llm.endpoint": "chat.completions",
        "jukebox.llm.stream": False,
        "jukebox.llm.status": 200,
        "jukebox.llm.tool_calls": ["write_file"],
        "jukebox.cost_usd": payload["cost_usd"],
        "jukebox.frame.seq": 1,
        "jukebox.frame.kind": "llm_turn",
    }
    assert chat.status.status_code == StatusCode.UNSET

    stream = attrs(spans[3])  # OpenAI chat stream
    assert stream["jukebox.llm.stream"] is True and stream["gen_ai.response.finish_reasons"] == [
        "stop"
    ]
    responses = attrs(spans[5])  # OpenAI Responses
    assert (responses["gen_ai.operation.name"], responses["gen_ai.response.id"]) == (
        "chat",
        "resp_fake",
    )
    assert attrs(spans[6])["gen_ai.response.finish_reasons"] == ["stop"]  # Responses stream
    anthropic = attrs(spans[7])
    assert anthropic["gen_ai.provider.name"] == "anthropic"
    assert anthropic["gen_ai.request.max_tokens"] == 64
    assert anthropic["gen_ai.response.finish_reasons"] == ["tool_use"]
    assert anthropic["gen_ai.response.id"] == "msg_fake"
    streamed = attrs(spans[8])  # Anthropic stream through the SDK's helper, a cache read
    assert streamed["gen_ai.response.finish_reasons"] == ["end_turn"]
    assert streamed["gen_ai.usage.cache_read.input_tokens"] == 3
    embeddings = spans[11]
    assert embeddings.name == "embeddings text-embedding-3-small"
    assert attrs(embeddings)["gen_ai.operation.name"] == "embeddings"
    assert attrs(embeddings)["gen_ai.usage.input_tokens"] == 3
    completion = attrs(spans[12])
    assert completion["gen_ai.operation.name"] == "text_completion"
    assert completion["gen_ai.request.max_tokens"] == 5
    assert completion["gen_ai.response.finish_reasons"] == ["stop"]

    failed = spans[13]  # the upstream answered 429
    assert failed.status.status_code == StatusCode.ERROR
    assert attrs(failed)["error.type"] == "429" and "gen_ai.response.model" not in attrs(failed)


def test_tools_and_jukebox_frames_become_spans(recorded: Recorded) -> None:
    tape, spans, _ = exported(recorded)
    tool = spans[14]
    assert tool.name == "execute_tool write_file" and tool.kind == SpanKind.INTERNAL
    assert attrs(tool) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "write_file",
        "gen_ai.tool.type": "function",
        "gen_ai.tool.call.id": "call_fake_1",
        "jukebox.frame.seq": 14,
        "jukebox.frame.kind": "tool_call",
    }
    assert tool.end_time - tool.start_time == 250_000_000  # the recorded 0.25 s
    assert spans[15].status.status_code == StatusCode.ERROR  # ok: false

    checkpoint = spans[16]
    assert checkpoint.name == "jukebox.checkpoint"
    assert attrs(checkpoint)["jukebox.checkpoint.label"] == "tests-pass"
    assert attrs(checkpoint)["jukebox.checkpoint.id"] == 1
    assert attrs(checkpoint)["jukebox.tree"] == tape.frames[16].tree.hex()
    assert attrs(checkpoint)["jukebox.files.changed"] == 2
    changes = {e.attributes["jukebox.file.path"]: dict(e.attributes) for e in checkpoint.events}
    assert changes["hello.txt"]["jukebox.file.status"] == "added"
    assert changes["hello.txt"]["jukebox.file.size"] == 6
    assert changes["a.txt"]["jukebox.file.status"] == "deleted"
    assert {e.name for e in checkpoint.events} == {"jukebox.file.change"}

    verify = spans[17]
    assert verify.status.status_code == StatusCode.ERROR
    assert attrs(verify)["jukebox.verify.cmd"] == ["pytest", "-q"]
    assert attrs(verify)["jukebox.verify.exit"] == 1
    assert verify.end_time - verify.start_time == 1_500_000_000
    breaker = attrs(spans[18])
    assert breaker["jukebox.breaker.rule"] == "max_cost_usd"
    assert breaker["jukebox.breaker.value"] == 0.75
    rollback = attrs(spans[19])
    assert rollback["jukebox.rollback.to"] == 0 and rollback["jukebox.files.changed"] == 2
    assert spans[20].name == "jukebox.exit" and attrs(spans[20])["jukebox.exit.code"] == 0
    assert attrs(spans[21])["jukebox.rollback.final"] is True

    root = spans[-1]
    assert root.name == "invoke_agent otel-agent" and root.parent is None
    assert root.start_time == tape.frames[0].time_ns and root.end_time == tape.frames[-1].time_ns
    a = attrs(root)
    assert a["gen_ai.operation.name"] == "invoke_agent"
    assert a["gen_ai.agent.name"] == "otel-agent" and a["gen_ai.agent.id"] == "otelrun"
    assert a["jukebox.status"] == "ROLLED_BACK"  # as `jukebox ls` says
    assert a["jukebox.providers"] == ["anthropic", "openai"]
    assert a["jukebox.run.argv"] == ["python", "agent.py", "--api-key", "[REDACTED]"]
    model_spans = [s for s in spans.values() if s.kind == SpanKind.CLIENT]
    assert a["gen_ai.usage.input_tokens"] == sum(
        s.attributes["gen_ai.usage.input_tokens"]
        for s in model_spans
        if s.status.status_code != StatusCode.ERROR
    )
    assert root.status.status_code == StatusCode.ERROR  # the breaker tripped
    assert a["jukebox.cost_usd"] == pytest.approx(tape.summary()["cost_usd"])


def test_client_metrics_are_the_conventions_histograms(recorded: Recorded) -> None:
    tape, spans, plans = exported(recorded)
    data = collect_metrics(plans.metrics, resource(plans.tape_id))
    metrics = {
        m.name: m
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert set(metrics) == {"gen_ai.client.token.usage", "gen_ai.client.operation.duration"}
    assert metrics["gen_ai.client.token.usage"].unit == "{token}"
    assert metrics["gen_ai.client.operation.duration"].unit == "s"
    usage = metrics["gen_ai.client.token.usage"].data.data_points
    by_key = {
        (p.attributes["gen_ai.request.model"], p.attributes["gen_ai.token.type"]): p
        for p in usage
    }
    haiku_in = by_key[("claude-haiku-4-5", "input")]
    assert haiku_in.attributes["gen_ai.provider.name"] == "anthropic"
    assert haiku_in.attributes["gen_ai.operation.name"] == "chat"
    haiku_calls = [s for s in spans.values() if s.name == "chat claude-haiku-4-5"]
    assert haiku_in.count == len(haiku_calls) == 3
    assert haiku_in.sum == sum(s.attributes["gen_ai.usage.input_tokens"] for s in haiku_calls)
    durations = metrics["gen_ai.client.operation.duration"].data.data_points
    model_calls = [f for f in tape.frames if f.kind == "llm_turn"]
    assert sum(p.count for p in durations) == len(model_calls)
    assert sum(p.sum for p in durations) == pytest.approx(
        sum(f.payload["latency_ms"] for f in model_calls) / 1000
    )
    errors = [p for p in durations if p.attributes.get("error.type") == "429"]
    assert len(errors) == 1 and errors[0].count == 1


def test_content_is_left_out_unless_asked(recorded: Recorded) -> None:
    _, spans, _ = exported(recorded)
    for span in spans.values():
        text = everything(span)
        for secret in ("write hello", ENV_SECRET, KEY_SHAPED, ARGV_KEY, "1 failed"):
            assert secret not in text, (span.name, secret)
        assert not any(k.startswith(("gen_ai.input", "gen_ai.output")) for k in span.attributes)
        assert "gen_ai.tool.call.arguments" not in span.attributes


def test_captured_content_is_scrubbed_of_secrets(
    recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: a prompt, a tool's arguments and result and a verifier's output hold an
    environment secret and a key; --capture-content must not carry either out."""
    monkeypatch.setenv("DB_PASSWORD", ENV_SECRET)
    _, spans, _ = exported(recorded, capture=True, scrubber=environment_scrubber())
    for span in spans.values():
        text = everything(span)
        assert ENV_SECRET not in text and KEY_SHAPED not in text, span.name
    chat = attrs(spans[1])
    assert json.loads(chat["gen_ai.system_instructions"]) == [
        {"type": "text", "content": "You are a file agent."}
    ]
    inputs = json.loads(chat["gen_ai.input.messages"])
    assert inputs == [
        {
            "role": "user",
            "parts": [
                {
                    "type": "text",
                    "content": "write hello; my password is [REDACTED] and the key [REDACTED]",
                }
            ],
        }
    ]
    output = json.loads(chat["gen_ai.output.messages"])
    assert output[0]["role"] == "assistant" and output[0]["finish_reason"] == "tool_calls"
    call = output[0]["parts"][0]
    assert (call["type"], call["id"], call["name"]) == ("tool_call", "call_fake_1", "write_file")
    answered = json.loads(attrs(spans[2])["gen_ai.input.messages"])
    assert answered[-1] == {
        "role": "tool",
        "parts": [
            {"type": "tool_call_response", "id": "call_fake_1", "response": "wrote hello.txt"}
        ],
    }
    streamed = json.loads(attrs(spans[8])["gen_ai.output.messages"])
    assert streamed[0]["parts"] == [{"type": "text", "content": "echo: use the cache and stream"}]
    tool = attrs(spans[14])
    assert json.loads(tool["gen_ai.tool.call.arguments"])["path"] == "hello.txt"
    assert tool["gen_ai.tool.call.result"] == "wrote hello.txt ([REDACTED])"
    assert attrs(spans[17])["jukebox.verify.output"] == "1 failed: [REDACTED]\n"


def test_ids_derive_from_the_tape_id(recorded: Recorded) -> None:
    _, first, _ = exported(recorded)
    _, again, _ = exported(recorded)
    assert [(s.context.trace_id, s.context.span_id) for s in first.values()] == [
        (s.context.trace_id, s.context.span_id) for s in again.values()
    ]
    assert otel_ids.trace_id("otelrun") != otel_ids.trace_id("otelrun2")
    assert otel_ids.span_id("otelrun", 1) != otel_ids.span_id("otelrun", 2)
    assert otel_ids.run_span_id("otelrun") != otel_ids.span_id("otelrun", 0)


def test_a_fork_is_its_own_trace_linked_to_the_original(tmp_path: Path) -> None:
    original_path = tmp_path / "orig.jbx"
    with TapeWriter.create(original_path, None, "orig") as w:
        w.append("run_start", {"name": "forky", "argv": ["agent"]})
        w.append("agent_turn", {"agent_name": "planner", "message": "plan it", "model": "m",
                                "cost_usd": 0.25, "tokens": 12})  # fmt: skip
        w.append("note", {"event": "llm_passthrough", "path": "/v1/models?key=sk-abcdefghijklmnop1",
                          "status": 200})  # fmt: skip
        w.append("exit", {"code": 3, "signal": None, "seconds": 1.0})
    original = Tape.load(original_path)
    with TapeWriter.fork_from(original, 2, tmp_path / "fork.jbx", "fork1") as w:
        w.append("exit", {"code": 0, "signal": None, "seconds": 0.5})
    fork = Tape.load(tmp_path / "fork.jbx")

    orig_plans, fork_plans = plan_tape(original), plan_tape(fork)
    assert orig_plans.trace_id != fork_plans.trace_id
    assert not {p.span_id for p in orig_plans.spans} & {p.span_id for p in fork_plans.spans}
    link = (otel_ids.trace_id("orig"), otel_ids.run_span_id("orig"))
    fork_root = fork_plans.spans[-1]
    assert fork_root.links == [link] and fork_root.attributes["jukebox.fork.from"] == "orig"
    fork_frame = next(p for p in fork_plans.spans if p.name == "jukebox.fork")
    assert fork_frame.attributes["jukebox.fork.at"] == 2 and fork_frame.links == [link]
    assert fork_root.attributes["jukebox.status"] == "EXITED"

    names = [p.name for p in orig_plans.spans]
    assert names == ["jukebox.agent_turn", "jukebox.note llm_passthrough", "jukebox.exit",
                     "invoke_agent forky"]  # fmt: skip
    turn = orig_plans.spans[0].attributes
    assert turn["gen_ai.agent.name"] == "planner" and turn["jukebox.cost_usd"] == 0.25
    assert "jukebox.agent_turn.message" not in turn  # content
    note = orig_plans.spans[1].attributes
    assert note["jukebox.note.status"] == 200
    assert "sk-abcdefghijklmnop1" not in note["jukebox.note.path"]  # notes pass redact too
    assert orig_plans.spans[2].error is not None  # exit code 3


def test_mcp_tool_calls_carry_the_mcp_client_attributes() -> None:
    """Tool calls as the MCP gateway records them (docs/mcp.md): allowed, an error result, a
    protocol error, a denial."""
    mapper = TapeMapper("mcp-run")
    mapper.frame(0, "run_start", 1_000_000_000, {"name": "mcp:files"})
    base = {"server": "files", "tool": "write_file", "args": {"path": "a", "text": "SECRET"},
            "reported_by": "gateway"}  # fmt: skip
    ok = mapper.frame(1, "tool_call", 2_000_000_000, {
        **base, "result": {"content": [{"type": "text", "text": "done"}], "isError": False},
        "latency_ms": 12.5, "decision": "allow", "ok": True})  # fmt: skip
    assert ok is not None and ok.kind == "client" and ok.name == "execute_tool write_file"
    assert ok.start_ns == 2_000_000_000 - 12_500_000 and ok.error is None
    assert ok.attributes == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "write_file",
        "gen_ai.tool.type": "extension",
        "mcp.method.name": "tools/call",
        "network.transport": "pipe",
        "jukebox.mcp.server": "files",
        "jukebox.mcp.decision": "allow",
        "jukebox.mcp.reported_by": "gateway",
        "jukebox.frame.seq": 1,
        "jukebox.frame.kind": "tool_call",
    }
    failed = mapper.frame(2, "tool_call", 3_000_000_000, {
        **base, "result": {"content": [], "isError": True}, "ok": False,
        "decision": "allow"})  # fmt: skip
    assert failed is not None and failed.attributes["error.type"] == "tool_error"
    broken = mapper.frame(3, "tool_call", 4_000_000_000, {
        **base, "error": {"code": -32602, "message": "bad params"}, "ok": False})  # fmt: skip
    assert broken is not None and broken.error == "bad params"
    assert broken.attributes["error.type"] == broken.attributes["rpc.response.status_code"]
    assert broken.attributes["error.type"] == "-32602"
    denied = mapper.frame(4, "tool_call", 5_000_000_000, {
        **base, "decision": "deny", "why": "policy: denied", "ok": False})  # fmt: skip
    assert denied is not None and denied.attributes["jukebox.mcp.why"].startswith("policy")
    for span in (ok, failed, broken, denied):
        assert "SECRET" not in json.dumps(span.attributes)  # arguments are content


def test_sql_statements_are_database_client_spans() -> None:
    """Statements as the SQL proxy records them (docs/tape-format.md): the statement's text is
    content, exported only on request."""
    payload = {"db": "shop", "conn": 2, "statement": "UPDATE users SET pw = 'hunter2' WHERE id = 1",
               "tag": "UPDATE 1", "rows": 1, "rows_changed": 1, "ms": 4.5}  # fmt: skip
    for capture in (False, True):
        mapper = TapeMapper("sql-run", capture=capture)
        mapper.frame(0, "run_start", 0, {"name": "agent"})
        span = mapper.frame(1, "sql", 10_000_000, payload)
        assert span is not None and span.name == "UPDATE shop" and span.kind == "client"
        assert span.start_ns == 10_000_000 - 4_500_000
        a = span.attributes
        assert (a["db.system.name"], a["db.namespace"], a["db.operation.name"]) == (
            "postgresql",
            "shop",
            "UPDATE",
        )
        assert a["db.response.returned_rows"] == 1 and a["jukebox.sql.rows_changed"] == 1
        assert ("hunter2" in json.dumps(a)) is capture
    error = {"code": "42601", "message": "syntax"}
    failed = mapper.frame(2, "sql", 20_000_000, {"db": "shop", "statement": "x", "error": error})
    assert failed is not None and failed.error == "syntax"
    assert failed.attributes["error.type"] == "42601"


def test_a_newer_kind_keeps_its_text_unless_content_is_asked_for() -> None:
    payload = {"prompt": "the secret plan", "count": 3, "ok": True}
    for capture in (False, True):
        mapper = TapeMapper("later", capture=capture)
        span = mapper.frame(1, "hologram", 5, payload)
        assert span is not None and span.name == "jukebox.hologram"
        assert span.attributes["jukebox.hologram.count"] == 3
        assert span.attributes["jukebox.hologram.ok"] is True
        assert ("jukebox.hologram.prompt" in span.attributes) is capture
