"""Which FUSE requests the daemon has read and is still serving, in the kernel's own order.

The mount's barrier (`shadowfs.mountctl.Mount.sync`) is a STATFS sent after a syncfs(2): its
answer must mean that every write the syncfs handed out is in the layer. The kernel numbers
requests (their ``unique``) as it queues them and hands them out in that order, so the
writes all carry smaller numbers than the STATFS. Waiting for the requests still being served
is not enough: a worker back from read(2) with a write still has to win the GIL before it can
record that it holds one, and the worker that read the STATFS after it can win first (seen
here in about 1 checkpoint in 400, with the writer's file still open). So the barrier also
waits until every number below its own has been read by some worker.

The kernel steps the numbers by 2 (the low bit marks an INTERRUPT, which carries the number of
the request it interrupts). A request taken back before any worker read it (its process was
killed while it waited in the queue) leaves a hole that never fills; a barrier gives up on
holes after GAP_WAIT, and so does the bookkeeping once EARLY_MAX numbers were read past one,
which no worker can have waited out for the GIL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from shadowfs.lazylog import LazyLogger

log = LazyLogger(__name__)  # logging imported at the first message

STEP = 2
# Longer than a worker can plausibly wait for the GIL after read(2) (a few switch intervals of
# 5 ms), short enough that a hole left by a killed process costs one barrier little.
GAP_WAIT = 0.25
# Numbers kept above a hole before it is given up on: a bound on the memory a hole can cost.
EARLY_MAX = 65536
_POLL = 0.00005


class Arrivals:
    """The requests read so far (by ``unique``) and the ones being served."""

    __slots__ = ("_clock", "_early", "_early_max", "_lock", "_next", "_pause", "_serving")

    def __init__(
        self,
        early_max: int = EARLY_MAX,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
    ) -> None:
        """``clock`` and ``pause`` are what a barrier's wait reads the time with and polls
        with: a test passes its own, to see a barrier decide to wait, and to move the time
        past GAP_WAIT, without sleeping."""
        self._early_max = early_max
        self._clock = clock
        self._pause = pause
        self._lock = threading.Lock()
        # Every number below _next has been read; _early holds the ones read above it.
        self._next: int | None = None
        self._early: set[int] = set()
        self._serving: set[int] = set()

    def arrived(self, unique: int) -> None:
        """A worker read request ``unique`` and is about to serve it."""
        if unique & (STEP - 1):
            return  # an INTERRUPT: not a request of its own
        with self._lock:
            self._serving.add(unique)
            nxt = self._next
            if nxt is None or unique == nxt:
                self._advance(unique + STEP)
            elif unique > nxt:
                early = self._early
                early.add(unique)
                if len(early) > self._early_max:
                    self._advance(min(early))

    def done(self, unique: int) -> None:
        """Request ``unique`` has been answered."""
        self._serving.discard(unique)

    def wait_before(
        self, unique: int, gap_wait: float = GAP_WAIT, on_wait: Callable[[], None] | None = None
    ) -> None:
        """Return once every request numbered below ``unique`` has been read and answered;
        ``on_wait`` is called once, before the first pause, if there is anything to wait for.

        Called by the worker serving request ``unique``, which must have `arrived`."""
        clock = self._clock
        deadline = clock() + gap_wait
        while True:
            with self._lock:
                nxt = self._next
                read_all = nxt is None or nxt > unique
                if not read_all and clock() > deadline:
                    log.debug("shadowfs: requests %d..%d never arrived; a barrier went on", nxt,
                              unique - STEP)
                    self._advance(unique)
                    read_all = True
                if read_all and not any(u < unique for u in self._serving):
                    return
            if on_wait is not None:
                on_wait()
                on_wait = None
            self._pause(_POLL)

    def _advance(self, nxt: int) -> None:
        """Every number below ``nxt`` counts as read (holes below it given up on)."""
        early = self._early
        if early and min(early) < nxt:
            early.difference_update([u for u in early if u < nxt])
        while nxt in early:
            early.remove(nxt)
            nxt += STEP
        self._next = nxt
