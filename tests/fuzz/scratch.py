"""A per-process scratch directory for harnesses that must hand their input to code as a file."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

# Set by the long runner (`python -m tests.fuzz`) for each worker it starts: libFuzzer ends a
# worker with _exit, which skips atexit, so the runner removes the directory itself.
SCRATCH_ENV = "JUKEBOX_FUZZ_SCRATCH"


@cache
def scratch() -> Path:
    given = os.environ.get(SCRATCH_ENV)
    if given:
        return Path(given)
    path = Path(tempfile.mkdtemp(prefix="jukebox-fuzz-"))
    atexit.register(shutil.rmtree, path, True)
    return path
