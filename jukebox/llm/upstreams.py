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
from jukebox.llm.providers import DEFAULT_UPSTREAMS, NAMED_PREFIX, OPENAI, PREFIXES, base_url_names

AZURE = "azure"
AZURE_ENDPOINT_ENV = "AZURE_OPENAI_ENDPOINT"
_NAME = r"[a-z][a-z0-9_]{0,31}"  # compiled at first use: most booths name no upstream
# Where a replay's named upstreams point: nothing listens on the discard port, so a call that
# would go live there (a bug) fails instead of reaching anything.
OFFLINE_URL = "http://127.0.0.1:9"
# The `note` frame a proxy with named upstreams writes first: a replay exposes the same names.
NOTE_EVENT = "llm_upstreams"
LIST_ENV = "JUKEBOX_UPSTREAMS"


class BadUpstream(UsageError, ValueError):
    """A `--upstream` value that cannot be used; the message says what to write instead."""


def check_name(name: str) -> str:
    if not re.fullmatch(_NAME, name):
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


def upstreams_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The user's own base URLs (the SDK's variable, else an alias) become the upstreams; the
    providers' public APIs otherwise; and `azure` when AZURE_OPENAI_ENDPOINT is set, so a
    replay's or fork's live calls reach it too."""
    out = {}
    for provider, default in DEFAULT_UPSTREAMS.items():
        urls = (environ.get(name) for name in base_url_names(provider))
        out[provider] = (next((url for url in urls if url), None) or default).rstrip("/")
    return with_named(out, (), environ)


def resolve(
    upstreams: Mapping[str, str], replay_protocols: Mapping[str, str] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """What a proxy serves: (every upstream's plain URL, the protocol of each named one).

    A built-in provider missing from `upstreams` gets its public API, or OFFLINE_URL in a
    replay (`replay_protocols` given: the names the tape used, each served offline when not
    configured). Raises BadUpstream for a bad name."""
    out = dict(upstreams)
    for provider, default in DEFAULT_UPSTREAMS.items():
        # A caller's mapping may predate a provider: a replay's then reaches nothing.
        out.setdefault(provider, OFFLINE_URL if replay_protocols is not None else default)
    protocols: dict[str, str] = {}
    for name in named(out):
        protocols[name], out[name] = split(out[check_name(name)])
    for name, protocol in (replay_protocols or {}).items():
        if name not in out:
            out[name], protocols[name] = OFFLINE_URL, protocol
    return out, protocols


def proxy_env(proxy_url: str, protocols: Mapping[str, str]) -> dict[str, str]:
    """The environment that points an agent's SDKs at a proxy whose root (secret included) is
    `proxy_url`: every base-URL variable a popular client reads, and the named upstreams."""
    out = {name: proxy_url + prefix for p, prefix in PREFIXES.items() for name in base_url_names(p)}
    out.update(agent_env(proxy_url, protocols))
    return out
