"""The proxy's agent-side HTTP/1.1 (jukebox.llm.http1_agent): requests read the same however
they are cut, what is not HTTP/1.1 is refused with the status h11 gave, keep-alive and
pipelining hold, and responses are framed for the agent's version. Then the same through a real
proxy, over a raw socket, read back with h11 (an independent parser)."""

from __future__ import annotations

import json
import socket
from typing import Any

import h11
import pytest

from jukebox.llm.http1_agent import AgentConnection, BadRequest, Request
from tests.llm.conftest import Recording
from tests.llm.upstream import FakeUpstream

BODY = b'{"model": "gpt-4o-mini", "messages": []}'
POST = (
    b"POST /s/openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY)
)
CHUNKED = (
    b"POST /s/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;ext=1\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\nx-trailer: t\r\n\r\n"
)


def _read(raw: bytes, step: int) -> tuple[AgentConnection, Request | None, bytes]:
    conn = AgentConnection()
    request = None
    body = b""
    for i in range(0, len(raw), step):
        conn.feed(raw[i : i + step])
        request = request or conn.request()
        if request is not None:
            body += b"".join(conn.body())
    return conn, request, body


@pytest.mark.parametrize("raw", [POST, CHUNKED], ids=["length", "chunked"])
@pytest.mark.parametrize("step", [1, 7, 100_000])
def test_a_request_reads_the_same_however_it_is_cut(raw: bytes, step: int) -> None:
    conn, request, body = _read(raw, step)
    assert request is not None and conn.body_done
    assert request.method == "POST" and request.http11
    assert ("host", "x") in request.headers  # names lower-case
    assert body == (BODY if raw is POST else b'{"a": 1}')


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 400),
        (b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nA: nul\x00here\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
         400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nA: " + b"a" * 70_000, 431),
    ],
)
def test_what_is_not_http_is_refused_with_h11s_status(raw: bytes, status: int) -> None:
    conn = AgentConnection()
    conn.feed(raw)
    with pytest.raises(BadRequest) as refused:
        if conn.request() is not None:
            conn.body()
    assert refused.value.status == status


def test_keep_alive_pipelining_and_the_framing_of_answers() -> None:
    conn = AgentConnection()
    conn.feed(b"\r\n" + POST + b"GET /s/openai/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    first = conn.request()
    assert first is not None and conn.body() == [BODY] and conn.body_done
    # a length when given, else chunks to an HTTP/1.1 agent
    assert conn.head(200, [("x-a", "1")], length=2) == (
        b"HTTP/1.1 200 \r\nx-a: 1\r\ncontent-length: 2\r\n\r\n"
    )
    assert conn.data(b"{}") + conn.end() == b"{}"
    assert conn.reusable
    conn.next_cycle()
    second = conn.request()  # it came with the first: kept for this cycle
    assert second is not None and second.method == "GET" and conn.body_done
    head = conn.head(200, checked=[("content-type", "text/event-stream"), ("x-n", "é")])
    assert head.endswith(b"x-n: \xe9\r\ntransfer-encoding: chunked\r\n\r\n")
    assert conn.data(b"abc") + conn.data(b"") + conn.end() == b"3\r\nabc\r\n0\r\n\r\n"
    with pytest.raises(Exception, match="invalid response header"):
        AgentConnection().head(200, [("x-a", "1\r\nset-cookie: evil")])


def test_http10_and_connection_close_end_the_connection() -> None:
    conn = AgentConnection()
    conn.feed(b"GET /s/x HTTP/1.0\r\n\r\n")
    assert conn.request() is not None
    head = conn.head(200, checked=[("content-type", "text/plain")])
    assert b"transfer-encoding" not in head and head.endswith(b"connection: close\r\n\r\n")
    assert conn.data(b"raw") == b"raw" and conn.end() == b""  # the body runs to the close
    assert not conn.reusable
    conn = AgentConnection()
    conn.feed(b"HEAD /s/x HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Close\r\n\r\n")
    assert conn.request() is not None
    assert conn.head(200).endswith(b"connection: close\r\n\r\n")
    assert conn.data(b"no body for HEAD") == b""
    conn.end()
    assert not conn.reusable


def _exchange(sock: socket.socket, raw: bytes, requests: int) -> list[Any]:
    """`raw` (that many requests) sent at once, then the events of their answers, read by h11
    (as a client that sent them: its state must have sent requests to read answers)."""
    sock.sendall(raw)
    client = h11.Connection(h11.CLIENT)
    events: list[Any] = []
    for _ in range(requests):
        client.send(h11.Request(method="POST", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        event = None
        while not isinstance(event, h11.EndOfMessage):
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(sock.recv(65536))
            else:
                events.append(event)
        if client.our_state is h11.MUST_CLOSE:
            break
        client.start_next_cycle()
    return events


def test_pipelined_and_chunked_requests_through_the_proxy(
    upstream: FakeUpstream, recording: Recording
) -> None:
    with recording.proxy(upstream) as proxy:
        path = f"/{proxy.secret}/openai/v1/chat/completions".encode()
        body = json.dumps(
            {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        one = b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (
            path, len(body), body,
        )  # fmt: skip
        half = len(body) // 2
        chunked = (
            b"POST %b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n"
            % (path, half, body[:half], len(body) - half, body[half:])
        )
        with socket.create_connection((proxy.host, proxy.port)) as sock:
            events = _exchange(sock, one + chunked, 2)  # both sent before either answer
        responses = [e for e in events if isinstance(e, h11.Response)]
        assert [r.status_code for r in responses] == [200, 200]
        answers = [e.data for e in events if isinstance(e, h11.Data)]
        assert all(json.loads(a)["object"] == "chat.completion" for a in answers)
        with socket.create_connection((proxy.host, proxy.port)) as sock:
            # HTTP/1.0: no Host needed, the connection closes after the answer
            events = _exchange(sock, one.replace(b"HTTP/1.1", b"HTTP/1.0"), 1)
            assert [e.status_code for e in events if isinstance(e, h11.Response)] == [200]
            assert sock.recv(100) == b""
        with socket.create_connection((proxy.host, proxy.port)) as sock:
            sock.sendall(b"POST %b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: br\r\n\r\n" % path)
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 501 ") and b"connection: close" in answer
            assert sock.recv(100) == b""
    turns = [f for f in recording.tape().frames if f.kind == "llm_turn"]
    assert len(turns) == 3  # the refused request reached no tape
