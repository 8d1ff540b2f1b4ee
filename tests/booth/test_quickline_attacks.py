"""An agent attacking the control socket where the compiled path (`_quickline.serve`) reads it:
lines that are the checkpoint line's length but not it, the checkpoint line twice in one send,
cut in two sends, followed by junk, an endless line, a connection closed before its answer, and
eight connections asking at once. Each must get the answer the Python path gives (or a one-line
error), the supervisor must go on answering, and the tape must hold exactly the checkpoints
answered. As root and as nobody: both booths answer through the compiled path."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from jukebox.booth import control
from tests.booth.conftest import NOBODY
from tests.booth.test_booth_run import frames, jb

pytestmark = pytest.mark.usefixtures("dev_fuse")

AGENT = r"""
import json, os, socket, threading, time
from jukebox.booth.control import CHECKPOINT_LINE, request
PATH = os.environ["JUKEBOX_SOCKET"]
LINE = CHECKPOINT_LINE
step = [0]

def folded():
    # a write, then still for longer than the booth waits before folding the step
    step[0] += 1
    with open("f.txt", "w") as f:
        f.write("%d\n" % step[0])
    time.sleep(0.2)

def talk(*parts, answers=1, gap=0.0):
    s = socket.socket(socket.AF_UNIX)
    s.connect(PATH)
    s.settimeout(20)
    for i, part in enumerate(parts):
        if i and gap:
            time.sleep(gap)
        s.sendall(part)
    got = b""
    while got.count(b"\n") < answers:
        more = s.recv(65536)
        if not more:
            break
        got += more
    s.close()
    return [json.loads(line) for line in got.splitlines()]

out = {}
folded()
out["twice"] = talk(LINE + LINE, answers=2)
folded()
out["cut"] = talk(LINE[:7], LINE[7:], gap=0.05)
folded()
out["junk_after"] = talk(LINE + b'{"op":"nonsense"}\n', answers=2)
folded()
# Refused lines take no checkpoint: the fold stays the last thing, the compiled path open.
out["same_length_zeros"] = talk(b"\0" * (len(LINE) - 1) + b"\n")
out["one_byte_off"] = talk(LINE.replace(b"checkpoint", b"checkpoinu"))
out["endless"] = talk(b"[" * (MAX_LINE + 10))
folded()
s = socket.socket(socket.AF_UNIX)
s.connect(PATH)
s.sendall(LINE)
s.close()  # gone before its answer
time.sleep(0.2)
folded()
many = []
def ask():
    many.extend(talk(LINE))
threads = [threading.Thread(target=ask) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
out["many"] = many
folded()
out["after"] = request({"op": "checkpoint"})
status = request({"op": "status"})
out["count"] = len(status["checkpoints"])
out["compiled"] = status["compiled_answers"]
print(json.dumps(out))
""".replace("MAX_LINE", str(control.MAX_LINE))


def _attack(python: str, user: int | None, tree: Path, tapes: Path) -> dict:
    proc = jb(
        "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "t1",
        "--commit", "never", "--", python, "-c", AGENT,
        python=python, user=user, cwd=str(tree.parent),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _check(out: dict, tapes: Path, python: str, user: int | None) -> None:
    twice = out["twice"]
    assert [a["ok"] for a in twice] == [True, True]
    assert twice[1]["checkpoint"] == twice[0]["checkpoint"] + 1
    [cut] = out["cut"]
    assert cut["ok"] and cut["checkpoint"] == twice[1]["checkpoint"] + 1
    ok, nonsense = out["junk_after"]
    assert ok["ok"] and ok["checkpoint"] == cut["checkpoint"] + 1
    assert not nonsense["ok"] and "unknown op" in nonsense["error"]
    # The checkpoint line's length, not the line: refused, not taken.
    for case in ("same_length_zeros", "one_byte_off"):
        [refused] = out[case]
        assert not refused["ok"], (case, refused)
    [endless] = out["endless"]
    assert not endless["ok"] and "longer than" in endless["error"]
    many = out["many"]
    assert len(many) == 8 and all(a["ok"] for a in many)
    numbers = sorted(a["checkpoint"] for a in many)
    # the closed connection's checkpoint was taken (one number) before these eight
    assert numbers == list(range(ok["checkpoint"] + 2, ok["checkpoint"] + 10))
    assert out["after"]["checkpoint"] == numbers[-1] + 1
    assert out["count"] == out["after"]["checkpoint"] + 1  # 0 is the start
    # The tape: every checkpoint answered, once, in order; and it verifies.
    recorded = [f["payload"]["id"] for f in frames(tapes) if f["kind"] == "checkpoint"]
    assert recorded == list(range(1, out["count"]))
    verify = jb("verify", "t1", "--tape-dir", str(tapes), python=python, user=user,
                cwd=str(tapes.parent))  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    if control._quickline is not None:
        # Single checkpoint lines after a fold took the compiled path (nobody's booth too).
        assert out["compiled"] >= 2


@pytest.mark.usefixtures("root_only")
def test_hostile_lines_on_the_compiled_path_as_root(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    out = _attack(sys.executable, None, tree, tapes)
    _check(out, tapes, sys.executable, None)


def test_hostile_lines_on_the_control_socket_as_nobody(
    nobody_python: str, nobody_dir: Path, open_dev_fuse: None
) -> None:
    tree, tapes = nobody_dir / "tree", nobody_dir / "tapes"
    tree.mkdir()
    os.chown(tree, NOBODY, NOBODY)
    out = _attack(nobody_python, NOBODY, tree, tapes)
    _check(out, tapes, nobody_python, NOBODY)
