"""syncfs(2): make everything written to one file system durable in a single call.

A commit of thousands of files pays a journal commit per fsync even when the file system folds
concurrent ones together; one syncfs writes all of them back and commits the journal once.
It also writes back whatever else is dirty on that file system, so it pays off only for many
files (callers choose the threshold). Since Linux 5.8 it reports write-back errors as fsync does.
"""

from __future__ import annotations

import ctypes
import os

from shadowfs.libc import libc as _libc


def syncfs(fd: int) -> None:
    """Flush the file system holding ``fd`` to stable storage; OSError if it could not."""
    if _libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
