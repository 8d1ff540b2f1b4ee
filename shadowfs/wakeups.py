"""Background threads woken after an answer, not before it.

A checkpoint schedules two background flushes (the store's group commit, the booth's tape). Each
schedule notified a sleeping thread at once, which then woke, preempted the
control thread and asked for the interpreter lock while the checkpoint was still being
answered: the answer waited for those threads' turns (1.1-2.6 ms each in the mean of 90
checkpoints taken after a pause, `perf sched` beside timestamps in the control thread;
docs/benchmarks.md). Neither flush is due for tens of milliseconds, so nothing is
lost by waking them once the answer has left.

`notify(cond)` notifies at once, unless the calling thread is inside `deferred()`, which then
notifies every condition it collected on leaving. The control server wraps each request's
handling and answer in `deferred()`.
"""

from __future__ import annotations

import threading
from types import TracebackType

_local = threading.local()


def notify(cond: threading.Condition) -> None:
    """``cond.notify()``, now or when this thread leaves `deferred()`. Call it holding
    ``cond``'s lock, as ``cond.notify()`` itself requires."""
    pending: list[threading.Condition] | None = getattr(_local, "pending", None)
    if pending is None:
        cond.notify()
    elif cond not in pending:
        pending.append(cond)


class deferred:
    """A section whose `notify` calls wait for its end (nestable: the outermost notifies).

    A class, not a generator: this runs on every control request, and a generator's context
    manager costs several more Python frames on a path that runs cold."""

    __slots__ = ("_outer",)

    def __enter__(self) -> None:
        self._outer = getattr(_local, "pending", None) is not None
        if not self._outer:
            _local.pending = []

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._outer:
            return
        pending = _local.pending
        _local.pending = None
        for cond in pending:
            with cond:
                cond.notify()
