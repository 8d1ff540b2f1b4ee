"""Gemini's native API (generativelanguage.googleapis.com), the third wire protocol.

The booth sets `GOOGLE_GEMINI_BASE_URL` (read by the google-genai SDK) and `GEMINI_API_BASE`
(litellm) to `http://127.0.0.1:P/<secret>/gemini`; the clients append
`/v1beta/models/{model}:{method}`. The model is in the path, not the body, so the frame's model
comes from the path when the response does not say it (`modelVersion`), a replay keeps one
queue per model and method (`replay_endpoint`): a call to another model than recorded finds
nothing to match and diverges, and a fork's `--model gemini=M` rewrites the path (`with_model`).

Recorded methods: `generateContent`, `streamGenerateContent` (SSE with `?alt=sse`; each event a
partial response, usage cumulative in `usageMetadata`), `embedContent`, `batchEmbedContents`
and `countTokens` (free). The API key travels as the `x-goog-api-key` header or a `?key=` query
parameter, both redacted on the tape (jukebox.redact).
"""

from __future__ import annotations

import json
import re

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

    from jukebox.llm.providers import Summary

GEMINI = "gemini"
GENERATE = "generateContent"
STREAM_GENERATE = "streamGenerateContent"
EMBED = "embedContent"
BATCH_EMBED = "batchEmbedContents"
COUNT = "countTokens"
METHODS = (GENERATE, STREAM_GENERATE, EMBED, BATCH_EMBED, COUNT)
# Compiled at first use (re's cache): a booth imports this module at its start, and only an agent
# calling Gemini matches it.
_PATH = r"/(?:v1|v1beta|v1alpha)/(?:models|tunedModels)/([^/:]+):([A-Za-z]+)"


def endpoint_of(path: str) -> str | None:
    """The recorded method a decoded path calls, or None."""
    match = re.fullmatch(_PATH, path)
    return match.group(2) if match and match.group(2) in METHODS else None


def model_of(path: str) -> str | None:
    """The model named in a path (the part before `?` of the frame's `path` will do)."""
    match = re.fullmatch(_PATH, path.partition("?")[0])
    return match.group(1) if match else None


def with_model(path: str, model: str) -> str | None:
    """A decoded path (no query) calling `model` instead of the one it names, or None when it
    names none. `model` may be `models/M` or `tunedModels/M`, as the SDKs accept it."""
    match = re.fullmatch(_PATH, path)
    if match is None:
        return None
    collection, _, name = model.rpartition("/")
    if collection not in ("", "models", "tunedModels"):
        return None
    version = path.split("/", 2)[1]
    return f"/{version}/{collection or 'models'}/{name}:{match.group(2)}"


def replay_endpoint(endpoint: str, path: str | None) -> str:
    """What a replay queues a Gemini call under: its method and model, since the body does not
    name the model (`generateContent gemini-2.5-flash`)."""
    model = model_of(path or "")
    return f"{endpoint} {model}" if model else endpoint


def error_body(message: str, code: str, status: int = 400) -> bytes:
    """An error in Google's shape (google.rpc.Status): google-genai raises a 4xx as ClientError."""
    body = {
        "error": {
            "code": status,
            "message": message,
            "status": "FAILED_PRECONDITION" if status < 500 else "UNAVAILABLE",
            "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": code}],
        }
    }
    return json.dumps(body).encode()


def summarize(s: Summary, endpoint: str, response: Any, events: list[Any] | None) -> None:
    if endpoint == COUNT:
        s.reported = True  # free: nothing to count or estimate
        return
    # Without `alt=sse` a stream comes as one JSON array of the same partial responses.
    items = events if events is not None else response if isinstance(response, list) else [response]
    for data in items:
        if not isinstance(data, dict):
            continue
        s.model = data.get("modelVersion") or s.model
        _usage(s, data.get("usageMetadata"))
        for candidate in data.get("candidates") or []:
            for part in (candidate.get("content") or {}).get("parts") or []:
                if part.get("thought"):
                    continue  # a thought summary: billed as output, not the answer's text
                if isinstance(part.get("text"), str):
                    s.text += part["text"]
                call = part.get("functionCall")
                if isinstance(call, dict):
                    s.tool_calls.append({"name": call.get("name"), "arguments": call.get("args")})


def _usage(s: Summary, usage: Any) -> None:
    """Cumulative in a stream: the last one seen wins. Output counts the model's thinking."""
    if not isinstance(usage, dict):
        return
    s.reported = True

    def count(key: str) -> int:
        value = usage.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    s.input = count("promptTokenCount") + count("toolUsePromptTokenCount")
    s.output = count("candidatesTokenCount") + count("thoughtsTokenCount")
    s.cached = count("cachedContentTokenCount")
