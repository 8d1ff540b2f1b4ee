"""`jukebox booth export`: a pending booth's changes as a git patch, for review elsewhere."""

from __future__ import annotations

import sys
from typing import Any

import click

from jukebox.cli.booth import _AT_HELP, _tape_dir, booth
from jukebox.cli.review_options import exclude_options


@booth.command("export")
@click.argument("booth_id")
@click.option("--tape-dir", default=None)
@click.option("--at", "at", default=None, metavar="LABEL|N", help=_AT_HELP)
@exclude_options
def export(
    booth_id: str,
    tape_dir: str | None,
    at: str | None,
    excludes: tuple[str, ...],
    default_excludes: bool,
) -> None:
    """Print a pending booth's changes as a git-format patch (`> change.patch`), for
    `git am` or `git apply` on its base tree. Binary files go as git binary patches; what
    the default excludes hide (see `booth diff`) is left out, and said so on stderr."""
    from jukebox.booth.export import added_empty_dirs, export_patch
    from jukebox.booth.supervisor import load_record, pending_changes
    from jukebox.review.filter import ReviewFilter

    tapes = _tape_dir(tape_dir)
    shown = ReviewFilter.from_options(excludes, default_excludes)
    with pending_changes(tapes, booth_id, at) as (store, _base, _target, every):
        record = load_record(tapes, booth_id)
        changes = shown.keep(every)
        what = record.name or f"booth {booth_id}"
        at_text = f" (checkpoint {at})" if at is not None else ""
        body = (
            f"Changes of jukebox booth {booth_id}{at_text} over {record.tree}.\n\n"
            f"Tape: {record.tape}"
        )
        result = export_patch(
            store,
            changes,
            subject=f"{what}{at_text}",
            body=body,
            date=record.created,
            empty_dirs=[p for p in added_empty_dirs(every) if not shown.excludes(p)],
        )
    if sys.stdout.isatty():
        # Read on a terminal, not applied: the files' own escape sequences are shown, not run.
        from jukebox.display.names import printable_lines

        click.echo(printable_lines(result.patch.decode("utf-8", "surrogateescape")), nl=False)
    else:
        # click 8.3 deprecates it behind a module __getattr__, which mypy reads as `object`.
        out = click.get_binary_stream("stdout")  # type: ignore[operator]
        out.write(result.patch)
        out.flush()
    binary = f" ({result.binary} binary)" if result.binary else ""
    click.echo(f"exported {result.files} file(s){binary} of booth {booth_id}", err=True)
    note = shown.hidden_note(f"jukebox booth export {booth_id}")
    if note:
        click.echo(note, err=True)
    if result.specials_left_out:
        click.echo(
            f"{len(result.specials_left_out)} special file(s) (fifo, socket, device) left out: "
            "git cannot hold them (named in the message)",
            err=True,
        )
    if result.dirs_left_out:
        click.echo(
            f"{len(result.dirs_left_out)} empty director(ies) left out: a git patch cannot "
            "hold them (named in the message)",
            err=True,
        )


def commit_only(
    tapes: Any,
    booth_id: str,
    paths: tuple[str, ...],
    at: str | None,
    allow_hooks: bool,
    lock_timeout: float | None,
) -> None:
    """`booth commit ID --only PATH...` (jukebox.booth.partial)."""
    from jukebox.booth.supervisor import commit_booth, pending_changes
    from jukebox.errors import UsageError

    if not paths:
        raise UsageError(f"--only needs the paths to commit: `jukebox booth commit {booth_id} "
                         "--only PATH...`")  # fmt: skip
    changes = commit_booth(
        tapes, booth_id, at, allow_hooks=allow_hooks, lock_timeout=lock_timeout, only=paths
    )
    what = f"checkpoint {at} of booth" if at is not None else "booth"
    if not (tapes.booths_path / f"{booth_id}.json").exists():
        click.echo(f"committed {what} {booth_id}: {changes} change(s), all it had left")
        return
    with pending_changes(tapes, booth_id) as (_store, _base, _target, left):
        remaining = len(left)
    click.echo(
        f"committed {changes} change(s) of {what} {booth_id}; {remaining} change(s) stay "
        f"pending: `jukebox booth diff {booth_id}`"
    )
