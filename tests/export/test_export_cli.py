"""`jukebox export otel` as a user runs it: its refusals (one line, exit 2), a collector that is
not there (exit 1, the report still printed), --help. In process (click's runner) but for the
helper the Phoenix test uses to run the real command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from click.testing import CliRunner

from tests.export.conftest import Recorded


def jukebox(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed `jukebox` command, in a process of its own."""
    exe = os.path.join(os.path.dirname(sys.executable), "jukebox")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)


def export(*args: str) -> tuple[int, str, str]:
    import jukebox.cli.export  # noqa: F401  (registers the command)
    from jukebox.cli import cli

    result = CliRunner().invoke(cli, ["export", "otel", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: {result.exception!r}") from result.exception
    return result.exit_code, result.stdout, result.stderr


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
        code, _, err = export(*args)
        assert code == 2, (args, err)
        assert says in err and len(err.strip().splitlines()) == 1, err
        assert "Traceback" not in err


def test_a_collector_that_is_not_there_fails_the_export(recorded: Recorded) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    code, out, err = export(str(recorded.path), "--endpoint", url, "--timeout", "0.5", "--json")
    assert code == 1, err
    assert f"{url} did not accept the spans of 1 tape(s)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    report = json.loads(out)
    assert report["endpoint"] == url and report["capture_content"] is False
    tape = report["tapes"][0]
    assert tape["spans_sent"] is False and tape["spans"] == 22 and tape["tape_id"] == "otelrun"


def test_help_names_the_options() -> None:
    code, out, _ = export("--help")
    assert code == 0
    for option in ("--endpoint", "--capture-content", "--timeout", "--json", "TAPE…"):
        assert option in out


def test_the_endpoint_is_a_base_url_and_a_pasted_signal_url_works_too() -> None:
    from jukebox.export.otel_send import signal_url

    assert signal_url("http://c:4318", "traces") == "http://c:4318/v1/traces"
    assert signal_url("http://c:4318/", "metrics") == "http://c:4318/v1/metrics"
    assert signal_url("http://c:6006/v1/traces", "metrics") == "http://c:6006/v1/metrics"
    assert signal_url("http://c/otlp/v1/metrics/", "traces") == "http://c/otlp/v1/traces"
