"""`jukebox log -f` on a booth that is still running, and the `ls` filters."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.booth.in_process import here
from tests.booth.test_booth_run import JUKEBOX, work  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


def wait_for(predicate, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def read_through_checkpoint(proc: subprocess.Popen[str]) -> list[str]:
    """The lines a follower printed up to the checkpoint frame's (the last written so far)."""
    assert proc.stdout is not None
    lines = []
    def kind(line: str) -> str:
        return json.loads(line)["kind"] if line.startswith("{") else line.split()[2]

    while not lines or kind(lines[-1]) != "checkpoint":
        line = proc.stdout.readline()
        assert line, f"the follower ended early after {lines}"
        lines.append(line.rstrip("\n"))
    return lines


def test_log_follow_prints_frames_as_they_come_and_ls_filters(work) -> None:  # noqa: F811
    tree, tapes = work
    tape = tapes / "f1.jbx"
    # The agent waits for a line on its stdin: the run is held open while the followers start.
    booth = subprocess.Popen(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id",
         "f1", "--name", "follower-test", "--", "sh", "-c",
         'jukebox booth checkpoint --label before; read line; echo "$line" > a.txt'],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: b'"label":"before"' in (tape.read_bytes() if tape.exists() else b""),
                 "the checkpoint frame")  # fmt: skip
        follow = [JUKEBOX, "log", "-f", "f1", "--tape-dir", str(tapes)]
        interrupted = subprocess.Popen(follow, stdout=subprocess.PIPE, text=True)
        followed = subprocess.Popen(follow, stdout=subprocess.PIPE, text=True)
        as_json = subprocess.Popen([*follow, "--json"], stdout=subprocess.PIPE, text=True)
        # Each has printed every frame so far, and waits for more: the run is still open.
        early = [read_through_checkpoint(p) for p in (interrupted, followed, as_json)]
        assert booth.poll() is None
        assert interrupted.poll() is None and followed.poll() is None and as_json.poll() is None
        interrupted.send_signal(signal.SIGINT)
        out, _ = interrupted.communicate(timeout=10)
        assert interrupted.returncode == 0 and "commit" not in out, out
        assert followed.poll() is None  # the others follow on

        booth.communicate("changed\n", timeout=30)
        assert booth.returncode == 0
        out, _ = followed.communicate(timeout=10)
        assert followed.returncode == 0
        rows = early[1] + out.splitlines()
        assert rows[0].split() == ["FRAME", "AT", "KIND", "TREE", "WHAT"]
        kinds = [row.split()[2] for row in rows[1:]]
        assert kinds[0] == "run_start" and "checkpoint" in kinds
        assert kinds[-3:] == ["fs", "exit", "commit"], out
        lines, _ = as_json.communicate(timeout=10)
        kinds = [json.loads(line)["kind"] for line in early[2] + lines.splitlines()]
        assert kinds[0] == "run_start" and kinds[-1] == "commit", kinds
    finally:
        if booth.poll() is None:
            booth.kill()
            booth.wait()
    assert (tree / "a.txt").read_text() == "changed\n"

    # A pending booth: its run is over, so following it ends at once.
    assert subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id",
         "p1", "--commit", "never", "--", "sh", "-c", "echo p > p.txt"],
        capture_output=True,
    ).returncode == 0  # fmt: skip
    done = here("log", "-f", "p1", "--tape-dir", str(tapes))
    assert done.returncode == 0 and done.stdout.splitlines()[-1].split()[2] == "exit", done

    def listed(*filters: str) -> list[str]:
        done = here("ls", "--tape-dir", str(tapes), "--json", *filters)
        assert done.returncode == 0, done.stderr
        return sorted(row["track_id"] for row in json.loads(done.stdout))

    assert listed() == ["f1", "p1"]
    assert listed("--status", "committed") == ["f1"]
    assert listed("--status", "PENDING") == ["p1"]
    assert listed("--status", "pending", "--status", "committed") == ["f1", "p1"]
    assert listed("--agent", "READ LINE") == ["f1"]  # the command, case aside
    assert listed("--agent", "follower-test") == ["f1"]  # or the agent's name
    assert listed("--since", "1h") == ["f1", "p1"]
    assert listed("--since", "2000-01-01") == ["f1", "p1"]
    assert listed("--since", "2999-01-01T00:00+00:00") == []
    assert listed("--since", "1h", "--status", "committed", "--agent", "p.txt") == []
    done = here("ls", "--tape-dir", str(tapes), "--since", "2999-01-01")
    assert done.returncode == 0 and done.stdout == f"no tapes in {tapes} match\n", done
    bad = here("ls", "--tape-dir", str(tapes), "--since", "yesterday")
    assert bad.returncode == 2 and "neither an age nor a date" in bad.stderr, bad
