"""Named upstreams: more than one model server per protocol behind one proxy.

`jukebox booth run --upstream local=http://127.0.0.1:11434/v1` adds an upstream named `local`
(an OpenAI-compatible server: Ollama, vLLM, OpenRouter, Groq, ...). The proxy serves it under
`/<secret>/upstream/local`, and the agent finds that base URL in
`$JUKEBOX_UPSTREAM_LOCAL_BASE_URL` (the SDK appends `/chat/completions` as usual). Its calls are
recorded with `upstream: "local"` on the frame and replay offline from their own queue.

`azure` is a name like any other, except that the agent's `AZURE_OPENAI_ENDPOINT` is pointed at
it too, and that it is added by itself when the supervisor's `AZURE_OPENAI_ENDPOINT` is set: the
openai SDK's `AzureOpenAI` client then goes through the proxy without a change. Its paths
(`/openai/deployments/{name}/chat/completions?api-version=...`) are recorded as the OpenAI
endpoint they end in (jukebox.llm.providers).

A URL written `anthropic+https://...` (or `gemini+...`) names a server speaking that protocol
instead (an Anthropic-compatible gateway): the agent's SDK takes the same base URL, and the
calls are recorded as that provider's. `openai=URL` and `anthropic=URL` replace the built-in
upstreams (as `OPENAI_BASE_URL` and `ANTHROPIC_BASE_URL` in the supervisor's environment do).

`$JUKEBOX_UPSTREAMS` holds the same `NAME=URL` words (separated by spaces or commas) for every
proxy the environment starts: `booth run`, and the live calls of `replay --until` and `fork
--exec`, which otherwise have no URL for a named upstream (the tape keeps only its name). The
agent's copy names the proxy's URLs instead, so it cannot reach an upstream around the proxy.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from jukebox.errors import UsageError
from jukebox.llm.providers import DEFAULT_UPSTREAMS, NAMED_PREFIX, OPENAI

AZURE = "azure"
AZURE_ENDPOINT_ENV = "AZURE_OPENAI_ENDPOINT"
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
# Where a replay's named upstreams point: nothing listens on the discard port, so a call that
# would go live there (a bug) fails instead of reaching anything.
OFFLINE_URL = "http://127.0.0.1:9"
# The `note` frame a proxy with named upstreams writes first: a replay exposes the same names.
NOTE_EVENT = "llm_upstreams"
LIST_ENV = "JUKEBOX_UPSTREAMS"


class BadUpstream(UsageError, ValueError):
    """A `--upstream` value that cannot be used; the message says what to write instead."""


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise BadUpstream(
            f"bad upstream name {name!r}: use lower-case letters, digits and _, starting with "
            "a letter (like local or openrouter)"
        )
    return name


def split(value: str) -> tuple[str, str]:
    """An upstream's value as (its protocol, its URL): `anthropic+https://x` is Anthropic's."""
    protocol, sep, url = value.partition("+")
    if sep and protocol in DEFAULT_UPSTREAMS and url.startswith(("http://", "https://")):
        return protocol, url
    return OPENAI, value


def parse(spec: str) -> tuple[str, str]:
    """`NAME=URL` as (name, URL without a trailing slash, its protocol prefix kept)."""
    name, sep, value = spec.partition("=")
    if not sep:
        raise BadUpstream(
            f"bad --upstream {spec!r}: write NAME=URL, like local=http://127.0.0.1:11434/v1"
        )
    if not split(value)[1].startswith(("http://", "https://")):
        raise BadUpstream(
            f"bad --upstream {spec!r}: the URL must start with http:// or https:// (or "
            "anthropic+https:// for an Anthropic-compatible server), like "
            "http://127.0.0.1:11434/v1"
        )
    return check_name(name.strip()), value.rstrip("/")


def with_named(
    upstreams: Mapping[str, str], specs: Iterable[str], environ: Mapping[str, str]
) -> dict[str, str]:
    """`upstreams` (the built-in ones) plus `azure` from the environment's AZURE_OPENAI_ENDPOINT,
    the `NAME=URL` words of its JUKEBOX_UPSTREAMS, and those of `specs`, later ones winning."""
    out = dict(upstreams)
    azure = environ.get(AZURE_ENDPOINT_ENV)
    if azure and azure.startswith(("http://", "https://")):
        out[AZURE] = azure.rstrip("/")
    listed = environ.get(LIST_ENV, "").replace(",", " ").split()
    for spec in [*listed, *specs]:
        name, url = parse(spec)
        out[name] = url
    return out


def named(upstreams: Mapping[str, str]) -> list[str]:
    """The names that are not a built-in provider's."""
    return sorted(name for name in upstreams if name not in DEFAULT_UPSTREAMS)


def env_name(name: str) -> str:
    return f"JUKEBOX_UPSTREAM_{name.upper()}_BASE_URL"


def agent_env(proxy_url: str, protocols: Mapping[str, str]) -> dict[str, str]:
    """The variables that point the agent at each named upstream (name: protocol) through the
    proxy."""
    out = {}
    listed = []
    for name, protocol in sorted(protocols.items()):
        url = proxy_url + NAMED_PREFIX + name
        out[env_name(name)] = url
        if name == AZURE:
            out[AZURE_ENDPOINT_ENV] = url
        listed.append(f"{name}={'' if protocol == OPENAI else protocol + '+'}{url}")
    out[LIST_ENV] = " ".join(listed)
    return out
