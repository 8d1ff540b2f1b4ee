"""Process isolation for a booth: namespaces, mounts, capabilities, prctl and resource limits.

Two steps, in two processes:

* The supervisor calls `enter_private_namespace()` once, before it starts any thread: a private
  mount namespace (and, when not root, a user namespace mapping the caller to root inside, which
  is what lets an unprivileged user mount at all). The layer is then mounted over the tree there,
  invisible to everybody outside.
* Each sandboxed command (the agent, the verifier) is started through a small exec shim,
  `python -m jukebox.booth.isolation exec`, rather than a `preexec_fn`: the supervisor has threads
  (the FUSE server, the control socket), and running Python between fork and exec in a threaded
  process can deadlock. The shim reports a failed set-up over a close-on-exec pipe: an empty
  pipe means the command is running.

The shim is three processes, so that nothing the command starts can outlive the booth:

    supervisor ── relay (the shim; the pid the supervisor waits for)
                    └── init (pid 1 of a new PID namespace)
                          └── CMD

* The relay starts a session of its own (so no terminal's signals reach it, nor the init),
  unshares a PID namespace and forks the init. It passes the supervisor's signals on to the
  init and, once the init is gone, exits exactly as CMD did (its status, or killed by
  the same signal), so the supervisor sees CMD's outcome as if it were its own child. A relay
  pre-forked as root does this as soon as it has joined the booth's cgroups, before its spec
  comes; its init then waits for the spec (`_relay_with_waiting_init`).
* The init enters a mount namespace of its own (a child of the supervisor's, so it still sees
  the layer) with new IPC and UTS namespaces and forks CMD into them. While CMD starts a
  session of its own (with the booth's pty as its controlling terminal when the supervisor made
  one, see jukebox/booth/terminal.py: never the caller's), sets limits, joins a fresh session
  keyring, keeps only the capabilities of jukebox.booth.credentials and sets
  PR_SET_NO_NEW_PRIVS, the init builds the view: it hides what CMD must not see, makes the host
  read-only, nosuid and nodev, gives CMD a minimal /dev of its own (jukebox.booth.private_dev)
  and mounts a fresh /proc for the new PID namespace (CMD sees its own processes only, the
  supervisor not at all). Only then, told so over a pipe, does CMD enter its working directory
  and exec; a view that fails ends the init, and the namespace with CMD in it. The init passes
  signals on to CMD, reaps every orphan, and exits when CMD does: the kernel then kills whatever
  is left in the namespace (setsid, nohup and double forks included).
* The relay joins the booth's cgroup (jukebox.booth.cgroups) before it forks; CMD installs the
  seccomp filter (jukebox.booth.syscall_filter) as the last step before exec.
* Each link holds PR_SET_PDEATHSIG(SIGKILL) to the one above, so a SIGKILLed supervisor takes
  the relay, the relay the init, and the init the whole namespace.

Python 3.11 has no `os.unshare`, so the namespace and mount calls go through ctypes on libc.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import termios
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from jukebox.booth import credentials
from jukebox.errors import JukeboxError
from shadowfs.libc import check as _check
from shadowfs.libc import libc as _libc
from shadowfs.values import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    import subprocess
    from typing import Any, NoReturn

    from jukebox.booth.images import Image

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

# These three syscalls have one number on every architecture (they postdate the table merge).
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 0x1
AT_RECURSIVE = 0x8000
AT_EMPTY_PATH = 0x1000
AT_FDCWD = -100
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MNT_DETACH = 0x2

HOSTNAME = "jukebox-booth"  # the agent's UTS namespace: `hostname` says where it runs
# Where host services put their path-named unix sockets. A network namespace does not
# separate those (only abstract ones), so under --net none the booth covers these directories.
SOCKET_DIRS: tuple[str, ...] = (
    "/run",
    "/var/run",
    "/var/lib/mysql",
    "/var/spool/postfix",
    "/var/snap/lxd/common/lxd",
    "/var/lib/lxd",
)

RLIMITS: dict[str, int] = {
    "cpu_seconds": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "open_files": resource.RLIMIT_NOFILE,
    "processes": resource.RLIMIT_NPROC,
    "file_size_bytes": resource.RLIMIT_FSIZE,
}

SETUP_FAILED_STATUS = 125  # what the shim exits with when it could not set the sandbox up
# What the relay and the init pass on to CMD. SIGKILL cannot be caught: killing the relay ends
# the init (PDEATHSIG) and with it the namespace, which is the same thing for CMD.
FORWARDED_SIGNALS = frozenset(
    {
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
    }
)
_WAITED = FORWARDED_SIGNALS | {signal.SIGCHLD}
# What the supervisor blocks and waits for (jukebox.booth.supervisor.WAITED_SIGNALS); SIGWINCH:
# the operator's window changed, and the agent's pty follows (jukebox/booth/terminal.py).
SUPERVISOR_WAITED = frozenset(
    {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGWINCH}
)
INIT_TITLE = "jukebox-init"
VIEW_BUILT = b"v"  # the init to CMD: the view is whole, go on to the exec
# The pre-forked relay's command line (the exec'd one shows
# `python -I -m jukebox.booth.isolation exec`): `jukebox booth stop` finds the agent's relay
# among the supervisor's children by it.
RELAY_TITLE = "jukebox-relay"


def inside_booth() -> bool:
    """Whether this process runs in a booth: pid 1 of its PID namespace is a booth's init."""
    try:
        with open("/proc/1/cmdline", "rb") as cmdline:
            return cmdline.read(len(INIT_TITLE) + 1).rstrip(b"\0") == INIT_TITLE.encode()
    except OSError:
        return False


class IsolationError(JukeboxError):
    """The sandbox could not be set up; the message names the step and what to do."""


def _b(path: str | os.PathLike[str] | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    result = _libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data))
    _check(result, f"mount {target}")


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount {target}")


def mount_setattr(
    path: str, attr_set: int, attr_clr: int = 0, recursive: bool = False, dfd: int = AT_FDCWD
) -> None:
    attr = struct.pack("=QQQQ", attr_set, attr_clr, 0, 0)
    buf = ctypes.create_string_buffer(attr, len(attr))
    flags = AT_RECURSIVE if recursive else 0
    if not path:
        flags |= AT_EMPTY_PATH
    result = _libc.syscall(
        SYS_MOUNT_SETATTR,
        ctypes.c_int(dfd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.c_uint(flags),
        buf,
        ctypes.c_size_t(len(attr)),
    )
    _check(result, f"mount_setattr {path or dfd}")


def open_tree_clone(path: str) -> int:
    """A detached copy of the mount tree at `path`, to be attached again after covering it."""
    flags = OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC
    result = _libc.syscall(
        SYS_OPEN_TREE,
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.c_uint(flags),
    )
    return _check(result, f"open_tree {path}")


def move_mount(fd: int, target: str) -> None:
    result = _libc.syscall(
        SYS_MOVE_MOUNT,
        ctypes.c_int(fd),
        ctypes.c_char_p(b""),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(os.fsencode(target)),
        ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH),
    )
    _check(result, f"move_mount to {target}")


# prctl(2) options, called through libc rather than the python-prctl module, whose import (about
# 5 M instructions) the supervisor and the pre-forked shim each paid at every booth's start.
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, arg: int = 0) -> None:
    """prctl(option, arg) with an integer argument; OSError when refused."""
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def set_thread_name(name: str) -> None:
    """The process's name (its main thread's `comm`, what `ps -o comm` and /proc/PID/stat
    show), cut to the kernel's 15 bytes as prctl(PR_SET_NAME) does."""
    buf = ctypes.create_string_buffer(name.encode()[:15])
    _check(_libc.prctl(PR_SET_NAME, ctypes.addressof(buf), 0, 0, 0), "prctl(PR_SET_NAME)")


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


# --------------------------------------------------------------------------- the supervisor side


def makes_user_namespace() -> bool:
    """Whether `enter_private_namespace` makes a user namespace too: only when not root. A
    shim forked before it (PreforkedShim, join_later) joins one by the same rule."""
    return os.geteuid() != 0


def enter_private_namespace() -> bool:
    """Moves this process into a private mount namespace; returns True if a user namespace was made.

    Must run before any thread starts: the kernel refuses CLONE_NEWUSER in a threaded process,
    and CLONE_NEWNS would move only the calling thread.
    """
    if thread_count() != 1:
        raise IsolationError(
            "cannot enter a booth namespace from a process that already runs threads: "
            "start the booth from a fresh process (the `jukebox booth run` command does)"
        )
    uid, gid = os.geteuid(), os.getegid()
    userns = makes_user_namespace()
    try:
        unshare(CLONE_NEWNS | (CLONE_NEWUSER if userns else 0))
    except OSError as error:
        hint = (
            "unprivileged user namespaces are disabled here (see the sysctls"
            " kernel.unprivileged_userns_clone and user.max_user_namespaces);"
            " enable them or run as root"
            if userns
            else "the process lacks CAP_SYS_ADMIN"
        )
        raise IsolationError(
            f"cannot create the booth's namespace ({error.strerror}): {hint}"
        ) from error
    if userns:
        # setgroups must be denied before an unprivileged process may write gid_map.
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    # Private, recursively: nothing mounted in the booth may propagate back to the host.
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    return userns


# Always /tmp, never $TMPDIR: a socket's path must fit in 108 bytes (a CI runner's TMPDIR
# can be longer), and `booth abort` run later, with another TMPDIR, must find the same place.
SOCKET_PARENT = "/tmp"


def private_socket_dir(prefix: str) -> str:
    """A directory for the control socket, backed by a tiny tmpfs of this namespace's own.

    On the host it is an empty 0700 directory in /tmp (a short path: a unix socket's must fit
    in 108 bytes); the socket itself lives only in the tmpfs, which dies with the supervisor's
    namespace, so even a killed supervisor leaves at most the empty directory. Call it from
    inside the booth's namespace. The agent gets the directory read-only (`keep_readonly`): it
    can connect to the socket but not create anything beside it.
    """
    path = _new_private_dir(prefix)
    try:
        mount(
            "tmpfs",
            path,
            "tmpfs",
            MS_NOSUID | MS_NODEV | MS_NOEXEC,
            "mode=0700,size=16k,nr_inodes=16",
        )
    except OSError as error:
        os.rmdir(path)
        raise IsolationError(
            f"cannot mount the control socket's private directory at {path} "
            f"({error.strerror}): the booth's namespace lacks CAP_SYS_ADMIN; run it as "
            "`jukebox booth run`"
        ) from error
    return path


def _new_private_dir(prefix: str) -> str:
    """As tempfile.mkdtemp(prefix=prefix, dir=SOCKET_PARENT): a new 0700 directory under a
    random name, never one that was there (mkdir fails on any existing name, a symlink
    included, and another is drawn). Not tempfile itself: its import (with random) is paid
    at every booth's start for this one call."""
    for _ in range(100):
        path = os.path.join(SOCKET_PARENT, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, f"no free name for {prefix}* in {SOCKET_PARENT}")


def remove_stale_socket_dirs(prefix: str) -> None:
    """Removes the empty mount points `private_socket_dir(prefix)` left when its supervisor was
    killed (anything not empty is not ours to remove)."""
    with contextlib.suppress(OSError), os.scandir(SOCKET_PARENT) as entries:
        for entry in entries:
            if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.rmdir(entry.path)


def remove_private_dir(path: str) -> None:
    """Removes a directory made by `private_socket_dir`, leaving nothing behind on the host."""
    with contextlib.suppress(OSError):
        umount(path, MNT_DETACH)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


# --------------------------------------------------------------------------- the child's spec


class ChildSpec(Record):
    """Everything the exec shim needs; travels to it as JSON over a pipe (never on argv, where
    the environment's secret values would be world-readable in /proc/PID/cmdline)."""

    FIELDS = (
        "argv", "cwd", "env", "keep", "mount_at", "keep_readonly", "keep_tools", "hide",
        "readonly_root", "private_tmp", "limits", "net", "terminal", "parent_pid", "seccomp",
        "seccomp_bpf", "cgroup_procs", "cgroup_mounts", "tmp_size", "shm_size",
    )  # fmt: skip
    argv: list[str]
    cwd: str
    env: dict[str, str]
    keep: list[str]  # mounts that stay reachable (the tree)
    # Kept paths whose mount is taken from elsewhere in the supervisor's namespace: target ->
    # source. The tree's layer is mounted at jukebox.booth.scratchdir.layer_mountpoint, never over
    # the tree in the supervisor's namespace, so nothing the supervisor or its threads open
    # there (imports and shared libraries, /etc lookups, /etc/ld.so.cache, certificates) can
    # wait on its own FUSE server. The source is detached from the agent's view once cloned.
    mount_at: dict[str, str]
    # Mounts that stay reachable read-only (the control socket's directory: connect() needs no
    # write access to the mount, creating a file beside the socket does).
    keep_readonly: list[str]
    # Read-only but executable: jukebox's own interpreter and installation when they live where
    # the image hides (a venv under /tmp), so `jukebox booth checkpoint` works from inside.
    keep_tools: list[str]
    # Covered by an empty read-only tmpfs (or /dev/null for files).
    hide: list[str]
    readonly_root: bool
    private_tmp: bool
    limits: dict[str, int]  # keys of RLIMITS
    net: str  # "host" | "none"
    # CMD's stdin (else stdout, stderr) is the booth's pty, to become its controlling terminal.
    terminal: bool
    parent_pid: int
    # The groups of jukebox.booth.syscall_filter let through; None: no seccomp filter at all.
    seccomp: list[str] | None
    # That filter compiled (syscall_filter.compiled, hex), which CMD installs as it is; None
    # (no usable cache, or it could not be compiled): CMD builds it with libseccomp itself.
    seccomp_bpf: str | None
    # cgroup.procs files the relay joins before it forks (jukebox.booth.cgroups).
    cgroup_procs: list[str]
    # Their file systems, read-only in the view whatever the image: leaving the cgroup or
    # raising its limits is a write there.
    cgroup_mounts: list[str]
    # Sizes in bytes of the private /tmp and /dev/shm; None leaves the kernel's default (half
    # of RAM each), which the booth never does (see Image.tmpfs_sizes).
    tmp_size: int | None
    shm_size: int | None

    def __init__(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        keep: list[str] | None = None,
        mount_at: dict[str, str] | None = None,
        keep_readonly: list[str] | None = None,
        keep_tools: list[str] | None = None,
        hide: list[str] | None = None,
        readonly_root: bool = True,
        private_tmp: bool = True,
        limits: dict[str, int] | None = None,
        net: str = "host",
        terminal: bool = False,
        parent_pid: int = 0,
        seccomp: list[str] | None = None,
        seccomp_bpf: str | None = None,
        cgroup_procs: list[str] | None = None,
        cgroup_mounts: list[str] | None = None,
        tmp_size: int | None = None,
        shm_size: int | None = None,
    ) -> None:
        self.argv = argv
        self.cwd = cwd
        self.env = env
        self.keep = list() if keep is None else keep
        self.mount_at = dict() if mount_at is None else mount_at
        self.keep_readonly = list() if keep_readonly is None else keep_readonly
        self.keep_tools = list() if keep_tools is None else keep_tools
        self.hide = list() if hide is None else hide
        self.readonly_root = readonly_root
        self.private_tmp = private_tmp
        self.limits = dict() if limits is None else limits
        self.net = net
        self.terminal = terminal
        self.parent_pid = parent_pid
        self.seccomp = seccomp
        self.seccomp_bpf = seccomp_bpf
        self.cgroup_procs = list() if cgroup_procs is None else cgroup_procs
        self.cgroup_mounts = list() if cgroup_mounts is None else cgroup_mounts
        self.tmp_size = tmp_size
        self.shm_size = shm_size

    def to_json(self) -> bytes:
        return json.dumps(self.fields_dict()).encode()  # asdict's JSON: no field nests a class

    @classmethod
    def from_json(cls, data: bytes) -> ChildSpec:
        return cls(**json.loads(data))


class Child:
    """A sandboxed command started through the exec shim."""

    def __init__(self, proc: subprocess.Popen[bytes], status_fd: int) -> None:
        self.proc = proc
        self._status_fd = status_fd
        self.setup_error: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_started(self) -> bool:
        """Blocks until the command was exec'd (True) or its set-up failed (False: setup_error)."""
        if self._status_fd < 0:
            return self.setup_error is None
        chunks = []
        while True:
            chunk = os.read(self._status_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(self._status_fd)
        self._status_fd = -1
        if chunks:
            self.setup_error = b"".join(chunks).decode(errors="replace")
        return self.setup_error is None


def spawn(spec: ChildSpec, *, stdin: Any = None, stdout: Any = None, stderr: Any = None) -> Child:
    """Starts `spec.argv` in the sandbox through the exec shim; returns without waiting for it."""
    # Here, not at the top: the agent's shim is pre-forked (PreforkedShim), and a booth
    # without a verifier never needs subprocess (nor locale, which it imports).
    import subprocess

    spec.parent_pid = os.getpid()
    spec_r, spec_w = os.pipe()
    status_r, status_w = os.pipe()
    try:
        # -I: the agent's PYTHON* variables must not steer the shim (they are meant for the agent).
        proc = subprocess.Popen(
            [
                sys.executable, "-I", "-m", "jukebox.booth.isolation", "exec",
                str(spec_r), str(status_w),
            ],
            pass_fds=(spec_r, status_w),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            close_fds=True,
            # Out of the caller's session and process group: the caller's terminal signals go
            # to the supervisor alone, which passes them on; nothing below can signal the caller.
            start_new_session=True,
        )
    finally:
        os.close(spec_r)
        os.close(status_w)
    # Written after the start: a spec larger than the pipe buffer would otherwise block forever.
    data = spec.to_json()
    with os.fdopen(spec_w, "wb") as pipe, contextlib.suppress(BrokenPipeError):
        pipe.write(data)
    return Child(proc, status_r)


class _Forked:
    """What `Child.proc` is for a PreforkedShim: its pid, and the status the caller reaps."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None


# Where this process's argument strings lie, once read from /proc/self/stat (about 0.6 ms): a
# forked child has them at the same addresses, so the init, forked from the relay, which set
# its own title first, does not read it again on the agent's way to its start.
_argv_area: list[tuple[int, int]] = []


def set_title(title: str) -> None:
    """Shows `title` as this process's command line (/proc/PID/cmdline, `ps`): it overwrites
    the original argument strings in place, padded with NULs. Not python-prctl's
    set_proctitle, which segfaults in a process forked from one with a long command line (the
    supervisor of `booth run -- python3 -c SCRIPT`). Python keeps its own copy of argv."""
    if not _argv_area:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        _argv_area.append((int(fields[45]), int(fields[46])))  # fields 48 and 49 of proc(5)
    arg_start, arg_end = _argv_area[0]
    size = arg_end - arg_start
    if size <= 0:
        return
    data = title.encode()[: size - 1]
    ctypes.memmove(arg_start, data + b"\0" * (size - len(data)), size)


class PreforkedShim:
    """The exec shim forked from the supervisor while it has no thread yet, waiting for its
    spec: `spawn` then costs no new interpreter and no imports (a fresh `python -m
    jukebox.booth.isolation` is most of a booth's start-up), and its preparation overlaps the
    supervisor's mount.

    Forking is safe only without threads (the reason `spawn` execs a fresh shim), so `fork()`
    refuses otherwise. The child keeps nothing of the supervisor but the interpreter: every
    other descriptor is closed at once, the garbage collector is off (no finalizer of the
    supervisor's objects can run there), and it ends with `os._exit`, never returning into the
    supervisor's code. One spawn per shim; `close()` ends an unused one.

    Forked `join_later`, it is forked before the supervisor has imported most of itself or
    entered its namespaces (`jukebox booth run`'s start, jukebox.cli.fast): a process that
    small costs less to fork and far less afterwards, as neither it, the init nor CMD forked
    from it copy the supervisor's pages on write (about 40% of a booth's page faults were
    such copies), and it imports what it needs on the other CPU while the supervisor goes on.
    It then takes the booth's cgroups from `prepare()` and joins the supervisor's user and
    mount namespaces (setns) when its spec arrives: the namespaces, and all that is set up
    in them after, are the ones a shim forked there would have had."""

    def __init__(self, pid: int, sock: socket.socket, status_r: int) -> None:
        self.pid = pid
        self._sock: socket.socket | None = sock
        self._status_r = status_r

    @classmethod
    def fork(
        cls, cgroup_procs: Sequence[str] = (), *, preload_seccomp: bool = False,
        join_later: bool = False,
    ) -> PreforkedShim:  # fmt: skip
        """`cgroup_procs`: the booth's cgroup.procs files (jukebox.booth.cgroups), joined at once.
        Joining a cgroup v1 hierarchy waits for an RCU grace period in the kernel (10-60 ms
        here), which then passes while the supervisor mounts the layer instead of after the
        spec arrives; the spec's own list is joined again only where this failed.
        `preload_seccomp`: the spec will not bring the filter compiled (no usable cache), so
        CMD compiles it: the libseccomp binding is imported meanwhile too."""
        if thread_count() != 1:
            raise IsolationError("the shim can be forked only before the supervisor's threads")
        parent = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        # Born with the signals the supervisor waits for blocked, as when it is forked after
        # the supervisor blocked them (jukebox.booth.supervisor.WAITED_SIGNALS): the caller's
        # Ctrl-C is the supervisor's to pass on, never a reason for the shim to die.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, SUPERVISOR_WAITED)
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            raise
        if pid == 0:
            try:
                ours.close()
                os.close(status_r)
                _preforked_main(
                    parent, theirs, status_w, cgroup_procs, preload_seccomp, join_later
                )
            finally:
                os._exit(SETUP_FAILED_STATUS)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        theirs.close()
        os.close(status_w)
        return cls(pid, ours, status_r)

    def prepare(self, cgroup_procs: Sequence[str], *, preload_seccomp: bool) -> None:
        """For a shim forked `join_later`: the booth's cgroup.procs files, joined at once (see
        `fork`), and whether CMD will compile the filter. A shim that died meanwhile is told
        nothing: `spawn` reports it."""
        if self._sock is None:
            return
        data = json.dumps(
            {"cgroup_procs": list(cgroup_procs), "preload_seccomp": preload_seccomp}
        ).encode()
        with contextlib.suppress(OSError):
            self._sock.sendall(_HEADER.pack(_PREPARE, len(data)) + data)

    def spawn(
        self, spec: ChildSpec, *, stdin: int | None = None, stdout: int | None = None,
        stderr: int | None = None,
    ) -> Child:  # fmt: skip
        """As `spawn`; stdin, stdout and stderr are descriptors, or None for the supervisor's."""
        if self._sock is None:
            raise IsolationError("this pre-forked shim was used or closed already")
        spec.parent_pid = os.getpid()
        data = spec.to_json()
        stdio = [fd if fd is not None else i for i, fd in enumerate((stdin, stdout, stderr))]
        sock, self._sock = self._sock, None
        try:
            socket.send_fds(sock, [_HEADER.pack(_SPEC, len(data))], stdio)
            sock.sendall(data)
        except OSError as error:  # it died: its status says how, the caller reaps it
            os.write(2, f"jukebox: the pre-forked shim is gone ({error.strerror})\n".encode())
        finally:
            sock.close()
        # _Forked has the waitpid/kill surface Child uses of a Popen
        return Child(_Forked(self.pid), self._status_r)  # type: ignore[arg-type]

    def close(self) -> None:
        """Ends a shim that was never used (its socket's EOF) and reaps it."""
        if self._sock is None:
            return
        self._sock.close()
        self._sock = None
        os.close(self._status_r)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


# A message to a pre-forked shim: its kind, then the length of what follows. `_PREPARE`
# (JSON: cgroup_procs, preload_seccomp) only to a shim forked join_later; `_SPEC` (the
# ChildSpec's JSON) comes with CMD's stdin, stdout and stderr and is the last.
_HEADER = struct.Struct("!cQ")
_PREPARE, _SPEC = b"P", b"S"


def _join_cgroups(cgroup_procs: Sequence[str]) -> list[str]:
    joined = []
    for procs in cgroup_procs:
        # A failure is left for the relay, which joins again and reports it.
        with contextlib.suppress(OSError):
            Path(procs).write_text(str(os.getpid()))
            joined.append(procs)
    return joined


def _receive(sock: socket.socket) -> tuple[bytes, bytes, list[int]] | None:
    """One message (kind, body, descriptors that came with it); None at EOF."""
    head = b""
    fds: list[int] = []
    while len(head) < _HEADER.size:
        data, got, _, _ = socket.recv_fds(sock, _HEADER.size - len(head), 3)
        fds += got
        if not data:
            return None
        head += data
    kind, size = _HEADER.unpack(head)
    chunks = []
    while size > 0:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return kind, b"".join(chunks), fds


def _join_namespaces_of(supervisor: int | OSError | None) -> None:
    """Enters the user namespace the supervisor made (when it made one) and its mount
    namespace, through `supervisor`, a pidfd of it: where a shim forked by it after it
    entered them would be. Never through /proc/PID: where /proc is not of this PID namespace
    (`nsenter --pid`, `unshare --pid` without --mount-proc) the number names another process
    there, whose namespaces a shim would join (tests/booth/test_shim_attacks.py); a pidfd
    names its process for good, and setns through it fails once that process is gone."""
    if not isinstance(supervisor, int):
        raise supervisor or OSError(errno.EBADF, "no pidfd of the supervisor")
    flags = CLONE_NEWNS | (CLONE_NEWUSER if makes_user_namespace() else 0)
    try:
        _check(_libc.setns(supervisor, flags), "setns into the supervisor's namespaces")
    finally:
        os.close(supervisor)  # the init forked next keeps no handle on the supervisor


def _preforked_main(
    parent: int, sock: socket.socket, status_fd: int, cgroup_procs: Sequence[str] = (),
    preload_seccomp: bool = False, join_later: bool = False,
) -> None:  # fmt: skip
    """The pre-forked shim until its spec arrives; then the relay, as `_shim_main` is."""
    import gc

    gc.disable()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    supervisor: int | OSError | None = None
    if join_later:
        try:
            supervisor = os.pidfd_open(parent)
        except OSError as error:  # reported as the join's failure when the spec comes
            supervisor = error
    if os.getppid() != parent:
        # The supervisor died before pdeathsig was armed; checked after pidfd_open, so the
        # pidfd is of the supervisor, not of a process that took its number since.
        return
    with contextlib.suppress(Exception):
        set_thread_name(RELAY_TITLE)  # what `booth stop` looks for
        set_title(RELAY_TITLE)
    kept = {0, 1, 2, sock.fileno(), status_fd}
    if isinstance(supervisor, int):
        kept.add(supervisor)
    keep = sorted(kept)
    for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=True):
        os.closerange(low + 1, high)
    joined = _join_cgroups(cgroup_procs)
    # While the supervisor mounts the layer: what the init and CMD will need. The libseccomp
    # binding only when the spec will not bring the filter compiled (else the init imports it,
    # see _init_main).
    with contextlib.suppress(Exception):
        from jukebox.booth import private_dev, syscall_filter  # noqa: F401

        if preload_seccomp:
            syscall_filter.preload()
        # And what the relay, the init and CMD would make at their first call of each (they
        # are forked from this process): CMD's credentials' (credentials.prepare), libc's
        # functions for the namespaces and mounts. Off the agent's critical path, meanwhile.
        credentials.prepare()
        for name in ("setns", "unshare", "mount", "umount2"):
            getattr(_libc, name)
    while True:
        message = _receive(sock)
        if message is None:
            return  # closed unused
        kind, body, fds = message
        if kind != _PREPARE:
            break
        prepared = json.loads(body)
        wanted = prepared["cgroup_procs"]
        joined += _join_cgroups(wanted)
        if prepared["preload_seccomp"]:
            with contextlib.suppress(Exception):
                syscall_filter.preload()
        if join_later and not makes_user_namespace() and set(wanted) <= set(joined):
            _relay_with_waiting_init(sock, supervisor, status_fd, joined)
    sock.close()
    if kind != _SPEC or len(fds) != 3:
        return
    if join_later:
        try:
            _join_namespaces_of(supervisor)
        except OSError as error:
            _setup_failed(status_fd, "joining the supervisor's namespaces", error)
    _take_stdio(fds)
    # As the exec'd shim is started: a session of its own, out of the caller's process group.
    os.setsid()
    _relay_main(ChildSpec.from_json(body), status_fd, joined)


def _take_stdio(fds: Sequence[int]) -> None:
    """CMD's stdin, stdout and stderr, as they came with the spec, at 0, 1 and 2."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)


def _relay_with_waiting_init(
    sock: socket.socket, supervisor: int | OSError | None, status_fd: int, joined: list[str]
) -> NoReturn:
    """The relay of a pre-forked shim that has joined the booth's cgroups, as root (no user
    namespace to join first): it makes the PID namespace and forks the init now, while the
    supervisor still mounts the layer, instead of after the spec arrives; the init waits for
    the spec (`_waiting_init_main`), then joins the supervisor's mount namespace, and the
    rest is as `_relay_main`'s. The relay's own set-up and the init's start are then off the
    agent's way to its start. A failure here is reported when the spec comes, by the init."""
    os.setsid()  # as _preforked_main does, before the init is born into the session
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    # A failure leaves the init forked next outside pid 1: _waiting_init_main reports it.
    with contextlib.suppress(OSError):
        unshare(CLONE_NEWPID)

    def in_the_relay() -> None:  # the socket and the pidfd are the waiting init's only
        sock.close()
        if isinstance(supervisor, int):
            os.close(supervisor)

    _fork_init_and_relay(
        lambda alive_r, result_w: _waiting_init_main(
            sock, supervisor, status_fd, alive_r, result_w, joined
        ),
        status_fd,
        in_the_relay,
    )


def _waiting_init_main(
    sock: socket.socket, supervisor: int | OSError | None, status_fd: int, alive_r: int,
    result_w: int, joined: list[str],
) -> None:  # fmt: skip
    """The init forked by `_relay_with_waiting_init`, until its spec arrives; then the
    supervisor's mount namespace and `_init_main`. The socket's EOF (the shim closed unused):
    it exits, and the relay with it."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getpid() != 1:
        error = OSError(errno.EPERM, "the relay could not make a PID namespace")
        _setup_failed(status_fd, "entering a new PID namespace", error)
    while True:
        message = _receive(sock)
        if message is None:
            os._exit(0)
        kind, body, fds = message
        if kind != _PREPARE:
            break
        joined += _join_cgroups(json.loads(body)["cgroup_procs"])
    sock.close()
    if kind != _SPEC or len(fds) != 3:
        os._exit(SETUP_FAILED_STATUS)
    try:
        _join_namespaces_of(supervisor)
    except OSError as error:
        _setup_failed(status_fd, "joining the supervisor's namespaces", error)
    _take_stdio(fds)
    spec = ChildSpec.from_json(body)
    # Before CMD forks: it and all it starts are born in the booth's cgroup.
    _join_the_rest(spec, status_fd, joined)
    _init_main(spec, status_fd, alive_r, result_w)


# --------------------------------------------------------------------------- the shim side


def _cover_dir(path: str) -> None:
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")


def _cover_file(path: str) -> None:
    mount("/dev/null", path, None, MS_BIND)


def _lo_up() -> None:
    # SIOCGIFFLAGS / SIOCSIFFLAGS on "lo": a fresh network namespace starts with loopback down.
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh14x", b"lo", 0)
        flags = struct.unpack("16sh14x", fcntl.ioctl(s.fileno(), siocgifflags, req))[1]
        fcntl.ioctl(s.fileno(), siocsifflags, struct.pack("16sh14x", b"lo", flags | iff_up))


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def view_policy(image: Image, net: str, scratch_limit: int | None) -> dict[str, Any]:
    """What the agent's view will be, as the run_start frame records it: the private /dev,
    IPC and UTS namespaces, the keyring and capabilities, the sizes of the private /tmp and
    /dev/shm, and the socket directories covered under --net none."""
    sizes = image.tmpfs_sizes(scratch_limit)
    return {
        "dev": "private",
        "namespaces": ["mnt", "pid", "ipc", "uts", *(["net"] if net == "none" else [])],
        "hostname": HOSTNAME,
        "session_keyring": "fresh",
        "mounts": "nosuid,nodev",
        "kept_caps": list(credentials.KEPT_CAPS),
        "tmp_size": sizes["tmp"] if image.private_tmp else None,
        "shm_size": sizes["shm"],
        "hidden_socket_dirs": (
            [d for d in SOCKET_DIRS if os.path.lexists(d)] if net == "none" else []
        ),
    }


def hidden_tools(
    hide: list[str], private_tmp: bool, writable: Sequence[str] = ()
) -> list[str]:
    """jukebox's interpreter and installation directories that a view with these covers would
    hide; the booth keeps them reachable (read-only) so the agent can run `jukebox` inside.

    One inside a `writable` kept path (the tree: jukebox's own checkout, its venv inside) is
    reachable through it already: a read-only copy of its own would cover the agent's
    writable tree with the real files, and every write there would fail with EROFS."""
    import jukebox

    candidates = {
        os.path.realpath(p)
        for p in (
            sys.prefix,
            sys.exec_prefix,
            sys.base_prefix,
            os.path.dirname(os.path.dirname(os.path.abspath(jukebox.__file__))),
        )
    }
    covers = [os.path.realpath(h) for h in hide] + ["/dev"]  # the booth's /dev is its own
    if private_tmp:
        covers.append("/tmp")
    hidden = {c for c in candidates if any(_is_under(c, h) for h in covers)}
    hidden = {c for c in hidden if not any(_is_under(c, os.path.realpath(w)) for w in writable)}
    # Only the outermost of nested candidates (a venv inside the source checkout).
    return sorted(c for c in hidden if not any(o != c and _is_under(c, o) for o in hidden))


def enter_view_namespaces(spec: ChildSpec) -> None:
    """The namespaces `build_view` shapes: a mount namespace of this process's own (a child of
    the one it is in, private from there on), new IPC and UTS namespaces, and a network
    namespace with only its loopback up under --net none. A process forked after this is in
    them too, and sees every mount made here later (see `_init_main`)."""
    extra = CLONE_NEWNET if spec.net == "none" else 0
    unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | extra)
    socket.sethostname(HOSTNAME)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    if spec.net == "none":
        _lo_up()


def build_view(spec: ChildSpec, *, fresh_proc: bool = False, entered: bool = False) -> None:
    """Shapes this process's (new) mount namespace as the image asks (`entered`: the caller
    made the namespaces with `enter_view_namespaces` already). Order matters:

    the kept mounts and the host's device nodes are cloned first, so making the host read-only,
    nodev and nosuid and covering /dev, /tmp or a home directory cannot take them away; covers
    are mounted writable so the kept paths can be re-created inside them, then turned
    read-only. With `fresh_proc` (the caller is pid 1 of a new PID namespace) /proc is replaced
    by a procfs of that namespace. New IPC and UTS namespaces come with the mount namespace:
    the host's SysV objects and POSIX message queues are out of sight, and the hostname is
    the booth's.
    """
    from jukebox.booth import private_dev

    if not entered:
        enter_view_namespaces(spec)
    readonly = {os.path.realpath(p) for p in spec.keep_readonly}
    tools = {os.path.realpath(p) for p in spec.keep_tools} - readonly
    keep = sorted({os.path.realpath(p) for p in spec.keep} | readonly | tools)
    sources = {os.path.realpath(t): s for t, s in spec.mount_at.items()}
    clones = {path: open_tree_clone(sources.get(path, path)) for path in keep}
    # A kept file (--ro /tmp/agent.sh) needs a file to be mounted on, a directory a directory.
    kept_dirs = {path for path, fd in clones.items() if stat.S_ISDIR(os.fstat(fd).st_mode)}
    for source in sources.values():
        # The agent sees the layer at the tree's path only, not also at the supervisor's.
        umount(source, MNT_DETACH)
    terminal = next((fd for fd in (0, 1, 2) if os.isatty(fd)), None) if spec.terminal else None
    devices = private_dev.clone_device_nodes(terminal)
    # Nothing the agent can reach may act as a device or a setuid/setgid program: not a node
    # someone made in a directory of the host, not a setuid-root binary anywhere.
    inert = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
    mount_setattr("/", inert | (MOUNT_ATTR_RDONLY if spec.readonly_root else 0), recursive=True)
    private_dev.mount_private_dev(devices, spec.shm_size or 0)
    if spec.private_tmp and os.path.isdir("/tmp"):
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, _tmpfs_options(spec.tmp_size))
    hides = sorted({os.path.realpath(p) for p in spec.hide}, key=lambda p: p.count("/"))
    # Covers over an ancestor of a kept path go first, so the kept mount is put back on top of
    # them; covers inside a kept path (a hidden directory in the tree) go last, on top of it.
    above = [h for h in hides if any(_is_under(k, h) for k in keep)]
    below = [h for h in hides if h not in above]
    hidden_ro = _cover_all(above)
    # Every kept mount goes back at its own path, on top of whatever now lies there: the
    # read-only host, a cover, or the private /tmp. The clones predate all of that.
    for path, fd in clones.items():
        _make_mount_point(path, path in kept_dirs)
        move_mount(fd, path)
        os.close(fd)
        if path in readonly:
            flags = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC
        elif path in tools:
            flags = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
        else:
            flags = inert
        mount_setattr(path, flags, recursive=True)
    hidden_ro += _cover_all(below)
    for path in hidden_ro:
        if os.path.isdir(path):
            mount_setattr(path, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
        else:  # /dev/null itself, which must stay a device to read as empty
            mount_setattr(path, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    for path in spec.cgroup_mounts:
        if os.path.isdir(path):
            mount_setattr(path, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    private_dev.seal_private_dev()
    if fresh_proc and os.path.isdir("/proc") and not any(_is_under("/proc", h) for h in hides):
        _mount_fresh_proc(spec.readonly_root)


def _make_mount_point(path: str, is_dir: bool) -> None:
    """Where a kept mount goes back: there already (the read-only host), or made in a cover or
    the private /tmp, still writable at this point."""
    if is_dir:
        os.makedirs(path, exist_ok=True)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.lexists(path):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))


def _tmpfs_options(size: int | None) -> str:
    # size=0 would mean "no limit" to tmpfs: a size is given only when there is one.
    return "mode=1777" + (f",size={size}" if size else "")


def _mount_fresh_proc(readonly: bool) -> None:
    """A procfs of the caller's PID namespace over /proc: `ps`, /proc/self and /proc/1 make
    sense inside, and no process outside the namespace (the supervisor) is there at all."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | (MS_RDONLY if readonly else 0)
    try:
        mount("proc", "/proc", "proc", flags)
    except OSError as error:
        # Unprivileged, the kernel allows a new procfs only while the host's is fully visible:
        # under a /proc with masked entries (some containers) it refuses. The host's read-only
        # /proc then stays; the PID namespace still ends every process with the run.
        if error.errno != errno.EPERM:
            raise


def _cover_all(paths: list[str]) -> list[str]:
    """Covers each existing path (a path already gone under an earlier cover needs none)."""
    covered = []
    for path in paths:
        if os.path.isdir(path):
            _cover_dir(path)
        elif os.path.lexists(path):
            _cover_file(path)
        else:
            continue
        covered.append(path)
    return covered


def set_limits(limits: Mapping[str, int]) -> None:
    for key, value in limits.items():
        which = RLIMITS[key]
        _soft, hard = resource.getrlimit(which)
        new = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (new, new))


def drop_privileges() -> None:
    """A fresh session keyring, then every capability but the kept few gone from every set,
    and no_new_privs (see jukebox.booth.credentials)."""
    credentials.join_fresh_session_keyring()
    credentials.keep_only_kept_caps()


def _shim_main(spec_fd: int, status_fd: int) -> None:
    """The relay: reads the spec, makes the PID namespace, forks the init and waits for it."""
    os.set_inheritable(status_fd, False)
    # First: should the supervisor die from now on, so does this process and all below it.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    chunks = []
    while True:
        chunk = os.read(spec_fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(spec_fd)
    _relay_main(ChildSpec.from_json(b"".join(chunks)), status_fd)


def _relay_main(spec: ChildSpec, status_fd: int, joined: Sequence[str] = ()) -> None:
    """The relay once it has its spec (from the pipe, or from a PreforkedShim's socket, with
    the cgroups that shim joined already)."""
    if spec.parent_pid and os.getppid() != spec.parent_pid:
        os._exit(SETUP_FAILED_STATUS)  # the supervisor died before pdeathsig was armed
    # Before anything forks: the init, CMD and all they start are born in the booth's cgroup.
    _join_the_rest(spec, status_fd, joined)
    # Blocked from here on, and inherited by the init: both take them with sigwaitinfo.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    try:
        unshare(CLONE_NEWPID)
    except OSError as error:
        _setup_failed(status_fd, "entering a new PID namespace", error)
    _fork_init_and_relay(
        lambda alive_r, result_w: _init_main(spec, status_fd, alive_r, result_w), status_fd
    )


def _join_the_rest(spec: ChildSpec, status_fd: int, joined: Sequence[str]) -> None:
    """This process into each of the spec's cgroups not `joined` already; a failure ends it,
    reported."""
    for procs in spec.cgroup_procs:
        if procs in joined:
            continue
        try:
            Path(procs).write_text(str(os.getpid()))
        except OSError as error:
            _setup_failed(status_fd, f"joining the booth's cgroup {os.path.dirname(procs)}", error)


def _fork_init_and_relay(
    init_main: Callable[[int, int], None], status_fd: int,
    in_the_relay: Callable[[], None] | None = None,
) -> NoReturn:  # fmt: skip
    """Forks the init, `init_main(alive_r, result_w)`; closes what only the init keeps (the
    status pipe; `in_the_relay` closes the rest), passes signals on to it until it is gone,
    and exits as CMD did."""
    alive_r, alive_w = os.pipe2(os.O_CLOEXEC)  # EOF for the init once the relay is gone
    result_r, result_w = os.pipe2(os.O_CLOEXEC)  # CMD's raw wait status, from the init
    init = os.fork()
    if init == 0:
        os.close(alive_w)
        os.close(result_r)
        init_main(alive_r, result_w)
        os._exit(SETUP_FAILED_STATUS)  # init_main ends the process itself
    os.close(alive_r)
    os.close(result_w)
    if in_the_relay is not None:
        in_the_relay()
    # Only the init and CMD may hold the status pipe: its EOF is what says CMD was exec'd.
    os.close(status_fd)
    status = _relay(init)
    data = os.read(result_r, 4)
    if len(data) == 4:
        status = struct.unpack("i", data)[0]
    _exit_as(status)


def _relay(init: int) -> int:
    """Passes signals on to the init until it exits; returns its wait status. In a session of
    its own, the relay gets no terminal's signals: whatever arrives was sent to it, and goes on."""
    while True:
        info = signal.sigwaitinfo(_WAITED)
        if info.si_signo == signal.SIGCHLD:
            pid, status = os.waitpid(init, os.WNOHANG)
            if pid:
                return status
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, info.si_signo)


def _exit_as(status: int) -> NoReturn:
    """Ends this process the way CMD ended: its exit status, or killed by its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        prctl(PR_SET_DUMPABLE, 0)  # the relay's own core is of no use to anybody
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is to be ignored: only a status is left
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else SETUP_FAILED_STATUS)


def _init_main(spec: ChildSpec, status_fd: int, alive_r: int, result_w: int) -> None:
    """Pid 1 of the booth's PID namespace: builds the view, starts CMD, reaps, exits with CMD."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    readable, _, _ = select.select([alive_r], [], [], 0)
    if readable:
        os._exit(SETUP_FAILED_STATUS)  # the relay died before pdeathsig was armed
    os.close(alive_r)
    with contextlib.suppress(Exception):
        set_title(INIT_TITLE)  # what `ps` and /proc/1/cmdline show inside
    if spec.seccomp is not None:
        # Before the view, which may hide where jukebox is installed (a venv under /home).
        try:
            from jukebox.booth import syscall_filter

            if spec.seccomp_bpf is None:
                syscall_filter.preload()
        except Exception as error:
            _setup_failed(status_fd, "building the system call filter", error)
    try:
        enter_view_namespaces(spec)
    except Exception as error:
        _setup_failed(status_fd, "building the booth's view of the file system", error)
    # CMD is forked into those namespaces before the view is built, and makes its own set-up
    # (its session, limits, keyring, capabilities) on the other core meanwhile; it goes on
    # to its working directory and its exec only once the view is whole (`view_r` readable).
    # A failed view ends this process, and with it the namespace and CMD.
    view_r, view_w = os.pipe2(os.O_CLOEXEC)
    try:
        cmd = os.fork()
    except OSError as error:
        _setup_failed(status_fd, "starting the command's process", error)
    if cmd == 0:
        os.close(result_w)
        os.close(view_w)
        _exec_cmd(spec, status_fd, view_r)
    os.close(view_r)
    try:
        build_view(spec, fresh_proc=True, entered=True)
    except Exception as error:
        _setup_failed(status_fd, "building the booth's view of the file system", error)
    with contextlib.suppress(OSError):  # CMD gone already (its set-up failed): reaped below
        os.write(view_w, VIEW_BUILT)
    os.close(view_w)
    os.close(status_fd)
    status = _reap_until(cmd)
    os.write(result_w, struct.pack("i", status))
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _reap_until(cmd: int) -> int:
    """Passes signals on to CMD and reaps every child (orphans are re-parented to pid 1) until
    CMD exits; returns CMD's wait status."""
    while True:
        info = signal.sigwaitinfo(_WAITED)
        if info.si_signo != signal.SIGCHLD:
            with contextlib.suppress(ProcessLookupError):
                os.kill(cmd, info.si_signo)
            continue
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == cmd:
                return status


def _exec_cmd(spec: ChildSpec, status_fd: int, view_r: int) -> None:
    """CMD's process: session, limits, privileges; then, once the init says the view is built
    (`view_r`), working directory and exec."""
    step = "starting a session of its own"
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # Its own session and process group: kill(0, ...) reaches nothing outside the booth,
        # and no terminal but the booth's pty can be its controlling terminal.
        os.setsid()
        terminal = next((fd for fd in (0, 1, 2) if os.isatty(fd)), None)
        if spec.terminal and terminal is not None:
            step = "taking the booth's pty as its terminal"
            fcntl.ioctl(terminal, termios.TIOCSCTTY, 0)
        step = "setting resource limits"
        set_limits(spec.limits)
        seccomp: Any = None
        program = b""
        if spec.seccomp is not None:
            step = "building the system call filter"
            from jukebox.booth import syscall_filter

            if spec.seccomp_bpf is not None:
                program = bytes.fromhex(spec.seccomp_bpf)
            else:
                seccomp = syscall_filter.build(spec.seccomp)
        step = "dropping privileges"
        drop_privileges()
        # Nothing of the booth's view may be missing when CMD looks up a path: its cwd, its
        # program. No byte here means the init failed and reports why, and is ending us.
        if os.read(view_r, 1) != VIEW_BUILT:
            os._exit(SETUP_FAILED_STATUS)
        os.close(view_r)
        step = f"entering the working directory {spec.cwd}"
        os.chdir(spec.cwd)
        # The supervisor blocks the signals it waits for, and so do the relay and the init;
        # Python ignores SIGPIPE and SIGXFSZ. CMD must inherit none of that: a write past its
        # file size limit should end a shell tool as it would anywhere (SIGXFSZ).
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for sig in (*FORWARDED_SIGNALS, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        if seccomp is not None or program:
            # Last, after no_new_privs: nothing of the set-up above needs a refused call.
            step = "installing the system call filter"
            if program:
                syscall_filter.load_compiled(program)
            else:
                seccomp.load()
        step = f"starting {spec.argv[0]!r}"
        os.execvpe(spec.argv[0], spec.argv, spec.env)
    except OSError as error:
        if step.startswith("starting"):
            code = 127 if error.errno == errno.ENOENT else 126
            message = (
                f"cannot run {spec.argv[0]!r}: {error.strerror}; check the command and its PATH"
            )
            os.write(status_fd, message.encode())
            os._exit(code)
        _setup_failed(status_fd, step, error)
    except Exception as error:
        _setup_failed(status_fd, step, error)


def _setup_failed(status_fd: int, step: str, error: BaseException) -> NoReturn:
    """Reports a failed set-up step to the supervisor and ends this process."""
    if isinstance(error, OSError):
        detail = error.strerror or str(error)
    else:  # a bug of ours: still report it rather than hang the supervisor
        detail = f"{type(error).__name__}: {error}"
    with contextlib.suppress(OSError):
        os.write(status_fd, f"booth set-up failed while {step}: {detail}".encode())
    os._exit(SETUP_FAILED_STATUS)


def main(argv: Sequence[str]) -> None:
    if len(argv) != 3 or argv[0] != "exec":
        sys.stderr.write(
            "usage: python -m jukebox.booth.isolation exec SPEC_FD STATUS_FD"
            " (internal to jukebox)\n"
        )
        sys.exit(2)
    _shim_main(int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
