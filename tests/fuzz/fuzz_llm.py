"""The LLM proxy's parsing of what the agent sends and what comes back: request routing, request
bodies, the request rewriter used by forks, SSE streams, and the turn recorded onto the tape.

None of these may raise on hostile bytes: `parse_body` falls back to text, `summarize` records
what it understood, and a turn is recorded whatever the body held. The allowed outcome is a
`JukeboxError` only.
"""

from __future__ import annotations

import contextlib

from jukebox.errors import JukeboxError
from jukebox.llm.providers import route
from jukebox.llm.recorder import Exchange, build_turn, parse_body
from jukebox.llm.rewrite import RequestRewriter
from jukebox.llm.sse import SSEParser
from jukebox.redact import Scrubber
from tests.fuzz.common import Target

_TARGETS = [
    ("POST", "/openai/chat/completions"),
    ("POST", "/openai/responses"),
    ("POST", "/anthropic/v1/messages"),
    ("GET", "/openai/models?x=1"),
]
_SCRUBBER = Scrubber(["sk-test-secret-value-1234567890"])
_REWRITER = RequestRewriter(model="other-model", system_prompt="be brief")


def llm_input(data: bytes) -> None:
    if not data:
        return
    selector, body = data[0], data[1:]
    method, target = _TARGETS[selector % len(_TARGETS)]
    if selector & 0x80:
        # The request line itself is the agent's too.
        target = body[:200].decode("utf-8", "replace")
    with contextlib.suppress(JukeboxError):
        r = route(method, target)
        request = parse_body(body)
        if r is None:
            return
        _REWRITER.apply(r.provider, r.endpoint, request)
        stream = bool(selector & 0x40)
        events = None
        if stream:
            parser = SSEParser()
            third = max(1, len(body) // 3)
            for i in range(0, len(body), third):
                parser.feed(body[i : i + third], float(i))
            parser.close(1.0)
            events = parser.events
        ex = Exchange(
            provider=r.provider,
            endpoint=r.endpoint,
            method=method,
            path=target,
            request_headers=[("authorization", "Bearer sk-test-secret-value-1234567890")],
            request_body=body,
            status=200 if selector & 0x20 else 500,
            response_body=None if stream else body,
            events=events,
        )
        turn = build_turn(ex, _SCRUBBER, None)
        if b"sk-test-secret-value-1234567890" in repr(turn.payload).encode():
            raise AssertionError("a secret reached the recorded turn")


def _seeds() -> list[bytes]:
    chat = (
        b'{"model":"gpt-4o","messages":[{"role":"system","content":"s"},'
        b'{"role":"user","content":"hi"}],"stream":false}'
    )
    messages = (
        b'{"model":"claude","system":"s","max_tokens":5,"messages":[{"role":"user","content":"x"}]}'
    )
    responses = b'{"model":"gpt-4o","input":"hi","instructions":"s"}'
    sse = (
        b'data: {"choices":[{"delta":{"content":"he"}}],"model":"gpt-4o"}\n\n'
        b'event: message_delta\ndata: {"usage":{"output_tokens":3}}\n\ndata: [DONE]\n\n'
    )
    return [
        bytes([0x20]) + chat,
        bytes([0x22]) + messages,
        bytes([0x21]) + responses,
        bytes([0x60]) + sse,
        bytes([0x62]) + sse,
        bytes([0x80]) + b"/openai/../../etc?x",
    ]


TARGETS = [Target("llm", llm_input, _seeds, "proxy routing, bodies, rewriter, SSE, turns")]
