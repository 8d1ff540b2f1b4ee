"""The proxy's own HTTP client upstream (jukebox.llm.upstream_client), through the proxy with
the real openai SDK, against a raw HTTP/1.1 server started here: compressed answers decoded for
the agent and the tape, one kept-alive connection for many calls, an idle connection the
upstream closed never used again, and an encoding nobody asked for refused as a 502."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from jukebox.llm.server import ProxyServer
from tests.llm.conftest import OPENAI_KEY

ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "gpt-4o-mini",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "decoded fine"},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def _encode(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.compress(body)
    if encoding == "deflate":  # zlib-wrapped, as the standard says
        return zlib.compress(body)
    if encoding == "raw-deflate":  # as some servers send it
        squeeze = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return squeeze.compress(body) + squeeze.flush()
    return body  # identity, or an encoding this server only claims ("br")


class RawUpstream:
    """HTTP/1.1 on bare sockets: keeps connections alive and counts them. The user message
    says how to answer: `enc:NAME` compresses the body so, `close` closes the connection right
    after the answer without saying so (an upstream forgetting an idle connection)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.connections = 0
        self.encodings_asked: list[str] = []
        self.closed = threading.Event()  # set when a `close` answer's connection is closed
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                headers = dict(
                    line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line
                )
                headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
                size = int(headers.get(b"content-length", b"0"))
                while len(buf) < size:
                    buf += conn.recv(65536)
                body, buf = buf[:size], buf[size:]
                self.encodings_asked.append(headers.get(b"accept-encoding", b"").decode())
                said = json.loads(body)["messages"][-1]["content"]
                encoding = said.partition("enc:")[2].split()[0] if "enc:" in said else ""
                payload = _encode(json.dumps(ANSWER).encode(), encoding)
                lines = [b"HTTP/1.1 200 OK", b"content-type: application/json"]
                if encoding:
                    name = "deflate" if encoding == "raw-deflate" else encoding
                    lines.append(f"content-encoding: {name}".encode())
                lines.append(f"content-length: {len(payload)}".encode())
                if "latin1" in said.split():  # a header value that is not ASCII
                    lines.append(b"x-note: caf\xe9, d\xe9j\xe0 vu")
                conn.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + payload)
                if "close" in said.split():
                    conn.close()
                    self.closed.set()
                    return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def raw() -> Iterator[RawUpstream]:
    server = RawUpstream()
    yield server
    server.close()


def _ask(proxy: ProxyServer, content: str) -> Any:
    import openai

    client = openai.OpenAI(
        api_key=OPENAI_KEY, base_url=proxy.base_urls()["OPENAI_BASE_URL"], max_retries=0
    )
    return client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": content}]
    )


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate"])
def test_a_compressed_answer_reaches_the_agent_and_the_tape_decoded(
    raw: RawUpstream, encoding: str
) -> None:
    with ProxyServer(upstreams={"openai": raw.url}) as proxy:
        answer = _ask(proxy, f"enc:{encoding}")
    assert answer.choices[0].message.content == "decoded fine"
    (turn,) = proxy.turns
    assert turn.payload["status"] == 200
    assert turn.payload["response"]["choices"][0]["message"]["content"] == "decoded fine"
    assert turn.payload["usage"]["input"] == 3 and turn.payload["usage"]["output"] == 2
    assert raw.encodings_asked[-1] == "gzip, deflate"  # asked for what it can decode


def test_calls_share_one_kept_alive_connection(raw: RawUpstream) -> None:
    before = raw.connections
    with ProxyServer(upstreams={"openai": raw.url}) as proxy:
        for i in range(4):
            assert _ask(proxy, f"call {i}").choices[0].message.content == "decoded fine"
    assert raw.connections - before == 1
    assert [t.payload["status"] for t in proxy.turns] == [200] * 4


def test_a_connection_the_upstream_closed_is_not_used_again(raw: RawUpstream) -> None:
    before = raw.connections
    with ProxyServer(upstreams={"openai": raw.url}) as proxy:
        # The first answer's connection is closed by the upstream once answered; the second
        # call must not be sent on it (it would fail) but on a fresh one.
        raw.closed.clear()
        assert _ask(proxy, "answer then close").choices[0].message.content == "decoded fine"
        assert raw.closed.wait(10)
        assert _ask(proxy, "and again").choices[0].message.content == "decoded fine"
    assert raw.connections - before == 2
    assert [t.payload["status"] for t in proxy.turns] == [200, 200]


def test_an_encoding_the_proxy_did_not_ask_for_is_a_502(raw: RawUpstream) -> None:
    import openai

    with (
        ProxyServer(upstreams={"openai": raw.url}) as proxy,
        pytest.raises(openai.InternalServerError) as caught,
    ):
        _ask(proxy, "enc:br")
    assert caught.value.status_code == 502
    (turn,) = proxy.turns
    assert turn.payload["status"] == 502 and "content-encoding 'br'" in turn.payload["error"]


def test_an_upstream_header_that_is_not_ascii_reaches_the_agent_byte_for_byte(
    raw: RawUpstream,
) -> None:
    # The upstream's headers go to the agent as the proxy's client read them; h11 refused a
    # non-ASCII value, which cost the agent its answer and the tape its turn.
    body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "latin1"}]})
    with ProxyServer(upstreams={"openai": raw.url}) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port)
        conn.request("POST", f"/{proxy.secret}/openai/v1/chat/completions", body=body,
                     headers={"authorization": f"Bearer {OPENAI_KEY}"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read()) == ANSWER
        assert resp.getheader("x-note") == "caf\xe9, d\xe9j\xe0 vu"  # latin-1, as sent
        assert resp.getheader("content-length") == str(len(json.dumps(ANSWER)))
        conn.close()
    (turn,) = proxy.turns
    assert turn.payload["status"] == 200
    assert turn.payload["response_headers"]["x-note"] == "caf\xe9, d\xe9j\xe0 vu"


@pytest.mark.trio
async def test_events_that_follow_the_head_are_taken_without_waiting() -> None:
    """An upstream writes a stream's head and its first event apart: whatever has arrived by
    the time the proxy passes the head on is taken at once (`buffered`), to go to the agent in
    the head's write rather than a wake-up later; nothing is waited for."""
    import trio

    from jukebox.llm.upstream_client import UpstreamClient

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    head_taken = threading.Event()
    event = b'data: {"n": 1}\n\n'

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf or not buf.endswith(b"{}"):
                buf += conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            head_taken.wait(30)  # the event comes only after the client has the head
            conn.sendall(b"%x\r\n%b\r\n0\r\n\r\n" % (len(event), event))
            conn.recv(1)  # until the client closes

    threading.Thread(target=serve, daemon=True).start()
    client = UpstreamClient()
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        response = await client.send(client.request("POST", url, [], b"{}"))
        assert response.buffered() == []  # the head came alone: nothing to take yet
        head_taken.set()
        with trio.fail_after(30):  # a bound, not a timing: the event is on its way
            while not (taken := response.buffered()):
                await trio.sleep(0.001)
        assert taken == [event]
        assert await response.next_chunks() == []  # and the body's end came with it
        await response.aclose()
    finally:
        await client.aclose()
        listener.close()
