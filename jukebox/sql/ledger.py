"""Prepared database transactions of pending booths, and their end after a crash.

A booth kept pending (or one whose files are being committed) leaves its database work as a
prepared transaction (PREPARE TRANSACTION 'jukebox-ID-NAME'), which survives restarts of the
supervisor and of PostgreSQL. Its ledger, `<state>/sql/ID.json` (0600: it holds the database
URL the booth was given, password included, to finish it later), says where and in which state:

  prepared    the files are not committed: `booth commit` or `booth discard` decides
  committing  the file commit has begun: once the booth's record is gone (the file commit
              finished, here or by recovery) the database commits too

`sweep` runs when a tape dir with ledgers is opened, after the file commits were recovered: a
ledger whose booth record is gone is finished, COMMIT PREPARED when it was committing, else
ROLLBACK PREPARED (its booth was discarded). A commit killed before its files' commit point
and undone by the recovery hands its booth back pending, so its ledger goes back to `prepared`.

A booth never runs against a server without prepared transactions (max_prepared_transactions
= 0) unless it can commit nothing (jukebox.sql.booth_link.BoothDatabases.probe): with a plain
COMMIT after the files, a supervisor stopped between the two would lose the database work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import TYPE_CHECKING, Any

from jukebox.errors import CheckFailed

if TYPE_CHECKING:
    from jukebox.tape.tapedir import TapeDir

PREPARED = "prepared"
COMMITTING = "committing"
LEDGER_DIR = "sql"


def gid(booth_id: str, name: str) -> str:
    return f"jukebox-{booth_id}-{name}"


def _path(tapes: TapeDir, booth_id: str) -> Any:
    return tapes.state / LEDGER_DIR / f"{booth_id}.json"


def read(tapes: TapeDir, booth_id: str) -> dict[str, Any] | None:
    try:
        data = json.loads(_path(tapes, booth_id).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write(tapes: TapeDir, booth_id: str, databases: list[dict[str, str]], state: str) -> None:
    path = tapes.private_dir(LEDGER_DIR) / f"{booth_id}.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        json.dump({"booth": booth_id, "state": state, "databases": databases}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def set_state(tapes: TapeDir, booth_id: str, state: str) -> None:
    data = read(tapes, booth_id)
    if data is not None:
        write(tapes, booth_id, data["databases"], state)


def remove(tapes: TapeDir, booth_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(tapes, booth_id))


async def _finish_one(url: str, gid_: str, commit: bool) -> None:
    from jukebox.sql.upstream import Target, Upstream, UpstreamError, quote_literal

    up = await Upstream.connect(Target.parse(url), "jukebox")
    try:
        verb = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
        try:
            await up.query(f"{verb} {quote_literal(gid_)}")
        except UpstreamError as error:
            if error.code != "42704":  # undefined_object: finished already (by another run)
                raise
    finally:
        await up.close()


def finish(tapes: TapeDir, booth_id: str, commit: bool) -> list[str]:
    """COMMIT PREPARED (or ROLLBACK PREPARED) every database of the booth's ledger, then drops
    the ledger; returns the names done. Raises CheckFailed, keeping the ledger, when a server
    cannot be reached: the next attempt (or `sweep`) finishes it."""
    data = read(tapes, booth_id)
    if data is None:
        return []
    from jukebox.redact import redact_url

    done = []
    for entry in data.get("databases", []):
        if "gid" not in entry:  # an older version's `direct` commit: nothing prepared
            continue
        try:
            asyncio.run(_finish_one(entry["url"], entry["gid"], commit))
        except Exception as error:
            raise CheckFailed(
                f"booth {booth_id}: database {entry.get('name')!r} "
                f"({redact_url(str(entry.get('url')))}) could not "
                f"{'commit' if commit else 'roll back'} its prepared transaction ({error}); "
                "it stays prepared, holding its locks: run the command again once the server "
                "is reachable"
            ) from None
        done.append(entry["name"])
    remove(tapes, booth_id)
    return done


def sweep(tapes: TapeDir) -> None:
    """Finishes the ledgers whose booth has no record any more (see the module docstring)."""
    import sys

    root = tapes.state / LEDGER_DIR
    try:
        names = [n[:-5] for n in os.listdir(root) if n.endswith(".json")]
    except OSError:
        return
    for booth_id in names:
        if (tapes.booths_path / f"{booth_id}.json").exists():
            _pending_again(tapes, booth_id)
            continue
        data = read(tapes, booth_id)
        if data is None:
            continue
        try:
            finish(tapes, booth_id, commit=data.get("state") == COMMITTING)
        except CheckFailed as error:
            print(f"jukebox: {error}", file=sys.stderr)


def _pending_again(tapes: TapeDir, booth_id: str) -> None:
    """A commit killed before its files' commit point, just undone by this process's
    recovery (jukebox.trees.realtree), handed the booth back pending: its transaction, still
    prepared, is pending again too. Left `committing`, anything that later dropped the
    booth's record without `booth discard` would have the next sweep commit it alone."""
    from jukebox.trees.realtree import recovered

    if recovered(tapes, booth_id) != "undone" and not _never_began(tapes, booth_id):
        return  # not recovered here: a live commit of it may be past its files' commit point
    data = read(tapes, booth_id)
    if data is not None and data.get("state") == COMMITTING:
        write(tapes, booth_id, data["databases"], PREPARED)


def _never_began(tapes: TapeDir, booth_id: str) -> bool:
    """Whether the booth's supervisor died before its files' commit began (during or just
    after PREPARE TRANSACTION): its record still says running, with no final state, and no
    file commit of it is under way or left to recover. Its database work is then pending
    with it (or was rolled back by the server): never to be committed alone."""
    from jukebox.booth.supervisor import _alive
    from jukebox.trees.realtree import has_interrupted_commit

    try:
        record = json.loads((tapes.booths_path / f"{booth_id}.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("status") != "running":
        return False
    pid = record.get("pid")
    return (record.get("final_tree") is None and isinstance(pid, int) and not _alive(pid)
            and not has_interrupted_commit(tapes, booth_id))
