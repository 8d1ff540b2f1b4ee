"""API keys for runs that never need a real one: replays and the replayed prefix of a fork.

The SDKs refuse to start without a key (`openai.OpenAIError: The api_key client option must be
set`), so an offline replay of an agent that read its key from the environment would die before
its first call. Such a run gets a placeholder in each key variable the caller left unset. It is
no key of any provider (theirs start `sk-`), and the proxy drops every header carrying it, so it
never leaves the machine: a live call of `replay --until` or `fork --exec` goes without one.
"""

from __future__ import annotations

from collections.abc import Mapping

from jukebox.llm.providers import ANTHROPIC, OPENAI

PLACEHOLDER_KEY = "jukebox-replay-placeholder-not-an-api-key"
KEY_ENV = {OPENAI: "OPENAI_API_KEY", ANTHROPIC: "ANTHROPIC_API_KEY"}
# Read by the openai SDK's AzureOpenAI client (a named upstream `azure`, jukebox.llm.upstreams)
# and by google-genai and litellm for Gemini (google-genai also reads GOOGLE_API_KEY first).
OTHER_KEY_ENV = ("AZURE_OPENAI_API_KEY", "GEMINI_API_KEY")


def placeholder_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The placeholder for each provider's key variable that `environ` lacks or leaves empty."""
    names = (*KEY_ENV.values(), *OTHER_KEY_ENV)
    return {name: PLACEHOLDER_KEY for name in names if not environ.get(name)}


def carries_placeholder(header_value: str) -> bool:
    """Whether a request header holds the placeholder (`Bearer …`, `x-api-key: …`)."""
    return PLACEHOLDER_KEY in header_value
