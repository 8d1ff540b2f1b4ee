"""The FUSE worker's raised priority (shadowfs.fuse, "A raised priority, within a CPU budget"):
the worker serving the mount runs above the process where the process may raise it, drops back
before it blocks, and an agent keeping it busy gets it raised only within the budget."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from shadowfs import fuse
from tests.fs.conftest import NOBODY, needs_fuse, run_attack

# An agent keeping the worker busy: argv[1] is a work dir, argv[2] this checkout. The worker's
# clocks are the attack's own, so it uses up the budget without spinning; the nice values are
# the calling thread's (the "worker"), as the kernel sees them.
BUSY = r"""
import json, os, resource, sys
sys.path.insert(0, sys.argv[2])
from shadowfs import sched
if os.geteuid() != 0:
    resource.setrlimit(resource.RLIMIT_NICE, (0, 0))  # an unprivileged supervisor's limit
cpu, now = [0.0], [0.0]
base = os.getpriority(os.PRIO_PROCESS, 0)
boost = sched.Boost(base, 10, 0.05, 0.1, cpu=lambda: cpu[0], clock=lambda: now[0])
seen = []
for spent, at in ((0.0, 0.0), (0.03, 0.01), (0.06, 0.02), (0.09, 0.05), (0.10, 0.12)):
    cpu[0], now[0] = spent, at
    boost.check()
    seen.append(os.getpriority(os.PRIO_PROCESS, 0) - base)
boost.drop()
print(json.dumps({"seen": seen, "after": os.getpriority(os.PRIO_PROCESS, 0) - base}))
"""


@pytest.mark.parametrize("user", [None, NOBODY], ids=["root", "nobody"])
def test_an_agent_keeping_the_worker_busy_gets_the_raised_priority_only_within_the_budget(
    tmp_path: Path, user: int | None
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (the raised priority, and setpriv to run as nobody)")
    work = tmp_path / "work"
    work.mkdir()
    out = run_attack(BUSY, work, user)
    if user is None:
        # Raised; still within 0.05 s of CPU; over it inside the window: back to the base, and
        # there for the rest of the window; a new window: raised again.
        assert out["seen"] == [-10, -10, 0, 0, -10]
    else:
        # An unprivileged supervisor cannot raise a thread's priority: nothing changes.
        assert out["seen"] == [0, 0, 0, 0, 0]
    assert out["after"] == 0


@needs_fuse
def test_the_worker_serving_runs_above_the_process_and_drops_back_before_big_io(
    layer: object, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: only a process that may raise a thread's priority does")
    from shadowfs.mountctl import Mount

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base - fuse.WORKER_BOOST < -20:
        pytest.skip("this process already runs near the highest priority")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with Mount(layer, mnt) as m:  # type: ignore[arg-type]
        server = m._server
        assert server is not None
        assert (mnt / "README").read_text() == "readme\n"
        native = {t.ident: t.native_id for t in threading.enumerate()}
        leader = native[server._leader]
        assert leader is not None
        nices = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in server.tids}
        # The worker holding the turn (asleep in read(2) for the next request) is raised; the
        # ones waiting for the turn are not.
        assert nices.pop(leader) == base - fuse.WORKER_BOOST
        assert set(nices.values()) == {base}
        # A copy-up of a big file runs without the layer lock and the turn: the worker first
        # drops back to the process's priority.
        ops = m._ops
        assert ops is not None
        hand_on = ops.before_block
        at_block: list[int] = []

        def spy() -> None:
            hand_on()
            at_block.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

        ops.before_block = spy
        os.truncate(mnt / "big.bin", 2 * fuse.THREAD_IO)
        assert at_block and set(at_block) == {base}
        assert (mnt / "big.bin").stat().st_size == 2 * fuse.THREAD_IO
