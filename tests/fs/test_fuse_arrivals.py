"""The barrier's bookkeeping (shadowfs.fuse_arrivals) driven by threads directly: which requests
count as read and answered before a barrier, in the kernel's numbering."""

from __future__ import annotations

import threading
import time

from shadowfs.fuse_arrivals import Arrivals


def _waiter(
    arrivals: Arrivals, unique: int, **kwargs: float
) -> tuple[threading.Thread, list[float]]:
    returned: list[float] = []

    def wait() -> None:
        arrivals.wait_before(unique, **kwargs)
        returned.append(time.monotonic())

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t, returned


def test_a_barrier_waits_for_a_request_numbered_before_it_that_no_worker_has_recorded_yet() -> None:
    a = Arrivals()
    a.arrived(2)  # INIT
    a.done(2)
    a.arrived(6)  # the barrier, recorded before request 4 that was read before it
    t, returned = _waiter(a, 6)
    time.sleep(0.05)
    assert returned == []
    a.arrived(4)
    time.sleep(0.05)
    assert returned == []  # read, but still being served
    a.done(4)
    t.join(timeout=5)
    assert returned


def test_a_barrier_does_not_wait_for_requests_after_it_or_for_interrupts() -> None:
    a = Arrivals()
    for u in (2, 4):
        a.arrived(u)
        a.done(u)
    a.arrived(6)
    a.arrived(8)  # read after the barrier and still being served
    a.arrived(5)  # an INTERRUPT of request 4 (odd: the low bit marks it)
    t, returned = _waiter(a, 6)
    t.join(timeout=5)
    assert returned


def test_a_hole_that_never_fills_holds_a_barrier_only_for_the_gap_wait() -> None:
    a = Arrivals()
    a.arrived(2)
    a.done(2)
    a.arrived(6)  # request 4 was taken back before any worker read it
    start = time.monotonic()
    t, returned = _waiter(a, 6, gap_wait=0.2)
    t.join(timeout=5)
    assert returned and 0.2 <= returned[0] - start < 2
    # Given up on, the hole does not hold the next barrier.
    a.done(6)
    a.arrived(8)
    start = time.monotonic()
    t, returned = _waiter(a, 8, gap_wait=0.2)
    t.join(timeout=5)
    assert returned and returned[0] - start < 0.15


def test_a_hole_is_given_up_on_once_enough_requests_were_read_past_it() -> None:
    a = Arrivals(early_max=100)
    a.arrived(2)
    a.done(2)
    # Request 4 never arrives; 6 .. 206 do, and are answered.
    for u in range(6, 208, 2):
        a.arrived(u)
        a.done(u)
    a.arrived(208)
    start = time.monotonic()
    t, returned = _waiter(a, 208, gap_wait=5.0)
    t.join(timeout=10)
    assert returned and returned[0] - start < 1.0
