"""A real Arize Phoenix (`arize-phoenix` from PyPI, in its own venv: `make receivers`) on
127.0.0.1: its OTLP/HTTP endpoint takes the spans, its REST API gives them back."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENV_EXE = ROOT / ".venv" / "receivers" / "phoenix" / "bin" / "phoenix"
# A loaded machine starts Phoenix in tens of seconds (its imports); this only bounds a hang.
START_DEADLINE = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # A test run killed outright (a CI timeout, SIGKILL) runs no atexit: the kernel ends
    # Phoenix with it instead of leaving a server behind.
    import prctl

    prctl.set_pdeathsig(signal.SIGTERM)


class Phoenix:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self._ready = False

    @staticmethod
    def executable() -> Path | None:
        named = os.environ.get("JUKEBOX_PHOENIX")
        exe = Path(named) if named else VENV_EXE
        return exe if exe.is_file() else None

    @classmethod
    def start(cls, exe: Path, workdir: Path) -> Phoenix:
        port = free_port()
        env = {
            **os.environ,
            "PHOENIX_WORKING_DIR": str(workdir),
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(port),
            "PHOENIX_GRPC_PORT": str(free_port()),
            "PHOENIX_TELEMETRY_ENABLED": "false",
        }
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        log = workdir / "phoenix.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(exe), "serve"], env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip
        return cls(proc, port, log)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_DEADLINE
        while not self._ready:
            if self.proc.poll() is not None:
                raise AssertionError(f"Phoenix exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as r:
                    self._ready = r.status == 200
            except (urllib.error.URLError, OSError):
                pass
            if not self._ready:
                if time.monotonic() > deadline:
                    raise AssertionError(f"Phoenix did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.2)

    def spans(self, project: str = "default") -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            query = "limit=1000" + (f"&cursor={cursor}" if cursor else "")
            url = f"{self.url}/v1/projects/{project}/spans?{query}"
            try:
                with urllib.request.urlopen(url, timeout=10) as r:
                    body = json.load(r)
            except urllib.error.HTTPError as e:
                if e.code == 404:  # no span has arrived yet: the project is made by the first
                    return []
                raise
            out += body["data"]
            cursor = body.get("next_cursor")
            if not cursor:
                return out

    def wait_for(self, trace_id: str, count: int) -> list[dict[str, Any]]:
        """The spans of one trace once ``count`` of them are in (Phoenix inserts in batches)."""
        deadline = time.monotonic() + 60
        while True:
            spans = [s for s in self.spans() if s["context"]["trace_id"] == trace_id]
            if len(spans) >= count or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


_early: Phoenix | None = None


def start_early() -> None:
    """Start Phoenix while the tests are being collected, so that its start (tens of seconds of
    imports on a busy machine) overlaps the tests that run before these instead of adding to
    the suite's time. Stopped at exit whether or not a test used it."""
    global _early
    exe = Phoenix.executable()
    if exe is None or _early is not None:
        return
    workdir = Path(tempfile.mkdtemp(prefix="jukebox-phoenix-"))
    _early = Phoenix.start(exe, workdir)
    atexit.register(shutil.rmtree, workdir, True)
    atexit.register(_early.stop)


def early() -> Phoenix | None:
    """The Phoenix `start_early` started, if Phoenix is installed."""
    start_early()
    return _early
