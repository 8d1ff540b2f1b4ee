"""How long to busy-poll for what is about to come before sleeping on it, learnt per kind of
wait: the bound shared by the proxies' polls (the LLM proxy's sockets, jukebox.llm.fastio; the
SQL proxy's server session, jukebox.sql.upstream).

On this project's VMs a process that sleeps in `epoll_wait` and is woken by a loopback write
pays the wake-up of an idle vCPU (tens to hundreds of µs; guest halt-polling is off), and a
proxy pays it on each hop where a direct client pays it once. Polling for an answer that is
about to come spares that wake-up; polling for one that is not wastes a core. `Spin` keeps the
poll to answers known to be quick, and to a bound.
"""

from __future__ import annotations

import os


class Spin:
    """How long to busy-poll before sleeping, learnt from how long the last wait of the same
    kind took (what the kernel's guest halt-polling does for a vCPU, per wait).

    An answer that comes within `cap_ns` is polled for, up to twice as long as the last one
    took; an answer slower than the cap (a remote API's, a model thinking, a long query) is
    slept for, and its wait sets the budget to 0 until a wait of that kind is short again. The
    CPU spent spinning is at most the budget per wait, and nothing while the waits of that kind
    are longer than the cap. A cap of 0 never polls."""

    __slots__ = ("budget_ns", "cap_ns")

    def __init__(self, cap_ns: int) -> None:
        self.cap_ns = cap_ns
        self.budget_ns = 0  # nothing known yet: the first wait sleeps, and is measured

    def observed(self, waited_ns: int) -> None:
        self.budget_ns = min(2 * waited_ns, self.cap_ns) if waited_ns <= self.cap_ns else 0


CPUS = os.cpu_count() or 1


def runnable() -> int:
    """Tasks running or waiting for a CPU on the whole machine now, the caller included (the
    fourth field of /proc/loadavg); 0 when it cannot be read. A poll is worth its CPU only
    when a CPU would otherwise go idle: with more tasks runnable than CPUs, none does, and the
    poll would hold one that other work waits for."""
    try:
        fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return int(os.read(fd, 128).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        os.close(fd)
