"""Which model a fork sends each provider's calls to.

A model name belongs to one provider: sending Anthropic's calls an OpenAI model name fails them
all. A fork's model override is therefore per provider: `--model openai=gpt-4.1-mini --model
anthropic=claude-sonnet-4-5`, or a bare name, which applies to the provider of the frame forked
at (the model call at that frame, else the first one after it, else the last one before it). A
tape with no model call at all names no provider: a bare name then applies to every provider,
as every override did before overrides were per provider (and as such old fork frames say).

In a `fork` frame the override is a `{provider: model}` mapping, or a string for every provider.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from jukebox.errors import UsageError
from jukebox.llm.providers import PREFIXES

ModelOverride = str | dict[str, str]  # a string: every provider


def parse_model_options(values: Iterable[str]) -> tuple[str | None, dict[str, str]]:
    """`--model` values as (a bare name or None, {provider: model}); a UsageError when a
    provider is unknown, named twice, or there is more than one bare name."""
    bare: str | None = None
    named: dict[str, str] = {}
    for value in values:
        provider, sep, model = value.partition("=")
        if not sep:
            if bare is not None:
                raise UsageError(
                    f"--model {bare} and --model {value}: one bare model name at most (it "
                    "applies to the provider of the frame forked at); name the provider of "
                    "another with --model PROVIDER=MODEL"
                )
            bare = value
            continue
        if provider not in PREFIXES:
            raise UsageError(
                f"unknown provider {provider!r} in --model {value}: use "
                + ", ".join(f"{p}=MODEL" for p in PREFIXES)
                + ", or a bare MODEL for the provider of the frame forked at"
            )
        if not model or provider in named:
            raise UsageError(
                f"--model {value}: give each provider one non-empty model "
                f"(--model {provider}=MODEL once)"
            )
        named[provider] = model
    return bare, named


def provider_at(tape: Any, at: int) -> str | None:
    """The provider of the model call at frame `at`, else of the first one after it, else of
    the last one before it; None when the tape has no model call."""
    calls = [
        (f.seq, f.payload.get("provider"))
        for f in tape.frames
        if f.kind == "llm_turn" and f.payload.get("provider") in PREFIXES
    ]
    after = [p for seq, p in calls if seq >= at]
    before = [p for seq, p in calls if seq < at]
    return after[0] if after else before[-1] if before else None


def resolve(
    model: str | Mapping[str, str] | Iterable[str] | None, tape: Any, at: int
) -> ModelOverride | None:
    """The override a fork of `tape` at frame `at` records: `model` is a bare name (see the
    module), a {provider: model} mapping, or `--model` values (checked as
    `parse_model_options` does)."""
    if model is None:
        return None
    if isinstance(model, str):
        values: Iterable[str] = [model]
    elif isinstance(model, Mapping):
        values = [f"{p}={m}" for p, m in model.items()]
    else:
        values = model
    bare, named = parse_model_options(values)
    return combine(bare, named, tape, at)


def combine(bare: str | None, named: dict[str, str], tape: Any, at: int) -> ModelOverride | None:
    """A bare name joined to the per-provider ones, given the provider of frame `at`."""
    if bare is None:
        return dict(named) or None
    provider = provider_at(tape, at)
    if provider is None:
        if named:
            raise UsageError(
                f"--model {bare}: the tape has no model call, so a bare name names no "
                "provider; write it as PROVIDER=MODEL"
            )
        return bare
    if provider in named:
        raise UsageError(
            f"--model {bare} applies to {provider} (the provider of frame {at}), which "
            f"--model {provider}={named[provider]} names already: drop one"
        )
    return {provider: bare, **named}


def model_for(override: Any, provider: str) -> str | None:
    """The model `override` (as a fork frame records it) sends `provider`'s calls to."""
    if isinstance(override, str):
        return override
    if isinstance(override, Mapping):
        model = override.get(provider)
        return model if isinstance(model, str) else None
    return None


def describe(override: Any) -> str:
    """One line: `gpt-4.1-mini`, or `openai=gpt-4.1-mini, anthropic=claude-…`."""
    if isinstance(override, Mapping):
        return ", ".join(f"{p}={m}" for p, m in override.items())
    return str(override)


def model_label(override: Any) -> str:
    """The override as a model name where one provider is overridden (an agent turn has no
    provider to pick by), else as `describe` says it."""
    if isinstance(override, Mapping) and len(override) == 1:
        return str(next(iter(override.values())))
    return describe(override)
