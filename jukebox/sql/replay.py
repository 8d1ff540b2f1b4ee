"""Offline replay of a booth's SQL (`replay --exec` of a tape recorded with `booth run --pg …
--record-sql-results`): a stand-in PostgreSQL server per recorded database that answers the
agent from the tape's `sql` frames, with no server anywhere.

Matching: each agent connection is numbered as the recording numbered them (in the order they
connect), and takes the recorded statements of the connection with its number, in their order.
A statement whose text (scrubbed as the tape keeps it) or bound parameters differ from the next
recorded one, or one past the end of the recording, is a divergence: the agent gets an error
and the connection closes, a `note` frame (`event: divergence`) says what differed and the
replay stops the agent (jukebox.timetravel.timetravel).

What is served: the kept replies of each statement (jukebox.sql.results: row descriptions,
rows, tags, errors, COPY), exactly as recorded; the acknowledgements (ParseComplete,
BindComplete, CloseComplete, ReadyForQuery) are made here, with the transaction state a server
would report. The agent's `BEGIN`/`COMMIT` never reached a server in the recording either: their
tags are served from the frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jukebox.errors import CheckFailed, UsageError
from jukebox.redact import Scrubber
from jukebox.sql import messages as m
from jukebox.sql import results
from jukebox.sql import statements as st
from jukebox.sql.server import params_for_tape, statement_for_tape

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

# The server parameters a client needs when the tape has none (recorded before they were kept).
DEFAULT_PARAMETERS = {
    "server_version": "16.0", "server_encoding": "UTF8", "client_encoding": "UTF8",
    "DateStyle": "ISO, MDY", "integer_datetimes": "on", "standard_conforming_strings": "on",
    "TimeZone": "UTC", "IntervalStyle": "postgres",
}
DESCRIBE_KINDS = (b"t", b"T", b"n")
ENDS = (b"C", b"E", b"I", b"s")


@dataclass
class RecordedStatement:
    seq: int
    payload: dict[str, Any]
    messages: list[tuple[bytes, bytes]] | None
    served: int = 0  # messages already sent (a Describe serves the leading ones)

    @property
    def text(self) -> str:
        return str(self.payload.get("statement", ""))


@dataclass
class RecordedDatabase:
    name: str
    user: str
    database: str
    parameters: dict[str, str]
    by_conn: dict[int, deque[RecordedStatement]] = field(default_factory=dict)


class SqlRecording:
    """What a tape holds of a booth's databases: per database and connection, its statements."""

    def __init__(self, databases: dict[str, RecordedDatabase]) -> None:
        self.databases = databases
        self.on_divergence: Callable[[str], Any] | None = None  # set by the replay

    def start(
        self,
        record: Callable[[str, dict[str, Any]], Any],
        secrets: Iterable[str] = (),
        listen: Callable[[], socket.socket] | None = None,
    ) -> SqlReplay:
        """The stand-in servers, listening (the booth calls this where it would start
        proxies)."""
        return SqlReplay(self, record, secrets, listen, self.on_divergence).start()

    @classmethod
    def from_tape(cls, tape: Any, store: ObjectReader) -> SqlRecording | None:
        """None when the run used no database; UsageError when its SQL cannot be served."""
        dbs: dict[str, RecordedDatabase] = {}
        missing = 0
        for frame in tape.frames:
            if frame.kind not in ("note", "sql"):
                continue
            p = frame.resolve_payload(store) if store is not None else frame.payload
            if frame.kind == "note" and p.get("event") == "sql_databases":
                for name, url in (p.get("databases") or {}).items():
                    user, _, rest = str(url).partition("://")[2].partition("@")
                    dbs[name] = RecordedDatabase(name, user, rest.partition("/")[2],
                                                 dict(DEFAULT_PARAMETERS))
            elif frame.kind == "note" and p.get("event") == "sql_server":
                if p.get("db") in dbs:
                    dbs[p["db"]].parameters = {str(k): str(v) for k, v in
                                               (p.get("parameters") or {}).items()}
            elif frame.kind == "sql" and p.get("db") in dbs:
                kept = results.decode(p)
                if kept is None and "result_truncated" not in p:
                    missing += 1
                conn = int(p.get("conn") or 0)
                dbs[p["db"]].by_conn.setdefault(conn, deque()).append(
                    RecordedStatement(frame.seq, p, kept))
        if not dbs:
            return None
        if missing:
            raise UsageError(
                f"{tape.tape_id or 'the tape'} ran SQL through --pg but kept no results of "
                f"{missing} statement(s): a replay serves the database from the tape, which "
                "needs `booth run --record-sql-results`; record the run again with it"
            )
        return cls(dbs)

    def remaining(self) -> int:
        return sum(len(q) for db in self.databases.values() for q in db.by_conn.values())


class Diverged(CheckFailed):
    pass


class ReplayConnection:
    def __init__(self, server: ReplayDatabase, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, number: int) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.number = number
        self.queue = server.recorded.by_conn.get(number, deque())
        self.state = "I"
        self.skipping = False
        self.texts: dict[str, str] = {}
        self.portals: dict[str, tuple[str, list[Any]]] = {}
        self.out = bytearray()

    def send(self, data: bytes) -> None:
        self.out += data

    async def flush(self) -> None:
        if self.out:
            self.writer.write(bytes(self.out))
            self.out.clear()
            await self.writer.drain()

    # ------------------------------------------------------------------ matching

    def head(self, text: str, params: list[Any] | None, *, take: bool) -> RecordedStatement:
        scrubber = self.server.owner.scrubber
        where = f"SQL on database {self.server.name!r}, connection {self.number}"
        if not self.queue:
            self.server.owner.diverged(
                f"replay diverged ({where}): the statement goes beyond the recording (the tape "
                f"holds no more statements of this connection)\n"
                f"  got:      {statement_for_tape(text, scrubber)}"
            )
            raise Diverged
        rec = self.queue[0]
        got = statement_for_tape(text, scrubber)
        recorded_params = rec.payload.get("params")
        if got != rec.text or (params is not None and recorded_params is not None
                               and params != recorded_params):
            self.server.owner.diverged(
                f"replay diverged at frame {rec.seq} ({where}): the statement differs from "
                "the recorded one\n"
                f"  expected: {rec.text}" + (f"  {recorded_params}" if recorded_params else "")
                + f"\n  got:      {got}" + (f"  {params}" if params else "")
            )
            raise Diverged
        if rec.messages is None:
            self.server.owner.diverged(
                f"replay stopped at frame {rec.seq} ({where}): the statement's result was too "
                "large to keep on the tape"
            )
            raise Diverged
        if take:
            self.queue.popleft()
        return rec

    def describe(self, text: str, params: list[Any] | None, statement: bool) -> None:
        rec = self.head(text, params, take=False)
        msgs = rec.messages or []
        sent = False
        while rec.served < len(msgs) and msgs[rec.served][0] in DESCRIBE_KINDS:
            kind, data = msgs[rec.served]
            rec.served += 1
            if kind == b"t" and not statement:
                continue
            self.send(data)
            sent = True
        if not sent:  # a statement the recording's proxy answered itself (BEGIN, COMMIT…)
            self.send(m.NO_PARAMETERS + m.NO_DATA if statement else m.NO_DATA)

    async def execute(self, text: str, params: list[Any] | None) -> bool:
        """Serves one statement's recorded replies; False when it failed."""
        rec = self.head(text, params, take=True)
        failed = "error" in rec.payload
        ended = False
        for kind, data in (rec.messages or [])[rec.served:]:
            if kind in DESCRIBE_KINDS and rec.served == 0 and kind == b"t":
                continue  # a Describe of the statement the replay was not asked for
            self.send(data)
            ended = ended or kind in ENDS
            if kind == b"G":  # COPY FROM STDIN: the agent's rows come, and are dropped
                await self.flush()
                await self.copy_in()
        if not ended:
            tag = rec.payload.get("tag")
            if failed:
                error = rec.payload.get("error") or {}
                self.send(m.error(str(error.get("code") or "XX000"),
                                  str(error.get("message") or "error")))
            else:
                self.send(m.command_complete(str(tag or "")))
        return not failed

    async def copy_in(self) -> None:
        while True:
            kind, _ = await m.read_message(self.reader)
            if kind in (b"c", b"f"):
                return
            if kind not in (b"d", b"H", b"S"):
                raise m.ProtocolError(f"message {kind!r} during COPY FROM STDIN")

    def after(self, stmt: st.Statement, ok: bool) -> None:
        """The transaction state a server would report after `stmt`."""
        if not ok:
            if self.state != "I":
                self.state = "E"
            return
        if stmt.kind == st.BEGIN:
            self.state = "T"
        elif stmt.kind in (st.COMMIT, st.ROLLBACK):
            self.state = "I"
        elif stmt.kind == st.SAVEPOINT and self.state == "E":
            self.state = "T"  # ROLLBACK TO a savepoint of the failed block

    # ------------------------------------------------------------------ the connection

    async def serve(self) -> None:
        try:
            if not await self.startup():
                return
            while True:
                kind, body = await m.read_message(self.reader)
                if kind == b"X":
                    return
                await self.handle(kind, body)
                if not getattr(self.reader, "_buffer", None):
                    await self.flush()
        except Diverged:
            self.send(m.error("XX000", "jukebox replay: the agent's SQL differs from its "
                              "recording (see the replay's report)", "FATAL"))
        except m.ProtocolError as error:
            self.send(m.error("08P01", f"jukebox: protocol violation: {error}", "FATAL"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                await self.flush()
            self.writer.close()

    async def startup(self) -> bool:
        for _ in range(3):
            start = await m.read_startup(self.reader)
            if start.code in (m.SSL_REQUEST, m.GSSENC_REQUEST):
                self.send(b"N")
                await self.flush()
                continue
            if start.code == m.CANCEL_REQUEST:
                return False  # nothing runs long enough here to cancel
            if start.code != m.PROTOCOL_3:
                raise m.ProtocolError("the replay speaks protocol 3.0 only")
            self.send(m.AUTH_OK)
            for name, value in self.server.recorded.parameters.items():
                self.send(m.parameter_status(name, value))
            self.send(m.backend_key(self.number, secrets.randbits(31)))
            self.send(m.ready(self.state))
            await self.flush()
            return True
        raise m.ProtocolError("too many encryption requests")

    async def handle(self, kind: bytes, body: bytes) -> None:
        if kind == b"Q":
            stmts = st.split(m.decode_query(body))
            if not stmts:
                self.send(m.message(b"I"))
            for stmt in stmts:
                ok = await self.execute(stmt.text, None)
                self.after(stmt, ok)
                if not ok:
                    break
            self.send(m.ready(self.state))
        elif kind == b"S":
            self.skipping = False
            self.send(m.ready(self.state))
        elif kind in (b"d", b"c", b"f", b"H"):
            pass
        elif self.skipping:
            return
        elif kind == b"P":
            parse = m.decode_parse(body)
            self.texts[parse.name] = parse.query
            self.send(m.PARSE_COMPLETE)
        elif kind == b"B":
            bind = m.decode_bind(body)
            self.portals[bind.portal] = (self.texts.get(bind.statement, ""),
                                         params_for_tape(bind, self.server.owner.scrubber))
            self.send(m.BIND_COMPLETE)
        elif kind == b"D":
            what = m.decode_describe(body)
            if what.what == "S":
                self.describe(self.texts.get(what.name, ""), None, statement=True)
            else:
                text, params = self.portals.get(what.name, ("", []))
                self.describe(text, params, statement=False)
        elif kind == b"E":
            execute = m.decode_execute(body)
            text, params = self.portals.get(execute.portal, ("", []))
            stmts = st.split(text)
            ok = await self.execute(text, params)
            self.after(stmts[0] if len(stmts) == 1 else st.Statement(text, st.PLAIN), ok)
            if not ok:
                self.skipping = True
        elif kind == b"C":
            m.decode_close(body)
            self.send(m.CLOSE_COMPLETE)
        else:
            raise m.ProtocolError(f"message type {kind!r} is not one the replay accepts")


class ReplayDatabase:
    def __init__(self, owner: SqlReplay, recorded: RecordedDatabase, sock: socket.socket) -> None:
        self.owner = owner
        self.name = recorded.name
        self.recorded = recorded
        self.sock = sock
        self.server: asyncio.AbstractServer | None = None

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, sock=self.sock)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ReplayConnection(self, reader, writer, next(self.owner.numbers))
        with contextlib.suppress(asyncio.CancelledError):
            await conn.serve()


class SqlReplay:
    """The stand-in servers of one replayed booth, on an event loop thread of their own; the
    booth calls it as it calls jukebox.sql.booth_link.BoothDatabases (nothing to keep or undo:
    a replay is always discarded)."""

    def __init__(
        self,
        recording: SqlRecording,
        record: Callable[[str, dict[str, Any]], Any],
        secrets: Iterable[str] = (),
        listen: Callable[[], socket.socket] | None = None,
        on_divergence: Callable[[str], Any] | None = None,
    ) -> None:
        from jukebox.sql.server import _listen_loopback

        self.recording = recording
        self.record = record
        self.scrubber = Scrubber(secrets)
        self.on_divergence = on_divergence
        self.divergence: str | None = None
        self.numbers = itertools.count(1)
        self.urls: dict[str, str] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="jukebox-sql-replay",
                                       daemon=True)
        make = listen or _listen_loopback
        self.databases = {name: ReplayDatabase(self, db, make())
                          for name, db in recording.databases.items()}

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> SqlReplay:
        self.thread.start()
        for db in self.databases.values():
            asyncio.run_coroutine_threadsafe(db.start(), self.loop).result(30)
        return self

    def diverged(self, message: str) -> None:
        if self.divergence is not None:
            return
        self.divergence = message
        self.record("note", {"event": "divergence", "kind": "sql_mismatch", "message": message})
        if self.on_divergence is not None:
            threading.Thread(target=self.on_divergence, args=(message,), daemon=True).start()

    # ------------------------------------------------------------------ as the booth calls it

    def agent_env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for i, (name, db) in enumerate(self.databases.items()):
            rec = db.recorded
            url = f"postgresql://{rec.user}@127.0.0.1:{db.port}/{rec.database}"
            out[f"{name.upper()}_DATABASE_URL"] = url
            if i == 0:
                out.update({
                    "DATABASE_URL": url, "PGHOST": "127.0.0.1", "PGPORT": str(db.port),
                    "PGUSER": rec.user, "PGDATABASE": rec.database, "PGSSLMODE": "disable",
                })
        return out

    def checkpoint(self, n: int) -> None:
        pass  # the recording already holds what the database answered after it

    def rollback(self, n: int) -> None:
        pass

    def used(self) -> list[str]:
        return []

    def prepare(self, tapes: Any, booth_id: str, state: str) -> None:
        pass

    def end(self, sql: str) -> None:
        pass

    def close(self) -> None:
        if not self.thread.is_alive():
            return

        async def shutdown() -> None:
            for db in self.databases.values():
                if db.server is not None:
                    db.server.close()
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            for db in self.databases.values():
                db.sock.close()
