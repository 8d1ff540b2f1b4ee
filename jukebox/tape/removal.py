"""Deleting tapes, and what a tape dir holds: the library behind `jukebox rm`, `prune` and `du`.

A tape leaves in two steps: renamed, inside the tape dir, to a hidden trash name that is not a
tape (`.ID.jbx.removing-XXXX`), then unlinked. A kill between them leaves a file no listing
shows, swept by the next removal; never a half-written tape that `ls` would call damaged.
Both steps act on names relative to the tape dir's fd, so a tape that is a symlink (a received
tape dir is untrusted) loses the link, never what it points to, and no tape is read to remove it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from jukebox.errors import UsageError
from jukebox.tape.tapedir import KEPT_SCRATCH, TAPE_SUFFIX, TapeDir, check_tape_id

TRASH_MARK = ".removing-"
_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> int:
    """`30m`, `12h`, `7d`, `2w` as seconds."""
    match = _DURATION.match(text.strip())
    if not match:
        raise UsageError(
            f"bad duration {text!r}: write a number and a unit (s, m, h, d, w), e.g. 30m, 12h, "
            "7d or 2w"
        )
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


@dataclass(frozen=True)
class Removable:
    """A tape file of the tape dir, named by its entry there (never a path to follow)."""

    name: str
    bytes: int
    is_symlink: bool

    @property
    def track_id(self) -> str:
        return self.name[: -len(TAPE_SUFFIX)]


def _entry(home: TapeDir, name: str) -> Removable | None:
    try:
        info = os.lstat(home.path / name)
    except FileNotFoundError:
        return None
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        return None
    return Removable(
        name, info.st_size if stat.S_ISREG(info.st_mode) else 0, stat.S_ISLNK(info.st_mode)
    )


def removable_tape(home: TapeDir, text: str) -> Removable:
    """The tape ``text`` names: a tape id, or a path to a tape directly inside the tape dir."""
    if os.sep in text or text.endswith(TAPE_SUFFIX):
        path = Path(os.path.abspath(text))
        # The parent is resolved, the tape itself never: `rm` acts on the entry, not its target.
        if os.path.realpath(path.parent) != os.path.realpath(home.path):
            raise UsageError(
                f"{text} is not in the tape dir {home.path}: `jukebox rm` removes only tapes of "
                "the tape dir (name its tape dir with --tape-dir)"
            )
        name = path.name
        if not name.endswith(TAPE_SUFFIX):
            raise UsageError(f"{text} is not a tape: name a .jbx file or a tape id")
        check_tape_id(name[: -len(TAPE_SUFFIX)])
    else:
        name = check_tape_id(text) + TAPE_SUFFIX
    found = _entry(home, name)
    if found is None:
        raise UsageError(
            f"no tape {text!r} in {home.path}: list tapes with `jukebox ls --tape-dir {home.path}`"
        )
    return found


def tape_entries(home: TapeDir) -> list[Removable]:
    if not home.path.is_dir():
        return []
    names = sorted(n for n in os.listdir(home.path) if n.endswith(TAPE_SUFFIX))
    return [e for e in (_entry(home, n) for n in names) if e is not None]


def booth_hold(home: TapeDir, track_id: str) -> str | None:
    """Why the booth of this tape keeps it (still running, or pending its verdict), or None.

    Any record there holds the tape, even one that cannot be read: removing the tape under a
    pending booth would leave a booth that can be neither committed nor checked."""
    from jukebox.booth.supervisor import _alive

    record = home.booths_path / f"{track_id}.json"
    if not os.path.lexists(record):
        return None
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        data = {}
    data = data if isinstance(data, dict) else {}
    pid = data.get("pid")
    if data.get("status") == "running" and isinstance(pid, int) and _alive(pid):
        return (
            f"booth {track_id} is still running (pid {data['pid']}): wait for it to end, then "
            f"`jukebox booth commit {track_id}` or `jukebox booth discard {track_id}`"
        )
    return (
        f"booth {track_id} is pending: `jukebox booth commit {track_id}` or "
        f"`jukebox booth discard {track_id}` first"
    )


def sweep_trash(home: TapeDir) -> None:
    """Unlinks what a removal killed between its two steps left behind."""
    if not home.path.is_dir():
        return
    for name in os.listdir(home.path):
        if name.startswith(".") and TRASH_MARK in name and TAPE_SUFFIX in name:
            try:
                os.unlink(home.path / name)  # the entry itself: a symlink is not followed
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                continue


def remove_tape(home: TapeDir, tape: Removable) -> None:
    """Renames the entry to a trash name, then unlinks it, both relative to the dir's fd."""
    dir_fd = os.open(home.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        trash = f".{tape.name}{TRASH_MARK}{secrets.token_hex(4)}"
        os.rename(tape.name, trash, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)  # from here on, no listing shows the tape
        os.unlink(trash, dir_fd=dir_fd)
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def tape_age_seconds(home: TapeDir, tape: Removable, now: float) -> tuple[float, str]:
    """How long ago the tape's last frame was written, and its status (as `ls` shows it).

    A symlinked tape is never read (its target may be anything): it is aged by the link and its
    status is `SYMLINK`."""
    from jukebox.errors import JukeboxError
    from jukebox.tape.tape import Tape

    path = home.path / tape.name
    if tape.is_symlink:
        return now - os.lstat(path).st_mtime, "SYMLINK"
    try:
        summary = Tape.load(path).summary()
    except (JukeboxError, OSError):
        return now - os.lstat(path).st_mtime, "UNREADABLE"
    started = summary.get("started_ns")
    if not started:
        return now - os.lstat(path).st_mtime, summary["status"]
    return now - (started + summary.get("duration_ns", 0)) / 1e9, summary["status"]


@dataclass(frozen=True)
class Collected:
    objects: int
    bytes_freed: int
    busy: bool = False


def collect_garbage(
    home: TapeDir, grace_seconds: float, dry_run: bool, gone: Collection[str] = ()
) -> Collected:
    """What `jukebox gc` frees (or, not dry, frees it). A store another run is writing to is
    reported busy, not an error: the tapes are gone either way, gc can run later.
    ``gone``: tapes to count as removed already (a dry run of a removal)."""
    from jukebox.tape.liveness import live_objects
    from shadowfs.errors import StoreBusy
    from shadowfs.store import Store

    if not home.store_path.is_dir():
        return Collected(0, 0)
    with Store.open(home.store_path, create=False) as store:
        try:
            report = store.gc(
                live_objects(home, store, excluding=gone),
                grace_seconds=grace_seconds,
                dry_run=dry_run,
            )
        except StoreBusy:
            return Collected(0, 0, busy=True)
    return Collected(report.removed, report.bytes_freed)


# --------------------------------------------------------------------------- du


def _walk_sizes(
    root: Path, skip: Callable[[str], bool] = lambda _: False
) -> Iterator[os.stat_result]:
    """lstat of every entry under ``root``: no symlink followed, no mount point crossed."""
    try:
        top = os.lstat(root)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(top.st_mode):
        yield top
        return
    pending = [root]
    while pending:
        here = pending.pop()
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for entry in entries:
            if here == root and skip(entry.name):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            yield info
            if stat.S_ISDIR(info.st_mode) and info.st_dev == top.st_dev:
                pending.append(Path(entry.path))


def _disk_bytes(infos: Iterator[os.stat_result]) -> tuple[int, int]:
    """(files, bytes on disk): what each takes, a sparse file's holes not counted."""
    files = used = 0
    for info in infos:
        used += info.st_blocks * 512
        files += stat.S_ISREG(info.st_mode)
    return files, used


def disk_usage(home: TapeDir) -> dict[str, dict[str, int]]:
    """Bytes on disk by what holds them: tapes, the store (packs and index), the scratch of
    booths not yet committed or discarded, base-tree caches, and the rest of the state dir."""
    tapes = [e for e in tape_entries(home) if not e.is_symlink]
    _, tape_bytes = _disk_bytes(os.lstat(home.path / e.name) for e in tapes)
    packs_dir = home.store_path / "packs"
    packs, pack_bytes = _disk_bytes(_walk_sizes(packs_dir))
    _, store_bytes = _disk_bytes(_walk_sizes(home.store_path))
    # Running booths' scratch, and pending booths' kept until their commit or discard.
    scratch_dirs = (home.state / "scratch", home.kept_path)
    booths = sum(len(os.listdir(d)) for d in scratch_dirs if d.is_dir())
    _, scratch_bytes = _disk_bytes(info for d in scratch_dirs for info in _walk_sizes(d))
    cache_files, cache_bytes = _disk_bytes(
        info
        for part in ("base-trees.json", "base-tree-stats")
        for info in _walk_sizes(home.state / part)
    )
    accounted = {"store", "scratch", KEPT_SCRATCH, "base-trees.json", "base-tree-stats", "mnt"}
    # mnt/ holds running booths' mount points: walking one would read an agent's view.
    _, other_bytes = _disk_bytes(_walk_sizes(home.state, skip=accounted.__contains__))
    usage = {
        "tapes": {"count": len(tapes), "bytes": tape_bytes},
        "store": {
            "packs": packs,
            "pack_bytes": pack_bytes,
            "index_bytes": store_bytes - pack_bytes,
            "bytes": store_bytes,
        },
        "scratch": {"booths": booths, "bytes": scratch_bytes},
        "base_tree_caches": {"files": cache_files, "bytes": cache_bytes},
        "other_state": {"bytes": other_bytes},
    }
    usage["total"] = {"bytes": sum(part["bytes"] for part in usage.values())}
    return usage
