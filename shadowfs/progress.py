"""How a long operation of shadowfs tells its caller how far it got.

shadowfs draws nothing: a caller that wants a progress bar passes one of these callbacks and
renders it as it likes (jukebox.display.progress does, with rich, on a terminal). An operation calls
it often and cheaply; throttling is the caller's business. None means nobody is watching.
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """``done`` units of ``total`` (paths, records, bytes: the operation says which); ``total``
    is None while it is not known yet (a tree still being scanned)."""

    def __call__(self, done: int, total: int | None, /) -> None: ...


class PhasedProgress(Protocol):
    """As Progress, for an operation made of named phases run one after the other (a commit:
    "check", "stage", "apply"); ``done`` and ``total`` count within the phase."""

    def __call__(self, phase: str, done: int, total: int, /) -> None: ...
