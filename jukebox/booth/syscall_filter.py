"""The booth's seccomp filter: system calls an agent has no use for, refused with EPERM.

Shaped like Docker's default profile and nsjail's policies, but default-allow: the agent is a
general program (compilers, interpreters, package managers, test runners), so the filter names
what it refuses rather than what it allows. Each refusal belongs to a named group; an image
loosens the filter by naming groups (`[seccomp] allow = ["ptrace"]`) or turns it off
(`enabled = false`). docs/booth.md lists the groups and why each is refused.

Decisions worth knowing:

* Only the native ABI (x86_64 on an x86_64 host) passes the filter: a 32-bit `int 0x80` call
  or an x32 call gets EPERM, as in Docker's profile for arches it does not list, because the
  rules below are written for one syscall table and another ABI's numbers would slip past them.
* Arguments the kernel reads as 32-bit ints (ioctl's request, socket's family, unshare's
  flags) are compared on their low 32 bits only: the kernel ignores the high ones, so a caller
  setting them must not slip past a rule either (the TIOCSTI bypass of old container filters).
* ptrace: seccomp cannot see whether the target is a descendant, so PTRACE_ATTACH and
  PTRACE_SEIZE are refused outright; PTRACE_TRACEME is allowed, so a debugger or tracer that
  starts its own child (gdb's `run`, `strace CMD`) works, `gdb -p` and `strace -p` do not.
* New user namespaces (unshare or clone with CLONE_NEWUSER) are refused: inside one an agent
  holds every capability again over new network and mount namespaces, the door most kernel
  privilege escalations of recent years went through. clone3 passes its flags in memory the
  filter cannot read, so it gets ENOSYS, which makes glibc fall back to clone (Docker does the
  same).
* Sockets: AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK with NETLINK_ROUTE only (glibc's
  getaddrinfo and `ip` read interfaces through it; changing them needs CAP_NET_ADMIN, which
  the agent lacks). Every other family (packet, vsock, bluetooth, key, alg, ...) is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import json
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from blake3 import blake3

from jukebox.errors import JukeboxError
from shadowfs.libc import libc
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

LOW32 = 0xFFFFFFFF
# The comparison operators of libseccomp (scmp_compare), named here so the rules below can be
# written before (and without) loading the library.
NE, GE, EQ, MASKED_EQ = 1, 5, 4, 7

TIOCSTI = 0x5412
TIOCLINUX = 0x541C
PTRACE_ATTACH = 16
PTRACE_SEIZE = 0x4206
CLONE_NEWUSER = 0x10000000
MMAP_PAGE_ZERO = 0x0100000
READ_IMPLIES_EXEC = 0x0400000
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
AF_MAX = 46  # one past the highest address family Linux knows (AF_MCTP is 45)
NETLINK_ROUTE = 0
ALLOWED_FAMILIES = frozenset({AF_UNIX, AF_INET, AF_INET6, AF_NETLINK})
LIBSECCOMP = "libseccomp.so.2"
# Bumped whenever what goes into the cache key or the file's layout changes.
# 2: BLAKE3 (the store's hash, loaded already) rather than hashlib's SHA-256, whose import
# (OpenSSL's initialisation with it) was a booth start's largest single import.
CACHE_FORMAT = 2
DIGEST_SIZE = 32  # the BLAKE3 of the program, ahead of it in a cache file
SOCK_FILTER_SIZE = 8  # struct sock_filter: u16 code, u8 jt, u8 jf, u32 k
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


_EPERM = errno.EPERM  # a Refusal's default, named apart from its `errno` field


class Refusal(Value):
    """One rule: `syscall` fails with `errno` when every (arg, op, a, b) comparison holds."""

    __slots__ = FIELDS = ("syscall", "args", "errno")
    syscall: str
    args: tuple[tuple[int, int, int, int], ...]
    errno: int

    def __init__(
        self, syscall: str, args: tuple[tuple[int, int, int, int], ...] = (),
        errno: int = _EPERM,
    ) -> None:  # fmt: skip
        setfield(self, "syscall", syscall)
        setfield(self, "args", args)
        setfield(self, "errno", errno)


def _calls(*names: str) -> tuple[Refusal, ...]:
    return tuple(Refusal(name) for name in names)


def _low32(arg: int, value: int) -> tuple[int, int, int, int]:
    return (arg, MASKED_EQ, LOW32, value)


def _socket_refusals() -> tuple[Refusal, ...]:
    refused = [
        Refusal("socket", (_low32(0, family),))
        for family in range(AF_MAX)
        if family not in ALLOWED_FAMILIES
    ]
    refused.append(Refusal("socket", ((0, GE, AF_MAX, 0),)))
    refused.append(Refusal("socket", (_low32(0, AF_NETLINK), (2, NE, NETLINK_ROUTE, 0))))
    return tuple(refused)


def _personality_refusals() -> tuple[Refusal, ...]:
    # "flag set, and the value is not the query 0xffffffff": libseccomp allows one comparison
    # per argument, so the second half is "some other low bit is clear", one rule per bit.
    return tuple(
        Refusal("personality", ((0, MASKED_EQ, flag | 1 << bit, flag),))
        for flag in (MMAP_PAGE_ZERO, READ_IMPLIES_EXEC)
        for bit in range(32)
        if 1 << bit != flag
    )


# What each group refuses; the names are what `[seccomp] allow` accepts.
GROUPS: dict[str, tuple[Refusal, ...]] = {
    # Pushing input into a terminal (the operator's shell runs it) or taking over the console.
    "terminal": (
        Refusal("ioctl", (_low32(1, TIOCSTI),)),
        Refusal("ioctl", (_low32(1, TIOCLINUX),)),
        Refusal("vhangup"),
    ),
    # The kernel keyring is shared by uid across the host, not namespaced.
    "keyring": _calls("keyctl", "add_key", "request_key"),
    "io_uring": _calls("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "sockets": _socket_refusals(),
    "ptrace": (
        Refusal("ptrace", ((0, EQ, PTRACE_ATTACH, 0),)),
        Refusal("ptrace", ((0, EQ, PTRACE_SEIZE, 0),)),
        *_calls("process_vm_readv", "process_vm_writev", "pidfd_getfd"),
    ),
    "userns": (
        Refusal("unshare", ((0, MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER),)),
        Refusal("clone", ((0, MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER),)),
        Refusal("clone3", errno=errno.ENOSYS),
    ),
    "bpf": _calls("bpf"),
    "perf_event": _calls("perf_event_open"),
    "userfaultfd": _calls("userfaultfd"),
    # Opening a file by handle walks around the mount namespace (the "shocker" escape).
    "file_handles": _calls("open_by_handle_at", "name_to_handle_at"),
    # Belt and braces: CAP_SYS_ADMIN is dropped already.
    "mounts": _calls(
        "mount",
        "umount",
        "umount2",
        "pivot_root",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "move_mount",
        "open_tree",
        "mount_setattr",
        "setns",
    ),
    # The machine's, not a booth's: modules, kexec, reboot, swap, clock, accounting, kernel log.
    "kernel": _calls(
        "kexec_load",
        "kexec_file_load",
        "init_module",
        "finit_module",
        "delete_module",
        "create_module",
        "get_kernel_syms",
        "query_module",
        "reboot",
        "swapon",
        "swapoff",
        "acct",
        "syslog",
        "quotactl",
        "quotactl_fd",
        "lookup_dcookie",
        "nfsservctl",
        "settimeofday",
        "clock_settime",
        "stime",
        "uselib",
        "vm86",
        "vm86old",
        "iopl",
        "ioperm",
        "_sysctl",
    ),
    "personality": _personality_refusals(),
}


class FilterError(JukeboxError):
    """The filter could not be built or loaded; the message says which step."""


def check_groups(names: Iterable[str]) -> list[str]:
    """The names that are not groups (empty when all are valid)."""
    return [name for name in names if name not in GROUPS]


def refusals(allow: Sequence[str] = ()) -> list[Refusal]:
    return [rule for group, rules in GROUPS.items() if group not in allow for rule in rules]


def unavailable_reason() -> str | None:
    """Why the filter cannot be applied here, or None when it can. Cheap (no libseccomp
    binding is imported): the supervisor asks before every booth."""
    if not os.path.exists("/proc/sys/kernel/seccomp/actions_avail"):
        return "the kernel has no seccomp filters (CONFIG_SECCOMP_FILTER)"
    try:
        ctypes.CDLL(LIBSECCOMP)
    except OSError:
        return f"{LIBSECCOMP} is not installed (Debian: apt-get install libseccomp2)"
    if importlib.util.find_spec("pyseccomp") is None:
        return "the pyseccomp package is missing: reinstall jukebox (`make setup`)"
    return None


def _binding() -> Any:
    """pyseccomp, imported without its two `ctypes.util.find_library` calls: each runs
    `ldconfig -p` in a subprocess, half the filter's cost on every booth start. The sonames
    are known (libc's symbols are the process's own: CDLL(None))."""
    import ctypes.util

    find_library = ctypes.util.find_library
    known: dict[str, str | None] = {"c": None, "seccomp": LIBSECCOMP}
    ctypes.util.find_library = lambda name: known[name] if name in known else find_library(name)
    try:
        import pyseccomp
    except OSError:  # not under that soname here: let pyseccomp look for itself
        pyseccomp = None
    finally:
        ctypes.util.find_library = find_library
    if pyseccomp is None:
        import pyseccomp
    return pyseccomp


def preload() -> None:
    """Imports the binding while the host's file system is still in view: an image may hide
    the directory it is installed in (a venv under /home, with `minimal`)."""
    _binding()


def build(allow: Sequence[str] = ()) -> Any:
    """The filter as a libseccomp context, ready to `load()` in the process that will exec."""
    sc = _binding()

    refuse_other_abis = sc.ERRNO(errno.EPERM)
    context = sc.SyscallFilter(sc.ALLOW)
    context.set_attr(sc.Attr.ACT_BADARCH, refuse_other_abis)
    for rule in refusals(allow):
        args = [sc.Arg(arg, op, a, b) for arg, op, a, b in rule.args]
        try:
            context.add_rule(sc.ERRNO(rule.errno), rule.syscall, *args)
        except OSError as error:
            raise FilterError(f"adding the rule for {rule.syscall}: {error.strerror}") from None
    return context


def digest(program: bytes) -> bytes:
    """What a cache file holds ahead of its program (DIGEST_SIZE bytes)."""
    return blake3(program).digest()


def _export(context: Any) -> bytes:
    import tempfile  # on a cache miss only

    with tempfile.TemporaryFile() as out:
        context.export_bpf(out)
        out.seek(0)
        return out.read()


def _cache_key(allow: Sequence[str]) -> str:
    """What the compiled program depends on: the rules, libseccomp's version and the API level
    it found in this kernel, the architecture and the kernel itself."""
    lib = ctypes.CDLL(LIBSECCOMP)
    lib.seccomp_version.restype = ctypes.POINTER(ctypes.c_uint * 3)
    version = list(lib.seccomp_version().contents)
    api = lib.seccomp_api_get()
    uname = os.uname()
    rules = [[rule.syscall, rule.args, rule.errno] for rule in refusals(allow)]
    material = json.dumps(
        [CACHE_FORMAT, sorted(allow), rules, version, api, uname.machine, uname.release]
    )
    return blake3(material.encode()).hexdigest()


def _private_dir(path: Path) -> bool:
    """Whether `path` is a real directory only its owner (this user) can write: a program
    someone else could plant would be what the next booth loads."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _read_cached(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(1 << 20)
    expected, program = data[:DIGEST_SIZE], data[DIGEST_SIZE:]
    # The file is written without an fsync: a crash can leave it short or empty, never loaded.
    if not program or len(program) % SOCK_FILTER_SIZE:
        return None
    if digest(program) != expected:
        return None
    return program


def _write_cached(path: Path, program: bytes) -> None:
    import tempfile  # on a cache miss only

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(digest(program) + program)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def compiled(allow: Sequence[str] = ()) -> bytes:
    """The filter as the classic BPF program the kernel loads (an array of struct sock_filter),
    compiled by libseccomp: the same program `build(allow).load()` installs."""
    return _export(build(allow))


def cached(allow: Sequence[str], cache_dir: str | os.PathLike[str]) -> bytes | None:
    """`compiled(allow)`, kept in `cache_dir` (a directory only this user can write, hidden
    from every booth) under a key of everything it depends on, so a booth's start reuses it
    instead of importing the binding and compiling 160 rules again (about 30 ms of CPU).
    Compiled and kept on a miss; None when the directory cannot be used (not this user's, or
    writable by others, or not creatable): whoever installs the filter compiles it then."""
    directory = Path(cache_dir)
    with contextlib.suppress(OSError):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private_dir(directory):
        return None
    path = directory / f"{_cache_key(allow)}.bpf"
    program = _read_cached(path)
    if program is None:
        program = compiled(allow)
        with contextlib.suppress(OSError):
            _write_cached(path, program)
    return program


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_compiled(program: bytes) -> None:
    """Installs a program from `compiled` in this thread (and what it execs), as libseccomp's
    load does (flags 0). no_new_privs must be set already (jukebox.booth.credentials does)."""
    if not program or len(program) % SOCK_FILTER_SIZE:
        raise FilterError(f"a compiled filter of {len(program)} bytes is not a BPF program")
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // SOCK_FILTER_SIZE, ctypes.addressof(buf))
    # `prog` (and `buf`, which it points into) live until the call returns.
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
