"""Reading and committing commands run in this process: the CLI's own code and error handling,
without an interpreter start per call (a booth run still goes through `jb`, a real process)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from click.testing import CliRunner


def here(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    import jukebox.cli.booth_review
    import jukebox.cli.show
    import jukebox.cli.tapes  # noqa: F401
    from jukebox.cli import cli

    old = os.getcwd()
    os.chdir(cwd or "/")
    try:
        result = CliRunner().invoke(cli, list(args), env=env)
    finally:
        os.chdir(old)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: {result.exception!r}") from result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)
