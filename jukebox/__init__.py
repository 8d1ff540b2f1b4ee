"""Jukebox: the flight recorder and undo button for AI agents.

The Python API is loaded on first use of a name (``from jukebox import Jukebox`` or
``jukebox.Jukebox``), so ``import jukebox`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    "Jukebox": "jukebox.api.api",
    "SandboxPolicy": "jukebox.api.api",
    "Tape": "jukebox.api.api",
    "BSide": "jukebox.api.api",
    "Report": "jukebox.api.api",
    "track": "jukebox.api.api",
    "CircuitBreaker": "jukebox.guard.breaker",
    "BreakerTripped": "jukebox.guard.breaker",
    "Transaction": "jukebox.api.transaction",
    "TransactionClosed": "jukebox.api.transaction",
    "Checkpoint": "jukebox.api.transaction",
    "Outcome": "jukebox.api.transaction",
    "TxFS": "jukebox.api.transaction",
    "State": "jukebox.api.state",
    "StateVersion": "jukebox.api.state",
    "ConflictError": "shadowfs.errors",
}

__all__ = [
    "BSide",
    "BreakerTripped",
    "Checkpoint",
    "CircuitBreaker",
    "ConflictError",
    "Jukebox",
    "Outcome",
    "Report",
    "SandboxPolicy",
    "State",
    "StateVersion",
    "Tape",
    "Transaction",
    "TransactionClosed",
    "TxFS",
    "__version__",
    "track",
]

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

    from jukebox.api.api import BSide, Jukebox, Report, SandboxPolicy, Tape, track
    from jukebox.api.state import State, StateVersion
    from jukebox.api.transaction import Checkpoint, Outcome, Transaction, TransactionClosed, TxFS
    from jukebox.guard.breaker import BreakerTripped, CircuitBreaker
    from shadowfs.errors import ConflictError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jukebox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
