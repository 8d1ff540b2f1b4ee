"""`jukebox fork`: a new tape sharing the prefix byte for byte; with --exec the run goes on live
from frame N with the overrides, and `jukebox diff A B` shows what changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jukebox.tape.tape import HEADER_SIZE, ID_SIZE, LENGTH, Tape
from shadowfs.store import Store
from tests.timetravel.conftest import AGENT, Recording


def prefix_bytes(path: Path, frames: int) -> bytes:
    data = path.read_bytes()
    pos = HEADER_SIZE
    for _ in range(frames):
        (length,) = LENGTH.unpack_from(data, pos)
        pos += LENGTH.size + length + ID_SIZE
    return data[:pos]


def test_fork_without_exec_shares_the_prefix_and_records_the_overrides(
    recording: Recording,
) -> None:
    proc = recording.jukebox(
        "fork", str(recording.tape), "--at", "3", "--model", "m2", "--system-prompt", "Be terse.",
        "--tape-id", "plain-fork",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    fork_path = recording.tapes / "plain-fork.jbx"
    assert prefix_bytes(fork_path, 3) == prefix_bytes(recording.tape, 3)
    tape = Tape.load(fork_path)
    assert len(tape.frames) == 4 and tape.frames[3].kind == "fork"
    payload = tape.frames[3].payload
    # A bare name is for the provider of the frame forked at (the first call after it).
    assert payload["overrides"] == {"model": {"openai": "m2"}, "system_prompt": "Be terse."}
    assert payload["forked_from"]["at"] == 3 and payload["exec"] is False
    bad = recording.jukebox("fork", str(recording.tape), "--at", "99")
    assert bad.returncode == 2 and "fork at 1.." in bad.stderr


def test_fork_exec_goes_live_with_the_other_model_and_diff_shows_it(
    recording: Recording, tmp_path: Path
) -> None:
    store_path = recording.tapes / ".jukebox" / "store"
    with Store.open(store_path) as store:
        turns = [f.seq for f in Tape.load(recording.tape, store).frames if f.kind == "llm_turn"]
    at = turns[1]  # the first call comes from the tape, the second onward goes live
    calls = len(recording.upstream.seen)
    proc = recording.jukebox(
        "fork", str(recording.tape), "--at", str(at), "--model", "other-model", "--exec",
        "--tape-id", "forked", live=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "1 LLM call(s) served from the tape" in proc.stderr
    fork_path = recording.tapes / "forked.jbx"
    assert prefix_bytes(fork_path, at) == prefix_bytes(recording.tape, at)
    # Everything from the fork on went to the upstream, rewritten.
    sent = recording.upstream.seen[calls:]
    assert len(sent) == 3 and {body["model"] for _, _, _, body in sent} == {"other-model"}
    with Store.open(store_path) as store:
        tape = Tape.load(fork_path, store)
        assert tape.verify().ok
        kinds = [f.kind for f in tape.frames]
        assert kinds[at] == "fork" and kinds.count("run_start") == 1
        later = [f.resolve_payload(store) for f in tape.frames[at:] if f.kind == "llm_turn"]
        assert [t["model"] for t in later] == ["other-model"] * 3
        assert all(t.get("rewritten") and "replayed_from" not in t for t in later)
        # The prefix was replayed, not recorded again: one llm_turn before the fork frame.
        assert kinds[:at].count("llm_turn") == 1 and kinds.count("checkpoint") == 3
        assert kinds[-1] == "exit"
    assert not (recording.tapes / "forked.exec.jbx").exists()

    diff = recording.jukebox("diff", str(recording.tape), str(fork_path))
    assert diff.returncode == 0, diff.stderr
    report = diff.stdout
    assert f"Frames 0..{at - 1} ({at} frame(s)) are identical" in report
    assert "| model * | gpt-4o-mini | other-model |" in report
    assert "- B: gpt-4o-mini, other-model" in report
    md = tmp_path / "report.md"
    written = recording.jukebox("diff", str(recording.tape), str(fork_path), "--markdown", str(md))
    assert written.returncode == 0 and md.read_text() == report
    as_json = json.loads(recording.jukebox("diff", "rec", "forked", "--tape-dir",
                                           str(recording.tapes), "--json").stdout)  # fmt: skip
    assert as_json["shared_prefix"] == at
    assert as_json["b"]["models"] == ["gpt-4o-mini", "other-model"]
    assert as_json["messages"]["differing_turns"] == [2, 3, 4]
    # The @N forms still compare file trees.
    files = recording.jukebox("diff", f"{recording.tape}@3", f"{fork_path}@{len(kinds) - 1}")
    assert files.returncode == 0 and "change(s)" in files.stdout

    # The fork replays strictly, offline: its live calls were sent with the override, and the
    # replay applies the fork frame's overrides to the agent's requests before matching.
    again = recording.jukebox("replay", str(fork_path), "--exec", "--strict")
    assert again.returncode == 0, again.stderr
    assert "3/3 checkpoint(s) matched, 4 LLM call(s) served from the tape" in again.stderr
    assert "kept pending" not in again.stderr


def test_fork_exec_honor_timing_serves_the_prefix_with_its_recorded_latency(
    recording: Recording, tmp_path: Path
) -> None:
    """The real openai SDK, in a booth: a run whose chat call took 300 ms upstream, forked after
    it with --honor-timing, sees the served call take its recorded time (served at once, it
    would take a few ms); the call after the fork goes live."""
    tree = tmp_path / "tree"
    tree.mkdir()
    slow = {"JB_DELAY_MS": "300", "JB_TURNS": "1", "JB_TIMES": "1"}
    proc = recording.jukebox(
        "booth", "run", "--tree", str(tree), "--tape-dir", str(recording.tapes), "--tape-id",
        "slow", "--", sys.executable, AGENT, live=True, **slow,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    slow_tape = recording.tapes / "slow.jbx"
    with Store.open(recording.tapes / ".jukebox" / "store") as store:
        calls = [
            f.resolve_payload(store) | {"seq": f.seq}
            for f in Tape.load(slow_tape, store).frames
            if f.kind == "llm_turn"
        ]
    assert [c["endpoint"] for c in calls] == ["chat.completions", "responses"]
    recorded = calls[0]["latency_ms"]
    assert recorded >= 300
    at = calls[1]["seq"]  # the chat call comes from the tape, the Responses stream goes live
    forked = recording.jukebox(
        "fork", str(slow_tape), "--at", str(at), "--exec", "--honor-timing", "--tape-id",
        "slow-fork", "--json", live=True, **slow,
    )  # fmt: skip
    assert forked.returncode == 0, forked.stderr
    result = json.loads(forked.stdout[forked.stdout.rindex("\n{\n") + 1 :])  # after the agent's
    assert (result["llm_served"], result["llm_live"]) == (1, 1)
    took = [float(line.rpartition(" ")[2]) for line in forked.stderr.splitlines()
            if line.startswith("took_ms turn")]  # fmt: skip
    assert len(took) == 1 and took[0] >= recorded
    plain = recording.jukebox("fork", str(slow_tape), "--at", str(at), "--honor-timing")
    assert plain.returncode == 2 and "add --exec" in plain.stderr
