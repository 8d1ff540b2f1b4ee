"""Span plans to the OpenTelemetry SDK, and a whole tape to an OTLP endpoint.

The plans (jukebox.export.otel_mapping) become the SDK's own `ReadableSpan`s, with the recorded
timestamps and the ids derived from the tape id, and go to the SDK's OTLP/HTTP protobuf
exporter (`OTLPSpanExporter`); the model calls' durations and token counts are recorded in the
SDK's histograms (`gen_ai.client.operation.duration`, `gen_ai.client.token.usage`), collected
once and sent with `OTLPMetricExporter`. The exporters are called directly, not through a
background processor: `jukebox export otel` reports what the endpoint accepted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from jukebox import __version__
from jukebox.export.otel_mapping import (
    OPERATION_DURATION,
    TOKEN_USAGE,
    MetricPoint,
    SpanPlan,
    TapeMapper,
)
from jukebox.redact import Scrubber

SCOPE = "jukebox"
# The conventions' advisory bucket boundaries for the two client metrics.
TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                 16777216, 67108864]  # fmt: skip
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92]  # fmt: skip
BATCH = 512  # spans per OTLP request
DEFAULT_ENDPOINT = "http://localhost:4318"


def quiet_sdk_logs() -> None:
    """The exporters log failures with tracebacks; jukebox says it once, in one line, itself."""
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL + 1)


def resource(tape_id: str | None = None) -> Any:
    from opentelemetry.sdk.resources import Resource

    attributes: dict[str, Any] = {
        "service.name": os.environ.get("OTEL_SERVICE_NAME") or "jukebox",
        "service.version": __version__,
    }
    if tape_id is not None:
        attributes["jukebox.tape.id"] = tape_id
    return Resource.create(attributes)


def readable_span(plan: SpanPlan, trace_id: int, res: Any) -> Any:
    """One plan as the SDK's finished span."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

    flags = TraceFlags(TraceFlags.SAMPLED)

    def context(tid: int, sid: int) -> SpanContext:
        return SpanContext(tid, sid, is_remote=False, trace_flags=flags)

    status = Status(StatusCode.ERROR, plan.error) if plan.error else Status(StatusCode.UNSET)
    return ReadableSpan(
        name=plan.name,
        context=context(trace_id, plan.span_id),
        parent=context(trace_id, plan.parent_id) if plan.parent_id is not None else None,
        resource=res,
        attributes=plan.attributes,
        events=[Event(e.name, e.attributes, e.time_ns) for e in plan.events],
        links=[Link(context(t, s)) for t, s in plan.links],
        kind=SpanKind.CLIENT if plan.kind == "client" else SpanKind.INTERNAL,
        instrumentation_scope=InstrumentationScope(SCOPE, __version__),
        status=status,
        start_time=plan.start_ns,
        end_time=plan.end_ns,
    )


class Histograms:
    """The two GenAI client histograms on one meter provider (any reader: in memory for
    `jukebox export otel` and the tests, periodic OTLP for a live export)."""

    def __init__(self, readers: Sequence[Any], res: Any) -> None:
        from opentelemetry.sdk.metrics import MeterProvider

        self.provider = MeterProvider(resource=res, metric_readers=list(readers))
        meter = self.provider.get_meter(SCOPE, __version__)
        self._hist = {
            TOKEN_USAGE: meter.create_histogram(
                TOKEN_USAGE,
                unit="{token}",
                description="Number of input and output tokens used.",
                explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
            ),
            OPERATION_DURATION: meter.create_histogram(
                OPERATION_DURATION,
                unit="s",
                description="GenAI operation duration.",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
            ),
        }

    def record(self, points: Iterable[MetricPoint]) -> None:
        for point in points:
            self._hist[point.name].record(point.value, point.attributes)


def _file_rows(tape: Any, n: int) -> list[dict[str, Any]] | None:
    """Frame ``n``'s file changes against the tree before it (names and sizes, no content)."""
    from jukebox.display.names import name_json
    from shadowfs import tree

    frame = tape.frames[n]
    if frame.tree is None or tape.store is None or n == 0:
        return None
    before = tape.frames[0].tree if frame.kind == "commit" else tape.tree_at(n - 1)
    rows = []
    for change in tree.diff_trees(tape.store, before, frame.tree):
        row: dict[str, Any] = {**name_json(change.path), "status": change.status}
        entry = change.new or change.old
        if entry is not None and entry.kind == "file":
            row["size"] = entry.size
        rows.append(row)
    return rows


@dataclass
class TapePlans:
    tape_id: str
    trace_id: int
    spans: list[SpanPlan]
    metrics: list[MetricPoint]


def plan_tape(tape: Any, *, capture: bool = False, scrubber: Scrubber | None = None) -> TapePlans:
    """Every span of a loaded tape (jukebox.tape.tape.Tape, chain checked), the run's span last."""
    tape_id = tape.tape_id or os.path.basename(str(tape.path)).removesuffix(".jbx")
    mapper = TapeMapper(tape_id, capture=capture, scrubber=scrubber)
    spans = []
    for n, frame in enumerate(tape.frames):
        payload = frame.resolve_payload(tape.store) if tape.store is not None else frame.payload
        plan = mapper.frame(
            frame.seq,
            frame.kind,
            frame.time_ns,
            payload,
            files=_file_rows(tape, n),
            tree=frame.tree.hex() if frame.tree is not None else None,
        )
        if plan is not None:
            spans.append(plan)
    spans.append(mapper.finish())
    return TapePlans(tape_id, mapper.trace_id, spans, mapper.metrics)


def collect_metrics(points: Iterable[MetricPoint], res: Any) -> Any:
    """The points recorded in the SDK's histograms and collected once (MetricsData)."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    hist = Histograms([reader], res)
    hist.record(points)
    data = reader.get_metrics_data()
    hist.provider.shutdown()
    return data


def signal_url(endpoint: str, signal: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT's rule: the base URL plus `/v1/traces` or `/v1/metrics`.
    A signal's own URL given as the base (a pasted `.../v1/traces`) names the same base."""
    base = endpoint.rstrip("/")
    for path in ("/v1/traces", "/v1/metrics"):
        base = base.removesuffix(path)
    return f"{base}/v1/{signal}"


def export_endpoint(given: str | None) -> str:
    return given or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_ENDPOINT


def send_spans(spans: Sequence[Any], exporter: Any) -> bool:
    from opentelemetry.sdk.trace.export import SpanExportResult

    ok = True
    for i in range(0, len(spans), BATCH):
        ok = exporter.export(spans[i : i + BATCH]) == SpanExportResult.SUCCESS and ok
        if not ok:
            break
    return ok


def export_tape(
    tape: Any,
    endpoint: str,
    *,
    capture: bool = False,
    scrubber: Scrubber | None = None,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Send one tape's spans and metrics to an OTLP/HTTP endpoint; what was sent and accepted."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics.export import MetricExportResult

    quiet_sdk_logs()
    plans = plan_tape(tape, capture=capture, scrubber=scrubber)
    res = resource(plans.tape_id)
    spans = [readable_span(p, plans.trace_id, res) for p in plans.spans]
    traces = OTLPSpanExporter(endpoint=signal_url(endpoint, "traces"), timeout=timeout)
    try:
        spans_ok = send_spans(spans, traces)
    finally:
        traces.shutdown()
    metrics_ok: bool | None = None
    if plans.metrics:
        exporter = OTLPMetricExporter(endpoint=signal_url(endpoint, "metrics"), timeout=timeout)
        try:
            data = collect_metrics(plans.metrics, res)
            metrics_ok = exporter.export(data) == MetricExportResult.SUCCESS
        finally:
            exporter.shutdown()
    return {
        "tape": str(tape.path),
        "tape_id": plans.tape_id,
        "trace_id": f"{plans.trace_id:032x}",
        "spans": len(spans),
        "spans_sent": spans_ok,
        "metric_points": len(plans.metrics),
        "metrics_sent": metrics_ok,
    }
