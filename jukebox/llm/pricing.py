"""What a model call cost: a price table shipped with jukebox that users can override.

Layers, later wins per model: the shipped `jukebox/data/prices.toml`, then `prices.toml` in the
tape dir, then the file named by `$JUKEBOX_PRICES`. Prices are US dollars per million tokens.

A model id is priced by its own entry, else by the longest entry it extends with a dated
snapshot suffix, else by the longest `family = true` entry it extends with "-anything"; else
by the table's fallback (`--unknown-cost price=IN/OUT`), else it has no price. Bare prefix
matching priced "o3-pro" as "o3", ten times too low.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from jukebox.errors import UsageError

PRICES_ENV = "JUKEBOX_PRICES"
TAPE_DIR_FILE = "prices.toml"
_FIELDS = ("input", "output", "cached_input", "cache_write", "family")
# What a provider appends to a model's name for one dated snapshot of that same model.
_SNAPSHOT = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8}|\d{4}|latest)")


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
            cached_input=float(entry.get("cached_input", entry["input"])),
            cache_write=float(entry.get("cache_write", entry["input"])),
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


class PriceTable:
    def __init__(self, prices: Mapping[str, Price], fallback: Price | None = None) -> None:
        self.prices = dict(prices)
        self.fallback = fallback  # for a model the table does not know
        # Longest first, so the most specific entry wins.
        self._order = sorted(self.prices, key=len, reverse=True)

    @classmethod
    def shipped(cls) -> PriceTable:
        text = resources.files("jukebox").joinpath("data/prices.toml").read_text()
        return cls(_parse(tomllib.loads(text), "jukebox/data/prices.toml"))

    @classmethod
    def load(
        cls,
        tape_dir: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> PriceTable:
        environ = os.environ if environ is None else environ
        table = cls.shipped().prices
        if tape_dir is not None and (Path(tape_dir) / TAPE_DIR_FILE).is_file():
            table.update(_read(Path(tape_dir) / TAPE_DIR_FILE))
        if environ.get(PRICES_ENV):
            table.update(_read(Path(environ[PRICES_ENV])))
        return cls(table)

    def with_fallback(self, fallback: Price | None) -> PriceTable:
        return PriceTable(self.prices, fallback)

    def known(self, model: str | None) -> Price | None:
        """The table's own price for `model` (the fallback not considered)."""
        if not model:
            return None
        if model in self.prices:
            return self.prices[model]
        for name in self._order:
            if not model.startswith(name + "-"):
                continue
            price = self.prices[name]
            if price.family or _SNAPSHOT.fullmatch(model[len(name) :]):
                return price
        return None

    def lookup(self, model: str | None) -> Price | None:
        """The price of `model`: the table's, else the fallback, else None."""
        price = self.known(model)
        return price if price is not None else self.fallback

    def cost(self, model: str | None, usage: Mapping[str, int]) -> float | None:
        """Dollars, or None for a model without a price."""
        price = self.lookup(model)
        return price.cost(usage) if price is not None else None


def per_million(text: str) -> Price:
    """`IN/OUT` (dollars per million input and output tokens) as a Price; ValueError if not."""
    parts = text.split("/")
    values = [float(p) for p in parts]  # ValueError for anything not a number
    if len(values) != 2 or not all(v >= 0 and v != float("inf") for v in values):
        raise ValueError(text)
    return Price(values[0], values[1], values[0], values[0])
