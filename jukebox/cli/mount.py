"""`jukebox mount TAPE[@N] DIR` and `jukebox umount DIR`: the files at any frame, read-only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from jukebox.cli import cli
from jukebox.cli.options import tape_dir_option
from jukebox.cli.reading import check_frame, load_intact


@cli.command("mount")
@click.argument("tape", metavar="TAPE[@N]")
@click.argument("directory", metavar="DIR", type=click.Path(path_type=Path))
@tape_dir_option
@click.option(
    "--force", is_flag=True, help="Mount over a folder that is not empty (its files hidden)."
)
def mount_command(tape: str, directory: Path, tape_dir: Path | None, force: bool) -> None:
    """Show the files at frame N (default: the last) read-only at DIR until `jukebox umount`."""
    from jukebox.errors import UsageError
    from jukebox.tape.tapedir import TapeRef

    ref = TapeRef.parse(tape, tape_dir)
    loaded = load_intact(ref)
    n = check_frame(loaded, ref)
    tree_id = loaded.tree_at(n)
    if tree_id is None:
        raise UsageError(
            f"frame {n} of {ref.path} comes before any file state was recorded: "
            "pick a later frame (see `jukebox log`)"
        )
    if loaded.store is None:
        raise UsageError(f"no store beside {ref.path}: mount needs the tape dir it was recorded in")
    if not directory.is_dir():
        raise UsageError(f"mount point {directory} is not a directory: create it first")
    if os.path.ismount(directory):
        raise UsageError(
            f"{directory} is already a mount point: `jukebox umount {directory}` first"
        )
    if not force and _has_entries(directory):
        raise UsageError(
            f"{directory} is not empty: the mount would hide its files until `jukebox umount`; "
            "choose an empty folder, or add --force"
        )
    import subprocess

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shadowfs.view",
            str(ref.tape_dir.store_path),
            tree_id.hex(),
            str(directory),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        message = (proc.stderr.strip().splitlines() or ["the view daemon failed"])[-1]
        raise UsageError(
            f"could not mount {ref.path}@{n} at {directory}: {message.removeprefix('error: ')}"
        )
    click.echo(
        f"mounted {ref.path}@{n} (tree {tree_id.hex()[:12]}) read-only at {directory}; "
        f"`jukebox umount {directory}` to unmount"
    )


def _has_entries(directory: Path) -> bool:
    with os.scandir(directory) as entries:
        return next(entries, None) is not None


@cli.command("umount")
@click.argument("directory", metavar="DIR", type=click.Path(path_type=Path))
def umount_command(directory: Path) -> None:
    """Unmount a tape mounted with `jukebox mount` (and nothing else)."""
    from jukebox.errors import UsageError
    from shadowfs.mountinfo import mounts_at
    from shadowfs.view import is_view, unmount

    target = os.path.realpath(directory)
    if not os.path.ismount(target):
        raise UsageError(f"{directory} is not a mount point: nothing to unmount")
    if not is_view(target):
        found = mounts_at(target)
        what = f"a {found[-1].fstype} mount" if found else "a mount"
        raise UsageError(
            f"{directory} is {what}, not a tape `jukebox mount` made: jukebox leaves it "
            "alone (use umount(8) if you mean it)"
        )
    unmount(target)
    click.echo(f"unmounted {directory}")
