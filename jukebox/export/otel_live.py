"""Live export: a booth run with OTEL_EXPORTER_OTLP_ENDPOINT set sends its spans as frames land.

The tape writer hands each frame it wrote to `LiveExport.observe`, which only puts it on a
bounded queue (a full queue drops the frame and counts it): the run never waits for the
export. A worker thread maps frames to spans (jukebox.export.otel_mapping, the same mapping as
`jukebox export otel`) and gives them to the SDK's BatchSpanProcessor, itself a bounded queue
with its own thread, which sends them with the OTLP/HTTP exporter. The run's `invoke_agent`
span ends with the run, so it goes last, with the metrics, when the booth closes the export.

An unreachable or refusing collector costs at most one export attempt (EXPORT_TIMEOUT): the
first failure prints one warning and turns the export off for the rest of the run; the tape is
whole, and `jukebox export otel ID` sends it later with the same ids. Closing waits at most
CLOSE_TIMEOUT for what is still queued.

Live export leaves out what needs the store (file-change events: reading trees from a second
thread while the booth writes would be a cost to the run) and spilled payload values are
whatever the writer was given, in full. `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`
(the variable OpenTelemetry's GenAI instrumentations read) adds message content, scrubbed.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jukebox.export.otel_mapping import TapeMapper

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
QUEUE_LIMIT = 4096  # frames waiting to be mapped; the SDK's span queue is as long
EXPORT_TIMEOUT = 2.0  # seconds one OTLP request may take, retries included
CLOSE_TIMEOUT = 3.0  # seconds the end of a run waits for the last spans


def from_environment(
    tape_id: str, warn: Callable[[str], None], environ: Mapping[str, str] | None = None
) -> LiveExport | None:
    """A live export when OTEL_EXPORTER_OTLP_ENDPOINT names a collector, else None."""
    env = os.environ if environ is None else environ
    endpoint = env.get(ENDPOINT_ENV, "").strip()
    if not endpoint:
        return None
    capture = env.get(CAPTURE_ENV, "").strip().lower() in ("1", "true", "yes")
    return LiveExport(tape_id, endpoint, warn, capture=capture)


class LiveExport:
    def __init__(
        self, tape_id: str, endpoint: str, warn: Callable[[str], None], *, capture: bool = False
    ) -> None:
        from jukebox.export.otel_content import environment_scrubber

        self.tape_id = tape_id
        self.endpoint = endpoint
        self._warn = warn
        self.mapper = TapeMapper(
            tape_id, capture=capture, scrubber=environment_scrubber() if capture else None
        )
        self._frames: queue.Queue[tuple[Any, ...] | None] = queue.Queue(QUEUE_LIMIT)
        self.dropped = 0
        self.failed: str | None = None
        self._warned = False
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._processor: Any = None
        self._resource: Any = None
        self._closed = False

    # -- the writer's side: never blocks, never raises -------------------------------------------

    def observe(self, frame: Any, payload: Mapping[str, Any]) -> None:
        try:
            tree = frame.tree.hex() if frame.tree is not None else None
            item = (frame.seq, frame.kind, frame.time_ns, dict(payload), tree)
            self._frames.put_nowait(item)
        except queue.Full:
            self.dropped += 1
        except Exception as error:  # a bug of ours must not fail the run's recording
            self.fail(f"{type(error).__name__}: {error}")

    # -- the export's side -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the threads. A booth calls this once it has entered its namespaces: the
        supervisor may not run other threads before."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from jukebox.export.otel_send import quiet_sdk_logs, resource, signal_url

        with self._lock:
            if self._worker is not None:
                return
            quiet_sdk_logs()
            self._resource = resource(self.tape_id)
            exporter = OTLPSpanExporter(
                endpoint=signal_url(self.endpoint, "traces"), timeout=EXPORT_TIMEOUT
            )
            self._processor = BatchSpanProcessor(
                _guarded(exporter, self),
                max_queue_size=QUEUE_LIMIT,
                schedule_delay_millis=200,
                export_timeout_millis=EXPORT_TIMEOUT * 1000,
            )
            self._worker = threading.Thread(
                target=self._work, name="jukebox-otel-live", daemon=True
            )
            self._worker.start()

    def _work(self) -> None:
        from jukebox.export.otel_send import readable_span

        while True:
            item = self._frames.get()
            if item is None:
                return
            if self.failed is not None:
                continue  # keep draining: the writer must never find the queue full for long
            try:
                seq, kind, time_ns, payload, tree = item
                plan = self.mapper.frame(seq, kind, time_ns, payload, tree=tree)
                if plan is not None:
                    span = readable_span(plan, self.mapper.trace_id, self._resource)
                    self._processor.on_end(span)
            except Exception as error:
                self.fail(f"{type(error).__name__}: {error}")

    def fail(self, why: str) -> None:
        with self._lock:
            self.failed = self.failed or why
            if self._warned:
                return
            self._warned = True
        self._warn(
            f"live OpenTelemetry export to {self.endpoint} stopped ({why}); the run goes on and "
            f"its tape is whole: `jukebox export otel {self.tape_id}` sends it later"
        )

    def close(self) -> None:
        """The run ended: its span and metrics go out, within CLOSE_TIMEOUT, then the threads
        stop. Never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.start()
            self._frames.put(None, timeout=CLOSE_TIMEOUT)
            assert self._worker is not None
            self._worker.join(CLOSE_TIMEOUT)
        except Exception as error:
            self.fail(f"{type(error).__name__}: {error}")
        finisher = threading.Thread(target=self._finish, name="jukebox-otel-close", daemon=True)
        finisher.start()
        finisher.join(CLOSE_TIMEOUT)
        if self.dropped and self.failed is None:
            self._warn(
                f"live OpenTelemetry export left out {self.dropped} frame(s) the collector could "
                f"not keep up with: `jukebox export otel {self.tape_id}` sends the whole tape"
            )

    def _finish(self) -> None:
        from jukebox.export.otel_send import readable_span

        try:
            if self.failed is None:
                root = self.mapper.finish()
                self._processor.on_end(readable_span(root, self.mapper.trace_id, self._resource))
            self._processor.shutdown()  # sends what is queued
            if self.failed is None and self.mapper.metrics:
                self._send_metrics()
        except Exception as error:
            self.fail(f"{type(error).__name__}: {error}")

    def _send_metrics(self) -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        from jukebox.export.otel_send import collect_metrics, signal_url

        exporter = OTLPMetricExporter(
            endpoint=signal_url(self.endpoint, "metrics"), timeout=EXPORT_TIMEOUT
        )
        try:
            # A collector without metrics (Phoenix) refusing them is no reason to warn.
            exporter.export(collect_metrics(self.mapper.metrics, self._resource))
        finally:
            exporter.shutdown()


def _guarded(inner: Any, live: LiveExport) -> Any:
    from opentelemetry.sdk.trace.export import SpanExporter

    class Guarded(_Guarded, SpanExporter):
        pass

    return Guarded(inner, live)


class _Guarded:
    """The OTLP exporter, turned off for good at its first failure (one warning, and an
    unreachable collector costs one timeout, not one per batch)."""

    def __init__(self, inner: Any, live: LiveExport) -> None:
        self.inner = inner
        self.live = live

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self.live.failed is not None:
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception as error:
            self.live.fail(f"{type(error).__name__}: {error}")
            return SpanExportResult.FAILURE
        if result != SpanExportResult.SUCCESS:
            self.live.fail("the collector did not accept the spans")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
