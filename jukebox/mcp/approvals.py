"""`ask`: the operator decides a tool call while the booth runs (`jukebox booth approve ID CALL
[--deny]`).

The gateway asks the supervisor (control op `mcp_ask`), which records the question, tells the
operator on its terminal, and answers at once with the question's id; the gateway then polls
(`mcp_ask_status`) until the answer comes or its wait ends (a refusal). Answers are files in the
tape dir (`.jukebox/approvals/<booth>/<ask id>`), which the agent cannot see or write (the tape
dir is hidden in a booth): the control socket is the agent's, so an answer never travels on it.
"""

from __future__ import annotations

import os
from typing import Any

from jukebox.errors import UsageError

ANSWERS = ("approve", "deny")


def read_answer(tape_dir: Any, booth_id: str, ask_id: str) -> str | None:
    """The answer to question `ask_id`, if the operator gave one (`tape_dir`: a TapeDir)."""
    try:
        text = (tape_dir.state / "approvals" / booth_id / ask_id).read_text().strip()
    except OSError:
        return None
    return text if text in ANSWERS else None


def write_answer(tape_dir: Any, booth_id: str, ask_id: str, answer: str) -> None:
    """The operator's answer to question `ask_id` of running booth `booth_id`."""
    from jukebox.booth.supervisor import load_record
    from jukebox.tape.tapedir import check_tape_id

    if not ask_id.startswith("ask-") or not ask_id[4:].isdigit():
        raise UsageError(f"bad call id {ask_id!r}: the booth names its questions ask-N")
    record = load_record(tape_dir, check_tape_id(booth_id))
    if record.status != "running":
        raise UsageError(f"booth {booth_id} is not running: no question is waiting")
    path = tape_dir.private_dir("approvals", booth_id) / ask_id
    if path.exists():
        raise UsageError(f"{ask_id} of booth {booth_id} was answered already")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        f.write(answer + "\n")
