"""Streamed calls are counted: the proxy asks an OpenAI chat stream for its usage when the agent
did not, hides the extra chunk from that agent (live and in replay), estimates the tokens when
the upstream still reports none, and reads Anthropic's usage from its stream events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jukebox.guard.breaker import CircuitBreaker
from jukebox.llm.replay import ReplaySource
from jukebox.llm.usage import ask_for_usage
from tests.llm.conftest import Recording, clients, direct_urls
from tests.llm.test_replay import events_per_chunk, raw_chunks
from tests.llm.upstream import FakeUpstream

PROMPT = [{"role": "user", "content": "count the streamed tokens please"}]


def stream_chat(base_urls: dict[str, str], **options: Any) -> list[dict[str, Any]]:
    """Every chunk the real openai SDK yields for one streamed chat call, as dicts."""
    o, _ = clients(base_urls)
    chunks = o.chat.completions.create(model="gpt-4o", messages=PROMPT, stream=True, **options)
    return [chunk.model_dump() for chunk in chunks]


def turns(recording: Recording) -> list[dict[str, Any]]:
    tape = recording.tape()
    return [f.resolve_payload(recording.store) for f in tape.frames if f.kind == "llm_turn"]


def test_a_stream_without_include_usage_is_counted_and_the_agent_sees_its_own_stream(
    upstream: FakeUpstream, recording: Recording
) -> None:
    direct = stream_chat(direct_urls(upstream))
    with recording.proxy(upstream) as proxy:
        proxied = stream_chat(proxy.base_urls())
    assert proxied == direct  # not one chunk more: the usage chunk was hidden
    assert all(chunk["choices"] and chunk["usage"] is None for chunk in proxied)
    assert upstream.seen[-1][3]["stream_options"] == {"include_usage": True}
    (turn,) = turns(recording)
    assert turn["usage"]["input"] > 0 and turn["usage"]["output"] > 0
    assert turn["cost_usd"] > 0
    assert turn["usage_requested"] is True and "usage_estimated" not in turn
    assert "stream_options" not in turn["request"]  # the agent's own request is recorded
    hidden = [e for e in turn["response"] if e.get("hidden")]
    assert len(hidden) == 1 and hidden[0]["data"]["choices"] == []


def test_an_agent_that_asks_for_usage_gets_its_usage_chunk(
    upstream: FakeUpstream, recording: Recording
) -> None:
    with recording.proxy(upstream) as proxy:
        chunks = stream_chat(proxy.base_urls(), stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    (turn,) = turns(recording)
    assert "usage_requested" not in turn and turn["usage"]["output"] > 0
    assert not any(e.get("hidden") for e in turn["response"])


def test_max_tokens_trips_on_streamed_calls(upstream: FakeUpstream, recording: Recording) -> None:
    import openai

    breaker = CircuitBreaker(max_tokens=60)
    answered = 0
    with recording.proxy(upstream, breaker=breaker) as proxy:
        o, _ = clients(proxy.base_urls())
        with pytest.raises(openai.BadRequestError, match="circuit breaker tripped: max_tokens"):
            for i in range(8):
                messages = [{"role": "user", "content": f"call {i}: stream me some words"}]
                chunks = o.chat.completions.create(model="gpt-4o", messages=messages, stream=True)
                list(chunks)
                answered += 1
    assert 0 < answered < 8
    assert proxy.trip.rule == "max_tokens" and proxy.trip.value > 60


def test_an_upstream_that_ignores_the_option_gives_an_estimated_count(
    upstream: FakeUpstream, recording: Recording
) -> None:
    breaker = CircuitBreaker(max_tokens=10_000)
    with recording.proxy(upstream, breaker=breaker) as proxy:
        chunks = stream_chat(proxy.base_urls(), extra_headers={"x-fake-no-usage": "1"})
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks).startswith("echo:")
    (turn,) = turns(recording)
    assert turn["usage_estimated"] is True
    # bytes / 4: the request body for input, the text the model wrote for output.
    assert turn["usage"]["input"] >= 10 and turn["usage"]["output"] >= 8
    assert turn["cost_usd"] > 0
    assert breaker.state().tokens == turn["usage"]["input"] + turn["usage"]["output"]


def test_replay_serves_the_stream_the_agent_received_without_the_usage_chunk(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    body = {"model": "gpt-4o", "stream": True, "messages": PROMPT}
    with recording.proxy(upstream) as proxy:
        live = raw_chunks(proxy.port, f"/{proxy.secret}/openai/v1/chat/completions", body)
    upstream.stop()
    source = ReplaySource.from_tape(recording.tape(), recording.store)
    second = Recording(tmp_path / "replay")
    with second.proxy(None, replay=source) as proxy:
        again = raw_chunks(proxy.port, f"/{proxy.secret}/openai/v1/chat/completions", body)
    assert events_per_chunk(again) == events_per_chunk(live)
    seen = [data for chunk in events_per_chunk(again) for _, data in chunk]
    assert seen[-1] == "[DONE]" and all(d["choices"] for d in seen[:-1])
    (turn,) = turns(second)
    assert turn["replayed_from"] == 1 and turn["usage"]["output"] > 0
    assert "usage_estimated" not in turn  # read from the hidden chunk, which was served to no one
    second.close()


def test_anthropic_streams_are_counted_from_their_events(
    upstream: FakeUpstream, recording: Recording
) -> None:
    breaker = CircuitBreaker(max_tokens=10_000)
    with recording.proxy(upstream, breaker=breaker) as proxy:
        _, a = clients(proxy.base_urls())
        with a.messages.stream(model="claude-haiku-4-5", max_tokens=50, messages=PROMPT) as stream:
            final = stream.get_final_message()
    (turn,) = turns(recording)
    assert turn["stream"] is True and "usage_estimated" not in turn
    assert turn["usage"]["input"] == final.usage.input_tokens > 0
    assert turn["usage"]["output"] == final.usage.output_tokens > 1  # message_delta's count
    assert breaker.state().tokens == turn["usage"]["input"] + turn["usage"]["output"]


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        (b'{"model": "m", "stream": false, "messages": []}', False),
        (b'{"model": "m", "messages": [{"content": "say \\"stream\\": true"}]}', False),
        (b'{"model": "m", "stream": true}', True),
        (b'{\n  "model": "m",\n  "stream" :\n    true\n}', True),  # pretty-printed
        (b'{"stream": true, "stream_options": {"include_usage": true}}', False),
    ],
)
def test_only_a_stream_that_does_not_ask_for_usage_is_asked_for_it(
    body: bytes, asked: bool
) -> None:
    forwarded = ask_for_usage("openai", "chat.completions", body)
    assert (forwarded is not None) == asked
    if forwarded is not None:
        assert json.loads(forwarded)["stream_options"] == {"include_usage": True}
