"""Strict replay of an agent that fans out parallel calls: matched by content within the
calls that were in flight together, whatever order they arrive in; paced with honor_timing."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import pytest

from jukebox.llm.replay import Divergence, Recorded, ReplaySource
from tests.llm.conftest import Recording, clients
from tests.llm.test_replay import replay_proxy
from tests.llm.upstream import FakeUpstream

TASKS = 8
# Recorded: task k answers after (TASKS + 1 - k) * TASK_MS, so the last submitted tends to
# finish first; the gates of fan_out make the tape's shape certain, however slow the machine.
TASK_MS = 20
FOLLOW_UP_MS = 50
TOGETHER = f"tasks:{TASKS}"  # the upstream holds the tasks until all have arrived
FIRST_ANSWERED = "a follow-up answered"
LAST_SENT = "the last follow-up sent"


def ask(provider: str, sdk: tuple[Any, Any], text: str, headers: dict[str, str]) -> str:
    """One call through the real SDK (`headers` for the fake upstream); the answer's text."""
    o, a = sdk
    messages = [{"role": "user", "content": text}]
    if provider == "openai":
        reply = o.chat.completions.create(
            model="gpt-4o-mini", messages=messages, extra_headers=headers
        )
        return reply.choices[0].message.content or ""
    # Anthropic, streamed: the events are assembled by the SDK.
    with a.messages.stream(
        model="claude-haiku-4-5", max_tokens=64, messages=messages, extra_headers=headers
    ) as stream:
        return stream.get_final_text()


def fan_out(
    provider: str,
    base_urls: dict[str, str],
    changed: int | None = None,
    upstream: FakeUpstream | None = None,
) -> tuple[list[Any], list[int]]:
    """Eight tasks at once; each task's follow-up is sent as soon as that task is done, so the
    follow-ups go out in completion order. Returns each task's final answer (or its error) in
    task order, and the order the tasks completed in.

    When recording (`upstream` given), gates make the tape interleave tasks and follow-ups and
    keep every call in one concurrency window: tasks 1-4 are answered only once the agent
    holds a follow-up's answer (so that follow-up's frame precedes theirs), and the second
    follow-up only once the last one has reached the upstream (so the last starts while
    another is in flight)."""
    finals: list[Any] = [None] * TASKS
    order: list[int] = []
    sdk = clients(base_urls)
    with ThreadPoolExecutor(TASKS * 2) as pool:
        tasks: dict[Future[str], int] = {}
        for k in range(1, TASKS + 1):
            headers = {"x-fake-delay-ms": str((TASKS + 1 - k) * TASK_MS),
                       "x-fake-barrier": TOGETHER}  # fmt: skip
            if k <= TASKS // 2:
                headers["x-fake-wait-for"] = FIRST_ANSWERED
            tasks[pool.submit(ask, provider, sdk, f"task {k}", headers)] = k
        follow_ups: dict[Future[str], int] = {}
        for position, done in enumerate(as_completed(tasks)):
            k = tasks[done]
            order.append(k)
            if done.exception() is not None:  # after a divergence: no follow-up
                finals[k - 1] = done.exception()
                continue
            how = "differently" if k == changed else "briefly"
            text = f"follow up on [{done.result()}] {how}"
            headers = {"x-fake-delay-ms": str(FOLLOW_UP_MS)}
            if position == 1:
                headers["x-fake-wait-for"] = LAST_SENT
            if position == TASKS - 1:
                headers["x-fake-opens"] = LAST_SENT
            future = pool.submit(ask, provider, sdk, text, headers)
            if position == 0 and upstream is not None:
                opens = upstream.server.gate(FIRST_ANSWERED).set
                future.add_done_callback(lambda _, opens=opens: opens())
            follow_ups[future] = k
        for done in as_completed(follow_ups):
            error = done.exception()
            finals[follow_ups[done] - 1] = done.result() if error is None else error
    return finals, order


def recorded_requests(recording: Recording) -> dict[int, str]:
    """The last user message of each recorded call, by frame."""
    out = {}
    for frame in recording.tape().frames:
        if frame.kind == "llm_turn":
            payload = frame.resolve_payload(recording.store)
            out[frame.seq] = payload["request"]["messages"][-1]["content"]
    return out


@pytest.mark.parametrize(
    ("provider", "honor_timing"), [("openai", False), ("anthropic", False), ("anthropic", True)]
)
def test_a_fan_out_replays_strictly_whatever_order_its_calls_come_in(
    provider: str, honor_timing: bool, upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    with recording.proxy(upstream) as proxy:
        live, recorded_order = fan_out(provider, proxy.base_urls(), upstream=upstream)
    assert recorded_order != sorted(recorded_order)
    # The tape interleaves tasks and follow-ups: a follow-up ended before a task did.
    texts = list(recorded_requests(recording).values())
    follow = [text.startswith("follow up") for text in texts]
    assert follow.index(True) < len(follow) - 1 - follow[::-1].index(False)
    upstream.stop()
    proxy, source, second, diverged = replay_proxy(recording, tmp_path, honor_timing=honor_timing)
    with proxy:
        replayed, _ = fan_out(provider, proxy.base_urls())
    assert not diverged, diverged[0].message()
    assert replayed == live and source.remaining() == 0
    if honor_timing:
        # The replay answered the calls in the order they completed when recorded.
        frames = second.tape().frames
        served = [f.payload["replayed_from"] for f in frames if f.kind == "llm_turn"]
        assert served == sorted(served) and len(served) == 2 * TASKS
    second.close()


def test_a_changed_follow_up_in_a_fan_out_diverges_at_its_own_frame(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    import openai

    with recording.proxy(upstream) as proxy:
        fan_out("openai", proxy.base_urls(), upstream=upstream)
    upstream.stop()
    (frame,) = [s for s, text in recorded_requests(recording).items() if "task 5]" in text]
    proxy, _, second, diverged = replay_proxy(recording, tmp_path)
    with proxy:
        finals, _ = fan_out("openai", proxy.base_urls(), changed=5)
    assert isinstance(finals[4], openai.BadRequestError)
    divergence = diverged[0]
    assert divergence.kind == "request_mismatch" and divergence.seq == frame
    assert any('"follow up on [echo: task 5] briefly" ->' in line for line in divergence.diff)
    second.close()


def exchange(seq: int, start_ms: int, end_ms: int, text: str) -> Recorded:
    request = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return Recorded(seq, "openai", "chat.completions", request, 200, {}, {"ok": seq},
                    start_ns=start_ms * 10**6, end_ns=end_ms * 10**6)  # fmt: skip


def test_calls_of_a_later_window_keep_their_recorded_order() -> None:
    # x and y overlap, z starts after both ended: windows {x, y} then {z}.
    calls = [exchange(1, 0, 10, "x"), exchange(2, 5, 20, "y"), exchange(3, 30, 40, "z")]
    source = ReplaySource(calls)
    assert [c.window for c in calls] == [0, 0, 1]
    assert source.take("openai", "chat.completions", calls[1].request).seq == 2
    with pytest.raises(Divergence) as caught:
        source.take("openai", "chat.completions", calls[2].request)
    # Expected: x, the one call left in the window; z came before it, as frame 3 says.
    assert caught.value.seq == 1 and caught.value.later == 3
    assert "equals frame 3" in caught.value.message()
    assert "--honor-timing" in caught.value.message()


def test_calls_that_arrived_together_share_a_window_however_late_they_were_sent(
    recording: Recording,
) -> None:
    """litellm's acompletion fanned out six calls at once; the proxy, busy, sent some upstream
    only after others were answered, so their recorded spans (from sending) did not overlap and
    the replay wanted them in that order. A call is in flight from its arrival (`queued_ms`)."""

    def turn(text: str, queued_ms: float | None) -> dict[str, Any]:
        payload = {"provider": "openai", "endpoint": "chat.completions", "status": 200,
                   "path": "/chat/completions", "latency_ms": 1.0, "stream": False,
                   "request": {"model": "m", "messages": [{"role": "user", "content": text}]},
                   "response": {"choices": []}, "response_headers": {}}  # fmt: skip
        return payload if queued_ms is None else {**payload, "queued_ms": queued_ms}

    # Both arrived together and waited at the proxy: one window, either order replays.
    queued = 10_000.0  # far longer than the gap between the frames, however slow the machine
    recording.writer.append("llm_turn", turn("a", queued))
    time.sleep(0.02)  # the second was sent upstream after the first was answered
    recording.writer.append("llm_turn", turn("b", queued))
    source = ReplaySource.from_tape(recording.tape(), recording.store)
    request_b = turn("b", None)["request"]
    first, second = (f.seq for f in recording.tape().frames if f.kind == "llm_turn")
    assert source.take("openai", "chat.completions", request_b).seq == second
    assert source.take("openai", "chat.completions", turn("a", None)["request"]).seq == first

    # A tape without `queued_ms` (or a call sent at once) keeps the spans from sending.
    recording.writer.append("llm_turn", turn("c", None))
    time.sleep(0.02)
    recording.writer.append("llm_turn", turn("d", 0.0))
    source = ReplaySource.from_tape(recording.tape(), recording.store)
    for text in ("a", "b"):
        source.take("openai", "chat.completions", turn(text, None)["request"])
    with pytest.raises(Divergence):
        source.take("openai", "chat.completions", turn("d", None)["request"])
