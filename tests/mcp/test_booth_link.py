"""The wrapper's frames to the booth's supervisor (jukebox.mcp.record.BoothSink): written without
waiting for the reply, and still recorded, in order, when the wrapper is gone and the booth
ends before the supervisor read them."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from jukebox.booth.control import ControlServer

# A gateway that records a frame, then, when told, two more, and dies at once.
GATEWAY = """
import os, sys
from jukebox.mcp.record import BoothSink
from jukebox.redact import Scrubber

sink = BoothSink([], Scrubber(), sys.argv[1])
frame = {"server": "s", "tool": "t", "ok": True}
sink.record("tool_call", {**frame, "args": {"n": 0}})
sys.stdin.readline()
for n in (1, 2):
    sink.record("tool_call", {**frame, "args": {"n": n}})
os._exit(0)
"""


def test_frames_in_the_socket_when_the_booth_ends_are_recorded(tmp_path: Path) -> None:
    recorded: list[int] = []
    busy, carry_on = threading.Event(), threading.Event()

    def record(request: dict[str, Any], peer: Any) -> dict[str, Any]:
        recorded.append(request["payload"]["args"]["n"])
        busy.set()
        carry_on.wait(timeout=60)  # a supervisor busy with the first frame
        return {}

    path = str(tmp_path / "control.sock")
    none: Any = lambda request, peer: {}  # noqa: E731
    server = ControlServer(path, {"checkpoint": none, "rollback": none, "status": none,
                                  "mcp_record": record}).start()  # fmt: skip
    closing = threading.Thread(target=server.close)
    try:
        gateway = subprocess.Popen([sys.executable, "-c", GATEWAY, path], text=True,
                                   stdin=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        assert busy.wait(timeout=60)
        # Two more frames while the supervisor is busy, and the gateway is gone.
        _, err = gateway.communicate("go\n", timeout=60)
        assert gateway.returncode == 0, err
        # The booth ends (its agent has left) before the supervisor read them.
        closing.start()
        while not server._stop:
            closing.join(timeout=0.01)
    finally:
        carry_on.set()
        if closing.ident is not None:
            closing.join(timeout=60)
        else:
            server.close()
    assert recorded == [0, 1, 2]
