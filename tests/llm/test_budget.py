"""The breaker's budget with real SDK clients: calls in flight are admitted against it, an SDK's
retries are not a loop, and a trip reaches the agent, never retryable, before it is stopped."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from jukebox.guard.breaker import CircuitBreaker
from tests.llm.conftest import OPENAI_KEY, Recording, clients
from tests.llm.upstream import FakeUpstream

PROMPT = "tell me about the weather in a long and winding sentence, " * 7  # about 100 tokens


async def fan_out(base_url: str, calls: int, **options: Any) -> list[Any]:
    """`calls` chat calls at once, all in flight together (the upstream holds each 300 ms)."""
    import openai

    client = openai.AsyncOpenAI(api_key=OPENAI_KEY, base_url=base_url, max_retries=0)
    async with client:
        return await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="gpt-4o",
                    messages=[{"role": "user", "content": f"{i} {PROMPT}"}],
                    extra_headers={"x-fake-delay-ms": "300"},
                    **options,
                )
                for i in range(calls)
            ),
            return_exceptions=True,
        )


def chat_calls(upstream: FakeUpstream) -> int:
    return sum(1 for _, path, _, _ in upstream.seen if path.endswith("/chat/completions"))


@pytest.mark.parametrize(
    ("limits", "total", "limit"),
    [
        ({"max_turns": 3}, "turns", 3),
        ({"max_tokens": 300}, "tokens", 300),
        ({"max_cost_usd": 0.001}, "cost_usd", 0.001),
    ],
)
def test_parallel_calls_cannot_overshoot_the_budget(
    upstream: FakeUpstream, recording: Recording, limits: dict[str, Any], total: str, limit: Any
) -> None:
    import openai

    breaker = CircuitBreaker(**limits)
    with recording.proxy(upstream, breaker=breaker) as proxy:
        results = asyncio.run(fan_out(proxy.base_urls()["OPENAI_BASE_URL"], 8, max_tokens=20))
    answered = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, openai.BadRequestError)]
    assert len(answered) + len(refused) == 8
    assert answered and refused  # some fit, the rest were refused
    assert all("circuit breaker tripped" in str(r) for r in refused)
    assert chat_calls(upstream) == len(answered)  # refused calls never reached upstream
    assert breaker.totals[total] <= limit
    assert breaker.tripped is not None and breaker.tripped.rule == next(iter(limits))


def test_an_sdk_retrying_a_rate_limited_call_is_not_a_loop(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import openai

    breaker = CircuitBreaker.from_options(max_repeat=3)  # --max-repeat 3
    with recording.proxy(upstream, breaker=breaker) as proxy:
        o = openai.OpenAI(
            api_key=OPENAI_KEY, base_url=proxy.base_urls()["OPENAI_BASE_URL"], max_retries=2
        )
        # Every attempt rate-limited: the SDK sends it three times, then gives up.
        with pytest.raises(openai.RateLimitError):
            o.chat.completions.create(
                model="gpt-4o",
                messages=[{"role": "user", "content": "busy"}],
                extra_headers={"x-fake-fail": "429:3"},
            )
        # Rate-limited once, answered on the SDK's retry.
        answer = o.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": "then fine"}],
            extra_headers={"x-fake-fail": "429:1"},
        )
        assert answer.choices[0].message.content == "echo: then fine"
    assert chat_calls(upstream) == 5
    assert breaker.tripped is None
    # Decided: the first attempt of each call is a turn; a retry is one only when answered.
    assert breaker.totals["turns"] == 3
    assert breaker.totals["failure_run"] == 0


def test_the_same_request_refused_again_and_again_is_still_a_loop(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import openai

    breaker = CircuitBreaker.from_options(max_repeat=3)  # --max-repeat 3
    with recording.proxy(upstream, breaker=breaker) as proxy:
        o, _ = clients(proxy.base_urls())
        for _ in range(3):  # a 400 is never an SDK retry: the agent itself is looping
            with pytest.raises(openai.BadRequestError):
                o.chat.completions.create(
                    model="gpt-4o",
                    messages=[{"role": "user", "content": "bad"}],
                    extra_headers={"x-fake-fail": "400:99"},
                )
    assert breaker.tripped is not None and breaker.tripped.rule == "max_repeat_failures"


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_trip_reaches_the_agent_not_retryable_before_it_is_stopped(
    upstream: FakeUpstream, recording: Recording, provider: str
) -> None:
    import anthropic
    import openai

    agent_saw_error = threading.Event()
    seen_at_trip: list[bool] = []
    breaker = CircuitBreaker(max_turns=1)

    def stop_agent(trip: Any) -> None:  # the booth stops the agent here
        seen_at_trip.append(agent_saw_error.is_set())

    with recording.proxy(upstream, breaker=breaker, stop_agent=stop_agent) as proxy:
        urls = proxy.base_urls()
        if provider == "openai":
            client: Any = openai.OpenAI(
                api_key=OPENAI_KEY, base_url=urls["OPENAI_BASE_URL"], max_retries=5
            )

            def call() -> Any:
                return client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
                )

            refused: type[Exception] = openai.BadRequestError
        else:
            client = anthropic.Anthropic(
                api_key="sk-ant-x", base_url=urls["ANTHROPIC_BASE_URL"], max_retries=5
            )

            def call() -> Any:
                return client.messages.create(
                    model="claude-haiku-4-5",
                    max_tokens=8,
                    messages=[{"role": "user", "content": "hi"}],
                )

            refused = anthropic.BadRequestError
        call()
        with pytest.raises(refused) as caught:
            call()
        agent_saw_error.set()
        client.close()  # the agent goes on (here: away) after taking the error
        sent = len(upstream.seen)
    response = caught.value.response  # type: ignore[attr-defined]
    assert response.status_code == 400
    assert response.headers["x-should-retry"] == "false"
    assert "retry-after" not in response.headers and "retry-after-ms" not in response.headers
    body = response.json()
    assert body["error"]["type"] == "invalid_request_error"
    if provider == "openai":
        assert body["error"]["code"] == "jukebox_circuit_breaker"
    assert sent == 1  # the refusal was not retried through to upstream
    assert seen_at_trip == [True]  # the agent had its answer before the booth stopped it


def test_a_client_closing_after_each_response_has_the_refusal_before_it_is_stopped(
    upstream: FakeUpstream, recording: Recording
) -> None:
    # A client sending `Connection: close` (as urllib does), one connection per call: the
    # booth must not stop it before it has read the refusal, which it shows by closing its end.
    import http.client
    import json
    import socket
    import time
    from urllib.parse import urlsplit

    agent_saw_error = threading.Event()
    seen_at_trip: list[bool] = []
    breaker = CircuitBreaker(max_turns=1)

    def stop_agent(trip: Any) -> None:
        seen_at_trip.append(agent_saw_error.is_set())

    with recording.proxy(upstream, breaker=breaker, stop_agent=stop_agent) as proxy:
        path = urlsplit(proxy.base_urls()["OPENAI_BASE_URL"]).path + "/chat/completions"
        body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
        head = (f"POST {path} HTTP/1.1\r\nHost: {proxy.host}:{proxy.port}\r\n"
                "Content-Type: application/json\r\nConnection: close\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
        statuses = []
        for _ in range(2):
            with socket.create_connection((proxy.host, proxy.port), timeout=20) as sock:
                sock.sendall(head.encode() + body.encode())
                response = http.client.HTTPResponse(sock)
                response.begin()
                answer = response.read()  # all of it; the socket stays open until the `with` ends
                statuses.append(response.status)
                if response.status != 200:
                    assert response.status == 400 and b"circuit breaker" in answer, answer
                    # A slow agent: a booth stopping it once the answer is sent, not once the
                    # agent closes, would stop it now (well within the proxy's 1 s notice).
                    time.sleep(0.1)
                    # Marked before the close (marked after it, as urllib's caller could only,
                    # the mark raced the proxy's stop_agent under load).
                    agent_saw_error.set()
    assert statuses == [200, 400]
    assert seen_at_trip == [True]


def test_a_call_is_budgeted_as_forwarded_after_a_fork_changes_its_model(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import openai

    from jukebox.llm.rewrite import RequestRewriter

    def ask(o: Any) -> Any:
        return o.chat.completions.create(
            model="gpt-4o-mini", max_tokens=1000, messages=[{"role": "user", "content": "hi"}]
        )

    # 1000 output tokens: $0.0006 for gpt-4o-mini, $0.08 for o3-pro; the limit is between.
    cheap = CircuitBreaker(max_cost_usd=0.01)
    with recording.proxy(upstream, breaker=cheap) as proxy:
        ask(clients(proxy.base_urls())[0])
    dear = CircuitBreaker(max_cost_usd=0.01)
    forked = RequestRewriter(model="o3-pro")
    with (
        recording.proxy(upstream, breaker=dear, rewriter=forked) as proxy,
        pytest.raises(openai.BadRequestError, match="max_cost_usd"),
    ):
        ask(clients(proxy.base_urls())[0])
    assert chat_calls(upstream) == 1
