"""A local stand-in for the OpenAI and Anthropic APIs: both wire protocols, JSON and SSE.

Deterministic: the answer depends only on the request. With tools offered and a user message
last, the model calls the first tool; after a tool result it says `done: <result>`; otherwise
it echoes the last user text. Streams are written one event per write (some two per write) with
chunked transfer encoding, so chunk boundaries are real. A request with `"cache"` in its last
message reports 3 cached prompt tokens. Header `x-fake-delay-ms` delays the answer
(after `x-fake-barrier: NAME:N` has held the request until N requests naming NAME arrived;
then `x-fake-wait-for: NAME` holds it until gate NAME is open, which a request with
`x-fake-opens: NAME` opens as it arrives, or the test);
`x-fake-response-headers` (a JSON object) is added to a JSON answer's headers;
`x-fake-gate: NAME` holds a stream after its first event until the test opens the gate, and
`x-fake-pause-ms` pauses it there (a model thinking between its first and second token).
`x-fake-fail: STATUS:N` answers the first N copies of the same request (path and body) with
that status and an error body, as a rate-limited or broken API does (an SDK then retries).
A chat stream ends with the usage chunk (`choices: []`, `usage`) when the request asks for it
(`stream_options.include_usage`), as the real API does, unless header `x-fake-no-usage` is set
(an OpenAI-compatible server that ignores the option).

Besides the model calls: `/embeddings` (a vector per input that depends on its text, floats or
base64 as asked), legacy `/completions` (JSON or stream, usage chunk as chat), `/moderations`,
Anthropic's `/v1/messages/count_tokens`, and the Agents SDK's `/traces/ingest`. Gemini's native
`/v1beta/models/{model}:generateContent`, `:streamGenerateContent?alt=sse` (events end `\r\n\r\n`,
usage cumulative in each), `:countTokens` and `:embedContent`. Paths are matched
on their end, so Azure's `/openai/deployments/{name}/chat/completions` is the chat endpoint.

Run as `python tests/llm/upstream.py PORT` for a standalone server (the booth tests do).
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL_ECHO = "fake-echo"
GATE_TIMEOUT_S = 5.0


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif isinstance(part.get("content"), str | list):
                    parts.append(_text_of(part["content"]))
        return " ".join(parts)
    return ""


def decide(messages: list[dict[str, Any]], tools: list[Any]) -> tuple[str, str | None, dict]:
    """(text, tool name or None, tool arguments) for a conversation."""
    last = messages[-1] if messages else {}
    role = last.get("role")
    content = last.get("content")
    if isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "tool_result" for p in content
    ):
        role = "tool"
    if role == "tool" or last.get("type") == "function_call_output":
        result = _text_of(content) if content is not None else str(last.get("output", ""))
        return f"done: {result}", None, {}
    text = _text_of(content)
    if tools:
        tool = tools[0]
        name = tool.get("name") or (tool.get("function") or {}).get("name")
        return "", name, {"path": "hello.txt", "text": text[:40]}
    return f"echo: {text}", None, {}


def _words(text: str) -> list[str]:
    words = text.split(" ")
    return [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def log_message(self, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # One small write per event: without this, Nagle and delayed ACKs add ~40 ms per stream.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # ------------------------------------------------------------------ plumbing

    def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("x-request-id", "req_fake_1")
        # A test can ask for response headers (cookies, tokens) to see what the proxy records.
        asked = json.loads(self.headers.get("x-fake-response-headers") or "{}")
        for k, v in {**asked, **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("x-request-id", "req_fake_stream")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    @staticmethod
    def _sse(data: Any, event: str | None = None) -> bytes:
        head = f"event: {event}\n" if event else ""
        text = data if isinstance(data, str) else json.dumps(data)
        return (head + f"data: {text}\n\n").encode()

    def _events(self, events: list[bytes]) -> None:
        """Writes events, pairing every third with the next, so chunks hold one or two events.
        With header `x-fake-gate: NAME`, waits after the first event until the test opens
        `server.gate(NAME)` (GATE_TIMEOUT_S at most), noting `second event sent` in
        `server.log` as it goes on."""
        self._start_stream()
        gate = self.headers.get("x-fake-gate")
        pause = float(self.headers.get("x-fake-pause-ms") or 0) / 1000
        i = 0
        while i < len(events):
            take = 2 if i % 3 == 2 and i + 1 < len(events) else 1
            if i == 1 and pause:
                time.sleep(pause)
            if i == 1 and gate:
                self.server.gate(gate).wait(GATE_TIMEOUT_S)
                self.server.log.append("second event sent")
            self._chunk(b"".join(events[i : i + take]))
            i += take
        self._end_stream()

    def do_GET(self) -> None:
        self.server.seen.append(("GET", self.path, dict(self.headers), None))
        if self.path.partition("?")[0].endswith("/models"):
            self._json(200, {"object": "list", "data": [{"id": "gpt-4o", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found", "type": "not_found"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        raw = self.rfile.read(length)
        body = json.loads(raw) if raw else {}
        self.server.seen.append(("POST", self.path, dict(self.headers), body))
        opens = self.headers.get("x-fake-opens")
        if opens:
            self.server.gate(opens).set()
        barrier = self.headers.get("x-fake-barrier")
        if barrier:
            name, _, parties = barrier.partition(":")
            with contextlib.suppress(threading.BrokenBarrierError):
                self.server.barrier(name, int(parties)).wait(GATE_TIMEOUT_S)
        delay = float(self.headers.get("x-fake-delay-ms", "0") or 0)
        if delay:
            time.sleep(delay / 1000)
        waits_for = self.headers.get("x-fake-wait-for")
        if waits_for:
            self.server.gate(waits_for).wait(GATE_TIMEOUT_S)
        if self._fail(raw):
            return
        path = self.path.partition("?")[0]
        if path.endswith("/chat/completions"):
            self._chat(body)
        elif path.endswith("/responses"):
            self._responses(body)
        elif path.endswith("/v1/messages"):
            self._messages(body)
        elif path.endswith("/v1/messages/count_tokens"):
            count = sum(len(json.dumps(m)) for m in body.get("messages", [])) // 4
            self._json(200, {"input_tokens": count})
        elif path.endswith("/completions"):
            self._completions(body)
        elif path.endswith("/embeddings"):
            self._embeddings(body)
        elif path.endswith("/moderations"):
            self._moderations(body)
        elif path.endswith("/traces/ingest"):
            self._json(200, {})
        elif ":" in path and "/models/" in path:
            model, _, method = path.rpartition("/models/")[2].partition(":")
            self._gemini(body, model, method)
        else:
            self._json(404, {"error": {"message": f"no {self.path}", "type": "not_found"}})

    def _fail(self, raw: bytes) -> bool:
        status, _, times = (self.headers.get("x-fake-fail") or "").partition(":")
        if not status:
            return False
        with self.server.lock:
            key = (self.path, raw)
            seen = self.server.failed.get(key, 0)
            if seen >= int(times):
                return False
            self.server.failed[key] = seen + 1
        error = {"message": f"fake failure {status}", "type": "rate_limit_error"}
        self._json(int(status), {"type": "error", "error": error}, {"retry-after-ms": "10"})
        return True

    # ------------------------------------------------------------------ OpenAI chat

    def _chat(self, body: dict[str, Any]) -> None:
        messages = body.get("messages", [])
        text, tool, args = decide(messages, body.get("tools") or [])
        prompt = sum(len(json.dumps(m)) for m in messages) // 4
        cached = 3 if "cache" in json.dumps(messages[-1:]) else 0
        completion = max(len(text.split()), 1) + (5 if tool else 0)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        model = body.get("model", MODEL_ECHO)
        base = {"id": "chatcmpl-fake", "created": 1700000000, "model": model}
        call = {
            "id": "call_fake_1",
            "type": "function",
            "function": {"name": tool, "arguments": json.dumps(args)},
        }
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if tool:
                message["tool_calls"] = [call]
            choice = {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if tool else "stop",
                "logprobs": None,
            }
            resp = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            self._json(200, resp)
            return
        chunk = {**base, "object": "chat.completion.chunk"}
        events = [
            self._sse(
                {
                    **chunk,
                    "choices": [
                        {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
                    ],
                }
            )
        ]
        if tool:
            arguments = call["function"]["arguments"]
            half = len(arguments) // 2
            pieces = [
                {"index": 0, "id": "call_fake_1", "type": "function",
                 "function": {"name": tool, "arguments": arguments[:half]}},
                {"index": 0, "function": {"arguments": arguments[half:]}},
            ]  # fmt: skip
            for piece in pieces:
                delta = {"tool_calls": [piece]}
                events.append(
                    self._sse(
                        {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                    )
                )
        for word in _words(text):
            delta = {"content": word}
            events.append(
                self._sse(
                    {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                )
            )
        finish = "tool_calls" if tool else "stop"
        events.append(
            self._sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        )
        asked = (body.get("stream_options") or {}).get("include_usage")
        if asked and not self.headers.get("x-fake-no-usage"):
            events.append(self._sse({**chunk, "choices": [], "usage": usage}))
        events.append(self._sse("[DONE]"))
        self._events(events)

    # ------------------------------------------------------------------ other OpenAI endpoints

    def _completions(self, body: dict[str, Any]) -> None:
        prompt = body.get("prompt")
        text = f"echo: {prompt if isinstance(prompt, str) else json.dumps(prompt)}"
        usage = {"prompt_tokens": len(json.dumps(prompt)) // 4,
                 "completion_tokens": len(text.split()),
                 "total_tokens": len(json.dumps(prompt)) // 4 + len(text.split())}  # fmt: skip
        base = {"id": "cmpl-fake", "object": "text_completion", "created": 1700000000,
                "model": body.get("model", MODEL_ECHO)}  # fmt: skip
        if not body.get("stream"):
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
            self._json(200, {**base, "choices": [choice], "usage": usage})
            return
        events = []
        for word in _words(text):
            choice = {"index": 0, "text": word, "finish_reason": None, "logprobs": None}
            events.append(self._sse({**base, "choices": [choice]}))
        events.append(self._sse({**base, "choices": [
            {"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}]}))  # fmt: skip
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(self._sse({**base, "choices": [], "usage": usage}))
        events.append(self._sse("[DONE]"))
        self._events(events)

    def _embeddings(self, body: dict[str, Any]) -> None:
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = []
        for i, text in enumerate(inputs):
            seed = sum(str(text).encode()) % 97
            vector = [round((seed + k) / 100, 2) for k in range(4)]
            embedding: Any = vector
            if body.get("encoding_format") == "base64":
                embedding = base64.b64encode(struct.pack("<4f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        tokens = sum(len(str(t).split()) for t in inputs)
        self._json(200, {"object": "list", "data": data, "model": body.get("model", MODEL_ECHO),
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip

    def _moderations(self, body: dict[str, Any]) -> None:
        flagged = "attack" in json.dumps(body.get("input"))
        result = {"flagged": flagged, "categories": {"violence": flagged},
                  "category_scores": {"violence": 0.9 if flagged else 0.01}}  # fmt: skip
        self._json(200, {"id": "modr-fake", "model": body.get("model") or "omni-moderation-latest",
                         "results": [result]})  # fmt: skip

    # ------------------------------------------------------------------ Gemini native

    def _gemini(self, body: dict[str, Any], model: str, method: str) -> None:
        contents = body.get("contents") or []
        if method == "countTokens":
            self._json(200, {"totalTokens": len(json.dumps(contents)) // 4})
            return
        if method in ("embedContent", "batchEmbedContents"):
            asked = body.get("requests") or [body]
            vectors = []
            for request in asked:
                seed = sum(_text_of((request.get("content") or {}).get("parts")).encode()) % 97
                vectors.append({"values": [(seed + k) / 100 for k in range(4)]})
            one = method == "embedContent"
            self._json(200, {"embedding": vectors[0]} if one else {"embeddings": vectors})
            return
        messages = []
        for content in contents:
            parts = content.get("parts") or []
            answered = next((p["functionResponse"] for p in parts if "functionResponse" in p), None)
            if answered is not None:
                messages.append({"role": "tool", "content": json.dumps(answered.get("response"))})
            else:
                messages.append({"role": content.get("role"), "content": _text_of(parts)})
        tools = [d for t in body.get("tools") or [] for d in t.get("functionDeclarations") or []]
        text, tool, args = decide(messages, tools)
        prompt = len(json.dumps(contents)) // 4
        output = max(len(text.split()), 1)
        usage = {"promptTokenCount": prompt, "candidatesTokenCount": output,
                 "thoughtsTokenCount": 2, "totalTokenCount": prompt + output + 2}  # fmt: skip
        parts = [{"functionCall": {"name": tool, "args": args}}] if tool else [{"text": text}]
        candidate = {"content": {"role": "model", "parts": parts}, "finishReason": "STOP",
                     "index": 0}  # fmt: skip
        final = {"candidates": [candidate], "usageMetadata": usage,
                 "modelVersion": f"{model}-001", "responseId": "resp-fake"}  # fmt: skip
        if method == "generateContent":
            self._json(200, final)
            return
        events = []
        words = _words(text) if not tool else []
        for word in words:
            piece = {"content": {"role": "model", "parts": [{"text": word}]}, "index": 0}
            partial = {**usage, "candidatesTokenCount": 1}
            events.append({"candidates": [piece], "usageMetadata": partial,
                           "modelVersion": f"{model}-001", "responseId": "resp-fake"})  # fmt: skip
        events.append({**final, "candidates": [{**candidate, "content": {
            "role": "model", "parts": [] if not tool else parts}}]})  # fmt: skip
        self._events([f"data: {json.dumps(e)}\r\n\r\n".encode() for e in events])

    # ------------------------------------------------------------------ OpenAI responses

    def _responses(self, body: dict[str, Any]) -> None:
        inp = body.get("input")
        messages = [{"role": "user", "content": inp}] if isinstance(inp, str) else list(inp or [])
        tools = body.get("tools") or []
        text, tool, args = decide(messages, tools)
        prompt = len(json.dumps(inp)) // 4 + len(body.get("instructions") or "") // 4
        completion = max(len(text.split()), 1)
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }
        if tool:
            item: dict[str, Any] = {
                "type": "function_call",
                "id": "fc_fake_1",
                "call_id": "call_fake_1",
                "name": tool,
                "arguments": json.dumps(args),
                "status": "completed",
            }
        else:
            item = {
                "type": "message",
                "id": "msg_fake_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        response = {
            "id": "resp_fake",
            "object": "response",
            "created_at": 1700000000,
            "model": body.get("model", MODEL_ECHO),
            "status": "completed",
            "output": [item],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": tools,
            "usage": usage,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "metadata": {},
            "temperature": 1.0,
            "top_p": 1.0,
        }
        if not body.get("stream"):
            self._json(200, response)
            return
        seq = iter(range(1000))
        ev: list[bytes] = []

        def add(kind: str, **fields: Any) -> None:
            ev.append(self._sse({"type": kind, "sequence_number": next(seq), **fields}, kind))

        pending = {**response, "status": "in_progress", "output": [], "usage": None}
        add("response.created", response=pending)
        add("response.in_progress", response=pending)
        if tool:
            add("response.output_item.added", output_index=0, item={**item, "arguments": ""})
            add("response.function_call_arguments.delta", item_id="fc_fake_1", output_index=0,
                delta=item["arguments"])  # fmt: skip
            add("response.function_call_arguments.done", item_id="fc_fake_1", output_index=0,
                arguments=item["arguments"])  # fmt: skip
        else:
            empty = {**item, "content": [], "status": "in_progress"}
            add("response.output_item.added", output_index=0, item=empty)
            part = {"type": "output_text", "text": "", "annotations": []}
            add("response.content_part.added", item_id="msg_fake_1", output_index=0,
                content_index=0, part=part)  # fmt: skip
            for word in _words(text):
                add("response.output_text.delta", item_id="msg_fake_1", output_index=0,
                    content_index=0, delta=word, logprobs=[])  # fmt: skip
            add("response.output_text.done", item_id="msg_fake_1", output_index=0,
                content_index=0, text=text, logprobs=[])  # fmt: skip
            add("response.content_part.done", item_id="msg_fake_1", output_index=0,
                content_index=0, part={**part, "text": text})  # fmt: skip
        add("response.output_item.done", output_index=0, item=item)
        add("response.completed", response=response)
        self._events(ev)

    # ------------------------------------------------------------------ Anthropic messages

    def _messages(self, body: dict[str, Any]) -> None:
        messages = body.get("messages", [])
        text, tool, args = decide(messages, body.get("tools") or [])
        prompt = sum(len(json.dumps(m)) for m in messages) // 4 + len(str(body.get("system"))) // 4
        cached = 3 if "cache" in json.dumps(messages[-1:]) else 0
        completion = max(len(text.split()), 1)
        if tool:
            block: dict[str, Any] = {
                "type": "tool_use", "id": "toolu_fake_1", "name": tool, "input": args
            }  # fmt: skip
        else:
            block = {"type": "text", "text": text}
        message = {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", MODEL_ECHO),
            "content": [block],
            "stop_reason": "tool_use" if tool else "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt,
                "output_tokens": completion,
                "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0,
            },
        }
        if not body.get("stream"):
            self._json(200, message)
            return
        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "usage": {**message["usage"], "output_tokens": 1},
        }
        ev = [self._sse({"type": "message_start", "message": start}, "message_start")]
        ev.append(self._sse({"type": "ping"}, "ping"))
        if tool:
            opened = {**block, "input": {}}
            ev.append(self._sse({"type": "content_block_start", "index": 0,
                                 "content_block": opened}, "content_block_start"))  # fmt: skip
            arguments = json.dumps(args)
            half = len(arguments) // 2
            for piece in (arguments[:half], arguments[half:]):
                delta = {"type": "input_json_delta", "partial_json": piece}
                ev.append(self._sse({"type": "content_block_delta", "index": 0, "delta": delta},
                                    "content_block_delta"))  # fmt: skip
        else:
            ev.append(self._sse({"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}},
                                "content_block_start"))  # fmt: skip
            for word in _words(text):
                delta = {"type": "text_delta", "text": word}
                ev.append(self._sse({"type": "content_block_delta", "index": 0, "delta": delta},
                                    "content_block_delta"))  # fmt: skip
        ev.append(self._sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        ev.append(
            self._sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                    "usage": {"output_tokens": completion},
                },
                "message_delta",
            )
        )
        ev.append(self._sse({"type": "message_stop"}, "message_stop"))
        self._events(ev)


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int]) -> None:
        super().__init__(addr, Handler)
        self.seen: list[tuple[str, str, dict[str, str], Any]] = []
        self.failed: dict[tuple[str, bytes], int] = {}
        self.lock = threading.Lock()
        self.gates: dict[str, threading.Event] = {}
        self.barriers: dict[str, threading.Barrier] = {}
        self.log: list[str] = []  # what gated streams did, in order (tests add their own)

    def barrier(self, name: str, parties: int) -> threading.Barrier:
        with self.lock:
            return self.barriers.setdefault(name, threading.Barrier(parties))

    def gate(self, name: str) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(name, threading.Event())


class FakeUpstream:
    """A FakeServer on 127.0.0.1 in a background thread."""

    def __init__(self, port: int = 0) -> None:
        self.server = FakeServer(("127.0.0.1", port))
        self.port = self.server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_url(self) -> str:
        return self.url + "/v1"

    @property
    def seen(self) -> list[tuple[str, str, dict[str, str], Any]]:
        return self.server.seen

    def start(self) -> FakeUpstream:
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join()


if __name__ == "__main__":
    server = FakeServer(("127.0.0.1", int(sys.argv[1])))
    print(server.server_address[1], flush=True)
    server.serve_forever()
