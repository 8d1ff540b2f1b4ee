"""The read side: ls, log, verify, replay, diff, gc."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from jukebox.cli import cli
from jukebox.cli.booth_view import view_path_options
from jukebox.cli.options import json_option, listed_tape_dir, tape_dir_option
from jukebox.cli.reading import (
    check_frame,
    emit_json,
    frame_rows,
    load,
    load_intact,
    open_store,
    replay_offline,
    timeline,
    verify_report,
    whole_tape,
)

if TYPE_CHECKING:
    from jukebox.booth.paths import BoothPaths


image_option = click.option(
    "--image",
    default=None,
    metavar="NAME|PATH|recorded",
    help="--exec: the booth's sandbox image (default: the built-in host image; never the "
    "tape's). `recorded` rebuilds the tape's own image; if it is looser, add "
    "--trust-recorded-image.",
)
trust_option = click.option(
    "--trust-recorded-image",
    is_flag=True,
    help="With --image recorded: run under it even where it loosens the built-in image.",
)


def ls_filter_options(command: Any) -> Any:
    """`ls --status/--since/--agent` (jukebox.tape.filters)."""
    from jukebox.tape.filters import LS_STATUSES

    command = click.option(
        "--agent",
        default=None,
        metavar="TEXT",
        help="Only tapes whose command or agent name holds TEXT.",
    )(command)
    command = click.option(
        "--since",
        default=None,
        metavar="AGE|DATE",
        help="Only tapes started since then: 2h, 7d, 2w ago, or an ISO date like 2026-12-01.",
    )(command)
    return click.option(
        "--status",
        "statuses",
        multiple=True,
        type=click.Choice(LS_STATUSES, case_sensitive=False),
        help="Only tapes with this status (repeatable).",
    )(command)


@cli.command("ls")
@tape_dir_option
@json_option
@ls_filter_options
def ls_command(
    tape_dir: Path | None,
    as_json: bool,
    statuses: tuple[str, ...],
    since: str | None,
    agent: str | None,
) -> None:
    """List the tapes in the tape dir: track id, start time, agent, frames, cost, status."""
    from jukebox.display.render import money, table, timestamp
    from jukebox.display.style import status as status_style
    from jukebox.errors import JukeboxError
    from jukebox.tape.filters import TapeFilter, run_start_of
    from jukebox.tape.tape import Tape

    wanted = TapeFilter.from_options(statuses, since, agent)
    home = listed_tape_dir(tape_dir)
    rows = []
    for path in home.tape_paths():
        start = None
        try:
            loaded = Tape.load(path)
            summary = loaded.summary()
            start = run_start_of(loaded) if wanted.agent is not None else None
        except JukeboxError as error:
            summary = {
                "path": str(path),
                "tape_id": path.stem,
                "status": "UNREADABLE",
                "error": str(error),
            }
        summary["tape_id"] = summary.get("tape_id") or path.stem
        # Reruns under one tape id keep older tapes as `<id>.<n>.jbx`: the file stem is what
        # names each one to `jukebox log`, so it is the track id a user can act on.
        summary["track_id"] = path.stem
        if summary["status"] == "EXITED" and (home.booths_path / f"{path.stem}.json").exists():
            summary["status"] = "PENDING"  # its booth waits for `jukebox booth commit`
        if wanted.matches(summary, start):
            rows.append(summary)
    rows.sort(key=lambda r: r.get("started_ns") or 0)
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo(f"no tapes in {home.path}" + (" match" if wanted.active else ""))
        return
    click.echo(
        table(
            ["TRACK ID", "STARTED", "AGENT NAME", "FRAMES", "COST", "STATUS"],
            (
                [
                    r["track_id"],
                    timestamp(r["started_ns"] / 1e9) if r.get("started_ns") else "-",
                    r.get("name") or "-",
                    r.get("frames", "-"),
                    money(r.get("cost_usd") or 0.0),
                    r["status"] + (" (torn)" if r.get("torn") else ""),
                ]
                for r in rows
            ),
            right=(3, 4),
            paint={5: status_style},
        )
    )


def tape_argument(name: str = "tape"):
    return click.argument(name, metavar="TAPE")


@cli.command("log")
@tape_argument()
@tape_dir_option
@json_option
@click.option(
    "-f",
    "--follow",
    is_flag=True,
    help="Keep printing frames as the run writes them, until it ends (or Ctrl-C); "
    "with --json one object a line.",
)
def log_command(tape: str, tape_dir: Path | None, as_json: bool, follow: bool) -> None:
    """Show a tape's frames as a readable timeline."""
    from jukebox.tape.tapedir import TapeRef

    ref = TapeRef.parse(tape, tape_dir)
    whole_tape(ref, "log", "drop the @{n}")
    if follow:
        from jukebox.tape.follow import follow as follow_tape

        follow_tape(ref.path, ref.tape_dir.booths_path, click.echo, as_json)
        return
    loaded = load(ref)
    damage = loaded.damage  # shown up to the damage, then refused: never printed as healthy
    if as_json:
        emit_json(
            {
                "path": str(ref.path),
                "summary": loaded.summary(),
                "frames": frame_rows(loaded),
                "damage": str(damage) if damage is not None else None,
            }
        )
        sys.exit(1 if damage is not None else 0)
    summary = loaded.summary()
    from jukebox.display.names import printable
    from jukebox.display.render import timestamp

    started = summary.get("started_ns")
    when = f"started {timestamp(started / 1e9)}, " if started else ""
    click.echo(
        printable(
            f"tape {summary['tape_id']}  ({summary.get('name') or 'unnamed'}, "
            f"{summary['status']}, {when}{ref.path})"
        )
    )
    click.echo(timeline(loaded))
    if damage is not None:
        raise damage
    if loaded.torn_tail is not None:
        click.echo(
            f"warning: torn tail at byte {loaded.torn_tail.offset}: {loaded.torn_tail.reason}",
            err=True,
        )


@cli.command("verify")
@tape_argument()
@tape_dir_option
@json_option
def verify_command(tape: str, tape_dir: Path | None, as_json: bool) -> None:
    """Check a tape's hash chain, Merkle root and every object it references. Exit 1 if altered."""
    from jukebox.tape.tapedir import TapeRef

    ref = TapeRef.parse(tape, tape_dir)
    whole_tape(ref, "verify", "drop the @{n} (every frame's hash covers the ones before)")
    from jukebox.display.progress import step

    loaded = load(ref)
    with step("verifying the tape", "frames", done="verified the tape") as tick:
        result = verify_report(loaded, tick)
    report = result.pop("_report")
    if as_json:
        emit_json(result)
        sys.exit(0 if report.ok else 1)
    if not report.ok:
        report.raise_for_problems()
    head = report.head
    click.echo(
        f"ok: {head.count} frame(s) verified; "
        f"head {head.last_frame_id.hex() if head.last_frame_id else '-'}"
        f", merkle root {head.merkle_root.hex()}"
        + ("" if result["objects_checked"] else " (no store beside the tape: objects not checked)")
    )


def mcp_config_option(f):
    """`--mcp-config FILE` of a replay or fork: where its MCP servers' secrets come from."""
    return click.option(
        "--mcp-config",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        metavar="FILE",
        help="--exec: the .mcp.json whose servers' \"headers\" and \"env\" give the values a "
        "tape never keeps (else $JUKEBOX_MCP_HEADER_<SERVER>_<HEADER> and the environment).",
    )(f)


@cli.command("replay")
@tape_argument()
@tape_dir_option
@click.option(
    "--exec",
    "exec_",
    is_flag=True,
    help="Re-run the recorded command in a fresh offline booth against the tape.",
)
@click.option(
    "--strict/--loose",
    "strict",
    default=None,
    help="--exec: model requests must match the recorded ones (default), or are served by order.",
)
@click.option(
    "--until",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="--exec: serve the recording through frame N, go live after it.",
)
@click.option(
    "--record/--no-record",
    default=True,
    help="--exec: keep the replay's own tape <id>-replay-<n> (default) or remove it.",
)
@click.option(
    "--honor-timing",
    is_flag=True,
    help="--exec: answer each model call after its recorded latency, in the recorded order.",
)
@click.option("--fs", type=click.Choice(["fuse", "overlay"]), default=None, help="--exec layer.")
@image_option
@trust_option
@mcp_config_option
@json_option
@view_path_options
def replay_command(
    tape: str,
    tape_dir: Path | None,
    exec_: bool,
    strict: bool | None,
    until: int | None,
    record: bool,
    honor_timing: bool,
    fs: str | None,
    image: str | None,
    trust_recorded_image: bool,
    as_json: bool,
    paths: BoothPaths | None,
    mcp_config: Path | None,
) -> None:
    """Verify a tape, then walk every frame rebuilding the file state at each, offline.

    With --exec, re-run the recorded command in a fresh booth over the recorded base tree, the
    model calls answered from the tape and no network; the first difference from the tape (a
    request, a checkpoint's files, the final files, the exit status) ends it with exit 1.
    """

    if exec_:
        from jukebox.cli.timetravel import run_replay_exec

        mode = "loose" if strict is False else "strict"
        run_replay_exec(
            tape, tape_dir, mode, until, record, fs, as_json, image, trust_recorded_image,
            honor_timing, paths, mcp_config,
        )  # fmt: skip
        return
    if paths is not None:
        from jukebox.errors import UsageError

        raise UsageError("--rw, --ro, --hide and --no-private-tmp shape the booth: add --exec")
    if (
        strict is not None or until is not None or fs is not None or not record
        or image is not None or trust_recorded_image or honor_timing or mcp_config is not None
    ):  # fmt: skip
        from jukebox.errors import UsageError

        raise UsageError(
            "--strict, --loose, --until, --no-record, --honor-timing, --fs, --image, "
            "--trust-recorded-image and --mcp-config re-execute the run: add --exec"
        )
    replay_offline(tape, tape_dir, as_json)


@cli.command("diff")
@click.argument("first", metavar="TAPE@N")
@click.argument("second", metavar="[TAPE@M]", required=False)
@tape_dir_option
@click.option("-p", "--patch", is_flag=True, help="Show line diffs of changed text files.")
@click.option(
    "--markdown",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE",
    help="TAPE_A TAPE_B: write the comparison report to FILE (.md).",
)
@json_option
def diff_command(
    first: str,
    second: str | None,
    tape_dir: Path | None,
    patch: bool,
    markdown: Path | None,
    as_json: bool,
) -> None:
    """What changed in the files between two frames (by default: frame N against the one before).

    `jukebox diff TAPE_A TAPE_B` (two tapes, no @) compares two whole runs instead: the shared
    prefix, then frames, models, messages, tool calls, files, tokens and cost of each side.
    """
    from jukebox.display.names import CHANGE_LETTERS, entry_note, name_json, visible
    from jukebox.errors import UsageError
    from jukebox.review.patch import text_patch
    from jukebox.tape.tapedir import TapeRef
    from shadowfs import tree

    ref_a = TapeRef.parse(first, tape_dir)
    if second is not None:
        ref_b = TapeRef.parse(second, tape_dir)
        if ref_a.frame is None and ref_b.frame is None:
            from jukebox.cli.timetravel import print_comparison

            store = open_store(ref_a.tape_dir)
            if ref_b.tape_dir.path.resolve() == ref_a.tape_dir.path.resolve():
                store_b = store
            else:
                store_b = open_store(ref_b.tape_dir)
            from jukebox.tape.tape import Tape

            print_comparison(
                Tape.load(ref_a.path, store),
                Tape.load(ref_b.path, store_b),
                store,
                markdown,
                as_json,
                (ref_a.path.stem, ref_b.path.stem),
            )
            return
    if markdown is not None:
        raise UsageError(
            "--markdown reports on two whole tapes: write `jukebox diff TAPE_A TAPE_B`"
        )
    tape_a = load_intact(ref_a)
    n = check_frame(tape_a, ref_a)
    if second is None:
        old_tree = tape_a.tree_at(n - 1) if n > 0 else None
        new_tree, tape_b = tape_a.tree_at(n), tape_a
        # Frame 0 has nothing before it: its files are diffed against an empty tree.
        label = f"{ref_a.path}@{n - 1} → @{n}" if n else f"{ref_a.path}@0 (against an empty tree)"
    else:
        tape_b = load_intact(ref_b)
        m = check_frame(tape_b, ref_b)
        old_tree, new_tree = tape_a.tree_at(n), tape_b.tree_at(m)
        label = f"{ref_a.path}@{n} → {ref_b.path}@{m}"
    store = tape_a.store or tape_b.store
    if store is None and (old_tree or new_tree):
        raise UsageError(
            f"no store beside {ref_a.path}: diff needs the tape dir the run was recorded in"
        )
    changes = tree.diff_trees(store, old_tree, new_tree) if store else []
    if as_json:
        emit_json(
            {
                "from_tree": old_tree.hex() if old_tree else None,
                "to_tree": new_tree.hex() if new_tree else None,
                "changes": [
                    # a change has a new entry, an old one, or both
                    {**name_json(c.path), "status": c.status, "kind": (c.new or c.old).kind}  # type: ignore[union-attr]
                    for c in changes
                ],
            }
        )
        return
    from jukebox.display import style

    click.echo(f"diff {label}: {len(changes)} change(s)")
    for change in changes:
        letter = CHANGE_LETTERS.get(change.status, "?")
        e = change.new or change.old
        # What a non-file entry is; plain files keep the short line.
        note = entry_note(e) if e is not None and (e.kind != "file" or e.link) else ""
        click.echo(style.change_line(f"  {letter}  {visible(change.path)}{note}"))
        if patch:
            click.echo(style.patch(text_patch(store, change)), nl=False)


# `jukebox gc` rewrites a pack only once this much of it is garbage (see Store.gc).
GC_MIN_WASTE = 0.25


@cli.command("gc")
@tape_dir_option
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
@click.option(
    "--grace",
    "grace_seconds",
    type=click.IntRange(min=0),
    default=3600,
    show_default=True,
    help="Keep unreferenced objects younger than this many seconds (a run may still need them).",
)
@click.option(
    "--compact",
    is_flag=True,
    help="Rewrite every pack that holds garbage, freeing all of it now (else only packs a "
    "quarter or more garbage are: gc then costs what it removes, not the store's size).",
)
@json_option
def gc_command(
    tape_dir: Path | None, dry_run: bool, grace_seconds: int, compact: bool, as_json: bool
) -> None:
    """Remove store objects that no tape and no pending booth references."""
    from jukebox.tape.liveness import live_objects

    home = listed_tape_dir(tape_dir)
    store = open_store(home)
    if store is None:
        if as_json:
            emit_json({"kept": 0, "removed": 0, "bytes_freed": 0, "dry_run": dry_run})
        else:
            click.echo(f"nothing to collect: no store in {home.path}")
        return
    from jukebox.display.progress import step

    with store:
        with step("gc: scanning tapes", "tapes", done="scanned the tapes") as tick:
            live = live_objects(home, store, progress=tick)
        with step("gc: collecting", "records", done="collected") as tick:
            report = store.gc(
                live, grace_seconds=grace_seconds, dry_run=dry_run, progress=tick,
                min_waste=0.0 if compact else GC_MIN_WASTE,
            )  # fmt: skip
    if as_json:
        emit_json(
            {
                "kept": report.kept,
                "removed": report.removed,
                "bytes_freed": report.bytes_freed,
                "bytes_left": report.bytes_left,
                "dry_run": dry_run,
            }
        )
        return
    verb = "would remove" if dry_run else "removed"
    left = (
        f"; {report.bytes_left} byte(s) of garbage stay in packs until they are a quarter "
        "garbage (--compact frees them now)"
        if report.bytes_left
        else ""
    )
    click.echo(
        f"{verb} {report.removed} object(s), {report.bytes_freed} byte(s); kept {report.kept}"
        + left
    )
