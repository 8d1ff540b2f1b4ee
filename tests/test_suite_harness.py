"""The suite's own machinery (tests/conftest.py): what a test's commands inherit, and how
`pytest -n` keeps tests that share a fixture on one worker."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.conftest import REPO

# A child's ignored signals, from its /proc status: bit n-1 for signal n.
IGNORED = "print(int(open('/proc/self/status').read().split('SigIgn:')[1].split()[0], 16))"


def test_a_tests_commands_get_ctrl_c_however_the_suite_was_started() -> None:
    # A suite started with SIGINT and SIGQUIT ignored: once tests/conftest.py is loaded, what
    # its tests start takes them as from a terminal (Python keeps an inherited ignore, and
    # `jukebox view` then never stopped on the SIGINT a test sent).
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {IGNORED!r}])"
    for code, expect_ignored in ((child, True), ("import tests.conftest; " + child, False)):
        # What a shell does to a background job (`make test &`), then the suite's process.
        out = subprocess.run(
            ["sh", "-c", 'trap "" INT QUIT; exec "$0" -c "$1"', sys.executable, code],
            capture_output=True, text=True, cwd=REPO, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        ignored = int(out.stdout)
        for sig in (signal.SIGINT, signal.SIGQUIT):
            assert bool(ignored & (1 << (sig - 1))) is expect_ignored, (code, hex(ignored))
