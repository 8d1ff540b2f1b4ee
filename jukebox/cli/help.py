"""`jukebox help [TOPIC]`: short guides kept in the package (jukebox/data/help/TOPIC.txt)."""

from __future__ import annotations

import click

from jukebox.cli import cli

SUMMARIES = {
    "booth": "run an agent in a booth; commit, diff, discard",
    "tapes": "the record of a run: ls, log, verify, diff, the tape dir",
    "images": "what the agent sees and may do (--image)",
    "breaker": "stop a run that costs or repeats too much (--max-*)",
    "replay": "check a tape, re-run it offline, fork it",
    "config": "~/.config/jukebox/config.toml: your defaults",
    "output": "progress, --quiet, --verbose, colour and NO_COLOR",
    "completion": "Tab completion for bash, zsh and fish",
    "models": "the model APIs a booth records; --upstream, Azure, Gemini, telemetry",
}


def topic_text(topic: str) -> str | None:
    from importlib import resources

    if topic not in SUMMARIES:
        return None
    return resources.files("jukebox").joinpath("data", "help", f"{topic}.txt").read_text()


def _complete_topic(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[str]:
    return [t for t in SUMMARIES if t.startswith(incomplete)]


@cli.command("help")
@click.argument("topic", nargs=-1, shell_complete=_complete_topic)
@click.pass_context
def help_command(ctx: click.Context, topic: tuple[str, ...]) -> None:
    """A short guide to TOPIC; without one, the list of topics. `jukebox help booth run`
    is `jukebox booth run --help`."""
    from jukebox.errors import UsageError

    if not topic:
        width = max(map(len, SUMMARIES))
        click.echo("jukebox help TOPIC, where TOPIC is one of:\n")
        for name, summary in SUMMARIES.items():
            click.echo(f"  {name.ljust(width)}  {summary}")
        click.echo("\nand `jukebox COMMAND --help` for any command (`jukebox --help` lists them).")
        return
    text = topic_text(topic[0]) if len(topic) == 1 else None
    if text is not None:
        click.echo(text, nl=False)
        return
    command: click.Command | None = cli
    path = ["jukebox"]
    for word in topic:
        sub = command.commands.get(word) if isinstance(command, click.Group) else None
        if sub is None:
            raise UsageError(
                f"no help topic or command {' '.join(topic)!r}: the topics are "
                f"{', '.join(SUMMARIES)} (`jukebox help` lists them), and `jukebox --help` "
                "lists the commands"
            )
        command, path = sub, [*path, word]
    assert command is not None
    with click.Context(command, info_name=" ".join(path[1:]), parent=ctx.find_root()) as sub_ctx:
        click.echo(command.get_help(sub_ctx))
