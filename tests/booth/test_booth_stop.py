"""`jukebox booth stop ID`, and committing a crashed booth at one of its checkpoints.

Each configuration (root or nobody, FUSE or overlay) runs two booths side by side, both
agents ignoring SIGTERM after a good checkpoint and a bad change: one is stopped (the SIGKILL
after the grace period is what ends it), the other loses its supervisor to SIGKILL (crashed)
and is committed at its good checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.tape.tape import Tape
from tests.booth.conftest import NOBODY
from tests.booth.test_no_hang import _command, jb, nothing_left

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

AGENT = (
    "echo good > a.txt && {jukebox} booth checkpoint --label good && echo bad > a.txt && "
    "trap '' TERM && echo ready && sleep 60; echo survived"
)


# Each user and each layer once: what is tested does not depend on the pair.
@pytest.fixture(params=["root-fuse", "nobody-overlay"])
def config(request: pytest.FixtureRequest, tmp_path: Path):
    who, fs = request.param.split("-")
    full = request.param == "root-fuse"  # the error paths, once: they do not depend on it
    if who == "root":
        return None, None, tmp_path, fs, full
    python = request.getfixturevalue("nobody_python")
    request.getfixturevalue("open_dev_fuse")
    return python, NOBODY, request.getfixturevalue("nobody_dir"), fs, full


def _start(python, user, tree: Path, tapes: Path, booth_id: str, fs: str) -> subprocess.Popen:
    # nobody cannot run the project venv's `jukebox` (under /root): its own interpreter instead.
    cli = f"{python or sys.executable} -c 'from jukebox.cli import main; main()'"
    args = ["booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", booth_id]
    proc = subprocess.Popen(
        _command(python, user, *args, "--fs", fs, "--", "sh", "-c", AGENT.format(jukebox=cli)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    return proc


def _wait_ready(proc: subprocess.Popen) -> None:
    lines = [proc.stdout.readline() for _ in range(2)]  # type: ignore[union-attr]
    if lines[-1] != "ready\n":
        proc.kill()
        pytest.fail(f"the agent never got ready: {lines} {proc.communicate()}")


def _record(tapes: Path, booth_id: str) -> dict:
    return json.loads((tapes / ".jukebox" / "booths" / f"{booth_id}.json").read_text())


def test_stop_keeps_the_booth_pending_and_a_crashed_one_commits_at_a_checkpoint(config) -> None:
    python, user, base, fs, full = config
    trees = {}
    for booth_id in ("stopped", "crashed"):
        tree = trees[booth_id] = base / booth_id
        tree.mkdir()
        (tree / "a.txt").write_text("base\n")
        if user is not None:
            os.chown(tree, user, user)
            os.chown(tree / "a.txt", user, user)
    tapes = base / "tapes"
    procs = {b: _start(python, user, trees[b], tapes, b, fs) for b in trees}
    try:
        for proc in procs.values():
            _wait_ready(proc)

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return jb(*args, "--tape-dir", str(tapes), python=python, user=user)

        if full:  # a running booth has no final state to commit; the error says what to do
            early = run("booth", "commit", "stopped")
            assert early.returncode == 2 and "still running" in early.stderr, early.stderr

        # stop: SIGTERM (ignored by this agent), then SIGKILL after the grace period.
        stopped = run("booth", "stop", "stopped", "--grace", "200ms")
        assert stopped.returncode == 0, stopped.stderr
        assert "killed after 200ms" in stopped.stdout and "status pending" in stopped.stdout
        out, err = procs["stopped"].communicate(timeout=60)
        assert "survived" not in out, out
        assert procs["stopped"].returncode == 128 + signal.SIGKILL, err
        assert _record(tapes, "stopped")["status"] == "pending"
        notes = [f.payload for f in Tape.load(tapes / "stopped.jbx").frames if f.kind == "note"]
        stop = next(n for n in notes if n.get("event") == "interrupt")
        assert stop["signal"] == "SIGTERM" and stop["pid"] > 0, stop
        if full:
            assert "M a.txt" in run("booth", "diff", "stopped").stdout
            again = run("booth", "stop", "stopped")
            assert again.returncode == 2 and "not running (status pending)" in again.stderr

        # crashed: the supervisor is killed; its good checkpoint can still be committed.
        supervisor = _record(tapes, "crashed")["pid"]
        os.kill(supervisor, signal.SIGKILL)
        procs["crashed"].communicate(timeout=60)
        if full:
            whole = run("booth", "commit", "crashed")
            assert whole.returncode == 2 and "--at" in whole.stderr, whole.stderr
            assert "crashed" in whole.stderr and whole.stderr.count("\n") == 1
            refused = run("booth", "stop", "crashed")
            assert refused.returncode == 2 and "status crashed" in refused.stderr, refused.stderr
            assert "M a.txt" in run("booth", "diff", "crashed", "--at", "good").stdout
        committed = run("booth", "commit", "crashed", "--at", "good")
        assert committed.returncode == 0, committed.stderr
        assert (trees["crashed"] / "a.txt").read_text() == "good\n"
        assert not (tapes / ".jukebox" / "booths" / "crashed.json").exists()
        assert not (tapes / ".jukebox" / "scratch" / "crashed").exists()
        nothing_left("crashed", trees["crashed"], tapes)
        if full:
            verified = run("verify", str(tapes / "crashed.jbx"))
            assert verified.returncode == 0, verified.stdout + verified.stderr
        # The stopped booth's real tree was never touched.
        assert (trees["stopped"] / "a.txt").read_text() == "base\n"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
