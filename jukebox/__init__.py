"""Jukebox: the flight recorder and undo button for AI agents.

The Python API is loaded on first use of a name (``from jukebox import Jukebox`` or
``jukebox.Jukebox``), so ``import jukebox`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    "Jukebox": "jukebox.api",
    "SandboxPolicy": "jukebox.api",
    "Tape": "jukebox.api",
    "BSide": "jukebox.api",
    "Report": "jukebox.api",
    "track": "jukebox.api",
    "CircuitBreaker": "jukebox.breaker",
    "BreakerTripped": "jukebox.breaker",
    "Transaction": "jukebox.transaction",
    "TransactionClosed": "jukebox.transaction",
    "Checkpoint": "jukebox.transaction",
    "Outcome": "jukebox.transaction",
    "TxFS": "jukebox.transaction",
    "State": "jukebox.state",
    "StateVersion": "jukebox.state",
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

if TYPE_CHECKING:
    from jukebox.api import BSide, Jukebox, Report, SandboxPolicy, Tape, track
    from jukebox.breaker import BreakerTripped, CircuitBreaker
    from jukebox.state import State, StateVersion
    from jukebox.transaction import Checkpoint, Outcome, Transaction, TransactionClosed, TxFS
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
