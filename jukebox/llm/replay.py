"""Serving recorded exchanges back: the replay source, request matching and divergences.

A `ReplaySource` holds a tape's llm_turn frames as queues, one per (provider, endpoint). Each
request the agent makes takes the next recorded exchange of its endpoint:

* strict: the request must equal the recorded one after normalization (JSON parsed, volatile
  fields dropped, keys sorted). Calls that were in flight together when recorded may arrive in
  any order: the recorded calls form concurrency windows (`concurrency_windows`: chains of
  calls whose request-to-response spans overlap, each window ending at a moment when no call
  was in flight), and a request is matched by content against every call of its endpoint
  still unserved in the earliest window that has any. A parallel agent whose follow-ups go out
  in completion order replays whatever order those completions come in; calls of different
  windows keep their recorded order. The first request that matches none is a `Divergence`
  naming the recorded call of that window closest to it (the frame it was expected to match),
  what was expected, what came and a compact diff — the way Temporal reports non-determinism.
  After a divergence, the recording no longer describes the run, so every later call fails too.
* loose: served by order per endpoint, whatever the request says.

A request past the end of its endpoint's recording is a divergence too, unless `until` was
given: then the recording serves frames up to `until` and everything after goes live.

A fork tape's calls after its `fork` frame were sent with the fork's overrides applied (another
model, another system prompt) while the agent asked for the original; `from_tape` reads those
overrides from the fork frame, and strict matching applies them to the agent's request before
comparing, so a fork replays as strictly as any other tape.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jukebox.errors import CheckFailed
from jukebox.llm.model_override import model_for
from jukebox.llm.providers import GEMINI, OPENAI, PREFIXES, replay_endpoint
from jukebox.llm.recorder import LLM_TURN
from jukebox.llm.rewrite import RequestRewriter
from jukebox.llm.sse import SSEEvent, event_from_record
from jukebox.llm.upstreams import NOTE_EVENT as UPSTREAMS_NOTE
from jukebox.tape.frame import canonical_json

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

MODES = ("strict", "loose")

# Top-level request fields that change between identical runs or say nothing about the prompt.
VOLATILE_FIELDS = frozenset(
    {
        "stream_options",
        "user",
        "metadata",
        "prompt_cache_key",
        "safety_identifier",
        "service_tier",
        "store",
    }
)

DIFF_LINES = 8
SHOW_CHARS = 120


@dataclass
class Recorded:
    """One recorded exchange, ready to be served."""

    seq: int
    provider: str
    endpoint: str
    request: Any
    status: int
    headers: dict[str, str]
    response: Any = None  # the JSON body
    events: list[SSEEvent] | None = None  # or the stream
    start_ns: int = 0
    end_ns: int = 0
    # The fork overrides in force when this call was recorded (None: the agent's own request).
    rewriter: RequestRewriter | None = None
    upstream: str | None = None  # a named upstream's name (jukebox.llm.upstreams)
    window: int = 0  # its concurrency window (see concurrency_windows)
    _expected: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def expected(self) -> bytes:
        """The recorded request as strict matching compares it."""
        if self._expected is None:
            self._expected = canonical_json(normalize(self.request))
        return self._expected

    @property
    def stream(self) -> bool:
        return self.events is not None

    def body(self) -> bytes:
        if isinstance(self.response, dict) and set(self.response) == {"$text"}:
            return self.response["$text"].encode()
        return json.dumps(self.response, ensure_ascii=False, separators=(",", ":")).encode()


class Live:
    """The answer of `take` when the request is past `until`: forward it upstream."""


LIVE = Live()


class Divergence(CheckFailed):
    """The run stopped matching its tape."""

    def __init__(
        self,
        kind: str,
        provider: str,
        endpoint: str,
        seq: int | None,
        expected: Any,
        got: Any,
        diff: list[str],
        exchange: int,
        later: int | None = None,
    ) -> None:
        self.kind = kind  # "request_mismatch" | "beyond_recording" | "halted"
        self.provider = provider
        self.endpoint = endpoint
        self.seq = seq
        self.expected = expected
        self.got = got
        self.diff = diff
        self.exchange = exchange  # how many calls to this endpoint came before this one
        # A later frame the request equals: the call came before calls recorded ahead of it.
        self.later = later
        super().__init__(self.message())

    def message(self) -> str:
        where = f"{self.provider} {self.endpoint} call #{self.exchange + 1}"
        if self.kind == "halted":
            return f"replay stopped: {self.diff[0] if self.diff else 'the run left its recording'}"
        if self.kind == "beyond_recording":
            return (
                f"replay diverged: {where} goes beyond the recording (the tape holds "
                f"{self.exchange} such call(s)); a replay never reaches the network — "
                "replay with --until N to go live after frame N"
            )
        lines = [
            f"replay diverged at frame {self.seq} ({where}): the request differs from the "
            "recorded one",
            f"  expected: {_show(self.expected)}",
            f"  got:      {_show(self.got)}",
            "  diff:",
            *(f"    {line}" for line in self.diff),
        ]
        if self.later is not None:
            lines.append(
                f"  it equals frame {self.later}, recorded after calls not yet asked for: the "
                "calls came in another order than recorded; an agent whose calls depend on "
                "timing replays with --honor-timing"
            )
        return "\n".join(lines)

    def to_payload(self) -> dict[str, Any]:
        return {
            "event": "divergence",
            "kind": self.kind,
            "provider": self.provider,
            "endpoint": self.endpoint,
            "frame": self.seq,
            "call": self.exchange + 1,
            "diff": self.diff,
            "later_frame": self.later,
            "message": self.message(),
        }


def _show(value: Any) -> str:
    text = canonical_json(value).decode()
    return text if len(text) <= SHOW_CHARS else text[: SHOW_CHARS - 3] + "..."


def normalize(body: Any) -> Any:
    """What strict matching compares: the body without volatile fields (keys sort on compare)."""
    if isinstance(body, dict):
        return {k: v for k, v in body.items() if k not in VOLATILE_FIELDS}
    return body


def json_diff(
    expected: Any, got: Any, path: str = "", out: list[str] | None = None, limit: int = DIFF_LINES
) -> list[str]:
    """Paths where two JSON values differ, one line each, at most `limit` lines."""
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(expected, dict) and isinstance(got, dict):
        for key in sorted(set(expected) | set(got)):
            sub = f"{path}.{key}" if path else key
            if key not in got:
                out.append(f"{sub}: missing (expected {_short(expected[key])})")
            elif key not in expected:
                out.append(f"{sub}: unexpected {_short(got[key])}")
            else:
                json_diff(expected[key], got[key], sub, out, limit)
            if len(out) >= limit:
                break
        return out
    if isinstance(expected, list) and isinstance(got, list):
        for i in range(min(len(expected), len(got))):
            json_diff(expected[i], got[i], f"{path}[{i}]", out, limit)
            if len(out) >= limit:
                return out
        if len(expected) != len(got):
            out.append(f"{path}: {len(expected)} items expected, {len(got)} came")
        return out
    if expected != got or type(expected) is not type(got):
        out.append(f"{path or '(body)'}: {_short(expected)} -> {_short(got)}")
    return out


def distance(expected: Any, got: Any) -> float:
    """How far apart two JSON values are: 1 per value missing, added or of another type, and
    for two strings the share of the longer one outside their common prefix and suffix."""
    if type(expected) is type(got) and expected == got:
        return 0.0
    if isinstance(expected, dict) and isinstance(got, dict):
        return sum(
            distance(expected[k], got[k]) if k in expected and k in got else 1.0
            for k in set(expected) | set(got)
        )
    if isinstance(expected, list) and isinstance(got, list):
        pairs = sum(distance(a, b) for a, b in zip(expected, got, strict=False))
        return pairs + abs(len(expected) - len(got))
    if isinstance(expected, str) and isinstance(got, str):
        prefix = _shared(expected, got)
        suffix = _shared(expected[prefix:][::-1], got[prefix:][::-1])
        return 1.0 - (prefix + suffix) / max(len(expected), len(got))
    return 1.0


def _shared(a: str, b: str) -> int:
    """The length of the common prefix of a and b."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def concurrency_windows(exchanges: list[Recorded]) -> None:
    """Numbers each exchange's window: calls whose spans overlap, directly or through a chain of
    others, share one; a new window starts when a call starts after every earlier one ended.
    (A call's span runs from its request to its frame, written before the agent saw the end of
    the response, so a call sent after another's answer never overlaps it.)"""
    window, open_until = -1, None
    for ex in sorted(exchanges, key=lambda e: (e.start_ns, e.seq)):
        if open_until is None or ex.start_ns >= open_until:
            window += 1
            open_until = ex.end_ns
        open_until = max(open_until, ex.end_ns)
        ex.window = window


def _short(value: Any) -> str:
    text = canonical_json(value).decode()
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class _Queue:
    items: deque[Recorded] = field(default_factory=deque)
    served: int = 0


class ReplaySource:
    """Recorded exchanges served in place of the upstream. Thread-safe enough for one proxy:
    all calls come from the proxy's single event loop."""

    def __init__(
        self,
        exchanges: list[Recorded],
        mode: str = "strict",
        until: int | None = None,
        honor_timing: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"bad replay mode {mode!r}: use strict or loose")
        self.mode = mode
        self.until = until
        self.honor_timing = honor_timing
        self._queues: dict[tuple[str, str], _Queue] = {}
        self.exchanges = sorted(
            (ex for ex in exchanges if until is None or ex.seq <= until), key=lambda e: e.seq
        )
        concurrency_windows(self.exchanges)
        # Named upstreams get their own queues, and a replaying proxy serves their names.
        self.upstream_protocols: dict[str, str] = {
            ex.upstream: ex.provider for ex in exchanges if ex.upstream
        }
        for ex in self.exchanges:
            key = (ex.upstream or ex.provider, ex.endpoint)
            self._queues.setdefault(key, _Queue()).items.append(ex)
        self.total = sum(len(q.items) for q in self._queues.values())
        self.divergence: Divergence | None = None
        # Gemini calls a fork sent to another model were recorded under that model's path (it
        # is in the path, not the body): the models, to find their queues by.
        self._gemini_overrides = sorted(
            {
                model.rpartition("/")[2]
                for ex in self.exchanges
                if ex.provider == GEMINI and ex.rewriter is not None
                for model in [model_for(ex.rewriter.model, GEMINI)]
                if model
            }
        )

    @classmethod
    def from_tape(
        cls,
        tape: Any,
        store: ObjectReader,
        mode: str = "strict",
        until: int | None = None,
        honor_timing: bool = False,
    ) -> ReplaySource:
        """Every successful llm_turn frame of `tape` (a jukebox.tape.tape.Tape), through `until`."""
        exchanges = []
        rewriter: RequestRewriter | None = None
        names: dict[str, str] = {}
        for frame in tape.frames:
            if frame.kind == "note" and frame.payload.get("event") == UPSTREAMS_NOTE:
                listed = frame.payload.get("names")
                protocols = frame.payload.get("protocols") or {}
                for name in listed if isinstance(listed, list) else ():
                    protocol = protocols.get(name) if isinstance(protocols, dict) else None
                    if isinstance(name, str):
                        names[name] = protocol if protocol in PREFIXES else OPENAI
                continue
            if frame.kind == "fork":
                rewriter = _fork_rewriter(frame.payload)
                continue
            if frame.kind != LLM_TURN:
                continue
            p = frame.resolve_payload(store)
            if p.get("error") is not None or not isinstance(p.get("status"), int):
                continue  # the upstream never answered: nothing to serve
            events = None
            if p.get("stream"):
                events = [event_from_record(e) for e in p.get("response") or []]
            latency_ns = int(float(p.get("latency_ms") or 0) * 1e6)
            # In flight from its arrival at the proxy, which may have held it a while before
            # sending it upstream (tapes before `queued_ms`: from its sending).
            queued_ns = int(float(p.get("queued_ms") or 0) * 1e6)
            exchanges.append(
                Recorded(
                    seq=frame.seq,
                    provider=p["provider"],
                    endpoint=replay_endpoint(p["provider"], p["endpoint"], p.get("path")),
                    request=p.get("request"),
                    status=p["status"],
                    headers=dict(p.get("response_headers") or {}),
                    response=None if events is not None else p.get("response"),
                    events=events,
                    start_ns=frame.time_ns - latency_ns - queued_ns,
                    end_ns=frame.time_ns,
                    rewriter=rewriter if p.get("replayed_from") is None else None,
                    upstream=p["upstream"] if isinstance(p.get("upstream"), str) else None,
                )
            )
        source = cls(exchanges, mode=mode, until=until, honor_timing=honor_timing)
        source.upstream_protocols = {**names, **source.upstream_protocols}
        return source

    def remaining(self) -> int:
        return sum(len(q.items) for q in self._queues.values())

    def halt(self, reason: str) -> None:
        """Refuse every later call, in either mode: the run has left its recording in a way
        the proxy cannot see (its files or its own frames differ), so no call may go live."""
        if self.divergence is None:
            self.divergence = Divergence("halted", "-", "-", None, None, None, [reason], 0)

    def take(
        self, provider: str, endpoint: str, request: Any, upstream: str | None = None
    ) -> Recorded | Live:
        """The recorded exchange to serve for `request`, LIVE, or raises Divergence.
        `upstream`: the named upstream the request went to (None: the provider's own)."""
        if self.divergence is not None and (
            self.mode == "strict" or self.divergence.kind == "halted"
        ):
            raise self.divergence
        queue = self._queue(upstream or provider, endpoint)
        if not queue.items:
            if self.until is not None:
                return LIVE
            self.divergence = Divergence(
                "beyond_recording",
                upstream or provider,
                endpoint,
                None,
                None,
                request,
                [],
                queue.served,
            )
            raise self.divergence
        head = queue.items[0]
        if self.mode == "loose":
            queue.items.popleft()
            queue.served += 1
            return head
        # Calls that were in flight together may come back in any order: any unserved call of
        # the earliest window may match. Items are in frame order, so a window is a prefix.
        window = list(itertools.takewhile(lambda c: c.window == head.window, queue.items))
        sent: dict[int, tuple[Any, bytes]] = {}  # the request as sent, per rewriter in force
        for i, candidate in enumerate(window):
            if candidate.expected == _as_sent(candidate, provider, endpoint, request, sent)[1]:
                del queue.items[i]
                queue.served += 1
                return candidate
        # The frame it was expected to match: the call of the window closest to it.
        distances = [
            distance(normalize(c.request), _as_sent(c, provider, endpoint, request, sent)[0])
            for c in window
        ]
        closest = window[distances.index(min(distances))]
        later = next(
            (
                c.seq
                for c in list(queue.items)[len(window) :]
                if c.expected == _as_sent(c, provider, endpoint, request, sent)[1]
            ),
            None,
        )
        got = _as_sent(closest, provider, endpoint, request, sent)[0]
        expected = normalize(closest.request)
        self.divergence = Divergence(
            "request_mismatch",
            upstream or provider,
            endpoint,
            closest.seq,
            expected,
            got,
            json_diff(expected, got),
            queue.served,
            later,
        )
        raise self.divergence


    def _queue(self, upstream: str, endpoint: str) -> _Queue:
        """The queue a call takes from: its endpoint's, or for a Gemini call whose own model's
        queue is done, the queue of the model a fork sent such calls to."""
        queue = self._queues.setdefault((upstream, endpoint), _Queue())
        if queue.items or not self._gemini_overrides:
            return queue
        method = endpoint.partition(" ")[0]
        for model in self._gemini_overrides:
            other = self._queues.get((upstream, f"{method} {model}"))
            if other is not None and other.items and other.items[0].rewriter is not None:
                return other
        return queue


def _fork_rewriter(payload: Any) -> RequestRewriter | None:
    """The overrides a fork frame records, as the rewriter that produced the later requests."""
    overrides = payload.get("overrides") if isinstance(payload, dict) else None
    if not isinstance(overrides, dict):
        return None
    model, prompt = overrides.get("model"), overrides.get("system_prompt")
    if isinstance(model, dict):  # per provider; a tape's, so only string pairs count
        model = {p: m for p, m in model.items() if isinstance(m, str)} or None
    rewriter = RequestRewriter(
        model=model if isinstance(model, str | dict) else None,
        system_prompt=prompt if isinstance(prompt, str) else None,
    )
    return rewriter if rewriter.active else None


def _as_sent(
    recorded: Recorded,
    provider: str,
    endpoint: str,
    request: Any,
    cache: dict[int, tuple[Any, bytes]],
) -> tuple[Any, bytes]:
    """The agent's request as the proxy sent it when `recorded` was made (overrides applied),
    normalized, and its canonical JSON; `cache` keeps both per rewriter."""
    key = id(recorded.rewriter)
    if key not in cache:
        if recorded.rewriter is not None:
            request = recorded.rewriter.apply(provider, endpoint, request)
        sent = normalize(request)
        cache[key] = (sent, canonical_json(sent))
    return cache[key]
