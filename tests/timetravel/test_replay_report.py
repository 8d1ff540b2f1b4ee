"""What a replay or fork reports, and what it needs from the caller: a relative tape dir, an
agent that fails or catches a refused call, no API key in the environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jukebox.llm.placeholder_keys import PLACEHOLDER_KEY
from jukebox.tape.tape import Tape
from shadowfs.store import Store
from tests.timetravel.conftest import JUKEBOX, Recording

KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")


def run_in(
    recording: Recording,
    cwd: str | Path,
    *args: str,
    live: bool = False,
    drop: tuple[str, ...] = (),
    **extra: str,
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in recording.env(live, **extra).items() if k not in drop}
    return subprocess.run(
        [JUKEBOX, *args], capture_output=True, text=True, env=env, timeout=90, cwd=cwd
    )


def our_lines(stderr: str) -> list[str]:
    """Jukebox's own report lines (the agent's stderr comes through too)."""
    return [line for line in stderr.splitlines() if line.startswith("jukebox: ")]


def first_turn(recording: Recording) -> int:
    with Store.open(recording.tapes / ".jukebox" / "store") as store:
        tape = Tape.load(recording.tape, store)
        return next(f.seq for f in tape.frames if f.kind == "llm_turn")


def test_a_relative_tape_dir_is_resolved_once_where_the_command_started(
    recording: Recording, tmp_path: Path
) -> None:
    root = recording.tapes.parent
    for args in (("--tape-dir", "tapes"), ()):
        proc = run_in(recording, root, "replay", "rec", "--exec", "--no-record", *args,
                      JUKEBOX_TAPE_DIR="tapes")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    proc = run_in(
        recording, root, "fork", "rec", "--at", "3", "--exec", "--tape-dir", "tapes",
        "--tape-id", "relative-fork", live=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (recording.tapes / "relative-fork.jbx").is_file()
    # An agent (a nested jukebox among them) inherits the tape dir as the command resolved it.
    tree = tmp_path / "tree"
    tree.mkdir()
    proc = run_in(
        recording, tmp_path, "booth", "run", "--tree", "tree", "--commit", "never", "--",
        sys.executable, "-c", "import os; print(os.environ['JUKEBOX_TAPE_DIR'])",
        JUKEBOX_TAPE_DIR="tapes",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == str(tmp_path / "tapes")


def test_until_reports_an_agent_that_failed_after_going_live(recording: Recording) -> None:
    proc = run_in(
        recording, "/", "replay", str(recording.tape), "--exec", "--until",
        str(first_turn(recording)), "--no-record", "--json", live=True, JB_EXIT="1",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    line = "the agent failed: it exited with status 1 (recorded: 0); its own output above says why"
    assert our_lines(proc.stderr)[0] == f"jukebox: {line}"
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["ok"] is False and result["problems"] == [line]
    assert result["difference"] is None and result["agent_status"] == 1


def test_a_refused_call_the_agent_caught_still_fails_the_replay(recording: Recording) -> None:
    proc = run_in(
        recording, "/", "replay", str(recording.tape), "--exec", "--json", JB_LIST_MODELS="1"
    )
    assert proc.returncode == 1, proc.stderr
    assert "listing the models failed, going on" in proc.stderr  # the agent caught it
    result = json.loads(proc.stdout.splitlines()[-1])
    [problem] = result["problems"]
    assert problem.startswith("the replay refused GET /models (openai): not a recorded model")
    assert our_lines(proc.stderr)[0] == f"jukebox: {problem}"
    # Everything else matched: the refusal is the only reason the replay fails.
    assert result["difference"] is None and result["checkpoints_matched"] == 3
    assert (recording.tapes / result["tape_id"]).with_suffix(".jbx").is_file()


def test_a_replay_needs_no_api_key_and_never_forwards_the_placeholder(
    recording: Recording,
) -> None:
    proc = run_in(
        recording, "/", "replay", str(recording.tape), "--exec", "--no-record", drop=KEYS,
        JB_KEY_FROM_ENV="1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == recording.stdout
    # Past --until the calls go live: without the placeholder, whatever the SDK sent.
    calls = len(recording.upstream.seen)
    proc = run_in(
        recording, "/", "replay", str(recording.tape), "--exec", "--no-record", "--until",
        str(first_turn(recording)), live=True, drop=KEYS, JB_KEY_FROM_ENV="1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sent = recording.upstream.seen[calls:]
    assert len(sent) == 3
    assert not [h for _, _, headers, _ in sent for h in headers.values() if PLACEHOLDER_KEY in h]
    # A key the caller has is the agent's, as in any booth.
    proc = run_in(
        recording, "/", "replay", str(recording.tape), "--exec", "--no-record", "--until",
        str(first_turn(recording)), live=True, JB_KEY_FROM_ENV="1", OPENAI_API_KEY="sk-mine",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert recording.upstream.seen[-1][2].get("authorization") == "Bearer sk-mine"


def test_an_agent_that_crashes_is_named_before_what_it_left_undone(recording: Recording) -> None:
    proc = run_in(
        recording, "/", "replay", str(recording.tape), "--exec", "--no-record", JB_TURNS="x"
    )
    assert proc.returncode == 1, proc.stderr
    lines = our_lines(proc.stderr)
    assert lines[0].startswith("jukebox: the agent failed: it exited with status 1 (recorded: 0)")
    assert "replay diverged" in proc.stderr  # the checks still say what it never did


def test_a_fork_whose_agent_fails_after_the_fork_exits_1_and_says_so(
    recording: Recording,
) -> None:
    proc = run_in(
        recording, "/", "fork", str(recording.tape), "--at", str(first_turn(recording) + 1),
        "--exec", "--tape-id", "failing-fork", "--json", live=True, JB_EXIT="3",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    line = "the agent failed: it exited with status 3 (recorded: 0); its own output above says why"
    # After the agent's own output (one JSON per line) comes the result, indented.
    result = json.loads(proc.stdout[proc.stdout.rindex("\n{\n") :])
    assert result["problems"] == [line] and result["agent_status"] == 3
    assert result["difference"] is None
