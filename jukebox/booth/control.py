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
own connection and nothing else happens. Each connection is read by a thread of its own (at
most MAX_CONNECTIONS of them), and the handlers take turns under one lock (two checkpoints never
race inside the layer). Each request carries the peer's credentials (SO_PEERCRED) to the handler
so the tape can say who asked.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping

# The C encoder's private names: typeshed does not declare them (a fallback covers their absence).
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from types import ModuleType

from jukebox.errors import JukeboxError
from jukebox.spin import runnable as _runnable
from shadowfs import sched, wakeups
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any, Protocol

_quickline: ModuleType | None
try:
    # The checkpoint line after a fold answered in C (_quickline.c), built by the install.
    from jukebox.booth import _quickline
except ImportError:  # not built (no compiler at install): the Python path serves every line
    _quickline = None
# `JUKEBOX_QUICKLINE=off`: every line served by the Python path, the compiled one's reference.
if os.environ.get("JUKEBOX_QUICKLINE") == "off":
    _quickline = None

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
Handler = Callable[[dict[str, "Any"], Peer], dict[str, "Any"]]
# A handler of one exact request line (ControlServer's `quick`), given the peer and `reply`: it
# calls `reply(fields)` once, as soon as it knows the answer, and may go on working after it
# (still holding the handlers' turn); or returns False without replying, and the plain
# handler serves the request.
QuickHandler = Callable[[Peer, Callable[[dict[str, "Any"]], None]], bool]


if TYPE_CHECKING:

    class FastCheckpoint(Protocol):
        """What the compiled path (`_quickline.serve`) needs to answer `CHECKPOINT_LINE` itself
        after a fold, and finish afterwards (the booth's `_Run`)."""

        def quick_gate(self) -> tuple[int, int, int, tuple[Any, ...]] | None:
            """(the mount's fd, its fusectl directory's fd, its connection number, (the run's
            lock, the run, the layer lock, the layer, the tape queue)), or None: not now."""

        def fast_taken(self, n: int, seq: int, tree: bytes) -> None:
            """Checkpoint ``n`` answered with frame ``seq`` and tree ``tree``, the frame queued:
            finish it (the layer's bookkeeping, the flush scheduled) under the run's lock and the
            layer lock, which the compiled path took and releases after this."""


def validate(raw: bytes) -> dict[str, Any]:
    """The request as a dict with exactly the keys its op allows, or RequestError."""
    try:
        request = _loads(raw)
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


def quickline_answers() -> int:
    """Checkpoints this process answered through the compiled path (0 without it)."""
    return 0 if _quickline is None else int(_quickline.answered())


def peer_of(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


class ControlServer:
    """Serves the control socket at `path` until close(): one thread accepts, and each
    connection has a thread of its own, blocked in `recv` on it until the agent asks.

    The agent keeps one connection (`request`) and, between its requests, waits for its model:
    its request then wakes exactly the thread that reads it, which answers from the same stack
    frame, with no event loop's dispatch in between (after a pause that code runs cold, and
    every frame on the path costs). Handlers take turns under one lock, so two checkpoints never
    race inside the layer; at most MAX_CONNECTIONS connections (and threads) are served."""

    def __init__(
        self,
        path: str,
        handlers: dict[str, Handler],
        quick: Mapping[bytes, QuickHandler] | None = None,
        fast: FastCheckpoint | None = None,
    ) -> None:
        missing = set(CORE_OPS) - set(handlers)
        if missing:
            raise ValueError(f"handlers missing for {sorted(missing)}")
        self.path = path
        self.handlers = handlers
        # Request lines answered without parsing them, by the bytes `request` sends (the
        # unlabelled checkpoint an agent asks for after each step: `CHECKPOINT_LINE`). After the
        # agent's pause every step of the plain path (framing, JSON, validation, dispatch)
        # runs from cold caches; this one is a dictionary lookup.
        self.quick: Mapping[bytes, QuickHandler] = quick or {}
        # The same line after a fold answered before any Python runs (`_quickline`), where it
        # was built; `CHECKPOINT_LINE`'s quick handler stays its fallback for any doubt.
        self.fast = fast if _quickline is not None and CHECKPOINT_LINE in self.quick else None
        self.requests = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._listener.bind(path)
        os.chmod(path, 0o600)
        self._listener.listen(MAX_CONNECTIONS)
        self._turn = threading.Lock()  # one handler at a time
        self._conns_lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
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
        # shutdown wakes a thread blocked in accept (EINVAL) or recv (end of stream).
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._conns_lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for _, thread in conns:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _serve(self) -> None:
        while not self._stop:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._stop:
                    return
                continue  # a connection reset before it was accepted, or no fd left: go on
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        """Serve an accepted connection on a thread of its own, unless too many are open."""
        with self._conns_lock:
            if self._stop or len(self._conns) >= MAX_CONNECTIONS:
                sock.close()
                return
            thread = threading.Thread(
                target=self._serve_conn, args=(sock,), name="jukebox-control-conn", daemon=True
            )
            self._conns[sock] = thread
        thread.start()

    def _serve_conn(self, sock: socket.socket) -> None:
        # This thread sleeps until the agent asks, and the agent waits for its answer: a short
        # slice lets it run at once when woken on a busy machine (shadowfs.sched).
        sched.short_slice(CONTROL_SLICE)
        try:
            peer = peer_of(sock)
            buf = b""
            fast, fields, fd = self.fast, peer.as_dict(), sock.fileno()
            # Until the end of the stream, also once close() shut it: what a client wrote
            # before is still read first (an MCP gateway's frames, written without waiting for
            # their answers by a wrapper the agent's end killed: jukebox.mcp.record.BoothSink).
            while True:
                if fast is None or _quickline is None:
                    data = sock.recv(65536)
                else:
                    gate = None if buf else fast.quick_gate()
                    if gate is not None:
                        gate = (*gate[:3], (self._turn, *gate[3]))
                    got = _quickline.serve(fd, CHECKPOINT_LINE, gate, fields)
                    if type(got) is tuple:
                        # `got` says it answered, so `gate` was given
                        if self._fast_taken(sock, fast, got, gate[3]):  # type: ignore[index]
                            continue
                        return
                    data = got
                if not data:
                    return
                quick = None if buf else self.quick.get(data)
                if quick is not None and self._answer_quick(sock, quick, peer):
                    continue
                buf += data
                if b"\n" in buf:
                    *lines, buf = buf.split(b"\n")
                    self._answer(sock, lines, peer)
                if len(buf) > MAX_LINE:
                    error = {"ok": False, "error": f"request longer than {MAX_LINE} bytes"}
                    sock.sendall(_encode(error))
                    return
        except OSError:
            return  # the agent went away mid-answer, or close() shut the connection
        finally:
            with self._conns_lock:
                self._conns.pop(sock, None)
            sock.close()

    def _answer(self, sock: socket.socket, lines: list[bytes], peer: Peer) -> None:
        """Handle complete request lines and send their answers, in order."""
        # Flushes a request scheduled are woken once it is answered (shadowfs.wakeups).
        with wakeups.deferred():
            with self._turn:
                out = b"".join([self.dispatch(line, peer) for line in lines if line.strip()])
            if self._stop:
                return  # nobody reads answers any more: close() shut the connection
            # An answer fits the socket's buffer unless the agent stopped reading: then the
            # flushes are woken before this thread waits for it (below).
            try:
                sent = sock.send(out, socket.MSG_DONTWAIT) if out else 0
            except BlockingIOError:
                sent = 0
        if sent < len(out):
            sock.sendall(out[sent:])

    def _fast_taken(
        self,
        sock: socket.socket,
        fast: FastCheckpoint,
        got: tuple[int, int, bytes, bytes, int],
        locks: tuple[Any, ...],
    ) -> bool:
        """After `_quickline.serve` answered a checkpoint, holding the gate's ``locks`` (the
        turn, the run's lock, the layer lock): its bookkeeping, the locks released, then the
        rest of the answer; whether the connection goes on (not when the agent had gone)."""
        n, seq, tree, rest, error = got
        turn, run_lock, _, layer_lock = locks[:4]
        try:
            fast.fast_taken(n, seq, tree)
        finally:
            self.requests += 1
            layer_lock.release()
            run_lock.release()
            turn.release()
        if error:
            return False
        if rest and not self._stop:
            sock.sendall(rest)
        return True

    def _answer_quick(self, sock: socket.socket, quick: QuickHandler, peer: Peer) -> bool:
        """A request line of `quick`'s: whether it served it (answered, or failed and said so)."""
        rest = b""
        answered = False

        def reply(fields: dict[str, Any]) -> None:
            nonlocal rest, answered
            answered = True
            out = _encode({"ok": True, **fields})
            if self._stop:
                return  # nobody reads answers any more: close() shut the connection
            # Under the handler's locks: never wait here for an agent that stopped reading.
            try:
                sent = sock.send(out, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            rest = out[sent:]
            # The agent's send woke this thread onto the agent's own CPU (the scheduler packs
            # a woken task onto its waker's vCPU here, even with the other one idle): the
            # agent, preempted there, reads its answer now, and the bookkeeping after it runs
            # once the agent sleeps or waits again. Quiet: 591-606 µs against 674-700.
            os.sched_yield()

        with wakeups.deferred(), self._turn:
            try:
                served = quick(peer, reply)
            except Exception as error:
                if answered:
                    raise  # after its answer: the connection ends, the agent reconnects
                failure: dict[str, Any] = {"ok": False, "error": str(error) or type(error).__name__}
                if isinstance(error, RequestError):
                    failure["refused"] = True
                rest, served = _encode(failure), True
            if served:
                self.requests += 1
        if rest and not self._stop:
            sock.sendall(rest)
        return served

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


# One encoder for every line, called directly: `json.dumps` builds a JSONEncoder per call, and
# `JSONEncoder.encode` builds its C encoder per call too, through two Python frames; after the
# agent's pause each frame and each first use of the `re` engine runs from cold caches. The
# direct encoder skips the check for circular structures, which no request or answer has.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)
try:
    _C_ENCODE = c_make_encoder(
        None, str, encode_basestring_ascii, None, ":", ",", False, False, True
    )
except TypeError:  # another interpreter's private signature, or no C accelerator
    _C_ENCODE = None


def _encode(response: dict[str, Any]) -> bytes:
    if _C_ENCODE is None:
        return _ENCODER.encode(response).encode() + b"\n"
    return "".join(_C_ENCODE(response, 0)).encode() + b"\n"


def encode_request(request: dict[str, Any]) -> bytes:
    """One request as its line on the socket."""
    return _encode(request)


# The line `request({"op": "checkpoint"})` sends: a server's `quick` handlers are keyed by it.
CHECKPOINT_LINE = encode_request({"op": "checkpoint"})


# The C scanner behind `json.loads`, without its Python frames, encoding detection and the
# regular expressions it strips whitespace with. A line it cannot take whole (whitespace around
# the value, bytes that are not UTF-8, bad JSON) goes through `json.loads`, which names the
# problem.
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _loads(raw: bytes) -> Any:
    try:
        text = raw.decode()
        value, end = _SCAN(text, 0)
        if end == len(text):
            return value
    except (StopIteration, ValueError):  # UnicodeDecodeError and JSONDecodeError among them
        pass
    # UTF-8 only, as the protocol says: json.loads would guess UTF-16 or UTF-32 from NUL bytes,
    # and then name an error in an encoding nobody sent.
    return json.loads(raw.decode())


class ControlClient:
    """A connection to a booth's control socket; reusable for several requests.

    A blocking socket whose waits the kernel bounds (SO_SNDTIMEO, SO_RCVTIMEO): a request is
    one `send` and one `recv`, where a socket with a Python timeout polls before each."""

    # Slots: the compiled client (`_quickline.ask_kept`) reads them as one load each, where
    # an instance dict's lookups ran cold after the agent's pause.
    __slots__ = ("_buf", "path", "polls", "sock", "timeout")

    def __init__(self, path: str | None = None, timeout: float = 30.0) -> None:
        path = path or os.environ.get(SOCKET_ENV)
        if not path:
            raise ControlRefused(
                f"${SOCKET_ENV} is not set: run this inside a booth (`jukebox booth run -- CMD`)"
            )
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.timeout = -1.0
        try:
            self.set_timeout(timeout)
            self.sock.connect(path)
        except OSError as error:
            self.sock.close()
            raise ControlError(
                f"cannot reach the booth's control socket {path} ({error.strerror}): "
                "is the booth still running?"
            ) from None
        self._buf = b""
        # Whether `answer` polls before it sleeps: not after a poll that ran out (a busy
        # machine, a long request), where polling again would likely only burn the CPU.
        self.polls = True

    def set_timeout(self, timeout: float) -> None:
        """The longest a request may wait for the socket (each send and each recv)."""
        if timeout != self.timeout:
            whole = int(timeout)
            tv = struct.pack("ll", whole, int((timeout - whole) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.timeout = timeout

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, request: dict[str, Any]) -> None:
        """Sends one request (`call` sends and reads its answer)."""
        self.send_line(_encode(request))

    def send_line(self, line: bytes) -> None:
        """Sends one request already encoded (`encode_request`)."""
        try:
            self.sock.sendall(line)
        except BlockingIOError:  # SO_SNDTIMEO ran out
            raise ControlError(f"the booth did not take a request on {self.path} in time") from None

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Sends one request and returns the raw response (ok true or false)."""
        try:
            self.send(request)
            return self.answer()
        except OSError as error:
            raise ControlError(f"control socket {self.path} failed: {error.strerror}") from None

    def answer(self, spin: float = 0.0) -> dict[str, Any]:
        """Reads the answer to the request sent last; polls for it for up to ``spin`` seconds
        before sleeping in `recv` (`SPIN`), unless the last poll ran out: then it sleeps at
        once, and polls again after an answer that came within ``spin``."""
        buf = self._buf
        slept_from = 0.0
        if spin and b"\n" not in buf:
            if self.polls:
                buf = self._spin(buf, spin)
                self.polls = b"\n" in buf
            else:
                slept_from = time.perf_counter()
        try:
            while b"\n" not in buf:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ControlError(
                        f"the booth closed the control socket {self.path} mid-request"
                    )
                buf += chunk
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise ControlError(f"the booth did not answer on {self.path} in time") from None
        if slept_from:
            self.polls = time.perf_counter() - slept_from <= spin
        line, self._buf = buf.split(b"\n", 1)
        answer: dict[str, Any] = _loads(line)
        return answer

    def ask_compiled(self, line: bytes, spin: float) -> dict[str, Any]:
        """`send_line(line)` then `answer(spin)`, the socket's part in C (`_quickline.ask`):
        after the agent's pause each Python frame on the way runs cold. Without the compiled
        module, or with an answer already buffered, the Python path."""
        if _quickline is None or self._buf:
            self.send_line(line)
            return self.answer(spin)
        try:
            asked = _quickline.ask(self.sock.fileno(), line, spin, self.polls, _CPUS)
        except BlockingIOError:  # SO_SNDTIMEO ran out
            raise ControlError(f"the booth did not take a request on {self.path} in time") from None
        return self.compiled_answer(asked)

    def compiled_answer(
        self, asked: tuple[dict[str, Any] | bytes, bool, int] | int
    ) -> dict[str, Any]:
        """The answer from what `_quickline.ask` returned, or from the errno of its send
        (`_quickline.ask_kept`: raised here as `ask` raises it)."""
        if isinstance(asked, int):
            if asked in (errno.EAGAIN, errno.EWOULDBLOCK):  # SO_SNDTIMEO ran out
                raise ControlError(f"the booth did not take a request on {self.path} in time")
            raise OSError(asked, os.strerror(asked))  # BrokenPipeError... by its errno
        got, self.polls, error = asked
        if isinstance(got, dict):  # a checkpoint's answer in the one shape it has, read in C
            return got
        if b"\n" not in got:
            if error == -1:
                raise ControlError(f"the booth closed the control socket {self.path} mid-request")
            if error in (errno.EAGAIN, errno.EWOULDBLOCK):  # SO_RCVTIMEO ran out
                raise ControlError(f"the booth did not answer on {self.path} in time")
            if error:
                # Not an OSError: one of `request`'s _GONE would send the request again.
                raise ControlError(f"control socket {self.path} failed: {os.strerror(error)}")
            self._buf = got  # longer than the compiled read's buffer: read on here
            return self.answer()
        line, self._buf = got.split(b"\n", 1)
        answer: dict[str, Any] = _loads(line)
        return answer

    def _spin(self, buf: bytes, spin: float) -> bytes:
        """What arrives within ``spin`` seconds, read without sleeping: until a whole line is
        in, the stream ends or the time is up (the caller's `recv` then waits as usual)."""
        sock, clock = self.sock, time.perf_counter
        until = clock() + spin
        looked = False
        while True:
            try:
                chunk = sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if not looked:
                    # Looked at while the booth works, so it costs no time: with more tasks
                    # runnable than CPUs, no CPU goes idle (nothing to save) and the poll would
                    # hold one that other work is waiting for.
                    looked = True
                    if _runnable() > _CPUS:
                        return buf
                if clock() > until:
                    return buf
                # The booth's thread may have been woken onto this CPU (no other was idle):
                # it runs now, not once this poll's slice ends. Another process's task here
                # would take the CPU for its slice, but then more tasks are runnable than
                # CPUs, and the poll has stopped already.
                os.sched_yield()
                continue
            if not chunk:
                return buf  # the end of the stream: the caller's `recv` says so
            buf += chunk
            if b"\n" in buf:
                return buf


# How long `request` polls for the answer to a request the booth answers itself (SPUN_OPS)
# before it sleeps in `recv`. A caller asleep in `recv` leaves its CPU idle, and on a virtual
# machine an idle CPU halts: the answer then waits for that CPU to be woken (an interrupt
# through the host) and for the caller's cold code; polling keeps the CPU awake for the few
# hundred microseconds a checkpoint takes (only where a CPU would go idle: not while more tasks
# are runnable than there are CPUs), and the booth's reading of the request no longer
# wakes the caller for nothing (the kernel wakes a unix socket's sleeping writer once its bytes
# are read). It costs at most SPIN of this process's CPU per request, and nothing once the
# answer is in; a longer request (a checkpoint of many files) then sleeps as before, and the
# connection's next requests sleep at once until an answer comes within SPIN again.
SPIN = 0.002
SPUN_OPS = frozenset({"checkpoint", "rollback", "status"})
_CPUS = os.cpu_count() or 1


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

# What `send` on a kept connection raises when the booth had closed it (a restarted booth, a
# dropped connection): the request never reached a booth, so it is sent again on a new one.
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionRefusedError)


# The request an agent sends after each step (`request`'s compiled branch).
_CHECKPOINT = {"op": "checkpoint"}


def request(
    request: dict[str, Any], path: str | None = None, timeout: float = 30.0
) -> dict[str, Any]:
    """One request to the booth; raises ControlError when the booth says no.

    Requests from one process share one connection per socket path, opened at the first and
    opened again when the booth has closed it; threads take turns on it (the booth serves one
    request at a time anyway)."""
    # The unlabelled checkpoint an agent asks for after each step, on the connection kept for
    # $JUKEBOX_SOCKET: from here to the answer in one C call (`_quickline.ask_kept`), since
    # after the agent's pause each bytecode before the send runs from cold caches
    # (`os.environ.get` alone took 37 µs). None: nothing sent, the path below serves it.
    if request == _CHECKPOINT and path is None and timeout == 30.0 and _quickline is not None:
        with _kept_lock:
            asked = _quickline.ask_kept(_kept, CHECKPOINT_LINE, 30.0, SPIN, _CPUS)
            if type(asked) is dict:
                return asked
            if asked is not None:
                return _request_kept(request, asked[0], timeout, asked[1:])
    with _kept_lock:
        return _request_kept(request, path or os.environ.get(SOCKET_ENV) or None, timeout)


def _request_kept(
    request: dict[str, Any],
    path: str | None,
    timeout: float,
    asked: tuple[ControlClient, tuple[dict[str, Any] | bytes, bool, int] | int] | None = None,
) -> dict[str, Any]:
    """`request` under `_kept_lock`. ``asked``: `_quickline.ask_kept` sent the checkpoint on
    ``path``'s kept client, and what it returned is this client and its answer to finish."""
    key = path or ""
    op = request.get("op")
    # The unlabelled checkpoint an agent asks for after each step is sent as the line it always
    # is: after the agent's pause every step before the send runs from cold caches.
    line = CHECKPOINT_LINE if op == "checkpoint" and len(request) == 1 else _encode(request)
    client = _kept.get(key) if asked is None else asked[0]
    try:
        response = None
        if client is not None:
            try:
                if asked is not None:
                    response = client.compiled_answer(asked[1])
                else:
                    if timeout != client.timeout:
                        client.set_timeout(timeout)
                    if line is CHECKPOINT_LINE:
                        response = client.ask_compiled(line, SPIN)
                    else:
                        client.send_line(line)
            except _GONE:  # raised by the send: the booth never had the request
                client.close()
                client = None
        if client is None:
            client = _kept[key] = ControlClient(path, timeout)
            client.send_line(line)
        if response is None:
            response = client.answer(SPIN if op in SPUN_OPS else 0.0)
    except BaseException as failure:
        # A failure, a garbled answer or an interrupt mid-request: whatever the booth made
        # of it, this connection is out of step now.
        if client is not None:
            client.close()
        _kept.pop(key, None)
        if isinstance(failure, OSError):
            where = client.path if client is not None else path
            raise ControlError(f"control socket {where} failed: {failure.strerror}") from None
        raise
    if not response.get("ok"):
        error = ControlRefused if response.get("refused") else ControlError
        raise error(f"the booth refused {request.get('op')}: {response.get('error')}")
    return response


# The plain checkpoint compiled from the agent's own call on, where the module is built
# (`_quickline.quick_request`): after the agent's pause, `request`'s bytecodes, its `with
# _kept_lock` and its global lookups were most of what ran before `ask_kept`. The function
# above serves every other call, and is the reference (`request.__wrapped__`). A module built
# from an older _quickline.c (an editable tree not rebuilt yet: `make` rebuilds it) has no
# `quick_request`, and the function serves every call.
if _quickline is not None and hasattr(_quickline, "quick_request"):
    request = _quickline.quick_request(request, globals(), _kept, CHECKPOINT_LINE)
