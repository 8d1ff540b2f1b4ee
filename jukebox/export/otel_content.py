"""Message content in the GenAI conventions' JSON shape, exported only on request.

Prompts and replies can hold secrets an agent pasted, so `jukebox export otel` leaves them out
unless `--capture-content`, and even then every string passes jukebox.redact: the values of
this process's secret-looking environment variables, key-shaped values (`sk-...`, `ghp_...`),
`Bearer X`, URL passwords. The conversation is read by jukebox.tape.frame_view, the reader `jukebox
show` uses, so every protocol the proxy records comes out in one shape:
`[{"role": ..., "parts": [{"type": "text", "content": ...}, {"type": "tool_call", ...}]}]`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from jukebox.redact import Scrubber, is_secret_env_name, redact_text


def environment_scrubber(environ: Mapping[str, str] | None = None) -> Scrubber:
    env = os.environ if environ is None else environ
    return Scrubber(value for name, value in env.items() if is_secret_env_name(name))


def scrubbed(value: Any, scrubber: Scrubber) -> Any:
    """``value`` with every string in it (keys included) passed through jukebox.redact."""
    if isinstance(value, str):
        return redact_text(value, scrubber)
    if isinstance(value, list):
        return [scrubbed(v, scrubber) for v in value]
    if isinstance(value, dict):
        return {scrubbed(k, scrubber): scrubbed(v, scrubber) for k, v in value.items()}
    return value


def _part(block: dict[str, Any]) -> dict[str, Any]:
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "content": block.get("text", "")}
    if kind == "thinking":
        return {"type": "reasoning", "content": block.get("text", "")}
    if kind == "tool_call":
        return {"type": "tool_call", "id": block.get("id"), "name": block.get("name"),
                "arguments": block.get("arguments")}  # fmt: skip
    if kind == "tool_result":
        inner = [_part(b) for b in block.get("content") or []]
        texts = [p["content"] for p in inner if p.get("type") == "text"]
        response: Any = "\n".join(texts) if len(texts) == len(inner) else inner
        return {"type": "tool_call_response", "id": block.get("id"), "response": response}
    return {"type": str(block.get("what", kind))}


def _messages(messages: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    """(system instructions, the other messages) in the conventions' shape."""
    system: list[Any] = []
    rest: list[Any] = []
    for message in messages:
        parts = [_part(b) for b in message.get("blocks") or []]
        if message.get("role") in ("system", "developer") and not rest:
            system += parts
        else:
            rest.append({"role": message.get("role"), "parts": parts})
    return system, rest


def content_attributes(
    payload: dict[str, Any], finish_reasons: list[str], scrubber: Scrubber
) -> dict[str, str]:
    """gen_ai.system_instructions, gen_ai.input.messages and gen_ai.output.messages of one model
    call, each a JSON string (span attributes cannot nest), scrubbed."""
    from jukebox.tape.frame_view import reply, request_messages

    out: dict[str, str] = {}
    system, inputs = _messages(request_messages(payload.get("request")))
    if system:
        out["gen_ai.system_instructions"] = _dump(scrubbed(system, scrubber))
    if inputs:
        out["gen_ai.input.messages"] = _dump(scrubbed(inputs, scrubber))
    answer = reply(payload)
    if "error" in answer:
        output: list[Any] = [
            {"role": "assistant", "parts": [{"type": "error", "content": answer["error"]}]}
        ]
    elif answer.get("blocks"):
        message: dict[str, Any] = {
            "role": "assistant",
            "parts": [_part(b) for b in answer["blocks"]],
        }
        if finish_reasons:
            message["finish_reason"] = finish_reasons[0]
        output = [message]
    else:
        output = []
    if output:
        out["gen_ai.output.messages"] = _dump(scrubbed(output, scrubber))
    return out


def json_attribute(value: Any, scrubber: Scrubber) -> str:
    """A tool call's arguments or result as one scrubbed string."""
    return _dump(scrubbed(value, scrubber))


def _dump(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)
