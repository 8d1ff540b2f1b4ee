"""From one finished exchange to the payload of its `llm_turn` frame.

The payload (docs/llm-proxy.md has the full list): provider, endpoint, upstream (a named one's
name only), model, status,
latency_ms, stream, usage {input, output, cached}, tool_calls [{name, arguments}], cost_usd,
request (the JSON body), response (the JSON body, or for a stream the list of its events with
chunk index and millisecond offset). Request and response larger than 4 KiB land in the store
through the tape writer's spill. Every recorded byte passes the scrubber first, headers are
recorded redacted and the path's secret-looking query values are replaced (jukebox.redact), so
no key reaches the tape.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jukebox.llm.defaults import DEFAULT_RECORD_LIMIT as DEFAULT_RECORD_LIMIT
from jukebox.llm.gemini import GEMINI
from jukebox.llm.gemini import model_of as gemini_model
from jukebox.llm.pricing import PriceTable
from jukebox.llm.providers import Summary, summarize
from jukebox.llm.sse import SSEEvent
from jukebox.llm.usage import estimate
from jukebox.redact import Scrubber, redact_headers, redact_query, redact_text
from jukebox.tape.frame import canonical_json

LLM_TURN = "llm_turn"

# Response headers worth nothing on a tape (transport details) or unsafe there (cookies).
_DROP_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "date",
        "server",
        "set-cookie",
        "alt-svc",
        "cf-ray",
        "strict-transport-security",
    }
)
_DROP_REQUEST_HEADERS = frozenset(
    {"connection", "keep-alive", "content-length", "host", "accept-encoding", "user-agent"}
)

FrameSink = Callable[[str, dict[str, Any]], Any]


@dataclass
class Exchange:
    """One request and its response as the proxy saw them (bytes unscrubbed, in memory only)."""

    provider: str
    endpoint: str
    method: str
    path: str
    request_headers: list[tuple[str, str]]
    request_body: bytes
    status: int = 0
    response_headers: list[tuple[str, str]] = field(default_factory=list)
    response_body: bytes | None = None  # JSON (or any non-stream) body
    events: list[SSEEvent] | None = None  # a stream's events, in order
    latency_ms: float = 0.0
    # When the proxy had the whole request, and how long it then held it before sending it
    # upstream (breaker admission, rewriting, a busy event loop): the call was in flight, for
    # the agent, from its arrival, which is what replay's concurrency windows need.
    received: float = field(default_factory=time.perf_counter)
    queued_ms: float = 0.0
    error: str | None = None  # the upstream failed or the client went away
    replayed_from: int | None = None  # seq of the frame served in its place, during replay
    rewritten: bool = False  # a RequestRewriter changed the request before it was sent
    reservation: Any = None  # what the breaker holds for this call until it settles
    retry: bool = False  # the same request again after a retryable answer (jukebox.llm.retries)
    # What went upstream in place of request_body when the proxy asked for usage on the
    # agent's behalf (jukebox.llm.usage); the tape records the agent's own request.
    usage_asked_body: bytes | None = None
    upstream: str | None = None  # a named upstream's name (jukebox.llm.upstreams)
    # Recording work done ahead, while the upstream answered (`prepare_request`,
    # `prepare_events`). Used only if the scrubber learned no secret since; otherwise done again.
    prepared_request: Prepared | None = None
    prepared_events: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    # The canonical JSON of the prepared events' records, a batch at a time (each the items of
    # a list, comma-joined: one encoder call per upstream read rather than one per event), or
    # None for a batch that would not encode.
    prepared_json: list[bytes | None] = field(default_factory=list)

    @property
    def stream(self) -> bool:
        return self.events is not None


@dataclass(slots=True)
class Prepared:
    """What a turn records of the request, made while the upstream works on it."""

    count: int  # the scrubber's count then
    request: Any  # the recorded request body
    request_json: bytes | None  # its canonical JSON (None: it does not encode)
    path: str
    headers: dict[str, str]
    headers_json: bytes | None


@dataclass
class Turn:
    payload: dict[str, Any]
    summary: Summary
    cost_usd: float | None
    # Canonical JSON of payload values already encoded
    # (jukebox.tape.frame.encode_payload's `known`).
    encoded: dict[str, bytes] = field(default_factory=dict)


def _encoded(value: Any) -> bytes | None:
    try:
        return canonical_json(value)
    except (ValueError, TypeError, RecursionError):  # the writer raises it, as it always did
        return None


def prepare_request(ex: Exchange, scrubber: Scrubber) -> None:
    """The request's recorded values and encodings (body, path, headers), made while the
    upstream works on it."""
    count = scrubber.count
    value = parse_body(scrubber.bytes(ex.request_body))
    headers = _request_headers(ex, scrubber)
    ex.prepared_request = Prepared(
        count, value, _encoded(value), _path(ex, scrubber), headers, _encoded(headers)
    )


def _path(ex: Exchange, scrubber: Scrubber) -> str:
    return redact_query(scrubber.text(ex.path))


def _request_headers(ex: Exchange, scrubber: Scrubber) -> dict[str, str]:
    return {
        k: scrubber.text(v)
        for k, v in redact_headers(ex.request_headers).items()
        if k not in _DROP_REQUEST_HEADERS
    }


def prepare_events(ex: Exchange, events: list[SSEEvent], scrubber: Scrubber) -> None:
    """The records of a stream's events (scrubbed), made while the next ones are awaited.
    `events` are the stream's next ones, in order, after those already prepared."""
    if not events:
        return
    count = scrubber.count
    records = []
    for event in events:
        event.data = scrubber.text(event.data)
        records.append(event.to_record())
    ex.prepared_events += [(count, record) for record in records]
    ex.prepared_json.append(_items(records))


def _items(records: list[dict[str, Any]]) -> bytes | None:
    """The canonical JSON of `records` as a list, without its brackets (None: it does not
    encode; the writer then says why)."""
    encoded = _encoded(records)
    return encoded[1:-1] if encoded is not None else None


def parse_body(data: bytes) -> Any:
    """A body as a JSON value, or as text when it is not JSON (still recorded, still scrubbed)."""
    if not data:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # nesting past the parser's depth is not JSON to us
        return {"$text": data.decode("utf-8", errors="replace")}


def build_turn(ex: Exchange, scrubber: Scrubber, prices: PriceTable | None) -> Turn:
    count = scrubber.count
    encoded: dict[str, bytes] = {}
    ahead = ex.prepared_request
    if ahead is not None and ahead.count == count:
        request, path, request_headers = ahead.request, ahead.path, ahead.headers
        if ahead.request_json is not None:
            encoded["request"] = ahead.request_json
        if ahead.headers_json is not None:
            encoded["request_headers"] = ahead.headers_json
    else:
        request = parse_body(scrubber.bytes(ex.request_body))
        path, request_headers = _path(ex, scrubber), _request_headers(ex, scrubber)
    events: list[dict[str, Any]] | None = None
    response: Any
    if ex.events is not None:
        events = []
        prepared = ex.prepared_events
        fresh = len(prepared) <= len(ex.events) and all(p[0] == count for p in prepared)
        if not fresh:
            prepared = []
        for i, event in enumerate(ex.events):
            if i < len(prepared):
                events.append(prepared[i][1])
                continue
            event.data = scrubber.text(event.data)
            events.append(event.to_record())
        if prepared:  # the list, as canonical_json would encode it
            parts = list(ex.prepared_json)
            if len(events) > len(prepared):
                parts.append(_items(events[len(prepared) :]))
            if all(part is not None for part in parts):
                # the `if` just above saw every part encoded (none is None)
                encoded["response"] = b"[" + b",".join(parts) + b"]"  # type: ignore[arg-type]
        datas = [e.get("data") for e in events]
        summary = summarize(ex.provider, ex.endpoint, request, events=datas)
        response = events
    else:
        response = parse_body(scrubber.bytes(ex.response_body or b""))
        ok = 200 <= ex.status < 300
        summary = summarize(ex.provider, ex.endpoint, request, response if ok else None)
    if summary.model is None and ex.provider == GEMINI:
        summary.model = gemini_model(ex.path)  # Gemini names the model in the path only
    estimated = 200 <= ex.status < 300 and not summary.reported
    if estimated:
        estimate(summary, len(ex.request_body))
    usage = summary.usage()
    cost = None
    if ex.replayed_from is not None:
        cost = 0.0  # served from a tape: nobody paid for it this time
    elif prices is not None and 200 <= ex.status < 300:
        cost = prices.cost(summary.model, usage, ex.provider, ex.upstream)
    payload: dict[str, Any] = {
        "provider": ex.provider,
        "endpoint": ex.endpoint,
        "model": summary.model,
        "status": ex.status,
        "latency_ms": round(ex.latency_ms, 3),
        "queued_ms": round(ex.queued_ms, 3),
        "stream": ex.stream,
        "usage": usage,
        "tool_calls": summary.tool_calls,
        "cost_usd": cost,
        "request": request,
        "response": response,
        "path": path,
        "request_headers": request_headers,
        "response_headers": {
            k: scrubber.text(v)
            for k, v in redact_headers(ex.response_headers).items()
            if k not in _DROP_RESPONSE_HEADERS
        },
    }
    if ex.upstream is not None:
        payload["upstream"] = ex.upstream
    if ex.error is not None:
        payload["error"] = redact_text(ex.error, scrubber)
    if ex.replayed_from is not None:
        payload["replayed_from"] = ex.replayed_from
    if ex.rewritten:
        payload["rewritten"] = True
    if ex.usage_asked_body is not None:
        payload["usage_requested"] = True
    if estimated:
        payload["usage_estimated"] = True
    return Turn(payload, summary, cost, encoded)
