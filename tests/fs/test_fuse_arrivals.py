"""The barrier's bookkeeping (shadowfs.fuse_arrivals) driven by threads directly: which requests
count as read and answered before a barrier, in the kernel's numbering.

The waiting barrier runs on a thread with a clock the test moves by hand and a pause that counts
its polls: a poll means it looked at the bookkeeping and chose to wait, so "still waiting" is
seen, not guessed from a sleep, and GAP_WAIT passes when the test says so."""

from __future__ import annotations

import threading
import time

from shadowfs.fuse_arrivals import Arrivals

WEDGED = 10.0  # real seconds: only a barrier that stopped polling or never returns comes near


class Steps:
    """A clock that moves only when told, and the barrier's pause, counting polls."""

    def __init__(self) -> None:
        self.now = 0.0
        self.polls = 0
        self._changed = threading.Condition()

    def clock(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        with self._changed:
            self.polls += 1
            self._changed.notify_all()
        time.sleep(0.0001)  # a real, short yield: the waiter must not spin the test's CPU

    def still_waiting(self, waiter: threading.Thread) -> bool:
        """Whether ``waiter``, given a whole look at the state as it is now, chose to wait: two
        more polls (the first may end a look begun before the change), or its end."""
        with self._changed:
            target = self.polls + 2
            self._changed.wait_for(
                lambda: self.polls >= target or not waiter.is_alive(), timeout=WEDGED
            )
            return waiter.is_alive()


def _waiter(arrivals: Arrivals, unique: int, **kwargs: float) -> threading.Thread:
    t = threading.Thread(target=arrivals.wait_before, args=(unique,), kwargs=kwargs, daemon=True)
    t.start()
    return t


def _returns(t: threading.Thread) -> bool:
    t.join(timeout=WEDGED)
    return not t.is_alive()


def test_a_barrier_waits_for_a_request_numbered_before_it_that_no_worker_has_recorded_yet() -> None:
    steps = Steps()
    a = Arrivals(clock=steps.clock, pause=steps.pause)
    a.arrived(2)  # INIT
    a.done(2)
    a.arrived(6)  # the barrier, recorded before request 4 that was read before it
    t = _waiter(a, 6)
    assert steps.still_waiting(t)
    a.arrived(4)
    assert steps.still_waiting(t)  # read, but still being served
    a.done(4)
    assert _returns(t)
    assert steps.now == 0.0  # no hole was given up on: the time never moved


def test_a_barrier_does_not_wait_for_requests_after_it_or_for_interrupts() -> None:
    steps = Steps()
    a = Arrivals(clock=steps.clock, pause=steps.pause)
    for u in (2, 4):
        a.arrived(u)
        a.done(u)
    a.arrived(6)
    a.arrived(8)  # read after the barrier and still being served
    a.arrived(5)  # an INTERRUPT of request 4 (odd: the low bit marks it)
    assert _returns(_waiter(a, 6))
    assert steps.polls == 0  # it never waited at all


def test_a_hole_that_never_fills_holds_a_barrier_only_for_the_gap_wait() -> None:
    steps = Steps()
    a = Arrivals(clock=steps.clock, pause=steps.pause)
    a.arrived(2)
    a.done(2)
    a.arrived(6)  # request 4 was taken back before any worker read it
    t = _waiter(a, 6, gap_wait=0.2)
    assert steps.still_waiting(t)
    steps.now = 0.2  # the whole gap wait, not past it
    assert steps.still_waiting(t)
    steps.now = 0.21
    assert _returns(t)
    # Given up on, the hole does not hold the next barrier: it returns with the time unmoved.
    a.done(6)
    a.arrived(8)
    polls = steps.polls
    assert _returns(_waiter(a, 8, gap_wait=0.2))
    assert steps.polls == polls


def test_a_hole_is_given_up_on_once_enough_requests_were_read_past_it() -> None:
    steps = Steps()
    a = Arrivals(early_max=100, clock=steps.clock, pause=steps.pause)
    a.arrived(2)
    a.done(2)
    # Request 4 never arrives; 6 .. 206 do, and are answered.
    for u in range(6, 208, 2):
        a.arrived(u)
        a.done(u)
    a.arrived(208)
    # However long the gap wait, the barrier does not wait for the time to pass.
    assert _returns(_waiter(a, 208, gap_wait=5.0))
    assert steps.now == 0.0 and steps.polls == 0
