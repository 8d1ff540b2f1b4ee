"""The SQL savepoint proxy on its own (no booth): real clients through it to a real server.

Each test starts a proxy over a fresh database of the session's private cluster and checks,
through a direct connection of its own, what another client of the database sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from jukebox.sql import messages as m
from jukebox.sql.server import SqlProxy
from jukebox.sql.upstream import RELEASE_TX, Target
from tests.fuzz.common import mutate
from tests.sql.cluster import SCRAM_PASSWORD, SCRAM_USER, Cluster, wait_for


class Proxied:
    def __init__(self, pg: Cluster, db: str, url: str | None = None, **kw: Any) -> None:
        self.pg = pg
        self.db = db
        self.frames: list[dict[str, Any]] = []
        self.proxy = SqlProxy({"main": Target.parse(url or pg.url(db))},
                              lambda kind, payload: self.frames.append(payload), "test", **kw)
        self.proxy.start()
        self.port = self.proxy.databases["main"].port
        self.url = f"postgresql://agent@127.0.0.1:{self.port}/{db}"

    def psql(self, sql: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["psql", "-X", "-At", "-d", self.url, "-c", sql],
                              capture_output=True, text=True, timeout=60)

    def session(self):
        return self.proxy.databases["main"].session

    def end(self, sql: str) -> None:
        self.proxy.call(self.session().end(sql), timeout=30)


@pytest.fixture
def proxied(pg: Cluster, db: str) -> Iterator[Proxied]:
    p = Proxied(pg, db)
    try:
        yield p
    finally:
        p.proxy.stop()


def writes_waiting(proxied: Proxied) -> int:
    """How many units of the agent's connections wait for another's written block to end:
    the waiters of the session's `changed` event (asyncio.Event keeps them in `_waiters`),
    read on the proxy's own loop."""

    async def count() -> int:
        return len(vars(proxied.session().changed)["_waiters"])

    return int(proxied.proxy.call(count(), timeout=10))


def rows(pg: Cluster, db: str) -> str:
    return pg.psql("SELECT string_agg(id || ':' || v, ',' ORDER BY id) FROM t", db=db)


def test_psql_writes_stay_invisible_to_others_until_commit(pg: Cluster, db: str,
                                                           proxied: Proxied) -> None:
    # Statements of one query are split at the parser's byte offsets: text that is not ASCII
    # before the second must not shift it.
    out = proxied.psql("INSERT INTO t VALUES (3, 'thrée'); CREATE TABLE u (x int)")
    assert out.returncode == 0, out.stderr
    # The agent reads its own writes on a new connection (autocommit, as psql runs).
    assert proxied.psql("SELECT count(*) FROM t").stdout.strip() == "3"
    assert proxied.psql("SELECT count(*) FROM u").stdout.strip() == "0"
    # Nobody else sees the row or the table.
    assert rows(pg, db) == "1:one,2:two"
    assert pg.psql("SELECT to_regclass('u') IS NULL", db=db) == "t"
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,3:thrée"
    assert pg.psql("SELECT to_regclass('u') IS NULL", db=db) == "f"


def test_rollback_of_the_booth_leaves_nothing(pg: Cluster, db: str, proxied: Proxied) -> None:
    before = pg.dump(db)
    assert proxied.psql("UPDATE t SET v = 'x'; DELETE FROM t WHERE id = 1; "
                        "CREATE INDEX ti ON t (v); ALTER TABLE t ADD COLUMN w int").returncode == 0
    proxied.end("ROLLBACK")
    assert pg.dump(db) == before


def test_agent_transactions_become_savepoints(pg: Cluster, db: str, proxied: Proxied) -> None:
    with psycopg.connect(proxied.url) as conn:
        conn.execute("INSERT INTO t VALUES (3, 'kept')")
        conn.commit()  # a savepoint released: still the booth's, not the database's
        conn.execute("INSERT INTO t VALUES (4, 'undone')")
        conn.rollback()
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("INSERT INTO t VALUES (1, 'dup')")
        conn.rollback()
        with conn.transaction():
            conn.execute("INSERT INTO t VALUES (5, 'outer')")
            with pytest.raises(psycopg.errors.DivisionByZero), conn.transaction():
                conn.execute("INSERT INTO t VALUES (6, 'inner')")
                conn.execute("SELECT 1/0")
        conn.commit()
        assert conn.execute("SELECT string_agg(id::text, ',' ORDER BY id) FROM t").fetchone() \
            == ("1,2,3,5",)
    assert rows(pg, db) == "1:one,2:two"
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,3:kept,5:outer"


def test_a_failed_block_behaves_as_on_the_server(proxied: Proxied) -> None:
    out = proxied.psql("BEGIN; INSERT INTO t VALUES (7, 'a'); SELECT 1/0")
    assert "division by zero" in out.stderr
    with psycopg.connect(proxied.url) as conn:
        conn.execute("INSERT INTO t VALUES (8, 'b')")
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            conn.execute("SELECT 1")
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM t WHERE id IN (7, 8)").fetchone() == (0,)
    assert proxied.psql("COMMIT").stderr.startswith("WARNING:  there is no transaction")


def test_a_pool_reads_its_own_writes_across_connections(proxied: Proxied) -> None:
    a = psycopg.connect(proxied.url)
    b = psycopg.connect(proxied.url)
    try:
        with a.transaction():
            a.execute("INSERT INTO t VALUES (10, 'from a')")
        assert b.execute("SELECT v FROM t WHERE id = 10").fetchone() == ("from a",)
        b.commit()
        # Open blocks of both at once, as psycopg opens one before each first statement.
        assert a.execute("SELECT count(*) FROM t").fetchone() == (3,)  # a's block: reads
        assert b.execute("SELECT count(*) FROM t").fetchone() == (3,)  # goes on at once
        b.execute("INSERT INTO t VALUES (12, 'b, open')")  # b's block writes
        # a reads inside b's open block, so it sees b's row (a server would not show it)
        assert a.execute("SELECT count(*) FROM t").fetchone() == (4,)
        # a write of a waits for b's block to end: a rollback of b must not take it along
        got: list[Any] = []
        writer = threading.Thread(
            target=lambda: got.append(a.execute("INSERT INTO t VALUES (13, 'a')").rowcount)
        )
        writer.start()
        # Seen waiting in the proxy, not merely unanswered after a while (which a write that
        # has not been sent yet also is).
        deadline = time.monotonic() + 30
        while not writes_waiting(proxied):
            assert writer.is_alive(), f"a's write went through b's open block: {got}"
            assert time.monotonic() < deadline, "a's write never came to wait for b's block"
            time.sleep(0.01)
        assert writer.is_alive() and not got
        b.rollback()
        writer.join(30)
        assert got == [1]
        assert a.execute("SELECT string_agg(id::text, ',' ORDER BY id) FROM t").fetchone() == (
            "1,2,10,13",)
        a.rollback()  # undoes 13 alone
        assert b.execute("SELECT string_agg(id::text, ',' ORDER BY id) FROM t").fetchone() == (
            "1,2,10",)
        b.commit()
    finally:
        a.close()
        b.close()


def test_a_failed_bookkeeping_query_is_told_to_its_own_connection(
    pg: Cluster, db: str, proxied: Proxied
) -> None:
    """The RELEASE that keeps a unit's work is sent as the unit ends, with the next unit's
    savepoint (Upstream.take_ahead), and read by whoever reads the server next. Should it
    fail (a late cancel, the server's own trouble: faulted here by swapping the RELEASE for a
    query the real server refuses, which leaves the unit's savepoint in place as a failed
    RELEASE does), the error is its own connection's: the other connection's statement did
    not run and says so, retryable, its connection alive; the connection whose work was
    undone is told at its next statement."""
    a = psycopg.connect(proxied.url, autocommit=True)
    b = psycopg.connect(proxied.url, autocommit=True)
    try:
        a.execute("SELECT 1")
        conn_a = proxied.proxy.databases["main"].connections[1]

        _fail_next_release(proxied, conn_a)
        a.execute("INSERT INTO t VALUES (3, 'kept, then undone')")
        with pytest.raises(psycopg.errors.SerializationFailure) as not_run:
            b.execute("SELECT count(*) FROM t")
        assert "did not run: the booth's bookkeeping for its connection 1 failed just before " \
               "it (division by zero); run it again" in str(not_run.value)
        assert not b.closed
        assert b.execute("SELECT count(*) FROM t").fetchone() == (2,)  # a's row went
        with pytest.raises(psycopg.errors.StatementCompletionUnknown) as lost:
            a.execute("SELECT 1")
        assert "bookkeeping after this connection's last statement failed (division by zero)" \
            in str(lost.value)
        a.execute("INSERT INTO t VALUES (3, 'again')")
        assert b.execute("SELECT v FROM t WHERE id = 3").fetchone() == ("again",)
        # A simple query (psql): the same error, its own position in an error of its own.
        _fail_next_release(proxied, conn_a)
        a.execute("INSERT INTO t VALUES (4, 'kept, then undone')")
        out = proxied.psql("SELECT count(*) FROM t")
        assert out.returncode == 1 and "did not run: the booth's bookkeeping for its " \
            "connection 1 failed just before it (division by zero)" in out.stderr
        with pytest.raises(psycopg.errors.StatementCompletionUnknown):
            a.execute("SELECT 1")
        out = proxied.psql("SELECT nosuch FROM t")
        assert "LINE 1: SELECT nosuch FROM t\n" + " " * 15 + "^" in out.stderr
        assert proxied.psql("SELECT count(*) FROM t").stdout == "3\n"
    finally:
        a.close()
        b.close()
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,3:again"


def test_a_rollback_undoes_a_block_waiting_for_the_session(
    pg: Cluster, db: str, proxied: Proxied
) -> None:
    """A block that wrote is undone by a rollback of the booth even when its next statement is
    already waiting for the session (another connection's long read holds it): that
    statement belongs to the undone block, so it does not run, and the block's ROLLBACK ends
    it with nothing of it left."""
    a = psycopg.connect(proxied.url)
    c = psycopg.connect(proxied.url, autocommit=True)
    session = proxied.session()
    try:
        c.execute("SELECT 1")  # the session is open: checkpoint 1 is a savepoint on it
        proxied.proxy.call(session.checkpoint(1, 10), timeout=10)
        a.execute("INSERT INTO t VALUES (3, 'a, open')")
        sleeper = threading.Thread(target=lambda: c.execute("SELECT pg_sleep(0.6)"))
        sleeper.start()
        wait_for(lambda: session.holder is proxied.proxy.databases["main"].connections[2])
        got: list[BaseException] = []

        def write() -> None:
            try:
                a.execute("INSERT INTO t VALUES (4, 'a, waiting')")
            except psycopg.Error as error:
                got.append(error)

        writer = threading.Thread(target=write)
        writer.start()
        wait_for(lambda: session._waiting == 1)
        proxied.proxy.call(session.rollback_to(1, 10), timeout=10)
        writer.join(10)
        sleeper.join(10)
        assert len(got) == 1 and isinstance(got[0], psycopg.errors.InFailedSqlTransaction)
        assert "rolled back to checkpoint 1 while this transaction was open" in str(got[0])
        a.rollback()
        assert a.execute("SELECT count(*) FROM t").fetchone() == (2,)
        a.commit()
    finally:
        a.close()
        c.close()
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two"


def test_a_checkpoint_while_blocks_are_open_is_the_state_before_them(
    pg: Cluster, db: str, proxied: Proxied
) -> None:
    """A checkpoint while another connection's block that wrote (or failed) is open is
    answered at once (it waited 10 s and failed): it is the committed state then, before that
    block, whether the block commits after it (a rollback to it undoes the whole block, not
    the part after the checkpoint) or rolls back; the agent's own savepoints left open by
    the block's COMMIT are gone as the server would have them."""
    auto = psycopg.connect(proxied.url, autocommit=True)
    a = psycopg.connect(proxied.url)
    session = proxied.session()

    def checkpoint(n: int) -> None:
        start = time.monotonic()
        proxied.proxy.call(session.checkpoint(n, 10), timeout=10)
        assert time.monotonic() - start < 1

    def ids() -> str:
        return ",".join(str(r[0]) for r in auto.execute("SELECT id FROM t ORDER BY id"))

    try:
        auto.execute("INSERT INTO t VALUES (3, 'before the block')")
        a.execute("INSERT INTO t VALUES (4, 'in the block')")
        a.execute("SAVEPOINT mine")  # the agent's own, still open at its COMMIT
        checkpoint(1)
        a.execute("INSERT INTO t VALUES (5, 'in the block, after the checkpoint')")
        a.commit()
        auto.execute("INSERT INTO t VALUES (6, 'after the block')")
        checkpoint(2)
        auto.execute("INSERT INTO t VALUES (7, 'after checkpoint 2')")
        proxied.proxy.call(session.rollback_to(2, 10), timeout=10)
        assert ids() == "1,2,3,4,5,6"
        proxied.proxy.call(session.rollback_to(1, 10), timeout=10)
        assert ids() == "1,2,3"  # the whole block went: it had not committed at 1
        with pytest.raises(psycopg.errors.InvalidSavepointSpecification):
            a.execute("ROLLBACK TO SAVEPOINT mine")  # released with its block, as on a server
        a.rollback()
        a.execute("INSERT INTO t VALUES (8, 'a block that rolls back')")
        checkpoint(3)
        a.rollback()
        auto.execute("INSERT INTO t VALUES (9, 'after')")
        with pytest.raises(psycopg.errors.DivisionByZero):
            a.execute("SELECT 1/0")  # a failed block keeps the session
        checkpoint(4)
        a.rollback()
        auto.execute("INSERT INTO t VALUES (10, 'after')")
        proxied.proxy.call(session.rollback_to(4, 10), timeout=10)
        assert ids() == "1,2,3,9"
        proxied.proxy.call(session.rollback_to(3, 10), timeout=10)
        assert ids() == "1,2,3"
        a.execute("INSERT INTO t VALUES (11, 'open at the rollback')")
        checkpoint(5)
        proxied.proxy.call(session.rollback_to(5, 10), timeout=10)
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            a.execute("SELECT 1")
        a.rollback()
        auto.execute("INSERT INTO t VALUES (12, 'last')")
    finally:
        a.close()
        auto.close()
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,3:before the block,12:last"


def test_a_connection_gone_while_queued_leaves_no_prepared_statements(
    proxied: Proxied
) -> None:
    """An agent connection that ends while its close waits for the session (another
    connection's long read holds it), its open block undone meanwhile by a rollback of the
    booth, still closes its named prepared statements on the shared server session: they
    used to stay there for the booth's life."""
    a = psycopg.connect(proxied.url)
    c = psycopg.connect(proxied.url, autocommit=True)
    session = proxied.session()
    conns = proxied.proxy.databases["main"].connections
    prepared = "SELECT name FROM pg_prepared_statements ORDER BY name"
    try:
        a.execute("INSERT INTO t VALUES (%s, 'a, open')", (3,), prepare=True)
        assert c.execute(prepared).fetchall() == [("jb1__pg3_0",)]
        proxied.proxy.call(session.checkpoint(1, 10), timeout=10)
        sleeper = threading.Thread(target=lambda: c.execute("SELECT pg_sleep(0.6)"))
        sleeper.start()
        wait_for(lambda: session.holder is conns[2])
        a.close()  # its end waits for the session, in the queue
        wait_for(lambda: session._waiting == 1)
        proxied.proxy.call(session.rollback_to(1, 10), timeout=10)
        sleeper.join(10)
        wait_for(lambda: 1 not in conns)
        assert c.execute(prepared).fetchall() == []
        assert c.execute("SELECT count(*) FROM t").fetchone() == (2,)
    finally:
        a.close()
        c.close()


def test_the_unnamed_statement_outlives_its_round_trip(proxied: Proxied) -> None:
    """A client that Parses the unnamed statement, Syncs, and Binds it in a later round trip
    (libpq's PQprepare(conn, "") then PQexecPrepared) gets its own statement, though the
    proxy's bookkeeping and other connections' units replace the server's one unnamed
    statement in between; one that binds an unnamed statement it never parsed gets the
    server's error, never another connection's statement."""
    from psycopg.pq import ExecStatus

    a = psycopg.connect(proxied.url, autocommit=True)
    b = psycopg.connect(proxied.url, autocommit=True)
    c = psycopg.connect(proxied.url, autocommit=True)
    try:
        pa, pb = a.pgconn, b.pgconn
        assert pa.prepare(b"", b"SELECT v FROM t WHERE id = $1").status == ExecStatus.COMMAND_OK
        b.execute("INSERT INTO t VALUES (%s, 'three')", (3,))  # an unnamed Parse of its own
        assert pb.prepare(b"", b"SELECT 'b' || count(*) FROM t WHERE id > $1").status == \
            ExecStatus.COMMAND_OK
        for key, value in ((b"1", b"one"), (b"3", b"three"), (b"2", b"two")):
            got = pa.exec_prepared(b"", [key])
            assert got.status == ExecStatus.TUPLES_OK, got.error_message
            assert got.get_value(0, 0) == value
        got = pb.exec_prepared(b"", [b"1"])
        assert got.status == ExecStatus.TUPLES_OK and got.get_value(0, 0) == b"b2"
        # PQdescribePrepared holds the GIL while it waits (the proxy runs in this process):
        # its asynchronous form, waited for here.
        pa.send_describe_prepared(b"")
        while pa.flush():
            select.select([], [pa.socket], [], 10)
        while pa.consume_input() or pa.is_busy():
            select.select([pa.socket], [], [], 10)
        assert pa.get_result().nparams == 1  # type: ignore[union-attr]
        assert pa.get_result() is None
        # Inside a transaction block, with the agent's COMMIT between.
        a.execute("BEGIN")
        assert pa.prepare(b"", b"SELECT count(*) FROM t").status == ExecStatus.COMMAND_OK
        a.execute("INSERT INTO t VALUES (4, 'four')")
        assert pa.exec_prepared(b"", []).get_value(0, 0) == b"4"
        a.execute("COMMIT")
        assert pa.exec_prepared(b"", []).get_value(0, 0) == b"4"
        got = c.pgconn.exec_prepared(b"", [])
        assert got.status == ExecStatus.FATAL_ERROR
        assert b"unnamed prepared statement does not exist" in got.error_message
        assert c.execute("SELECT count(*) FROM t").fetchone() == (4,)
    finally:
        a.close()
        b.close()
        c.close()


def test_a_rollback_leaves_a_block_that_only_read_alone_beside_a_failed_one(
    pg: Cluster, db: str, proxied: Proxied
) -> None:
    """A connection's failed statement inside another connection's idle block that has only
    read aborts the server's transaction; a rollback of the booth then undoes the failed
    block and leaves the reading one untouched (its savepoint used to be RELEASEd in the
    aborted transaction, which failed it with a bookkeeping error), both when the checkpoint
    was taken before the failure and while the failed block held the session."""
    auto = psycopg.connect(proxied.url, autocommit=True)
    reader = psycopg.connect(proxied.url)
    failed = psycopg.connect(proxied.url)
    session = proxied.session()
    try:
        auto.execute("SELECT 1")
        proxied.proxy.call(session.checkpoint(1, 10), timeout=10)
        auto.execute("INSERT INTO t VALUES (3, 'after checkpoint 1')")
        for n in (1, 2):
            assert reader.execute("SELECT count(*) FROM t").fetchone() == (3,)
            with pytest.raises(psycopg.errors.DivisionByZero):
                failed.execute("SELECT 1/0")
            if n == 2:  # taken while the failed block holds the session: the state before it
                proxied.proxy.call(session.checkpoint(2, 10), timeout=10)
            proxied.proxy.call(session.rollback_to(n, 10), timeout=10)
            # Checkpoint 1 is before row 3; checkpoint 2, the state before the failed block.
            after = (2,) if n == 1 else (3,)
            assert reader.execute("SELECT count(*) FROM t").fetchone() == after
            reader.commit()
            with pytest.raises(psycopg.errors.InFailedSqlTransaction) as undone:
                failed.execute("SELECT 1")
            assert f"rolled back to checkpoint {n}" in str(undone.value)
            failed.rollback()
            assert failed.execute("SELECT count(*) FROM t").fetchone() == after
            failed.commit()
            auto.execute("INSERT INTO t VALUES (%s, 'again')", (3 + n - 1,))
    finally:
        auto.close()
        reader.close()
        failed.close()
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,3:again,4:again"


def _checkpoint_in_a_block_then_fail_its_bookkeeping(
    proxied: Proxied, session: Any, w: psycopg.Connection, b: psycopg.Connection
) -> None:
    """`b` writes a row outside any block, `w` opens a block that writes one, checkpoint 1 is
    taken, then a query the server refuses is queued as `w`'s own bookkeeping (the fault)."""
    b.execute("INSERT INTO t VALUES (3, 'before the block')")
    w.execute("INSERT INTO t VALUES (4, 'in the block')")
    proxied.proxy.call(session.checkpoint(1, 10), timeout=10)
    conn_w = proxied.proxy.databases["main"].connections[1]

    async def fail_its_bookkeeping() -> None:
        up = session.upstream
        assert up is not None and session.pending_on is conn_w
        up.send_own("SELECT 1/0", conn_w)

    proxied.proxy.call(fail_its_bookkeeping(), timeout=10)


def test_a_checkpoint_outlives_the_failed_bookkeeping_that_undid_its_block(
    pg: Cluster, db: str, proxied: Proxied
) -> None:
    """A checkpoint taken while a block that wrote is open is the state before that block.
    When a bookkeeping query of that block's connection fails (faulted here by queueing, as
    its own, a query the server refuses), the unit that reads the failure rolls back to the
    block's savepoint: the checkpoint's state. The checkpoint is taken there and a rollback
    to it works (it was marked gone, as if a rollback had passed it)."""
    w = psycopg.connect(proxied.url)
    b = psycopg.connect(proxied.url, autocommit=True)
    session = proxied.session()
    try:
        _checkpoint_in_a_block_then_fail_its_bookkeeping(proxied, session, w, b)
        with pytest.raises(psycopg.errors.SerializationFailure):
            b.execute("SELECT count(*) FROM t")
        assert b.execute("SELECT count(*) FROM t").fetchone() == (3,)  # the block went
        with pytest.raises(psycopg.errors.StatementCompletionUnknown):
            w.execute("SELECT 1")
        w.rollback()
        b.execute("INSERT INTO t VALUES (5, 'after the checkpoint')")
        proxied.proxy.call(session.rollback_to(1, 10), timeout=10)
        assert b.execute("SELECT count(*) FROM t").fetchone() == (3,)
        w.execute("INSERT INTO t VALUES (6, 'a block after')")
        w.commit()
    finally:
        w.close()
        b.close()
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,3:before the block,6:a block after"


def test_concurrent_transactions_of_an_asyncpg_pool(proxied: Proxied) -> None:
    import asyncpg

    async def work(pool: Any, n: int) -> None:
        async with pool.acquire() as conn, conn.transaction():
            await conn.fetch("SELECT * FROM t")
            await asyncio.sleep(0.05)  # the other task's transaction opens meanwhile
            await conn.execute("INSERT INTO t VALUES ($1, 'task')", n)
            await asyncio.sleep(0.05)

    async def main() -> list[int]:
        pool = await asyncpg.create_pool(proxied.url, min_size=2, max_size=2)
        try:
            await asyncio.wait_for(asyncio.gather(*(work(pool, n) for n in (20, 21, 22))), 60)
            return [r[0] for r in await pool.fetch("SELECT id FROM t ORDER BY id")]
        finally:
            await pool.close()

    assert asyncio.run(main()) == [1, 2, 20, 21, 22]

REFUSED = [
    "CREATE DATABASE other",
    "VACUUM t",
    "CREATE INDEX CONCURRENTLY ti ON t (v)",
    "ALTER SYSTEM SET work_mem = '8MB'",
    "PREPARE TRANSACTION 'mine'",
    "COMMIT PREPARED 'x'",
    "RELEASE SAVEPOINT jukebox_cp_0",
    "DISCARD ALL",
]


def test_statements_that_escape_the_transaction_are_refused(
    pg: Cluster, db: str, proxied: Proxied
) -> None:
    for statement in REFUSED:
        out = proxied.psql(f"INSERT INTO t VALUES (3, 'x'); {statement}")
        assert out.returncode == 1, statement
        assert "jukebox:" in out.stderr, statement
        # The unit is undone as a failed implicit transaction; the session is still good.
        assert proxied.psql("SELECT count(*) FROM t").stdout.strip() == "2"
        with psycopg.connect(proxied.url, autocommit=True) as conn:
            with pytest.raises(psycopg.Error, match="jukebox"):
                conn.execute(statement)  # extended protocol
            assert conn.execute("SELECT count(*) FROM t").fetchone() == (2,)
        # A statement's frame is written just after its answer leaves the proxy.
        want = [statement, "SELECT count(*) FROM t"]
        wait_for(lambda want=want: [f["statement"] for f in proxied.frames[-2:]] == want,
                 timeout=10)
        assert proxied.frames[-2]["error"]["message"].startswith("jukebox:")
    assert pg.psql("SELECT count(*) FROM pg_database WHERE datname = 'other'") == "0"
    assert pg.psql("SELECT count(*) FROM pg_prepared_xacts") == "0"


def test_scram_over_tls_upstream_and_secrets_kept_off_the_frames(pg: Cluster, db: str) -> None:
    p = Proxied(pg, db, url=pg.url(db, SCRAM_USER, SCRAM_PASSWORD) + "?sslmode=require")
    try:
        with psycopg.connect(p.url, autocommit=True) as conn:
            assert conn.execute("SELECT current_user").fetchone() == (SCRAM_USER,)
            assert conn.execute(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
            ).fetchone() == (True,)
            conn.execute("INSERT INTO t VALUES (%s, %s)", (3, f"pw={SCRAM_PASSWORD}"))
            conn.execute(f"SELECT '{SCRAM_PASSWORD}'")
        p.end("COMMIT")
    finally:
        p.proxy.stop()
    assert rows(pg, db).endswith(f"3:pw={SCRAM_PASSWORD}")
    text = repr(p.frames)
    assert SCRAM_PASSWORD not in text and "[REDACTED]" in text
    assert any(f.get("rows_changed") == 1 for f in p.frames)


def test_a_unix_socket_server_upstream(pg: Cluster, db: str) -> None:
    from urllib.parse import quote

    p = Proxied(pg, db, url=f"postgresql://postgres@{quote(str(pg.dir), safe='')}:{pg.port}/{db}")
    try:
        with psycopg.connect(p.url, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES (3, 'by socket')")
            # The server sees the booth's session come in by its socket: no client address.
            assert conn.execute(
                "SELECT client_addr IS NULL FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            ).fetchone() == (True,)
        assert rows(pg, db) == "1:one,2:two"
        p.end("COMMIT")
    finally:
        p.proxy.stop()
    assert rows(pg, db) == "1:one,2:two,3:by socket"


def test_copy_in_and_out(pg: Cluster, db: str, proxied: Proxied) -> None:
    with psycopg.connect(proxied.url, autocommit=True) as conn:
        with conn.cursor().copy("COPY t (id, v) FROM STDIN") as copy:
            for i in range(3, 103):
                copy.write_row((i, f"r{i}"))
        with conn.cursor().copy("COPY t TO STDOUT") as copy:
            out = [row for row in copy.rows()]
        assert len(out) == 102
    proxied.end("COMMIT")
    assert pg.psql("SELECT count(*) FROM t", db=db) == "102"


def test_asyncpg_and_a_sqlalchemy_pool(pg: Cluster, db: str, proxied: Proxied) -> None:
    import asyncpg
    import sqlalchemy as sa

    async def agent() -> list[Any]:
        conn = await asyncpg.connect(proxied.url)
        try:
            async with conn.transaction():
                await conn.executemany("INSERT INTO t VALUES ($1, $2)", [(3, "c"), (4, "d")])
            stmt = await conn.prepare("SELECT id FROM t WHERE id > $1 ORDER BY id")
            return [r["id"] for r in await stmt.fetch(1)]
        finally:
            await conn.close()

    assert asyncio.run(agent()) == [2, 3, 4]
    engine = sa.create_engine(
        proxied.url.replace("postgresql://", "postgresql+psycopg://"), pool_size=3
    )
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO t VALUES (5, 'e')"))
    # The pool hands out its connections in turn: each reads what the others committed.
    for expected in (5, 5, 5):
        with engine.connect() as c:
            assert c.execute(sa.text("SELECT count(*) FROM t")).scalar() == expected
    assert engine.pool.checkedin() >= 1
    engine.dispose()
    assert rows(pg, db) == "1:one,2:two"
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,3:c,4:d,5:e"


def test_hostile_startup_and_messages_get_a_protocol_error(proxied: Proxied) -> None:
    def exchange(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", proxied.port), timeout=10) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out

    assert exchange(b"\x00\x00\x00\x08\x00\x00\x00\x01").startswith(b"E")  # a bad version
    assert b"08P01" in exchange(b"\x7f\xff\xff\xff\x00\x03\x00\x00")  # an absurd length
    startup = b"\x00\x03\x00\x00user\x00a\x00\x00"
    hello = len(startup).to_bytes(4, "big")
    hello = (len(startup) + 4).to_bytes(4, "big") + startup
    answer = exchange(hello + b"B\x00\x00\x00\x09\xff\xff\x00\x00\x00")
    assert b"08P01" in answer
    # The proxy serves on: a real client still works.
    assert proxied.psql("SELECT 41 + 1").stdout.strip() == "42"


def _hostile_seeds() -> list[bytes]:
    """Message sequences a client sends after its startup: each is mutated into hostile ones."""
    def msg(kind: bytes, body: bytes) -> bytes:
        return kind + (len(body) + 4).to_bytes(4, "big") + body

    bind = m.Bind("p1", "s1", [0], [b"7"], [0]).encode()
    return [
        msg(b"Q", b"SELECT 1; SELECT 2\0"),
        msg(b"Q", b"BEGIN\0") + msg(b"Q", b"INSERT INTO t VALUES (9, 'x')\0")
        + msg(b"Q", b"SAVEPOINT a\0") + msg(b"Q", b"ROLLBACK\0"),
        m.Parse("s1", "SELECT $1::int", [23]).encode() + bind + m.Describe("P", "p1").encode()
        + m.Execute("p1", 0).encode() + m.Close("S", "s1").encode() + msg(b"S", b""),
        m.Parse("", "COMMIT", []).encode() + m.Bind("", "", [], [], []).encode()
        + m.Execute("", 1).encode() + msg(b"H", b"") + msg(b"S", b""),
        # A prepared statement's unit in one packet (AgentConnection.prepared_unit).
        m.Parse("s1", "SELECT $1::int", [23]).encode() + msg(b"S", b"")
        + m.Bind("", "s1", [0], [b"7"], [0]).encode() + m.Describe("P", "").encode()
        + m.Execute("", 0).encode() + msg(b"S", b""),
        msg(b"Q", b"COPY t FROM STDIN\0") + msg(b"d", b"5\tcopied\n") + msg(b"c", b""),
        msg(b"Q", b"COPY t TO STDOUT\0") + msg(b"X", b""),
    ]


def test_fuzzed_messages_on_a_live_connection_never_crash_the_proxy(proxied: Proxied) -> None:
    """Mutated message sequences after a valid startup, each on a real connection: the
    handler answers, or says 08P01 and closes; nothing escapes it (an exception in its task
    reaches the loop's exception handler), and the proxy serves on. The decoders alone have
    their own fuzz target (tests/fuzz/fuzz_sql.py)."""
    escaped: list[dict[str, Any]] = []
    proxied.proxy.loop.call_soon_threadsafe(proxied.proxy.loop.set_exception_handler,
                                            lambda loop, context: escaped.append(context))
    startup = b"\x00\x03\x00\x00user\x00agent\x00database\x00x\x00\x00"
    hello = (len(startup) + 4).to_bytes(4, "big") + startup
    seeds = _hostile_seeds()
    rng = random.Random(29)
    for _ in range(150):
        data = mutate(rng, rng.choice(seeds), seeds)
        with socket.create_connection(("127.0.0.1", proxied.port), timeout=20) as s:
            s.sendall(hello + data)
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(m.AUTH_OK), answer[:64]
    gc.collect()  # a task's unretrieved exception is reported when it is collected
    assert escaped == []
    out = proxied.psql("SELECT count(*) FROM t")
    assert out.stdout.strip() == "2", out.stderr


MIGRATION = '''
"""add a column and a table"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade():
    op.add_column("t", sa.Column("note", sa.Text()))
    op.create_table("audit", sa.Column("id", sa.Integer, primary_key=True))
    op.execute("UPDATE t SET note = 'migrated'")
'''


def test_an_alembic_migration_commits_only_with_the_booth(
    pg: Cluster, db: str, proxied: Proxied, tmp_path: Path
) -> None:
    from alembic import command
    from alembic.config import Config

    cfg = Config(str(tmp_path / "alembic.ini"))
    cfg.set_main_option("script_location", str(tmp_path / "migrations"))
    cfg.set_main_option("sqlalchemy.url",
                        proxied.url.replace("postgresql://", "postgresql+psycopg://"))
    command.init(cfg, str(tmp_path / "migrations"))
    (tmp_path / "migrations" / "versions" / "0001_first.py").write_text(MIGRATION)
    command.upgrade(cfg, "head")
    assert proxied.psql("SELECT version_num FROM alembic_version").stdout.strip() == "0001"
    assert pg.psql("SELECT to_regclass('alembic_version') IS NULL", db=db) == "t"
    proxied.end("COMMIT")
    assert pg.psql("SELECT version_num FROM alembic_version", db=db) == "0001"
    assert pg.psql("SELECT DISTINCT note FROM t", db=db) == "migrated"


def test_cancel_and_smuggled_commits(pg: Cluster, db: str, proxied: Proxied) -> None:
    # psql passes Ctrl-C on as a cancel request (a client in another process: libpq's cancel
    # holds the GIL, so one in this process would wait on the proxy's thread forever).
    sleeper = subprocess.Popen(["psql", "-X", "-d", proxied.url, "-c", "SELECT pg_sleep(60)"],
                               stderr=subprocess.PIPE, text=True)
    # (The booth's savepoint goes ahead of a simple query's text, in the same query string.)
    wait_for(lambda: pg.psql("SELECT count(*) FROM pg_stat_activity WHERE query LIKE "
                             "'%SELECT pg_sleep(60)' AND pid <> pg_backend_pid()") == "1")
    sleeper.send_signal(signal.SIGINT)
    _, err = sleeper.communicate(timeout=30)
    assert "canceling statement due to user request" in err
    with psycopg.connect(proxied.url, autocommit=True) as conn:
        conn.execute("INSERT INTO t VALUES (3, 'x')")
        # A COMMIT hidden in a prepared statement, a function body or a procedure never ends
        # the booth's transaction: the server refuses each inside a transaction block.
        with pytest.raises(psycopg.errors.SyntaxError):
            conn.execute("COMMIT; SELECT %s::int", (1,))
        with pytest.raises(psycopg.errors.InvalidTransactionTermination):
            conn.execute("DO $$BEGIN COMMIT; END$$")
        conn.execute("CREATE PROCEDURE p() LANGUAGE plpgsql AS $$BEGIN COMMIT; END$$")
        with pytest.raises(psycopg.errors.InvalidTransactionTermination):
            conn.execute("CALL p()")
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (3,)
    assert rows(pg, db) == "1:one,2:two"


def test_a_database_the_agent_never_used_is_never_opened(pg: Cluster) -> None:
    p = Proxied(pg, "postgres")
    try:
        p.end("COMMIT")  # the verdict of a booth whose agent never connected
    finally:
        p.proxy.stop()
    assert p.frames == []
    assert pg.psql("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE "
                   "'jukebox booth%'") == "0"


# ---------------------------------------------------------------------- edge cases of the wire


def _fail_pending_release(proxied: Proxied, conn: Any) -> None:
    """Swaps `conn`'s queued RELEASE for a query the real server refuses: its unit's savepoint
    stays in place, in an aborted transaction, as a RELEASE that failed leaves it."""

    async def swap() -> None:
        up = proxied.session().upstream
        assert up is not None and up.own == [(RELEASE_TX, conn)], up and up.own
        up.own[0] = ("SELECT 1/0", conn)

    proxied.proxy.call(swap(), timeout=10)


def _fail_next_release(proxied: Proxied, conn: Any) -> None:
    """As `_fail_pending_release`, for the RELEASE that `conn`'s next unit sends as it ends,
    with the next unit's savepoint (Upstream.take_ahead): swapped before it leaves."""

    async def arm() -> None:
        up = proxied.session().upstream
        assert up is not None

        def failing(owner: object) -> None:
            assert owner is conn and up.own == [(RELEASE_TX, conn)], up.own
            up.own[0] = ("SELECT 1/0", conn)
            del up.take_ahead  # once
            up.take_ahead(owner)

        up.take_ahead = failing  # type: ignore[method-assign]

    proxied.proxy.call(arm(), timeout=10)


@pytest.mark.parametrize("end", ["rollback", "statement", "close", "commit"])
def test_another_connections_failed_bookkeeping_leaves_a_blocks_end_whole(
    pg: Cluster, db: str, proxied: Proxied, end: str
) -> None:
    """A read of another connection runs inside a block that wrote, with a savepoint of its own
    over the block's. When that read's RELEASE fails, its savepoint stays on top: the block's
    ROLLBACK (or its undoing at a disconnect) used to roll back to it, which kept the block's
    rows, and its COMMIT closed the connection. The block ends whole, the reading connection
    is told its read was undone."""
    w = psycopg.connect(proxied.url)
    r = psycopg.connect(proxied.url, autocommit=True)
    try:
        w.execute("INSERT INTO t VALUES (3, 'in the block')")
        assert r.execute("SELECT count(*) FROM t").fetchone() == (3,)  # inside w's block
        _fail_pending_release(proxied, proxied.proxy.databases["main"].connections[2])
        if end == "statement":  # w reads the failure: its statement did not run
            with pytest.raises(psycopg.errors.SerializationFailure):
                w.execute("SELECT 1")
            w.rollback()
        elif end == "rollback":
            w.rollback()
        elif end == "commit":
            w.commit()
        else:
            w.close()
            wait_for(lambda: 1 not in proxied.proxy.databases["main"].connections)
        if end != "close":
            want = (3,) if end == "commit" else (2,)
            assert w.execute("SELECT count(*) FROM t").fetchone() == want
            w.commit()
        with pytest.raises(psycopg.errors.StatementCompletionUnknown):
            r.execute("SELECT 1")
        assert r.execute("SELECT count(*) FROM t").fetchone() == ((3,) if end == "commit"
                                                                  else (2,))
        r.execute("INSERT INTO t VALUES (4, 'after')")
    finally:
        w.close()
        r.close()
    proxied.end("COMMIT")
    kept = "3:in the block," if end == "commit" else ""
    assert rows(pg, db) == f"1:one,2:two,{kept}4:after"


def test_a_failed_block_end_leaves_its_checkpoint_reachable(
    pg: Cluster, db: str, proxied: Proxied
) -> None:
    """A checkpoint taken while a block that wrote is open gets its savepoint when the block
    ends. When the query that ends the block fails (faulted here by queueing, as the block's
    own, a query the server refuses), the checkpoint used to be listed with no savepoint: a
    rollback to it failed and aborted the booth's transaction. It is the state before the
    block, taken where the block's undoing leaves the session."""
    w = psycopg.connect(proxied.url)
    b = psycopg.connect(proxied.url, autocommit=True)
    session = proxied.session()
    try:
        _checkpoint_in_a_block_then_fail_its_bookkeeping(proxied, session, w, b)
        with pytest.raises(psycopg.Error):
            w.commit()  # the session failed under it: the connection ends
        assert b.execute("SELECT count(*) FROM t").fetchone() == (3,)  # the block went
        b.execute("INSERT INTO t VALUES (5, 'after the checkpoint')")
        proxied.proxy.call(session.rollback_to(1, 10), timeout=10)
        assert b.execute("SELECT count(*) FROM t").fetchone() == (3,)
        b.execute("INSERT INTO t VALUES (6, 'after the rollback')")
    finally:
        w.close()
        b.close()
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,3:before the block,6:after the rollback"


def test_the_unnamed_portal_outlives_its_round_trip_in_a_block(proxied: Proxied) -> None:
    """Inside a transaction block the server keeps the unnamed portal across a Sync: libpq's
    PQdescribePortal(conn, "") after a statement describes that statement's portal. The
    proxy's bookkeeping and other connections' units replace the server's one unnamed portal
    in between; the agent still gets its own."""
    a = psycopg.connect(proxied.url)
    b = psycopg.connect(proxied.url, autocommit=True)
    try:
        pa = a.pgconn
        assert a.execute("SELECT id, v FROM t WHERE id = %s", (1,)).fetchone() == (1, "one")
        assert b.execute("SELECT 42 AS other").fetchone() == (42,)  # inside a's block
        b.execute("INSERT INTO t VALUES (3, 'b')")  # after a's block: it only read
        # PQdescribePortal holds the GIL while it waits (the proxy runs in this process): its
        # asynchronous form, waited for here.
        pa.send_describe_portal(b"")
        while pa.flush():
            select.select([], [pa.socket], [], 10)
        while pa.consume_input() or pa.is_busy():
            select.select([pa.socket], [], [], 10)
        got = pa.get_result()
        assert got is not None and got.error_message == b""
        assert [got.fname(i) for i in range(got.nfields)] == [b"id", b"v"]
        assert pa.get_result() is None
        assert a.execute("SELECT count(*) FROM t").fetchone() == (3,)
        a.commit()
    finally:
        a.close()
        b.close()


def _wire(port: int, user: str = "agent", database: str = "x") -> socket.socket:
    """A connection of the protocol's own messages, past its startup."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    startup = (b"\x00\x03\x00\x00user\x00" + user.encode() + b"\x00database\x00"
               + database.encode() + b"\x00\x00")
    s.sendall((len(startup) + 4).to_bytes(4, "big") + startup)
    _until_ready(s)
    return s


def _until_ready(s: socket.socket) -> list[tuple[bytes, bytes]]:
    """The server's messages up to ReadyForQuery, as (type, body)."""
    out: list[tuple[bytes, bytes]] = []
    buf = b""
    while True:
        while len(buf) < 5 or len(buf) < 1 + int.from_bytes(buf[1:5], "big"):
            chunk = s.recv(65536)
            assert chunk, out
            buf += chunk
        size = int.from_bytes(buf[1:5], "big")
        kind, body, buf = buf[:1], buf[5 : 1 + size], buf[1 + size :]
        out.append((kind, body))
        if kind == b"Z":
            assert not buf
            return out


def test_a_suspended_unnamed_portal_goes_on_after_a_sync(proxied: Proxied) -> None:
    """A client fetching the unnamed portal a row at a time (Execute with a row limit), one
    round trip each, inside a block: the rows go on where they stopped, while another
    connection's statements run between its round trips."""
    def msg(kind: bytes, body: bytes = b"") -> bytes:
        return kind + (len(body) + 4).to_bytes(4, "big") + body

    def rows_of(replies: list[tuple[bytes, bytes]]) -> list[bytes]:
        return [body for kind, body in replies if kind == b"D"]

    execute_one = msg(b"E", b"\0" + (1).to_bytes(4, "big")) + msg(b"S")
    b = psycopg.connect(proxied.url, autocommit=True)
    s = _wire(proxied.port)
    try:
        b.execute("INSERT INTO t VALUES (3, 'three')")
        s.sendall(msg(b"Q", b"BEGIN\0"))
        assert _until_ready(s)[-1] == (b"Z", b"T")
        s.sendall(msg(b"P", b"\0SELECT id FROM t ORDER BY id\0\0\0")
                  + msg(b"B", b"\0\0\0\0\0\0\0\0") + execute_one)
        first = _until_ready(s)
        assert [k for k, _ in first] == [b"1", b"2", b"D", b"s", b"Z"], first
        seen = rows_of(first)
        for _ in range(2):
            assert b.execute("SELECT count(*) FROM t").fetchone() == (3,)  # between
            s.sendall(execute_one)
            more = _until_ready(s)
            assert [k for k, _ in more] == [b"D", b"s", b"Z"], more
            seen += rows_of(more)
        assert [r[-1:] for r in seen] == [b"1", b"2", b"3"]
        s.sendall(msg(b"Q", b"COMMIT\0"))
        assert _until_ready(s)[-1] == (b"Z", b"I")
    finally:
        s.close()
        b.close()


def _pipelines(connect: Any) -> list[Any]:
    """Pipelines, errors in their middle, COPY failed from either side, transaction control in
    one query string: what each step answered (rows, or the error's SQLSTATE), and the table."""
    out: list[Any] = []

    def step(conn: Any, run: Any) -> None:
        try:
            out.append(run())
        except psycopg.Error as error:
            out.append(error.sqlstate or type(error).__name__)
            if not conn.autocommit and not conn.closed:
                out.append(str(conn.info.transaction_status))

    def table(conn: Any) -> list[Any]:
        return conn.execute("SELECT id, v FROM t ORDER BY id").fetchall()

    def pipeline(conn: Any, *statements: str, sync_after: int = -1) -> list[Any]:
        curs = []
        with conn.pipeline() as p:
            for i, sql in enumerate(statements):
                curs.append(conn.execute(sql))
                if i == sync_after:
                    p.sync()
        return [c.fetchall() if c.description else c.rowcount for c in curs]

    def copy_in(conn: Any, rows: list[str], fail: bool) -> None:
        with conn.cursor().copy("COPY t (id, v) FROM STDIN") as copy:
            for line in rows:
                copy.write(line)
            if fail:
                raise psycopg.DataError("the client gives up")  # CopyFail

    auto = connect(autocommit=True)
    block = connect()
    try:
        # One Sync: an implicit transaction, undone whole by the error in its middle.
        step(auto, lambda: pipeline(auto, "INSERT INTO t VALUES (3, 'p')",
                                    "INSERT INTO t VALUES (1, 'dup')",
                                    "INSERT INTO t VALUES (4, 'p')"))
        # A Sync between: the first part stays.
        step(auto, lambda: pipeline(auto, "INSERT INTO t VALUES (5, 'p')",
                                    "INSERT INTO t VALUES (1, 'dup')",
                                    "INSERT INTO t VALUES (6, 'p')", sync_after=0))
        # BEGIN and COMMIT inside one Sync, then an error after the COMMIT.
        step(auto, lambda: pipeline(auto, "BEGIN", "INSERT INTO t VALUES (7, 'p')", "COMMIT",
                                    "INSERT INTO t VALUES (1, 'dup')"))
        step(auto, lambda: table(auto))
        # In a block: an error mid-pipeline fails the block, ROLLBACK TO a savepoint saves it.
        step(block, lambda: pipeline(block, "INSERT INTO t VALUES (8, 'b')", "SAVEPOINT s",
                                     "INSERT INTO t VALUES (9, 'b')", "SELECT 1/0",
                                     "INSERT INTO t VALUES (10, 'b')"))
        step(block, lambda: block.execute("SELECT 1").fetchall())
        step(block, lambda: block.execute("ROLLBACK TO SAVEPOINT s").rowcount)
        step(block, lambda: table(block))
        block.commit()
        # COPY given up by the client (CopyFail) and refused by the server (bad data).
        step(auto, lambda: copy_in(auto, ["11\tc\n"], fail=True))
        step(auto, lambda: copy_in(auto, ["12\tc\n", "oops\tc\n"], fail=False))
        step(block, lambda: copy_in(block, ["13\tc\n"], fail=True))
        step(block, lambda: block.execute("SELECT 1").fetchall())
        block.rollback()
        step(block, lambda: copy_in(block, ["14\tc\n"], fail=False))
        block.commit()
        # Several statements in one simple query: one implicit transaction, or the blocks it
        # opens and ends itself.
        step(auto, lambda: auto.execute("INSERT INTO t VALUES (15, 'q'); "
                                        "INSERT INTO t VALUES (1, 'dup'); "
                                        "INSERT INTO t VALUES (16, 'q')", prepare=False))
        step(auto, lambda: auto.execute("BEGIN; INSERT INTO t VALUES (17, 'q'); COMMIT; "
                                        "INSERT INTO t VALUES (1, 'dup')", prepare=False))
        step(auto, lambda: table(auto))
    finally:
        auto.close()
        block.close()
    return out


def test_pipelines_errors_and_copy_behave_as_on_the_server(pg: Cluster, db: str,
                                                           proxied: Proxied) -> None:
    """The same client work, straight to the server and through the proxy, answers the same
    and leaves the same rows: pipelines with an error in their middle (one Sync or several),
    transaction control inside a pipeline or a query string, COPY given up by the client or
    refused by the server, in a block and outside."""
    direct = f"{db}_direct"
    pg.psql(f"CREATE DATABASE {direct} TEMPLATE {db}")
    want = _pipelines(lambda **kw: psycopg.connect(pg.url(direct), **kw))
    got = _pipelines(lambda **kw: psycopg.connect(proxied.url, **kw))
    assert got == want
    proxied.end("COMMIT")
    assert rows(pg, db) == rows(pg, direct)


@pytest.mark.parametrize("gone", ["mid-pipeline", "mid-copy", "failed"])
def test_a_connection_gone_mid_block_lets_the_waiting_write_go(
    pg: Cluster, db: str, proxied: Proxied, gone: str
) -> None:
    """A block that wrote, whose connection ends abruptly (extended messages sent with no
    Sync, in the middle of COPY FROM STDIN, or in a failed block) while another connection's
    write waits for it: the block is undone whole, the write goes on, the session serves."""
    def msg(kind: bytes, body: bytes = b"") -> bytes:
        return kind + (len(body) + 4).to_bytes(4, "big") + body

    s = _wire(proxied.port)
    other = psycopg.connect(proxied.url, autocommit=True)
    try:
        s.sendall(msg(b"Q", b"BEGIN; INSERT INTO t VALUES (3, 'in the block')\0"))
        assert _until_ready(s)[-1] == (b"Z", b"T")
        if gone == "mid-pipeline":
            s.sendall(msg(b"P", b"\0INSERT INTO t VALUES (4, 'no sync')\0\0\0")
                      + msg(b"B", b"\0\0\0\0\0\0\0\0") + msg(b"E", b"\0\0\0\0\0") + msg(b"H"))
            wait_for(lambda: len(s.recv(65536, socket.MSG_PEEK)) > 0)  # the INSERT ran
        elif gone == "mid-copy":
            s.sendall(msg(b"Q", b"COPY t (id, v) FROM STDIN\0"))
            assert s.recv(1) == b"G"
            s.sendall(msg(b"d", b"5\tcopied\n"))
        else:
            s.sendall(msg(b"Q", b"SELECT 1/0\0"))
            assert _until_ready(s)[-1] == (b"Z", b"E")
        got: list[Any] = []
        writer = threading.Thread(target=lambda: got.append(
            other.execute("INSERT INTO t VALUES (6, 'waited')").rowcount))
        writer.start()
        wait_for(lambda: writes_waiting(proxied) == 1 or bool(got))
        assert not got  # it waits for the block
        s.close()
        writer.join(30)
        assert got == [1]
        assert other.execute("SELECT id FROM t ORDER BY id").fetchall() == [(1,), (2,), (6,)]
    finally:
        s.close()
        other.close()
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,6:waited"


def test_an_asyncpg_cursor_goes_on_while_another_connection_works(proxied: Proxied) -> None:
    """asyncpg's cursor in a transaction fetches its portal a row at a time, a round trip
    each; another connection's reads and the proxy's bookkeeping run between."""
    import asyncpg

    async def main() -> list[int]:
        a = await asyncpg.connect(proxied.url)
        b = await asyncpg.connect(proxied.url)
        try:
            await b.execute("INSERT INTO t VALUES (3, 'three')")
            seen = []
            async with a.transaction():
                async for row in a.cursor("SELECT id FROM t ORDER BY id", prefetch=1):
                    seen.append(row["id"])
                    assert await b.fetchval("SELECT count(*) FROM t") == 3
                    assert await a.fetchval("SELECT $1::int + 1", row["id"]) == row["id"] + 1
            return seen
        finally:
            await a.close()
            await b.close()

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [1, 2, 3]


def test_a_failed_bookkeeping_read_by_its_own_connection_is_told(pg: Cluster, db: str,
                                                                  proxied: Proxied) -> None:
    """The RELEASE that keeps a statement's work fails and the same connection's next
    statement is the one that reads it: that statement did not run, and the one before, which
    had completed, was undone. The connection is told both, not only that its statement can
    be retried (which would lose the first)."""
    a = psycopg.connect(proxied.url, autocommit=True)
    try:
        a.execute("SELECT 1")
        _fail_next_release(proxied, proxied.proxy.databases["main"].connections[1])
        a.execute("INSERT INTO t VALUES (3, 'kept, then undone')")
        with pytest.raises(psycopg.errors.StatementCompletionUnknown) as lost:
            a.execute("INSERT INTO t VALUES (4, 'next')")
        assert "undid that statement's work" in str(lost.value)
        assert a.execute("SELECT count(*) FROM t").fetchone() == (2,)
    finally:
        a.close()


def test_named_portals_end_with_the_agents_transaction(pg: Cluster, db: str,
                                                        proxied: Proxied) -> None:
    """A server drops a named portal when the transaction that bound it ends (the Sync
    outside a block): an Execute of it in a later round trip is an error, and its name can be
    bound again. The booth's transaction outlives the agent's, so the proxy closes it then,
    straight to the server and through the proxy alike."""
    def msg(kind: bytes, body: bytes = b"") -> bytes:
        return kind + (len(body) + 4).to_bytes(4, "big") + body

    parse = msg(b"P", b"\0SELECT id FROM t ORDER BY id\0\0\0")
    bind = msg(b"B", b"c1\0\0\0\0\0\0\0\0")  # portal c1 of the unnamed statement
    execute = msg(b"E", b"c1\0" + (1).to_bytes(4, "big"))  # one row

    def exchange(port: int) -> list[Any]:
        s = _wire(port, "postgres", db)
        try:
            seen = []
            for sent in (parse + bind + execute + msg(b"S"), execute + msg(b"S"),
                         parse + bind + execute + msg(b"S")):
                s.sendall(sent)
                seen.append([(k, m.decode_fields(b).get("C") if k == b"E" else None)
                             for k, b in _until_ready(s)])
            return seen
        finally:
            s.close()

    direct = exchange(pg.port)
    assert direct[1][0] == (b"E", "34000")  # portal "c1" does not exist
    assert exchange(proxied.port) == direct


def test_an_asyncpg_cursor_left_open_ends_with_its_transaction(pg: Cluster, db: str,
                                                                proxied: Proxied) -> None:
    """asyncpg leaves a cursor's portal, not fetched to its end, to the transaction's end
    (its COMMIT and ROLLBACK are simple queries): one connection's cursors must not pile up
    on the booth's session, which outlives the agent's transactions."""
    import asyncpg

    cursors = "SELECT count(*) FROM pg_cursors WHERE name LIKE '%asyncpg_portal%'"

    async def main(url: str) -> list[int]:
        conn = await asyncpg.connect(url)
        try:
            left = []
            for _ in range(3):
                async with conn.transaction():
                    cursor = await conn.cursor("SELECT generate_series(1, 100)")
                    assert len(await cursor.fetch(2)) == 2
                    left.append(await conn.fetchval(cursors))
                left.append(await conn.fetchval(cursors))
            with contextlib.suppress(RuntimeError):
                async with conn.transaction():
                    await conn.cursor("SELECT generate_series(1, 100)")
                    raise RuntimeError("the agent's code fails")  # its ROLLBACK
            left.append(await conn.fetchval(cursors))
            return left
        finally:
            await conn.close()

    direct = asyncio.run(asyncio.wait_for(main(pg.url(db)), 60))
    assert direct == [1, 0, 1, 0, 1, 0, 0]
    assert asyncio.run(asyncio.wait_for(main(proxied.url), 60)) == direct


def test_the_unnamed_portal_outside_a_block_ends_at_its_sync(pg: Cluster, db: str,
                                                            proxied: Proxied) -> None:
    """Outside a block the server drops the unnamed portal at the Sync (its implicit
    transaction ends): an Execute of it in a later round trip is an error, straight to the
    server and through the proxy alike (where the server's portal outlived the Sync, inside
    the booth's transaction)."""
    def msg(kind: bytes, body: bytes = b"") -> bytes:
        return kind + (len(body) + 4).to_bytes(4, "big") + body

    def exchange(port: int) -> list[Any]:
        s = _wire(port, "postgres", db)
        try:
            s.sendall(msg(b"P", b"\0SELECT id FROM t ORDER BY id\0\0\0")
                      + msg(b"B", b"\0\0\0\0\0\0\0\0") + msg(b"E", b"\0" + (1).to_bytes(4, "big"))
                      + msg(b"S"))
            first = [k for k, _ in _until_ready(s)]
            s.sendall(msg(b"E", b"\0" + (1).to_bytes(4, "big")) + msg(b"S"))
            again = [(k, m.decode_fields(b).get("C") if k == b"E" else None)
                     for k, b in _until_ready(s)]
            s.sendall(msg(b"Q", b"SELECT 1\0"))
            return [first, again, [k for k, _ in _until_ready(s)]]
        finally:
            s.close()

    assert exchange(proxied.port) == exchange(pg.port)


def test_a_prepared_statements_unit_in_one_packet_is_the_servers_own(
    pg: Cluster, db: str, proxied: Proxied, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bind of a prepared statement, then Describe and Execute of the unnamed portal and Sync,
    in one packet: what drivers send for every statement they prepared, which the proxy runs
    in one go (AgentConnection.prepared_unit), not message by message. The agent gets the
    replies the server gives straight; a failed one is undone and the connection goes on;
    each is a frame with its parameters; the writes are kept."""
    from jukebox.sql.connection import AgentConnection

    def msg(kind: bytes, body: bytes = b"") -> bytes:
        return kind + (len(body) + 4).to_bytes(4, "big") + body

    def text(value: bytes) -> bytes:
        return len(value).to_bytes(4, "big") + value

    parse = msg(b"P", b"ins\0INSERT INTO t VALUES ($1, $2) RETURNING id\0\0\0") + msg(b"S")

    def unit(ident: bytes, value: bytes) -> bytes:
        bind = msg(b"B", b"\0ins\0\0\0\0\x02" + text(ident) + text(value) + b"\0\0")
        return (bind + msg(b"D", b"P\0") + msg(b"E", b"\0\0\0\0\0") + msg(b"S"))

    def exchange(port: int, first: int) -> list[Any]:
        s = _wire(port, "postgres", db)
        try:
            s.sendall(parse)
            _until_ready(s)
            seen = []
            for ident, value in ((first, b"a"), (first, b"b"), (first + 1, b"c")):
                s.sendall(unit(str(ident).encode(), value))
                seen.append([(k, m.decode_fields(b).get("C") if k == b"E" else None)
                             for k, b in _until_ready(s)])
            return seen
        finally:
            s.close()

    handled: list[bytes] = []
    handle = AgentConnection.handle

    async def seen(self: AgentConnection, kind: bytes, body: bytes) -> None:
        handled.append(kind)
        await handle(self, kind, body)

    monkeypatch.setattr(AgentConnection, "handle", seen)
    direct = exchange(pg.port, 5)
    assert (b"E", "23505") in direct[1]  # the duplicate key
    assert exchange(proxied.port, 7) == direct
    assert handled == [b"P", b"S"]  # the three units went in one go each
    def mine() -> list[dict[str, Any]]:
        return [f for f in proxied.frames if f["statement"].startswith("INSERT")]

    wait_for(lambda: len(mine()) == 3)  # each written once its answer has left
    assert [(f["params"], f.get("tag"), f.get("error", {}).get("code")) for f in mine()] == [
        (["7", "a"], "INSERT 0 1", None), (["7", "b"], None, "23505"),
        (["8", "c"], "INSERT 0 1", None)]
    proxied.end("COMMIT")
    assert rows(pg, db) == "1:one,2:two,5:a,6:c,7:a,8:c"
