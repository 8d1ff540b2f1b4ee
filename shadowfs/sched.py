"""A thread's scheduler slice: how long it may run before the kernel looks for another task.

Linux's fair scheduler (EEVDF, 6.6 and later) gives each task a deadline one slice after it is
picked, and from 6.12 a task may ask for a slice of its own (sched_setattr's `sched_runtime`,
0.1-100 ms; no privilege needed, its nice value and share of the CPU unchanged). A thread that
sleeps most of the time and must answer quickly when woken (the booth's control socket) asks
for a short one: its earlier deadline lets it preempt a task that was running when it woke,
instead of waiting for that task's slice to end (milliseconds on a machine whose cores are
busy). Older kernels ignore the field; other systems have no such call.

A thread's priority (its nice value) is its share of the CPU against the other tasks of its
scheduling group. `Boost` raises a thread's priority within a CPU budget where the process may
(the FUSE workers, shadowfs.fuse); such a thread is marked reset-on-fork, so that the threads
and processes it starts begin at nice 0, not at its raised value.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable

from shadowfs.libc import libc

# sched_setattr(2) by architecture; libc has no wrapper for it.
_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(os.uname().machine)
_SCHED_ATTR_SIZE_VER0 = 48
_SCHED_FLAG_RESET_ON_FORK = 1


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
    ]


def short_slice(seconds: float, tid: int = 0, *, reset_on_fork: bool | None = None) -> bool:
    """Ask for a slice of ``seconds`` for thread ``tid`` (0: the calling thread); whether the
    kernel accepted it. ``reset_on_fork``: mark the thread so that the threads and processes it
    starts take neither its slice nor a negative nice value (None: as the thread has it now;
    the call would otherwise clear the mark).

    Only for a thread under the normal policy (SCHED_BATCH and SCHED_IDLE, which someone chose,
    stay as they are), and keeping its nice value: the call sets both."""
    if _SYS_SCHED_SETATTR is None:
        return False
    try:
        policy = os.sched_getscheduler(tid)
        if policy & ~os.SCHED_RESET_ON_FORK != os.SCHED_OTHER:
            return False
        nice = os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())
    except OSError:
        return False
    if reset_on_fork is None:
        reset_on_fork = bool(policy & os.SCHED_RESET_ON_FORK)
    attr = _SchedAttr(
        size=_SCHED_ATTR_SIZE_VER0,
        sched_policy=os.SCHED_OTHER,
        sched_flags=_SCHED_FLAG_RESET_ON_FORK if reset_on_fork else 0,
        sched_nice=nice,
        sched_runtime=int(seconds * 1e9),
    )
    result: int = libc.syscall(_SYS_SCHED_SETATTR, tid, ctypes.byref(attr), 0)
    return result == 0


def set_nice(nice: int, tid: int = 0) -> bool:
    """Give thread ``tid`` (0: the calling thread) the nice value ``nice``; whether the kernel
    allowed it. Raising a thread's priority (a lower value) needs CAP_SYS_NICE or an
    RLIMIT_NICE that allows it; lowering it is always allowed."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid or threading.get_native_id(), nice)
    except OSError:
        return False
    return True


class BoostBudget:
    """The CPU that raised threads may use together: ``budget`` seconds within each ``window``
    seconds. Shared by all the threads one `Boost` each raises, so that threads raised in turn
    (a worker handing the turn on before it blocks, the next one taking it) use one budget
    between them, not one each. Written under the GIL; a check's worth of CPU may go over."""

    __slots__ = ("budget", "clock", "spent", "start", "window")

    def __init__(
        self, budget: float, window: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.budget = budget
        self.window = window
        self.clock = clock
        self.start = clock()
        self.spent = 0.0

    def spend(self, seconds: float) -> None:
        self._roll()
        self.spent += seconds

    def left(self) -> bool:
        self._roll()
        return self.spent <= self.budget

    def _roll(self) -> None:
        now = self.clock()
        if now - self.start >= self.window:
            self.start = now
            self.spent = 0.0


class Boost:
    """A thread's priority raised ``steps`` nice values above ``base``, within a shared CPU
    budget (`BoostBudget`): the CPU the thread uses while raised is charged to it, and once
    the window's budget is used up the thread runs at ``base`` for the rest of that window.
    Only the thread itself calls `check` and `drop`, and only for a ``base`` of 0 or below
    (`may_boost`), with the thread marked reset-on-fork: what it starts then begins at nice 0,
    never at the raised value.

    ``cpu`` reads the thread's CPU time: a test passes its own, to use up the budget without
    spinning. Where the process may not raise a thread's priority, the thread stays at
    ``base``."""

    __slots__ = ("base", "budget", "cpu", "high", "since", "steps")

    def __init__(
        self,
        base: int,
        steps: int,
        budget: BoostBudget,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        self.base = base
        self.steps = steps
        self.budget = budget
        self.cpu = cpu
        self.high = False
        self.since = 0.0

    def check(self) -> None:
        """Raise the priority if the budget has some left, else drop it."""
        if self.high:
            now = self.cpu()
            self.budget.spend(now - self.since)
            self.since = now
        if not self.budget.left():
            self.drop()
        elif not self.high:
            self.high = set_nice(self.base - self.steps)
            self.since = self.cpu()

    def drop(self) -> None:
        """Back to ``base`` (before the thread blocks on something that may take long)."""
        if self.high:
            self.budget.spend(self.cpu() - self.since)
            set_nice(self.base)
            self.high = False


def may_boost(steps: int) -> int | None:
    """Prepare the calling thread for a `Boost` of ``steps``: its nice value (the boost's base)
    if the process may raise it that far, with the thread marked reset-on-fork; else None.

    Not for a thread running at a positive nice value (someone asked it to yield, and what it
    starts would inherit the raised value: reset-on-fork only resets a negative one), nor under
    another policy than the normal one."""
    tid = threading.get_native_id()
    try:
        policy = os.sched_getscheduler(0)
        base = os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return None
    if steps <= 0 or base > 0 or policy & ~os.SCHED_RESET_ON_FORK != os.SCHED_OTHER:
        return None
    if not policy & os.SCHED_RESET_ON_FORK:
        try:
            os.sched_setscheduler(0, policy | os.SCHED_RESET_ON_FORK, os.sched_param(0))
        except OSError:
            return None
    if not set_nice(base - steps):
        return None
    set_nice(base)
    return base
