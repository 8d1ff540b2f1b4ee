"""What a model call cost: a price table shipped with jukebox that users can override.

Layers, later wins per model: the shipped `jukebox/data/prices.toml`, then `prices.toml` in the
tape dir, then the file named by `$JUKEBOX_PRICES`. Prices are US dollars per million tokens.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from jukebox.errors import UsageError

PRICES_ENV = "JUKEBOX_PRICES"
TAPE_DIR_FILE = "prices.toml"
_FIELDS = ("input", "output", "cached_input", "cache_write")


@dataclass(frozen=True)
class Price:
    input: float
    output: float
    cached_input: float
    cache_write: float

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
    def __init__(self, prices: Mapping[str, Price]) -> None:
        self.prices = dict(prices)
        # Longest first, so the most specific prefix wins.
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

    def lookup(self, model: str | None) -> Price | None:
        if not model:
            return None
        if model in self.prices:
            return self.prices[model]
        for name in self._order:
            if model.startswith(name + "-"):
                return self.prices[name]
        return None

    def cost(self, model: str | None, usage: Mapping[str, int]) -> float | None:
        """Dollars, or None for a model the table does not know."""
        price = self.lookup(model)
        return price.cost(usage) if price is not None else None
