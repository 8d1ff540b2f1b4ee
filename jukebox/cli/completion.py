"""What Tab completes beyond commands and options: tape ids and pending booth ids, read from
the tape dir the command line names (else the default one). Completion never recovers, creates
or writes anything, and a tape dir it cannot read completes nothing."""

from __future__ import annotations

from pathlib import Path

import click

TAPE_ARGUMENTS = {"tape", "tapes", "first", "second"}
BOOTH_ARGUMENTS = {"booth_id"}


def _tape_dir(ctx: click.Context):
    from jukebox.tape.tapedir import TapeDir, default_tape_dir

    named = ctx.params.get("tape_dir")
    return TapeDir(Path(named) if named else default_tape_dir())


def complete_tape(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    from jukebox.errors import JukeboxError

    try:
        ids = [p.stem for p in _tape_dir(ctx).tape_paths()]
    except (JukeboxError, OSError):
        return []
    return [i for i in ids if i.startswith(incomplete)]


def complete_booth(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    from jukebox.errors import JukeboxError

    try:
        names = sorted(p.stem for p in _tape_dir(ctx).booths_path.glob("*.json"))
    except (JukeboxError, OSError):
        return []
    return [n for n in names if n.startswith(incomplete)]


def add_completion(command: click.Command) -> None:
    """Gives a command's TAPE and BOOTH_ID arguments their completion, unless they have one."""
    for param in command.params:
        if not isinstance(param, click.Argument) or param._custom_shell_complete is not None:
            continue
        # click keeps the shell_complete= given to a parameter here, and asks it first.
        if param.name in TAPE_ARGUMENTS:
            param._custom_shell_complete = complete_tape
        elif param.name in BOOTH_ARGUMENTS:
            param._custom_shell_complete = complete_booth
