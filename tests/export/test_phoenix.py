"""A real receiver: `jukebox export otel` into Arize Phoenix (started by the test from its PyPI
package), the spans read back through Phoenix's REST API, then exported again."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from jukebox.export import otel_ids
from jukebox.export.otel_live import CAPTURE_ENV, from_environment
from jukebox.export.otel_send import export_tape
from jukebox.tape.tape import Tape, TapeWriter
from tests.export.conftest import ENV_SECRET, KEY_SHAPED, Recorded
from tests.export.phoenix import Phoenix
from tests.export.test_export_cli import jukebox


def same_time(iso: str, time_ns: int) -> bool:
    """Phoenix keeps microseconds, rounded: the recorded time to within one."""
    stamp = datetime.fromisoformat(iso)
    micros = int(stamp.timestamp()) * 1_000_000 + stamp.microsecond
    return abs(micros - time_ns / 1000) <= 1


def marker_tape(root: Path, tape_id: str) -> Tape:
    path = root / f"{tape_id}.jbx"
    with TapeWriter.create(path, None, tape_id) as writer:
        writer.append("run_start", {"name": tape_id, "argv": ["true"]})
        writer.append("exit", {"code": 0, "signal": None, "seconds": 0.01})
    return Tape.load(path)


def test_phoenix_reads_back_what_was_exported(
    recorded: Recorded, phoenix: Phoenix, tmp_path: Path
) -> None:
    result = jukebox("export", "otel", str(recorded.path), "--endpoint", phoenix.url, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["tapes"][0]
    assert report["spans_sent"] is True and report["spans"] == 22
    trace = report["trace_id"]

    spans = phoenix.wait_for(trace, 22)
    assert len(spans) == 22
    by_name = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    tape = recorded.load()
    root = by_name["invoke_agent otel-agent"][0]
    assert root["parent_id"] is None and root["status_code"] == "ERROR"
    assert root["attributes"]["gen_ai.operation.name"] == "invoke_agent"
    assert root["attributes"]["jukebox.status"] == "ROLLED_BACK"
    assert same_time(root["start_time"], tape.frames[0].time_ns)
    assert same_time(root["end_time"], tape.frames[-1].time_ns)
    children = [s for s in spans if s is not root]
    assert {s["parent_id"] for s in children} == {root["context"]["span_id"]}

    chat = next(s for s in by_name["chat gpt-4o-mini"] if s["attributes"]["jukebox.frame.seq"] == 1)
    frame = tape.frames[1]
    assert same_time(chat["end_time"], frame.time_ns)
    a = chat["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "gpt-4o-mini"
    assert a["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert a["gen_ai.usage.input_tokens"] == frame.payload["usage"]["input"]
    assert a["gen_ai.usage.output_tokens"] == frame.payload["usage"]["output"]
    assert "gen_ai.input.messages" not in a  # no content unless asked
    anthropic = by_name["chat claude-haiku-4-5"]
    assert {s["attributes"]["gen_ai.provider.name"] for s in anthropic} == {"anthropic"}
    assert by_name["embeddings text-embedding-3-small"][0]["attributes"][
        "gen_ai.operation.name"
    ] == "embeddings"
    tool = by_name["execute_tool write_file"][0]
    assert tool["attributes"]["gen_ai.tool.call.id"] == "call_fake_1"
    checkpoint = by_name["jukebox.checkpoint"][0]
    assert checkpoint["attributes"]["jukebox.checkpoint.label"] == "tests-pass"
    paths = {e["attributes"]["jukebox.file.path"] for e in checkpoint["events"]}
    assert paths == {"a.txt", "hello.txt"}
    assert by_name["jukebox.breaker"][0]["status_code"] == "ERROR"

    # Again, then a second tape behind it: once that one is in, the repeat has been taken too,
    # and Phoenix keeps one copy of each span (same trace and span ids).
    assert export_tape(recorded.load(), phoenix.url)["spans_sent"]
    marker = export_tape(marker_tape(tmp_path, "marker-after-repeat"), phoenix.url)
    assert len(phoenix.wait_for(marker["trace_id"], 2)) == 2
    assert len([s for s in phoenix.spans() if s["context"]["trace_id"] == trace]) == 22


def test_live_export_with_content_arrives_scrubbed(
    recorded: Recorded, phoenix: Phoenix, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live exporter a booth uses, fed the recorded frames, with content capture turned on
    by OpenTelemetry's own variable: the prompts arrive, the secrets in them do not."""
    monkeypatch.setenv("DB_PASSWORD", ENV_SECRET)
    warnings: list[str] = []
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url, CAPTURE_ENV: "true"}
    live = from_environment("live-content", warnings.append, env)
    assert live is not None
    live.start()
    tape = recorded.load()
    for frame in tape.frames:
        live.observe(frame, frame.resolve_payload(tape.store))
    live.close()
    assert warnings == []

    spans = phoenix.wait_for(f"{otel_ids.trace_id('live-content'):032x}", len(tape.frames))
    assert len(spans) == len(tape.frames)
    everything = json.dumps(spans)
    assert ENV_SECRET not in everything and KEY_SHAPED not in everything
    chat = next(s for s in spans if s["attributes"].get("jukebox.frame.seq") == 1)
    inputs = json.loads(chat["attributes"]["gen_ai.input.messages"])
    assert inputs[0]["parts"][0]["content"] == (
        "write hello; my password is [REDACTED] and the key [REDACTED]"
    )
    checkpoint = next(s for s in spans if s["name"] == "jukebox.checkpoint")
    assert checkpoint["events"] == []  # live: no file-change events (docs/otel.md)
