"""The command lines `jukebox.cli.main` runs without click: `jukebox replay TAPE`, with
`--tape-dir DIR`, `--json` and the output flags, in any order.

Importing click and building the app and its commands cost about as much CPU as the replay of an
8-frame tape itself (docs/benchmarks.md, "Where a user waits"). This path parses only what it
knows to mean exactly what click would make of it; a command line with anything else (another
option, `--help`, `--exec`, a value that looks like an option, a contradiction, `--tape-dir`
naming a file) goes to click as before, so the help, the usage errors and their wording stay
click's. What runs is the same function the click command calls (jukebox.cli.reading), under
the same error lines (jukebox.cli.guarded).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The output flags every command takes (jukebox.cli.options.OUTPUT_FLAGS), by parameter name.
OUTPUT_FLAGS = {
    "-q": "quiet",
    "--quiet": "quiet",
    "-v": "verbose",
    "--verbose": "verbose",
    "--no-color": "no_color",
}


class Replay:
    """A `jukebox replay TAPE` command line, parsed."""

    __slots__ = ("as_json", "flags", "tape", "tape_dir")

    def __init__(self, tape: str, tape_dir: str | None, as_json: bool, flags: set[str]) -> None:
        self.tape = tape
        self.tape_dir = tape_dir
        self.as_json = as_json
        self.flags = flags


def _usable_tape_dir(value: str) -> bool:
    """A --tape-dir value click takes as is: not empty, not option-like, not an existing file
    (click.Path(file_okay=False) refuses that with a usage error of its own)."""
    if not value or value.startswith("-"):
        return False
    try:
        st = os.stat(value)
    except OSError:
        return True
    import stat

    return stat.S_ISDIR(st.st_mode)


def planned(argv: list[str]) -> Replay | None:
    """The command line parsed, or None when click should parse it."""
    flags: set[str] = set()
    i = 0
    while i < len(argv) and argv[i] in OUTPUT_FLAGS:
        flags.add(OUTPUT_FLAGS[argv[i]])
        i += 1
    if i >= len(argv) or argv[i] != "replay":
        return None
    tape: str | None = None
    tape_dir: str | None = None
    as_json = False
    rest = argv[i + 1 :]
    j = 0
    while j < len(rest):
        arg = rest[j]
        if arg in OUTPUT_FLAGS:
            flags.add(OUTPUT_FLAGS[arg])
        elif arg == "--json":
            as_json = True
        elif arg == "--tape-dir" and j + 1 < len(rest):
            tape_dir = rest[j + 1]
            j += 1
        elif arg.startswith("--tape-dir="):
            tape_dir = arg.removeprefix("--tape-dir=")
        elif not arg.startswith("-") and tape is None:
            tape = arg
        else:
            return None
        j += 1
    if tape is None or {"quiet", "verbose"} <= flags:
        return None
    if tape_dir is not None and not _usable_tape_dir(tape_dir):
        return None
    return Replay(tape, tape_dir, as_json, flags)


def run(plan: Replay) -> int:
    """Runs the planned command as the click app would: the config file, the output settings,
    the tape dir made absolute, the command, the last flush."""
    from jukebox.cli import absolute_tape_dir_env, guarded, stdout_closed, stop_quietly
    from jukebox.display import progress, style

    def call() -> None:
        from jukebox import config
        from jukebox.cli.output import configure_output
        from jukebox.cli.reading import replay_offline

        loaded = config.load()
        flags = plan.flags
        configure_output("quiet" in flags, "verbose" in flags, "no_color" in flags, loaded, False)
        absolute_tape_dir_env()
        tape_dir = Path(os.path.abspath(plan.tape_dir)) if plan.tape_dir is not None else None
        replay_offline(plan.tape, tape_dir, plan.as_json)

    saved = (progress.level(), progress.drawing(), progress.coloured(), style.enabled())
    try:
        guarded(call)
        sys.stdout.flush()  # here, where a closed pipe can still be told from a bug
    except BrokenPipeError:
        if not stdout_closed():
            raise
        stop_quietly()
    finally:  # as jukebox.cli.options.kept_output_settings, for a caller that goes on
        progress.configure(level=saved[0], draw=saved[1], color=saved[2])
        style.configure(saved[3])
    return 0
