"""The proxy's circuit-breaker hook: admit before a call, observe after, a 400 on a trip."""

from __future__ import annotations

from typing import Any

import pytest

from jukebox.guard.breaker import CircuitBreaker
from tests.llm.conftest import Recording, clients
from tests.llm.upstream import FakeUpstream


def ask(o: Any, text: str = "hello", **options: Any) -> Any:
    return o.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": text}], **options
    )


def test_max_turns_refuses_the_call_past_the_limit(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import openai

    trips: list[Any] = []
    breaker = CircuitBreaker(max_turns=2)
    with recording.proxy(upstream, breaker=breaker, on_trip=trips.append) as proxy:
        o, _ = clients(proxy.base_urls())
        ask(o, "one")
        ask(o, "two")
        calls = len(upstream.seen)
        with pytest.raises(openai.BadRequestError) as caught:
            ask(o, "three")
        with pytest.raises(openai.BadRequestError):
            ask(o, "four")
    assert "jukebox circuit breaker tripped: max_turns" in str(caught.value)
    assert caught.value.status_code == 400
    assert len(upstream.seen) == calls  # refused before forwarding
    assert [t.rule for t in trips] == ["max_turns"]  # called once


def test_a_trip_seen_after_a_call_fails_the_next_one(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import openai

    trips: list[Any] = []
    # No max_tokens on the request: its output cannot be reserved, so the call is admitted
    # on its prompt alone and its real usage trips the breaker afterwards.
    breaker = CircuitBreaker(max_tokens=100)
    with recording.proxy(upstream, breaker=breaker, on_trip=trips.append) as proxy:
        o, _ = clients(proxy.base_urls())
        first = ask(o, "word " * 50)  # 78 tokens reserved; 70 in + 51 out used
        assert first.choices[0].message.content.startswith("echo:")  # the tripping call answers
        with pytest.raises(openai.BadRequestError, match="circuit breaker tripped: max_tokens"):
            ask(o, "x")
    assert [t.rule for t in trips] == ["max_tokens"]


class StandIn:
    """The hook's contract with nothing else: admit and observe, returning a trip or None."""

    class Trip:
        rule, limit, value, detail = "stand_in", 1, 2, "it said so"

        def to_payload(self) -> dict[str, Any]:
            return {"rule": self.rule}

    def __init__(self) -> None:
        self.observed: list[dict[str, Any]] = []

    def admit(self, reservation: Any) -> Any:
        return None

    def release(self, reservation: Any) -> None:
        pass

    def observe(self, **kwargs: Any) -> Any:
        self.observed.append(kwargs)
        return self.Trip() if len(self.observed) == 2 else None


def test_observe_sees_cost_tokens_text_tool_calls_and_failures(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import openai

    breaker = StandIn()
    with recording.proxy(upstream, breaker=breaker) as proxy:
        o, _ = clients(proxy.base_urls())
        ask(o, "hello world")
        tools = [{"type": "function", "function": {"name": "grep", "parameters": {}}}]
        o.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}], tools=tools
        )
        with pytest.raises(openai.BadRequestError, match=r"stand_in .*it said so"):
            ask(o)
    first, second = breaker.observed
    assert first["text"] == "echo: hello world" and first["tokens"] > 0
    assert first["cost_usd"] > 0 and first["failed"] is None
    assert second["tool_calls"][0]["name"] == "grep"
