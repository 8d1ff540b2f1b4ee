"""What of the booth's isolation this run could apply, for the tape, the operator and strict mode.

Each protection has a name and a state: "on", "off: <why>" (turned off on purpose, by the image
or a flag) or "unavailable: <why>" (this kernel or this user cannot have it). The states go into
the `run_start` frame's policy as `protections`; a booth with any unavailable one says so once
on stderr, and `--strict-sandbox` refuses to start it. Add a protection with `set()` and one
line in MEANINGS saying what running without it means.
"""

from __future__ import annotations

from jukebox.booth import cgroups, syscall_filter
from jukebox.booth.cgroups import BoothCgroup
from jukebox.booth.images import Image
from shadowfs.values import Record

ON = "on"
OFF = "off"
UNAVAILABLE = "unavailable"

# What an operator should know when a protection is missing: the door it leaves open.
MEANINGS: dict[str, str] = {
    "seccomp": "the agent can call io_uring, keyctl, bpf, ptrace attach, TIOCSTI and the rest "
    "of the refused system calls",
    "pids_cgroup": "processes are bounded only by RLIMIT_NPROC, per uid and never for root "
    "(a fork bomb as root is unbounded)",
    "memory_cgroup": "memory is bounded only by RLIMIT_AS (address space, not memory), and "
    "files in the private /tmp count against nothing",
}


class Protections(Record):
    __slots__ = FIELDS = ("states",)

    def __init__(self, states: dict[str, str] | None = None) -> None:
        self.states: dict[str, str] = {} if states is None else states

    def set(self, name: str, state: str) -> None:
        self.states[name] = state

    def update(self, states: dict[str, str]) -> None:
        self.states.update(states)

    def is_on(self, name: str) -> bool:
        return self.states.get(name) == ON

    def unavailable(self) -> dict[str, str]:
        return {k: v for k, v in self.states.items() if v.startswith(UNAVAILABLE)}

    def policy(self) -> dict[str, str]:
        return dict(self.states)

    def missing_line(self) -> str | None:
        """One line naming every unavailable protection, why, and what that leaves open."""
        missing = self.unavailable()
        if not missing:
            return None
        parts = [
            f"{name} ({_reason(state)}): {MEANINGS.get(name, 'not applied')}"
            for name, state in missing.items()
        ]
        return "this booth runs without " + "; without ".join(parts)


def _reason(state: str) -> str:
    return state.removeprefix(UNAVAILABLE + ": ")


def strict_refusal(protections: Protections) -> str:
    """The one line `--strict-sandbox` exits with when something is unavailable."""
    missing = ", ".join(
        f"{name} ({_reason(state)})" for name, state in protections.unavailable().items()
    )
    return f"--strict-sandbox: this booth cannot have {missing}; refusing to start"


def booth_protections(
    img: Image, booth_id: str, *, seccomp: bool = True
) -> tuple[Protections, BoothCgroup]:
    """What the supervisor can apply before the agent starts: the seccomp filter's state, and
    the booth's cgroup (made now; the caller removes it when the booth ends)."""
    protections = Protections()
    if not img.seccomp:
        protections.set("seccomp", f"{OFF}: the image sets seccomp.enabled = false")
    elif not seccomp:
        protections.set("seccomp", f"{OFF}: --no-seccomp")
    else:
        reason = syscall_filter.unavailable_reason()
        protections.set("seccomp", f"{UNAVAILABLE}: {reason}" if reason else ON)
    cgroup = cgroups.create(
        booth_id,
        processes=img.limits.get("processes"),
        memory=img.limits.get("memory_bytes"),
        enabled=img.cgroup,
    )
    protections.update(cgroup.states)
    return protections, cgroup
