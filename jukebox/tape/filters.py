"""Which tapes `jukebox ls` lists: `--status`, `--since`, `--agent`.

* `--status S` (repeatable): the status `ls` shows, PENDING included, case aside;
* `--since WHEN`: tapes started at or after WHEN, an age (`30m`, `2h`, `7d`, `2w`: that long
  ago) or an ISO 8601 date or time (`2026-12-01`, `2026-12-01T09:30`, with a zone or in local
  time); a tape with no readable start is left out;
* `--agent TEXT`: tapes whose recorded command (run_start's argv, or the Python API's function)
  or agent name holds TEXT, case aside.

All given filters must hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jukebox.errors import UsageError

LS_STATUSES = (
    "committed", "pending", "discarded", "rolled_back", "exited", "running", "damaged",
    "unreadable",
)  # fmt: skip


def parse_since(text: str, now: float | None = None) -> float:
    """``text`` as a moment (seconds since the epoch): an age back from ``now``, or an ISO date."""
    from jukebox.tape.removal import parse_duration

    now = time.time() if now is None else now
    stripped = text.strip()
    if stripped[:1].isdigit() and stripped[-1:].isalpha() and "-" not in stripped:
        return now - parse_duration(stripped)
    try:
        moment = datetime.fromisoformat(stripped)
    except ValueError:
        raise UsageError(
            f"--since {text!r} is neither an age nor a date: write like 30m, 2h, 7d, 2w, or "
            "2026-12-01, 2026-12-01T09:30"
        ) from None
    return moment.timestamp()  # a time without a zone is local, as `ls` prints them


def command_of(start: dict[str, Any]) -> str:
    """What run_start says was run: its argv, or the API's function."""
    argv = start.get("argv")
    if isinstance(argv, list):
        return " ".join(map(str, argv))
    function = start.get("function")
    return function if isinstance(function, str) else ""


@dataclass(frozen=True)
class TapeFilter:
    statuses: frozenset[str] = frozenset()
    since: float | None = None
    agent: str | None = None

    @classmethod
    def from_options(
        cls, statuses: tuple[str, ...], since: str | None, agent: str | None
    ) -> TapeFilter:
        return cls(
            frozenset(s.upper() for s in statuses),
            parse_since(since) if since is not None else None,
            agent.casefold() if agent else None,
        )

    @property
    def active(self) -> bool:
        return bool(self.statuses) or self.since is not None or self.agent is not None

    def matches(self, row: dict[str, Any], start: dict[str, Any] | None) -> bool:
        """``row`` is an `ls` row; ``start`` the tape's run_start payload, if it was read."""
        if self.statuses and row.get("status") not in self.statuses:
            return False
        if self.since is not None:
            started = row.get("started_ns")
            if not isinstance(started, int) or started / 1e9 < self.since:
                return False
        if self.agent is not None:
            start = start or {}
            name = start.get("name") if isinstance(start.get("name"), str) else ""
            if self.agent not in f"{command_of(start)}\n{name}".casefold():
                return False
        return True


def run_start_of(tape: Any) -> dict[str, Any] | None:
    """The first frame's payload when it is a run_start that decodes, else None."""
    from jukebox.tape.errors import TamperedTape

    try:
        first = tape.intact_frames[0] if tape.intact_frames else None
        if first is None or first.kind != "run_start":
            return None
        return first.payload
    except TamperedTape:
        return None
