"""The booth's one upstream session: the single transaction all of an agent's connections run
in, the order they take turns in, and the booth's own savepoints.

Design: one server session per database per booth, opened at the first connection, holding one
transaction (BEGIN) until the verdict. Agent connections take turns on it, a unit of work at a
time (a simple query, or extended-query messages up to Sync: the *wire*), so an agent that
writes on one connection and reads on another (a pool) always reads its own writes, exactly as
if it had committed.

Transaction blocks of several connections may be open at once. A block's savepoint (jukebox_tx)
stays on the session between its units: the *attached* block, one at a time. Whoever needs the
session while a block that has only read so far is attached and idle *detaches* it (RELEASE:
its reads need no undoing); its next unit takes a fresh savepoint, which is then its rollback
point, before its first write. A block that wrote cannot be detached: until its COMMIT or
ROLLBACK, other connections' units that only read run nested inside it (and see its uncommitted
rows), and a unit that writes waits for it (see `TURN_TIMEOUT`): its work would otherwise
vanish with that block's rollback. A block in error keeps the wire until its ROLLBACK.

Savepoints of the proxy's own (`jukebox_` names the agent may not use):
  jukebox_cp_N  the booth's checkpoint N (jukebox_cp_0 at the start), rolled back to by
                `booth rollback --to N`;
  jukebox_tx    the agent's current unit or transaction block, released by its COMMIT and
                rolled back to by its ROLLBACK or an error outside a block.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from typing import Any

from jukebox.errors import JukeboxError
from jukebox.sql import messages as m
from jukebox.sql.upstream import Target, Upstream, UpstreamError, quote_literal

# How long a connection (or a checkpoint) waits for the session while another connection holds
# it in an open transaction, before it gets an error instead of hanging the agent forever.
TURN_TIMEOUT = 30.0
# Waiting on a row lock another client holds ends with an error instead of hanging the booth.
LOCK_TIMEOUT = "30s"


class TurnTimeout(JukeboxError):
    pass


# `pending_on` of checkpoints whose block a rollback under way undoes (no connection's).
_UNDONE = object()


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
        self.wire = asyncio.Lock()
        self.holder: Any = None  # who holds the wire now (a connection, or the booth's own step)
        self.attached: Any = None  # the connection whose block's savepoint is on the session
        # Set (and replaced) when the wire is given back or a block attached or ended: what a
        # write waiting for another connection's block waits on.
        self.changed = asyncio.Event()
        self._watching = 0  # waits on `changed` under way (none: nothing to tell)
        self.prepared: str | None = None  # the gid of PREPARE TRANSACTION, once done
        self.finished = False
        self.rows_changed = 0
        # The booth's checkpoints with a savepoint on the session (0 from its start; one taken
        # before the agent first connected has none: nothing had run), and those a rollback
        # went back past. Known here, a rollback to one of those is refused before it is sent:
        # a ROLLBACK TO a savepoint that is not there would abort the booth's transaction.
        self.points: list[int] = []
        self.taken = 0  # the highest checkpoint number asked for
        self.gone: set[int] = set()
        # Checkpoints asked for while a block of the agent's that wrote (or failed) was open:
        # the committed state then is the state before that block (`pending_on`), where its
        # own savepoint jukebox_tx is. They are answered at once and get their savepoint when
        # the block ends (`block_ends`), or the block's undoing takes them along.
        self.pending: list[int] = []
        self.pending_on: Any = None
        # Checkpoints whose savepoint jukebox_cp_N sits above the work of the block that was
        # open when they were taken, which then committed: that block's jukebox_tx was kept
        # under its work, and going back to N goes back to it (`rollback_to`).
        self.deferred: set[int] = set()
        # Checkpoints whose block a failed bookkeeping query undid, until the rollback that
        # follows takes their savepoint (`block_lost`).
        self.stranded: list[int] = []
        self.placing = 0  # the checkpoint the last `block_ends` placed
        self._opening = asyncio.Lock()
        self._waiting = 0  # takers waiting for the wire (a free wire goes to them first)

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
                self.points = [0]
            return self.upstream

    def blocked_by(self, holder: Any) -> bool:
        """Whether a block that wrote, of another connection, is attached (its writes would
        nest in it); an idle block that only read is detached here first."""
        other = self.attached
        if other is None or other is holder:
            return False
        if not other.wrote and self.holder is None and self.upstream is not None:
            other.detach(self.upstream)
            self.attached = None
            return False
        return True

    async def take(self, holder: Any, write: bool = True,
                   timeout: float = TURN_TIMEOUT) -> Upstream:
        """The wire, for one unit of `holder`; with `write`, also no other connection's
        written block attached (waited for)."""
        if self.holder is holder:
            assert self.upstream is not None
            return self.upstream
        if (self.upstream is not None and not self.wire.locked() and not self._waiting
                and not (write and self.blocked_by(holder))):
            # The common case, a free wire: taken without wait_for's task and its two turns
            # of the event loop, a cost every statement paid.
            await self.wire.acquire()  # a free asyncio.Lock is taken without yielding
            self.holder = holder
            return self.upstream
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                if write and self.blocked_by(holder):
                    await self._watch(left)
                    continue
                self._waiting += 1
                try:
                    await asyncio.wait_for(self.wire.acquire(),
                                           max(0.001, deadline - loop.time()))
                finally:
                    self._waiting -= 1
                if write and self.blocked_by(holder):  # a block attached while we waited
                    self.wire.release()
                    continue
                break
        except TimeoutError:
            raise TurnTimeout(
                f"jukebox: another connection of this agent has an open transaction that "
                f"wrote (BEGIN, a write, no COMMIT yet) on the booth's database {self.name!r} "
                f"for over {timeout:g}s; all of a booth's connections share one session, so "
                "a write waits for that transaction's COMMIT or ROLLBACK: end it first"
            ) from None
        self.holder = holder
        try:
            return await self.open()
        except BaseException:
            self.give_back(holder)
            raise

    def idle(self) -> bool:
        """Nobody waits for the wire (nor for a block to end): the holder's next unit is
        likely the next to use it."""
        return not self._waiting and not self._watching

    def give_back(self, holder: Any) -> None:
        if self.holder is holder:
            self.holder = None
            self.wire.release()
            self.notify()

    def set_attached(self, holder: Any, attached: bool) -> None:
        """`holder`'s block keeps its savepoint on the session, or no longer does."""
        if attached:
            self.attached = holder
        elif self.attached is holder:
            self.attached = None
        self.notify()

    def notify(self) -> None:
        if self._watching:  # a fresh Event at every statement's end was a cost of its own
            changed, self.changed = self.changed, asyncio.Event()
            changed.set()

    async def _watch(self, timeout: float) -> None:
        self._watching += 1
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        finally:
            self._watching -= 1

    # ------------------------------------------------------------------ the booth's own steps

    async def _own(self, sql: str, timeout: float) -> None:
        if self.upstream is None:  # nothing ran yet: nothing to save or undo
            return
        me = object()
        await self.take(me, timeout=timeout)
        try:
            await self.upstream.query(sql)
        finally:
            self.give_back(me)

    async def _turn(
        self, me: object, timeout: float, waiter: str,
        first: Callable[[], None] | None = None, instead: Callable[[], bool] | None = None,
    ) -> bool:  # fmt: skip
        """The wire for a checkpoint or a rollback (`waiter`), once no unit runs on it: True
        when taken. At each look `first` runs, and `instead`, when the wire is not free, may
        answer the caller another way (False: the wire is not taken). A unit running now is
        waited for up to `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if first is not None:
                first()
            if not self.wire.locked() and not self._waiting and not self.blocked_by(me):
                await self.wire.acquire()  # free, nobody waiting: taken without yielding
                self.holder = me
                return True
            if instead is not None and instead():
                return False
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                await self._watch(left)
            except TimeoutError:
                raise TurnTimeout(
                    f"jukebox: a statement of the agent on the booth's database {self.name!r} "
                    f"ran for over {timeout:g}s; the {waiter} waits for it to end"
                ) from None

    async def checkpoint(self, n: int, timeout: float) -> None:
        """SAVEPOINT jukebox_cp_N, or, while a block of the agent that wrote (or failed) is
        open, a checkpoint at the state before that block, answered at once (see `pending`):
        the block has not committed, so the committed state is the one its savepoint marks.
        Only a unit running now is waited for (up to `timeout`)."""
        self.taken = max(self.taken, n)
        if self.upstream is None:
            return
        me = object()

        def parked() -> bool:
            block = self._open_block()
            if block is None:
                return False
            self.pending.append(n)
            self.pending_on = block
            return True

        if not await self._turn(me, timeout, "checkpoint", instead=parked):
            return
        try:
            if self.upstream is None:
                raise UpstreamError("the booth's database session has ended")
            await self.upstream.query(f"SAVEPOINT jukebox_cp_{int(n)}")
            self.points.append(n)
        finally:
            self.give_back(me)

    def _open_block(self) -> Any:
        """The agent's open block a checkpoint is taken before, when no unit is running: the
        attached block that wrote, else a failed block parked on the session."""
        holder = self.holder
        if holder is not None and not getattr(holder, "parked", False):
            return None  # a unit is running: waited for
        attached = self.attached
        if attached is not None and attached.wrote:
            return attached
        return holder

    def block_ends(self, conn: Any, how: str) -> str:
        """`conn`'s block ends (`how`: "commit" or "rollback") while checkpoints wait for it:
        the SQL that ends it and gives them their savepoint, in place of the usual RELEASE or
        ROLLBACK TO of jukebox_tx. A rollback leaves the state before the block: the savepoint
        is taken there. A commit keeps the block's jukebox_tx under its work (the state
        before it) and takes jukebox_cp_N above (`deferred`); the agent's own savepoints
        still open in the block are released first (`jukebox_in` marks the first)."""
        first = self.pending[0]
        self.pending, self.pending_on = [], None
        self.points.append(first)
        self.placing = first
        if how == "rollback":
            sql = "ROLLBACK TO SAVEPOINT jukebox_tx; RELEASE SAVEPOINT jukebox_tx; "
            other = self.attached
            if other is not None and other is not conn and not other.wrote:
                # A failed unit inside another's idle block that only read: that block's
                # savepoint is under this one, and its reads need no undoing (detached).
                sql += "RELEASE SAVEPOINT jukebox_tx; "
                other.attached = False
                self.attached = None
                self.notify()
            return f"{sql}SAVEPOINT jukebox_cp_{first}"
        self.deferred.add(first)
        release = "RELEASE SAVEPOINT jukebox_in; " if conn.marked else ""
        return f"{release}SAVEPOINT jukebox_cp_{first}"

    def block_end_failed(self) -> None:
        """The query `block_ends` made failed: the checkpoint it was to place has no savepoint
        (a rollback to it would abort the booth's transaction). Its block is undone next,
        back to its savepoint, the state the checkpoint is: it is taken there, as for a block
        a failed bookkeeping query undid (`place_stranded`)."""
        first = self.placing
        if first in self.points:
            self.points.remove(first)
            self.deferred.discard(first)
            self.stranded.append(first)

    def block_lost(self, conn: Any) -> None:
        """`conn`'s block is undone by a failed bookkeeping query of its own, read by another
        unit: that unit's own SAVEPOINT was refused in the aborted transaction, so its
        rollback (`ROLLBACK TO SAVEPOINT jukebox_tx`) goes back to the block's savepoint, the
        state before the block, which is what checkpoints waiting for the block are: their
        savepoint is taken there (`place_stranded`)."""
        if self.pending_on is conn:
            self.stranded = self.pending
            self.pending, self.pending_on = [], None

    def place_stranded(self) -> str:
        """The SQL that gives checkpoints stranded by `block_lost` their savepoint, to follow
        the rollback of the unit that read the failure."""
        if not self.stranded:
            return ""
        first = self.stranded[0]
        self.stranded = []
        self.points.append(first)
        return f"; SAVEPOINT jukebox_cp_{int(first)}"

    async def rollback_to(self, n: int, timeout: float) -> None:
        """ROLLBACK TO SAVEPOINT jukebox_cp_N. Open blocks of the agent's connections are
        part of what goes back: a block that wrote, or one that failed and keeps the wire,
        has its savepoint after checkpoint N, so it is undone with the rest and told so at
        its next statement (`AgentConnection.undo`), rather than waited for: the agent asking
        for the rollback is often the one holding that block open, and waiting would only
        time out. A unit running now is waited for (up to `timeout`)."""
        if n in self.stranded:  # its block's undoing is not over: nowhere to go yet
            raise UpstreamError(
                f"database {self.name!r} cannot go to checkpoint {n} yet: the transaction it "
                "was taken before failed and is still being undone; try again"
            )
        if n in self.gone:
            raise UpstreamError(
                f"database {self.name!r} cannot go to checkpoint {n}: an earlier rollback "
                "went back past it (a database only goes back)"
            )
        if self.upstream is None:  # nothing ran yet: nothing to undo
            return
        me = object()
        pops = 0  # units parked on a block checkpoints wait for, whose savepoints go first
        reader = None  # an idle block that has only read, whose savepoint the rollback ends

        def undo_blocks() -> None:
            nonlocal pops, reader
            pops += self._undo_blocks(n)
            other = self.attached
            if (other is not None and not other.wrote and not self.wire.locked()
                    and not self._waiting):
                # The wire is the rollback's now (`_turn`). Detached by the rollback's own SQL,
                # not by a RELEASE ahead of it: a failed unit of another connection inside
                # that block has the transaction aborted, and the RELEASE would fail there,
                # failing the block that had only read.
                other.attached = False
                self.attached = None
                reader = other

        await self._turn(me, timeout, "rollback", first=undo_blocks)
        try:
            if self.upstream is None:
                raise UpstreamError("the booth's database session has ended")
            undo = "ROLLBACK TO SAVEPOINT jukebox_tx; RELEASE SAVEPOINT jukebox_tx; "
            if self.pending and n >= self.pending[0]:
                # To a checkpoint taken while a block was open, which is undone now: the
                # state before it, its jukebox_tx (under a failed unit parked inside it).
                point = self.pending[0]
                # A block that only read, whose failed unit parked inside it was that block:
                # its savepoint is just under that unit's, and goes too (it read only).
                release = "RELEASE SAVEPOINT jukebox_tx; " if reader is not None else ""
                sql = undo * pops + f"{undo}{release}SAVEPOINT jukebox_cp_{point}"
                self.points.append(point)
            else:
                # A checkpoint taken before the agent's first connection is the start. A block
                # that only read attached now took its savepoint after that checkpoint: it
                # goes with the rest, its reads need no undoing.
                point = max(p for p in self.points if p <= n)
                sql = f"ROLLBACK TO SAVEPOINT jukebox_cp_{int(point)}"
                if point in self.deferred:  # back to the kept jukebox_tx under that block
                    sql += f"; {undo}SAVEPOINT jukebox_cp_{point}"
            await self.upstream.query(sql)
            self.pending, self.pending_on = [], None
            self.points = [p for p in self.points if p <= point]
            self.deferred = {p for p in self.deferred if p < point}
            self.stranded = [p for p in self.stranded if p <= point]
            self.gone.update(range(n + 1, self.taken + 1))
        finally:
            self.give_back(me)

    def _undo_blocks(self, n: int) -> int:
        """Before rollback to checkpoint N: a connection parked in a failed block gives the
        wire up, and the attached block, if it wrote, is dropped; both are undone. Returns 1
        when the parked one was a unit inside the block checkpoints wait for."""
        holder = self.holder
        inside = 0
        if holder is not None and getattr(holder, "parked", False):
            inside = int(self.pending_on is not None and holder is not self.pending_on)
            self._disown(holder)
            holder.undo(n)
            if self.attached is holder:
                self.attached = None
            self.holder = None
            self.wire.release()
        attached = self.attached
        if attached is not None and attached.wrote and attached is not self.holder:
            self._disown(attached)
            attached.undo(n)
            self.attached = None
        if holder is not self.holder or attached is not self.attached:
            self.notify()  # writes that waited for that block may go once the rollback is done
        return inside

    def _disown(self, conn: Any) -> None:
        """`conn`'s block is undone by the rollback under way, which takes the checkpoints
        waiting for it (`pending`) to the state before it: its own end no longer does."""
        if self.pending_on is conn:
            self.pending_on = _UNDONE

    async def end(self, sql: str, die_when_sent: bool = False) -> None:
        """The verdict: COMMIT, ROLLBACK or PREPARE TRANSACTION; the session closes after.
        `die_when_sent`: a crash test's SIGKILL once `sql` has left, before its answer."""
        self.finished = True
        if self.upstream is None:  # the agent never connected: nothing ran, nothing to end
            return
        me = object()
        await self.take(me, timeout=5.0)
        try:
            if self.upstream is not None and die_when_sent:
                self.upstream.send(m.message(b"Q", sql.encode() + b"\0"))
                self.upstream.flush()
                await self.upstream.wire.drain()
                os.kill(os.getpid(), signal.SIGKILL)
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
