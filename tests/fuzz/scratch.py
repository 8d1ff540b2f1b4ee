"""A per-process scratch directory for harnesses that must hand their input to code as a file."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path


@cache
def scratch() -> Path:
    path = Path(tempfile.mkdtemp(prefix="jukebox-fuzz-"))
    atexit.register(shutil.rmtree, path, True)
    return path
