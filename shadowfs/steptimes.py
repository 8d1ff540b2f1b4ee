"""Opt-in step timers for measuring a long operation (a commit) from the outside.

``SHADOWFS_STEP_TIMES=1`` in the environment makes every `lap(name)` write one line to stderr:
the seconds since the previous lap (or since this module was first imported), the step's name
and the process's CPU seconds in that span. Unset, `lap` is one dictionary lookup. For
benchmarks and profiling only: no output format is promised.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "SHADOWFS_STEP_TIMES"
_on = bool(os.environ.get(ENV))
_last = (time.perf_counter(), time.process_time())


def lap(name: str) -> None:
    """End the step ``name`` (started at the previous lap)."""
    global _last
    if not _on:
        return
    now = (time.perf_counter(), time.process_time())
    wall, cpu = now[0] - _last[0], now[1] - _last[1]
    sys.stderr.write(f"step {wall:7.3f}s  cpu {cpu:7.3f}s  {name}\n")
    sys.stderr.flush()
    _last = now
