"""The two wire protocols: which paths are model calls, and what a call's bodies say.

The agent reaches the proxy at `/openai/v1/...` and `/anthropic/...` (the base URLs the booth
sets, after the booth's secret); everything after that prefix is appended to the upstream base
URL, confined to it (jukebox.llm.paths), so `OPENAI_BASE_URL=http://127.0.0.1:P/S/openai/v1`
and the SDK's `/chat/completions` become
`https://api.openai.com/v1/chat/completions`. The endpoints in `_ENDPOINTS` are recorded (model
calls, and the unbilled calls that inform them: moderations, Anthropic's token count); the rest
pass through, noted. Named upstreams (`--upstream NAME=URL`, jukebox.llm.upstreams) speak the
OpenAI protocol under `/upstream/NAME`; Azure OpenAI's paths (`/openai/deployments/{name}/...`,
`/openai/...`) are matched as the OpenAI endpoint they end in.

`summarize` reads a finished exchange (a JSON body or the list of stream events) into the
numbers a frame carries: model, token usage, tool calls and the text the model produced.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from jukebox.llm import gemini
from jukebox.llm.gemini import GEMINI
from jukebox.llm.paths import confine
from shadowfs.values import Record, Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

OPENAI = "openai"
ANTHROPIC = "anthropic"
PREFIXES = {OPENAI: "/openai/v1", ANTHROPIC: "/anthropic", GEMINI: "/gemini"}
DEFAULT_UPSTREAMS = {
    OPENAI: "https://api.openai.com/v1",
    ANTHROPIC: "https://api.anthropic.com",
    GEMINI: "https://generativelanguage.googleapis.com",
}
# GOOGLE_GEMINI_BASE_URL is google-genai's (and the Gemini CLI's).
BASE_URL_ENV = {
    OPENAI: "OPENAI_BASE_URL",
    ANTHROPIC: "ANTHROPIC_BASE_URL",
    GEMINI: "GOOGLE_GEMINI_BASE_URL",
}
# Other names clients read the same base URL from (same value: the SDKs' own base URL):
# OPENAI_API_BASE by langchain-openai, litellm and the pre-1.0 openai SDK; ANTHROPIC_API_URL by
# langchain-anthropic, where it wins over ANTHROPIC_BASE_URL; ANTHROPIC_API_BASE and
# GEMINI_API_BASE by litellm. A booth sets every one, or an agent reading an alias would bypass
# the proxy unrecorded.
BASE_URL_ALIASES = {
    OPENAI: ("OPENAI_API_BASE",),
    ANTHROPIC: ("ANTHROPIC_API_URL", "ANTHROPIC_API_BASE"),
    GEMINI: ("GEMINI_API_BASE",),
}


def base_url_names(provider: str) -> tuple[str, ...]:
    """Every variable naming `provider`'s base URL, the SDK's own first."""
    return (BASE_URL_ENV[provider], *BASE_URL_ALIASES[provider])


CHAT = "chat.completions"
RESPONSES = "responses"
MESSAGES = "messages"
EMBEDDINGS = "embeddings"
COMPLETIONS = "completions"  # OpenAI's legacy text completions
MODERATIONS = "moderations"
COUNT_TOKENS = "messages.count_tokens"
OTHER = "other"

_ENDPOINTS = {
    (OPENAI, "/chat/completions"): CHAT,
    (OPENAI, "/responses"): RESPONSES,
    (OPENAI, "/embeddings"): EMBEDDINGS,
    (OPENAI, "/completions"): COMPLETIONS,
    (OPENAI, "/moderations"): MODERATIONS,
    (ANTHROPIC, "/v1/messages"): MESSAGES,
    (ANTHROPIC, "/v1/messages/count_tokens"): COUNT_TOKENS,
}
# Recorded and replayed, but neither billed nor a model turn: the breaker does not count them.
UNBILLED = frozenset({MODERATIONS, COUNT_TOKENS, gemini.COUNT})
# Where named upstreams are served under the proxy's secret: `/upstream/NAME/...`.
NAMED_PREFIX = "/upstream/"


class Route(Value):
    __slots__ = FIELDS = ("provider", "endpoint", "rest", "upstream", "path")
    provider: str  # the wire protocol: OPENAI or ANTHROPIC
    endpoint: str  # a value of _ENDPOINTS, or OTHER
    rest: str  # the path and query after the provider prefix, appended to the upstream base
    upstream: str  # the upstream's name: the provider's own (the default), or a named one's
    path: str  # the decoded path the endpoint was matched on

    def __init__(
        self, provider: str, endpoint: str, rest: str, upstream: str = "", path: str = ""
    ) -> None:
        setfield(self, "provider", provider)
        setfield(self, "endpoint", endpoint)
        setfield(self, "rest", rest)
        setfield(self, "upstream", upstream or provider)
        setfield(self, "path", path)

    @property
    def recorded(self) -> bool:
        return self.endpoint != OTHER

    @property
    def billed(self) -> bool:
        """Whether the breaker admits and counts this call (a recorded, billable one)."""
        return self.recorded and self.endpoint not in UNBILLED

    @property
    def replay_endpoint(self) -> str:
        """What a replay queues this call under (jukebox.llm.replay)."""
        return replay_endpoint(self.provider, self.endpoint, self.path)

    @property
    def named(self) -> str | None:
        """The upstream's name when it is not the provider's own (recorded on the frame)."""
        return self.upstream if self.upstream != self.provider else None


def replay_endpoint(provider: str, endpoint: str, path: str | None) -> str:
    """A replay's queue for a call, beside its provider or upstream: the endpoint, and for
    Gemini the model too, which is in the path rather than the body (jukebox.llm.gemini)."""
    return gemini.replay_endpoint(endpoint, path) if provider == GEMINI else endpoint


def _openai_path(path: str) -> str:
    """An Azure OpenAI path as the OpenAI endpoint it addresses: `/openai/deployments/D/X`
    and `/openai/X` (and `/openai/v1/X`) are `/X`."""
    parts = path.split("/")
    if len(parts) > 4 and parts[1:3] == ["openai", "deployments"]:
        return "/" + "/".join(parts[4:])
    if len(parts) > 3 and parts[1:3] == ["openai", "v1"]:
        return "/" + "/".join(parts[3:])
    if len(parts) > 2 and parts[1] == "openai":
        return "/" + "/".join(parts[2:])
    return path


def route(method: str, target: str, named: Mapping[str, str] | Iterable[str] = ()) -> Route | None:
    """The provider and endpoint a request target addresses, or None if it is not ours.
    `named`: the proxy's named upstreams (`/upstream/NAME`), each name with its protocol, or
    names alone for the OpenAI protocol.

    Raises PathRefused when the path after the prefix would leave it (jukebox.llm.paths)."""
    protocols = named if isinstance(named, Mapping) else dict.fromkeys(named, OPENAI)
    prefixes = [(p, prefix, p) for p, prefix in PREFIXES.items()]
    prefixes += [
        (protocol, NAMED_PREFIX + name, name)
        for name, protocol in protocols.items()
        if name not in PREFIXES
    ]
    for provider, prefix, upstream in prefixes:
        if target == prefix or target.startswith((prefix + "/", prefix + "?")):
            rest, path = confine(target[len(prefix) :] or "/")
            endpoint = OTHER
            if method == "POST" and provider == GEMINI:
                endpoint = gemini.endpoint_of(path) or OTHER
            elif method == "POST":
                matched = _openai_path(path) if provider == OPENAI else path
                endpoint = _ENDPOINTS.get((provider, matched), OTHER)
            return Route(provider, endpoint, rest, upstream, path)
    return None


def error_body(
    provider: str, message: str, code: str = "jukebox_error", status: int = 400
) -> bytes:
    """An error in the provider's own shape, so its SDK raises it with the message intact;
    `status` is the HTTP status it goes with (Google's shape repeats it)."""
    if provider == GEMINI:
        return gemini.error_body(message, code, status)
    if provider == ANTHROPIC:
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
    else:
        body = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    return json.dumps(body).encode()


# --------------------------------------------------------------------------- summaries


class Summary(Record):
    __slots__ = FIELDS = (
        "model", "input", "output", "cached", "cache_write", "tool_calls", "text", "reported"
    )  # fmt: skip

    def __init__(
        self,
        model: str | None = None,
        input: int = 0,  # every prompt token, cached or not
        output: int = 0,
        cached: int = 0,  # prompt tokens read from the provider's cache
        cache_write: int = 0,  # prompt tokens written to the cache (Anthropic bills them apart)
        tool_calls: list[dict[str, Any]] | None = None,
        text: str = "",
        # The upstream said how many tokens (else jukebox.llm.usage estimates).
        reported: bool = False,
    ) -> None:
        self.model = model
        self.input = input
        self.output = output
        self.cached = cached
        self.cache_write = cache_write
        self.tool_calls: list[dict[str, Any]] = [] if tool_calls is None else tool_calls
        self.text = text
        self.reported = reported

    def usage(self) -> dict[str, int]:
        out = {"input": self.input, "output": self.output, "cached": self.cached}
        if self.cache_write:
            out["cache_write"] = self.cache_write
        return out


def _args(value: Any) -> Any:
    """Tool arguments as a JSON value when they parse, else as the string the model wrote."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except ValueError:
            return value
    return value


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def summarize(
    provider: str,
    endpoint: str,
    request: Any,
    response: Any = None,
    events: list[Any] | None = None,
) -> Summary:
    """Reads a JSON response (`response`) or a stream (`events`: parsed data of each event)."""
    s = Summary()
    try:
        if endpoint == CHAT:
            _chat(s, response, events)
        elif endpoint == RESPONSES:
            _responses(s, response, events)
        elif endpoint == MESSAGES:
            _messages(s, response, events)
        elif endpoint == COMPLETIONS:
            _completions(s, response, events)
        elif endpoint == EMBEDDINGS:
            _embeddings(s, response)
        elif provider == GEMINI:
            gemini.summarize(s, endpoint, response, events)
        elif endpoint in UNBILLED:
            s.model = response.get("model") if isinstance(response, dict) else None
            s.reported = True  # nothing billed: no tokens to estimate either
    except (AttributeError, TypeError, KeyError, IndexError):
        pass  # a malformed upstream body: record what was understood, never fail the call
    if s.model is None and isinstance(request, dict) and isinstance(request.get("model"), str):
        s.model = request["model"]
    return s


def _chat(s: Summary, response: Any, events: list[Any] | None) -> None:
    if events is None:
        if not isinstance(response, dict):
            return
        s.model = response.get("model")
        _chat_usage(s, response.get("usage"))
        for choice in response.get("choices") or []:
            message = choice.get("message") or {}
            if isinstance(message.get("content"), str):
                s.text += message["content"]
            for call in message.get("tool_calls") or []:
                fn = call.get("function") or {}
                s.tool_calls.append(
                    {"name": fn.get("name"), "arguments": _args(fn.get("arguments"))}
                )
        return
    calls: dict[tuple[int, int], dict[str, Any]] = {}
    for data in events:
        if not isinstance(data, dict):
            continue
        s.model = data.get("model") or s.model
        _chat_usage(s, data.get("usage"))
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                s.text += delta["content"]
            for part in delta.get("tool_calls") or []:
                key = (choice.get("index", 0), part.get("index", 0))
                call = calls.setdefault(key, {"name": None, "arguments": ""})
                fn = part.get("function") or {}
                if fn.get("name"):
                    call["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    call["arguments"] += fn["arguments"]
    for key in sorted(calls):
        s.tool_calls.append(
            {"name": calls[key]["name"], "arguments": _args(calls[key]["arguments"])}
        )


def _completions(s: Summary, response: Any, events: list[Any] | None) -> None:
    """Legacy text completions: `choices[].text`, whole or one delta per chunk; usage as chat."""
    for data in [response] if events is None else events:
        if not isinstance(data, dict):
            continue
        s.model = data.get("model") or s.model
        _chat_usage(s, data.get("usage"))
        for choice in data.get("choices") or []:
            if isinstance(choice.get("text"), str):
                s.text += choice["text"]


def _embeddings(s: Summary, response: Any) -> None:
    if isinstance(response, dict):
        s.model = response.get("model")
        _chat_usage(s, response.get("usage"))


def _chat_usage(s: Summary, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    s.reported = True
    s.input = _int(usage.get("prompt_tokens"))
    s.output = _int(usage.get("completion_tokens"))
    s.cached = _int((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))


def _responses(s: Summary, response: Any, events: list[Any] | None) -> None:
    if events is not None:
        final = None
        text = []
        for data in events:
            if not isinstance(data, dict):
                continue
            kind = data.get("type", "")
            if kind in ("response.completed", "response.incomplete", "response.failed"):
                final = data.get("response")
            elif kind == "response.created" and final is None:
                s.model = (data.get("response") or {}).get("model")
            elif kind == "response.output_text.delta" and isinstance(data.get("delta"), str):
                text.append(data["delta"])
            elif kind == "response.output_item.done":
                _response_item(s, data.get("item") or {}, with_text=False)
        if final is None:
            s.text = "".join(text)
            return
        s.tool_calls.clear()
        response = final
    if not isinstance(response, dict):
        return
    s.model = response.get("model") or s.model
    usage = response.get("usage")
    if isinstance(usage, dict):
        s.reported = True
        s.input = _int(usage.get("input_tokens"))
        s.output = _int(usage.get("output_tokens"))
        s.cached = _int((usage.get("input_tokens_details") or {}).get("cached_tokens"))
    for item in response.get("output") or []:
        _response_item(s, item, with_text=True)


def _response_item(s: Summary, item: dict[str, Any], *, with_text: bool) -> None:
    kind = item.get("type")
    if kind == "function_call":
        s.tool_calls.append({"name": item.get("name"), "arguments": _args(item.get("arguments"))})
    elif kind == "custom_tool_call":
        s.tool_calls.append({"name": item.get("name"), "arguments": item.get("input")})
    elif kind == "message" and with_text:
        for part in item.get("content") or []:
            if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                s.text += part["text"]


def _messages(s: Summary, response: Any, events: list[Any] | None) -> None:
    if events is None:
        if not isinstance(response, dict):
            return
        s.model = response.get("model")
        _anthropic_usage(s, response.get("usage"))
        for block in response.get("content") or []:
            if block.get("type") == "text":
                s.text += block.get("text") or ""
            elif block.get("type") in ("tool_use", "server_tool_use"):
                s.tool_calls.append({"name": block.get("name"), "arguments": block.get("input")})
        return
    blocks: dict[int, dict[str, Any]] = {}
    for data in events:
        if not isinstance(data, dict):
            continue
        kind = data.get("type")
        if kind == "message_start":
            message = data.get("message") or {}
            s.model = message.get("model")
            _anthropic_usage(s, message.get("usage"))
        elif kind == "content_block_start":
            block = dict(data.get("content_block") or {})
            block["partial"] = ""
            blocks[data.get("index", 0)] = block
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            block = blocks.setdefault(data.get("index", 0), {"type": "text", "partial": ""})
            if delta.get("type") == "text_delta":
                s.text += delta.get("text") or ""
            elif delta.get("type") == "input_json_delta":
                block["partial"] += delta.get("partial_json") or ""
        elif kind == "message_delta":
            _anthropic_usage(s, data.get("usage"), partial=True)
    for index in sorted(blocks):
        block = blocks[index]
        if block.get("type") in ("tool_use", "server_tool_use"):
            args = _args(block["partial"]) if block["partial"] else block.get("input") or {}
            s.tool_calls.append({"name": block.get("name"), "arguments": args})


def _anthropic_usage(s: Summary, usage: Any, partial: bool = False) -> None:
    """Anthropic's input_tokens excludes cache reads and writes; ours counts every prompt token.

    message_delta carries cumulative counts, sometimes only output_tokens: absent fields keep
    what message_start said.
    """
    if not isinstance(usage, dict):
        return
    s.reported = True
    fresh = usage.get("input_tokens")
    read = usage.get("cache_read_input_tokens")
    write = usage.get("cache_creation_input_tokens")
    if not partial or any(isinstance(v, int) for v in (fresh, read, write)):
        base = s.input - s.cached - s.cache_write
        fresh_n = _int(fresh) if isinstance(fresh, int) or not partial else base
        s.cached = _int(read) if isinstance(read, int) or not partial else s.cached
        s.cache_write = _int(write) if isinstance(write, int) or not partial else s.cache_write
        s.input = fresh_n + s.cached + s.cache_write
    if isinstance(usage.get("output_tokens"), int):
        s.output = usage["output_tokens"]
