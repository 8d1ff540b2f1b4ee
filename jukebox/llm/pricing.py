"""What a model call cost: the maintained `genai-prices` catalogue, under the user's overrides.

Layers, later wins per model: the catalogue of the `genai-prices` package (its data ships in
the wheel, so pricing never reaches the network; jukebox never calls its auto-update), then
`prices.toml` in the tape dir, then the file named by `$JUKEBOX_PRICES`. Prices are US dollars
per million tokens.

A user's entry prices a model id that is its own name, or its name plus a dated snapshot
suffix, or (`family = true`) its name plus "-anything". The catalogue matches ids its own way
per provider (dated snapshots and aliases included, "o3-pro" never as "o3") and prices tiers
(Anthropic's long-context rates). A model neither knows falls to the table's fallback
(`--unknown-cost price=IN/OUT`), else it has no price.
"""

from __future__ import annotations

import contextlib
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

from jukebox.errors import UsageError
from jukebox.llm.defaults import PRICES_ENV, named_price_files

_FIELDS = ("input", "output", "cached_input", "cache_write", "family")
# What a provider appends to a model's name for one dated snapshot of that same model.
_SNAPSHOT = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8}|\d{4}|latest)")
# A proxy provider's name as the catalogue's provider id; a name not here lets the catalogue
# pick the provider from the model id.
_CATALOGUE_PROVIDER = {"openai": "openai", "anthropic": "anthropic", "gemini": "google"}


@dataclass(frozen=True)
class Price:
    input: float
    output: float
    cached_input: float
    cache_write: float
    family: bool = False

    def cost(self, usage: Mapping[str, int]) -> float:
        cached = usage.get("cached", 0)
        write = usage.get("cache_write", 0)
        fresh = max(usage.get("input", 0) - cached - write, 0)
        total = (
            fresh * self.input
            + cached * self.cached_input
            + write * self.cache_write
            + usage.get("output", 0) * self.output
        )
        return round(total / 1_000_000, 8)


def _parse(data: Mapping[str, Any], source: str) -> dict[str, Price]:
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise UsageError(f"{source}: [models] must be a table of model tables")
    out = {}
    for name, entry in models.items():
        if not isinstance(entry, dict) or not all(
            isinstance(entry.get(k), int | float) for k in ("input", "output")
        ):
            raise UsageError(
                f"{source}: model {name!r} needs numeric `input` and `output` prices "
                "(dollars per million tokens)"
            )
        if not isinstance(entry.get("family", False), bool):
            raise UsageError(f"{source}: model {name!r}: `family` must be true or false")
        unknown = set(entry) - set(_FIELDS)
        if unknown:
            raise UsageError(
                f"{source}: model {name!r} has unknown fields {sorted(unknown)}; "
                f"use {', '.join(_FIELDS)}"
            )
        out[name] = Price(
            input=float(entry["input"]),
            output=float(entry["output"]),
            cached_input=float(entry["cached_input" if "cached_input" in entry else "input"]),
            cache_write=float(entry["cache_write" if "cache_write" in entry else "input"]),
            family=entry.get("family", False),
        )
    return out


def _read(path: Path) -> dict[str, Price]:
    try:
        with open(path, "rb") as f:
            return _parse(tomllib.load(f), str(path))
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"the price table {path} is not valid TOML ({error}); fix it") from None
    except FileNotFoundError:
        raise UsageError(
            f"the price table {path} does not exist; fix ${PRICES_ENV} or create the file"
        ) from None


# The catalogue's token rates a call's usage counts (the proxy reports no audio, searches or
# other units, which then cost nothing), each with the usage it prices; and the one price that
# counts something the usage does not say (a fee per request).
_TOKEN_RATES = (
    ("input_mtok", "input"),
    ("cache_read_mtok", "cached"),
    ("cache_write_mtok", "cache_write"),
    ("output_mtok", "output"),
)
_PER_REQUEST = "requests_kcount"
_MTOK = Decimal(1_000_000)


@dataclass(frozen=True)
class CataloguePrice(Price):
    """A price from the `genai-prices` catalogue: its own calculation prices tiers, which the
    flat rates above (the base tier) cannot.

    Its calculation is general (units, their decomposition, validation) and takes ~0.1 ms a
    call, on the path of every response; `cost` computes the same Decimal sum directly when the
    price is only token rates, flat or tiered (tests/llm/test_pricing_fast.py checks it equals
    the catalogue's own for every model of the providers the proxy speaks)."""

    model_price: Any = None

    def cost(self, usage: Mapping[str, int]) -> float:
        fast = _token_cost(self.model_price, usage)
        if fast is not None:
            return round(float(fast), 8)
        from genai_prices.types import Usage

        counted = Usage(
            input_tokens=usage.get("input", 0),
            cache_read_tokens=usage.get("cached", 0),
            cache_write_tokens=usage.get("cache_write", 0),
            output_tokens=usage.get("output", 0),
        )
        return round(float(self.model_price.calc_price(counted)["total_price"]), 8)


def _token_cost(model_price: Any, usage: Mapping[str, int]) -> Decimal | None:
    """What the catalogue's calc_price totals for `usage`, when the price has token rates only;
    None when the catalogue must compute it (a fee per request, usage it would reject)."""
    rates = vars(model_price)
    if rates.get(_PER_REQUEST) is not None:
        return None
    prompt = usage.get("input", 0)
    counts = {key: usage.get(key, 0) for _, key in _TOKEN_RATES}
    fresh = prompt
    for attr, key in _TOKEN_RATES[1:3]:  # priced apart from input when the model has a rate
        if rates.get(attr) is not None:
            fresh -= counts[key]
    if fresh < 0 or min(counts.values()) < 0:
        return None
    counts["input"] = fresh
    total = Decimal(0)
    for attr, key in _TOKEN_RATES:
        price = rates.get(attr)
        if price is None or not counts[key]:
            continue
        if not isinstance(price, Decimal):
            base = getattr(price, "base", None)
            tiers = getattr(price, "tiers", None)
            if not isinstance(base, Decimal) or not isinstance(tiers, list):
                return None
            price = next((t.price for t in reversed(tiers) if prompt > t.start), base)
        total += price * Decimal(counts[key]) / _MTOK
    return total


def _rate(value: Any) -> float:
    """A catalogue rate as a float: its base when tiered, 0 when the model has none."""
    if value is None:
        return 0.0
    return float(getattr(value, "base", value))


@cache
def catalogue_price(
    model: str, provider: str | None, api_url: str | None = None
) -> CataloguePrice | None:
    """The catalogue's current price for `model` called at `api_url`, the upstream's base URL
    (the catalogue knows the hosts of Groq, OpenRouter, Azure, DeepSeek, ...), else at
    `provider` (a proxy provider name); None when it has none."""
    from genai_prices import data_snapshot

    snapshot = data_snapshot.get_snapshot()
    info = None
    if api_url:
        with contextlib.suppress(LookupError):  # a host it does not know: a local server
            _, info = snapshot.find_provider_model(model, None, None, api_url)
    if info is None:
        try:
            _, info = snapshot.find_provider_model(
                model, None, _CATALOGUE_PROVIDER.get(provider or ""), None
            )
        except LookupError:
            return None
    model_price = info.get_prices(datetime.now(tz=UTC))
    if model_price.input_mtok is None and model_price.output_mtok is None:
        return None  # priced per request or per second: not a token price
    return CataloguePrice(
        input=_rate(model_price.input_mtok),
        output=_rate(model_price.output_mtok),
        cached_input=_rate(model_price.cache_read_mtok or model_price.input_mtok),
        cache_write=_rate(model_price.cache_write_mtok or model_price.input_mtok),
        model_price=model_price,
    )


def warm_catalogue() -> None:
    """Loads the catalogue (about 0.2 s), so that the first priced call does not wait for it."""
    catalogue_price("gpt-4o", "openai")


class PriceTable:
    def __init__(
        self,
        prices: Mapping[str, Price],
        fallback: Price | None = None,
        catalogue: bool = True,
        upstream_urls: Mapping[str, str] | None = None,
    ) -> None:
        self.prices = dict(prices)  # the user's entries, which win over the catalogue
        self.fallback = fallback  # for a model nobody prices
        self.catalogue = catalogue
        # {provider or named upstream: base URL}: a call is priced as its host charges.
        self.upstream_urls = dict(upstream_urls or {})
        # Longest first, so the most specific entry wins.
        self._order = sorted(self.prices, key=len, reverse=True)

    @classmethod
    def shipped(cls) -> PriceTable:
        """The catalogue alone."""
        return cls({})

    @classmethod
    def load(
        cls,
        tape_dir: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> PriceTable:
        environ = os.environ if environ is None else environ
        table: dict[str, Price] = {}
        for path in named_price_files(tape_dir, environ):
            table.update(_read(Path(path)))
        return cls(table)

    def with_fallback(self, fallback: Price | None) -> PriceTable:
        return PriceTable(self.prices, fallback, self.catalogue, self.upstream_urls)

    def with_upstreams(self, upstream_urls: Mapping[str, str]) -> PriceTable:
        return PriceTable(self.prices, self.fallback, self.catalogue, upstream_urls)

    def _own(self, model: str) -> Price | None:
        if model in self.prices:
            return self.prices[model]
        for name in self._order:
            if not model.startswith(name + "-"):
                continue
            price = self.prices[name]
            if price.family or _SNAPSHOT.fullmatch(model[len(name) :]):
                return price
        return None

    def known(
        self, model: str | None, provider: str | None = None, upstream: str | None = None
    ) -> Price | None:
        """The price of `model` called through `provider`, at the named `upstream` if any (the
        fallback not considered)."""
        if not model:
            return None
        own = self._own(model)
        if own is not None or not self.catalogue:
            return own
        return catalogue_price(model, provider, self.upstream_urls.get(upstream or provider or ""))

    def lookup(
        self, model: str | None, provider: str | None = None, upstream: str | None = None
    ) -> Price | None:
        """The price of `model`: the user's, else the catalogue's, else the fallback, else None."""
        price = self.known(model, provider, upstream)
        return price if price is not None else self.fallback

    def cost(
        self,
        model: str | None,
        usage: Mapping[str, int],
        provider: str | None = None,
        upstream: str | None = None,
    ) -> float | None:
        """Dollars, or None for a model without a price."""
        price = self.lookup(model, provider, upstream)
        return price.cost(usage) if price is not None else None


def per_million(text: str) -> Price:
    """`IN/OUT` (dollars per million input and output tokens) as a Price; ValueError if not."""
    parts = text.split("/")
    values = [float(p) for p in parts]  # ValueError for anything not a number
    if len(values) != 2 or not all(v >= 0 and v != float("inf") for v in values):
        raise ValueError(text)
    return Price(values[0], values[1], values[0], values[0])
