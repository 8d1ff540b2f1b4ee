"""The wrapper's frames to the booth's supervisor (jukebox.mcp.record.BoothSink): written without
waiting for the reply, and still recorded, in order, when the wrapper dies before the
supervisor read them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from jukebox.booth.control import ControlServer

# A gateway that records three frames and dies at once, its supervisor not reading yet.
GATEWAY = """
import os, sys
from jukebox.mcp.record import BoothSink
from jukebox.redact import Scrubber

sink = BoothSink([], Scrubber(), sys.argv[1])
for n in range(3):
    sink.record("tool_call", {"server": "s", "tool": "t", "args": {"n": n}, "ok": True})
os._exit(0)
"""


def test_frames_in_the_socket_when_the_gateway_dies_are_recorded(tmp_path: Path) -> None:
    recorded: list[dict[str, Any]] = []

    def record(request: dict[str, Any], peer: Any) -> dict[str, Any]:
        recorded.append(request["payload"])
        return {}

    path = str(tmp_path / "control.sock")
    none: Any = lambda request, peer: {}  # noqa: E731
    # Not started: nothing reads the socket until it is closed, as when the booth ends first.
    server = ControlServer(path, {"checkpoint": none, "rollback": none, "status": none,
                                  "mcp_record": record})  # fmt: skip
    try:
        died = subprocess.run([sys.executable, "-c", GATEWAY, path], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert died.returncode == 0, died.stderr
        assert recorded == []
    finally:
        server.close()
    assert [p["args"]["n"] for p in recorded] == [0, 1, 2]
