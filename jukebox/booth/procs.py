"""Processes as this PID namespace's /proc shows them: each one's parent, read from
`/proc/PID/stat` in one place.

One pass over /proc gives every parent's children at once (`children_by_parent`): the
supervisor's reaping of stragglers, the time-travel watch stopping an agent and `booth stop`
finding the agent's relay all read it so. Nothing here is atomic: a process may start or end
during the pass, so callers kill, then look again.
"""

from __future__ import annotations

import os


def parent_of(pid: int) -> int | None:
    """The parent's pid, or None when the process is gone (or never was)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return _ppid(stat)


def children_by_parent() -> dict[int, list[int]]:
    """{parent pid: [its children's pids]}, for every process visible here."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        ppid = parent_of(int(entry))
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry))
    return children


def children_of(pid: int) -> list[int]:
    return children_by_parent().get(pid, [])


def descendants_of(pid: int) -> list[int]:
    """Every descendant of `pid`, each one after its parent."""
    children = children_by_parent()
    found: list[int] = []
    todo = list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, ()))
    return found


def _ppid(stat: bytes) -> int | None:
    # The command name, in parentheses, may hold spaces and parentheses itself: the fields that
    # follow start after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None
