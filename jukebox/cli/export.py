"""`jukebox export otel TAPE…`: tapes to an OpenTelemetry collector (jukebox.export)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import click

from jukebox.cli import cli
from jukebox.cli.options import json_option, tape_dir_option
from jukebox.cli.reading import emit_json, load_intact, whole_tape


@cli.group("export")
def export_group() -> None:
    """Send tapes to other tools."""


def _endpoint(given: str | None) -> str:
    from jukebox.errors import UsageError
    from jukebox.export.otel_send import export_endpoint

    endpoint = export_endpoint(given)
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(
            f"the OTLP endpoint {endpoint!r} is not an http(s) URL; give one like "
            "--endpoint http://localhost:4318 (the collector's OTLP/HTTP base URL)"
        )
    return endpoint


@export_group.command("otel")
@click.argument("tapes", metavar="TAPE…", nargs=-1, required=True)
@click.option(
    "--endpoint",
    default=None,
    metavar="URL",
    help="The collector's OTLP/HTTP base URL; /v1/traces and /v1/metrics are added "
    "(default: $OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318).",
)
@click.option(
    "--capture-content",
    is_flag=True,
    help="Also send prompts, replies, tool arguments and results and verifier output "
    "(scrubbed of secret-looking values); off by default: prompts can hold secrets.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="How long to keep trying a collector that does not answer.",
)
@tape_dir_option
@json_option
def export_otel_command(
    tapes: tuple[str, ...],
    endpoint: str | None,
    capture_content: bool,
    timeout: float,
    tape_dir: Path | None,
    as_json: bool,
) -> None:
    """Send tapes to an OpenTelemetry collector as OTLP/HTTP (protobuf), following the GenAI
    semantic conventions: an invoke_agent span per run, a chat/embeddings/... span per model
    call, execute_tool spans, jukebox.* spans for checkpoints, rollbacks, the verifier and the
    verdict, and the gen_ai.client metrics. Timestamps are the recorded ones; the trace id
    comes from the tape id, so exporting a tape again sends the same ids (docs/otel.md).
    Exit 1 when the collector does not accept them."""
    from jukebox.errors import CheckFailed
    from jukebox.export.otel_content import environment_scrubber
    from jukebox.export.otel_send import export_tape
    from jukebox.tape.tapedir import TapeRef

    url = _endpoint(endpoint)
    refs = [TapeRef.parse(t, tape_dir) for t in tapes]
    for ref in refs:
        whole_tape(ref, "export otel", "drop the @{n} (a run is exported whole)")
    scrubber = environment_scrubber() if capture_content else None
    reports = []
    for ref in refs:
        loaded = load_intact(ref)
        report = export_tape(
            loaded, url, capture=capture_content, scrubber=scrubber, timeout=timeout
        )
        reports.append(report)
        if not as_json:
            click.echo(_line(report, url))
    if as_json:
        emit_json({"endpoint": url, "capture_content": capture_content, "tapes": reports})
    failed = [r for r in reports if not r["spans_sent"]]
    if failed:
        raise CheckFailed(
            f"{url} did not accept the spans of {len(failed)} tape(s): check that an OTLP/HTTP "
            "collector listens there (--endpoint)"
        )


def _line(report: dict, url: str) -> str:
    sent = "sent" if report["spans_sent"] else "NOT accepted"
    line = f"{report['tape_id']}: {report['spans']} span(s) {sent}, trace {report['trace_id']}"
    if report["metrics_sent"] is False:
        line += f"; metrics not accepted by {url}"
    elif report["metrics_sent"]:
        line += f"; {report['metric_points']} metric point(s)"
    return line
