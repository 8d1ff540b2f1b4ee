"""The proxy prices a call without the catalogue's general calculation when the model has token
rates only (jukebox.llm.pricing._token_cost): it must total exactly what `genai-prices` itself
totals, for every model of the providers the proxy speaks and of the hosts most often put
behind it, flat and tiered, with and without cache traffic."""

from __future__ import annotations

from datetime import UTC, datetime

from genai_prices import data_snapshot
from genai_prices.types import Usage

from jukebox.llm.pricing import CataloguePrice, _token_cost, catalogue_price

PROVIDERS = {"openai", "anthropic", "google", "azure", "groq", "deepseek", "mistral", "perplexity"}
USAGES = [
    {"input": 0, "output": 0, "cached": 0},
    {"input": 1234, "output": 56, "cached": 0},
    {"input": 5000, "output": 700, "cached": 4096},
    {"input": 9000, "output": 10, "cached": 1000, "cache_write": 2000},
    {"input": 250_000, "output": 4000, "cached": 100_000, "cache_write": 20_000},  # past a tier
    {"input": 1, "output": 999_999, "cached": 1},
]


def catalogue_total(price: CataloguePrice, usage: dict[str, int]) -> float | None:
    counted = Usage(
        input_tokens=usage.get("input", 0),
        cache_read_tokens=usage.get("cached", 0),
        cache_write_tokens=usage.get("cache_write", 0),
        output_tokens=usage.get("output", 0),
    )
    try:
        return round(float(price.model_price.calc_price(counted)["total_price"]), 8)
    except ValueError:  # usage this model's units reject: the catalogue decides
        return None


def test_token_rates_cost_what_the_catalogue_says() -> None:
    now = datetime.now(tz=UTC)
    compared = fast = 0
    for provider in data_snapshot.get_snapshot().providers:
        if provider.id not in PROVIDERS:
            continue
        for model in provider.models:
            price = CataloguePrice(0.0, 0.0, 0.0, 0.0, model_price=model.get_prices(now))
            for usage in USAGES:
                want = catalogue_total(price, usage)
                if want is None:
                    continue
                assert price.cost(usage) == want, (provider.id, model.id, usage)
                compared += 1
                fast += _token_cost(price.model_price, usage) is not None
    assert compared > 500 and fast > compared * 0.8


def test_the_models_agents_call_take_the_direct_sum() -> None:
    for model, provider in (
        ("gpt-4o-mini", "openai"),  # flat, cache reads
        ("claude-sonnet-4-5", "anthropic"),  # tiered, cache writes
        ("gemini-2.5-pro", "gemini"),  # tiered
    ):
        price = catalogue_price(model, provider)
        assert price is not None
        usage = {"input": 300_000, "output": 10, "cached": 1000, "cache_write": 500}
        assert _token_cost(price.model_price, usage) is not None
        assert price.cost(usage) == catalogue_total(price, usage)
