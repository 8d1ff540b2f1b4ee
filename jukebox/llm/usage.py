"""How a model call's token usage becomes known: asked of the upstream, else estimated.

An OpenAI chat stream carries usage only when the request says
`stream_options: {include_usage: true}`, and many clients do not say it (LangChain stops asking
once `OPENAI_BASE_URL` is set), so such a call would count 0 tokens and $0 and the breaker would
never trip on it. The proxy therefore asks on the agent's behalf (`ask_for_usage`) and hides the
extra final chunk the upstream then sends (`choices: []` with `usage`, `is_usage_chunk`) from an
agent that did not ask for it, so the agent sees the stream it expected.

When a successful call still reports no usage (an upstream that ignores the option, a stream
broken mid-way, a server that never reports it), the tokens are estimated (`estimate`) and the
frame says `usage_estimated: true`. The estimate is bytes / 4, as the breaker's reservation is
(jukebox.llm.budget): `tiktoken` would count exactly for OpenAI models, but its wheel ships no
encodings and fetches them from the network at first use, which a booth may not reach.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from jukebox.llm.budget import BYTES_PER_TOKEN
from jukebox.llm.providers import CHAT, COMPLETIONS, OPENAI, Summary
from jukebox.llm.sse import SSEEvent

_INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'
# What a body that asks for a stream holds (JSON allows whitespace around the colon).
_STREAM_TRUE = re.compile(rb'"stream"[ \t\r\n]*:[ \t\r\n]*true')


def ask_for_usage(provider: str, endpoint: str, body: bytes) -> bytes | None:
    """The body to forward instead of `body` so that the upstream reports usage, or None when
    the request is not a chat (or legacy completions) stream or already asks for it."""
    if provider != OPENAI or endpoint not in (CHAT, COMPLETIONS):
        return None
    # Most calls are not streams, and some say `"stream": false`: no need to parse the whole
    # body, on the call's way upstream, to see it. (A client that escaped the key's letters
    # would only have its usage estimated.)
    if _STREAM_TRUE.search(body) is None:
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict) or request.get("stream") is not True:
        return None
    options = request.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return None  # malformed: the upstream's answer to it is the agent's
    if (options or {}).get("include_usage") is True:
        return None
    if "stream_options" not in request:
        # The agent's bytes kept, the option put in front: no re-encoding of the body (UTF-8
        # JSON; json.loads also reads UTF-16 and -32, which are encoded again instead).
        stripped = body.lstrip(b" \t\r\n")
        if stripped[:1] == b"{" and b"\x00" not in stripped[:4]:
            at = len(body) - len(stripped) + 1
            return body[:at] + _INCLUDE_USAGE + body[at:]
    request["stream_options"] = {**(options or {}), "include_usage": True}
    return json.dumps(request, ensure_ascii=False).encode()


def is_usage_chunk(event: SSEEvent) -> bool:
    """The chunk an OpenAI chat (or completions) stream ends with when usage was asked for."""
    if '"usage"' not in event.data:  # this runs on every event: most are not worth parsing
        return False
    data = event.json()
    return (
        isinstance(data, dict) and data.get("choices") == [] and isinstance(data.get("usage"), dict)
    )


def estimate(summary: Summary, request_size: int) -> None:
    """Fills `summary`'s input and output tokens from the request's size and the text and
    tool arguments the model produced, at BYTES_PER_TOKEN bytes a token."""
    produced = summary.text.encode()
    for call in summary.tool_calls:
        arguments: Any = call.get("arguments")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        produced += (call.get("name") or "").encode() + text.encode()
    summary.input = math.ceil(request_size / BYTES_PER_TOKEN)
    summary.output = math.ceil(len(produced) / BYTES_PER_TOKEN)
    summary.cached = summary.cache_write = 0
