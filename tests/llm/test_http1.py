"""The upstream client's HTTP/1.1 codec (jukebox.llm.http1): responses fed byte by byte and in
one piece read the same, each framing ends where it should, the connection is reused only when
the upstream keeps it alive, and what h11 refused is refused."""

from __future__ import annotations

import pytest

from jukebox.llm.http1 import ProtocolError, ResponseReader, encode_request

CHUNKED = (
    b"HTTP/1.1 100 Continue\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"6\r\ndata: \r\nA;ext=1\r\n{\"a\": 1}\n\n\r\n0\r\nx-trailer: t\r\n\r\n"
)


def _read(raw: bytes, step: int) -> tuple[ResponseReader, int, list[bytes]]:
    reader = ResponseReader()
    parts: list[bytes] = []
    status = 0
    for i in range(0, len(raw), step):
        reader.feed(raw[i : i + step])
        head = reader.head()
        if head is not None:
            status = head.status
            parts += reader.body()
    return reader, status, parts


@pytest.mark.parametrize("step", [1, 3, len(CHUNKED)])
def test_a_chunked_answer_reads_the_same_however_it_is_cut(step: int) -> None:
    reader, status, parts = _read(CHUNKED, step)
    assert status == 200 and reader.done and reader.reusable
    assert b"".join(parts) == b'data: {"a": 1}\n\n'
    if step == len(CHUNKED):
        assert parts == [b"data: ", b'{"a": 1}\n\n']  # one part per chunk, as it came
    head = reader.head()
    assert head is not None and head.headers[0] == ("content-type", "text/event-stream")


def test_length_close_and_keep_alive() -> None:
    reader, status, parts = _read(b"HTTP/1.1 404 Nope\r\nContent-Length: 4\r\n\r\nbody", 2)
    assert (status, b"".join(parts), reader.reusable) == (404, b"body", True)
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    reader, _, parts = _read(closing, 5)
    assert reader.done and not reader.reusable
    reader, _, parts = _read(b"HTTP/1.0 200 OK\r\n\r\nuntil the end", 4)
    assert not reader.done  # framed by the close
    reader.feed(b"")
    assert reader.body() == [] and reader.done and not reader.reusable
    assert b"".join(parts) == b"until the end"


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Name: 1\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
    ],
)
def test_what_is_not_http_is_refused(raw: bytes) -> None:
    reader = ResponseReader()
    reader.feed(raw)
    with pytest.raises(ProtocolError):
        reader.head()
        reader.body()


def test_a_body_cut_short_is_an_error_and_a_request_cannot_smuggle_lines() -> None:
    reader = ResponseReader()
    reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
    assert reader.head() is not None and reader.body() == [b"short"]
    reader.feed(b"")
    with pytest.raises(ProtocolError):
        reader.body()
    sent = encode_request("POST", "/v1/x?a=1", [("host", "h"), ("content-length", "2")], b"{}")
    assert sent == b"POST /v1/x?a=1 HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\n\r\n{}"
    for headers in ([("x-a", "1\r\nx-b: 2")], [("x a", "1")]):
        with pytest.raises(ProtocolError):
            encode_request("GET", "/", headers, b"")
    with pytest.raises(ProtocolError):
        encode_request("GET", "/ HTTP/1.1\r\nx:", [], b"")
