"""Server-sent events: an incremental parser that keeps chunk boundaries, and the encoder.

The proxy feeds upstream bytes to `SSEParser` and forwards them untouched, each event as soon
as it is complete (`take_ready`: the bytes up to the last point between events), so recording
neither alters nor delays what the agent sees. Each event remembers the chunk (the upstream
read) it completed in and when, which is what replay needs to re-emit a stream with the same
boundaries and, optionally, the same timing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from json.scanner import make_scanner
from typing import Any, cast

_EOL = re.compile(rb"\r\n|\r|\n")
# json.loads without its two Python layers (decode, raw_decode) around the C scanner: about a
# third of parsing a stream's event, which the proxy does for every event it records.
# (typeshed wants a make_scanner as its context: any object with a decoder's settings is one)
_SCAN = make_scanner(cast(Any, json.JSONDecoder()))


@dataclass
class SSEEvent:
    data: str
    event: str | None = None
    id: str | None = None
    chunk: int = 0  # index of the upstream read in which the event completed
    t_ms: float = 0.0  # milliseconds since the response headers arrived
    # Received from the upstream but never sent to the agent (the usage chunk the proxy asked
    # for on the agent's behalf, jukebox.llm.usage): recorded, never replayed.
    hidden: bool = False
    # The last `json()` and the data it parsed: the proxy asks an event's JSON more than once
    # (is it the usage chunk, the final event, then its record), and the data may be replaced.
    _parsed: tuple[str, Any] | None = field(default=None, repr=False, compare=False)

    def json(self) -> Any:
        """The data parsed as JSON, or None when it is not JSON (`[DONE]`)."""
        if self._parsed is not None and self._parsed[0] is self.data:
            return self._parsed[1]
        value = None
        data = self.data
        if data and data[0] in "{[":  # so no leading whitespace to skip, as json.loads does
            try:
                value, end = _SCAN(data, 0)
            except (ValueError, StopIteration):  # StopIteration: nothing to parse at 0
                value = None
            else:
                if end != len(data) and data[end:].strip(" \t\n\r"):
                    value = None  # more after the value: json.loads says "Extra data"
        self._parsed = (self.data, value)
        return value

    def to_record(self) -> dict[str, Any]:
        """The event as stored on the tape: JSON data as a value, anything else as a string."""
        value = self.json()
        out: dict[str, Any] = {"chunk": self.chunk, "t_ms": round(self.t_ms, 3)}
        if value is not None:
            out["data"] = value
        else:
            out["text"] = self.data
        if self.event is not None:
            out["event"] = self.event
        if self.id is not None:
            out["id"] = self.id
        if self.hidden:
            out["hidden"] = True
        return out


def event_from_record(record: dict[str, Any]) -> SSEEvent:
    if "data" in record:
        data = json.dumps(record["data"], separators=(",", ":"), ensure_ascii=False)
    else:
        data = record.get("text", "")
    return SSEEvent(
        data=data,
        event=record.get("event"),
        id=record.get("id"),
        chunk=int(record.get("chunk", 0)),
        t_ms=float(record.get("t_ms", 0.0)),
        hidden=record.get("hidden") is True,
    )


def encode_event(event: SSEEvent) -> bytes:
    lines = []
    if event.event is not None:
        lines.append(f"event: {event.event}")
    if event.id is not None:
        lines.append(f"id: {event.id}")
    for line in event.data.split("\n"):
        lines.append(f"data: {line}")
    return ("\n".join(lines) + "\n\n").encode()


class SSEParser:
    """Feed it bytes as they arrive; it returns the events each feed completed."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self.chunks = 0
        self.events: list[SSEEvent] = []
        self._raw = bytearray()  # bytes fed and not yet taken by take_ready
        self._ready = 0  # how many of them end at a point between events

    def feed(self, chunk: bytes, t_ms: float) -> list[SSEEvent]:
        index = self.chunks
        self.chunks += 1
        return self._consume(chunk, index, t_ms)

    def take_ready(self) -> bytes:
        """The bytes fed so far that end between events (every event in them complete, no
        event begun), removed: what may be passed on now, byte for byte."""
        ready = bytes(self._raw[: self._ready])
        del self._raw[: self._ready]
        self._ready = 0
        return ready

    def take_rest(self) -> bytes:
        """Every byte fed and not yet taken: at the end of the stream, the unterminated tail."""
        rest = bytes(self._raw)
        self._raw.clear()
        self._ready = 0
        return rest

    def _consume(self, chunk: bytes, index: int, t_ms: float, fed: bool = True) -> list[SSEEvent]:
        self._buf += chunk
        if fed:
            self._raw += chunk
        done: list[SSEEvent] = []
        pos = 0
        buf = self._buf
        # Where buf starts in the untaken bytes (it is their tail: a partial line at most).
        base = len(self._raw) - len(buf)
        if b"\r" not in buf:
            # Lines end in \n alone, as every API's streams do: one split, not a regex search
            # per line (the parse is on the path of every event). A `data: ` line and the empty
            # line ending an event, nearly all the lines of a model's stream, are handled here,
            # the rest by `_line`.
            lines = buf.split(b"\n")
            self._buf = lines.pop()
            data = self._data
            for raw in lines:
                pos += len(raw) + 1
                if raw[:6] == b"data: ":
                    data.append(raw[6:].decode("utf-8", errors="replace"))
                    continue  # an event is begun: no point between events here
                if raw:
                    event = self._line(raw.decode("utf-8", errors="replace"), index, t_ms)
                elif data or self._event is not None:
                    event = SSEEvent("\n".join(data), self._event, self._id, index, t_ms)
                    data = self._data = []
                    self._event = None
                else:
                    event = None
                if event is not None:
                    done.append(event)
                    data = self._data
                if fed and not data and self._event is None:
                    self._ready = base + pos
            self.events.extend(done)
            return done
        while True:
            match = _EOL.search(buf, pos)
            # A lone \r at the very end may be the first half of \r\n: wait for more.
            if match is None or (match.group() == b"\r" and match.end() == len(buf)):
                break
            line = buf[pos : match.start()].decode("utf-8", errors="replace")
            pos = match.end()
            event = self._line(line, index, t_ms)
            if event is not None:
                done.append(event)
            if fed and not self._data and self._event is None:
                self._ready = base + pos
        self._buf = buf[pos:]
        self.events.extend(done)
        return done

    def _line(self, line: str, chunk: int, t_ms: float) -> SSEEvent | None:
        if not line:
            if not self._data and self._event is None:
                return None
            event = SSEEvent("\n".join(self._data), self._event, self._id, chunk, t_ms)
            self._data, self._event = [], None
            return event
        if line.startswith(":"):
            return None  # a comment (keep-alive)
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        return None

    def close(self, t_ms: float) -> list[SSEEvent]:
        """Completes an event the upstream left unterminated at the end of the stream."""
        if not (self._buf or self._data):
            return []
        return self._consume(b"\n\n", max(self.chunks - 1, 0), t_ms, fed=False)
