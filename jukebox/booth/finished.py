"""What became of a booth that has no record any more: its tape's verdict frame.

A booth's record is removed once it is committed, discarded or rolled back; its tape keeps the
verdict (a `commit`, `discard` or final `rollback` frame, with its time and what wrote it). A
second `booth commit`, or the loser of a race for one booth, reads it from there to say what
happened instead of a bare "no pending booth".
"""

from __future__ import annotations

from typing import Any

from jukebox.display.render import timestamp
from jukebox.tape.tapedir import TapeDir

# The verdict frames' `by` payload field, as a person reads it; no `by`: the run's own verdict.
_WRITERS = {
    "booth commit": "`jukebox booth commit`",
    "booth discard": "`jukebox booth discard`",
    "scratch booth": "the replay or fork that ran it",
}


def _verdict(frame: Any) -> str | None:
    if frame.kind == "commit":
        return "committed"
    if frame.kind == "discard":
        return "discarded"
    if frame.kind == "rollback" and frame.payload.get("final"):
        return "rolled back"
    return None


def _who(peer: Any) -> str:
    """`user NAME (uid N), pid P` from a frame's `peer` (or run_start's `host`) field."""
    import pwd

    if not isinstance(peer, dict) or not isinstance(peer.get("uid"), int):
        return ""
    uid = peer["uid"]
    try:
        name = f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        name = f"uid {uid}"
    pid = peer.get("pid")
    return f", {name}" + (f", pid {pid}" if isinstance(pid, int) else "")


def finished_booth(tape_dir: TapeDir, booth_id: str) -> str | None:
    """One line saying when and by what the booth was finished, or None when its tape is not
    there or holds no verdict (then it never was a booth here)."""
    from jukebox.errors import JukeboxError
    from jukebox.tape.tape import Tape

    path = tape_dir.tape_path(booth_id)
    try:
        frames = Tape.load(path).intact_frames
    except (JukeboxError, OSError, ValueError):
        return None
    for frame in reversed(frames):
        verdict = _verdict(frame)
        if verdict is None:
            continue
        by = frame.payload.get("by")
        if isinstance(by, str):
            writer = _WRITERS.get(by, repr(by)) + _who(frame.payload.get("peer"))
        else:  # the run's own verdict: run_start names the process that ran it
            writer = "the run itself" + _who(frames[0].payload.get("host") if frames else None)
        changes = frame.payload.get("changes")
        what = f" ({changes} change(s))" if frame.kind == "commit" and changes is not None else ""
        calls = unfinished_calls(frames[frames.index(frame) :])
        return (
            f"booth {booth_id} was already {verdict}{what} at {timestamp(frame.time_ns / 1e9)} "
            f"by {writer}{calls}: nothing to do (`jukebox log {path}`)"
        )
    return None


def unfinished_calls(frames: list[Any]) -> str:
    """What a commit that stopped while it ran staged MCP calls (its process killed) left: ""
    when it finished, else the words for which ran, which may have reached its server and
    which never started. Frames are durable one by one (jukebox.mcp.staging.run_staged): the
    first call without a frame was the one in flight."""
    from jukebox.mcp.staging import MCP_COMMIT_BEGIN

    begun: list[str] = []
    ran: set[str] = set()
    for frame in frames:
        payload = frame.payload
        if frame.kind == "note" and payload.get("event") == MCP_COMMIT_BEGIN:
            begun, ran = [str(i) for i in payload.get("ids") or []], set()
        elif frame.kind == "note" and payload.get("event") == "mcp_commit":
            begun = []
        elif frame.kind == "tool_call" and payload.get("decision") == "commit":
            ran.add(str(payload.get("staged_id")))
    left = [i for i in begun if i not in ran]
    if not left:
        return ""
    done = ", ".join(i for i in begun if i in ran) or "none"
    never = ", ".join(left[1:]) or "none"
    return (
        f"; its staged MCP calls stopped midway (the process running them was killed): ran "
        f"{done}; {left[0]} may have reached its server; never started: {never}; none is run "
        "again"
    )
