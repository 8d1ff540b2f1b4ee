"""Options every jukebox command takes, and the config file's defaults.

``-q/--quiet``, ``-v/--verbose`` and ``--no-color`` are added to every command and group as it
is registered (``add_output_options``), so ``jukebox --quiet booth run`` and ``jukebox booth
run --quiet`` mean the same. Each one's callback records it on the root context and applies the
whole (jukebox.display.progress, jukebox.display.style, click's colour) again: the group's options
are parsed before the sub-command's, and the last application sees them all.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import click

_META = "jukebox.output"


def _record(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if ctx.resilient_parsing:  # shell completion: nothing runs
        return
    root = ctx.find_root()
    given = root.meta.setdefault(_META, {})
    if value:
        given[param.name] = True
    apply_output(ctx)


@contextlib.contextmanager
def kept_output_settings() -> Iterator[None]:
    """The settings a command sets last only as long as it runs: a command invoked inside a
    longer-lived process (click's test runner, a program calling `cli.main`) leaves the Python
    API plain and undrawn afterwards."""
    from jukebox.display import progress, style

    saved = (progress.level(), progress.drawing(), progress.coloured(), style.enabled())
    try:
        yield
    finally:
        progress.configure(level=saved[0], draw=saved[1], color=saved[2])
        style.configure(saved[3])


def apply_output(ctx: click.Context) -> None:
    """Sets how talkative and colourful this command is, from its flags, the environment and
    the config file (``no-color``), in that order."""
    from jukebox.cli.output import configure_output
    from jukebox.display import style

    root = ctx.find_root()
    given = root.meta.get(_META, {})
    if given.get("quiet") and given.get("verbose"):
        raise click.UsageError("--quiet and --verbose contradict each other: give one")
    told = bool(root.meta.get("jukebox.config_told"))
    root.meta["jukebox.config_told"] = configure_output(
        bool(given.get("quiet")), bool(given.get("verbose")), bool(given.get("no_color")),
        root.meta.get("jukebox.config"), told,
    )  # fmt: skip
    color = style.enabled()
    if not color:
        # click.echo would otherwise keep codes on a terminal; contexts made later inherit it.
        node: click.Context | None = ctx
        while node is not None:
            node.color = False
            node = node.parent


OUTPUT_FLAGS = {
    ("-q", "--quiet"): "No progress and no notes on stderr: results, warnings and errors only.",
    ("-v", "--verbose"): "Also say on stderr what each long step did and how long it took.",
    ("--no-color",): "No colour even on a terminal (as $NO_COLOR does).",
}


def output_options() -> list[click.Option]:
    return [
        click.Option(list(names), is_flag=True, expose_value=False, callback=_record, help=text)
        for names, text in OUTPUT_FLAGS.items()
    ]


def add_output_options(command: click.Command) -> None:
    """Adds the output options a command lacks; a flag string it already uses for something of
    its own (a `-v` of its own) stays its own, and that output option is added without it."""
    names = {p.name for p in command.params}
    taken = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    for option in output_options():
        if option.name in names:
            continue
        option.opts = [o for o in option.opts if o not in taken]
        if option.opts:
            command.params.append(option)


def load_config(ctx: click.Context) -> None:
    """Reads the config file (ConfigError, exit 2, if it is bad) and makes its values the
    defaults of the flags they name. `jukebox help` works with a bad file: it is where one
    reads how to fix it."""
    from jukebox import config

    try:
        loaded = config.load()
    except config.ConfigError:
        if ctx.invoked_subcommand != "help":
            raise
        loaded = config.Config()
    root = ctx.find_root()
    root.meta["jukebox.config"] = loaded
    defaults = config.default_map(loaded, root.command)
    if defaults:
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
    apply_output(ctx)


# The tape dir and --json options, shared by every command module: here, not in jukebox.cli.tapes
# (the read side's commands and their imports), which `booth run` does not need.
def absolute_tape_dir(
    ctx: click.Context, param: click.Parameter, value: Path | None
) -> Path | None:
    """Resolved once, where the user typed it: a replay or fork later runs in a scratch tree,
    where a relative tape dir would name another directory (inside the tree)."""
    return Path(os.path.abspath(value)) if value is not None else None


tape_dir_option = click.option(
    "--tape-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    callback=absolute_tape_dir,
    help="Where tapes live (default: $JUKEBOX_TAPE_DIR, else ~/.local/share/jukebox/tapes).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


def listed_tape_dir(tape_dir: Path | None):
    """The tape dir of a command that reads what is in it (a listing, gc, a pending booth). One
    named with --tape-dir or $JUKEBOX_TAPE_DIR must exist: a mistyped path would list nothing
    and look like an empty dir."""
    from jukebox.tape.tapedir import TapeDir, require_named_tape_dir

    home = TapeDir.resolve(tape_dir)
    require_named_tape_dir(home.path, tape_dir)
    return home
