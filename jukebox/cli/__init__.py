"""The `jukebox` command.

Sub-commands import their machinery lazily: `jukebox replay` of a 50-frame tape, interpreter start
included, must stay well under 150 ms, so nothing heavy is imported at module level here.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import click

from jukebox import __version__
from jukebox.cli.options import add_output_options


class JukeboxGroup(click.Group):
    """Turns the errors we raise on purpose into one line and the documented exit code, and
    gives every command the output options (jukebox.cli.options)."""

    group_class = type  # sub-groups (`jukebox booth`) are JukeboxGroups too

    def main(self, *args, **kwargs):
        from jukebox.cli.options import kept_output_settings

        with kept_output_settings():
            return super().main(*args, **kwargs)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        from jukebox.cli.completion import add_completion
        from jukebox.cli.options import add_output_options

        add_output_options(cmd)
        add_completion(cmd)
        super().add_command(cmd, name)

    def invoke(self, ctx: click.Context):
        from jukebox.errors import JukeboxError
        from shadowfs.errors import ConflictError, ShadowfsError

        try:
            return super().invoke(ctx)
        except JukeboxError as error:
            fail(str(error), error.exit_code)
        except ConflictError as error:
            fail(str(error), 1)
        except ShadowfsError as error:
            fail(str(error), 2)
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as error:
            name = error.filename or ""
            fail(f"{error.strerror}: {name}: check the path and its permissions", 2)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except Exception as error:  # a bug of ours: still one line unless asked for more
            if isinstance(error, BrokenPipeError) and stdout_closed():
                stop_quietly()
            if os.environ.get("JUKEBOX_DEBUG"):
                raise
            fail(
                f"internal error: {type(error).__name__}: {error} "
                "(rerun with JUKEBOX_DEBUG=1 for a traceback and report it)",
                70,
            )


def stdout_closed() -> bool:
    """Whether whoever read stdout is gone (`jukebox diff A@0 A | head -1`): a pipe whose
    reading end is closed polls as an error. An EPIPE from anything else is a bug to report."""
    import select

    poller = select.poll()
    try:
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (ValueError, OSError):
        return False
    return any(events & select.POLLERR for _, events in poller.poll(0))


def stop_quietly() -> None:
    """What a Unix tool does when its reader goes away: no message, the status of SIGPIPE.
    stdout goes to /dev/null first, so the interpreter's last flush cannot fail again."""
    import signal

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(128 + signal.SIGPIPE)


def fail(message: str, code: int) -> None:
    from jukebox.display.names import printable

    # Messages quote names from trees and tapes: a terminal must not act on what they hold.
    from jukebox.display.style import error_prefix

    click.echo(f"{error_prefix('jukebox:')} {printable(message)}", err=True)
    sys.exit(code)


@click.group(cls=JukeboxGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="jukebox")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Jukebox: the flight recorder and undo button for AI agents.

    TAPE is a .jbx path or a tape id in the tape dir ($JUKEBOX_TAPE_DIR, else
    ${XDG_DATA_HOME:-~/.local/share}/jukebox/tapes);
    TAPE@N selects frame N (frames count from 0). Defaults come from
    ~/.config/jukebox/config.toml; `jukebox help TOPIC` explains booth, tapes, config and more.
    """
    from jukebox.cli.options import load_config
    from jukebox.tape.tapedir import TAPE_DIR_ENV

    load_config(ctx)

    # Resolved once, at the start of every command, in the directory the user ran it from:
    # replays and forks run in a scratch tree, agents inherit the variable.
    named = os.environ.get(TAPE_DIR_ENV)
    if named:
        os.environ[TAPE_DIR_ENV] = os.path.abspath(named)


add_output_options(cli)


# The modules that register each command (importing one registers its commands). A command
# line imports only its command's: each module costs its imports at every start.
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "booth": ("booth", "booth_review", "mcp"),
    **dict.fromkeys(("ls", "log", "verify", "replay", "diff", "gc"), ("tapes",)),
    **dict.fromkeys(("rm", "prune", "du"), ("disk",)),
    **dict.fromkeys(("mount", "umount"), ("mount",)),
    "show": ("show",),
    "fork": ("timetravel",),
    "mcp": ("mcp",),
    "export": ("export",),
    "view": ("view",),
}
ALL_COMMAND_MODULES = (
    "booth", "booth_review", "disk", "export", "help", "mcp", "mount", "show", "tapes",
    "timetravel", "view",
)  # fmt: skip
COMPLETE_ENV = "_JUKEBOX_COMPLETE"  # click's shell completion asks with it set


def register_commands(argv: list[str]) -> None:
    """Imports the modules of the command `argv` names; all of them when it names none (the
    list of commands), asks for the top-level help or version, completes a word, names an
    unknown command (click suggests close ones) or asks `jukebox help` (it walks them all)."""
    from importlib import import_module

    modules: tuple[str, ...] | None = None
    if not os.environ.get(COMPLETE_ENV):
        for arg in argv:
            if arg in ("-h", "--help", "--version"):
                break
            if not arg.startswith("-"):
                modules = COMMAND_MODULES.get(arg)
                break
    for name in modules or ALL_COMMAND_MODULES:
        import_module(f"jukebox.cli.{name}")


_skip_teardown = False


def skip_teardown() -> None:
    """Lets this command's process end without the interpreter's teardown (`_leave`). Only for
    commands that close what they open (stores, tapes, files, threads) before they return."""
    global _skip_teardown
    _skip_teardown = True


def _leave(code: object) -> NoReturn:
    """Ends the process as `sys.exit(code)` would, minus the teardown: freeing every module and
    object one by one took 39M instructions after a booth's work was done (8% of `booth run --
    true`; about 10 ms of CPU, and more wall time on a busy machine). What of the teardown
    matters runs first, in its order: threads that are not daemons are joined, the atexit
    handlers run (the store's flush at exit, logging's shutdown), the standard streams are
    flushed."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message goes to stderr, the status is 1
        sys.stderr.write(f"{code}\n")
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 120  # what the interpreter exits with when its flush fails
    os._exit(status)


def main() -> None:
    register_commands(sys.argv[1:])
    code: object
    try:
        code = _main()
    except SystemExit as stop:
        if not _skip_teardown:
            raise
        code = stop.code
    if _skip_teardown:
        _leave(code)
    sys.exit(code)


def _main() -> int:
    try:
        code = cli.main(prog_name="jukebox", standalone_mode=False)
        sys.stdout.flush()  # here, where a closed pipe can still be told from a bug
    except BrokenPipeError:
        if not stdout_closed():
            raise
        stop_quietly()
    except click.UsageError as error:
        where = error.ctx.command_path if error.ctx else "jukebox"
        fail(f"{error.format_message()} (see `{where} --help`)", 2)
    except click.ClickException as error:
        fail(error.format_message(), error.exit_code)
    except click.Abort:
        fail("interrupted", 130)
    return code if isinstance(code, int) else 0
