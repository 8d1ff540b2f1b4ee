"""shadowfs.lazylog: the FUSE server's logger imports `logging` at its first message, and that
message reaches the handlers as the real logger's would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shadowfs.lazylog import LazyLogger


def test_a_message_reaches_the_module_logger(caplog: pytest.LogCaptureFixture) -> None:
    # A name no other test has made: a library configuring logging earlier in the session
    # (dictConfig's disable_existing_loggers) disables every logger that existed by then.
    name = "shadowfs.lazylog_test"
    log = LazyLogger(name)
    with caplog.at_level("DEBUG", logger=name):
        log.error("shadowfs: request %d failed", 7)
        log.debug("shadowfs: requests %d..%d never arrived", 1, 2)
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        (name, "ERROR", "shadowfs: request 7 failed"),
        (name, "DEBUG", "shadowfs: requests 1..2 never arrived"),
    ]


def test_the_fuse_server_imports_no_logging_until_it_logs() -> None:
    code = (
        "import sys; import shadowfs.fuse as f; assert 'logging' not in sys.modules; "
        "f.log.warning('x'); assert 'logging' in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "x"  # logging's last resort handler, as for any logger
