"""Colour for a person at a terminal: table headers, statuses, change letters, diff lines.

Off until the CLI turns it on (``configure``), so the Python API and tests see plain text. The
CLI turns it off for --no-color, a non-empty $NO_COLOR (no-color.org) or ``no-color = true``
in the config file. Even on, the codes reach only a terminal: click.echo strips them from a
pipe or a file, and code that writes to a stream itself asks ``wanted_on``.

Everything painted here was made printable first (jukebox.display.names): the only escape sequences
that reach the terminal are ours.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import IO, Any


class _Settings:
    enabled = False


_settings = _Settings()


def configure(enabled: bool) -> None:
    _settings.enabled = enabled


def no_color_requested(flag: bool = False) -> bool:
    """--no-color, $NO_COLOR set to anything but the empty string, or a terminal that says it
    cannot show colour (TERM=dumb)."""
    return flag or bool(os.environ.get("NO_COLOR")) or os.environ.get("TERM") == "dumb"


def enabled() -> bool:
    return _settings.enabled


def wanted_on(stream: IO[Any]) -> bool:
    """Whether to write colour codes straight to ``stream``."""
    try:
        return _settings.enabled and stream.isatty()
    except (ValueError, AttributeError):
        return False


# The SGR codes click.style writes for the colours used here: the same bytes, without importing
# click into commands that never need it (`jukebox replay` starts without it).
_FG = {"red": 31, "green": 32, "yellow": 33, "magenta": 35, "cyan": 36, "bright_black": 90}


def paint(text: str, *, fg: str | None = None, bold: bool = False) -> str:
    if not _settings.enabled:
        return text
    codes = (f"\x1b[{_FG[fg]}m" if fg else "") + ("\x1b[1m" if bold else "")
    return f"{codes}{text}\x1b[0m"


def header(text: str) -> str:
    return paint(text, bold=True)


_STATUS_COLOURS = {
    "COMMITTED": "green",
    "RUNNING": "cyan",
    "PENDING": "cyan",
    "EXITED": "yellow",
    "ROLLED_BACK": "yellow",
    "DISCARDED": "bright_black",
    "DAMAGED": "red",
    "UNREADABLE": "red",
    "CRASHED": "red",
    "CONFLICT": "red",
}


def status(text: str) -> str:
    """A tape's or a booth's status word, coloured by what it asks of the reader."""
    colour = _STATUS_COLOURS.get(text.split(" ", 1)[0].upper())
    return paint(text, fg=colour) if colour else text


_CHANGE_COLOURS = {"A": "green", "D": "red", "M": "yellow", "T": "magenta"}


def change_line(line: str) -> str:
    """A line of a change list ("  M  src/app.py"), coloured by its status letter."""
    stripped = line.lstrip()
    letter = stripped[:1]
    colour = _CHANGE_COLOURS.get(letter)
    if colour is None or stripped[1:2] not in (" ", ""):
        return line
    cut = len(line) - len(stripped) + 1
    return line[: cut - 1] + paint(letter, fg=colour, bold=True) + line[cut:]


def patch(text: str) -> str:
    """A unified diff (each line possibly indented): additions green, removals red, hunk
    headers cyan, file headers bold."""
    if not _settings.enabled or not text:
        return text
    out = []
    for line in text.splitlines(keepends=True):
        body = line.lstrip(" ")
        indent, content = line[: len(line) - len(body)], body.rstrip("\n")
        end = line[len(indent) + len(content) :]
        if content.startswith(("+++ ", "--- ")):
            content = paint(content, bold=True)
        elif content.startswith("@@"):
            content = paint(content, fg="cyan")
        elif content.startswith("+"):
            content = paint(content, fg="green")
        elif content.startswith("-"):
            content = paint(content, fg="red")
        out.append(indent + content + end)
    return "".join(out)


def error_prefix(text: str) -> str:
    return paint(text, fg="red", bold=True)
