"""`jukebox show TAPE@N`: one frame in full (jukebox.tape.frame_view)."""

from __future__ import annotations

from pathlib import Path

import click

from jukebox.cli import cli
from jukebox.cli.options import json_option, tape_dir_option
from jukebox.cli.reading import check_frame, emit_json, load_intact
from jukebox.cli.review_options import exclude_options


@cli.command("show")
@click.argument("tape", metavar="TAPE@N")
@tape_dir_option
@exclude_options
@json_option
def show_command(
    tape: str,
    tape_dir: Path | None,
    excludes: tuple[str, ...],
    default_excludes: bool,
    as_json: bool,
) -> None:
    """Show one frame in full: a model call's messages and reply (streams put together), a
    tool call, the files it changed with a short diff (hiding what `booth diff` hides), a
    checkpoint, a verdict. Without @N, the last frame. Headers are never shown."""
    from jukebox.review.filter import ReviewFilter
    from jukebox.tape.frame_view import frame_view, render_frame
    from jukebox.tape.tapedir import TapeRef

    ref = TapeRef.parse(tape, tape_dir)
    shown = ReviewFilter.from_options(excludes, default_excludes)
    loaded = load_intact(ref)
    n = check_frame(loaded, ref)
    view = frame_view(loaded, n, shown)
    if as_json:
        emit_json(view)
        return
    click.echo(render_frame(view))
    note = shown.hidden_note(f"jukebox show {ref.path}@{n}")
    if note:
        click.echo(note)
