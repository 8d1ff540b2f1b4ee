"""The control socket: round trips, peer credentials, and hostile input that must not hurt it."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from jukebox.booth import control
from jukebox.booth.control import ControlClient, ControlError, ControlRefused, ControlServer, Peer
from tests.conftest import slow


class Booth:
    """Handlers with real state: a list of checkpoints and a current position."""

    def __init__(self) -> None:
        self.checkpoints: list[str | None] = ["start"]
        self.at = 0
        self.peers: list[Peer] = []
        self.lock = threading.Lock()

    def checkpoint(self, req: dict, peer: Peer) -> dict:
        if req.get("label") == "disk-full":
            raise OSError("No space left on device")  # a failure, not a wrong request
        with self.lock:
            self.peers.append(peer)
            self.checkpoints.append(req.get("label"))
            self.at = len(self.checkpoints) - 1
            return {"checkpoint": self.at, "label": req.get("label")}

    def rollback(self, req: dict, peer: Peer) -> dict:
        to = req["to"]
        if isinstance(to, str):
            if to not in self.checkpoints:
                raise control.RequestError(f"no checkpoint labelled {to!r}")
            to = len(self.checkpoints) - 1 - self.checkpoints[::-1].index(to)
        if to >= len(self.checkpoints):
            raise control.RequestError(f"no checkpoint {to}")
        self.at = to
        return {"checkpoint": to}

    def status(self, req: dict, peer: Peer) -> dict:
        return {"at": self.at, "count": len(self.checkpoints), "peer": peer.as_dict()}

    def handlers(self) -> dict:
        return {"checkpoint": self.checkpoint, "rollback": self.rollback, "status": self.status}


@pytest.fixture
def served(tmp_path: Path):
    booth = Booth()
    path = str(tmp_path / "c.sock")
    with ControlServer(path, booth.handlers()) as server:
        yield booth, path, server


def test_round_trips(served) -> None:
    booth, path, _ = served
    assert control.request({"op": "checkpoint", "label": "one"}, path)["checkpoint"] == 1
    assert control.request({"op": "checkpoint"}, path)["checkpoint"] == 2
    assert control.request({"op": "rollback", "to": "one"}, path)["checkpoint"] == 1
    assert control.request({"op": "rollback", "to": 0}, path)["checkpoint"] == 0
    status = control.request({"op": "status"}, path)
    assert status["ok"] is True and status["at"] == 0 and status["count"] == 3
    me = Peer(os.getpid(), os.getuid(), os.getgid())
    assert status["peer"] == me.as_dict()
    assert booth.peers == [me, me]


def _sched_field(tid: int, name: str) -> int | None:
    """A field of the kernel's per-thread scheduler report (CONFIG_SCHED_DEBUG kernels)."""
    try:
        text = Path(f"/proc/self/task/{tid}/sched").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return int(value)
    return None


def test_the_control_thread_asks_for_a_short_slice_and_keeps_its_nice_value(served) -> None:
    # Woken by the agent on a busy machine, it should preempt what runs instead of waiting for
    # a slice to end (shadowfs.sched); its share of the CPU (nice) stays what the user chose.
    _, path, server = served
    control.request({"op": "status"}, path)  # the thread is serving, past its set-up
    (thread,) = server._conns.values()  # the thread that reads this process's connection
    tid = thread.native_id
    assert tid is not None
    major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    if _sched_field(tid, "se.slice") is None or (major, minor) < (6, 12):
        pytest.skip("no per-thread slice here (a kernel before 6.12, or no scheduler report)")
    assert _sched_field(tid, "se.slice") == int(control.CONTROL_SLICE * 1e9)
    assert os.getpriority(os.PRIO_PROCESS, tid) == os.getpriority(os.PRIO_PROCESS, 0)


def test_handler_refusal_becomes_an_error_response(served) -> None:
    _, path, _ = served
    with pytest.raises(ControlRefused, match="no checkpoint labelled 'nope'") as refused:
        control.request({"op": "rollback", "to": "nope"}, path)
    assert refused.value.exit_code == 2  # bad input, as the CLI reports it
    with ControlClient(path) as client:
        assert client.call({"op": "rollback", "to": 99}) == {
            "ok": False,
            "error": "no checkpoint 99",
            "refused": True,
        }
        assert client.call({"op": "status"})["ok"] is True  # same connection still served


def test_a_handler_that_fails_is_an_error_not_a_refusal(served) -> None:
    _, path, _ = served
    with pytest.raises(ControlError, match="No space left on device") as failed:
        control.request({"op": "checkpoint", "label": "disk-full"}, path)
    assert not isinstance(failed.value, ControlRefused) and failed.value.exit_code == 1
    with ControlClient(path) as client:
        response = client.call({"op": "checkpoint", "label": "disk-full"})
    assert response == {"ok": False, "error": "No space left on device"}


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"op": "format-disk"}', "unknown op"),
        (b'{"op": 7}', "unknown op"),
        (b'{"op": "status", "x": 1}', "unexpected key"),
        (b'{"op": "rollback"}', "needs 'to'"),
        (b'{"op": "rollback", "to": true}', "'to' must be"),
        (b'{"op": "rollback", "to": -1}', ">= 0"),
        (b'{"op": "rollback", "to": [1]}', "'to' must be"),
        (b'{"op": "checkpoint", "label": ""}', "non-empty"),
        (b'{"op": "checkpoint", "label": "a\\nb"}', "printable"),
        (b'{"op": "checkpoint", "label": 3}', "non-empty string"),
        (b"\xff\xfe", "not JSON: 'utf-8' codec can't decode"),
        # NUL bytes are not read as UTF-32: the error is about the JSON that was sent
        (b"\0" * 19, "not JSON: Expecting value: line 1 column 1"),
    ],
)
def test_malformed_requests(served, line: bytes, error: str) -> None:
    booth, path, _ = served
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(line + b"\n")
        response = json.loads(s.makefile("rb").readline())
    assert response["ok"] is False and error in response["error"] and response["refused"] is True
    assert booth.checkpoints == ["start"]  # nothing happened
    assert control.request({"op": "status"}, path)["ok"]


def test_oversized_and_abandoned_connections_do_not_kill_the_server(served) -> None:
    _, path, _server = served
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b"x" * (control.MAX_LINE + 10))
        response = json.loads(s.makefile("rb").readline())
    assert "longer than" in response["error"]
    for _ in range(5):  # connect and vanish, or vanish mid-line
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(b'{"op": "sta')
        s.close()
    results = []

    def ask() -> None:
        results.append(control.request({"op": "checkpoint", "label": "t"}, path)["checkpoint"])

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(1, 9))  # serialised: every checkpoint got its own number


def test_pipelined_requests_on_one_connection(served) -> None:
    _, path, _ = served
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b'{"op":"checkpoint","label":"a"}\n{"op":"checkpoint"}\n{"op":"status"}\n')
        f = s.makefile("rb")
        answers = [json.loads(f.readline()) for _ in range(3)]
    assert [a.get("checkpoint") for a in answers[:2]] == [1, 2] and answers[2]["count"] == 3


def test_an_answer_waits_for_a_client_that_stopped_reading(tmp_path: Path) -> None:
    # The agent's end is full (it has not read for a while): the answer waits for it, and the
    # connection stays, instead of failing the send that must not block.
    server = ControlServer(str(tmp_path / "c.sock"), Booth().handlers())
    ours, agent = socket.socketpair()
    try:
        ours.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                ours.send(b"x" * 4096)
        ours.setblocking(True)
        failed: list[BaseException] = []

        def answer() -> None:
            try:
                server._answer(ours, [b'{"op": "status"}'], Peer(1, 0, 0))
            except BaseException as error:  # reported below
                failed.append(error)

        thread = threading.Thread(target=answer)
        thread.start()
        agent.settimeout(slow(10))
        got = b""
        with contextlib.suppress(TimeoutError):
            while not got.endswith(b"\n"):
                got += agent.recv(65536).lstrip(b"x")
        thread.join(slow(10))
        assert not failed, failed
        assert json.loads(got)["ok"] is True
    finally:
        ours.close()
        agent.close()
        server.close()


def test_requests_from_one_process_share_a_connection_and_reopen_it_when_the_booth_drops_it(
    tmp_path: Path,
) -> None:
    booth = Booth()
    path = str(tmp_path / "kept.sock")
    accepted: list[int] = []
    with ControlServer(path, booth.handlers()) as server:
        admit = server._admit

        def counting_admit(sock: socket.socket) -> None:
            accepted.append(1)
            admit(sock)

        server._admit = counting_admit  # type: ignore[method-assign]
        for _ in range(3):
            assert control.request({"op": "status"}, path)["ok"]
        assert len(accepted) == 1
    # A new booth on the same path: the kept connection is dead, and the next request opens
    # another instead of failing or hanging.
    with ControlServer(path, booth.handlers()) as server:
        assert control.request({"op": "checkpoint", "label": "after"}, path)["checkpoint"] >= 1
        # A forked child asks over its own connection, with its own credentials.
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                answer = control.request({"op": "status"}, path)
                os.write(write_end, json.dumps(answer["peer"]).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        child_peer = json.loads(os.read(read_end, 4096))
        os.close(read_end)
        os.waitpid(pid, 0)
        assert child_peer["pid"] == pid
        assert control.request({"op": "status"}, path)["peer"]["pid"] == os.getpid()


def test_a_child_forked_while_a_thread_waits_on_the_booth_can_still_ask(tmp_path: Path) -> None:
    booth = Booth()
    release = threading.Event()
    handlers = booth.handlers()
    plain_status = handlers["status"]

    def slow_status(req: dict, peer: Peer) -> dict:
        release.wait(slow(10))
        return plain_status(req, peer)

    handlers["status"] = slow_status
    path = str(tmp_path / "fork.sock")
    with ControlServer(path, handlers):
        waiting = threading.Thread(target=control.request, args=({"op": "status"}, path))
        waiting.start()  # holds this process's connection until the booth answers
        deadline = time.monotonic() + slow(10)
        while control._kept_lock.acquire(blocking=False):
            control._kept_lock.release()  # not taken yet: the thread is still on its way
            assert time.monotonic() < deadline
            time.sleep(0.001)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                answer = control.request(
                    {"op": "checkpoint", "label": "child"}, path, timeout=slow(10)
                )
                os.write(write_end, str(answer["checkpoint"]).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        release.set()
        ready, _, _ = select.select([read_end], [], [], 10)
        got = os.read(read_end, 64) if ready else b""
        os.close(read_end)
        if not got:
            os.kill(pid, signal.SIGKILL)  # stuck on a lock no thread of it will let go
        os.waitpid(pid, 0)
        waiting.join()
    assert got == b"1", "the forked child could not ask the booth"


def test_client_errors_name_the_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(control.SOCKET_ENV, raising=False)
    with pytest.raises(ControlRefused, match="JUKEBOX_SOCKET is not set"):
        control.request({"op": "status"})
    with pytest.raises(ControlError, match="is the booth still running"):
        control.request({"op": "status"}, str(tmp_path / "gone.sock"))


def test_socket_is_private_and_removed_on_close(tmp_path: Path) -> None:
    path = tmp_path / "c.sock"
    server = ControlServer(str(path), Booth().handlers()).start()
    assert (path.stat().st_mode & 0o777) == 0o600
    server.close()
    assert not path.exists()


class Quick:
    """A quick checkpoint handler (ControlServer's `quick`) that replies, then finishes its
    work only once the test lets it: the agent must have its answer before that."""

    def __init__(self, serve: bool = True, fail: Exception | None = None) -> None:
        self.serve = serve
        self.fail = fail
        self.finish = threading.Event()
        self.finished = False
        self.peers: list[Peer] = []

    def __call__(self, peer: Peer, reply) -> bool:
        if self.fail is not None:
            raise self.fail
        if not self.serve:
            return False
        self.peers.append(peer)
        reply({"checkpoint": 7, "label": None})
        assert self.finish.wait(slow(10)), "the test never saw the answer"
        self.finished = True
        return True


def test_the_checkpoint_line_is_answered_before_its_handler_finishes(tmp_path: Path) -> None:
    booth, quick = Booth(), Quick()
    path = str(tmp_path / "c.sock")
    with ControlServer(path, booth.handlers(), quick={control.CHECKPOINT_LINE: quick}) as server:
        assert control.encode_request({"op": "checkpoint"}) == control.CHECKPOINT_LINE
        answer = control.request({"op": "checkpoint"}, path, timeout=slow(5))
        assert answer == {"ok": True, "checkpoint": 7, "label": None}
        assert not quick.finished, "answered while its handler still worked"
        quick.finish.set()
        # The handler's turn ends once it finishes; the next request waits for that.
        assert control.request({"op": "status"}, path)["count"] == 1
        assert quick.finished and server.requests == 2
        assert quick.peers == [Peer(os.getpid(), os.getuid(), os.getgid())]
        # A label is another line: the plain handler takes it.
        assert control.request({"op": "checkpoint", "label": "x"}, path)["checkpoint"] == 1
    assert booth.checkpoints == ["start", "x"]


def test_a_quick_handler_that_declines_or_fails(tmp_path: Path) -> None:
    booth = Booth()
    path = str(tmp_path / "c.sock")
    declines = Quick(serve=False)
    with ControlServer(path, booth.handlers(), quick={control.CHECKPOINT_LINE: declines}):
        assert control.request({"op": "checkpoint"}, path)["checkpoint"] == 1  # the plain one
    failures = ((OSError("disk gone"), ControlError), (control.RequestError("no"), ControlRefused))
    for fail, error in failures:
        quick = {control.CHECKPOINT_LINE: Quick(fail=fail)}
        with ControlServer(path, booth.handlers(), quick=quick):
            with pytest.raises(error, match=str(fail)):
                control.request({"op": "checkpoint"}, path)
            assert control.request({"op": "status"}, path)["count"] == 2  # the server goes on
    assert booth.checkpoints == ["start", None]


def _asleep_in_recv(tid: int) -> bool:
    """Whether a thread of this process sleeps reading a unix socket (not, say, waiting for
    the interpreter lock, which a polling thread does too)."""
    return "unix_stream" in Path(f"/proc/self/task/{tid}/wchan").read_text()


def _asking(results: list, request: dict, path: str) -> threading.Thread:
    """A thread sending `request` to the booth at `path`, its answer put in `results`."""
    caller = threading.Thread(
        target=lambda: results.append(control.request(request, path)), daemon=True
    )
    caller.start()
    return caller


def _until_asleep_in_recv(caller: threading.Thread, otherwise: str) -> None:
    deadline = time.monotonic() + slow(10)
    while not _asleep_in_recv(caller.native_id or 0):
        assert time.monotonic() < deadline, otherwise
        time.sleep(0.001)


def _raw_booth(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    return listener


def test_the_answer_is_polled_for_in_pieces_and_the_end_of_the_stream_seen_while_polling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A poll long enough that the whole exchange happens inside it: a poll that missed the
    # answer's second piece or the end of the stream would keep the caller for a minute. The
    # machine as idle, whatever other tests run meanwhile.
    monkeypatch.setattr(control, "SPIN", 60.0)
    monkeypatch.setattr(control, "_runnable", lambda: 1)
    path = str(tmp_path / "raw.sock")
    listener = _raw_booth(path)
    results: list[object] = []

    def agent() -> None:
        results.append(control.request({"op": "status"}, path))
        try:
            control.request({"op": "checkpoint"}, path)
        except ControlError as error:
            results.append(error)

    caller = threading.Thread(target=agent, daemon=True)
    caller.start()
    conn, _ = listener.accept()
    with conn:
        assert conn.recv(100) == b'{"op":"status"}\n'
        conn.sendall(b'{"ok":true,"pie')
        conn.sendall(b'ces":2}\n')
        assert conn.recv(100) == control.CHECKPOINT_LINE  # sent as the line it always is
    caller.join(slow(10))
    listener.close()
    assert not caller.is_alive(), "the poll missed the end of the stream"
    assert results[0] == {"ok": True, "pieces": 2}
    assert isinstance(results[1], ControlError) and "mid-request" in str(results[1])


def test_an_answer_later_than_the_poll_is_waited_for_asleep_and_the_next_one_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control, "SPIN", 0.001)
    monkeypatch.setattr(control, "_runnable", lambda: 1)
    path = str(tmp_path / "raw.sock")
    listener = _raw_booth(path)
    results: list[dict] = []
    caller = _asking(results, {"op": "checkpoint"}, path)
    conn, _ = listener.accept()
    with conn:
        assert conn.recv(100) == control.CHECKPOINT_LINE
        # The booth answers only once the caller has stopped polling and sleeps in recv: a
        # poll without an end would never get there.
        _until_asleep_in_recv(caller, "the caller never stopped polling")
        conn.sendall(b'{"ok":true,"checkpoint":1}\n')
        caller.join(slow(10))
        assert results == [{"ok": True, "checkpoint": 1}]
        # After a poll that ran out, the next request sleeps at once: a caller polling for a
        # minute would not be seen asleep.
        monkeypatch.setattr(control, "SPIN", 60.0)
        caller = _asking(results, {"op": "status"}, path)
        assert conn.recv(100) == b'{"op":"status"}\n'
        _until_asleep_in_recv(caller, "the caller polled again")
        conn.sendall(b'{"ok":true,"status":2}\n')
        caller.join(slow(10))
    listener.close()
    assert results[1] == {"ok": True, "status": 2}


def test_no_poll_while_more_tasks_are_runnable_than_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No CPU would go idle: the caller sleeps in recv at once instead of polling for a minute.
    monkeypatch.setattr(control, "SPIN", 60.0)
    monkeypatch.setattr(control, "_runnable", lambda: control._CPUS + 1)
    path = str(tmp_path / "raw.sock")
    listener = _raw_booth(path)
    results: list[dict] = []
    caller = _asking(results, {"op": "checkpoint"}, path)
    conn, _ = listener.accept()
    with conn:
        assert conn.recv(100) == control.CHECKPOINT_LINE
        _until_asleep_in_recv(caller, "the caller polled on a busy machine")
        conn.sendall(b'{"ok":true,"checkpoint":1}\n')
        caller.join(slow(10))
    listener.close()
    assert results == [{"ok": True, "checkpoint": 1}]


def test_runnable_tasks_are_read_from_the_kernel() -> None:
    # This thread runs while it reads them.
    assert control._runnable() >= 1


# The agent's checkpoint on its kept connection goes through the compiled client
# (`ControlClient.ask_compiled`, `_quickline.ask`): the same poll, the same errors.
compiled = pytest.mark.skipif(control._quickline is None, reason="the compiled path was not built")


def _not_in_python(*args: object, **kwargs: object) -> dict:
    raise AssertionError("the compiled client read this answer in Python")


def _socket_given(monkeypatch: pytest.MonkeyPatch, path: str, via_env: bool) -> str | None:
    """The `path` argument of a test's requests: `path` itself, or None with $JUKEBOX_SOCKET
    naming it, as an agent asks (`_quickline.ask_kept` then sends its checkpoints, never
    `ControlClient.ask_compiled`)."""
    if not via_env:
        return path
    monkeypatch.setenv(control.SOCKET_ENV, path)
    monkeypatch.setattr(ControlClient, "ask_compiled", _not_in_python)
    return None


via_env = pytest.mark.parametrize("via_env", [False, True], ids=["path", "env"])


@compiled
@via_env
def test_the_compiled_client_reads_an_answer_in_pieces_and_never_resends_after_a_read_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via_env: bool
) -> None:
    monkeypatch.setattr(control, "SPIN", 60.0)
    monkeypatch.setattr(control, "_CPUS", 1 << 20)  # the machine as idle: the poll runs
    path = str(tmp_path / "raw.sock")
    listener = _raw_booth(path)
    results: list[object] = []
    given = _socket_given(monkeypatch, path, via_env)

    def agent() -> None:
        results.append(control.request({"op": "status"}, given))  # opens the kept connection
        monkeypatch.setattr(ControlClient, "answer", _not_in_python)
        results.append(control.request({"op": "checkpoint"}, given))
        try:
            control.request({"op": "checkpoint"}, given)
        except ControlError as error:
            results.append(error)

    caller = threading.Thread(target=agent, daemon=True)
    caller.start()
    conn, _ = listener.accept()
    with conn:
        assert conn.recv(100) == b'{"op":"status"}\n'
        conn.sendall(b'{"ok":true,"status":1}\n')
        assert conn.recv(100) == control.CHECKPOINT_LINE
        conn.sendall(b'{"ok":true,"che')
        conn.sendall(b'ckpoint":1}\n')
        assert conn.recv(100) == control.CHECKPOINT_LINE
    caller.join(slow(10))
    assert not caller.is_alive(), "the poll missed the end of the stream"
    # The request had reached the booth: it is not sent again on a new connection.
    assert select.select([listener], [], [], 0)[0] == []
    listener.close()
    assert results[:2] == [{"ok": True, "status": 1}, {"ok": True, "checkpoint": 1}]
    assert isinstance(results[2], ControlError) and "mid-request" in str(results[2])


@compiled
@pytest.mark.parametrize("busy", [False, True], ids=["poll-runs-out", "busy-machine"])
def test_the_compiled_client_sleeps_after_its_poll_runs_out_or_at_once_on_a_busy_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    # Busy: more tasks runnable than CPUs (at least this one, against none), so no poll, even
    # for a minute. Otherwise a poll of 1 ms that runs out, and then the next request sleeps at
    # once: a caller polling for a minute would not be seen asleep.
    monkeypatch.setattr(control, "SPIN", 60.0 if busy else 0.001)
    monkeypatch.setattr(control, "_CPUS", 0 if busy else 1 << 20)
    path = str(tmp_path / "raw.sock")
    listener = _raw_booth(path)
    results: list[dict] = []
    caller = _asking(results, {"op": "status"}, path)
    conn, _ = listener.accept()
    with conn:
        assert conn.recv(100) == b'{"op":"status"}\n'
        conn.sendall(b'{"ok":true,"status":1}\n')
        caller.join(slow(10))
        monkeypatch.setattr(ControlClient, "answer", _not_in_python)
        for n in (1, 2):
            caller = _asking(results, {"op": "checkpoint"}, path)
            assert conn.recv(100) == control.CHECKPOINT_LINE
            _until_asleep_in_recv(caller, "the caller never stopped polling")
            conn.sendall(b'{"ok":true,"checkpoint":%d}\n' % n)
            caller.join(slow(10))
            monkeypatch.setattr(control, "SPIN", 60.0)
    listener.close()
    assert results[1:] == [{"ok": True, "checkpoint": 1}, {"ok": True, "checkpoint": 2}]


ANSWERS_READ_IN_C = [
    b'{"ok":true,"checkpoint":12,"label":null,"tree":"' + b"ab" * 32 + b'","frame":345}\n',
    b'{"ok":true,"checkpoint":0,"label":null,"tree":"' + b"09" * 32 + b'","frame":0}\n',
]


@compiled
@pytest.mark.parametrize(
    "answer",
    [
        *ANSWERS_READ_IN_C,
        # Any other bytes are left to `json`: a label, a leading zero, upper case, spaces, two
        # lines, an error.
        b'{"ok":true,"checkpoint":1,"label":"a","tree":"' + b"ab" * 32 + b'","frame":3}\n',
        b'{"ok":true,"checkpoint":01,"label":null,"tree":"' + b"ab" * 32 + b'","frame":3}\n',
        b'{"ok":true,"checkpoint":1,"label":null,"tree":"' + b"AB" * 32 + b'","frame":3}\n',
        b'{"ok": true, "checkpoint": 1, "label": null, "tree": "'
        + b"ab" * 32
        + b'", "frame": 3}\n',
        b'{"ok":true,"checkpoint":1,"label":null,"tree":"' + b"ab" * 32 + b'","frame":3}\n{}\n',
        b'{"ok":false,"error":"no"}\n',
    ],
)
def test_the_compiled_client_reads_its_answers_as_json_does_and_leaves_it_the_rest(
    answer: bytes,
) -> None:
    assert control._quickline is not None
    agent, booth = socket.socketpair()
    with agent, booth:
        booth.sendall(answer)
        got, _, error = control._quickline.ask(agent.fileno(), control.CHECKPOINT_LINE, 0, 0, 1)
        assert booth.recv(100) == control.CHECKPOINT_LINE and error == 0
    if answer in ANSWERS_READ_IN_C:
        assert isinstance(got, dict)
        assert list(got.items()) == list(json.loads(answer).items())
    else:
        assert got == answer


class _Interrupted(Exception):
    pass


@compiled
@via_env
def test_a_signal_interrupts_the_compiled_client_waiting_for_its_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via_env: bool
) -> None:
    # As socket.recv does (PEP 475): the handler runs at once, and its exception ends the
    # request, whose connection is then dropped. The booth here never answers.
    monkeypatch.setattr(control, "SPIN", 0.0)
    path = str(tmp_path / "raw.sock")
    listener = _raw_booth(path)
    main = threading.main_thread()
    assert threading.current_thread() is main
    old = signal.signal(signal.SIGUSR1, lambda *_: (_ for _ in ()).throw(_Interrupted()))
    booth: list[socket.socket] = []
    ended: list[bool] = []

    def serve_then_interrupt() -> None:
        conn, _ = listener.accept()
        booth.append(conn)
        conn.recv(100)
        conn.sendall(b'{"ok":true,"status":1}\n')
        assert conn.recv(100) == control.CHECKPOINT_LINE
        _until_asleep_in_recv(main, "the caller never slept in recv")
        signal.pthread_kill(main.ident or 0, signal.SIGUSR1)
        # The caller, interrupted, drops its connection. One still waiting is freed here (and
        # the request then fails otherwise) instead of holding the test.
        conn.settimeout(slow(10))
        try:
            ended.append(conn.recv(100) == b"")
        except TimeoutError:
            ended.append(False)
        finally:
            conn.shutdown(socket.SHUT_RDWR)

    server = threading.Thread(target=serve_then_interrupt, daemon=True)
    server.start()
    given = _socket_given(monkeypatch, path, via_env)
    # The agent's own requests have the default timeout (`ask_kept` takes only those).
    timeout = 30.0 if via_env else 3600.0
    try:
        assert control.request({"op": "status"}, given, timeout) == {"ok": True, "status": 1}
        monkeypatch.setattr(ControlClient, "answer", _not_in_python)
        # A client that waited for the answer instead would hold the test past its timeout.
        with pytest.raises(_Interrupted):
            control.request({"op": "checkpoint"}, given, timeout=timeout)
    finally:
        signal.signal(signal.SIGUSR1, old)
        server.join(slow(10))
        for conn in booth:
            conn.close()
        listener.close()
    assert ended == [True] and path not in control._kept


@compiled
def test_the_agents_checkpoint_goes_where_its_socket_variable_points_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compiled branch of `request` reads $JUKEBOX_SOCKET itself: a value changed in the
    # process (os.environ) is the booth asked next, on its own connection, and a booth
    # restarted on the same path gets the checkpoint on a new one (the send on the old one
    # failed: the request never reached a booth).
    first, second = Booth(), Booth()
    a, b = str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    accepted: list[str] = []

    def counting(server: ControlServer, name: str) -> ControlServer:
        admit = server._admit

        def counting_admit(sock: socket.socket) -> None:
            accepted.append(name)
            admit(sock)

        server._admit = counting_admit  # type: ignore[method-assign]
        return server

    checkpoint = {"op": "checkpoint"}
    with (
        counting(ControlServer(a, first.handlers()), "a"),
        counting(ControlServer(b, second.handlers()), "b"),
    ):
        _socket_given(monkeypatch, a, via_env=True)
        assert [control.request(checkpoint)["checkpoint"] for _ in range(2)] == [1, 2]
        monkeypatch.setenv(control.SOCKET_ENV, b)
        assert control.request(checkpoint)["checkpoint"] == 1
        monkeypatch.setenv(control.SOCKET_ENV, a)
        assert control.request(checkpoint)["checkpoint"] == 3
        assert accepted == ["a", "b"]
        assert [len(first.checkpoints), len(second.checkpoints)] == [4, 2]
    third = Booth()
    with counting(ControlServer(a, third.handlers()), "a again"):
        assert control.request(checkpoint)["checkpoint"] == 1
        assert control.request(checkpoint)["checkpoint"] == 2
    assert accepted == ["a", "b", "a again"] and len(third.checkpoints) == 3
    monkeypatch.delenv(control.SOCKET_ENV)
    with pytest.raises(ControlRefused, match="JUKEBOX_SOCKET is not set"):
        control.request(checkpoint)


def test_the_install_built_the_compiled_checkpoint_path() -> None:
    # The extension is optional to pip (no compiler: the Python path serves every line), but
    # `make setup` installs gcc and python3-dev: a build that failed there would only show as
    # every compiled test skipped.
    module = importlib.import_module("jukebox.booth._quickline")
    assert callable(module.answered)


@compiled
def test_the_agents_plain_checkpoint_call_is_compiled_and_keeps_the_functions_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `request` itself is compiled (`_quickline.quick_request`) for `request({"op":
    # "checkpoint"})`; the Python function stays behind it, with its signature, and serves
    # every other call. The compiled call takes the module's `_kept_lock` as the function
    # does: held by another thread, the checkpoint waits for it (the function's `with`), and
    # it goes out only once the lock is let go.
    import inspect

    assert inspect.signature(control.request) == inspect.signature(control.request.__wrapped__)
    assert control.request.__name__ == "request" and "One request" in control.request.__doc__
    booth = Booth()
    path = str(tmp_path / "quick.sock")
    monkeypatch.setenv(control.SOCKET_ENV, path)
    checkpoint = {"op": "checkpoint"}
    with ControlServer(path, booth.handlers()):
        assert control.request(checkpoint)["checkpoint"] == 1  # the kept connection opened
        monkeypatch.setattr(ControlClient, "ask_compiled", _not_in_python)
        monkeypatch.setattr(ControlClient, "answer", _not_in_python)
        assert control.request(checkpoint) == {"ok": True, "checkpoint": 2, "label": None}
        monkeypatch.undo()
        monkeypatch.setenv(control.SOCKET_ENV, path)
        results: list[dict] = []
        with control._kept_lock:
            asking = threading.Thread(target=lambda: results.append(control.request(checkpoint)))
            asking.start()
            asking.join(0.2)
            assert asking.is_alive() and len(booth.checkpoints) == 3
        asking.join(slow(10))
        assert [r["checkpoint"] for r in results] == [3] and len(booth.checkpoints) == 4
        # Not the plain line: the function, as before.
        assert control.request({"op": "checkpoint", "label": "x"})["checkpoint"] == 4
        assert control.request(checkpoint, path)["checkpoint"] == 5
        assert control.request(checkpoint, timeout=30.0)["checkpoint"] == 6
    with pytest.raises(TypeError):
        control.request()  # type: ignore[call-arg]


@compiled
def test_the_locks_on_the_compiled_path_are_taken_as_their_methods_take_them() -> None:
    # On the CPython it was built for, the compiled path takes threading.Lock and RLock
    # without their methods (`try_acquire`), having checked their layout at import.
    assert control._quickline is not None
    assert control._quickline.direct_locks() == (True, True)
