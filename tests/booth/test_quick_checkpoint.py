"""The checkpoint an agent asks for after a folded step, answered by the control socket's
compiled path (`jukebox/booth/_quickline.c`): taken when it may be, and then recording on the
tape and in the layer exactly what the Python path records, with writes, rollbacks and other
checkpoints racing it on other connections. A real booth, its real FUSE layer."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jukebox.booth import control
from shadowfs.journal import decode_journal
from shadowfs.oid import ObjectId
from shadowfs.store import Store
from tests.booth.conftest import NOBODY
from tests.booth.test_booth_run import JUKEBOX, frames, jb
from tests.conftest import slow

pytestmark = [
    pytest.mark.usefixtures("root_only", "dev_fuse"),
    pytest.mark.skipif(control._quickline is None, reason="the compiled path was not built"),
]

# Three folded steps (still for longer than the booth waits before folding), a checkpoint after
# each on the kept connection, the answers' raw bytes read on a socket of its own for the last;
# then each rolled back to, and the counter of compiled answers.
STEPS = r"""
import json, os, socket, time
from jukebox.booth.control import request
answers = []
for step in range(3):
    for j in range(4):
        with open("f%d.txt" % j, "w") as f:
            f.write("%d-%d\n" % (step, j))
    time.sleep(0.2)
    if step < 2:
        answers.append(request({"op": "checkpoint"}))
    else:
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(os.environ["JUKEBOX_SOCKET"])
        raw.sendall(b'{"op":"checkpoint"}\n')
        line = b""
        while not line.endswith(b"\n"):
            line += raw.recv(4096)
        raw.close()
        answers.append(json.loads(line))
        answers[-1]["raw"] = line.decode()
seen = []
for cp in answers:
    request({"op": "rollback", "to": cp["checkpoint"]})
    seen.append([open("f%d.txt" % j).read() for j in range(4)])
status = request({"op": "status"})
print(json.dumps({"answers": answers, "seen": seen, "compiled": status["compiled_answers"]}))
"""


def _run(tree: Path, tapes: Path, script: str, env: dict | None = None) -> dict:
    proc = jb(
        "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "t1",
        "--commit", "never", "--", sys.executable, "-c", script, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _checkpoints(tapes: Path) -> dict[int, dict]:
    return {f["payload"]["id"]: f for f in frames(tapes) if f["kind"] == "checkpoint"}


def _journal(tapes: Path, hex_id: str) -> list[tuple[str, tuple[bytes, ...], int]]:
    store = Store.open(tapes / ".jukebox" / "store")
    try:
        ops = decode_journal(store.get(ObjectId(bytes.fromhex(hex_id))))
    finally:
        store.close()
    return [(op.op, op.paths, op.pid) for op in ops]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_checkpoint_after_a_fold_records_what_the_python_path_records(
    tmp_path: Path, compiled: bool
) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    env = None if compiled else {"JUKEBOX_QUICKLINE": "off"}
    out = _run(tree, tapes, STEPS, env)
    # Every checkpoint was folded first, so each one took the compiled path, or none did.
    assert out["compiled"] == (3 if compiled else 0)
    answers = out["answers"]
    raw = answers[2].pop("raw")
    assert raw.encode() == control.encode_request({"ok": True, **answers[2]})
    assert [a["checkpoint"] for a in answers] == [1, 2, 3]
    assert out["seen"] == [[f"{step}-{j}\n" for j in range(4)] for step in range(3)]
    recorded = _checkpoints(tapes)
    # The agent's pid as the supervisor sees it (the agent has a pid namespace of its own).
    pid = recorded[answers[0]["checkpoint"]]["payload"]["peer"]["pid"]
    for cp in answers:
        frame = recorded[cp["checkpoint"]]
        assert frame["seq"] == cp["frame"] and frame["tree"] == cp["tree"]
        payload = frame["payload"]
        assert set(payload) == {"id", "label", "reason", "journal", "peer"}
        assert payload["label"] is None and payload["reason"] == "request"
        assert payload["peer"]["pid"] == pid
        # The step's writes, each file's once: the journal let go after the previous one.
        ops = _journal(tapes, payload["journal"])
        paths = sorted({p for _, paths, _ in ops for p in paths})
        assert paths == [b"f%d.txt" % j for j in range(4)]
        assert {op_pid for _, _, op_pid in ops} == {pid}
    seqs = [recorded[n]["seq"] for n in sorted(recorded)]
    assert seqs == sorted(seqs)


# Two connections: one takes checkpoints after folded steps (the compiled path's case) while the
# other, on a thread of its own, replaces a file at the moment each is asked for, then takes a
# labelled checkpoint and asks for the status. Each checkpoint must hold the files as they were
# when it was asked for, whichever of the two came first: rolled back to at the end, each shows
# its step's file and the other file as it was before the race or after it. And no change is
# lost or recorded twice: every replace is in exactly one checkpoint's journal.
RACING = r"""
import json, os, threading, time
from jukebox.booth.control import ControlClient, request
os.makedirs("other", exist_ok=True)
go, went, stop = threading.Event(), threading.Event(), False
labelled = []
def other():
    client = ControlClient(os.environ["JUKEBOX_SOCKET"])
    i = 0
    while True:
        go.wait()
        go.clear()
        if stop:
            return
        try:
            with open("other/n.tmp", "w") as f:
                f.write("%d\n" % i)
            os.replace("other/n.tmp", "other/n.txt")
            got = client.call({"op": "checkpoint", "label": "o%d" % i})
            labelled.append(got["checkpoint"])
            client.call({"op": "status"})
            i += 1
        finally:
            went.set()  # a failure here fails the run, and does not leave it waiting
racer = threading.Thread(target=other)
racer.start()
mine = []
for step in range(4):
    with open("mine.txt", "w") as f:
        f.write("%d\n" % step)
    time.sleep(0.15)  # folded
    go.set()
    cp = request({"op": "checkpoint"})
    went.wait()
    went.clear()
    mine.append((cp["checkpoint"], cp["frame"], cp["tree"], step))
stop = True
go.set()
racer.join()
seen = []
for n, _, _, step in mine:
    request({"op": "rollback", "to": n})
    other = open("other/n.txt").read() if os.path.exists("other/n.txt") else None
    seen.append((step, open("mine.txt").read(), other))
status = request({"op": "status"})
print(json.dumps({"mine": mine, "other": labelled, "seen": seen,
                  "compiled": status["compiled_answers"], "count": len(status["checkpoints"])}))
"""


def test_racing_writes_and_checkpoints_on_another_connection(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    out = _run(tree, tapes, RACING)
    for step, mine, other in out["seen"]:
        assert mine == f"{step}\n"
        # before this step's replace (the previous one's, none at the first) or after it
        assert other in ({None, "0\n"} if step == 0 else {f"{step - 1}\n", f"{step}\n"})
    numbers = sorted([n for n, *_ in out["mine"]] + out["other"])
    assert numbers == list(range(1, out["count"]))  # none twice, none lost (0 is the start)
    recorded = _checkpoints(tapes)
    assert sorted(recorded) == list(range(1, out["count"]))
    for n, seq, tree_hex, _ in out["mine"]:
        assert recorded[n]["seq"] == seq and recorded[n]["tree"] == tree_hex
    seqs = [recorded[n]["seq"] for n in sorted(recorded)]
    assert seqs == sorted(seqs)  # the tape in the order the checkpoints were numbered
    replaces = [
        op
        for frame in recorded.values()
        if "journal" in frame["payload"]
        for op, paths, _ in _journal(tapes, frame["payload"]["journal"])
        if op == "rename" and paths[-1] == b"other/n.txt"
    ]
    assert len(replaces) == 4
    # Which of the four were compiled depends on which came first, the replace or the request;
    # each held either way. Those answered after the replace landed took the Python path.
    assert 0 <= out["compiled"] <= 4


# An agent on one CPU asks for checkpoints after its pauses, then waits for the test to look at
# the booth's threads before it asks for its status.
BESIDE = r"""
import json, os, sys, time
from jukebox.booth.control import request
os.sched_setaffinity(0, {int(sys.argv[1])})
for step in range(2):
    with open("f.txt", "w") as f:
        f.write("%d\n" % step)
    time.sleep(0.2)
    request({"op": "checkpoint"})
print("asked", flush=True)
sys.stdin.readline()
print(json.dumps({"compiled": request({"op": "status"})["compiled_answers"]}))
"""


def _masks(pid: int) -> dict[int, set[int]]:
    masks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            masks[int(tid)] = os.sched_getaffinity(int(tid))
    return masks


def _in_recv(pid: int) -> bool:
    """Whether a thread of ``pid`` waits for a request: in a unix socket's recv, or in the poll
    before it (`look_again_later`), by the kernel's wait channel."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/wchan") as f:
            channel = f.read()
            if channel.startswith("unix_stream_read") or "poll" in channel:
                return True
    return False


def _masks_while_waiting(
    tree: Path,
    tapes: Path,
    agent_cpu: int,
    booth_cpus: set[int] | None,
    python: str = sys.executable,
    user: int | None = None,
    bound_to: int | None = None,
) -> tuple[dict[int, set[int]], set[int], dict]:
    """The booth's threads' CPU masks (by thread id) while the agent, on ``agent_cpu``, waits
    after its checkpoints, once the connection's thread is back in its recv after the
    bookkeeping of the last answer (or after 100 looks); the booth's own
    mask; the agent's last line. ``booth_cpus``: the CPUs the booth is started on (None: the
    test's); ``python`` and ``user``: the booth's and the agent's interpreter, and who runs
    them; ``bound_to``: also wait (the same 100 looks) for a thread bound to that CPU alone, as
    another thread's poll can make the booth look back in its wait before that thread is."""
    jukebox = [JUKEBOX] if user is None else [
        "setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", python, "-c",
        "from jukebox.cli import main; main()",
    ]  # fmt: skip
    cmd = [
        *jukebox, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id",
        "t1", "--commit", "never", "--", python, "-c", BESIDE, str(agent_cpu),
    ]  # fmt: skip
    cpus = None if booth_cpus is None else functools.partial(os.sched_setaffinity, 0, booth_cpus)
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tree.parent if user is not None else "/", preexec_fn=cpus,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline() == "asked\n", proc.stderr.read() if proc.stderr else ""
        own = os.sched_getaffinity(proc.pid)
        for _ in range(100):
            masks = _masks(proc.pid)
            if _in_recv(proc.pid) and (bound_to is None or {bound_to} in masks.values()):
                break
            time.sleep(0.05)
        out, err = proc.communicate("\n", timeout=slow(60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    return masks, own, json.loads(out.splitlines()[-1])


def _two_cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    return cpus[0], cpus[-1]


@pytest.mark.serial  # its thread's CPU mask is read while an agent is pinned: alone, on idle CPUs
def test_the_connection_waits_beside_the_agent(tmp_path: Path) -> None:
    # Bound to the agent's CPU while it waits, so the agent's send wakes it on a running CPU;
    # every other thread of the booth keeps the booth's own mask.
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    _, agent_cpu = _two_cpus()
    masks, own, out = _masks_while_waiting(tree, tapes, agent_cpu, None, bound_to=agent_cpu)
    assert out["compiled"] >= 1
    bound = [tid for tid, mask in masks.items() if mask == {agent_cpu}]
    assert len(bound) == 1 and len(own) >= 2
    assert all(mask == own for tid, mask in masks.items() if tid not in bound)


# The agent of BESIDE, which moves to the CPU the test names once the connection's thread waits
# bound to its first one, then sleeps there until the test has looked again.
MOVING = r"""
import os, sys, time
from jukebox.booth.control import request
os.sched_setaffinity(0, {int(sys.argv[1])})
with open("f.txt", "w") as f:
    f.write("0\n")
time.sleep(0.2)
request({"op": "checkpoint"})
print("asked", flush=True)
os.sched_setaffinity(0, {int(sys.stdin.readline())})
print("moved", flush=True)
sys.stdin.readline()
"""


@pytest.mark.serial  # its thread's CPU mask is read while an agent is pinned: alone, on idle CPUs
def test_the_connection_follows_an_agent_that_sleeps_on_another_cpu(tmp_path: Path) -> None:
    # The agent's CPU read after an answer is not always where it sleeps through its pause
    # (its step's FUSE requests move it): the connection's thread looks again while it waits.
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    first, then = _two_cpus()
    cmd = [
        JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id",
        "t1", "--commit", "never", "--", sys.executable, "-c", MOVING, str(first),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None

    def bound_to(cpu: int) -> bool:
        return {cpu} in _masks(proc.pid).values()

    try:
        assert proc.stdout.readline() == "asked\n", proc.stderr.read() if proc.stderr else ""
        for _ in range(100):
            if _in_recv(proc.pid) and bound_to(first):
                break
            time.sleep(0.05)
        assert bound_to(first)
        proc.stdin.write(f"{then}\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "moved\n"
        for _ in range(100):  # the thread looks again 50 ms, then 1 s into its wait
            if bound_to(then):
                break
            time.sleep(0.05)
        masks = _masks(proc.pid)
        proc.communicate("\n", timeout=slow(60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert sum(mask == {then} for mask in masks.values()) == 1
    assert not any(mask == {first} for mask in masks.values())


@pytest.mark.serial  # its thread's CPU mask is read while an agent is pinned: alone, on idle CPUs
def test_the_booths_own_cpus_are_kept(tmp_path: Path) -> None:
    # A booth started on fewer CPUs than the agent runs on never binds a thread outside them.
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    booth_cpu, agent_cpu = _two_cpus()
    masks, own, out = _masks_while_waiting(tree, tapes, agent_cpu, {booth_cpu})
    assert out["compiled"] >= 1
    assert own == {booth_cpu}
    assert all(mask == {booth_cpu} for mask in masks.values())


@pytest.mark.serial  # its thread's CPU mask is read while an agent is pinned: alone, on idle CPUs
def test_an_unprivileged_booths_connection_waits_beside_its_agent(
    nobody_python: str, nobody_dir: Path, open_dev_fuse: None
) -> None:
    # The same, the booth and its agent run by nobody: the agent's /proc entry is still the
    # booth's to read, and its own thread its own to bind.
    tree, tapes = nobody_dir / "tree", nobody_dir / "tapes"
    tree.mkdir()
    os.chown(tree, NOBODY, NOBODY)
    _, agent_cpu = _two_cpus()
    masks, own, out = _masks_while_waiting(
        tree, tapes, agent_cpu, None, python=nobody_python, user=NOBODY, bound_to=agent_cpu
    )
    assert out["compiled"] >= 1
    bound = [tid for tid, mask in masks.items() if mask == {agent_cpu}]
    assert len(bound) == 1 and len(own) >= 2
    assert all(mask == own for tid, mask in masks.items() if tid not in bound)


def test_a_waiting_file_opened_before_a_request_counts_it_when_read(tmp_path: Path) -> None:
    # The compiled path opens its connection's fusectl `waiting` file while it waits for the
    # agent and reads it only after the request's syncfs: the kernel must count the unanswered
    # requests at that read, not at the open, or a WRITE sent in between would go unseen.
    from shadowfs.fuse_wire import FUSECTL, ensure_fusectl
    from shadowfs.layer import Layer
    from shadowfs.mountctl import Mount
    from tests.fs.conftest import populate

    if not ensure_fusectl():
        pytest.skip("fusectl is not mounted at /sys/fs/fuse/connections")
    base, mnt = tmp_path / "base", tmp_path / "mnt"
    populate(base)
    mnt.mkdir()
    store = Store.open(tmp_path / "store")
    layer = Layer(base, store, tmp_path / "scratch")
    try:
        with Mount(layer, mnt) as m:
            assert m._channel is not None and m._ops is not None
            waiting = os.open(f"{FUSECTL}/{m._channel.minor}/waiting", os.O_RDONLY)
            try:
                with m._ops.lock:  # the layer's workers wait for it: the request stays unanswered
                    asked = threading.Thread(target=os.path.exists, args=(mnt / "new-name",))
                    asked.start()
                    for _ in range(1000):
                        with open(f"{FUSECTL}/{m._channel.minor}/waiting") as f:
                            if int(f.read()) > 0:
                                break
                        time.sleep(0.005)
                    assert int(os.read(waiting, 32)) >= 1
                asked.join()
            finally:
                os.close(waiting)
    finally:
        layer.close()
        store.close()
