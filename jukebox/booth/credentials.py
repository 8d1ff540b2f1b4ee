"""What a booth's command holds of its credentials: the capabilities it keeps and its keyrings.

The agent keeps an explicit, short set of capabilities (`KEPT_CAPS`, each with the reason) and
loses every other one the kernel knows, from all five sets: the bounding set (so no exec of a
setuid-root or file-capability binary regains any), the ambient set, and the effective,
permitted and inheritable sets. A capability added by a newer kernel than this code knows is
dropped too: the loop runs to the kernel's own `cap_last_cap`.

The session keyring is replaced by a fresh, anonymous one before exec, so `@s` is not the
caller's: a key planted there dies with the booth. The user keyrings (`@u`, `@us`) belong to a
uid within a user namespace: an unprivileged booth's namespace has its own, but a root booth's
agent shares root's; the booth's seccomp filter refuses the keyring syscalls for that reason.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

from shadowfs.libc import check as _check
from shadowfs.libc import libc as _libc

# What a root agent keeps, and why. Everything else goes (see docs/booth.md, "The agent's
# capabilities"): the ways out of the namespaces (SYS_ADMIN, SYS_PTRACE, SYS_CHROOT, ...),
# raw access to devices and the network (MKNOD, SYS_RAWIO, NET_RAW, NET_ADMIN), host-wide
# kernel state (SYSLOG, SYS_TIME, SYS_NICE, IPC_LOCK, IPC_OWNER, LEASE, SYS_TTY_CONFIG, ...)
# and the way around the booth's limits (SYS_RESOURCE).
KEPT_CAPS: dict[str, str] = {
    "CAP_CHOWN": "tar, cp -a, package installers and git set the owners of files they write",
    "CAP_DAC_OVERRIDE": "a root agent reads and writes files in its tree whatever their modes, "
    "as root does anywhere (the host outside the tree is read-only all the same)",
    "CAP_FOWNER": "chmod and utime on files the agent does not own (tar x, rsync -a, "
    "git checkout in a tree owned by another user)",
    "CAP_FSETID": "writes and chowns keep set-group-ID directories and modes as they were "
    "(the bits buy nothing: every mount the agent sees is nosuid)",
    "CAP_KILL": "signals to the agent's own processes after a tool changed their uid; "
    "nothing outside the booth's PID namespace can be named",
    "CAP_SETGID": "tools that drop root to another user (apt's _apt, npm, su, runuser)",
    "CAP_SETUID": "tools that drop root to another user (apt's _apt, npm, su, runuser)",
}

CAP_NUMBERS: dict[str, int] = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_LINUX_IMMUTABLE": 9,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_BROADCAST": 11,
    "CAP_NET_ADMIN": 12,
    "CAP_NET_RAW": 13,
    "CAP_IPC_LOCK": 14,
    "CAP_IPC_OWNER": 15,
    "CAP_SYS_MODULE": 16,
    "CAP_SYS_RAWIO": 17,
    "CAP_SYS_CHROOT": 18,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_PACCT": 20,
    "CAP_SYS_ADMIN": 21,
    "CAP_SYS_BOOT": 22,
    "CAP_SYS_NICE": 23,
    "CAP_SYS_RESOURCE": 24,
    "CAP_SYS_TIME": 25,
    "CAP_SYS_TTY_CONFIG": 26,
    "CAP_MKNOD": 27,
    "CAP_LEASE": 28,
    "CAP_AUDIT_WRITE": 29,
    "CAP_AUDIT_CONTROL": 30,
    "CAP_SETFCAP": 31,
    "CAP_MAC_OVERRIDE": 32,
    "CAP_MAC_ADMIN": 33,
    "CAP_SYSLOG": 34,
    "CAP_WAKE_ALARM": 35,
    "CAP_BLOCK_SUSPEND": 36,
    "CAP_AUDIT_READ": 37,
    "CAP_PERFMON": 38,
    "CAP_BPF": 39,
    "CAP_CHECKPOINT_RESTORE": 40,
}
KEPT_MASK = sum(1 << CAP_NUMBERS[name] for name in KEPT_CAPS)

PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
KEYCTL_JOIN_SESSION_KEYRING = 1
# keyctl has no libc wrapper (it lives in libkeyutils): the raw syscall, by architecture.
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 311, "s390x": 280}



class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _prctl(option: int, arg: int = 0) -> int:
    result = _libc.prctl(option, arg, 0, 0, 0)
    _check(result, f"prctl({option})")
    return result


_read_last_cap: list[int] = []  # the kernel's, once read: it does not change while it runs


def last_cap() -> int:
    """The highest capability number this kernel knows (newer kernels add some)."""
    if _read_last_cap:
        return _read_last_cap[0]
    try:
        value = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        # Not kept: a later call, where /proc can be read, still learns the kernel's own.
        return max(CAP_NUMBERS.values())
    _read_last_cap.append(value)
    return value


def prepare() -> None:
    """Makes ahead what `keep_only_kept_caps` and `join_fresh_session_keyring` make at their
    first call in a process (the kernel's last capability read from /proc, ctypes' array type,
    libc's functions): about 0.8 ms of CMD's start, on the agent's critical path, when a process
    CMD is forked from (the pre-forked shim, while it waits for its spec) calls this first.
    Drops nothing and changes no credential."""
    last_cap()
    # ctypes keeps the array type it makes, the one _get_caps and keep_only_kept_caps use.
    _CapData * 2
    for name in ("syscall", "capget", "capset", "prctl"):
        getattr(_libc, name)


def _get_caps() -> tuple[int, int, int]:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "capget")
    return tuple(
        getattr(data[0], f) | getattr(data[1], f) << 32
        for f in ("effective", "permitted", "inheritable")
    )


def keep_only_kept_caps() -> None:
    """Cuts every capability but `KEPT_CAPS` from all five sets, then sets no_new_privs.

    The bounding set goes first: dropping from it needs CAP_SETPCAP, which the capset below
    takes away. no_new_privs last, so that even the kept capabilities can never be regained by
    an exec once the agent gave them up (setuid to a non-root uid clears them).
    """
    effective, permitted, _inheritable = _get_caps()
    if effective & (1 << CAP_NUMBERS["CAP_SETPCAP"]):
        for cap in range(last_cap() + 1):
            if not KEPT_MASK & (1 << cap) and _prctl(PR_CAPBSET_READ, cap) == 1:
                _prctl(PR_CAPBSET_DROP, cap)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    kept = permitted & KEPT_MASK
    for word in (0, 1):
        part = (kept >> (32 * word)) & 0xFFFFFFFF
        data[word].effective = data[word].permitted = part
        data[word].inheritable = 0
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def join_fresh_session_keyring() -> None:
    """Replaces this process's session keyring with a new anonymous one (KEYCTL_JOIN_SESSION_
    KEYRING with no name): what the command plants in `@s` is freed when the booth ends, and
    the caller's session keyring is out of its reach. A kernel without keyrings has nothing to
    replace, and a host seccomp filter that refuses keyctl already keeps the command out."""
    number = SYS_KEYCTL.get(os.uname().machine)  # platform.machine(), without platform
    if number is None:
        return
    result = _libc.syscall(
        ctypes.c_long(number), ctypes.c_int(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None)
    )
    if result < 0 and ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM):
        _check(result, "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")
