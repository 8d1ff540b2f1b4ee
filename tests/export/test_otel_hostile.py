"""A hostile tape (one received from someone else) still exports: any payload under any kind,
times outside what OTLP can carry, numbers past 64 bits. The mapping never raises and what it
makes always encodes as OTLP protobuf."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from jukebox.export.otel_mapping import TapeMapper
from jukebox.export.otel_send import collect_metrics, readable_span, resource
from jukebox.tape.frame import KNOWN_KINDS

# Kept cheap to draw (Hypothesis's own drawing is most of this test's time).
texts = st.text(alphabet="ab:/ sk-\u202e\x1b", max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
# The fields each mapping reads, so the hostile values land where they are looked at.
FIELDS = ["provider", "endpoint", "model", "status", "latency_ms", "usage", "request", "response",
          "tool_calls", "cost_usd", "tool", "args", "result", "ok", "seconds", "cmd", "output",
          "rule", "code", "signal", "forked_from", "event", "argv", "name", "final"]  # fmt: skip
payloads = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)
kinds = st.sampled_from([*sorted(KNOWN_KINDS - {"run_start"}), "span", "files", "clean", "x9"])
RESOURCE = resource("hostile")
times = st.integers(min_value=-(2**63), max_value=10**20 - 1)


@settings(max_examples=100, deadline=None)
@given(
    frames=st.lists(st.tuples(kinds, times, payloads), max_size=4),
    start=payloads,
    capture=st.booleans(),
)
def test_any_frames_map_to_spans_that_encode(
    frames: list[tuple[str, int, dict[str, Any]]], start: dict[str, Any], capture: bool
) -> None:
    mapper = TapeMapper("hostile", capture=capture)
    plans = [mapper.frame(0, "run_start", 0, start)]
    for seq, (kind, time_ns, payload) in enumerate(frames, start=1):
        plans.append(mapper.frame(seq, kind, time_ns, payload, files=[{"path": "a", "status": 1}]))
    plans.append(mapper.finish())
    spans = [readable_span(p, mapper.trace_id, RESOURCE) for p in plans if p is not None]
    assert len(spans) == len(frames) + 1
    encoded = encode_spans(spans).SerializeToString()
    assert encoded
    for span in spans:
        assert 0 <= span.start_time <= span.end_time < 2**64
    if mapper.metrics:
        collect_metrics(mapper.metrics, RESOURCE)
