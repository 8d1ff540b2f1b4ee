"""What an MCP call becomes on a tape, and where that goes.

A call is a `tool_call` frame: `server`, `tool`, `args`, `result` (the server's `content`,
`structuredContent` and `isError`, as on the wire), `error` (a protocol error or a timeout),
`latency_ms`, `decision` and `why` (jukebox.mcp.policy), `ok`, and `staged_id` for a staged call.
Lists (tools, resources, resource templates, prompts), resource reads and prompt gets are `note`
frames with `event: mcp_list` / `mcp_read` / `mcp_prompt`, so a replay can answer them. A request
the server made of the agent outside a relayed call is a note `event: mcp_asked` (`method`,
`params`, `answer`: jukebox.mcp.back_channel).

Known secret values (the wrapper's secret-looking environment variables) are replaced by
`[REDACTED]` in every payload before it leaves this module.

Two sinks: `TapeSink` writes a tape of the gateway's own (outside a booth); `BoothSink` hands each
frame to the booth's supervisor over the control socket (inside one, where the tape dir is
hidden), and asks it to stage calls.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from jukebox.redact import Scrubber, is_secret_env_name, redact_argv

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any, Protocol

FRAME_KINDS = ("tool_call", "note")
SYNC_EVERY = 1.0
NOTE_EVENTS = ("mcp_list", "mcp_read", "mcp_prompt", "mcp_server", "mcp_asked")
ASK_POLL = 0.2
# Set by the booth of a replay or fork: its gateways ask the supervisor for the recorded answers.
REPLAY_ENV = "JUKEBOX_MCP_REPLAY"


def wire(model: Any) -> Any:
    """An SDK model as the JSON the protocol carries (camelCase keys, no nulls)."""
    if hasattr(model, "model_dump"):
        return model.model_dump(by_alias=True, mode="json", exclude_none=True)
    return model


def env_scrubber(environ: Mapping[str, str]) -> Scrubber:
    return Scrubber(v for k, v in environ.items() if is_secret_env_name(k))


def scrub(payload: dict[str, Any], scrubber: Scrubber) -> dict[str, Any]:
    if not scrubber.count:
        return payload
    # JSON escapes nothing in a secret made of printable ASCII, so replacing in the text is exact.
    return json.loads(scrubber.text(json.dumps(payload)))


if TYPE_CHECKING:

    class Sink(Protocol):
        def record(self, kind: str, payload: dict[str, Any]) -> None: ...

        def close(self) -> None: ...


class TapeSink:
    """A tape of the gateway's own in the tape dir, one per `jukebox mcp wrap` run."""

    def __init__(self, tape_dir: str | os.PathLike[str] | None, server: str, argv: list[str],
                 policy: dict[str, Any], scrubber: Scrubber,
                 tape_id: str | None = None) -> None:  # fmt: skip
        from jukebox.tape.tape import TapeWriter
        from jukebox.tape.tapedir import TapeDir, check_tape_id, make_tape_dir
        from shadowfs.store import Store

        tapes = TapeDir(Path(os.path.realpath(TapeDir.resolve(tape_dir).path)))
        make_tape_dir(tapes.path)
        self.tape_id = check_tape_id(tape_id) if tape_id else _new_tape_id(server)
        self.path = tapes.tape_path(self.tape_id)
        self.store = Store.open(tapes.store_path, create=True)
        self.scrubber = scrubber
        # Each frame is one write(2): a killed gateway loses nothing. The fdatasync that makes
        # frames survive a power loss runs at most every SYNC_EVERY seconds and at the end, not
        # per call: it was most of what the gateway added to a call (8 ms of 10, measured).
        self.writer = TapeWriter.create(self.path, self.store, self.tape_id, fsync=False)
        self._synced = time.monotonic()
        self.writer.append(
            "run_start",
            {
                "tape_id": self.tape_id,
                "name": f"mcp:{server}",
                "argv": redact_argv(argv, scrubber),
                "cwd": os.getcwd(),
                "mcp": {"server": server, "gateway": "stdio"},
                "policy": {"mcp": policy},
            },
        )

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        payload = {k: wire(v) for k, v in payload.items()}
        self.writer.append(kind, scrub(payload, self.scrubber))
        if time.monotonic() - self._synced >= SYNC_EVERY:
            self._sync()

    def _sync(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        self._synced = time.monotonic()

    def close(self) -> None:
        # The gateway's run ends when its agent closes the connection: `jukebox ls` says EXITED.
        self.writer.append("exit", {"code": 0, "reason": "the agent closed the connection"})
        self._sync()
        self.writer.close()
        self.store.close()


def _new_tape_id(server: str) -> str:
    import re

    safe = re.sub(r"[^a-z0-9-]", "-", server.lower())[:24].strip("-") or "server"
    return f"mcp-{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"


# A control request is one line of at most jukebox.booth.control.MAX_LINE bytes: a result bigger
# than this goes to the supervisor in pieces first (`mcp_blob`), and the frame names it.
BOOTH_RESULT_LIMIT = 48 * 1024
# Characters per piece: JSON escapes a character in at most 6 bytes (\uXXXX), so a piece's
# request stays under the control socket's line limit whatever the result holds.
BLOB_PIECE = 8 * 1024
# The largest result the supervisor takes whole; a bigger one is recorded by size and hash only.
MAX_BLOB = 64 * 1024 * 1024


def blob_ref(text: str) -> dict[str, Any]:
    from blake3 import blake3

    data = text.encode()
    return {"bytes": len(data), "blake3": blake3(data).hexdigest()}


class BoothSink:
    """Inside a booth: frames go to the supervisor over the control socket ($JUKEBOX_SOCKET),
    which appends them to the booth's tape; staged calls are held there too.

    Every request goes on one connection of its own (_Link), in order. A frame is written to it
    before the agent has its answer, without waiting for the supervisor's: once written it is in
    the socket, which outlives this process (an agent that exits at once ends the booth, and
    the booth's end kills this process), and the supervisor reads what its socket still holds
    before it ends the booth (jukebox.booth.control.ControlServer.close). A stage or an ask
    waits for its answer, after every frame written before it."""

    def __init__(self, argv: list[str], scrubber: Scrubber, socket_path: str | None = None) -> None:
        self.argv = argv
        self.scrubber = scrubber
        self.socket_path = socket_path
        self._link: _Link | None = None

    def _connected(self) -> _Link:
        if self._link is None:
            self._link = _Link(self.socket_path)
        return self._link

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        from jukebox.booth.control import encode_request

        payload = {k: wire(v) for k, v in payload.items()}
        line = encode_request({"op": "mcp_record", "kind": kind, "payload": payload})
        if self.scrubber.count:
            # JSON escapes nothing in a secret made of printable ASCII: replacing in the text
            # is exact (as `scrub` does).
            line = self.scrubber.text(line.decode()).encode()
        if len(line) > BOOTH_RESULT_LIMIT:
            payload = self._fit(scrub(payload, self.scrubber))
            line = encode_request({"op": "mcp_record", "kind": kind, "payload": payload})
        self._connected().send(line)

    def _fit(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A result too big for one control line is sent in pieces, then named by the frame
        (`{"blob": ID, "bytes": N, "blake3": H}`), and the supervisor records it whole; past
        MAX_BLOB, or when the supervisor refuses it, only its size and hash are recorded."""
        from jukebox.booth import control

        value = payload.get("result")
        if value is None:
            return payload
        text = json.dumps(value, separators=(",", ":"))
        if len(text) <= BOOTH_RESULT_LIMIT:
            return payload
        ref = blob_ref(text)
        if ref["bytes"] <= MAX_BLOB:
            blob = os.urandom(8).hex()
            try:
                for at in range(0, len(text), BLOB_PIECE):
                    piece = text[at : at + BLOB_PIECE]
                    self._connected().call({"op": "mcp_blob", "id": blob, "data": piece})
                return {**payload, "result": {"blob": blob, **ref}}
            except control.ControlRefused:
                pass  # too much held at once: the size and the hash, as for a huge one
        return {**payload, "result": {"truncated": True, **ref}}

    def stage(self, server: str, tool: str, args: dict[str, Any]) -> str:
        answer = self._connected().call(
            {"op": "mcp_stage", "server": server, "argv": self.argv, "tool": tool, "args": args}
        )
        return str(answer["id"])

    def ask(self, server: str, tool: str, args: dict[str, Any], wait: float) -> str:
        """Asks the operator through the booth; "approve", or "deny" (also when no answer came
        within `wait` seconds)."""
        link = self._connected()
        asked = link.call({"op": "mcp_ask", "server": server, "tool": tool, "args": args})
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            answer = link.call({"op": "mcp_ask_status", "id": asked["id"]}).get("answer")
            if answer is not None:
                return str(answer)
            time.sleep(ASK_POLL)
        return "deny"

    def close(self) -> None:
        if self._link is not None:
            self._link.close()


class _Link:
    """One connection to the booth's control socket, its requests answered in order: a frame
    is sent without waiting for its answer (read later, and said on stderr if it was a
    refusal: a booth whose breaker tripped, which stops the agent itself); a request that
    needs its answer reads past those first. Threads take turns on it (the gateway's loop
    records, its worker threads stage and ask)."""

    def __init__(self, path: str | None) -> None:
        import select
        import threading

        from jukebox.booth.control import ControlClient

        self.client = ControlClient(path)
        self._poller = select.poll()
        self._poller.register(self.client.sock, select.POLLIN)
        self.owed = 0  # answers to frames not read yet
        self.lock = threading.Lock()
        self._buf = b""
        self._said = False

    def send(self, line: bytes) -> None:
        with self.lock:
            try:
                self.client.sock.sendall(line)
            except OSError as error:  # the booth is gone: it ends this process anyway
                self._say(f"a frame was not recorded: {error.strerror or error}")
                return
            self.owed += 1
            # The answers already there, without waiting for one.
            while self.owed and self._poller.poll(0):
                try:
                    chunk = self.client.sock.recv(65536)
                except OSError:
                    chunk = None
                if not chunk:
                    break
                self._buf += chunk
                self._settle()

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Sends `request` and returns its answer; raises as jukebox.booth.control.request."""
        from jukebox.booth import control

        with self.lock:
            try:
                self.client.sock.sendall(control.encode_request(request))
                while True:
                    self._settle()
                    if not self.owed and b"\n" in self._buf:
                        break
                    chunk = self.client.sock.recv(65536)
                    if not chunk:
                        raise control.ControlError(
                            f"the booth closed the control socket {self.client.path} mid-request"
                        )
                    self._buf += chunk
            except (TimeoutError, BlockingIOError):  # the socket's timeout ran out
                raise control.ControlError(
                    f"the booth did not answer on {self.client.path} in time"
                ) from None
            except OSError as error:
                raise control.ControlError(
                    f"control socket {self.client.path} failed: {error.strerror}"
                ) from None
            line, self._buf = self._buf.split(b"\n", 1)
        response = json.loads(line)
        if not response.get("ok"):
            error_type = control.ControlRefused if response.get("refused") else control.ControlError
            raise error_type(f"the booth refused {request.get('op')}: {response.get('error')}")
        return response

    def _settle(self) -> None:
        """Reads the frames' answers in the buffer; a refusal is said once."""
        while self.owed and b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self.owed -= 1
            if b'"ok":true' not in line:
                try:
                    error = json.loads(line).get("error")
                except ValueError:
                    error = line.decode(errors="replace")
                self._say(f"a frame was not recorded: the booth refused it: {error}")

    def _say(self, message: str) -> None:
        if not self._said:
            self._said = True
            _say(message)

    def close(self) -> None:
        self.client.close()


class DeferredSink:
    """Frames written after the agent has its answer: `record` queues the frame and returns, and
    one thread hands the frames, in their order, to the sink behind (a tape write, or a
    control-socket round trip to the booth's supervisor). Requests that need an answer (stage,
    ask) go through the same thread, after every frame queued before them, so the booth sees
    everything in the order it happened.

    A frame's values may still be SDK models: they are turned into JSON on that thread, not on
    the agent's path. A frame the sink behind refuses (a booth whose breaker tripped) is said on
    stderr in one line; the booth stops the agent itself."""

    def __init__(self, inner: Any) -> None:
        import queue
        import threading

        self.inner = inner
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._said = False
        self._thread = threading.Thread(target=self._work, name="jukebox-mcp-frames", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, done = item
            try:
                value = fn(*args)
            except BaseException as error:  # handed to the waiting caller, or said once
                if done is not None:
                    done.append(error)
                    done.event.set()
                elif not self._said:
                    self._said = True
                    _say(f"a frame was not recorded: {error}")
                continue
            if done is not None:
                done.append(value)
                done.event.set()

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        self._queue.put((self._record, (kind, payload), None))

    def _record(self, kind: str, payload: dict[str, Any]) -> None:
        self.inner.record(kind, {k: wire(v) for k, v in payload.items()})

    def call(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the frames' thread, after the frames queued before; its value."""
        import threading

        done = _Done()
        done.event = threading.Event()
        self._queue.put((fn, args, done))
        done.event.wait()
        if isinstance(done[0], BaseException):
            raise done[0]
        return done[0]

    def flush(self) -> None:
        self.call(lambda: None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.inner.close()


class _Done(list["Any"]):
    event: Any


def _say(message: str) -> None:
    import sys

    sys.stderr.write(f"jukebox: {message}\n")
    sys.stderr.flush()
