"""The proxy's busy-polls (jukebox.llm.fastio.Spin): what a poll learns, that it ends, and that a
proxy polling for every wait still serves the real SDKs as it does without, the first event of
a stream included while the upstream holds the rest back."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio

from jukebox.llm import fastio
from jukebox.llm.fastio import Spin, spin_read
from jukebox.llm.server import SPIN_ENV, ProxyServer
from tests.llm import scenario
from tests.llm.conftest import Recording, direct_urls
from tests.llm.test_stream_forwarding import first_event_then_rest, logged_in
from tests.llm.upstream import FakeUpstream


def test_a_short_wait_teaches_a_poll_twice_as_long_and_a_long_one_none() -> None:
    spin = Spin(cap_ns=1000)
    assert spin.budget_ns == 0  # nothing known: the first wait sleeps
    spin.observed(300)
    assert spin.budget_ns == 600
    spin.observed(700)
    assert spin.budget_ns == 1000  # never past the cap
    spin.observed(1001)  # a remote API, a model thinking: no poll until a wait is short again
    assert spin.budget_ns == 0


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_a_poll_returns_what_is_there_and_gives_up_after_its_budget(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    assert spin_read(a.fileno(), 100, 1_000_000) is None  # nothing came within 1 ms
    b.sendall(b"answer")
    assert spin_read(a.fileno(), 100, 0) == b"answer"  # there already: even with no budget
    b.close()
    assert spin_read(a.fileno(), 100, 1_000_000) == b""  # the end, as a read says it
    with pytest.raises(trio.BrokenResourceError):  # a closed descriptor, as trio says it
        spin_read(-1, 100, 1_000_000)


def test_spinning_is_off_in_process_and_when_the_environment_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not ProxyServer(upstreams={}).spin  # an agent in the same process: the GIL
    assert ProxyServer(upstreams={}, spin=True).spin
    monkeypatch.setenv(SPIN_ENV, "0")
    assert not ProxyServer(upstreams={}, spin=True).spin


@pytest.fixture
def always_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every wait after the first polls for as long as its cap allows, however long the last
    took: the polls are taken on every path whatever the machine's load."""

    def observed(self: Spin, waited_ns: int) -> None:
        self.budget_ns = self.cap_ns

    monkeypatch.setattr(fastio.Spin, "observed", observed)


def test_a_polling_proxy_serves_the_sdks_as_a_direct_call_does(
    upstream: FakeUpstream, recording: Recording, always_polling: None
) -> None:
    direct = scenario.run(direct_urls(upstream))
    with recording.proxy(upstream, spin=True) as proxy:
        polled = scenario.run(proxy.base_urls())
    assert polled == direct
    assert sum(f.kind == "llm_turn" for f in recording.tape().frames) == 10


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_polling_proxy_passes_the_first_event_on_before_the_upstream_sends_the_second(
    provider: str, upstream: FakeUpstream, recording: Recording, always_polling: None
) -> None:
    log = upstream.server.log
    record = logged_in(recording, log)
    upstreams = {"openai": upstream.openai_url, "anthropic": upstream.url}
    with ProxyServer(upstreams=upstreams, record=record, spin=True) as proxy:
        # A first stream, whole: every kind of wait has been measured, so the next polls.
        first_event_then_rest(provider, upstream, proxy.base_urls())
        upstream.server.gate(provider).clear()
        del log[:]
        seen = first_event_then_rest(provider, upstream, proxy.base_urls())
    # The poll after the head gave up (the upstream holds the second event until the agent has
    # the first): the first event went on, and the end only after the frame.
    assert log == ["agent has the first event", "second event sent", "llm_turn frame written",
                   "agent has the end"]  # fmt: skip
    assert len(seen) > 4
