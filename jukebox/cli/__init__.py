"""The `jukebox` command.

This module imports no click, and nothing heavy at module level: `main` runs the commands a user
waits on most (`jukebox replay TAPE`, jukebox.cli.fast) without it when their command line holds
nothing but what that path parses, and hands every other command line to the click app
(jukebox.cli.app), which imports the module of the command it names only. Both paths share the
error lines and exit codes here (`guarded`, `fail`), so a command reads the same either way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any, NoReturn, TypeVar

    from jukebox.cli.app import JukeboxGroup as JukeboxGroup
    from jukebox.cli.app import cli as cli

    T = TypeVar("T")

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
    "warm": ("warm_server",),
}
ALL_COMMAND_MODULES = (
    "booth", "booth_review", "disk", "export", "help", "mcp", "mount", "show", "tapes",
    "timetravel", "view", "warm_server",
)  # fmt: skip
COMPLETE_ENV = "_JUKEBOX_COMPLETE"  # click's shell completion asks with it set
WARM_ENV = "JUKEBOX_WARM"  # "off": never hand a command to a `jukebox warm` server
WARM_DIR_ENV = "JUKEBOX_WARM_DIR"  # where its socket lives (default: `warm_directory`)


def warm_directory() -> str:
    """Where this user's `jukebox warm` server has its socket: $JUKEBOX_WARM_DIR, else
    $XDG_RUNTIME_DIR/jukebox when the runtime dir is set (the user's own, 0700 by its spec),
    else /tmp/jukebox-warm-UID (made 0700; one already there of another user or mode makes the
    warm start unusable, never used: jukebox.cli.warm.open_directory). Here, not in
    jukebox.cli.warm: a cold start only looks whether it exists, without importing that."""
    named = os.environ.get(WARM_DIR_ENV)
    if named:
        return os.path.abspath(named)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "jukebox")
    return f"/tmp/jukebox-warm-{os.geteuid()}"


def __getattr__(name: str) -> Any:
    """`cli` and `JukeboxGroup` live in jukebox.cli.app: importing it imports click, so only
    the modules that register click commands (and the click path of `main`) ask for them."""
    if name in ("cli", "JukeboxGroup"):
        from jukebox.cli import app

        value = getattr(app, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jukebox.cli' has no attribute {name!r}")


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


def absolute_tape_dir_env() -> None:
    """Resolved once, at the start of every command, in the directory the user ran it from:
    replays and forks run in a scratch tree, agents inherit the variable."""
    from jukebox.tape.tapedir import TAPE_DIR_ENV

    named = os.environ.get(TAPE_DIR_ENV)
    if named:
        os.environ[TAPE_DIR_ENV] = os.path.abspath(named)


def echo(text: str, err: bool = False) -> None:
    """What click.echo does with a line of text: written and flushed, the colour codes taken
    out when the stream is not a terminal (style only paints when colour is wanted at all)."""
    stream = sys.stderr if err else sys.stdout
    try:
        terminal = stream.isatty()
    except (ValueError, AttributeError):
        terminal = False
    if not terminal and "\x1b" in text:
        import re

        text = re.sub(r"\033\[[;?0-9]*[a-zA-Z]", "", text)
    stream.write(text + "\n")
    stream.flush()


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


def stop_quietly() -> NoReturn:
    """What a Unix tool does when its reader goes away: no message, the status of SIGPIPE.
    stdout goes to /dev/null first, so the interpreter's last flush cannot fail again."""
    import signal

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(128 + signal.SIGPIPE)


def fail(message: str, code: int) -> NoReturn:
    from jukebox.display.names import printable

    # Messages quote names from trees and tapes: a terminal must not act on what they hold.
    from jukebox.display.style import error_prefix

    echo(f"{error_prefix('jukebox:')} {printable(message)}", err=True)
    sys.exit(code)


def _is_click_exit(error: BaseException) -> bool:
    """click's own Exit, Abort and usage errors, which its caller turns into lines; click is
    imported only when a click command ran, so an error from elsewhere is never one."""
    click = sys.modules.get("click")
    if click is None:
        return False
    return isinstance(error, (click.exceptions.Exit, click.exceptions.Abort, click.ClickException))


def guarded(call: Callable[[], T]) -> T:
    """Runs a command, turning the errors we raise on purpose into one line and the documented
    exit code."""
    from jukebox.errors import JukeboxError
    from shadowfs.errors import ConflictError, ShadowfsError

    try:
        return call()
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
    except Exception as error:  # a bug of ours: still one line unless asked for more
        if _is_click_exit(error):
            raise
        if isinstance(error, BrokenPipeError) and stdout_closed():
            stop_quietly()
        if os.environ.get("JUKEBOX_DEBUG"):
            raise
        fail(
            f"internal error: {type(error).__name__}: {error} "
            "(rerun with JUKEBOX_DEBUG=1 for a traceback and report it)",
            70,
        )


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
    argv = sys.argv[1:]
    if os.environ.get(WARM_ENV) != "off" and os.path.exists(warm_directory()):
        from jukebox.cli import warm

        handed = warm.run(argv)  # on a `jukebox warm` server, when one runs and may take it
        if handed is not None:
            _leave(handed)
    from jukebox.cli import fast

    run = None if os.environ.get(COMPLETE_ENV) else fast.planned(argv)
    code: object
    try:
        code = None if run is None else fast.run(run)
        if code is None:
            register_commands(argv)
            from jukebox.cli.app import run_click

            code = run_click()
    except SystemExit as stop:
        if not _skip_teardown:
            raise
        code = stop.code
    if _skip_teardown:
        _leave(code)
    sys.exit(code)
