"""jukebox.booth.procs against real processes: a child and the grandchild it started, one
of them named to trip a naive parse of /proc/PID/stat."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from jukebox.booth import procs


def test_children_and_descendants_of_a_real_process_tree() -> None:
    # The grandchild renames itself "a) (b c": the name holds ") " and spaces.
    grandchild = (
        "import ctypes, time; ctypes.CDLL(None).prctl(15, b'a) (b c', 0, 0, 0); time.sleep(60)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
         "print(p.pid, flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        grandchild_pid = int(child.stdout.readline())
        deadline = time.monotonic() + 30
        with open(f"/proc/{grandchild_pid}/comm") as f:
            while f.read().strip() != "a) (b c":  # renamed once its interpreter is up
                assert time.monotonic() < deadline
                f.seek(0)
        assert child.pid in procs.children_of(os.getpid())
        assert procs.children_of(child.pid) == [grandchild_pid]
        assert procs.parent_of(grandchild_pid) == child.pid
        found = procs.descendants_of(os.getpid())
        assert found.index(child.pid) < found.index(grandchild_pid)
    finally:
        child.kill()
        child.wait()
    os.kill(grandchild_pid, 9)
    assert procs.parent_of(2**22 + 1) is None  # beyond pid_max: no such process
