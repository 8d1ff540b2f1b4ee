"""A booth's supervisor SIGKILLed while MCP calls are staged: once while the calls are held
(the agent still running), once while its commit runs them. A held call never reaches the real
server after the kill, the recovery runs none twice, and the tape verifies up to its last
complete frame. The server is tests/mcp/hostile_server.py, whose `write` tool appends a line
to a log: the test reads what reached it from outside."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mcp.conftest import HOSTILE_SERVER, JUKEBOX, payloads

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

AGENT = str(Path(__file__).resolve().parent / "held_agent.py")


def _start(tmp: Path, booth_id: str, *steps: str, opts: tuple[str, ...] = ()) -> dict:
    tree, log = tmp / f"tree-{booth_id}", tmp / f"{booth_id}.log"
    tree.mkdir()
    (tree / "f.txt").write_text("base\n")
    config = tmp / f"{booth_id}.json"
    config.write_text(json.dumps({"mcpServers": {"log": {
        "command": sys.executable, "args": [str(HOSTILE_SERVER)], "env": {"HOSTILE_LOG": str(log)},
    }}}))  # fmt: skip
    proc = subprocess.Popen(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tmp / "tapes"),
         "--tape-id", booth_id, "--mcp-config", str(config), "--commit", "auto", *opts,
         "--", "sh", "-c", 'echo changed > f.txt && exec "$@"', "agent", sys.executable,
         AGENT, *steps],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tree,
    )  # fmt: skip
    return {"id": booth_id, "proc": proc, "tree": tree, "log": log,
            "tape": tmp / "tapes" / f"{booth_id}.jbx"}  # fmt: skip


def _until(predicate, what: str) -> None:
    # Waiting for a state, not timing it: the bound only turns a broken run into a failure.
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _booth_processes(marker: str) -> list[int]:
    """Processes still running with `marker` in their command line or environment: this test's
    agents and servers only (another test on the machine may run the same server)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/environ", "rb") as e:
                if marker.encode() in f.read() + e.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


def _committed(tape: Path) -> list[str]:
    """The staged calls a commit has run, as its tape says so far (read while it is written)."""
    from jukebox.tape.tape import Tape

    if not tape.exists():
        return []
    return [f.payload["staged_id"] for f in Tape.load(tape).intact_frames
            if f.kind == "tool_call" and f.payload.get("decision") == "commit"]  # fmt: skip


def jb(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([JUKEBOX, *args, "--tape-dir", str(tmp / "tapes")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.serial  # failed under load before (CI: the held booth ended first)
def test_supervisor_killed_with_calls_held_and_while_its_commit_runs_them(tmp_path: Path) -> None:
    # Side by side, for time: `held` is killed while its agent waits with two calls staged;
    # `running` while its commit waits on the second of three (the `hang` tool, staged by a rule).
    held = _start(tmp_path, "held", "write", "one", "checkpoint", "cp1", "write", "two",
                  "wait", "-")  # fmt: skip
    running = _start(tmp_path, "running", "write", "one", "hang", "-", "write", "three",
                     opts=("--mcp-stage", "log/hang"))  # fmt: skip
    try:
        said = [held["proc"].stdout.readline() for _ in range(3)]
        if said[-1] != "ready\n":  # the booth ended first: what it said is the diagnosis
            held["proc"].kill()
            assert said[-1] == "ready\n", (said, held["proc"].communicate(timeout=60)[1])
        staged = [json.loads(line)["structured"]["jukebox"] for line in said[:2]]
        assert staged == [{"staged": True, "id": "stage-1"}, {"staged": True, "id": "stage-2"}]
        # Killed once stage-1's frame is on the tape, while stage-2 waits on the server.
        _until(lambda: _committed(running["tape"]) == ["stage-1"], "the commit ran stage-1")
        for booth in (held, running):
            # The booth's own process is its supervisor (the one `booth run` started).
            os.kill(booth["proc"].pid, signal.SIGKILL)
            booth["out"], booth["err"] = booth["proc"].communicate(timeout=60)
        # Everything of the booths went with their supervisors (PDEATHSIG down the chain):
        # nothing is left that could still send a held call.
        _until(lambda: not _booth_processes(AGENT), "the agents are gone")
        _until(lambda: not _booth_processes(str(tmp_path)), "the servers are gone")  # their log
    finally:
        for booth in (held, running):
            if booth["proc"].poll() is None:
                booth["proc"].kill()
                booth["proc"].wait()

    # Held: neither staged call reached the server, and the record keeps both for a commit.
    assert not held["log"].exists(), held["log"].read_text()
    record = json.loads((tmp_path / "tapes" / ".jukebox" / "booths" / "held.json").read_text())
    assert [c["id"] for c in record["mcp_staged"]] == ["stage-1", "stage-2"]
    # Running: stage-1 ran, stage-2 was in flight and never finished, stage-3 never started.
    assert _lines(running["log"]) == ["one"]

    # The tapes verify as they were left by the kill, up to their last complete frame.
    for booth in (held, running):
        verified = jb(tmp_path, "verify", str(booth["tape"]))
        assert verified.returncode == 0, verified.stdout + verified.stderr

    # Recovery, as a user would: `booth ls`, then the commit of the crashed booth at cp1
    # (what was staged before it), twice.
    listed = jb(tmp_path, "booth", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    status = {b["id"]: b["status"] for b in json.loads(listed.stdout)}
    assert status == {"held": "crashed"}, status
    done = jb(tmp_path, "booth", "commit", "held", "--at", "cp1")
    assert done.returncode == 0, done.stderr
    assert "ran 1 staged MCP call(s) of booth held: stage-1" in done.stderr, done.stderr
    assert (held["tree"] / "f.txt").read_text() == "changed\n"
    again = jb(tmp_path, "booth", "commit", "held", "--at", "cp1")
    assert again.returncode == 1 and "already committed" in again.stderr, again.stderr
    assert _lines(held["log"]) == ["one"]  # once, and never the one staged after cp1

    # The running booth's commit had passed its commit point: nothing is pending, and asking
    # for a commit again says so and runs nothing.
    again = jb(tmp_path, "booth", "commit", "running")
    assert again.returncode == 1 and "already committed" in again.stderr, again.stderr
    assert ("its staged MCP calls stopped midway (the process running them was killed): ran "
            "stage-1; stage-2 may have reached its server; never started: stage-3; none is run "
            "again") in again.stderr, again.stderr  # fmt: skip
    assert (running["tree"] / "f.txt").read_text() == "changed\n"
    assert _lines(running["log"]) == ["one"]

    for booth in (held, running):
        verified = jb(tmp_path, "verify", str(booth["tape"]))
        assert verified.returncode == 0, verified.stdout + verified.stderr
    calls = payloads(held["tape"], "tool_call")
    assert [(c["decision"], c.get("staged_id")) for c in calls] == [
        ("stage", "stage-1"), ("stage", "stage-2"), ("commit", "stage-1"),
    ]
    (dropped,) = payloads(held["tape"], "note", "mcp_dropped")
    assert dropped["ids"] == ["stage-2"]
    calls = payloads(running["tape"], "tool_call")
    assert [(c["decision"], c.get("staged_id")) for c in calls] == [
        ("stage", "stage-1"), ("stage", "stage-2"), ("stage", "stage-3"), ("commit", "stage-1"),
    ]
    (begun,) = payloads(running["tape"], "note", "mcp_commit_begin")
    assert begun["ids"] == ["stage-1", "stage-2", "stage-3"]
    assert not payloads(running["tape"], "note", "mcp_commit")  # it never finished


def test_a_checkpoint_named_by_a_staged_call_survives_the_supervisor_killed_at_once(
    tmp_path: Path,
) -> None:
    # A checkpoint is answered before its frame is on the tape (group commit); a call staged
    # after it is kept in the booth's record at once, naming it. Killed right after that call,
    # the record must not name a checkpoint the tape lost: `commit --at cp1` must find it.
    held = _start(tmp_path, "held", "write", "one", "checkpoint", "cp1", "write", "two",
                  "wait", "-")  # fmt: skip
    try:
        said = [held["proc"].stdout.readline() for _ in range(3)]
        if said[-1] != "ready\n":  # the booth ended first: what it said is the diagnosis
            held["proc"].kill()
            assert said[-1] == "ready\n", (said, held["proc"].communicate(timeout=60)[1])
        os.kill(held["proc"].pid, signal.SIGKILL)
        held["proc"].communicate(timeout=60)
        _until(lambda: not _booth_processes(str(tmp_path)), "the booth's processes are gone")
    finally:
        if held["proc"].poll() is None:
            held["proc"].kill()
            held["proc"].wait()
    record = json.loads((tmp_path / "tapes" / ".jukebox" / "booths" / "held.json").read_text())
    assert [c["id"] for c in record["mcp_staged"]] == ["stage-1", "stage-2"]
    done = jb(tmp_path, "booth", "commit", "held", "--at", "cp1")
    assert done.returncode == 0, done.stderr
    assert "ran 1 staged MCP call(s) of booth held: stage-1" in done.stderr, done.stderr
    assert _lines(held["log"]) == ["one"]
