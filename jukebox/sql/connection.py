"""One agent connection to the proxy: the PostgreSQL protocol spoken to the agent, its work
forwarded onto the booth's shared upstream session, its transaction control turned into
savepoints (see jukebox.sql.session for the design).

The agent sees the transaction states PostgreSQL would show it (idle, in a block, failed
block); the upstream session is always inside the booth's one transaction. Mapping:

  agent BEGIN                  nothing upstream: the unit's savepoint jukebox_tx becomes the
                               block's (every unit of work outside an attached block starts
                               with SAVEPOINT jukebox_tx; see jukebox.sql.session for blocks
                               of several connections open at once)
  agent COMMIT                 RELEASE SAVEPOINT jukebox_tx (then a fresh one for what follows)
  agent ROLLBACK               ROLLBACK TO SAVEPOINT jukebox_tx
  error outside a block        the unit is rolled back to jukebox_tx, as the server would undo
                               the failed implicit transaction
  the agent's own SAVEPOINT,   passed on: they nest inside jukebox_tx
  RELEASE, ROLLBACK TO

Extended-query messages are forwarded as they come (statement and portal names prefixed per
connection: connections share one server session). A transaction-control or refused statement
in them is answered by the proxy; before it answers, the forwarded messages' replies are
brought in with a Sync of its own, which inside the booth's transaction ends nothing, and the
proxy then skips to the agent's Sync after an error as the server would have.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jukebox.spin import Spin
from jukebox.sql import messages as m
from jukebox.sql import statements as st
from jukebox.sql.results import Results
from jukebox.sql.session import TurnTimeout
from jukebox.sql.upstream import (
    RELEASE_TX,
    SAVEPOINT_TX,
    SYNC,
    Upstream,
    UpstreamError,
    Wire,
    quote_literal,
)

if TYPE_CHECKING:
    from jukebox.sql.server import DatabaseProxy

# Undoes the unit or block whose savepoint jukebox_tx is the session's last, and drops it.
UNDO_TX = "ROLLBACK TO SAVEPOINT jukebox_tx; RELEASE SAVEPOINT jukebox_tx"
CLOSE_UNNAMED = m.Close("S", "").encode()
WRITE_TAGS = ("INSERT", "UPDATE", "DELETE", "MERGE")
# How long a statement's frame may wait, when the agent pipelined its next statement, for that
# one to leave for the server, before it is written anyway.
FRAME_DELAY = 0.002
# Agent replies passed on since the last wait for the agent to take them (backpressure).
DRAIN_EVERY = 1 << 20


class BlockUndone(TurnTimeout):
    """The connection's open block was undone while it waited for the session; `reply` is
    the error its statement gets (AgentConnection.undone)."""

    def __init__(self, reply: bytes) -> None:
        super().__init__("the open transaction was undone")
        self.reply = reply


@dataclass(slots=True)
class _Run:
    """A statement on its way: what a `sql` frame says of it. `bind`: its bound values, made
    fit for the tape (scrubbed) only when its frame is written, off the reply's path."""

    text: str
    params: list[Any] | None = None
    bind: m.Bind | None = None
    started: int = field(default_factory=time.monotonic_ns)


# A Describe of the unnamed portal, as the agent sends it and as it goes on.
_UNNAMED_PORTAL = b"P\0"
_DESCRIBE_UNNAMED_PORTAL = m.message(b"D", _UNNAMED_PORTAL)
# What follows a prepared statement's Bind in the unit `AgentConnection.prepared_unit` runs:
# Describe of the unnamed portal, Execute of it (then its row limit, any) and Sync.
_DESCRIBE_EXECUTE = _DESCRIBE_UNNAMED_PORTAL + b"E\0\0\0\x09\0"
_HEAD = len(_DESCRIBE_EXECUTE)
_TAIL = _HEAD + 4
_DESCRIBE_EXECUTE_SYNC = _TAIL + len(SYNC)
# The extended-query messages `AgentConnection.writes` looks into.
_MAY_WRITE = frozenset((b"P", b"B", b"E"))


@functools.lru_cache(maxsize=1024)
def rows_of(tag: str) -> tuple[int | None, bool]:
    """(rows, whether they were changed) from a CommandComplete tag (`INSERT 0 3`,
    `UPDATE 2`, `SELECT 5`, `COPY 10`). Cached: asked twice a statement (its reply, its
    frame), and an agent's tags repeat."""
    word, _, rest = tag.partition(" ")
    last = rest.rpartition(" ")[2]
    if not last.isdigit():
        return None, False
    return int(last), word in WRITE_TAGS


class AgentConnection:
    def __init__(
        self,
        db: DatabaseProxy,
        sock: socket.socket,
        number: int,
    ) -> None:
        self.db = db
        self.session = db.session
        # The agent's socket, read and written as the server's is (upstream.Wire), not
        # through asyncio's streams: their Python layers (StreamReader's buffer and futures,
        # the transport's write and drain) were a share of every statement.
        self.stream = self.wire = Wire(sock)
        self.loop = asyncio.get_running_loop()
        self.number = number
        self.key = secrets.randbits(31)
        self.state = "I"  # what the agent is told: I idle, T in a block, E failed block
        self.up: Upstream | None = None  # the upstream, while this connection holds it
        self.unit_failed = False
        self.unit_wrote = False  # this unit ran (or will run) a statement that may write
        self.attached = False  # this connection's block keeps its savepoint on the session
        self.wrote = False  # this connection's block has written (it can no longer detach)
        # Its block took the savepoint jukebox_in before its first SAVEPOINT of the agent's:
        # a commit that keeps the block's jukebox_tx releases the agent's ones from there.
        self.marked = False
        self.skipping = False  # after an error in extended messages: drop them until Sync
        self.inflight = False  # forwarded extended messages whose replies are not read yet
        self.special: dict[str, st.Statement] = {}  # statements the proxy answers, by name
        self.special_portals: dict[str, st.Statement] = {}
        self.texts: dict[str, str] = {}  # statement name → its text, for frames
        self.portals: dict[str, _Run] = {}
        self.named: set[str] = set()  # upstream names of this connection's statements
        # The agent's named portals bound and not closed (its names). A server drops them when
        # the transaction ends (the Sync outside a block, COMMIT, ROLLBACK); the booth's
        # transaction does not, so the proxy closes them then (`close_portals`): an agent
        # connection's cursors would otherwise pile up on the session until it disconnects
        # (asyncpg leaves a cursor's portal to the transaction's end), and a name bound again
        # would be refused as in use.
        self.open_portals: set[str] = set()
        # The agent's unnamed statement, as its Parse went to the server. The server's one
        # unnamed statement is replaced by any Parse of it and by any Query: the proxy's own
        # bookkeeping and other connections' units do both between this connection's round
        # trips, so a Bind of it is preceded by this Parse again when the server's unnamed
        # statement is no longer this one (Upstream.unnamed).
        self.unnamed: tuple[AgentConnection, bytes] | None = None
        self.runs: deque[_Run] = deque()
        # Inside a block the server keeps the unnamed portal across a Sync, and the agent may
        # Execute (a row limit: the rest of it) or Describe it in a later round trip. The
        # proxy's bookkeeping and other connections' units replace the server's one unnamed
        # portal meanwhile, so a portal the agent binds in a block is a named one of its
        # connection's on the server (`portal`), closed before its next such Bind.
        self.portal = ""
        self.portal_open = False
        # Outside a block: the unit bound the unnamed portal (else the server's one is not the
        # agent's, which the server dropped at its Sync: `unbound_portal`).
        self.bound = False
        self.copying_in = False
        # Characters of bookkeeping ahead of the agent's text in its Query (Upstream.send_query)
        self.shift = 0
        # A failed block between the agent's messages: it keeps the wire (nothing else can run
        # in a failed transaction), but a rollback of the booth may take it (`undo`).
        self.parked = False
        # An open block of this connection undone under it (a rollback of the booth, or its
        # bookkeeping failed): the error its statements get until the agent's ROLLBACK.
        self.undone: bytes | None = None
        # Another connection's failed bookkeeping left its unit's savepoint over this
        # connection's block's (the server's last jukebox_tx): this block's end undoes it
        # first (`clear_stray`).
        self.stray = False
        self.fresh = False  # the unit running sent a SAVEPOINT of its own (`hold`)
        # Its last unit, outside a block, undone by its own bookkeeping that this unit's
        # statement read: the error that statement gets (`own_failed`).
        self.lost_now: bytes | None = None
        # Its last unit, outside a block, undone after it had completed (its bookkeeping
        # failed, read by another connection): the error its next statement gets, once.
        self.lost: bytes | None = None
        # --record-sql-results: the replies of the statement on its way, as the agent gets
        # them, kept on its frame (jukebox.sql.results) so a replay can serve them offline.
        self.kept: Results | None = Results(db.owner.scrubber) if db.owner.record_results else None
        # Replies are gathered and written together: a write per small message would be a TCP
        # segment each, which the agent's delayed ACK can hold up by 40 ms.
        self.out = bytearray()
        # The frames of statements answered, waiting for their answer to leave (`record`).
        self.frames: list[tuple[_Run, str | None, dict[str, str] | None, int,
                                dict[str, Any] | None, int]] = []
        self.frame_timer: asyncio.TimerHandle | None = None
        # How long to poll for the server's answer to this connection's statements before
        # sleeping on it (`relay`), learnt from how long its last answers took.
        self.spin = Spin(db.owner.spin_cap_ns)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # ------------------------------------------------------------------ plumbing

    def send(self, data: bytes) -> None:
        self.out += data
        if len(self.out) >= 65536:
            self.flush()

    def flush(self) -> None:
        if self.out:
            self.wire.write(self.out)
            self.out.clear()
        if self.frames:
            if not self.stream.pending():
                # Now, while the agent reads its answer and works out its next statement (the
                # frame of a statement costs about as much as the server's answer to it). The
                # write above woke the agent, which the scheduler here often puts on this very
                # CPU (a woken task goes to its waker's vCPU, even with the other one idle):
                # the CPU is the agent's first, so that it reads its answer now rather than
                # once the frames are written (an agent in another process: SqlProxy.give_way).
                if self.db.owner.give_way:
                    os.sched_yield()
                self.write_frames()
            elif self.frame_timer is None:
                # Its next message is here already (a pipeline): once that has left for the
                # server (`relay`), while the server works on it; or soon, whatever comes.
                self.frame_timer = self.loop.call_later(FRAME_DELAY, self._frames_due)

    def _frames_due(self) -> None:
        self.frame_timer = None
        self.write_frames()

    async def drain_agent(self) -> None:
        self.flush()
        wire = self.wire
        if wire.writing or wire.error is not None:  # else Wire.drain has nothing to wait for
            await wire.drain()

    def up_name(self, name: str) -> str:
        return f"jb{self.number}_{name}" if name else ""

    def ended_portals(self) -> list[str]:
        """The server's names of the agent's portals that outlive a Sync (its named ones, and
        the unnamed one of a block: `portal`), forgotten here: the agent's transaction ended,
        and the caller closes them (a Close of a portal already gone is no error)."""
        names = [self.up_name(name) for name in sorted(self.open_portals)]
        for name in self.open_portals:
            self.portals.pop(name, None)
        self.open_portals.clear()
        if self.portal_open:
            names.append(self.portal)
            self.portal_open = False
        return names

    async def hold(self, write: bool = False) -> Upstream:
        """The upstream, held for this unit (see jukebox.sql.session for when a unit that
        writes waits); the unit's savepoint jukebox_tx is sent, not awaited."""
        if self.up is None:
            was = self.undone
            up = await self.session.take(self, write=write)
            if self.undone is not None and was is None:
                # Its open block was undone while it waited for the session (a rollback of
                # the booth): what it was about to send belongs to that block, so not run.
                self.session.give_back(self)
                raise BlockUndone(self.undone)
            self.fresh = not self.attached
            self.lost_now = None
            if self.fresh:  # an attached block's own savepoint covers its units
                up.send_own(SAVEPOINT_TX, self)
            self.up = up
            self.unit_failed = False
        elif write and not self.unit_wrote and self.session.attached not in (None, self):
            # Started as a read nested in another connection's block: a write now would
            # nest in that block, and the unit's messages are already with the server.
            raise TurnTimeout(
                "jukebox: a write came in the same round trip as reads while another "
                "connection of this agent has a transaction open on the booth's database "
                f"{self.session.name!r}; send the write after a Sync, or end that transaction"
            )
        if write:
            self.unit_wrote = True
        return self.up

    def own_failed(self, fields: dict[str, str]) -> None:
        """A bookkeeping query of this connection's failed (its unit's SAVEPOINT, the RELEASE
        or ROLLBACK TO at its end, or its block's RELEASE when detached), read by whoever read
        the server next, which may be another connection (Upstream.settle). It aborted the
        booth's transaction; the next failed unit's ROLLBACK TO SAVEPOINT jukebox_tx then
        undoes this connection's last unit too. A unit of its own running now fails; else it
        is told at its next message, and an open block is failed until its ROLLBACK."""
        error = self.lost_error(fields)
        if self.up is not None:
            self.unit_failed = True
            if self.state == "I" and fields.get("C") != "25P02":
                # Read by this connection's own next unit (as a Query of its own: settle):
                # the statement before, not only this one, is to run again.
                self.lost_now = error
            return
        if self.state == "I":
            self.lost = error
        else:
            self.state, self.undone, self.attached, self.wrote = "E", error, False, False
            self.marked = False
            self.session.block_lost(self)
            if self.session.attached is self:
                self.session.set_attached(self, False)

    @staticmethod
    def lost_error(fields: dict[str, str]) -> bytes:
        return m.error(
            "40003",  # statement_completion_unknown: it completed, then was undone
            f"jukebox: the booth's bookkeeping after this connection's last statement failed "
            f"({fields.get('M', 'error')}), which undid that statement's work after it had "
            "completed; run it again",
        )

    def undo(self, n: int) -> None:
        """The booth rolls back to checkpoint `n` under this connection's open block (it wrote,
        or it failed): its work and savepoints go with the rest, so the block is failed, as a
        server would fail a transaction it had to roll back; the agent's ROLLBACK ends it."""
        self.up = None
        self.attached = self.wrote = self.unit_wrote = self.unit_failed = self.parked = False
        self.marked = self.stray = False
        self.state = "E"
        self.undone = m.error(
            "25P02",
            f"jukebox: the booth rolled back to checkpoint {n} while this transaction was "
            "open, which undid its work; commands are ignored until ROLLBACK",
        )

    def ends_block(self, stmts: tuple[st.Statement, ...] | list[st.Statement]) -> bool:
        return len(stmts) == 1 and stmts[0].kind in (st.COMMIT, st.ROLLBACK)

    def ends_undone(self, kind: bytes, body: bytes) -> bool:
        """Whether an extended-query message of an undone block is part of its ROLLBACK (or
        COMMIT): the Parse of one, or a Bind, Describe, Execute or Close naming one."""
        ends = (st.COMMIT, st.ROLLBACK)
        fields = body.split(b"\0", 2)
        try:
            if kind == b"P" and len(fields) > 2:
                return self.ends_block(st.split(fields[1].decode()))
            if kind == b"B" and len(fields) > 2:
                stmt = self.special.get(fields[1].decode())
            elif kind == b"E":
                stmt = self.special_portals.get(fields[0].decode())
            elif kind in (b"D", b"C") and body[:1] in (b"S", b"P"):
                name = body[1:].split(b"\0", 1)[0].decode()
                stmt = (self.special if body[:1] == b"S" else self.special_portals).get(name)
            else:
                return kind == b"H"
        except UnicodeDecodeError:
            return False
        return stmt is not None and stmt.kind in ends

    def detach(self, up: Upstream) -> None:
        """Another connection needs the session: this idle block, which has only read, gives
        up its savepoint (its reads need no undoing); its next unit takes a new one."""
        up.send_own(RELEASE_TX, self)
        self.attached = False

    async def clear_stray(self, up: Upstream) -> None:
        """Before this block's end (COMMIT, ROLLBACK, ROLLBACK TO, its undoing): another
        connection's unit nested in it (a read) may have left its savepoint on top, its
        RELEASE failed, still unread or read by this block's last statement (`stray`). The
        block's ROLLBACK would roll back to that one and keep the block's work, its RELEASE
        would fail in the aborted transaction: that savepoint is undone first. Only when
        another connection's bookkeeping is still unread is it read first (a round trip)."""
        if self.attached and not self.stray and any(owner is not self for _, owner in up.own):
            await up.settle()
            spoiled = up.spoiled
            self.stray = (up.status == "E" and spoiled is not None
                          and spoiled[0] != self.number)
        if self.stray:
            self.stray = False
            up.send_own(UNDO_TX, self)

    async def end_block(self, up: Upstream, how: str) -> None:
        """The block ends (`how`) while checkpoints wait for it (SqlSession.block_ends)."""
        try:
            await up.query(self.session.block_ends(self, how))
        except UpstreamError:
            self.session.block_end_failed()
            raise

    async def end_unit(self) -> None:
        """The unit is over: outside a block it is kept or undone; a block keeps its
        savepoint on the session while it has one of its own; other connections go on."""
        if self.up is None:
            return
        up = self.up
        self.bound = False
        if self.state == "I":
            if self.attached and (self.unit_failed or up.status == "E"
                                  or self.session.pending_on is self):
                await self.clear_stray(up)  # its block undone (a disconnect)
            if self.session.pending_on is self:  # its block undone at its end (a disconnect)
                try:
                    await self.end_block(up, "rollback")
                except UpstreamError:  # undone as a failed unit, its checkpoint placed then
                    up.send_own(UNDO_TX + self.session.place_stranded(), self)
            elif self.unit_failed or up.status == "E":
                up.send_own(UNDO_TX + self.session.place_stranded(), self)
            else:
                up.send_own(RELEASE_TX, self)
                if not self.attached and self.session.attached is None and self.session.idle():
                    up.take_ahead(self)  # its next unit's savepoint, off that unit's path
            self.wrote = False
            if self.attached:
                self.attached = False
                self.session.set_attached(self, False)
        elif self.state == "E" or up.status == "E":
            # A failed block keeps the session until its ROLLBACK: nobody can use it.
            self.parked = True
            self.session.notify()  # a rollback of the booth waiting may take it now
            return
        else:
            self.wrote = self.wrote or self.unit_wrote
            if not self.attached:
                if self.session.attached is None:  # the unit's savepoint becomes the block's
                    self.attached = True
                    self.session.set_attached(self, True)
                else:  # read nested in another's block: nothing to keep
                    up.send_own(RELEASE_TX, self)
        self.up = None
        self.unit_failed = False
        self.unit_wrote = False
        self.session.give_back(self)

    def writes(self, kind: bytes, body: bytes) -> bool:
        """Whether an extended-query message may lead to a write: a Parse of a statement that
        may write, and its Bind and Execute (so a unit takes its turn at its start). Reads
        only the names and text it needs: the message is decoded whole (and checked) after."""
        if kind not in _MAY_WRITE:
            return False
        fields = body.split(b"\0", 2)
        try:
            if kind == b"P" and len(fields) > 2:
                return st.may_write(fields[1].decode())
            if kind == b"B" and len(fields) > 2:
                name = fields[1].decode()
                if name in self.special:
                    return False
                return st.may_write(self.texts.get(name, ""))
            if kind == b"E":
                portal = fields[0].decode()
                if portal in self.special_portals:
                    return False
                run = self.portals.get(portal)
                return st.may_write(run.text if run else "")
        except UnicodeDecodeError:
            return True  # the decoder refuses it next
        return False

    def record(self, run: _Run, tag: str | None = None, failure: dict[str, str] | None = None,
               rows_changed: int = 0) -> None:
        """The statement's frame, written once its answer has gone to the agent (`flush`):
        the agent does not wait for the redaction and the tape's write."""
        result = self.kept.take() if self.kept is not None else None
        self.frames.append((run, tag, failure, rows_changed, result, time.monotonic_ns()))

    def write_frames(self) -> None:
        frames, self.frames = self.frames, []
        for run, tag, failure, rows_changed, result, ended in frames:
            self.db.record_statement(self.number, run, tag, failure, rows_changed, result,
                                     ended)

    def reply(self, kind: bytes, body: bytes) -> None:
        """One of the server's replies, passed on to the agent (and kept, when recording)."""
        data = m.message(kind, body)
        if self.kept is not None:
            self.kept.add(kind, data)
        self.send(data)

    # ------------------------------------------------------------------ the connection

    async def serve(self) -> None:
        owner = self.db.owner
        busy = False
        try:
            if not await self.startup():
                return
            stream = self.stream
            owner.busy += 1
            busy = True
            while True:
                found = stream.next_message()
                if found is None:
                    # Waiting for the agent: not at work, so another connection may poll.
                    owner.busy -= 1
                    busy = False
                    found = await stream.read_message()
                    owner.busy += 1
                    busy = True
                kind, body = found
                if kind == b"X":
                    return
                if kind == b"B" and self.up is None and await self.prepared_unit(body):
                    continue
                await self.handle(kind, body)
                # Replies wait while the agent's next messages are already here (a pipeline:
                # Parse, Bind, Execute, Sync in one packet), so they leave together.
                if self.out and not stream.pending():
                    await self.drain_agent()
        except m.ProtocolError as error:
            self.send(m.error("08P01", f"jukebox: protocol violation: {error}", "FATAL"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except UpstreamError as error:
            self.send(m.error(error.code or "08006",
                              f"jukebox: the booth's database session failed: {error}", "FATAL"))
        finally:
            if busy:
                owner.busy -= 1
            await self.cleanup()

    async def startup(self) -> bool:
        for _ in range(3):  # SSLRequest, GSSENCRequest, then the real startup
            start = await m.read_startup(self.stream)
            if start.code in (m.SSL_REQUEST, m.GSSENC_REQUEST):
                # TLS on 127.0.0.1 inside the booth buys nothing: clients fall back to plain.
                self.send(b"N")
                await self.drain_agent()
                continue
            if start.code == m.CANCEL_REQUEST:
                pid, key = m.decode_cancel(start.body)
                await self.db.cancel(pid, key)
                return False
            if start.code != m.PROTOCOL_3:
                raise m.ProtocolError(f"protocol version {start.code >> 16}.{start.code & 0xFFFF}"
                                      " (the proxy speaks 3.0)")
            try:
                upstream = await self.session.open()
            except (UpstreamError, OSError) as error:
                self.send(m.error("08006", f"jukebox: the booth cannot reach its database "
                                  f"{self.session.name!r}: {error}", "FATAL"))
                return False
            self.db.note_server(upstream.parameters)
            self.send(m.AUTH_OK)
            for name, value in upstream.parameters.items():
                self.send(m.parameter_status(name, value))
            self.send(m.backend_key(self.number, self.key))
            self.send(m.ready(self.state))
            await self.drain_agent()
            return True
        raise m.ProtocolError("too many encryption requests")

    async def cleanup(self) -> None:
        """The agent went away: what it left open is undone, as a server would on disconnect."""
        if ((self.up is not None or self.named or self.attached or self.state != "I"
             or self.portal_open or self.open_portals)
                and not self.session.finished):
            try:
                while True:
                    try:
                        up = await self.hold()
                        break
                    except TurnTimeout:
                        # Its block undone while this waited for the session (a rollback of
                        # the booth), or the wait ran out: its prepared statements are still
                        # on the shared session, so it takes its turn again to close them.
                        if self.session.finished:
                            raise
                if self.copying_in:
                    # Gone in the middle of COPY FROM STDIN: the server waits for its rows,
                    # and any other message would end the booth's session ("protocol
                    # synchronization was lost"). CopyFail ends the COPY with an error.
                    self.copying_in = False
                    up.send(m.message(b"f", b"jukebox: the agent's connection ended during "
                                            b"COPY\0"))
                    await self.relay(drop_only=True)
                if self.state != "I":
                    self.state = "I"
                    self.unit_failed = True
                elif self.inflight:
                    up.send(SYNC)
                    await self.relay(drop_only=True)
                for name in self.named:
                    up.send(m.Close("S", name).encode())
                closing = self.ended_portals()
                for name in closing:
                    up.send(m.Close("P", name).encode())
                if self.named or closing:
                    up.send(SYNC)
                    await self.relay(drop_only=True)
                self.unit_failed = True
                await self.end_unit()
            except Exception:  # the session is gone already (the verdict, a server restart)
                self.session.give_back(self)
        self.flush()
        self.write_frames()
        if self.frame_timer is not None:
            self.frame_timer.cancel()
            self.frame_timer = None
        self.wire.close()

    # ------------------------------------------------------------------ messages

    async def prepared_unit(self, body: bytes) -> bool:
        """A unit that is one Bind of a prepared statement of the agent's, then Describe and
        Execute of the unnamed portal and Sync, all here and nothing after them, outside a
        transaction block: what psycopg, libpq and most drivers send for every statement
        they have prepared (after its fifth run, for psycopg). Run here in one go, as `handle`
        would run its four messages (the same savepoint, messages, frame and replies), without
        the four dispatches, the two looks at whether it writes and the messages taken apart
        and put together again one by one. False, having done nothing: not such a unit, for
        `handle` to take its messages."""
        wire = self.wire
        buf, at = wire.buf, wire.at
        if (len(buf) - at != _DESCRIBE_EXECUTE_SYNC or body[:1] != b"\0"
                or buf[at : at + _HEAD] != _DESCRIBE_EXECUTE or buf[at + _TAIL :] != SYNC
                or self.state != "I" or self.skipping or self.inflight or self.copying_in
                or self.lost is not None or self.undone is not None or self.open_portals
                or self.portal_open or "" in self.special_portals):
            return False
        end = body.find(b"\0", 1)
        if end < 2:  # the unnamed statement (see `own_unnamed`), or no end: `handle`'s
            return False
        try:
            name = body[1:end].decode()
        except UnicodeDecodeError:
            return False
        text = self.texts.get(name)
        if text is None or name in self.special:
            return False
        bind = m.decode_bind(body)  # checked whole before anything of it goes on
        self.parked = False
        try:
            await self.hold(st.may_write(text))
        except TurnTimeout as error:  # as `handle`: the rest is skipped up to the Sync
            self.send(error.reply if isinstance(error, BlockUndone) else
                      m.error("55P03", str(error)))  # fmt: skip
            self.skipping = True
            return True
        up = self.up
        assert up is not None
        rest = bytes(buf[at:])
        buf.clear()
        wire.at = 0
        run = _Run(text, bind=bind)
        self.portals[""] = run
        self.portal = ""
        self.bound = True
        self.runs.append(run)
        up.send(m.message(b"B", b"\0" + self.up_name(name).encode() + body[end:]) + rest)
        await self.relay()
        self.runs.clear()
        self.send(m.ready(self.state))
        await self.drain_agent()
        await self.end_unit()
        return True

    async def handle(self, kind: bytes, body: bytes) -> None:
        self.parked = False  # at work again: the wire it holds is in use
        if self.lost is not None and kind in (b"Q", b"P", b"B", b"D", b"E", b"C"):
            lost, self.lost = self.lost, None
            self.send(lost)
            if kind == b"Q":
                self.send(m.ready(self.state))
            else:
                self.skipping = True
            return
        if self.undone is not None and kind in (b"P", b"B", b"D", b"E", b"C", b"H"):
            if not self.skipping and not self.ends_undone(kind, body):
                self.send(self.undone)
                self.skipping = True
            if self.skipping:
                return
        if kind == b"Q":
            await self.on_query(m.decode_query(body))
        elif kind == b"S":
            await self.on_sync()
        elif kind in (b"P", b"B", b"D", b"E", b"C", b"H"):
            if self.skipping:
                return
            try:
                # Held already, and nothing new to wait for (a write once the unit has one):
                # `hold` would only hand the upstream back, a coroutine a message.
                if self.up is None or not self.unit_wrote:
                    write = self.writes(kind, body)
                    if self.up is None or write:
                        await self.hold(write)
            except TurnTimeout as error:
                self.send(error.reply if isinstance(error, BlockUndone) else
                          m.error("55P03", str(error)))  # fmt: skip
                self.skipping = True
                return
            await _EXTENDED[kind](self, body)
        elif kind in (b"d", b"c", b"f"):
            pass  # copy data after the copy ended: the server ignores it too
        else:
            raise m.ProtocolError(f"message type {kind!r} is not one the proxy accepts")

    async def on_query(self, text: str) -> None:
        if self.skipping:
            return
        stmts = st.split(text)
        if not stmts:
            self.send(m.message(b"I"))
            self.send(m.ready(self.state))
            return
        if self.undone is not None and not self.ends_block(stmts):
            self.send(self.undone)
            self.send(m.ready(self.state))
            return
        try:
            await self.hold(not st.reads_only(stmts))
        except TurnTimeout as error:
            self.send(error.reply if isinstance(error, BlockUndone) else
                      m.error("55P03", str(error)))  # fmt: skip
            self.send(m.ready(self.state))
            return
        if len(stmts) == 1 and stmts[0].kind == st.PLAIN:
            # a PLAIN statement is forwarded only once the upstream is connected
            self.shift = self.up.send_query(text)  # type: ignore[union-attr]
            self.runs.append(_Run(stmts[0].text))
            await self.relay()
        else:
            for stmt in stmts:
                if not await self.run(stmt):
                    break
        self.send(m.ready(self.state))
        await self.drain_agent()
        await self.end_unit()

    async def run(self, stmt: st.Statement) -> bool:
        """One statement of a simple query, or a special one's Execute; False on an error."""
        up = self.up
        assert up is not None
        kind = stmt.kind
        if kind == st.SAVEPOINT and self.state == "T" and not self.marked and (
            stmt.text[:9].upper() == "SAVEPOINT"
        ):
            up.send_own("SAVEPOINT jukebox_in", self)
            self.marked = True
        if kind == st.SAVEPOINT and self.state != "I" and stmt.text[:8].upper() == "ROLLBACK":
            await self.clear_stray(up)  # the agent's ROLLBACK TO goes below it anyway
        if kind == st.PLAIN or (kind == st.SAVEPOINT and self.state != "I") or (
            kind == st.BEGIN and self.state == "E"
        ):
            self.shift = up.send_query(stmt.text)
            self.runs.append(_Run(stmt.text))
            return not await self.relay()
        if kind == st.SAVEPOINT:
            stmt = st.Statement(stmt.text, st.REFUSED,
                                f"{stmt.text.split()[0].upper()} can only be used in "
                                "transaction blocks", "25P01")
            kind = st.REFUSED
        if kind == st.REFUSED:
            self.runs.append(_Run(stmt.text))
            up.send(m.message(b"Q", (
                "DO $jukebox$BEGIN RAISE EXCEPTION USING MESSAGE = "
                f"{quote_literal(stmt.refusal)}, ERRCODE = {quote_literal(stmt.code)}; "
                "END$jukebox$"
            ).encode() + b"\0"))
            await self.relay(refusal=True)
            return False
        run = _Run(stmt.text)
        tag = kind.upper()
        if kind == st.BEGIN:
            if self.state == "T":
                self.send(m.notice("25001", "there is already a transaction in progress"))
            self.state = "T"
        elif self.state == "I":
            self.send(m.notice("25P01", "there is no transaction in progress"))
        elif kind == st.COMMIT and self.state == "T":
            await self.clear_stray(up)
            up.close_portals(self.ended_portals())  # read with the query that ends the block
            if self.session.pending_on is self:
                await self.end_block(up, "commit")
            else:
                await up.query(RELEASE_TX)
            self.marked = False
            # What follows in this unit needs its savepoint; the unit's end usually releases
            # it at once, and then neither is sent (Upstream.send_own).
            up.send_own(SAVEPOINT_TX, self)
            self.state = "I"
        else:  # ROLLBACK, or COMMIT of a failed block, which the server answers ROLLBACK
            if self.undone is None:
                await self.clear_stray(up)
            if self.state == "T" and self.undone is None:
                # Read with the query below. In a failed transaction they are left named:
                # closed at the next end, or dropped with the block's savepoint.
                up.close_portals(self.ended_portals())
            if self.session.pending_on is self:
                await self.end_block(up, "rollback")
                up.send_own(SAVEPOINT_TX, self)  # for what follows in this unit
            elif self.undone is None:  # else the booth's rollback took its savepoint already
                await up.query("ROLLBACK TO SAVEPOINT jukebox_tx")
            self.undone = None
            self.marked = False
            self.state, self.unit_failed, tag = "I", False, "ROLLBACK"
        self.send(m.command_complete(tag))
        self.record(run, tag)
        return True

    async def relay(self, refusal: bool = False, drop_only: bool = False) -> bool:
        """Passes the upstream's replies on until its ReadyForQuery (kept back: the proxy says
        the agent's state). Returns whether there was an error."""
        up = self.up
        assert up is not None
        failed = False
        passed = 0  # bytes passed on since the agent was last waited for
        if self.frames:
            # The earlier statements' frames, written while the server answers this one
            # rather than in the agent's way between its statements.
            up.flush()
            self.write_frames()
        bulk = self.kept is None and not drop_only
        # The server's answer is polled for rather than slept for, when this connection's
        # answers come quickly and no other connection is at work (the poll holds the loop).
        up.wire.spin = self.spin if self.db.owner.busy <= 1 else None
        while True:
            if up.prefix and not drop_only:
                up.skip_prefix()
            if bulk and not up.prefix and not up.dropping:
                # Rows, descriptions, ParseComplete…: the messages the proxy passes on as they
                # are go on in one piece, as many as are here, not one by one.
                run = up.passthrough()
                if run:
                    self.send(run)
                    passed += len(run)
                    if passed >= DRAIN_EVERY:
                        passed = 0
                        await self.drain_agent()
                    continue
            kind, body = up.ready() or await up.read()
            if kind == b"Z":
                up.wire.spin = None
                up.status = body.decode()
                if up.status != "E":
                    up.spoiled = None
                up.prefix.clear()
                up.dropping.clear()
                break
            if up.prefix:  # the bookkeeping ahead of the agent's statement in its Query
                failed = self.prefix_reply(up, kind, body, drop_only) or failed
                continue  # its notices too
            if drop_only:
                continue
            if up.dropping and kind in up.dropping:  # the proxy's Parse or Close again
                up.dropping.remove(kind)
                continue
            if kind == b"C":
                failed = not self.completed(body) or failed
                continue
            elif kind == b"E":
                failed = True
                self.failed(up, body, refusal)
                continue
            elif kind in (b"I", b"s") and self.runs:
                self.reply(kind, body)
                self.record(self.runs.popleft())
                continue
            elif kind == b"G":  # CopyInResponse: the agent's rows come next
                self.reply(kind, body)
                await self.drain_agent()
                await self.copy_in(up)
                continue
            self.reply(kind, body)
            passed += len(body)
            if passed >= DRAIN_EVERY:
                passed = 0
                await self.drain_agent()
        self.shift = 0
        if failed and self.state == "I":
            self.unit_failed = True
        if self.state != "I":
            self.state = "E" if up.status == "E" else "T"
        return failed

    def prefix_reply(self, up: Upstream, kind: bytes, body: bytes, drop_only: bool) -> bool:
        """A reply to the bookkeeping ahead of the agent's statement; True when it failed."""
        if kind == b"C":
            up.prefix.popleft()
        elif kind == b"E":
            # It failed, which aborted the booth's transaction: the agent's statement did not
            # run. The error is its owner's (see Upstream.settle).
            owner = up.prefix[0]
            # This connection's own, ahead of the SAVEPOINT its unit sent (if it sent one):
            # the previous unit's RELEASE, which kept work that is now undone.
            earlier = owner is self and self.state == "I" and sum(
                o is self for o in up.prefix) > int(self.fresh)
            up.prefix.clear()
            fields = m.decode_fields(body)
            up.spoiled = (owner.number, fields.get("M", "error"))
            owner.own_failed(fields)
            if owner is self:
                self.lost_now = self.lost_error(fields) if earlier else None
            # Its unit's savepoint stays over this block's, which sent none of its own.
            self.stray = self.stray or (self.attached and owner is not self)
            if not drop_only:
                error = self.not_run(up.spoiled)
                if self.lost_now is not None:
                    error, self.lost_now = self.lost_now[5:], None
                self.reply(kind, error)
                if self.runs:
                    self.record(self.runs.popleft(), failure=m.decode_fields(error))
                self.runs.clear()
            return True
        return False

    def completed(self, body: bytes) -> bool:
        """A CommandComplete: passed on and recorded; False when the breaker refused it."""
        tag = m.decode_tag(body)
        rows, changed = rows_of(tag)
        changed_rows = rows if changed and rows else 0
        if self.copying_in and tag.startswith("COPY") and rows:
            changed_rows = rows
        self.copying_in = False
        refused = bool(changed_rows) and self.db.over_limit(changed_rows)
        if refused:
            self.reply(b"E", m.error("54000", self.db.limit_message())[5:])
        else:
            self.reply(b"C", body)
        if self.runs:
            self.record(self.runs.popleft(), tag, rows_changed=changed_rows)
        return not refused

    def failed(self, up: Upstream, body: bytes, refusal: bool) -> None:
        """An ErrorResponse of the agent's statement, passed on (and recorded)."""
        fields = m.decode_fields(body)
        if up.spoiled is not None and fields.get("C") == "25P02":
            # Aborted by a bookkeeping query that failed just before (Upstream.settle), not
            # by anything of this unit: nothing of it ran, so it can run again.
            self.stray = self.stray or (self.attached and up.spoiled[0] != self.number)
            body = self.not_run(up.spoiled)
            if self.lost_now is not None:
                body, self.lost_now = self.lost_now[5:], None
            fields = m.decode_fields(body)
        elif self.shift and "P" in fields:  # its position in the agent's own text
            fields["P"] = str(max(1, int(fields["P"]) - self.shift))
            body = b"".join(k.encode() + v.encode() + b"\0" for k, v in fields.items()) + b"\0"
        if refusal:  # the proxy's own RAISE: the agent need not see it was a DO block
            body = b"".join(
                k.encode() + v.encode() + b"\0" for k, v in fields.items()
                if k not in ("W", "P", "F", "L", "R")
            ) + b"\0"
        self.reply(b"E", body)
        if self.runs:
            self.record(self.runs.popleft(), failure=fields)
        self.runs.clear()

    @staticmethod
    def not_run(spoiled: tuple[int, str]) -> bytes:
        """The error of a statement that did not run: a bookkeeping query failed before it."""
        who, why = spoiled
        fields = {"S": "ERROR", "V": "ERROR", "C": "40001", "M": (
            f"jukebox: this statement did not run: the booth's bookkeeping for its connection "
            f"{who} failed just before it ({why}); run it again")}
        return b"".join(k.encode() + v.encode() + b"\0" for k, v in fields.items()) + b"\0"

    async def copy_in(self, up: Upstream) -> None:
        self.copying_in = True
        while True:
            kind, body = await self.stream.read_message()
            if kind in (b"d", b"c", b"f"):
                up.send(m.message(kind, body))
                if kind != b"d":
                    return
            elif kind in (b"H", b"S"):
                continue  # ignored during COPY, as the server does
            else:
                raise m.ProtocolError(f"message {kind!r} during COPY FROM STDIN")

    async def drain(self) -> None:
        """Brings in the replies of forwarded extended messages before the proxy answers one
        itself, so the agent gets its replies in order."""
        if not self.inflight or self.up is None:
            return
        self.up.send(SYNC)
        self.inflight = False
        if await self.relay():
            self.skipping = True

    # ------------------------------------------------------------------ extended query

    def forward(self, data: bytes) -> None:
        assert self.up is not None
        self.up.send(data)
        self.inflight = True

    async def on_parse(self, body: bytes) -> None:
        parse = m.decode_parse(body)
        stmts = st.split(parse.query)
        stmt = stmts[0] if len(stmts) == 1 else st.Statement(parse.query, st.PLAIN)
        self.texts[parse.name] = parse.query
        if stmt.kind == st.PLAIN:
            self.special.pop(parse.name, None)
            if parse.name:
                name = self.up_name(parse.name)
                self.named.add(name)
                self.forward(m.message(b"P", name.encode() + body[len(parse.name.encode()):]))
                return
            data = m.message(b"P", body)
            self.forward(data)
            up = self.up
            assert up is not None
            self.unnamed = up.unnamed = (self, data)
            return
        if not parse.name:
            self.unnamed = None
        self.special[parse.name] = stmt
        await self.drain()
        if not self.skipping:
            self.send(m.PARSE_COMPLETE)

    async def on_bind(self, body: bytes) -> None:
        bind = m.decode_bind(body)
        stmt = self.special.get(bind.statement)
        if stmt is not None:
            self.special_portals[bind.portal] = stmt
            await self.drain()
            if not self.skipping:
                self.send(m.BIND_COMPLETE)
            return
        self.special_portals.pop(bind.portal, None)
        self.portals[bind.portal] = _Run(self.texts.get(bind.statement, ""), bind=bind)
        if not bind.statement:
            self.own_unnamed()
        if bind.portal:
            portal = self.up_name(bind.portal)
            self.open_portals.add(bind.portal)
        elif self.state == "I":
            portal = self.portal = ""  # gone at the Sync, as the server's would be
            self.bound = True
        else:
            portal = self.portal = f"jb{self.number}_"
            if self.portal_open:  # the last one, which a Bind of the unnamed one replaces
                up = self.up
                assert up is not None
                up.send(m.Close("P", portal).encode())
                up.dropping.append(b"3")
            self.portal_open = True
        if portal or bind.statement:
            head = len(bind.portal.encode()) + len(bind.statement.encode()) + 2
            body = (portal.encode() + b"\0"
                    + self.up_name(bind.statement).encode() + b"\0" + body[head:])
        self.forward(m.message(b"B", body))

    async def on_describe(self, body: bytes) -> None:
        if body == _UNNAMED_PORTAL and "" not in self.special_portals:
            # The usual one, the portal the Bind before it made: forwarded without decoding
            # it into a Describe to encode again.
            if not self.portal and not self.bound:
                self.unbound_portal()
            portal = self.portal
            self.forward(m.message(b"D", b"P" + portal.encode() + b"\0") if portal
                         else _DESCRIBE_UNNAMED_PORTAL)
            return
        what = m.decode_describe(body)
        stmt = (self.special if what.what == "S" else self.special_portals).get(what.name)
        if stmt is None:
            if what.what == "S" and not what.name:
                self.own_unnamed()
            if what.what == "P" and not what.name and not self.portal and not self.bound:
                self.unbound_portal()
            what.name = (self.up_name(what.name) if what.name or what.what == "S"
                         else self.portal)
            self.forward(what.encode())
            return
        await self.drain()
        if not self.skipping:
            self.send(m.NO_PARAMETERS + m.NO_DATA if what.what == "S" else m.NO_DATA)

    async def on_execute(self, body: bytes) -> None:
        if len(body) == 5 and body[0] == 0 and "" not in self.special_portals:
            # The usual one, of the unnamed portal (its name empty, then the row limit):
            # forwarded without decoding it into an Execute to encode again.
            run = self.portals.get("") or _Run("")
            self.runs.append(_Run(run.text, run.params, run.bind))
            if self.portal:
                self.forward(m.message(b"E", self.portal.encode() + body))
            else:
                if not self.bound:
                    self.unbound_portal()
                self.forward(m.message(b"E", body))
            return
        execute = m.decode_execute(body)
        stmt = self.special_portals.get(execute.portal)
        if stmt is None:
            run = self.portals.get(execute.portal) or _Run("")
            self.runs.append(_Run(run.text, run.params, run.bind))
            if execute.portal or self.portal:
                execute.portal = self.up_name(execute.portal) if execute.portal else self.portal
                self.forward(execute.encode())
            else:
                if not self.bound:
                    self.unbound_portal()
                self.forward(m.message(b"E", body))
            return
        await self.drain()
        if not self.skipping and not await self.run(stmt):
            self.skipping = True

    async def on_close(self, body: bytes) -> None:
        close = m.decode_close(body)
        table = self.special if close.what == "S" else self.special_portals
        if table.pop(close.name, None) is not None:
            await self.drain()
            if not self.skipping:
                self.send(m.CLOSE_COMPLETE)
            return
        if close.what == "P" and not close.name and self.portal:
            self.portal_open = False
            close.name = self.portal
        else:
            if close.what == "P":
                self.open_portals.discard(close.name)
                self.portals.pop(close.name, None)
            close.name = self.up_name(close.name)
        if close.what == "S":
            self.named.discard(close.name)
            if not close.name:
                self.unnamed = None
                self.forward(close.encode())
                assert self.up is not None
                self.up.unnamed = None
                return
        self.forward(close.encode())

    def unbound_portal(self) -> None:
        """Before an Execute or Describe of the unnamed portal outside a block: when this unit
        did not bind it, the server's is not the agent's (the agent's ended at its Sync, as
        its implicit transaction; the server's outlived it inside the booth's transaction, or
        is the bookkeeping's or another connection's): closed first, so the agent gets the
        server's error, as straight to a server."""
        up = self.up
        assert up is not None
        up.send(m.Close("P", "").encode())
        up.dropping.append(b"3")
        self.bound = True  # closed: the server's error says the rest

    def own_unnamed(self) -> None:
        """Before a Bind or Describe of the agent's unnamed statement: the server's unnamed
        statement made this connection's again when something replaced it since (see
        `unnamed`); its ParseComplete is the proxy's to drop. Without one of its own, the
        server's is closed first, so that the agent gets the server's error rather than
        another connection's statement."""
        up = self.up
        assert up is not None
        mine = self.unnamed
        if mine is None:  # rare: a client binding what it never parsed (or closed)
            up.send(CLOSE_UNNAMED)
            up.unnamed = None
            up.dropping.append(b"3")
        elif up.unnamed is not mine or up.own:
            up.send(mine[1])
            up.unnamed = mine
            up.dropping.append(b"1")

    async def on_flush(self, body: bytes) -> None:
        await self.drain()

    async def on_sync(self) -> None:
        self.skipping = False
        if self.up is not None and self.inflight:
            if self.state == "I" and (self.open_portals or self.portal_open):
                # The agent's transaction ends at this Sync: its portals with it (an error
                # before them in this round trip skips these Closes, and the unit's undoing
                # drops the portals it bound).
                for name in self.ended_portals():
                    self.up.send(m.Close("P", name).encode())
                    self.up.dropping.append(b"3")
            self.up.send(SYNC)
            self.inflight = False
            await self.relay()
        self.runs.clear()
        self.send(m.ready(self.state))
        await self.drain_agent()
        await self.end_unit()


_EXTENDED = {
    b"P": AgentConnection.on_parse, b"B": AgentConnection.on_bind,
    b"D": AgentConnection.on_describe, b"E": AgentConnection.on_execute,
    b"C": AgentConnection.on_close, b"H": AgentConnection.on_flush,
}


def cancel_message(pid: int, key: int) -> bytes:
    return struct.pack("!iiii", 16, m.CANCEL_REQUEST, pid, key)
