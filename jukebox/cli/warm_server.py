"""`jukebox warm start|stop|status`: a process kept alive, with the commands' modules imported,
that forks a child for each command a client hands it (jukebox.cli.warm, the client's side).

The server is one thread and one poll loop. It listens on `warm.sock` in a directory only its
user may enter (jukebox.cli.warm.open_directory), and serves a peer only when
* its uid (SO_PEERCRED) is the server's, and
* it lives in the server's mount, user and PID namespaces and under its root directory (an
  agent in a booth lives in its own: it must never get a command started for it outside its
  sandbox). The peer is the process that connected, held by a pidfd the kernel gives with the
  connection (SO_PEERPIDFD), so a pid reused meanwhile is not the one checked;
* it runs the server's interpreter with the server's sys.path, flags and import-time
  environment (`warm.identity`), and the code on disk is still what the server imported
  (`code_state`, checked at each request: a server whose code changed answers cold and ends).

Each command runs in a child forked while the server has one thread and no open state a child
could misuse (the server opens no store, tape or database; it imported modules, nothing else).
The child adopts the client's streams, working directory, environment, umask and argv, leaves
the server's session and process group for its own, and runs `jukebox.cli.main`. The server
keeps the connection: it passes the client's signals on (pidfd_send_signal), sends SIGHUP to
the child when the client hangs up (dies), and sends the child's wait status back. The child
gets SIGHUP too if the server dies (PR_SET_PDEATHSIG): nobody would be left to report it.

The server ends after `--idle-timeout` seconds without a command running, on `warm stop`, or
once its code changed; then it stops listening and waits for its running children.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import io
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

import click

from jukebox.cli import cli, warm, warm_directory
from jukebox.cli.options import json_option

DEFAULT_IDLE_TIMEOUT = 900.0
# After its client is gone, a child's booth gets this long to end on the SIGHUP; then a second
# SIGHUP, which a booth's supervisor answers by killing its agent (as `booth stop`'s grace).
HANGUP_GRACE = 10.0
SO_PEERPIDFD = 77
LOG_NAME = "server.log"
LOCK_NAME = "server.lock"
# What `booth run`, `replay` and the click commands import, imported once by the server (the
# children still import anything else they need, as a cold start would).
WARM_MODULES = (
    "jukebox.cli.fast", "jukebox.config", "jukebox.cli.output", "jukebox.llm.upstreams",
    "jukebox.tape.tapedir", "jukebox.booth.isolation", "jukebox.booth.supervisor",
    "jukebox.booth.fusectl", "jukebox.booth.layer_watchdog", "jukebox.trees.realtree",
    "jukebox.trees.basetree", "jukebox.mcp.record", "jukebox.mcp.staging",
    "jukebox.llm.standby", "jukebox.llm.telemetry", "jukebox.llm.session", "jukebox.llm.defaults",
    "shadowfs.store", "shadowfs.tree", "shadowfs.layer", "shadowfs.fuse", "shadowfs.mountctl",
    "shadowfs.quiet_fold", "shadowfs.removal", "jukebox.tape.tape", "jukebox.cli.reading",
    "jukebox.display.names", "jukebox.display.render", "jukebox.cli.app", "jukebox.cli.tapes",
    "jukebox.cli.booth", "jukebox.cli.booth_review", "jukebox.cli.mcp", "jukebox.cli.disk",
    "jukebox.cli.show", "jukebox.display.style", "shadowfs.nofollow",
)  # fmt: skip


def _rehearse() -> None:
    """What every booth's start computes the same way from files, done once so the children
    find the interpreter's caches (compiled regular expressions, lazy imports) filled: the
    default sandbox image is read and parsed, and the result dropped (each booth reads it
    again, so an edited image is seen); its environment patterns are matched against a name no
    environment has, which compiles them (fnmatch's cache); the tape's frame patterns, compiled
    at their first use, are compiled."""
    from jukebox.booth import images
    from jukebox.tape import frame

    frame.kind_pattern()
    frame.frame_pattern()
    frame.seq_pattern()

    with contextlib.suppress(Exception):
        image = images.load_image()
        name = "JUKEBOX_WARM_REHEARSAL_"
        image.is_secret(name)
        image.filter_env({name: ""})


def code_state() -> bytes:
    """The code a start would load, as the file system says now: every file of the jukebox and
    shadowfs packages (path, mtime, size, inode) and every sys.path entry's (mtime, inode: a
    package installed or removed there changes it). Compared, not trusted: a digest."""
    from _blake2 import blake2b

    import jukebox
    import shadowfs

    seen: list[tuple[str, int, int, int]] = []
    for package in (jukebox, shadowfs):
        pending = [os.path.dirname(os.path.abspath(package.__file__ or ""))]
        while pending:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        if entry.name != "__pycache__":
                            pending.append(entry.path)
                        continue
                    try:
                        st = entry.stat()  # through a symlink: the compiled modules' links
                    except OSError:
                        continue
                    seen.append((entry.path, st.st_mtime_ns, st.st_size, st.st_ino))
    for path in sys.path:
        try:
            st = os.stat(path or ".")
        except OSError:
            continue
        seen.append((path, st.st_mtime_ns, 0, st.st_ino))
    seen.sort()
    digest = blake2b(repr(seen).encode("utf-8", "surrogateescape"), digest_size=20)
    return digest.digest()


def _namespaces(pid: int | str) -> tuple[tuple[int, int], ...]:
    """A process's mount, user and PID namespaces, and its root directory (a chroot)."""
    return tuple(
        (st.st_dev, st.st_ino)
        for st in (os.stat(f"/proc/{pid}/{name}") for name in ("ns/mnt", "ns/user", "ns/pid",
                                                                "root"))
    )  # fmt: skip


def _pidfd_pid(pidfd: int) -> int:
    """The pid a pidfd's process has now, -1 once it is gone (/proc's fdinfo)."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    return -1


def peer_refusal(conn: socket.socket) -> str | None:
    """Why a connected peer is not served, or None: another uid, another namespace."""
    pid, uid, _gid = (int.from_bytes(conn.getsockopt(socket.SOL_SOCKET, warm.SO_PEERCRED, 12)[
        i : i + 4], sys.byteorder) for i in (0, 4, 8))  # fmt: skip
    if uid != os.geteuid():
        return f"peer uid {uid}"
    if pid <= 0:
        return "peer has no pid in this PID namespace"  # one in an ancestor's
    pidfd = -1
    try:
        try:
            pidfd = int.from_bytes(
                conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4), sys.byteorder, signed=True
            )
        except OSError:
            pidfd = os.pidfd_open(pid)  # before Linux 6.5: the pid, checked alive below
        theirs = _namespaces(pid)
        if _pidfd_pid(pidfd) != pid:
            return "peer gone"  # so the /proc/PID read may have been another process's
    except OSError as error:
        return f"peer not readable: {error}"
    finally:
        if pidfd >= 0:
            os.close(pidfd)
    if theirs != _namespaces("self"):
        return "peer in another namespace"
    return None


def _receive(conn: socket.socket) -> tuple[list[bytes], list[int]]:
    """One request: its fields and the descriptors that came with it."""
    fds: list[int] = []
    data, ancdata, flags, _ = conn.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
    for level, kind, raw in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += [int.from_bytes(raw[i : i + 4], sys.byteorder, signed=True)
                    for i in range(0, len(raw) - len(raw) % 4, 4)]  # fmt: skip
    try:
        if flags & socket.MSG_CTRUNC or len(data) < 4:
            raise ValueError("a truncated request")
        size = int.from_bytes(data[:4], "big")
        if size > warm.MAX_REQUEST:
            raise ValueError("a request too big")
        body = data[4:]
        while len(body) < size:
            chunk = conn.recv(min(size - len(body), 1 << 20))
            if not chunk:
                raise ValueError("a truncated request")
            body += chunk
        return body.split(b"\0"), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class Server:
    def __init__(self, directory: str, idle_timeout: float) -> None:
        self.directory = directory
        self.idle_timeout = idle_timeout
        self.identity = warm.identity()
        self.code = code_state()
        self.started = time.time()
        self.last_active = time.monotonic()
        self.listener: socket.socket | None = None
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, conn)
        self.hung_up: dict[int, float] = {}  # pidfd -> when to hang it up again
        self.runs = 0
        self.refused = 0
        self.cold = 0
        self.stopping = ""

    # -- the loop

    def serve(self, listener: socket.socket) -> None:
        self.listener = listener
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        while self.listener is not None or self.children:
            now = time.monotonic()
            timeout = 60.0
            if self.listener is not None and not self.children:
                timeout = max(0.0, self.last_active + self.idle_timeout - now)
            for pidfd, when in list(self.hung_up.items()):
                if when <= now:
                    del self.hung_up[pidfd]
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(pidfd, signal.SIGHUP)
                else:
                    timeout = min(timeout, when - now)
            events = poller.poll(min(timeout, 60.0) * 1000)
            if not events and self.listener is not None and not self.children:
                if time.monotonic() >= self.last_active + self.idle_timeout:
                    self._stop_listening(poller, "idle")
                elif code_state() != self.code:
                    self._stop_listening(poller, "code changed")
                continue
            for fd, event in events:
                if self.listener is not None and fd == self.listener.fileno():
                    self._accept(poller)
                elif fd in self.children:
                    self._reap(poller, fd)
                else:
                    self._client_event(poller, fd, event)
        os._exit(0)

    def _stop_listening(self, poller: select.poll, why: str) -> None:
        if self.listener is None:
            return
        self.stopping = why
        poller.unregister(self.listener)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, warm.SOCKET_NAME))
        self.listener.close()
        self.listener = None

    def _accept(self, poller: select.poll) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        keep = False
        try:
            refusal = peer_refusal(conn)
            if refusal is not None:
                self.refused += 1
                _log(f"refused a peer: {refusal}")
                with contextlib.suppress(OSError):
                    conn.sendall(warm.REFUSED)
                return
            conn.settimeout(5.0)  # a peer of ours that says nothing does not hold the loop long
            keep = self._handle(poller, conn)
        except (OSError, ValueError) as error:
            _log(f"a request failed: {error}")
        finally:
            if not keep:
                conn.close()

    def _handle(self, poller: select.poll, conn: socket.socket) -> bool:
        """Answers a request; True when `conn` now belongs to a running child."""
        fields, fds = _receive(conn)
        try:
            if fields[:1] != [warm.PROTOCOL] or len(fields) < 2:
                raise ValueError("not a jukebox warm request")
            kind = fields[1]
            if kind == b"status":
                conn.sendall(json.dumps(self.status()).encode())
                return False
            if kind == b"stop":
                conn.sendall(b"ok")
                self._stop_listening(poller, "stopped")
                return False
            if kind != b"run":
                raise ValueError("an unknown request")
            why = self._cold_reason(fields, fds)
            if why is not None:
                self.cold += 1
                _log(f"answered cold: {why}")
                conn.sendall(warm.COLD + why.encode())
                if why == "code changed":
                    self._stop_listening(poller, why)
                return False
            pid, pidfd = self._fork(conn, fields, fds)
        finally:
            for fd in fds:
                os.close(fd)
        self.runs += 1
        self.last_active = time.monotonic()
        self.children[pidfd] = (pid, conn)
        poller.register(pidfd, select.POLLIN)
        try:
            conn.sendall(warm.RUNNING)
        except OSError:  # the client went meanwhile: its child is hung up as at any loss
            self._hang_up(pidfd)
            return True
        conn.setblocking(False)
        poller.register(conn, select.POLLIN)
        return True

    def _hang_up(self, pidfd: int) -> None:
        """The client is gone: SIGHUP to its child now, and again after HANGUP_GRACE."""
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGHUP)
        self.hung_up[pidfd] = time.monotonic() + HANGUP_GRACE

    def _cold_reason(self, fields: list[bytes], fds: list[int]) -> str | None:
        if len(fields) < 6 or len(fds) != 4:
            return "a malformed request"
        if fields[2] != self.identity:
            return "another interpreter, sys.path or import-time environment"
        if code_state() != self.code:
            return "code changed"
        if len(os.listdir("/proc/self/task")) != 1:
            return "the server is not single-threaded"  # never forks then
        return None

    def _fork(self, conn: socket.socket, fields: list[bytes], fds: list[int]) -> tuple[int, int]:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            status = 70
            try:
                # Python's socket objects give up their descriptors without closing them: the
                # child closes every descriptor it did not adopt by number, and a socket object
                # collected later must not close one the command opened meanwhile.
                for sock in (self.listener, conn, *(c for _, c in self.children.values())):
                    if sock is not None:
                        sock.detach()
                _child(parent, fields, fds)
            except SystemExit as stop:  # `main`'s sys.exit: its end, as the interpreter's
                from jukebox.cli import _leave

                _leave(stop.code)  # joins threads, runs atexit, flushes; never returns
            except BaseException as error:  # nothing may go back to the server's code
                with contextlib.suppress(Exception):
                    os.write(2, f"jukebox: warm start failed: {error!r}\n".encode())
            os._exit(status)
        return pid, os.pidfd_open(pid)

    def _client_event(self, poller: select.poll, fd: int, event: int) -> None:
        entry = next(((k, v) for k, v in self.children.items() if v[1].fileno() == fd), None)
        if entry is None:
            poller.unregister(fd)
            return
        pidfd, (_pid, conn) = entry
        try:
            data = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client is gone: hang the child up, as a terminal's end does
            poller.unregister(fd)
            self._hang_up(pidfd)
            return
        for i in range(0, len(data) - 1, 2):
            if data[i : i + 1] == b"S" and data[i + 1] in warm.PASSED_SIGNALS:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(pidfd, data[i + 1])

    def _reap(self, poller: select.poll, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.hung_up.pop(pidfd, None)
        poller.unregister(pidfd)
        with contextlib.suppress(KeyError):
            poller.unregister(conn)
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
        with contextlib.suppress(OSError):
            conn.setblocking(True)
            conn.sendall(warm.EXITED + status.to_bytes(4, "big"))
        conn.close()
        self.last_active = time.monotonic()

    def status(self) -> dict[str, Any]:
        return {
            "running": True,
            "pid": os.getpid(),
            "socket": os.path.join(self.directory, warm.SOCKET_NAME),
            "started": self.started,
            "idle_timeout": self.idle_timeout,
            "commands_running": len(self.children),
            "commands_run": self.runs,
            "answered_cold": self.cold,
            "peers_refused": self.refused,
            "code_current": code_state() == self.code,
            "python": sys.executable,
        }


def _child(parent: int, fields: list[bytes], fds: list[int]) -> None:
    """In the forked child: adopt the client's process state, then run the command."""
    from jukebox.booth import isolation

    os.setpgid(0, 0)  # its own process group, out of the server's
    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGHUP)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    umask, argc = int(fields[3]), int(fields[4])
    argv = [os.fsdecode(a) for a in fields[5 : 5 + argc]]
    env = [os.fsdecode(item) for item in fields[5 + argc :] if item]
    for i in range(3):
        os.dup2(fds[i], i)
    os.fchdir(fds[3])
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    fds.clear()
    os.umask(umask)
    os.environ.clear()
    for item in env:
        key, _, value = item.partition("=")
        if key:
            os.environ[key] = value
    time.tzset()
    sys.argv = argv
    _reopen_streams()
    warm.served = True
    import jukebox.cli

    jukebox.cli.main()


def _reopen_streams() -> None:
    """sys.stdin/stdout/stderr on the adopted descriptors, made as the interpreter's start
    makes them (a terminal's stdout line-buffered, stderr always), in the server's encodings
    (its locale is the client's: `warm.identity`)."""
    made: list[io.TextIOWrapper] = []
    for fd, stream in enumerate((sys.stdin, sys.stdout, sys.stderr)):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        errors = getattr(stream, "errors", None) or "strict"
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        line_buffered = fd == 2 or (fd == 1 and os.isatty(fd))
        made.append(io.TextIOWrapper(buffered, encoding=encoding, errors=errors,
                                     line_buffering=line_buffered))  # fmt: skip
    sys.stdin, sys.stdout, sys.stderr = made
    # typeshed makes the originals Final; the interpreter lets them be set, as here.
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = made  # type: ignore[misc]


def _log(message: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}\n".encode())


# -- the commands


def _ask(kind: bytes) -> bytes | None:
    sock = warm.connect()
    if sock is None:
        return None
    try:
        warm.request(sock, [warm.PROTOCOL, kind])
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out
    except OSError:
        return None
    finally:
        sock.close()


def server_status() -> dict[str, Any]:
    reply = _ask(b"status")
    directory = warm_directory()
    if reply is None or not reply.startswith(b"{"):
        return {"running": False, "socket": os.path.join(directory, warm.SOCKET_NAME)}
    status: dict[str, Any] = json.loads(reply)
    status["usable"] = status["code_current"] and status["python"] == sys.executable
    return status


def ensure_directory(directory: str) -> int:
    """The socket directory, made 0700 when missing, opened and checked (warm.open_directory)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    return warm.open_directory(directory)


def start_server(idle_timeout: float) -> int:
    """Starts a server in the background; returns its pid once it listens."""
    from jukebox.errors import JukeboxError

    directory = warm_directory()
    try:
        dirfd = ensure_directory(directory)
    except OSError as error:
        reason = error.strerror if isinstance(error, PermissionError) else str(error)
        raise JukeboxError(f"the warm server did not start: {directory}: {reason}") from None
    base = f"/proc/self/fd/{dirfd}"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_r)
            os.setsid()
            if os.fork():
                os._exit(0)
            _daemon(directory, base, idle_timeout, ready_w)
        except BaseException as error:  # told to `warm start`, which waits
            with contextlib.suppress(Exception):
                os.write(ready_w, f"E{error}".encode())
        os._exit(code)
    os.close(ready_w)
    os.waitpid(pid, 0)
    with os.fdopen(ready_r, "rb") as ready:
        answer = ready.read()
    os.close(dirfd)
    if not answer.startswith(b"P"):
        raise JukeboxError(
            f"the warm server did not start: {answer[1:].decode(errors='replace') or 'no reason'}"
            f" (see {os.path.join(directory, LOG_NAME)})"
        )
    return int(answer[1:])


def _daemon(directory: str, base: str, idle_timeout: float, ready: int) -> None:
    lock = os.open(f"{base}/{LOCK_NAME}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o600)  # fmt: skip
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RuntimeError("another warm server runs or is starting") from None
    log = os.open(f"{base}/{LOG_NAME}", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                  0o600)  # fmt: skip
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir("/")
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for name in WARM_MODULES:
        importlib.import_module(name)
    from jukebox.cli import register_commands

    register_commands(["booth"])
    register_commands(["ls"])
    _rehearse()
    server = Server(directory, idle_timeout)
    path = f"{base}/{warm.SOCKET_NAME}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead server's: the lock says no server holds it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(64)
    import gc

    gc.collect()
    gc.freeze()  # what the children share stays shared: the collector never writes to it
    _log(f"listening (pid {os.getpid()}, idle timeout {idle_timeout:g} s)")
    os.write(ready, f"P{os.getpid()}".encode())
    os.close(ready)
    server.serve(listener)


@cli.group("warm")
def warm_group() -> None:
    """Keep a process alive that starts commands fast (opt-in).

    `jukebox warm start` starts a server with the commands' modules imported; while it runs,
    `jukebox booth run`, `replay`, `ls`, `log`, `show`, `verify`, `diff` and `du` run in a
    child it forks (stdin not a terminal only), and fall back to a normal start otherwise.
    """



@warm_group.command("start")
@click.option("--idle-timeout", type=click.FloatRange(min=1.0), default=DEFAULT_IDLE_TIMEOUT,
              show_default=True, help="Seconds without a command before the server ends.")
def start(idle_timeout: float) -> None:
    """Start this user's warm server (nothing to do when a current one runs)."""
    from jukebox.cli import echo, guarded

    def call() -> None:
        status = server_status()
        if status["running"] and status["usable"]:
            echo(f"jukebox: the warm server already runs (pid {status['pid']})")
            return
        if status["running"]:
            _ask(b"stop")  # stale: it stops listening and ends once its commands end
            time.sleep(0.05)
        pid = start_server(idle_timeout)
        echo(f"jukebox: warm server started (pid {pid}); `jukebox warm stop` ends it")

    guarded(call)


@warm_group.command("stop")
def stop() -> None:
    """Stop this user's warm server; commands it runs go on to their end."""
    from jukebox.cli import echo

    if _ask(b"stop") is None:
        echo("jukebox: no warm server runs")
        return
    echo("jukebox: warm server stopped")


@warm_group.command("status")
@json_option
def status_command(as_json: bool) -> None:
    """Whether this user's warm server runs, and what it did."""
    from jukebox.cli import echo

    status = server_status()
    if as_json:
        echo(json.dumps(status, sort_keys=True))
        return
    if not status["running"]:
        echo("warm server: not running")
        return
    echo(
        f"warm server: running, pid {status['pid']}, {status['commands_run']} commands run, "
        f"{status['commands_running']} running, {status['peers_refused']} peers refused; "
        + ("current" if status["usable"] else "stale (code changed): not used")
    )
