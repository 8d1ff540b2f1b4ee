"""jukebox.terminal on its own: the operator's settings come back when the supervisor fails.

The booth-level attacks are in tests/reliability/test_escape_terminal.py; this one needs a
failure in the middle of a run, which only an exception raised on purpose gives.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import termios

# A process whose stdio is a pty it controls: it goes raw through AgentTerminal, then fails
# inside `relayed` while its relay thread runs, and reports what its terminal looks like after.
SCRIPT = r"""
import json, os, termios
from jukebox.terminal import AgentTerminal, relayed

before = termios.tcgetattr(0)
term = AgentTerminal.for_caller()
raw = None
try:
    with relayed(term):
        term.start(on_interrupt=lambda: None)
        raw = termios.tcgetattr(0)
        raise RuntimeError("the supervisor failed mid-run")
except RuntimeError:
    pass
print(json.dumps({
    "interactive": term.interactive,
    "went_raw": raw is not None and not raw[3] & termios.ICANON,
    "restored": termios.tcgetattr(0) == before,
    "pty_closed": term.master == -1,
}), flush=True)
"""


def test_an_exception_mid_run_gives_the_operator_his_terminal_back() -> None:
    leader, follower = os.openpty()

    def take_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        preexec_fn=take_terminal,
    )
    os.close(follower)
    screen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    assert proc.wait(timeout=30) == 0, screen
    os.close(leader)
    line = next(ln for ln in screen.decode().splitlines() if ln.startswith("{"))
    assert line.strip() == (
        '{"interactive": true, "went_raw": true, "restored": true, "pty_closed": true}'
    ), screen
