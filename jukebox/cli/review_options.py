"""Options shared by the commands that show a booth's changes for review (diff, export)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def exclude_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`--exclude GLOB` (repeatable) and `--no-default-excludes` (jukebox.review.filter)."""
    command = click.option(
        "--no-default-excludes",
        "default_excludes",
        is_flag=True,
        default=True,
        flag_value=False,
        help="Also show .git/objects, .venv, __pycache__ and node_modules.",
    )(command)
    return click.option(
        "--exclude",
        "excludes",
        multiple=True,
        metavar="GLOB",
        help="Hide paths matching GLOB: a name (`*.log`, `dist`) anywhere, or a path from the "
        "tree's root (`docs/build`); repeatable.",
    )(command)
