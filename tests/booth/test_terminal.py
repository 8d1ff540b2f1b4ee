"""jukebox.booth.terminal on its own: the operator's settings come back when the supervisor fails.

The booth-level attacks are in tests/reliability/test_escape_terminal.py; this one needs a
failure in the middle of a run, which only an exception raised on purpose gives.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

# A process whose stdio is a pty it controls: it goes raw through AgentTerminal, then fails
# inside `relayed` while its relay thread runs, and reports what its terminal looks like after.
SCRIPT = r"""
import json, os, termios
from jukebox.booth.terminal import AgentTerminal, relayed

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


def _running(marker: str) -> bool:
    """Whether a process has `marker` as one of its arguments (the booth's own command line
    holds it only inside the --verify string)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    return True
        except OSError:
            continue
    return False


@pytest.mark.serial  # failed under load before
def test_the_operators_interrupt_reaches_the_verifier(tmp_path: Path) -> None:
    """The verifier leads a session of its own, out of the terminal's reach: the supervisor
    passes an interrupt on to it, and the booth is kept pending as after any interruption."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse")
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    marker = f"verifier-of-{os.getpid()}"
    verifier = f"exec python3 -c 'import time; time.sleep(600)' {marker}"
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "jukebox"),
            *("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes)),
            *("--tape-id", "v", "--verify", verifier, "--", "true"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        while not _running(marker):
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output
    assert "kept pending (interrupted)" in output, output
    assert not _running(marker)
