"""Streams pass through the proxy event by event: the agent has each event as soon as the
upstream completes it, and the end of the stream only once the call's frame is written."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import pytest

from jukebox.llm.server import ProxyServer
from jukebox.llm.sse import SSEParser
from shadowfs import wakeups
from tests.llm.conftest import Recording, clients
from tests.llm.upstream import FakeUpstream


def logged_in(recording: Recording, log: list[str]) -> Any:
    """A `record` for the proxy: the frame goes on the recording's tape, then into `log`
    (beside the upstream's own entries), so a test can say what came before what."""

    def record(kind: str, payload: Any) -> None:
        recording.writer.append(kind, payload)
        log.append(f"{kind} frame written")

    return record


def first_event_then_rest(provider: str, upstream: FakeUpstream, base_urls: dict[str, str]):
    """Streams one answer through the real SDK whose upstream holds everything after the first
    event until the agent has that first event; returns the events' types (or deltas)."""
    o, a = clients(base_urls)
    log, gate = upstream.server.log, upstream.server.gate(provider)
    headers = {"x-fake-gate": provider}
    messages = [{"role": "user", "content": "one two three"}]
    seen: list[Any] = []
    if provider == "openai":
        stream: Any = o.chat.completions.create(
            model="gpt-4o-mini", messages=messages, stream=True, extra_headers=headers
        )
    else:
        stream = a.messages.create(
            model="claude-haiku-4-5", max_tokens=16, messages=messages, stream=True,
            extra_headers=headers,
        )  # fmt: skip
    for event in stream:
        if not seen:
            log.append("agent has the first event")
            gate.set()
        seen.append(getattr(event, "type", None) or event.choices[0].delta.content)
        if seen[-1] == "message_stop":
            log.append("agent has the end")
    if provider == "openai":  # the SDK ends its iteration at [DONE], the final event
        log.append("agent has the end")
    return seen


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_the_first_event_reaches_the_agent_before_the_upstream_sends_the_second(
    provider: str, upstream: FakeUpstream, recording: Recording
) -> None:
    log = upstream.server.log
    record = logged_in(recording, log)
    upstreams = {"openai": upstream.openai_url, "anthropic": upstream.url}
    with ProxyServer(upstreams=upstreams, record=record) as proxy:
        seen = first_event_then_rest(provider, upstream, proxy.base_urls())
    # The end of the stream is held back until its frame is on the tape.
    assert log == ["agent has the first event", "second event sent", "llm_turn frame written",
                   "agent has the end"]  # fmt: skip
    assert len(seen) > 4
    # The tape holds the stream as it came from the upstream, chunk by chunk.
    (turn,) = [f.resolve_payload(recording.store) for f in recording.tape().frames[1:]]
    assert turn["stream"] is True and turn["response"][0]["chunk"] == 0
    assert turn["response"][1]["chunk"] == 1


def test_the_parser_releases_bytes_only_up_to_a_point_between_events() -> None:
    parser = SSEParser()
    parser.feed(b"event: a\r\ndata: 1\r\n\r\nevent: b\r\nda", 0.0)
    assert parser.take_ready() == b"event: a\r\ndata: 1\r\n\r\n"
    parser.feed(b"ta: 2\r\n", 1.0)
    assert parser.take_ready() == b""  # b has begun: nothing of it goes alone
    parser.feed(b"\r\n: keep-alive\n", 2.0)
    assert parser.take_ready() == b"event: b\r\ndata: 2\r\n\r\n: keep-alive\n"
    parser.feed(b"data: unterminated", 3.0)
    parser.close(4.0)
    assert parser.take_rest() == b"data: unterminated"
    assert [e.data for e in parser.events] == ["1", "2", "unterminated"]


def test_a_stream_the_agent_left_early_is_recorded_though_the_proxy_stops(
    upstream: FakeUpstream, recording: Recording
) -> None:
    # A client may stop reading once it has what it needs (litellm returns at the finish chunk)
    # and the agent exit, while the proxy still reads the stream's end to record it. The proxy's
    # stop comes right then: it lets the call finish, so its frame is not lost.
    gate = upstream.server.gate("openai")
    upstreams = {"openai": upstream.openai_url}
    with ProxyServer(upstreams=upstreams, record=recording.writer.append) as proxy:
        o, _ = clients(proxy.base_urls())
        stream = o.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "one two three"}],
            stream=True, extra_headers={"x-fake-gate": "openai"},
        )  # fmt: skip
        next(iter(stream))  # the first event only: the upstream holds the rest
        stream.close()
        threading.Timer(0.5, gate.set).start()  # the rest comes while the proxy is stopping
    (turn,) = [f.resolve_payload(recording.store) for f in recording.tape().frames[1:]]
    assert turn["stream"] is True and turn["response"]  # what came before the agent left
    assert "closed the connection mid-stream" in turn["error"]


def test_an_upstream_that_closes_right_after_the_head_is_a_broken_stream_on_the_tape() -> None:
    """The proxy looks for the first events as soon as it has the head; an upstream that has
    closed by then breaks the stream there, as it would later: the agent gets the head and a
    broken body, the tape a streamed turn that says so."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            buf = b""
            while not buf.endswith(b"}"):  # the head, then the JSON body
                buf += conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )  # and closes: no event, no end

    threading.Thread(target=serve, daemon=True).start()
    frames: list[Any] = []
    upstreams = {"openai": f"http://127.0.0.1:{listener.getsockname()[1]}/v1"}
    with ProxyServer(upstreams=upstreams, record=lambda k, p: frames.append(p)) as proxy:
        body = b'{"model": "m", "messages": [], "stream": true}'
        with socket.create_connection(("127.0.0.1", proxy.port)) as agent:
            agent.sendall(
                b"POST /%b/openai/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                % (proxy.secret.encode(), len(body), body)
            )
            answer = b""
            while data := agent.recv(65536):
                answer += data
    listener.close()
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n")  # head only
    (turn,) = frames
    assert turn["stream"] is True and turn["response"] == []
    assert "upstream stream broke" in turn["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_tapes_flusher_is_woken_only_once_the_agent_has_the_answer(
    stream: bool, upstream: FakeUpstream, recording: Recording
) -> None:
    # A booth's GroupTape notifies its flusher thread when a frame comes; woken before the
    # answer leaves, that thread would take the interpreter lock from the proxy's meanwhile.
    seen: list[bool] = []
    notified = threading.Event()

    end = b"0\r\n\r\n" if stream else b"}"

    class Flusher(threading.Condition):
        def notify(self, n: int = 1) -> None:
            # Whether the answer's end is in the agent's socket by now (loopback delivers at
            # once; the agent reads nothing before this).
            try:
                there = sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                there = b""
            seen.append(there.endswith(end))
            notified.set()
            super().notify(n)

    flusher = Flusher()

    def record(kind: str, payload: Any) -> None:
        recording.writer.append(kind, payload)
        with flusher:
            wakeups.notify(flusher)

    upstreams = {"openai": upstream.openai_url}
    with ProxyServer(upstreams=upstreams, record=record, record_inline=True) as proxy:
        sock = socket.create_connection((proxy.host, proxy.port))
        messages = [{"role": "user", "content": "hi"}]
        body = json.dumps({"model": "gpt-4o-mini", "stream": stream, "messages": messages}).encode()
        path = f"/{proxy.secret}/openai/v1/chat/completions"
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode() + body
        )
        assert notified.wait(10)
        answer = b""
        while not answer.endswith(end):
            answer += sock.recv(65536)
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200")
    assert seen == [True]
