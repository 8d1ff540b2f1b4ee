"""Progress of jukebox's long steps, and how talkative a command is.

A long step (hashing the base tree at booth start, a commit, gc, replaying a big tape) runs
inside ``with step("hashing the tree") as tick:`` and hands ``tick`` (or ``tick.phased``) to
the shadowfs operation as its progress callback (shadowfs.progress). What the person sees
depends on the level the command set once at its start (``configure``):

* a bar on stderr, drawn with rich, only when stderr is a terminal and the level is not quiet;
  it appears once a step has lasted ``SHOW_AFTER_S`` (a quick step draws nothing, and rich is
  not even imported) and is erased when the step ends, so what follows starts on a clean line;
* with --verbose, one line per finished step on stderr ("hashed the tree: 1234 entries in
  0.80s"), terminal or not;
* with --quiet, no bar and no notes (``note``): only results, warnings and errors.

Outside the CLI (the Python API) nothing is drawn until a caller configures it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

QUIET, NORMAL, VERBOSE = -1, 0, 1
SHOW_AFTER_S = 0.3
# How long a step lasts before its bar shows, in seconds, if not SHOW_AFTER_S (0: at once).
DELAY_ENV = "JUKEBOX_PROGRESS_DELAY"
REDRAW_EVERY_S = 0.1


class _Settings:
    level = NORMAL
    draw = False  # bars at all (the CLI turns them on)
    color = True


_settings = _Settings()


def configure(*, level: int, draw: bool, color: bool) -> None:
    _settings.level, _settings.draw, _settings.color = level, draw, color


def level() -> int:
    return _settings.level


def drawing() -> bool:
    return _settings.draw


def coloured() -> bool:
    return _settings.color


def note(message: str) -> None:
    """An informational line on stderr ("committed 3 changes to ..."); --quiet drops it."""
    if _settings.level > QUIET:
        _write(message)


def detail(message: str) -> None:
    """A line only --verbose shows."""
    if _settings.level >= VERBOSE:
        _write(message)


def _write(message: str) -> None:
    # Printable ASCII is what `printable` gives back unchanged (its str.isprintable() is true
    # for 0x20-0x7e and nothing else below 0x80): a booth's last line ("no changes to commit")
    # then needs neither jukebox.display.names nor its unicodedata, about 1 ms of its end.
    if not (message.isascii() and message.isprintable()):
        from jukebox.display.names import printable

        message = printable(message)
    sys.stderr.write(f"jukebox: {message}\n")
    sys.stderr.flush()


def _stderr_is_terminal() -> bool:
    try:
        return os.isatty(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False


def _show_after() -> float:
    try:
        return max(0.0, float(os.environ.get(DELAY_ENV, SHOW_AFTER_S)))
    except ValueError:
        return SHOW_AFTER_S


class Step:
    """The callback a long step hands to shadowfs; it draws (or not) what it is told. A step
    that cannot count (``counted=False``: nothing calls it back) gets a spinner instead, started
    by a timer once the step has lasted long enough and animated by rich's own thread."""

    def __init__(self, label: str, unit: str, drawn: bool, counted: bool = True) -> None:
        self.label = label
        self.unit = unit
        self.counted = counted
        self.done = 0
        self.total: int | None = None
        self.started = time.monotonic()
        self._drawn = drawn
        self._next_look = self.started + _show_after()
        self._shown = label
        self._bar: Any = None
        self._task: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self._timer: threading.Timer | None = None
        if drawn and not counted:
            self._timer = threading.Timer(_show_after(), self._spin)
            self._timer.daemon = True
            self._timer.start()

    def __call__(self, done: int, total: int | None = None, /) -> None:
        self._update(done, total, self.label)

    def phased(self, phase: str, done: int, total: int, /) -> None:
        """For an operation of named phases (shadowfs.progress.PhasedProgress)."""
        self._update(done, total, f"{self.label}: {phase}")

    def _update(self, done: int, total: int | None, description: str) -> None:
        self.done, self.total = done, total
        if not self._drawn:
            return
        now = time.monotonic()
        # Most calls end here, on a clock read: shadowfs calls for every path it touches.
        if now < self._next_look and (self._bar is None or description == self._shown):
            return
        self._next_look = now + REDRAW_EVERY_S
        self._shown = description
        self._redraw(description)

    def _redraw(self, description: str) -> None:
        if self._bar is None:
            self._bar = _make_bar(auto_refresh=False)
            if self._bar is None:
                self._drawn = False
                return
            self._bar.start()
            self._task = self._bar.add_task(description, total=self.total)
        self._bar.update(
            self._task,
            description=description,
            completed=self.done,
            total=self.total,
            refresh=True,
        )

    def _spin(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._bar = _make_bar(auto_refresh=True)
            if self._bar is not None:
                self._bar.start()
                self._bar.add_task(self.label, total=None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._bar is not None:
                self._bar.stop()
                self._bar = None


def _make_bar(*, auto_refresh: bool) -> Any:
    """A rich progress display on stderr; None where rich is not installed (no bar, then)."""
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
    except ImportError:
        return None

    console = Console(stderr=True, no_color=not _settings.color)
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        # A counted step is drawn when told (at most every REDRAW_EVERY_S), not by a thread of
        # rich's own: one competing for the GIL slowed a tree's hashing by a tenth.
        auto_refresh=auto_refresh,
        transient=True,  # erased at the end: the agent's output or the result starts clean
    )


@contextlib.contextmanager
def step(
    label: str, unit: str = "items", *, done: str | None = None, counted: bool = True
) -> Iterator[Step]:
    """A long step. ``done`` is the --verbose line's verb phrase ("hashed the tree"), else
    the label is used; ``counted=False`` for a step that never calls back (a spinner)."""
    # A dumb terminal cannot move the cursor back: a bar would print line after line.
    drawn = (
        _settings.draw
        and _settings.level > QUIET
        and _stderr_is_terminal()
        and os.environ.get("TERM") != "dumb"
    )
    current = Step(label, unit, drawn, counted)
    try:
        yield current
    finally:
        current.close()
    if _settings.level >= VERBOSE:
        elapsed = time.monotonic() - current.started
        count = f"{current.done} {unit} " if counted else ""
        _write(f"{done or label}: {count}in {elapsed:.2f}s")
