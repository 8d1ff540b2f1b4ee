"""The circuit breaker's rules for tool calls: `--max-tool-calls N` (at most N calls in all) and
`--max-tool-repeat N` (stop at the Nth identical call in a row: same server, tool and arguments,
an agent stuck in a loop). A trip is a jukebox.guard.breaker.Trip, recorded as a `breaker` frame."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from jukebox.errors import UsageError
from jukebox.guard.breaker import Trip


@dataclass
class ToolCallLimits:
    max_calls: int | None = None
    max_repeat: int | None = None
    calls: int = 0
    _last: str | None = None
    _run: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.max_calls is not None and self.max_calls < 1:
            raise UsageError("--max-tool-calls must be at least 1")
        if self.max_repeat is not None and self.max_repeat < 2:
            raise UsageError("--max-tool-repeat must be at least 2")

    @property
    def active(self) -> bool:
        return self.max_calls is not None or self.max_repeat is not None

    def limits(self) -> dict[str, Any]:
        return {"max_tool_calls": self.max_calls, "max_tool_repeat": self.max_repeat}

    def observe(self, server: str, tool: str, args: Any) -> Trip | None:
        """Counts one call about to run; the Trip if it breaks a rule (it must not run)."""
        signature = json.dumps([server, tool, args], sort_keys=True, default=str)
        with self._lock:
            self.calls += 1
            self._run = self._run + 1 if signature == self._last else 1
            self._last = signature
            if self.max_calls is not None and self.calls > self.max_calls:
                return Trip("max_tool_calls", self.max_calls, self.calls,
                            f"tool call {self.calls} ({server}/{tool}) is past --max-tool-calls "
                            f"{self.max_calls}")  # fmt: skip
            if self.max_repeat is not None and self._run >= self.max_repeat:
                return Trip("max_tool_repeat", self.max_repeat, self._run,
                            f"{server}/{tool} was called {self._run} times in a row with the "
                            f"same arguments (--max-tool-repeat {self.max_repeat})")  # fmt: skip
        return None
