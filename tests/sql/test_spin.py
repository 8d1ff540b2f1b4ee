"""The proxy's poll for the server's answer (jukebox.spin.Spin, jukebox.sql.upstream.Wire), on
by default in a booth's proxy: what it learns per agent connection, that it ends at its bound,
that a slow statement stops the polls, that it is off with `JUKEBOX_SQL_SPIN=0` and without
`apart`, and that answers polled for reach the agent whole and recorded in order.

No timing is asserted: the caps are set far from what the statements take (a minute against a
SELECT, 0.1 s against a 0.5 s pg_sleep), so the machine's load cannot move the outcome."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from jukebox.spin import CPUS
from jukebox.sql import upstream
from jukebox.sql.connection import AgentConnection
from jukebox.sql.server import SPIN_ENV
from jukebox.sql.upstream import Wire
from tests.sql.cluster import Cluster, wait_for
from tests.sql.test_proxy import Proxied, writes_waiting

MINUTE_NS = 60_000_000_000


@pytest.fixture
def polls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool, bool]]:
    """Each poll of a server's socket: (its budget, whether the answer came within it, whether
    it was for a statement's answer: not for the replies to the proxy's bookkeeping, which
    a simple Query's unit reads first, Upstream.take_ahead). The machine reads as having a
    CPU to spare (`runnable`), whatever else the suite runs."""
    monkeypatch.setattr(upstream, "runnable", lambda: 1)
    seen: list[tuple[int, bool, bool]] = []
    poll = Wire._poll

    def counted(self: Wire, budget_ns: int) -> bytes | None:
        got = poll(self, budget_ns)
        seen.append((budget_ns, got is not None, self.learning))
        return got

    monkeypatch.setattr(Wire, "_poll", counted)
    return seen


@pytest.fixture
def proxied(pg: Cluster, db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxied]:
    monkeypatch.delenv(SPIN_ENV, raising=False)  # on by default
    p = Proxied(pg, db, apart=True)  # as a booth's: its agents are other processes
    try:
        yield p
    finally:
        p.proxy.stop()


def the_connection(proxied: Proxied) -> AgentConnection:
    (conn,) = proxied.proxy.databases["main"].connections.values()
    return conn


def answers(polls: list[tuple[int, bool, bool]]) -> list[tuple[int, bool, bool]]:
    return [poll for poll in polls if poll[2]]


def test_quick_answers_are_polled_for_and_a_slow_one_stops_the_polls(
    proxied: Proxied, polls: list[tuple[int, bool, bool]]
) -> None:
    with psycopg.connect(proxied.url, autocommit=True) as agent:
        conn = the_connection(proxied)
        conn.spin.cap_ns = MINUTE_NS  # every answer is "quick": each teaches a poll
        for i in range(1, 21):
            assert agent.execute("SELECT %s::int * 2", (i,)).fetchone() == (2 * i,)
            assert agent.execute("SELECT v FROM t WHERE id = 1").fetchone() == ("one",)
        # A statement the proxy surely waits for (10 ms of the server's), twice: the first
        # wait teaches a poll, which the second takes, and finds its answer within.
        for _ in range(2):
            assert agent.execute("SELECT pg_sleep(0.01)").fetchone() == ("",)
        assert polls and polls[-1][1], "no answer was polled for"
        assert all(0 < budget <= MINUTE_NS for budget, *_ in polls)
        # Between statements nobody is at work (once the frame is written after the answer).
        wait_for(lambda: proxied.proxy.busy == 0)

        conn.spin.cap_ns = 100_000_000  # 0.1 s: the next statement takes 0.5 s
        before = len(answers(polls))
        agent.execute("SELECT pg_sleep(0.5)")
        assert conn.spin.budget_ns == 0  # slower than the cap: no poll until one is quick
        # That one gave up at its bound.
        assert len(answers(polls)) == before + 1 and not answers(polls)[-1][1]

        assert agent.execute("SELECT v FROM t WHERE id = 2").fetchone() == ("two",)
        assert len(answers(polls)) == before + 1  # slept for, not polled for

    # The statements, answered through polls, were recorded as ever, in their order.
    wait_for(lambda: len(proxied.frames) == 44)
    statements = [f["statement"] for f in proxied.frames]
    assert statements[-2:] == ["SELECT pg_sleep(0.5)", "SELECT v FROM t WHERE id = 2"]
    assert statements.count("SELECT v FROM t WHERE id = 1") == 20


def test_no_poll_while_more_tasks_are_runnable_than_cpus(
    proxied: Proxied, polls: list[tuple[int, bool, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every CPU taken (the machine says more tasks are runnable than it has CPUs), no
    CPU would go idle for a poll to spare a wake-up of: answers are slept for."""
    with psycopg.connect(proxied.url, autocommit=True) as agent:
        the_connection(proxied).spin.cap_ns = MINUTE_NS
        agent.execute("SELECT pg_sleep(0.01)")
        agent.execute("SELECT pg_sleep(0.01)")
        assert polls  # an idle machine: polled for
        monkeypatch.setattr(upstream, "runnable", lambda: CPUS + 1)
        before = len(polls)
        for _ in range(3):
            assert agent.execute("SELECT pg_sleep(0.01), 7").fetchone() == ("", 7)
        assert len(polls) == before
        assert the_connection(proxied).spin.budget_ns > 0  # still learning, for later


def test_with_spin_off_a_booths_proxy_neither_polls_nor_yields(
    pg: Cluster, db: str, polls: list[tuple[int, bool, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SPIN_ENV, "0")
    p = Proxied(pg, db, apart=True)
    try:
        assert p.proxy.spin_cap_ns == 0 and not p.proxy.give_way
        with psycopg.connect(p.url, autocommit=True) as agent:
            for _ in range(3):
                agent.execute("SELECT pg_sleep(0.01)")
            assert the_connection(p).spin.budget_ns == 0
        assert polls == []
    finally:
        p.proxy.stop()


def test_a_proxy_whose_agents_share_its_process_neither_polls_nor_yields(
    pg: Cluster, db: str, polls: list[tuple[int, bool, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without `apart` (an agent in the proxy's own process, as these tests' clients are), a
    poll or a yield would hand the agent the GIL in the middle of the proxy's work, whatever
    the environment says."""
    monkeypatch.setenv(SPIN_ENV, "1")
    p = Proxied(pg, db)
    try:
        assert p.proxy.spin_cap_ns == 0 and not p.proxy.give_way
        with psycopg.connect(p.url, autocommit=True) as agent:
            for _ in range(3):
                agent.execute("SELECT pg_sleep(0.01)")
        assert polls == []
    finally:
        p.proxy.stop()


def test_a_poll_returns_what_came_and_gives_up_at_its_budget() -> None:
    async def main() -> list[Any]:
        a, b = socket.socketpair()
        a.setblocking(False)
        wire = Wire(a)
        try:
            out: list[Any] = [wire._poll(1_000_000)]  # nothing comes within 1 ms
            b.sendall(b"answer")
            out.append(wire._poll(0))  # there already: even with no budget
            b.close()
            out.append(wire._poll(1_000_000))  # the end, as a read says it
            return out
        finally:
            wire.close()

    assert asyncio.run(main()) == [None, b"answer", b""]


def test_a_poll_is_not_taken_while_another_connection_is_at_work(
    proxied: Proxied, polls: list[tuple[int, bool, bool]]
) -> None:
    """The poll holds the proxy's loop: while a second connection has a statement in the
    works (here a write waiting for the first connection's block that wrote to end), the
    first sleeps for its answers."""
    with psycopg.connect(proxied.url) as first, psycopg.connect(proxied.url) as second:
        first.execute("UPDATE t SET v = 'uno' WHERE id = 1")  # its block keeps the session
        conn = proxied.proxy.databases["main"].connections[1]
        conn.spin.cap_ns = MINUTE_NS
        first.execute("SELECT pg_sleep(0.01)")  # surely waited for: it teaches a poll
        first.execute("SELECT pg_sleep(0.01)")
        assert polls
        waiting = threading.Thread(
            target=lambda: second.execute("UPDATE t SET v = 'dos' WHERE id = 2"), daemon=True)
        waiting.start()
        wait_for(lambda: writes_waiting(proxied) == 1)
        wait_for(lambda: proxied.proxy.busy == 1)  # the waiting one; the first is idle
        before = len(polls)
        assert first.execute("SELECT v FROM t WHERE id = 1").fetchone() == ("uno",)
        assert len(polls) == before  # slept: the other connection is at work
        first.commit()
        waiting.join(30)
        second.commit()
    with psycopg.connect(proxied.url) as third:
        assert third.execute("SELECT string_agg(v, ',' ORDER BY id) FROM t").fetchone() == (
            "uno,dos",)
