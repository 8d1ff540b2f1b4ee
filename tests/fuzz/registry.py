"""Every fuzz target, by name. Importing a harness module imports the code it fuzzes, so the
atheris worker imports this only inside `atheris.instrument_imports()`."""

from __future__ import annotations

import importlib

from tests.fuzz.common import Target

MODULES = ("fuzz_tape", "fuzz_tree", "fuzz_store", "fuzz_control", "fuzz_llm", "fuzz_sql")


def _canary(data: bytes) -> None:
    # Proves the runner turns an exception into a failure (the short tests run it on purpose).
    raise IndexError("the canary target fails on every input")


CANARY = Target("canary", _canary, lambda: [b"x"], "always fails; for testing the runner")


def all_targets(include_canary: bool = False) -> dict[str, Target]:
    targets: dict[str, Target] = {}
    for name in MODULES:
        module = importlib.import_module(f"tests.fuzz.{name}")
        for t in module.TARGETS:
            targets[t.name] = t
    if include_canary:
        targets[CANARY.name] = CANARY
    return targets
