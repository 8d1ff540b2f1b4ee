"""`jukebox booth stop ID`: end a running booth's agent gracefully, keeping the booth pending.

The supervisor already knows how to stop its agent when asked: a SIGTERM it receives is passed
on to the agent (through the exec shim's relay and the booth's init) and marks the run as
interrupted, so the verdict keeps the booth pending, whatever `--commit` said. That is all
`stop` asks of it. What the supervisor does not do on its own is escalate: an agent that ignores
SIGTERM would run on. So after the grace period `stop` SIGKILLs the relay itself (the process the
supervisor waits for): the relay's death takes the init (PR_SET_PDEATHSIG) and with it every
process of the booth's PID namespace; the supervisor sees the agent killed, snapshots the layer
and keeps the booth pending, as after any exit.

The supervisor is recognised as in `booth abort` (jukebox.booth.abort): a process whose mount
namespace holds the mounts only a booth of that id makes, so a recycled pid is never signalled.
The relay is the supervisor's child running the exec shim, held through a pidfd while it is
checked, so a recycled pid is never killed either.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from jukebox.booth import procs
from jukebox.booth.abort import _booth_mounts, _gone
from jukebox.booth.isolation import RELAY_TITLE
from jukebox.booth.supervisor import BoothRecord, load_record
from jukebox.errors import JukeboxError, UsageError
from jukebox.tape.tapedir import TapeDir

DEFAULT_GRACE = 10.0
# How long `stop` waits, once the agent is gone, for the supervisor to snapshot and keep the
# booth pending; a bigger tree's snapshot takes longer, so this only bounds the waiting.
SETTLE_SECONDS = 120.0
_SHIM = b"jukebox.booth.isolation\0exec\0"


def _is_shim(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    # An exec'd shim, or the agent's relay forked before the supervisor's threads (named by
    # PR_SET_NAME; its command line stays the supervisor's).
    return _SHIM in cmdline or comm == RELAY_TITLE


def kill_agent(supervisor: int) -> bool:
    """SIGKILLs the agent's relay, a child of `supervisor` running the exec shim; returns
    whether there was one."""
    killed = False
    for child in procs.children_of(supervisor):
        try:
            pidfd = os.pidfd_open(child)
        except OSError:
            continue  # gone meanwhile
        try:
            # Checked through the pidfd's process: a pid recycled after the open is not it.
            if procs.parent_of(child) == supervisor and _is_shim(child):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    killed = True
        finally:
            os.close(pidfd)
    return killed


def _agent_running(supervisor: int) -> bool:
    children = procs.children_of(supervisor)
    return any(_is_shim(c) and procs.parent_of(c) == supervisor for c in children)


def _current(tape_dir: TapeDir, booth_id: str) -> BoothRecord | None:
    try:
        return load_record(tape_dir, booth_id)
    except (JukeboxError, OSError):
        return None  # finished meanwhile (a discard, a breaker trip): its tape says how


def stop_booth(tape_dir: TapeDir, booth_id: str, grace: float = DEFAULT_GRACE) -> str:
    """Stops booth `booth_id`'s agent (SIGTERM, then SIGKILL after `grace` seconds) and waits
    for its supervisor to keep the booth pending. Returns how the agent ended: "terminated" or
    "killed"; the booth's status afterwards is in its record."""
    record = load_record(tape_dir, booth_id)
    pid = record.pid
    if record.status != "running" or not pid or _gone(pid):
        state = "crashed" if record.status == "running" else record.status
        raise UsageError(
            f"booth {booth_id} is not running (status {state}): nothing to stop; "
            f"`jukebox booth diff {booth_id}`, then commit or discard it"
        )
    if not _booth_mounts(tape_dir, pid, booth_id):
        raise UsageError(
            f"process {pid} is not booth {booth_id}'s supervisor any more (it crashed): nothing "
            f"to stop; `jukebox booth discard {booth_id}` drops it"
        )
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        raise UsageError(f"booth {booth_id} ended meanwhile: nothing to stop") from None
    except PermissionError:
        raise UsageError(
            f"cannot signal booth {booth_id}'s supervisor (pid {pid}): it belongs to another "
            "user; run `jukebox booth stop` as the user who started the booth"
        ) from None
    how = "terminated"
    deadline = time.monotonic() + grace
    while _agent_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _agent_running(pid) and kill_agent(pid):
        how = "killed"
    # The supervisor snapshots the layer, keeps the booth pending, and exits.
    deadline = time.monotonic() + SETTLE_SECONDS
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return how


def status_after_stop(tape_dir: TapeDir, booth_id: str) -> str:
    """The booth's status once `stop_booth` returned: pending (or conflict), `running` when its
    supervisor is still busy, `finished` when it is no pending booth any more."""
    current = _current(tape_dir, booth_id)
    return "finished" if current is None else current.status
