"""`jukebox booth ...`: run an agent in a shadow booth and manage pending booths."""

from __future__ import annotations

from jukebox.cli import cli


@cli.group()
def booth() -> None:
    """Run any agent over its working tree in a copy-on-write booth."""
