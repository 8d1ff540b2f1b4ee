"""The click app: the `jukebox` group, every command registered on it by the modules of
jukebox.cli.COMMAND_MODULES, and the click half of `jukebox.cli.main`."""

from __future__ import annotations

import sys

import click

from jukebox import __version__
from jukebox.cli import absolute_tape_dir_env, fail, guarded, stdout_closed, stop_quietly
from jukebox.cli.options import add_output_options


class JukeboxGroup(click.Group):
    """Turns the errors we raise on purpose into one line and the documented exit code
    (jukebox.cli.guarded), and gives every command the output options (jukebox.cli.options)."""

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
        return guarded(lambda: super(JukeboxGroup, self).invoke(ctx))


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

    load_config(ctx)
    absolute_tape_dir_env()


add_output_options(cli)


def run_click() -> int:
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
