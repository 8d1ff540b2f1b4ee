"""`jukebox replay TAPE --exec`: a recorded booth run re-executed offline in a fresh booth,
checked frame by frame against its tape (real SDKs, real booths, the fake upstream)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from jukebox.tape.tape import Tape
from jukebox.timetravel.timetravel import checkpoint_marks, same_files
from shadowfs.store import Store
from tests.timetravel.conftest import Recording


def seqs(tape_path: Path, store_path: Path, kind: str) -> list[int]:
    with Store.open(store_path) as store:
        return [f.seq for f in Tape.load(tape_path, store).frames if f.kind == kind]


def test_replay_serves_the_recording_and_matches_every_checkpoint(
    recording: Recording, tmp_path: Path
) -> None:
    # The replay's scratch tree goes under TMPDIR: a private one, so that other replays running
    # on the machine at the same time cannot make or hide a leftover. Its path is long, as a CI
    # runner's can be: the booth's control socket must not be placed under it.
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    proc = recording.jukebox("replay", str(recording.tape), "--exec", TMPDIR=str(tmpdir))
    assert proc.returncode == 0, proc.stderr
    # The SDKs got the very responses they got when recorded.
    assert proc.stdout == recording.stdout
    assert "3/3 checkpoint(s) matched, 4 LLM call(s) served from the tape" in proc.stderr
    assert "$0.00 spent" in proc.stderr
    replay = recording.tapes / "rec-replay-1.jbx"
    store_path = recording.tapes / ".jukebox" / "store"
    with Store.open(store_path) as store:
        original = checkpoint_marks(Tape.load(recording.tape, store))
        replayed = checkpoint_marks(Tape.load(replay, store))
        assert [m.label for m in replayed] == ["turn-1", "turn-2", "turn-3"]
        for want, got in zip(original, replayed, strict=True):
            assert same_files(store, want.tree, got.tree) == []
        turns = [f.payload for f in Tape.load(replay, store).frames if f.kind == "llm_turn"]
        assert all(t["replayed_from"] is not None and t["cost_usd"] == 0.0 for t in turns)
    # Zero residue: the real tree as recorded, no pending booth, no scratch tree left behind.
    assert {p.name: p.read_text() for p in sorted(recording.tree.iterdir())} == recording.files
    assert not list((recording.tapes / ".jukebox" / "booths").glob("rec-replay-*"))
    assert list(tmpdir.iterdir()) == []


def test_a_changed_prompt_diverges_at_the_frame_of_that_request(recording: Recording) -> None:
    proc = recording.jukebox(
        "replay", str(recording.tape), "--exec", "--no-record", JB_PROMPT_2="write goodbye"
    )
    assert proc.returncode == 1, proc.stderr
    second_turn = seqs(recording.tape, recording.tapes / ".jukebox" / "store", "llm_turn")[1]
    assert f"replay diverged at frame {second_turn} (openai chat.completions call #2)" in (
        proc.stderr
    )
    assert '"write hello #2" -> "write goodbye #2"' in proc.stderr
    assert "1/3 checkpoint(s) matched" in proc.stderr
    # The agent saw the first answer only: the divergence ended the run.
    assert proc.stdout == recording.stdout.splitlines(keepends=True)[0]


def test_loose_serves_by_order_despite_the_change(recording: Recording) -> None:
    proc = recording.jukebox(
        "replay", str(recording.tape), "--exec", "--loose", "--no-record",
        JB_PROMPT_2="write goodbye",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == recording.stdout


def test_different_files_at_a_checkpoint_end_the_replay_there(recording: Recording) -> None:
    proc = recording.jukebox("replay", str(recording.tape), "--exec", JB_STRAY="1")
    assert proc.returncode == 1, proc.stderr
    store_path = recording.tapes / ".jukebox" / "store"
    first_checkpoint = seqs(recording.tape, store_path, "checkpoint")[0]
    assert f'replay diverged at frame {first_checkpoint} (checkpoint #1 "turn-1")' in proc.stderr
    assert "A stray.txt" in proc.stderr
    # The report keeps its lines: escaping what the tape says must not flatten them into one.
    assert "\\n" not in proc.stderr
    assert any(line.strip().startswith("A stray.txt") for line in proc.stderr.splitlines())
    # The agent was stopped at that checkpoint: no model call after it reached the proxy.
    replays = sorted(recording.tapes.glob("rec-replay-*.jbx"), key=os.path.getmtime)
    assert len(seqs(replays[-1], store_path, "llm_turn")) == 1


def test_a_call_beyond_the_recording_fails_without_reaching_the_network(
    recording: Recording,
) -> None:
    tapes_before = set(recording.tapes.glob("*.jbx"))
    calls = len(recording.upstream.seen)
    # The caller's base URLs point at the running upstream: a replay must still not use it.
    proc = recording.jukebox(
        "replay", str(recording.tape), "--exec", "--no-record", live=True, JB_TURNS="4"
    )
    assert proc.returncode == 1, proc.stderr
    assert "call #4 goes beyond the recording" in proc.stderr
    assert len(recording.upstream.seen) == calls
    assert set(recording.tapes.glob("*.jbx")) == tapes_before


def test_until_serves_the_recording_through_frame_n_then_goes_live(recording: Recording) -> None:
    first_turn = seqs(recording.tape, recording.tapes / ".jukebox" / "store", "llm_turn")[0]
    calls = len(recording.upstream.seen)
    proc = recording.jukebox(
        "replay", str(recording.tape), "--exec", "--until", str(first_turn), "--no-record",
        live=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "1 LLM call(s) served from the tape, 3 live" in proc.stderr
    assert len(recording.upstream.seen) == calls + 3
    assert proc.stdout == recording.stdout


def test_honor_timing_answers_no_call_before_its_recorded_latency(recording: Recording) -> None:
    proc = recording.jukebox("replay", str(recording.tape), "--exec", "--honor-timing", "--json")
    assert proc.returncode == 0, proc.stderr
    replay = Path(json.loads(proc.stdout.splitlines()[-1])["tape_path"])
    with Store.open(recording.tapes / ".jukebox" / "store") as store:
        recorded = {
            f.seq: f.resolve_payload(store)["latency_ms"]
            for f in Tape.load(recording.tape, store).frames
            if f.kind == "llm_turn"
        }
        turns = [f.payload for f in Tape.load(replay, store).frames if f.kind == "llm_turn"]
    assert len(turns) == len(recorded) == 4
    for turn in turns:
        assert turn["latency_ms"] >= recorded[turn["replayed_from"]]
    replay.unlink()


def test_replay_options_need_exec(recording: Recording) -> None:
    proc = recording.jukebox("replay", str(recording.tape), "--until", "3")
    assert proc.returncode == 2
    assert "add --exec" in proc.stderr
    timed = recording.jukebox("replay", str(recording.tape), "--honor-timing")
    assert timed.returncode == 2 and "--honor-timing" in timed.stderr
    plain = recording.jukebox("replay", str(recording.tape))
    assert plain.returncode == 0 and "replayed 12 frame(s)" in plain.stdout
