"""How talkative and colourful a command is, without click: jukebox.cli.options applies it from
click's flags, jukebox.cli.fast from the command lines it parses itself."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any


def configure_output(quiet: bool, verbose: bool, no_color: bool, config: Any, told: bool) -> bool:
    """Sets the level and the colour from the flags, the environment and the config file
    (``no-color``), in that order; returns whether the config file has been named on stderr
    (once, at -v)."""
    from jukebox.display import progress, style

    level = progress.QUIET if quiet else progress.NORMAL
    if verbose:
        level = progress.VERBOSE
    from_file = bool(config is not None and config.get("no-color"))
    color = not style.no_color_requested(no_color or from_file)
    style.configure(color)
    progress.configure(level=level, draw=True, color=color)
    if level == progress.VERBOSE and config is not None and config.path is not None and not told:
        progress.detail(f"config {config.path}: {', '.join(config.values) or 'empty'}")
        return True
    return told
