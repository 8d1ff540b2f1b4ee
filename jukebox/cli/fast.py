"""The command lines `jukebox.cli.main` runs without click: `jukebox replay TAPE`, with
`--tape-dir DIR`, `--json` and the output flags, in any order; `jukebox booth run [OPTIONS]
[--] CMD ...` with only the options of `BOOTH_OPTIONS` (each given once, as `--flag VALUE`) and
the output flags, and no config file value for `booth run`.

Importing click and building the app and its commands cost about as much CPU as the replay of an
8-frame tape itself (docs/benchmarks.md, "Where a user waits"). This path parses only what it
knows to mean exactly what click would make of it; a command line with anything else (another
option, `--help`, `--exec`, a value that looks like an option, a contradiction, `--tape-dir`
naming a file) goes to click as before, so the help, the usage errors and their wording stay
click's. What runs is the same function the click command calls (jukebox.cli.reading), under
the same error lines (jukebox.cli.guarded).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

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


class BoothRun:
    """A `jukebox booth run [OPTIONS] CMD` command line, parsed: `options` by run_booth's
    parameter names (string values, passed to it as keywords)."""

    __slots__ = ("cmd", "flags", "options")

    def __init__(self, cmd: list[str], options: dict[str, Any], flags: set[str]) -> None:
        self.cmd = cmd
        self.options = options
        self.flags = flags


# The options of `booth run` this path parses (each takes one value), by run_booth's parameter
# names; a choice's values as click's Choice takes them (case-sensitive). Any other option, one
# given twice, `--flag=VALUE`, a value that looks like an option: click parses the line. Their
# defaults are run_booth's own, which the click command passes when no flag is given.
BOOTH_OPTIONS = {
    "--tree": "tree",
    "--tape-dir": "tape_dir",
    "--tape-id": "tape_id",
    "--name": "name",
    "--fs": "fs",
    "--image": "image",
    "--commit": "commit_mode",
    "--verify": "verify_cmd",
    "--net": "net",
}
BOOTH_CHOICES = {
    "fs": ("fuse", "overlay"),
    "commit_mode": ("auto", "ask", "never"),
    "net": ("host", "none"),
}


def planned_booth(argv: list[str]) -> BoothRun | None:
    """A `booth run` command line parsed, or None when click should parse it."""
    flags: set[str] = set()
    i = 0
    while i < len(argv) and argv[i] in OUTPUT_FLAGS:
        flags.add(OUTPUT_FLAGS[argv[i]])
        i += 1
    if argv[i : i + 1] != ["booth"]:
        return None
    i += 1
    while i < len(argv) and argv[i] in OUTPUT_FLAGS:
        flags.add(OUTPUT_FLAGS[argv[i]])
        i += 1
    if argv[i : i + 1] != ["run"]:
        return None
    i += 1
    options: dict[str, Any] = {}
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-"):
            break  # CMD: click stops at it too (allow_interspersed_args=False)
        if arg in OUTPUT_FLAGS:
            flags.add(OUTPUT_FLAGS[arg])
            i += 1
            continue
        name = BOOTH_OPTIONS.get(arg)
        if name is None or name in options or i + 1 >= len(argv):
            return None
        value = argv[i + 1]
        if not value or value.startswith("-"):
            return None
        if name in BOOTH_CHOICES and value not in BOOTH_CHOICES[name]:
            return None  # click's error message
        options[name] = value
        i += 2
    cmd = argv[i:]
    if not cmd or cmd[0].startswith("-") or {"quiet", "verbose"} <= flags:
        return None
    return BoothRun(cmd, options, flags)


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


def planned(argv: list[str]) -> Replay | BoothRun | None:
    """The command line parsed, or None when click should parse it."""
    if next((a for a in argv if a not in OUTPUT_FLAGS), None) == "booth":
        return planned_booth(argv)
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


def pause_gc() -> None:
    """The cyclic garbage collector off while a command starts. Its imports and set-up make
    objects that live as long as the process (modules, classes, functions, the booth), which
    the collector scanned again and again for no garbage: 26 young and 2 middle collections
    in a booth's start, 11 and 1 in a short replay's. `resume_gc` ends the pause."""
    gc.disable()


def resume_gc() -> None:
    """The collector back on once the command's start is done, what was made until then frozen
    (gc.freeze: never scanned again, so a long run's full collections stay short). A garbage
    cycle the start left, if any, is kept, once. Does nothing while the collector runs."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def run(plan: Replay | BoothRun) -> int | None:
    """Runs the planned command as the click app would: the config file, the output settings,
    the tape dir made absolute, the command, the last flush. None: nothing was run or written,
    and click is to run the command line (`booth run` with defaults in the config file)."""
    from jukebox.cli import absolute_tape_dir_env, guarded, stdout_closed, stop_quietly
    from jukebox.display import progress, style

    def call() -> bool:
        if isinstance(plan, BoothRun):
            return booth_run(plan)
        from jukebox import config
        from jukebox.cli.output import configure_output
        from jukebox.cli.reading import replay_offline

        loaded = config.load()
        flags = plan.flags
        configure_output("quiet" in flags, "verbose" in flags, "no_color" in flags, loaded, False)
        absolute_tape_dir_env()
        tape_dir = Path(os.path.abspath(plan.tape_dir)) if plan.tape_dir is not None else None
        replay_offline(plan.tape, tape_dir, plan.as_json)
        return True

    saved = (progress.level(), progress.drawing(), progress.coloured(), style.enabled())
    # Resumed once the booth is set up (run_booth's `set_up`), the replay's tape loaded
    # (replay_offline), or here when the command went wrong before that.
    pause_gc()
    try:
        if not guarded(call):
            return None
        sys.stdout.flush()  # here, where a closed pipe can still be told from a bug
    except BrokenPipeError:
        if not stdout_closed():
            raise
        stop_quietly()
    finally:  # as jukebox.cli.options.kept_output_settings, for a caller that goes on
        resume_gc()
        progress.configure(level=saved[0], draw=saved[1], color=saved[2])
        style.configure(saved[3])
    return 0


def booth_run(plan: BoothRun) -> bool:
    """`booth run` as jukebox.cli.booth's `run` does it with no other flag given: every option
    it does not parse is at its default, which is run_booth's own (no breaker, no proxy options,
    no MCP, no databases, no view paths, seccomp on). Ends the process with the run's status;
    returns False, having done nothing, when click is to run the command line."""
    from jukebox import config
    from jukebox.cli import absolute_tape_dir_env, skip_teardown
    from jukebox.cli.output import configure_output
    from jukebox.llm.upstreams import LIST_ENV

    loaded = config.load()
    booth_keys = config.COMMANDS[("booth", "run")]
    if any(loaded.get(key) is not None for key in booth_keys) or os.environ.get(LIST_ENV):
        # Defaults from the file (click's default_map), or upstreams to check with click's
        # error line: nothing has been said or done yet.
        return False
    flags = plan.flags
    configure_output("quiet" in flags, "verbose" in flags, "no_color" in flags, loaded, False)
    absolute_tape_dir_env()
    from jukebox.booth.isolation import PreforkedShim

    # The agent's shim, forked now, while this process is small: see PreforkedShim. It
    # imports what it needs on the other CPU while this one imports the supervisor.
    shim = PreforkedShim.fork(join_later=True)
    try:
        from jukebox.booth.supervisor import run_booth

        # run_booth closes what it opens, whatever the outcome: no teardown needed after it.
        skip_teardown()
        # An option not given is left to run_booth's own default, as the click command's is.
        code = run_booth(list(plan.cmd), preforked=shim, set_up=resume_gc, **plan.options)
    finally:
        shim.close()  # nothing to do when it was used or closed: else its set-up failed
    sys.exit(code)
