"""Telemetry: what agent libraries send about a run to somewhere other than the model.

Two kinds reach us:

* through the proxy: versions of the OpenAI Agents SDK that derive their trace endpoint from
  `OPENAI_BASE_URL` post their traces (every prompt, output and tool argument, with the agent's
  API key) to `$OPENAI_BASE_URL/traces/ingest`, so the booth's proxy sees them. They are not
  a model call: recording passes them on (the user's dashboard still gets them) with one
  warning line and a `note` frame; a replay answers them itself, so they neither leave the
  machine nor fail the replay.
* around it: libraries that call their own hosts directly (the Agents SDK versions whose trace
  endpoint is fixed at api.openai.com, LangSmith tracing, litellm's price map fetched at import,
  OpenTelemetry exporters). The proxy never sees those; the booth warns before the agent starts
  about the environment that turns them on, and under `--net none` names the hosts the agent
  looks up (jukebox.llm.lookups).

docs/llm-proxy.md ("Telemetry") lists, for users, what turns each known sender off.
"""

from __future__ import annotations

from collections.abc import Mapping

from jukebox.llm.providers import OPENAI
from shadowfs.values import Value, setfield


class Source(Value):
    __slots__ = FIELDS = ("who", "off")
    who: str  # the library, as a user knows it
    off: str  # the setting that turns it off

    def __init__(self, who: str, off: str) -> None:
        setfield(self, "who", who)
        setfield(self, "off", off)


AGENTS_TRACES = Source("the OpenAI Agents SDK's tracing", "OPENAI_AGENTS_DISABLE_TRACING=1")

# (provider, decoded path after the prefix) of telemetry endpoints that come through the proxy.
_THROUGH_PROXY = {(OPENAI, "/traces/ingest"): AGENTS_TRACES}
# The Agents SDK's model calls say who they are; its tracing is on unless this variable is set.
_AGENTS_USER_AGENT = "agents/python"
_AGENTS_OFF_ENV = "OPENAI_AGENTS_DISABLE_TRACING"

_TRUE = ("1", "true", "yes", "on")

# (variable, whether any value turns it on, who sends, what turns it off), for the warning
# before the agent starts: the proxy cannot see these senders.
_AROUND_PROXY = (
    ("LANGSMITH_TRACING", False, "LangSmith tracing", "LANGSMITH_TRACING=false"),
    ("LANGCHAIN_TRACING_V2", False, "LangSmith tracing", "LANGCHAIN_TRACING_V2=false"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", True, "an OpenTelemetry exporter", "OTEL_SDK_DISABLED=true"),
    ("LANGFUSE_PUBLIC_KEY", True, "Langfuse tracing", "unsetting LANGFUSE_PUBLIC_KEY"),
)


def through_proxy(provider: str, path: str) -> Source | None:
    """The telemetry sender a request through the proxy comes from, if it is one we know."""
    return _THROUGH_PROXY.get((provider, path.rstrip("/") or "/"))


def tracing_client(headers: list[tuple[str, str]], env: Mapping[str, str]) -> str | None:
    """The warning for a model call from the Agents SDK while its tracing is on (`env`: the
    agent's environment), else None. Versions such as 0.24 post traces to api.openai.com
    directly, where the proxy never sees them."""
    agent = next((v for k, v in headers if k.lower() == "user-agent"), "")
    if not agent.lower().startswith(_AGENTS_USER_AGENT):
        return None
    if env.get(_AGENTS_OFF_ENV, "").strip().lower() in _TRUE:
        return None
    return (
        f"warning: the agent uses the OpenAI Agents SDK ({agent}), whose tracing sends the "
        "run's prompts and outputs to OpenAI with the agent's API key, not onto the tape "
        "(versions that post to api.openai.com directly bypass the proxy: under --net none "
        f"they fail); set {AGENTS_TRACES.off} to stop them"
    )


def proxy_warning(source: Source, upstream_origin: str, replaying: bool) -> str:
    where = (
        "a replay answers them itself, so they never leave"
        if replaying
        else f"they go to {upstream_origin} with the agent's API key and are not on the tape"
    )
    return (
        f"warning: {source.who} sends the run's prompts and outputs as traces; {where}; "
        f"set {source.off} to stop them"
    )


def environment_warnings(env: Mapping[str, str], offline: bool) -> list[str]:
    """One line per sender the agent's environment turns on that bypasses the proxy."""
    out = []
    seen = set()
    for name, any_value, who, off in _AROUND_PROXY:
        value = env.get(name, "")
        on = bool(value) if any_value else value.strip().lower() in _TRUE
        if not on or who in seen:
            continue
        seen.add(who)
        fate = (
            "under --net none they fail (and may slow the agent with retries)"
            if offline
            else "they leave the booth directly, unrecorded"
        )
        out.append(
            f"warning: {name} turns on {who}, which sends the run's data to its own servers, "
            f"not through the proxy: {fate}; set {off} to stop it"
        )
    return out
