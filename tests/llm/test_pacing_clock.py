"""Replay pacing (`--honor-timing`, jukebox.llm.pacing) under trio's MockClock.

The proxy's own connection handler (`ProxyServer._connection`, what its listener runs for each
agent connection) serves recorded exchanges over in-memory streams on the test's trio loop, and
the virtual clock says when each answer, and each chunk of a stream, reached the agent. The
clock jumps to the next deadline whenever every task waits, so seconds of recorded latency cost
no real time, and the times asserted are exact rather than "at least, give or take the load".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import h11
import pytest
import trio
import trio.testing

from jukebox.llm.pacing import ORDER_GRACE_S, Pacer
from jukebox.llm.replay import Recorded, ReplaySource
from jukebox.llm.server import ProxyServer
from jukebox.llm.sse import SSEEvent

S = 1_000_000_000  # nanoseconds
SECRET = "pacing-secret"
CHAT = f"/{SECRET}/openai/v1/chat/completions"
MESSAGES = f"/{SECRET}/anthropic/v1/messages"

pytestmark = pytest.mark.trio


def chat(seq: int, start_s: float, end_s: float) -> Recorded:
    """A recorded chat completion asking `question <seq>`, in flight from start_s to end_s."""
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"question {seq}"}]}
    response = {
        "id": f"chatcmpl-{seq}",
        "object": "chat.completion",
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": f"answer {seq}"}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }  # fmt: skip
    return Recorded(
        seq=seq, provider="openai", endpoint="chat.completions", request=request, status=200,
        headers={"content-type": "application/json"}, response=response,
        start_ns=int(start_s * S), end_ns=int(end_s * S),
    )  # fmt: skip


def streamed(seq: int, latency_s: float, chunk_ms: list[float]) -> Recorded:
    """A recorded Anthropic stream: one upstream read per entry of `chunk_ms` (its offset from
    the headers), the whole call taking `latency_s`."""
    start = {"type": "message_start", "message": {
        "id": f"msg_{seq}", "type": "message", "role": "assistant", "model": "claude-haiku-4-5",
        "content": [], "usage": {"input_tokens": 5, "output_tokens": 1}}}  # fmt: skip
    words = [{"type": "content_block_delta", "index": 0,
              "delta": {"type": "text_delta", "text": f"w{i} "}}
             for i in range(len(chunk_ms) - 2)]  # fmt: skip
    bodies = [
        [start, {"type": "content_block_start", "index": 0,
                 "content_block": {"type": "text", "text": ""}}],
        *[[w] for w in words],
        [{"type": "content_block_stop", "index": 0},
         {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
          "usage": {"output_tokens": len(words)}},
         {"type": "message_stop"}],
    ]  # fmt: skip
    events = [
        SSEEvent(data=json.dumps(body), event=body["type"], chunk=chunk, t_ms=chunk_ms[chunk])
        for chunk, group in enumerate(bodies)
        for body in group
    ]
    request = {"model": "claude-haiku-4-5", "max_tokens": 16, "stream": True,
               "messages": [{"role": "user", "content": f"stream {seq}"}]}  # fmt: skip
    return Recorded(
        seq=seq, provider="anthropic", endpoint="messages", request=request, status=200,
        headers={"content-type": "text/event-stream"}, events=events,
        start_ns=0, end_ns=int(latency_s * S),
    )  # fmt: skip


@pytest.fixture
def frames() -> list[tuple[str, dict[str, Any]]]:
    return []


@contextmanager
def replaying(
    recorded: list[Recorded], frames: list[tuple[str, dict[str, Any]]], honor_timing: bool = True
) -> Iterator[ProxyServer]:
    """A proxy replaying `recorded`, its own frames into `frames`."""
    source = ReplaySource(recorded, honor_timing=honor_timing)
    proxy = ProxyServer(
        replay=source, secret=SECRET, record=lambda kind, payload: frames.append((kind, payload)),
        record_inline=True,  # recorded on the loop: no worker thread for the clock to race
    )
    try:
        yield proxy
    finally:
        proxy._sock.close()  # bound by the constructor, never listened on here


async def ask(proxy: ProxyServer, path: str, body: dict[str, Any]) -> list[tuple[float, bytes]]:
    """One request over a connection of its own, served by the proxy's connection handler;
    when (in virtual seconds) the headers and then each HTTP chunk arrived, with its bytes."""
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(proxy._connection, server)
        conn = h11.Connection(h11.CLIENT)
        data = json.dumps(body).encode()
        headers = [("host", "x"), ("content-type", "application/json"),
                   ("content-length", str(len(data)))]  # fmt: skip
        await client.send_all(
            conn.send(h11.Request(method="POST", target=path, headers=headers))
            + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())
        )
        got: list[tuple[float, bytes]] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await client.receive_some())
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
                got.append((trio.current_time(), b""))
            elif isinstance(event, h11.Data):
                got.append((trio.current_time(), bytes(event.data)))
            elif isinstance(event, h11.EndOfMessage):
                break
        await client.aclose()
    return got


async def test_a_paced_answer_comes_after_its_recorded_latency(
    autojump_clock: trio.testing.MockClock, frames: list[tuple[str, dict[str, Any]]]
) -> None:
    with replaying([chat(1, 0.0, 42.5)], frames) as proxy:
        start = trio.current_time()
        got = await ask(proxy, CHAT, chat(1, 0, 0).request)
        (headers_at, _), *_ = got
        assert headers_at - start == pytest.approx(42.5)
        assert json.loads(b"".join(d for _, d in got))["choices"][0]["message"]["content"] == (
            "answer 1"
        )
        # Served from the tape, and recorded as such on the replay's own tape.
        ((kind, payload),) = frames
        assert kind == "llm_turn" and payload["replayed_from"] == 1


async def test_a_paced_stream_sends_each_chunk_at_its_recorded_offset(
    autojump_clock: trio.testing.MockClock, frames: list[tuple[str, dict[str, Any]]]
) -> None:
    # The upstream took 2 s to start the stream, then read by read: 0, 0.5, 1.5 and 4 s after
    # the headers; the call took 6 s in all.
    offsets_ms = [0.0, 500.0, 1500.0, 4000.0]
    rec = streamed(7, 6.0, offsets_ms)
    with replaying([rec], frames) as proxy:
        start = trio.current_time()
        got = await ask(proxy, MESSAGES, rec.request)
        times = [t - start for t, _ in got]
        # The headers, then one HTTP chunk per recorded read.
        assert times == pytest.approx([2.0, 2.0, 2.5, 3.5, 6.0])
        assert b"message_start" in got[1][1] and b"message_stop" in got[-1][1]
        assert b"w1 " in got[3][1]


async def test_without_honor_timing_a_replay_answers_at_once(
    autojump_clock: trio.testing.MockClock, frames: list[tuple[str, dict[str, Any]]]
) -> None:
    with replaying([chat(1, 0.0, 42.5)], frames, honor_timing=False) as proxy:
        start = trio.current_time()
        got = await ask(proxy, CHAT, chat(1, 0, 0).request)
        assert got[0][0] == start


async def test_calls_in_flight_together_are_answered_in_their_recorded_order(
    autojump_clock: trio.testing.MockClock, frames: list[tuple[str, dict[str, Any]]]
) -> None:
    # Recorded: three calls sent together; call 2 finished first (after 3 s), then 3 (4 s),
    # then 4 (5 s). The frames are in completion order, so that is the order to keep.
    recorded = [chat(2, 0.0, 3.0), chat(3, 0.0, 4.0), chat(4, 0.0, 5.0)]
    with replaying(recorded, frames) as proxy:
        answered: dict[int, float] = {}
        start = trio.current_time()

        async def call(rec: Recorded, after_s: float) -> None:
            await trio.sleep(after_s)
            got = await ask(proxy, CHAT, rec.request)
            answered[rec.seq] = got[0][0] - start

        async with trio.open_nursery() as nursery:
            # The replaying agent sends call 2 late: 3 and 4 wait for it, though their own
            # latencies pass first.
            nursery.start_soon(call, recorded[0], 1.5)
            nursery.start_soon(call, recorded[1], 0.0)
            nursery.start_soon(call, recorded[2], 0.0)
        # Answered in the recorded order (the replay's tape names what it served, in order).
        assert [payload["replayed_from"] for _, payload in frames] == [2, 3, 4]
        assert [answered[seq] for seq in (2, 3, 4)] == pytest.approx([4.5, 4.5, 5.0])


async def test_a_call_never_asked_for_holds_the_order_only_for_the_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The Pacer alone: call 2 completed first when recorded, but the replaying agent never
    # asks for it. Call 3 waits for it past its own latency, then goes on without it.
    first, second = chat(2, 0.0, 1.0), chat(3, 0.0, 2.0)
    ReplaySource([first, second])  # numbers their concurrency window
    pacer = Pacer([first, second])
    arrived = trio.current_time()
    await pacer.until(arrived, 2.0)
    await pacer.in_turn(second, arrived)
    assert trio.current_time() - arrived == pytest.approx(2.0 + ORDER_GRACE_S)
    # Once answered, call 2 holds nobody.
    pacer.answered(first)
    arrived = trio.current_time()
    await pacer.in_turn(second, arrived)
    assert trio.current_time() == arrived
