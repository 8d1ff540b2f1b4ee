"""`jukebox log -f TAPE`: the timeline of a run still being recorded, frame by frame.

The tape is only ever appended to, so following it is re-reading it when it grows and printing
the frames not printed yet (a record half-written is a torn tail for that read, whole on the
next). It ends when the run has: a verdict frame (`commit`, `discard`, a final `rollback`), or
an `exit` frame once no booth is running for the tape any more (a pending booth's run is over;
its verdict comes from a later command), or a booth whose supervisor died. Ctrl-C ends it too;
both exit 0. A tape whose chain breaks ends it with the one-line error, exit 1, as `log` does.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

POLL_SECONDS = 0.2
_WIDTHS = (7, 10, 12, 12)  # FRAME, AT, KIND, TREE: fixed, as rows come one at a time


def _row(frame: Any, start_ns: int) -> list[str]:
    from jukebox.display.render import describe, seconds

    tree = frame.tree.hex()[:12] if frame.tree else ""
    return [
        f"@{frame.seq}",
        "+" + seconds(frame.time_ns - start_ns),
        frame.kind,
        tree,
        describe(frame.kind, frame.payload),
    ]


def _line(cells: list[str]) -> str:
    from jukebox.display.names import printable

    fixed = [
        c.rjust(w) if i == 1 else c.ljust(w)
        for i, (c, w) in enumerate(zip(cells, _WIDTHS, strict=False))
    ]
    return printable("  ".join([*fixed, cells[-1]]).rstrip())


def _booth_state(path: Path, booths: Path) -> str:
    """`running` while a live supervisor records into the tape, `dead` when its record says
    running but the process is gone, else `none` (no booth, or one whose run is over)."""
    from jukebox.booth.supervisor import _alive

    try:
        record = json.loads((booths / f"{path.stem}.json").read_text())
    except (OSError, ValueError):
        return "none"
    if not isinstance(record, dict) or record.get("status") != "running":
        return "none"
    return "running" if _alive(record.get("pid")) else "dead"


def _finished(frames: list[Any], state: str) -> str | None:
    """Why following stops, or None to keep going."""
    exited = False
    for frame in reversed(frames):
        if frame.kind in ("commit", "discard") or (
            frame.kind == "rollback" and frame.payload.get("final") is True
        ):
            return "verdict"
        if frame.kind == "fork":
            break
        exited = exited or frame.kind == "exit"
    if state == "dead":
        return "crashed"
    if exited and state == "none":
        return "exited"
    return None


def follow(
    path: Path,
    booths: Path,
    echo: Callable[[str], None],
    as_json: bool,
    poll: float = POLL_SECONDS,
) -> None:
    """Print the tape at ``path`` and then each frame written to it until the run ends.
    ``booths`` is the tape dir's booth records, which say whether a booth still records."""
    from jukebox.tape.tape import Tape

    shown = 0
    size = -1
    start_ns = 0
    frames: list[Any] = []
    try:
        while True:
            current = os.stat(path).st_size
            if current != size:
                size = current
                tape = Tape.load(path)
                frames = tape.intact_frames
                if frames and not shown:
                    start_ns = frames[0].time_ns
                    if not as_json:
                        echo(_line(["FRAME", "AT", "KIND", "TREE", "WHAT"]))
                for frame in frames[shown:]:
                    if as_json:
                        row = {"seq": frame.seq, "kind": frame.kind, "time_ns": frame.time_ns,
                               "id": frame.id.hex(), "payload": frame.payload,
                               "tree": frame.tree.hex() if frame.tree else None}  # fmt: skip
                        echo(json.dumps(row, sort_keys=True))
                    else:
                        echo(_line(_row(frame, start_ns)))
                shown = len(frames)
                if tape.damage is not None:
                    raise tape.damage
            why = _finished(frames, _booth_state(path, booths))
            if why is not None:
                if why == "crashed" and not as_json:
                    echo(f"(the booth's supervisor is gone: `jukebox booth discard {path.stem}`)")
                return
            time.sleep(poll)
    except KeyboardInterrupt:
        return
