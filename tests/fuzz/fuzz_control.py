"""The booth control socket: `validate` and `ControlServer.dispatch` on any request line.

`validate` documents RequestError (a ValueError) as its only refusal; `dispatch` documents that it
never raises and always answers one JSON line. The agent writing these lines is not trusted.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from jukebox.booth.control import ControlServer, Peer, RequestError, validate
from tests.fuzz.common import Target
from tests.fuzz.scratch import scratch

_PEER = Peer(1, 0, 0)


def _echo(request: dict[str, Any], peer: Peer) -> dict[str, Any]:
    return {"request": request, "peer": peer.as_dict()}


@cache
def _server() -> ControlServer:
    # Never started: dispatch is the whole request path once a line is framed.
    return ControlServer(
        str(scratch() / "control.sock"),
        {"checkpoint": _echo, "rollback": _echo, "status": _echo},
    )


def _seeds() -> list[bytes]:
    return [
        b'{"op": "checkpoint", "label": "before-refactor"}',
        b'{"op": "checkpoint"}',
        b'{"op": "rollback", "to": "before-refactor"}',
        b'{"op": "rollback", "to": 3}',
        b'{"op": "status"}',
        b'{"op": "rollback", "to": 1e400}',
        b"[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]",
    ]


def control_input(data: bytes) -> None:
    try:
        request = validate(data)
    except RequestError:
        pass
    else:
        if request.get("op") not in ("checkpoint", "rollback", "status"):
            raise AssertionError(f"validate accepted {request!r}")
    line = _server().dispatch(data, _PEER)
    if not line.endswith(b"\n") or b"\n" in line[:-1]:
        raise AssertionError(f"dispatch answered {line[:80]!r}, not one line")
    answer = json.loads(line)
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        raise AssertionError(f"dispatch answered {answer!r}")


TARGETS = [Target("control", control_input, _seeds, "control request validation and dispatch")]
