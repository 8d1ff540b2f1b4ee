"""The warm start's client: a command handed to a running `jukebox warm` server, or None.

`jukebox warm start` keeps a server alive that has imported what the commands below use
(jukebox.cli.warm_server). When one is running, `main` hands it the command line before doing
anything else: this process stays the one the user sees (the parent, the pid a shell waits
for), the server forks a child that adopts this process's stdin, stdout, stderr, working
directory (as file descriptors passed with SCM_RIGHTS), argv, environment and umask and runs the
command as `main` would. Signals this process takes (SIGINT, SIGTERM, SIGHUP, SIGQUIT) are passed
on, and it exits with the child's status. When this process dies, even by SIGKILL, the server
sees its connection close and hangs the child up (SIGHUP, what a cold booth's supervisor gets
when its terminal goes): the booth ends as an interrupted one does, kept pending.

Anything in doubt runs the command here, cold, as if no server existed, and says nothing:
no server, a command not in `WARM_COMMANDS`, stdin a terminal (job control and a controlling
terminal cannot be handed over), `JUKEBOX_WARM=off`, a socket directory that is not this user's
alone, a server of another uid, and, decided by the server before it forks: another interpreter,
sys.path, flags or import-time environment (`identity`), code changed on disk since the server
imported it, a peer in another mount, user or PID namespace (an agent in a booth).

Only the standard library's C modules are imported here (no socket, signal or enum module):
this runs at the start of every command.
"""

from __future__ import annotations

import os
import sys

from jukebox.cli import WARM_ENV, warm_directory

TYPE_CHECKING = False
if TYPE_CHECKING:
    import _socket as socket_module

SOCKET_NAME = "warm.sock"
PROTOCOL = b"jukebox-warm/1"
# The commands a server runs: they read no terminal and start no pager. By the first word
# (after the output flags), and for `booth`, the second.
WARM_COMMANDS = frozenset({"replay", "ls", "log", "show", "verify", "diff", "du"})
WARM_BOOTH_COMMANDS = frozenset({"run"})
# Environment variables read at import time or by the interpreter's start: a server started
# with other values would run other code, so they are part of `identity`.
IMPORT_ENV_PREFIXES = ("PYTHON", "SHADOWFS_")
IMPORT_ENV = frozenset({"JUKEBOX_QUICKLINE", "LC_ALL", "LC_CTYPE", "LANG"})
MAX_REQUEST = 4 << 20
served = False  # True in a server's child: it runs the command itself
PASSED_SIGNALS = (1, 2, 3, 15)  # SIGHUP, SIGINT, SIGQUIT, SIGTERM
SO_PEERCRED = 17
OUTPUT_FLAGS = frozenset({"-q", "--quiet", "-v", "--verbose", "--no-color"})
# Replies: the server's first byte.
RUNNING = b"R"  # forked: the child runs the command; an exit status follows
COLD = b"C"  # not run: the client runs it itself (a reason follows, for `warm status`)
REFUSED = b"N"  # a peer the server does not serve
EXITED = b"X"  # + 4 bytes, the child's wait status (big-endian)


def open_directory(path: str) -> int:
    """The socket directory, opened without following a symlink at its last component, and
    checked: a directory owned by this user that no one else may enter or write (mode & 077 is
    0). OSError when it is missing or fails a check. The socket is reached through the open
    descriptor (/proc/self/fd/N/...), so the directory checked is the one used."""
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(
                13,
                f"{path} is not this user's alone (owner {st.st_uid}, mode "
                f"{st.st_mode & 0o7777:o}): the warm start needs a directory only its user may "
                "enter",
                path,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


STATUS_LINES = (b"Uid:", b"Gid:", b"Groups:", b"NoNewPrivs:", b"Seccomp:", b"Cap")


def standing() -> list[str]:
    """What a forked child would inherit from the server instead of the client, and which must
    therefore be the same: credentials and groups, capabilities, no_new_privs and a seccomp
    filter (/proc/self/status), the cgroup, the security label, the nice value, the CPUs, the
    resource limits."""
    import resource

    with open("/proc/self/status", "rb") as f:
        status = [line for line in f.read().splitlines() if line.startswith(STATUS_LINES)]
    parts = [b"\x01".join(status).decode("ascii", "replace")]
    for name in ("/proc/self/cgroup", "/proc/self/attr/current"):
        try:
            with open(name, "rb") as f:
                parts.append(f.read().decode("utf-8", "surrogateescape"))
        except OSError:
            parts.append("-")
    parts.append(str(os.getpriority(os.PRIO_PROCESS, 0)))
    parts.append(repr(sorted(os.sched_getaffinity(0))))
    limits = [getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")]
    parts.append(repr([resource.getrlimit(n) for n in sorted(limits)]))
    return parts


def identity() -> bytes:
    """What makes a process load the code it loads, and run it as it would: the interpreter,
    its flags, sys.path, the package directory, the environment read at import time, the
    user and the rest of its `standing`. A server serves only a client with its own (and
    checks on each request that its code on disk is unchanged)."""
    import jukebox

    env = sorted(
        (k, v)
        for k, v in os.environ.items()
        if k.startswith(IMPORT_ENV_PREFIXES) or k in IMPORT_ENV
    )
    parts = [
        sys.executable,
        sys.version,
        repr(tuple(sys.flags)),
        sys.getfilesystemencoding(),
        "\x01".join(sys.path),
        os.path.dirname(os.path.abspath(jukebox.__file__)),
        "\x01".join(f"{k}={v}" for k, v in env),
        str(os.geteuid()),
        *standing(),
    ]
    return "\x02".join(parts).encode("utf-8", "surrogateescape")


def eligible(argv: list[str]) -> bool:
    """Whether this command line may run on a server (see the module's docstring)."""
    if served or os.environ.get(WARM_ENV) == "off" or os.environ.get("_JUKEBOX_COMPLETE"):
        return False
    words = [a for a in argv if a not in OUTPUT_FLAGS]
    if not words or words[0] not in WARM_COMMANDS | {"booth"}:
        return False
    if words[0] == "booth" and words[1:2] != ["run"]:
        return False
    if any(a in ("-h", "--help", "--version") for a in argv):
        return False  # click's help: cheap either way, and it reads the terminal's width
    try:
        return not os.isatty(0)
    except OSError:
        return False


def connect(path: str | None = None) -> socket_module.socket | None:
    """A connection to this user's server, checked (its directory, its peer's uid), or None."""
    import _socket

    try:
        dirfd = open_directory(path or warm_directory())
    except OSError:
        return None
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.connect(f"/proc/self/fd/{dirfd}/{SOCKET_NAME}")
        cred = sock.getsockopt(_socket.SOL_SOCKET, SO_PEERCRED, 12)
    except OSError:
        sock.close()
        return None
    finally:
        os.close(dirfd)
    if int.from_bytes(cred[4:8], sys.byteorder) != os.geteuid():
        sock.close()  # someone else's server at our path: never hand it our streams
        return None
    return sock


def encode(fields: list[bytes]) -> bytes:
    """Fields joined by NUL (none holds one: argv and environment strings cannot), behind
    their length, 4 bytes big-endian."""
    body = b"\0".join(fields)
    return len(body).to_bytes(4, "big") + body


def request(sock: socket_module.socket, fields: list[bytes], fds: list[int] = []) -> None:  # noqa: B006
    """Sends one request, the descriptors with its first byte."""
    import _socket

    data = encode(fields)
    ancillary = []
    if fds:
        raw = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds)
        ancillary = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, raw)]
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_exactly(sock: socket_module.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def run(argv: list[str]) -> int | None:
    """Runs the command line on the server; its exit status, or None to run it here (nothing
    was done, nothing said)."""
    if not eligible(argv):
        return None
    sock = connect()
    if sock is None:
        return None
    try:
        return _run_on(sock, argv)
    finally:
        sock.close()


def _run_on(sock: socket_module.socket, argv: list[str]) -> int | None:
    try:
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None  # a working directory removed: the cold path says so as it always did
    try:
        mask = os.umask(0o22)
        os.umask(mask)
        fields = [
            PROTOCOL,
            b"run",
            identity(),
            str(mask).encode(),
            str(len(argv) + 1).encode(),
            os.fsencode(sys.argv[0]),
            *(os.fsencode(a) for a in argv),
            *(os.fsencode(k) + b"=" + os.fsencode(v) for k, v in os.environ.items()),
        ]
        try:
            request(sock, fields, [0, 1, 2, cwd])
            reply = sock.recv(1)
        except OSError:
            return None  # nothing ran: 0, 1 or 2 not open (EBADF), or the server went away
    finally:
        os.close(cwd)
    if reply != RUNNING:
        return None
    return _wait(sock)


def _wait(sock: socket_module.socket) -> int:
    """Passes this process's signals on until the child's status comes; returns the exit
    code, or dies of the child's signal as a shell would see it."""
    # The C module behind `signal`, which has no stub; `signal` itself imports enum.
    import _signal  # type: ignore[import-not-found]  # (see the line above)

    def pass_on(signum: int, _frame: object) -> None:
        try:
            sock.send(b"S" + bytes([signum]))
        except OSError:
            return  # the server is gone: the wait below says so

    for signum in PASSED_SIGNALS:
        _signal.signal(signum, pass_on)
    reply = recv_exactly(sock, 5)
    if len(reply) != 5 or reply[:1] != EXITED:
        sys.stderr.write("jukebox: the warm server went away before the command ended\n")
        return 70
    status = int.from_bytes(reply[1:], "big")
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        _signal.signal(signum, _signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return 128 + signum
    return os.waitstatus_to_exitcode(status)
