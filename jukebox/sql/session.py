"""The booth's one upstream session: the single transaction all of an agent's connections run
in, the order they take turns in, and the booth's own savepoints.

Design: one server session per database per booth, opened at the first connection, holding one
transaction (BEGIN) until the verdict. Agent connections take turns on it: a connection holds
the session from the first message of a unit of work (a simple query, or extended-query messages
up to Sync) until it is back outside a transaction block, so an agent that writes on one
connection and reads on another (a pool) always reads its own writes, exactly as if it had
committed. A connection inside BEGIN … COMMIT keeps the session until its COMMIT: another
connection that wants it meanwhile waits (see `TURN_TIMEOUT`).

Savepoints of the proxy's own (`jukebox_` names the agent may not use):
  jukebox_cp_N  the booth's checkpoint N (jukebox_cp_0 at the start), rolled back to by
                `booth rollback --to N`;
  jukebox_tx    the agent's current unit or transaction block, released by its COMMIT and
                rolled back to by its ROLLBACK or an error outside a block.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from jukebox.sql.upstream import Target, Upstream, UpstreamError, quote_literal

# How long a connection (or a checkpoint) waits for the session while another connection holds
# it in an open transaction, before it gets an error instead of hanging the agent forever.
TURN_TIMEOUT = 30.0
# Waiting on a row lock another client holds ends with an error instead of hanging the booth.
LOCK_TIMEOUT = "30s"


class TurnTimeout(Exception):
    pass


class SqlSession:
    def __init__(self, name: str, target: Target, application_name: str,
                 lock_timeout: float | None = None) -> None:
        self.name = name
        # With --max-sql-lock-seconds the agent waits on others' locks no longer than others
        # may wait on the booth's.
        self.lock_timeout = (f"{max(1, int(lock_timeout * 1000))}ms" if lock_timeout is not None
                             else LOCK_TIMEOUT)
        self.target = target
        self.application_name = application_name
        self.upstream: Upstream | None = None
        self.turn = asyncio.Lock()
        self.holder: Any = None  # the connection that holds the session now
        self.prepared: str | None = None  # the gid of PREPARE TRANSACTION, once done
        self.finished = False
        self.rows_changed = 0
        self._opening = asyncio.Lock()

    async def open(self) -> Upstream:
        """The upstream, connected and inside the booth's transaction (opened once)."""
        async with self._opening:
            if self.upstream is None:
                if self.finished:
                    raise UpstreamError("the booth's database transaction has ended")
                upstream = await Upstream.connect(self.target, self.application_name)
                try:
                    await upstream.query(
                        "BEGIN; SET LOCAL idle_in_transaction_session_timeout = 0; "
                        f"SET LOCAL lock_timeout = {quote_literal(self.lock_timeout)}; "
                        "SAVEPOINT jukebox_cp_0"
                    )
                except BaseException:
                    await upstream.close()
                    raise
                self.upstream = upstream
            return self.upstream

    async def take(self, holder: Any, timeout: float = TURN_TIMEOUT) -> Upstream:
        if self.holder is holder:
            assert self.upstream is not None
            return self.upstream
        try:
            await asyncio.wait_for(self.turn.acquire(), timeout)
        except TimeoutError:
            raise TurnTimeout(
                f"jukebox: another connection of this agent holds the booth's database session "
                f"{self.name!r} in an open transaction (BEGIN without COMMIT) for over "
                f"{timeout:g}s; all of a booth's connections share one session, so commit "
                "that transaction first"
            ) from None
        try:
            upstream = await self.open()
        except BaseException:
            self.turn.release()
            raise
        self.holder = holder
        return upstream

    def give_back(self, holder: Any) -> None:
        if self.holder is holder:
            self.holder = None
            self.turn.release()

    # ------------------------------------------------------------------ the booth's own steps

    async def _own(self, sql: str, timeout: float) -> None:
        if self.upstream is None:  # nothing ran yet: nothing to save or undo
            return
        me = object()
        await self.take(me, timeout)
        try:
            await self.upstream.query(sql)
        finally:
            self.give_back(me)

    async def checkpoint(self, n: int, timeout: float) -> None:
        await self._own(f"SAVEPOINT jukebox_cp_{int(n)}", timeout)

    async def rollback_to(self, n: int, timeout: float) -> None:
        try:
            await self._own(f"ROLLBACK TO SAVEPOINT jukebox_cp_{int(n)}", timeout)
        except UpstreamError as error:
            if error.code == "3B001":  # invalid_savepoint_specification
                raise UpstreamError(
                    f"database {self.name!r} cannot go to checkpoint {n}: an earlier rollback "
                    "went back past it (a database only goes back)"
                ) from None
            raise

    async def end(self, sql: str) -> None:
        """The verdict: COMMIT, ROLLBACK or PREPARE TRANSACTION; the session closes after."""
        self.finished = True
        if self.upstream is None:  # the agent never connected: nothing ran, nothing to end
            return
        me = object()
        await self.take(me, timeout=5.0)
        try:
            if self.upstream is not None:
                await self.upstream.query(sql)
        finally:
            self.give_back(me)
            await self.close()

    async def close(self) -> None:
        self.finished = True
        if self.upstream is not None:
            upstream, self.upstream = self.upstream, None
            with contextlib.suppress(Exception):
                await upstream.close()
