"""Runs a real command with a pseudo-terminal as its stdin, stdout and stderr, as a person's
shell would, and returns everything it drew there."""

from __future__ import annotations

import fcntl
import os
import re
import select
import subprocess
import termios
import time
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_on_terminal(
    argv: list[str],
    env: dict[str, str],
    cwd: Path | str = "/",
    timeout: float = 60,
    answer: tuple[bytes, str] | None = None,
) -> tuple[int, str]:
    """(exit status, the raw text the terminal received, escape sequences included). The pty is
    the command's controlling terminal (what /dev/tty opens); ``answer`` is (a question, the
    line typed once the question appears)."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, b"\x18\x00\x78\x00\x00\x00\x00\x00")  # 24x120

    def take_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        argv,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        cwd=cwd,
        preexec_fn=take_terminal,
    )
    os.close(follower)
    seen, answered = b"", answer is None
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # every holder of the follower closed it
                    break
                if not chunk:
                    break
                seen += chunk
                if not answered and answer is not None and answer[0] in seen:
                    os.write(leader, answer[1].encode() + b"\n")
                    answered = True
            elif proc.poll() is not None:
                # It may have written its last output and exited after the select above found
                # nothing: read what the terminal still holds (seen at load 8: an empty screen).
                seen += _left_in(leader)
                break
        return proc.wait(timeout=30), seen.decode(errors="replace")
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()


def _left_in(leader: int) -> bytes:
    left = b""
    while select.select([leader], [], [], 0)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # every holder of the follower closed it, nothing left
            break
        if not chunk:
            break
        left += chunk
    return left


def plain(screen: str) -> str:
    """The text without its escape sequences."""
    return ANSI.sub("", screen)
