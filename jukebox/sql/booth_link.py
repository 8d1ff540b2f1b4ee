"""The databases of one booth (`booth run --pg NAME=URL`): the proxies started with the booth,
the agent's environment pointing at them, checkpoints and rollbacks taken in the same request as
the files', and the verdict (COMMIT, ROLLBACK, or PREPARE TRANSACTION for a pending booth; see
jukebox.sql.ledger).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jukebox.booth.control import RequestError
from jukebox.errors import UsageError
from jukebox.sql import ledger
from jukebox.sql.server import SqlProxy
from jukebox.sql.session import TurnTimeout
from jukebox.sql.upstream import Target, Upstream, UpstreamError

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,30}$")
# How long a checkpoint or rollback waits for an agent connection to end its open transaction.
CONTROL_TIMEOUT = 10.0


def parse_specs(specs: Iterable[str]) -> dict[str, str]:
    """`NAME=postgresql://…` values of --pg, checked: {name: url}. UsageError names the bad one."""
    out: dict[str, str] = {}
    for spec in specs:
        name, eq, url = spec.partition("=")
        if not eq or not NAME_RE.match(name):
            raise UsageError(
                f"bad --pg {spec.split('=')[0]!r}=…: write --pg NAME=postgresql://user@host:port/db"
                " with NAME a letter then letters, digits or _"
            )
        if name in out:
            raise UsageError(f"--pg {name} is given twice: one URL per name")
        try:
            Target.parse(url)
        except ValueError as error:
            raise UsageError(f"bad --pg {name} URL: {error}; write postgresql://user@host:port/db"
                             ) from None
        out[name] = url
    return out


async def _probe(target: Target) -> int:
    up = await Upstream.connect(target, "jukebox probe")
    try:
        return int(await up.scalar("SHOW max_prepared_transactions") or 0)
    finally:
        await up.close()


async def _after_frames(db: Any, step: Any) -> Any:
    """`step` (a checkpoint, a rollback), once the statements answered before it are on the
    tape before its own frame."""
    db.write_frames()
    return await step


class BoothDatabases:
    def __init__(self, proxy: SqlProxy, urls: dict[str, str]) -> None:
        self.proxy = proxy
        self.urls = urls

    @staticmethod
    def probe(urls: Mapping[str, str], needs_two_phase: bool) -> None:
        """Checks every server is reachable and, for a booth whose work may be committed or
        kept pending, takes prepared transactions, before anything of the booth is made.
        UsageError otherwise.

        Without prepared transactions a commit could not be atomic: the files, then COMMIT,
        and a supervisor stopped between the two would leave the files committed and the
        database work rolled back by the server; a booth kept pending would lose it outright.
        So such a server is refused unless nothing can be committed (a scratch booth)."""
        for name, url in urls.items():
            target = Target.parse(url)
            try:
                two_phase = asyncio.run(_probe(target)) > 0
            except (OSError, UpstreamError, asyncio.IncompleteReadError) as error:
                raise UsageError(
                    f"--pg {name}: cannot connect to {target.public_url()} ({error}); start the "
                    "server or fix the URL"
                ) from None
            if needs_two_phase and not two_phase:
                raise UsageError(
                    f"--pg {name}: the server {target.public_url()} has "
                    "max_prepared_transactions = 0, so the booth's database work cannot commit "
                    "atomically with its files; set max_prepared_transactions to 1 or more on "
                    "that server (postgresql.conf, or ALTER SYSTEM SET "
                    "max_prepared_transactions = 10) and restart it"
                )

    @classmethod
    def start(
        cls,
        urls: Mapping[str, str],
        *,
        record: Callable[[str, dict[str, Any]], Any],
        booth_id: str,
        secrets: Iterable[str],
        listen: Callable[[], socket.socket] | None,
        max_rows_changed: int | None,
        on_trip: Callable[[Any], Any] | None,
        record_results: bool = False,
        max_lock_seconds: float | None = None,
    ) -> BoothDatabases:
        """The proxies, listening (see `probe`, called first)."""
        targets = {name: Target.parse(url) for name, url in urls.items()}
        record("note", {"event": "sql_databases",
                        "databases": {n: t.public_url() for n, t in targets.items()}})
        proxy = SqlProxy(targets, record, booth_id, secrets=secrets, listen=listen,
                         max_rows_changed=max_rows_changed, on_trip=on_trip,
                         record_results=record_results,
                         max_lock_seconds=max_lock_seconds, apart=True).start()
        return cls(proxy, dict(urls))

    def agent_env(self) -> dict[str, str]:
        """DATABASE_URL and PG* for the first database, NAME_DATABASE_URL for each."""
        out: dict[str, str] = {}
        for i, (name, db) in enumerate(self.proxy.databases.items()):
            url = f"postgresql://{db.target.user}@127.0.0.1:{db.port}/{db.target.database}"
            out[f"{name.upper()}_DATABASE_URL"] = url
            if i == 0:
                out.update({
                    "DATABASE_URL": url, "PGHOST": "127.0.0.1", "PGPORT": str(db.port),
                    "PGUSER": db.target.user, "PGDATABASE": db.target.database,
                    "PGSSLMODE": "disable",
                })
        return out

    def _each(self, step: Callable[[Any], Any], what: str) -> None:
        for name, db in self.proxy.databases.items():
            try:
                self.proxy.call(_after_frames(db, step(db.session)),
                                timeout=CONTROL_TIMEOUT + 30)
            except TurnTimeout as error:
                raise RequestError(f"database {name}: {what} waited too long: {error}") from None
            except (UpstreamError, OSError) as error:
                raise RequestError(f"database {name}: {what} failed: {error}") from None

    def checkpoint(self, n: int) -> None:
        self._each(lambda s: s.checkpoint(n, CONTROL_TIMEOUT), f"checkpoint {n}")

    def rollback(self, n: int) -> None:
        self._each(lambda s: s.rollback_to(n, CONTROL_TIMEOUT), f"rollback to {n}")

    def used(self) -> list[str]:
        """The databases whose transaction is open: the agent connected, no verdict yet."""
        return [name for name, db in self.proxy.databases.items()
                if db.session.upstream is not None]

    def prepare(self, tapes: Any, booth_id: str, state: str) -> None:
        """PREPARE TRANSACTION on every database, its ledger written first (a crash between
        leaves a ledger whose gid may not exist: finishing it is then a no-op)."""
        from jukebox.sql.upstream import quote_literal

        # A database the agent never connected to has nothing to prepare.
        used = self.used()
        entries = [{"name": name, "url": self.urls[name], "gid": ledger.gid(booth_id, name)}
                   for name in used]
        if not entries:
            return
        ledger.write(tapes, booth_id, entries, state)
        # Crash tests (shadowfs.commit's SHADOWFS_CRASH_AT): `sql-prepare` kills the process
        # with PREPARE TRANSACTION sent, before its answer (the server may finish it or not);
        # `sql-prepared` once the server has answered it, before anything else is recorded.
        from shadowfs.commit import CRASH_ENV  # the verdict's file commit imports it anyway

        point = os.environ.get(CRASH_ENV)
        for entry in entries:
            session = self.proxy.databases[entry["name"]].session
            self.proxy.call(_after_frames(
                self.proxy.databases[entry["name"]],
                session.end(f"PREPARE TRANSACTION {quote_literal(entry['gid'])}",
                            die_when_sent=point == "sql-prepare")), timeout=60)
            if point == "sql-prepared":
                os.kill(os.getpid(), signal.SIGKILL)

    def end(self, sql: str) -> None:
        """ROLLBACK every database (or, unused since `prepare`, COMMIT)."""
        errors = []
        for name, db in self.proxy.databases.items():
            try:
                self.proxy.call(_after_frames(db, db.session.end(sql)), timeout=60)
            except Exception as error:
                errors.append(f"{name}: {error}")
        if errors:
            raise UpstreamError("; ".join(errors))

    def close(self) -> None:
        self.proxy.stop()
