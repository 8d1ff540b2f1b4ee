"""The booth's control socket: checkpoint, rollback and status requested from inside a booth.

A unix stream socket whose path the agent finds in `$JUKEBOX_SOCKET`. One JSON object per line
each way:

    {"op": "checkpoint", "label": "before-refactor"}   -> {"ok": true, "checkpoint": 3, ...}
    {"op": "rollback", "to": "before-refactor"}         -> {"ok": true, ...}   (or "to": 3)
    {"op": "status"}                                     -> {"ok": true, ...}
    {"op": "mcp_record", "kind": ..., "payload": {...}}  -> {"ok": true}  (jukebox.mcp.staging)
    {"op": "mcp_stage", "server": ..., "tool": ..., ...} -> {"ok": true, "id": "stage-1"}
    {"op": "mcp_replay", "server": ..., "method": ..., "params": {...}}  (a replay's booth only)
    anything else                                        -> {"ok": false, "error": "..."}

The agent is not trusted: every request is validated, a bad one gets an error response on its
own connection and nothing else happens. One server thread serves every connection through a
selector, which also serialises the handlers (two checkpoints never race inside the layer), and
keeps a flood of connections from becoming a flood of threads. Each request carries the peer's
credentials (SO_PEERCRED) to the handler so the tape can say who asked.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeGuard

from jukebox.errors import JukeboxError
from shadowfs import sched, wakeups
from shadowfs.values import Value, setfield

SOCKET_ENV = "JUKEBOX_SOCKET"
MAX_LINE = 64 * 1024
MAX_CONNECTIONS = 64
MAX_LABEL = 200
# The control thread's scheduler slice, the shortest the kernel takes (shadowfs.sched).
CONTROL_SLICE = 0.0001
OPS = (
    "checkpoint", "rollback", "status", "mcp_record", "mcp_stage", "mcp_ask", "mcp_ask_status",
    "mcp_replay", "mcp_blob",
)  # fmt: skip
# Every server answers these; the MCP stage gate's ops only where a handler is given.
CORE_OPS = ("checkpoint", "rollback", "status")
# The keys each op allows. Built once: a request's path runs cold after the agent's pause, and
# nine sets built per request were a share of it.
ALLOWED_KEYS = {
    "checkpoint": frozenset({"op", "label"}), "rollback": frozenset({"op", "to"}),
    "status": frozenset({"op"}),
    "mcp_record": frozenset({"op", "kind", "payload"}),
    "mcp_stage": frozenset({"op", "server", "argv", "tool", "args"}),
    "mcp_ask": frozenset({"op", "server", "tool", "args"}),
    "mcp_ask_status": frozenset({"op", "id"}),
    "mcp_replay": frozenset({"op", "server", "method", "params"}),
    "mcp_blob": frozenset({"op", "id", "data"}),
}  # fmt: skip


class ControlError(JukeboxError):
    """A control request failed, or the socket could not be reached."""

    exit_code = 1


class ControlRefused(ControlError):
    """The request itself was wrong (an unknown label or checkpoint number, a malformed field),
    or there is no booth to ask: bad input, so the CLI exits 2, not 1."""

    exit_code = 2


class RequestError(JukeboxError, ValueError):
    """A request the server refuses; its message goes back to the client."""


class Peer(Value):
    __slots__ = FIELDS = ("pid", "uid", "gid")
    pid: int
    uid: int
    gid: int

    def __init__(self, pid: int, uid: int, gid: int) -> None:
        setfield(self, "pid", pid)
        setfield(self, "uid", uid)
        setfield(self, "gid", gid)

    def as_dict(self) -> dict[str, int]:
        return {"pid": self.pid, "uid": self.uid, "gid": self.gid}


# A handler takes the validated request and the peer, and returns the response's extra fields.
Handler = Callable[[dict[str, Any], Peer], dict[str, Any]]


def validate(raw: bytes) -> dict[str, Any]:
    """The request as a dict with exactly the keys its op allows, or RequestError."""
    try:
        request = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(f"request is not JSON: {error}") from None
    except RecursionError:
        # A line of 100,000 '[' once escaped as a RecursionError and killed the server thread.
        raise RequestError("request nests too deeply to be a control request") from None
    if not isinstance(request, dict):
        raise RequestError("request must be a JSON object with an 'op' key")
    op = request.get("op")
    if op not in OPS:
        raise RequestError(f"unknown op {op!r}: use one of {', '.join(OPS)}")
    allowed = ALLOWED_KEYS[op]
    if not allowed.issuperset(request):
        extra = sorted(set(request) - allowed)
        raise RequestError(f"unexpected key(s) {', '.join(map(repr, extra))} for op {op!r}")
    if op == "checkpoint":
        label = request.get("label")
        if label is not None:
            _check_label(label)
            if label.isdigit():
                raise RequestError(NUMERIC_LABEL.format(label=label))
    elif op == "rollback":
        if "to" not in request:
            raise RequestError("rollback needs 'to': a checkpoint label or number")
        to = request["to"]
        if isinstance(to, bool) or not isinstance(to, int | str):
            raise RequestError("'to' must be a checkpoint label (string) or number (integer >= 0)")
        if isinstance(to, int) and to < 0:
            raise RequestError("'to' must be a checkpoint number >= 0")
        if isinstance(to, str):
            _check_label(to)
    return request


# `rollback --to 3` and `--at 3` mean checkpoint number 3, so a label "3" could never be named.
NUMERIC_LABEL = (
    "label {label!r} is a number, which names checkpoint number {label}: give a label with a "
    "letter in it (like cp-{label})"
)


def _check_label(label: object) -> None:
    if not isinstance(label, str) or not label:
        raise RequestError("a label must be a non-empty string")
    if len(label) > MAX_LABEL or not label.isprintable():
        raise RequestError(f"a label must be printable and at most {MAX_LABEL} characters")


def peer_of(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


class _Conn:
    __slots__ = ("buf", "out", "peer", "sock")

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock = sock
        self.peer = peer
        self.buf = b""
        self.out = b""


class ControlServer:
    """Serves the control socket at `path` from one background thread until close()."""

    def __init__(self, path: str, handlers: dict[str, Handler]) -> None:
        missing = set(CORE_OPS) - set(handlers)
        if missing:
            raise ValueError(f"handlers missing for {sorted(missing)}")
        self.path = path
        self.handlers = handlers
        self.requests = 0
        self._sel = selectors.DefaultSelector()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._listener.bind(path)
        os.chmod(path, 0o600)
        self._listener.listen(MAX_CONNECTIONS)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[int, _Conn] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="jukebox-control", daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def __enter__(self) -> ControlServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._listener.close()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _serve(self) -> None:
        # This thread sleeps until the agent asks, and the agent waits for its answer: a short
        # slice lets it run at once when woken on a busy machine (shadowfs.sched).
        sched.short_slice(CONTROL_SLICE)
        while not self._stop:
            for key, events in self._sel.select():
                if key.data == "wake":
                    return
                if key.data is None:
                    self._accept()
                else:
                    conn: _Conn = key.data
                    try:
                        if events & selectors.EVENT_READ:
                            # Flushes a request scheduled are woken once it is answered.
                            with wakeups.deferred():
                                self._read(conn)
                        if events & selectors.EVENT_WRITE and conn.out:
                            self._flush(conn)
                    except OSError:
                        self._drop(conn)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self._conns) >= MAX_CONNECTIONS:
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, peer_of(sock))
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        if not data:
            self._drop(conn)
            return
        conn.buf += data
        while b"\n" in conn.buf:
            line, conn.buf = conn.buf.split(b"\n", 1)
            if line.strip():
                conn.out += self.dispatch(line, conn.peer)
        if len(conn.buf) > MAX_LINE:
            conn.out += _encode({"ok": False, "error": f"request longer than {MAX_LINE} bytes"})
            conn.buf = b""
            self._flush(conn)
            self._drop(conn)
            return
        if conn.out:
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            sent = 0
        conn.out = conn.out[sent:]
        # A client that does not read its answers is only watched for writability while it owes.
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.modify(conn.sock, want, conn)

    def dispatch(self, line: bytes, peer: Peer) -> bytes:
        """One request line to one response line; never raises."""
        self.requests += 1
        try:
            request = validate(line)
            handler = self.handlers.get(request["op"])
            if handler is None:
                raise RequestError(f"op {request['op']!r} is not served by this booth")
            result = handler(request, peer)
        except RequestError as error:  # malformed, or naming what the booth lacks (a label)
            return _encode({"ok": False, "error": str(error), "refused": True})
        except Exception as error:  # the handler failed: the agent hears why
            return _encode({"ok": False, "error": str(error) or type(error).__name__})
        return _encode({"ok": True, **result})


# One encoder for every line: `json.dumps` with options builds a JSONEncoder per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


def _encode(response: dict[str, Any]) -> bytes:
    return _ENCODER.encode(response).encode() + b"\n"


class ControlClient:
    """A connection to a booth's control socket; reusable for several requests."""

    def __init__(self, path: str | None = None, timeout: float = 30.0) -> None:
        path = path or os.environ.get(SOCKET_ENV)
        if not path:
            raise ControlRefused(
                f"${SOCKET_ENV} is not set: run this inside a booth (`jukebox booth run -- CMD`)"
            )
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError as error:
            self.sock.close()
            raise ControlError(
                f"cannot reach the booth's control socket {path} ({error.strerror}): "
                "is the booth still running?"
            ) from None
        self._buf = b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Sends one request and returns the raw response (ok true or false)."""
        try:
            self.sock.sendall(_encode(request))
            while b"\n" not in self._buf:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ControlError(
                        f"the booth closed the control socket {self.path} mid-request"
                    )
                self._buf += chunk
        except TimeoutError:
            raise ControlError(f"the booth did not answer on {self.path} in time") from None
        except OSError as error:
            raise ControlError(f"control socket {self.path} failed: {error.strerror}") from None
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


# This process's connections, by socket path. A fresh connection per request cost the booth an
# accept and a second wake-up: 130-380 µs of each checkpoint an agent asks for after a pause.
_kept: dict[str, ControlClient] = {}
_kept_lock = threading.Lock()


def _forget_kept() -> None:
    # A forked child holds copies of its parent's connections: two processes writing requests
    # into one connection would read each other's answers. Closing the copies leaves the
    # parent's connections open. The lock is new too: another thread of the parent may have
    # held it at the fork, and no thread of the child would ever let it go.
    global _kept_lock
    _kept_lock = threading.Lock()
    for client in _kept.values():
        client.close()
    _kept.clear()


os.register_at_fork(after_in_child=_forget_kept)


def _usable(client: ControlClient | None) -> TypeGuard[ControlClient]:
    """Whether a kept connection still serves: not closed by the booth meanwhile (a restarted
    booth, a dropped connection), and holding no stray bytes."""
    if client is None:
        return False
    try:
        # A zero-timeout poll: recv on a socket with a timeout would wait for data first.
        poller = select.poll()
        poller.register(client.sock, select.POLLIN)
        ready = poller.poll(0)
    except (OSError, ValueError):
        return False
    # Idle, as it should be; anything to read is the end of the stream (the booth closed it)
    # or bytes nobody asked for.
    return not ready


def request(
    request: dict[str, Any], path: str | None = None, timeout: float = 30.0
) -> dict[str, Any]:
    """One request to the booth; raises ControlError when the booth says no.

    Requests from one process share one connection per socket path, opened at the first and
    opened again when the booth has closed it; threads take turns on it (the booth serves one
    request at a time anyway)."""
    path = path or os.environ.get(SOCKET_ENV) or None
    key = path or ""
    with _kept_lock:
        client = _kept.get(key)
        if not _usable(client):
            if client is not None:
                client.close()
            _kept.pop(key, None)
            client = _kept[key] = ControlClient(path, timeout)
        client.sock.settimeout(timeout)
        try:
            response = client.call(request)
        except BaseException:
            # A failure, a garbled answer or an interrupt mid-request: whatever the booth made
            # of it, this connection is out of step now.
            client.close()
            _kept.pop(key, None)
            raise
    if not response.get("ok"):
        error = ControlRefused if response.get("refused") else ControlError
        raise error(f"the booth refused {request.get('op')}: {response.get('error')}")
    return response
