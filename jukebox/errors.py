"""Errors the jukebox runtime raises on purpose.

`exit_code` follows DESIGN.md: 1 when the thing checked failed (tampering, divergence, conflict),
2 for usage or input errors. The CLI prints `str(error)` as one line and exits with it.
"""

from __future__ import annotations


class JukeboxError(Exception):
    exit_code = 2


class UsageError(JukeboxError):
    exit_code = 2


class CheckFailed(JukeboxError):
    """The thing checked failed: verify found tampering, replay diverged, a commit conflicted."""

    exit_code = 1
