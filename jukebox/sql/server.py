"""The SQL proxies of one booth: a listening socket per database (`--pg NAME=URL`), served by
one asyncio loop on a thread of its own, each with its one upstream session
(jukebox.sql.session), recording every statement as a `sql` frame.

The booth (jukebox.sql.booth_link) calls in from other threads: checkpoint, rollback, verdict.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from jukebox.redact import Scrubber, redact_text
from jukebox.sql import messages as m
from jukebox.sql.connection import AgentConnection, _Run, cancel_message, rows_of
from jukebox.sql.session import SqlSession
from jukebox.sql.upstream import Target, Upstream, UpstreamError

T = TypeVar("T")

# What a frame keeps of one statement and one bound value: enough to read, not a dump.
MAX_STATEMENT_CHARS = 16_384
MAX_PARAM_CHARS = 1_024
# The longest the proxy polls for the server's answer to a statement before it sleeps on it
# (jukebox.spin.Spin, learnt per agent connection): a statement the server answers within it
# (most, inside the booth's transaction: nothing commits) spares the proxy a wake-up, which on
# these VMs costs more than its own work on the statement; a connection whose statements take
# longer polls for none of them until one is quick again.
SPIN_CAP_NS = 1_000_000
# Set to 1, a booth's proxy polls for the server's answers and yields its CPU to the agent
# after each answer (see docs/sql.md, "Cost"); unset or 0, it sleeps for every answer and
# writes the frames at once. Off by default: side by side on the shared 2-core development VM
# neither showed a gain in the bench's wall clock (2026-12-07), and the polls cost CPU.
SPIN_ENV = "JUKEBOX_SQL_SPIN"

FrameSink = Callable[[str, dict[str, Any]], Any]


class DatabaseProxy:
    """One `--pg NAME=URL`: its listening socket, its session, its statements' frames."""

    def __init__(self, owner: SqlProxy, name: str, target: Target, sock: socket.socket) -> None:
        self.owner = owner
        self.name = name
        self.target = target
        self.sock = sock
        self.session = SqlSession(name, target, f"jukebox booth {owner.booth_id}",
                                  lock_timeout=owner.max_lock_seconds)
        self.connections: dict[int, AgentConnection] = {}
        self.server: asyncio.Future[None] | None = None  # the accepting task
        self.serving: set[asyncio.Task[None]] = set()
        self.noted = False
        self.watcher: asyncio.Future[None] | None = None

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    async def start(self) -> None:
        self.sock.setblocking(False)
        self.server = asyncio.ensure_future(self._accepting())
        if self.owner.max_lock_seconds is not None:
            self.watcher = asyncio.ensure_future(self._watch_locks(self.owner.max_lock_seconds))

    async def _watch_locks(self, limit: float) -> None:
        """--max-sql-lock-seconds: trips the breaker once another client of the database has
        waited longer than `limit` on a lock the booth's transaction holds (the booth then
        stops the agent and rolls the transaction back, which lets the waiter go on). Watched
        from a connection of its own, as the booth's session is the agent's."""
        watch: Upstream | None = None
        every = min(1.0, max(0.2, limit / 4))
        try:
            while not self.owner.tripped:
                await asyncio.sleep(every)
                up = self.session.upstream
                if up is None or self.session.finished:
                    continue
                if watch is None:
                    watch = await Upstream.connect(self.target, "jukebox lock watch")
                row = await watch.scalar(
                    "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - query_start)), 0)"
                    " || ' ' || count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    f"AND {int(up.backend_key[0])} = ANY(pg_blocking_pids(pid))"
                )
                seconds, _, waiters = (row or "0 0").partition(" ")
                if float(seconds) > limit:
                    self.owner.trip_locks(self.name, float(seconds), int(waiters), limit)
        except (OSError, UpstreamError, asyncio.IncompleteReadError, ValueError):
            pass  # the watch is lost with its server; the booth's own session says more
        finally:
            if watch is not None:
                await watch.close()

    async def _accepting(self) -> None:
        """Each agent connection served by a task of its own, on its plain socket."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self.sock)
            except OSError:  # out of descriptors, or the agent gave up at once: the next one
                await asyncio.sleep(0.01)
                continue
            sock.setblocking(False)
            task = asyncio.ensure_future(self._accept(sock))
            self.serving.add(task)
            task.add_done_callback(self.serving.discard)

    async def _accept(self, sock: socket.socket) -> None:
        number = next(self.owner.numbers)
        conn = AgentConnection(self, sock, number)
        self.connections[number] = conn
        try:
            await conn.serve()
        except asyncio.CancelledError:
            pass  # the proxy stops (its sessions are closed already)
        finally:
            self.connections.pop(number, None)

    async def cancel(self, pid: int, key: int) -> None:
        """The agent's CancelRequest for one of its connections: passed on with the upstream
        session's own key when that connection holds the session now."""
        conn = self.connections.get(pid)
        up = self.session.upstream
        if conn is None or conn.key != key or up is None or self.session.holder is not conn:
            return
        try:
            _, writer = await self.target.open()
            writer.write(cancel_message(*up.backend_key))
            await writer.drain()
            writer.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ frames and breaker

    def note_server(self, parameters: dict[str, str]) -> None:
        """With --record-sql-results, once: what the server told each connection at startup
        (server_version, encodings, DateStyle…), which a replay tells the agent again."""
        if self.owner.record_results and not self.noted:
            self.noted = True
            self.owner.record("note", {"event": "sql_server", "db": self.name,
                                       "parameters": dict(parameters)})

    def params_for_tape(self, bind: m.Bind) -> list[Any]:
        return params_for_tape(bind, self.owner.scrubber, self.owner.param_for_tape)

    def record_statement(
        self,
        conn: int,
        run: _Run,
        tag: str | None,
        failure: dict[str, str] | None,
        rows_changed: int,
        result: dict[str, Any] | None = None,
        ended: int | None = None,
    ) -> None:
        """The statement's `sql` frame; `ended` is when its answer came (monotonic ns; the
        frame itself is written after the answer went to the agent, off the reply's path)."""
        payload: dict[str, Any] = {
            "db": self.name,
            "conn": conn,
            "statement": self.owner.statement_for_tape(run.text),
            # To the µs, from integer ns: round(seconds * 1000, 3) was a cost of its own.
            "ms": ((ended or time.monotonic_ns()) - run.started + 500) // 1000 / 1000,
        }
        params = run.params
        if params is None and run.bind is not None:
            params = self.params_for_tape(run.bind)  # scrubbed here, off the reply's path
        if params is not None:
            payload["params"] = params
        if tag is not None:
            payload["tag"] = tag
            payload["rows"] = rows_of(tag)[0]
            if rows_changed:
                payload["rows_changed"] = rows_changed
        if failure is not None:
            payload["error"] = {
                "code": failure.get("C", ""),
                "message": redact_text(failure.get("M", ""), self.owner.scrubber),
            }
        if result is not None:
            payload.update(result)
        self.owner.record("sql", payload)

    def write_frames(self) -> None:
        """The frames of statements answered still waiting (AgentConnection.flush), written
        before a checkpoint, a rollback or the verdict, so the tape keeps them before it."""
        for conn in list(self.connections.values()):
            conn.write_frames()

    def over_limit(self, rows: int) -> bool:
        return self.owner.count_rows(rows)

    def limit_message(self) -> str:
        return (f"jukebox: the circuit breaker tripped: the agent changed more than "
                f"{self.owner.max_rows_changed} rows (--max-sql-rows-changed); the statement "
                "was not kept")


def statement_for_tape(text: str, scrubber: Scrubber) -> str:
    if len(text) > MAX_STATEMENT_CHARS:
        text = text[:MAX_STATEMENT_CHARS] + "…"
    return redact_text(text, scrubber)


def params_for_tape(bind: m.Bind, scrubber: Scrubber,
                    clean: Callable[[str], str] | None = None) -> list[Any]:
    """`clean`: what redacts one text value (SqlProxy.param_for_tape remembers them), else
    redact_text with `scrubber`."""
    out: list[Any] = []
    for i, value in enumerate(bind.params):
        if value is None:
            out.append(None)
        elif bind.param_format(i) == 1:
            out.append({"binary": len(value)})
        else:
            text = value.decode("utf-8", "replace")
            if len(text) > MAX_PARAM_CHARS:
                text = text[:MAX_PARAM_CHARS] + "…"
            out.append(clean(text) if clean is not None else redact_text(text, scrubber))
    return out


class SqlProxy:
    """All of one booth's database proxies, on one event loop thread."""

    def __init__(
        self,
        databases: dict[str, Target],
        record: FrameSink,
        booth_id: str,
        secrets: Iterable[str] = (),
        listen: Callable[[], socket.socket] | None = None,
        max_rows_changed: int | None = None,
        on_trip: Callable[[Any], Any] | None = None,
        record_results: bool = False,
        max_lock_seconds: float | None = None,
        apart: bool = False,
    ) -> None:
        self.record = record
        self.record_results = record_results
        self.max_lock_seconds = max_lock_seconds
        self.booth_id = booth_id
        self.scrubber = Scrubber(secrets)
        self.scrubber.add(t.password for t in databases.values() if t.password)
        # Redacted texts remembered: an agent repeats its statements (prepared ones always) and
        # their parameters (its ids, its flags), and the redaction's regular expressions over
        # each were a tenth of what the proxy spent on a statement. The secrets to scrub are
        # fixed for the proxy's life.
        self.statement_for_tape: Callable[[str], str] = functools.lru_cache(maxsize=4096)(
            functools.partial(statement_for_tape, scrubber=self.scrubber))
        self.param_for_tape: Callable[[str], str] = functools.lru_cache(maxsize=4096)(
            functools.partial(redact_text, known=self.scrubber))
        self.max_rows_changed = max_rows_changed
        self.rows_changed = 0
        self.on_trip = on_trip
        self.tripped = False
        self.numbers = itertools.count(1)
        # `apart`: the agents are processes apart from this one (a booth's), so the proxy may
        # poll for the server's answers and hand its CPU to the agent after each answer, unless
        # JUKEBOX_SQL_SPIN=0; an agent in this process would get the GIL in the middle of the
        # proxy's work instead.
        self.give_way = apart and os.environ.get(SPIN_ENV, "1") != "0"
        self.spin_cap_ns = SPIN_CAP_NS if self.give_way else 0
        # Agent connections at work on the loop (not waiting for their agent): a poll for the
        # server holds the loop, so a connection polls only while it is the only one.
        self.busy = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="jukebox-sql", daemon=True)
        make = listen or _listen_loopback
        self.databases = {name: DatabaseProxy(self, name, t, make())
                          for name, t in databases.items()}

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> SqlProxy:
        self.thread.start()
        for db in self.databases.values():
            self.call(db.start())
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs `coro` on the proxy's loop from another thread and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def count_rows(self, rows: int) -> bool:
        """Adds `rows` changed rows; True when that passes --max-sql-rows-changed (the breaker
        trips once, and the booth stops the agent)."""
        self.rows_changed += rows
        limit = self.max_rows_changed
        if limit is None or self.rows_changed <= limit:
            return False
        if not self.tripped and self.on_trip is not None:
            self.tripped = True
            from jukebox.guard.breaker import Trip

            trip = Trip("sql_rows_changed", limit, self.rows_changed,
                        f"the agent changed {self.rows_changed} database rows, more than "
                        f"--max-sql-rows-changed {limit}")
            threading.Thread(target=self.on_trip, args=(trip,), daemon=True).start()
        return True

    def trip_locks(self, name: str, seconds: float, waiters: int, limit: float) -> None:
        if self.tripped or self.on_trip is None:
            return
        self.tripped = True
        from jukebox.guard.breaker import Trip

        trip = Trip("sql_lock_held", limit, round(seconds, 1),
                    f"the booth's transaction on database {name!r} held a lock "
                    f"{waiters} other session(s) waited on for {seconds:.1f}s, more than "
                    f"--max-sql-lock-seconds {limit:g}")
        threading.Thread(target=self.on_trip, args=(trip,), daemon=True).start()

    def stop(self) -> None:
        """Stops listening and closes every session (an open transaction is rolled back by
        the server when its session closes)."""
        if not self.thread.is_alive():
            return

        async def shutdown() -> None:
            for db in self.databases.values():
                if db.server is not None:
                    db.server.cancel()
                for conn in list(db.connections.values()):
                    conn.write_frames()
                    conn.wire.close()
                await db.session.close()
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(shutdown(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            for db in self.databases.values():
                db.sock.close()


def _listen_loopback() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock
