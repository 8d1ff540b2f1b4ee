"""The options that adjust an image's view of the host for one booth (jukebox.booth.paths), for
`booth run`, `replay --exec` and `fork --exec`: one decorator, received as one `paths`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

_RW_HELP = (
    "Let the agent write this host path directly (repeatable): a venv outside the tree, a "
    "cache. A hole in the booth: those writes are neither recorded nor undone. Never the tree, "
    "the tape dir or the commit key's dir."
)
_RO_HELP = (
    "Show this host path read-only (repeatable), though the image or the private /tmp hides "
    "it: a script under /tmp, a hidden directory."
)
_HIDE_HELP = "Cover this path with an empty read-only one, as the image's hide list does."
_NO_PRIVATE_TMP_HELP = "Show the host's /tmp (read-only) instead of an empty private one."


def view_path_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Adds --rw, --ro, --hide and --no-private-tmp; `command` gets them as `paths`, a
    jukebox.booth.paths.BoothPaths, or None when none was given."""

    @click.option("--rw", multiple=True, metavar="PATH", help=_RW_HELP)
    @click.option("--ro", multiple=True, metavar="PATH", help=_RO_HELP)
    @click.option("--hide", multiple=True, metavar="PATH", help=_HIDE_HELP)
    @click.option("--no-private-tmp", is_flag=True, help=_NO_PRIVATE_TMP_HELP)
    @functools.wraps(command)
    def with_paths(
        *args: Any,
        rw: tuple[str, ...],
        ro: tuple[str, ...],
        hide: tuple[str, ...],
        no_private_tmp: bool,
        **kwargs: Any,
    ) -> Any:
        from jukebox.booth.paths import BoothPaths

        given = rw or ro or hide or no_private_tmp
        paths = BoothPaths.from_options(rw, ro, hide, no_private_tmp) if given else None
        return command(*args, paths=paths, **kwargs)

    return with_paths
