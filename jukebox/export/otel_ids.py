"""Trace and span ids derived from a tape id, so an export is the same every time.

A tape's trace id is the first 16 bytes of BLAKE3 over a fixed prefix and the tape id; each
frame's span id the first 8 bytes over the tape id and the frame's seq; the run's own span
(`invoke_agent`) has its own tag. Exporting a tape twice sends the same ids: a backend that
keys spans by id (Phoenix, Jaeger, Tempo) keeps one copy. A live export and a later
`jukebox export otel` of the same tape send the same ids too.
"""

from __future__ import annotations

from blake3 import blake3

_TRACE = b"jukebox otel trace\x00"
_SPAN = b"jukebox otel span\x00"


def _nonzero(value: int) -> int:
    # An all-zero id is invalid in OpenTelemetry; one in 2^64 inputs would need this.
    return value or 1


def trace_id(tape_id: str) -> int:
    return _nonzero(int.from_bytes(blake3(_TRACE + tape_id.encode()).digest()[:16], "big"))


def span_id(tape_id: str, seq: int | str) -> int:
    """The span of frame ``seq``; ``"run"`` names the run's own span."""
    data = _SPAN + tape_id.encode() + b"\x00" + str(seq).encode()
    return _nonzero(int.from_bytes(blake3(data).digest()[:8], "big"))


def run_span_id(tape_id: str) -> int:
    return span_id(tape_id, "run")
