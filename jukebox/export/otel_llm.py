"""What a recorded model call says beyond the frame's own fields: the GenAI operation it was,
the provider's name in the conventions' terms, the model that answered, the response id, the
finish reasons and the request's sampling settings.

Read from the recorded request and response (a JSON body, or a stream's events) in each
protocol's shape: OpenAI chat, Responses, legacy completions and embeddings, Anthropic Messages,
Gemini. Anything malformed yields nothing rather than an error: a tape from a misbehaving
upstream still exports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The frame's `endpoint` to gen_ai.operation.name (the conventions' well-known values).
OPERATIONS = {
    "chat.completions": "chat",
    "responses": "chat",
    "messages": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "generateContent": "generate_content",
    "streamGenerateContent": "generate_content",
    "embedContent": "embeddings",
    "batchEmbedContents": "embeddings",
}

# The frame's `provider` (and a named upstream's `azure`) to gen_ai.provider.name.
PROVIDERS = {"openai": "openai", "anthropic": "anthropic", "gemini": "gcp.gemini"}


def operation(endpoint: str) -> str:
    """The GenAI operation of an endpoint; an endpoint the conventions do not name (moderations,
    token counts) keeps its own name."""
    return OPERATIONS.get(endpoint, endpoint or "unknown")


def provider_name(provider: str, upstream: str | None) -> str:
    if upstream == "azure":
        return "azure.ai.openai"
    return PROVIDERS.get(provider, provider or "unknown")


@dataclass
class CallFacts:
    response_model: str | None = None
    response_id: str | None = None
    finish_reasons: list[str] = field(default_factory=list)


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def _objects(response: Any) -> list[dict[str, Any]]:
    """The response body, or each stream event's data, as dicts."""
    if isinstance(response, dict):
        return [response]
    if isinstance(response, list):
        out = []
        for event in response:
            data = _json(event.get("data")) if isinstance(event, dict) else None
            if isinstance(data, dict):
                out.append(data)
        return out
    return []


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _take(facts: CallFacts, obj: dict[str, Any], model_key: str, id_key: str) -> None:
    model, ident = obj.get(model_key), obj.get(id_key)
    if isinstance(model, str) and model:
        facts.response_model = model
    if isinstance(ident, str) and ident and facts.response_id is None:
        facts.response_id = ident


def _reason(facts: CallFacts, value: Any) -> None:
    if isinstance(value, str) and value:
        facts.finish_reasons.append(value)


def call_facts(endpoint: str, response: Any) -> CallFacts:
    facts = CallFacts()
    for obj in _objects(response):
        if endpoint in ("chat.completions", "completions", "embeddings"):
            _take(facts, obj, "model", "id")
            for choice in _list(obj.get("choices")):
                if isinstance(choice, dict):
                    _reason(facts, choice.get("finish_reason"))
        elif endpoint == "responses":
            # A stream's last event carries the whole response.
            body: dict[str, Any] = obj["response"] if isinstance(obj.get("response"), dict) else obj
            _take(facts, body, "model", "id")
            status = body.get("status")
            details = body.get("incomplete_details")
            if status == "completed" and obj.get("type", "response.completed").endswith(
                "completed"
            ):
                facts.finish_reasons = ["stop"]
            elif status == "incomplete":
                reason = details.get("reason") if isinstance(details, dict) else None
                facts.finish_reasons = [str(reason or "incomplete")]
        elif endpoint in ("messages",):
            body = obj["message"] if isinstance(obj.get("message"), dict) else obj
            _take(facts, body, "model", "id")
            _reason(facts, body.get("stop_reason"))
            delta = obj.get("delta")
            if isinstance(delta, dict):
                _reason(facts, delta.get("stop_reason"))
        else:  # Gemini
            _take(facts, obj, "modelVersion", "responseId")
            for candidate in _list(obj.get("candidates")):
                if isinstance(candidate, dict):
                    _reason(facts, candidate.get("finishReason"))
    return facts


# Request settings the conventions name, by the key each protocol uses.
_SETTINGS = {
    "gen_ai.request.max_tokens": ("max_tokens", "max_completion_tokens", "max_output_tokens"),
    "gen_ai.request.temperature": ("temperature",),
    "gen_ai.request.top_p": ("top_p",),
    "gen_ai.request.top_k": ("top_k",),
    "gen_ai.request.seed": ("seed",),
    "gen_ai.request.frequency_penalty": ("frequency_penalty",),
    "gen_ai.request.presence_penalty": ("presence_penalty",),
}


def request_settings(request: Any) -> dict[str, Any]:
    if not isinstance(request, dict):
        return {}
    config = request.get("generationConfig")  # Gemini nests them
    sources = [request, config] if isinstance(config, dict) else [request]
    out: dict[str, Any] = {}
    for attr, keys in _SETTINGS.items():
        for source in sources:
            for key in (*keys, _camel(keys[0])):
                value = source.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[attr] = value
    stop = request.get("stop", request.get("stop_sequences"))
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and stop:
        out["gen_ai.request.stop_sequences"] = stop
    n = request.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n != 1:
        out["gen_ai.request.choice.count"] = n
    return out


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part.title() for part in rest)
