"""`jukebox export otel` as a user runs it: its refusals (one line, exit 2), a collector that is
not there (exit 1), --help."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.export.conftest import Recorded


def jukebox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_jukebox(), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _jukebox() -> str:
    import os

    return os.path.join(os.path.dirname(sys.executable), "jukebox")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_input_is_one_line_and_exit_2(recorded: Recorded) -> None:
    tape = str(recorded.path)
    for args, says in [
        (["--endpoint", "localhost:4318", tape], "is not an http(s) URL"),
        ([f"{tape}@3", "--endpoint", "http://127.0.0.1:9"], "takes a whole tape"),
        (["--endpoint", "http://127.0.0.1:9", str(recorded.tape_dir / "nope.jbx")], "nope"),
    ]:
        result = jukebox("export", "otel", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr


def test_a_collector_that_is_not_there_fails_the_export(recorded: Recorded) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    result = jukebox("export", "otel", str(recorded.path), "--endpoint", url, "--timeout", "0.5")
    assert result.returncode == 1, result.stderr
    assert f"{url} did not accept the spans of 1 tape(s)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert "NOT accepted" in result.stdout

    as_json = jukebox(
        "export", "otel", str(recorded.path), "--endpoint", url, "--timeout", "0.5", "--json"
    )
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1
    assert report["tapes"][0]["spans_sent"] is False and report["tapes"][0]["spans"] == 22


def test_help_names_the_options() -> None:
    result = jukebox("export", "otel", "--help")
    assert result.returncode == 0
    for option in ("--endpoint", "--capture-content", "--timeout", "--json", "TAPE…"):
        assert option in result.stdout
