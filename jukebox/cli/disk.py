"""Disk space: rm and prune remove tapes, du says what holds space (jukebox.tape.removal)."""

from __future__ import annotations

from pathlib import Path

import click

from jukebox.cli import cli
from jukebox.cli.options import json_option, listed_tape_dir, tape_dir_option
from jukebox.cli.reading import emit_json

STATUSES = ("committed", "discarded", "rolled_back", "exited", "running", "damaged", "unreadable")

dry_run_option = click.option(
    "--dry-run", is_flag=True, help="Say what would be removed and freed; remove nothing."
)
gc_option = click.option(
    "--gc", "run_gc", is_flag=True, help="Then run `jukebox gc` (else say what it would free)."
)
grace_option = click.option(
    "--grace",
    "grace_seconds",
    type=click.IntRange(min=0),
    default=3600,
    show_default=True,
    help="As `jukebox gc --grace`: unreferenced objects younger than this are kept.",
)


def remove_and_report(home, tapes, dry_run: bool, run_gc: bool, grace: int, as_json: bool,
                      extra: dict | None = None) -> None:  # fmt: skip
    from jukebox.display.render import size
    from jukebox.tape.removal import collect_garbage, remove_tape

    if not dry_run:
        for tape in tapes:
            remove_tape(home, tape)
    collected = collect_garbage(
        home, grace, dry_run=dry_run or not run_gc, gone={t.name for t in tapes} if dry_run else ()
    )
    if as_json:
        emit_json(
            {
                **(extra or {}),
                "dry_run": dry_run,
                "removed": [
                    {"track_id": t.track_id, "bytes": t.bytes, "symlink": t.is_symlink}
                    for t in tapes
                ],
                "gc": {
                    "ran": run_gc and not dry_run,
                    "objects": collected.objects,
                    "bytes_freed": collected.bytes_freed,
                    "store_busy": collected.busy,
                },
            }
        )
        return
    verb = "would remove" if dry_run else "removed"
    for tape in tapes:
        what = "symlink" if tape.is_symlink else size(tape.bytes)
        click.echo(f"{verb} {tape.track_id} ({what})")
    if collected.busy:
        click.echo("the store is busy (a run is writing to it): run `jukebox gc` when it ends")
    elif run_gc and not dry_run:
        click.echo(f"gc freed {size(collected.bytes_freed)} ({collected.objects} object(s))")
    else:
        click.echo(
            f"`jukebox gc` would then free {size(collected.bytes_freed)} "
            f"({collected.objects} object(s); objects younger than {grace}s are kept)"
        )


@cli.command("rm")
@click.argument("tapes", metavar="TAPE…", nargs=-1, required=True)
@tape_dir_option
@dry_run_option
@gc_option
@grace_option
@json_option
def rm_command(
    tapes: tuple[str, ...],
    tape_dir: Path | None,
    dry_run: bool,
    run_gc: bool,
    grace_seconds: int,
    as_json: bool,
) -> None:
    """Delete tapes (tape ids, or .jbx paths in the tape dir), then say what gc frees.

    A tape whose booth is running or pending is refused: commit or discard the booth first.
    Nothing is removed unless every TAPE can be.
    """
    from jukebox.errors import UsageError
    from jukebox.tape.removal import booth_hold, removable_tape, sweep_trash

    home = listed_tape_dir(tape_dir)
    chosen = {}
    for text in tapes:
        tape = removable_tape(home, text)
        held = booth_hold(home, tape.track_id)
        if held:
            raise UsageError(f"tape {tape.track_id} not removed: {held}")
        chosen[tape.name] = tape
    if not dry_run:
        sweep_trash(home)
    remove_and_report(home, list(chosen.values()), dry_run, run_gc, grace_seconds, as_json)


@cli.command("prune")
@click.option(
    "--older-than",
    "older_than",
    required=True,
    metavar="AGE",
    help="Remove tapes whose last frame is older than this: 30m, 12h, 7d, 2w.",
)
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(STATUSES, case_sensitive=False),
    help="Only tapes with this status, as `jukebox ls` shows it (repeatable).",
)
@tape_dir_option
@dry_run_option
@gc_option
@grace_option
@json_option
def prune_command(
    older_than: str,
    statuses: tuple[str, ...],
    tape_dir: Path | None,
    dry_run: bool,
    run_gc: bool,
    grace_seconds: int,
    as_json: bool,
) -> None:
    """Delete the tapes older than AGE (of the --status given), then say what gc frees.

    Tapes of running or pending booths are kept and listed; symlinked tapes are never read,
    so no --status matches them.
    """
    import time

    from jukebox.tape.removal import (
        booth_hold,
        parse_duration,
        sweep_trash,
        tape_age_seconds,
        tape_entries,
    )

    limit = parse_duration(older_than)
    home = listed_tape_dir(tape_dir)
    wanted = {s.upper() for s in statuses}
    now = time.time()
    chosen, held = [], []
    for tape in tape_entries(home):
        age, status = tape_age_seconds(home, tape, now)
        if age < limit or (wanted and status not in wanted):
            continue
        reason = booth_hold(home, tape.track_id)
        if reason:
            held.append({"track_id": tape.track_id, "reason": reason})
        else:
            chosen.append(tape)
    if not dry_run:
        sweep_trash(home)
    remove_and_report(home, chosen, dry_run, run_gc, grace_seconds, as_json, {"kept": held})
    if not as_json:
        for hold in held:
            click.echo(f"kept {hold['track_id']}: {hold['reason']}")


@cli.command("du")
@tape_dir_option
@json_option
def du_command(tape_dir: Path | None, as_json: bool) -> None:
    """What holds space in the tape dir: tapes, the store, booths' scratch, caches."""
    from jukebox.display.render import size, table
    from jukebox.tape.removal import disk_usage

    home = listed_tape_dir(tape_dir)
    usage = disk_usage(home)
    if as_json:
        emit_json({"tape_dir": str(home.path), **usage})
        return
    store, scratch = usage["store"], usage["scratch"]
    rows = [
        ["tapes", f"{usage['tapes']['count']} tape(s)", size(usage["tapes"]["bytes"])],
        ["store packs", f"{store['packs']} pack(s)", size(store["pack_bytes"])],
        ["store index", "", size(store["index_bytes"])],
        ["booth scratch", f"{scratch['booths']} booth(s)", size(scratch["bytes"])],
        [
            "base-tree caches",
            f"{usage['base_tree_caches']['files']} file(s)",
            size(usage["base_tree_caches"]["bytes"]),
        ],
        ["other state", "", size(usage["other_state"]["bytes"])],
        ["total", "", size(usage["total"]["bytes"])],
    ]
    click.echo(f"disk used by {home.path}:")
    click.echo(table(["WHAT", "HOLDS", "ON DISK"], rows, right=(2,)))
