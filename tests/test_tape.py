"""Tapes: frames, the .jbx file, verification, forks, and the committed golden tape."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jukebox.errors import CheckFailed, JukeboxError
from jukebox.tape import merkle
from jukebox.tape.errors import (
    CorruptObject,
    MissingObject,
    NotATape,
    TamperedTape,
    TornTape,
    UnsupportedVersion,
)
from jukebox.tape.frame import (
    SPILL_THRESHOLD,
    canonical_json,
    encode_frame,
    encode_payload,
    frame_id,
    spill_encoded,
)
from jukebox.tape.tape import HEADER_SIZE, MAGIC, Tape, TapeWriter
from shadowfs.oid import ObjectId, hash_object
from shadowfs.store import Store

GOLDEN = Path(__file__).parent / "data" / "golden"
# The head of tests/data/golden/tape.jbx. It never changes: a new value means the format did.
GOLDEN_HEAD = "3bbd4bf8cd8c0f0d87878bf387819b117d1b2f17e7cbc5c7dfd7b6e32a619f76"
GOLDEN_LAST = "ecb4f35883556b34b8e18e07b283a1d1e7f7722eda0f714a1c426d6ac40dc479"


@pytest.fixture
def store(tmp_path: Path):
    with Store.open(tmp_path / "store") as s:
        yield s


def write_tape(path: Path, store: Store, n: int = 6) -> list:
    """A small tape of varied kinds with fixed times; returns the frames the writer produced."""
    frames = []
    with TapeWriter.create(path, store, "tape-1", fsync=False) as w:
        frames.append(w.append("run_start", {"name": "agent-a", "argv": ["x"]}, time_ns=100))
        for i in range(1, n):
            if i % 3 == 1:
                blob = store.put("blob", b"content %d" % i)
                frames.append(w.append("fs", {"path": f"f{i}", "op": "write"}, refs=[blob],
                                       time_ns=100 + i))
            elif i % 3 == 2:
                tree = store.put("tree", b"tree %d" % i)
                frames.append(w.append("checkpoint", {"label": f"c{i}"}, tree=tree,
                                       time_ns=100 + i))
            else:
                frames.append(w.append("llm_turn", {"model": "m", "cost_usd": 0.25},
                                       time_ns=100 + i))
    return frames


def records(path: Path) -> list[tuple[int, int]]:
    """(offset, end) of every record, walked by hand from the length prefixes."""
    data = path.read_bytes()
    out, pos = [], HEADER_SIZE
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        out.append((pos, pos + 4 + n + 32))
        pos += 4 + n + 32
    return out


# -- round trip and verification ---------------------------------------------------------------


def test_append_then_load_round_trips_every_field(tmp_path: Path, store: Store) -> None:
    written = write_tape(tmp_path / "t.jbx", store)
    tape = Tape.load(tmp_path / "t.jbx", store)
    assert tape.tape_id == "tape-1"
    assert [f.raw for f in tape.frames] == [f.raw for f in written]
    for w, f in zip(written, tape.frames, strict=True):
        assert (f.seq, f.kind, f.time_ns, f.parent, f.payload, f.refs, f.tree, f.id) == (
            w.seq, w.kind, w.time_ns, w.parent, w.payload, w.refs, w.tree, w.id
        )
        assert f.id == hash_object("frame", f.raw)
    assert tape.frames[0].parent is None
    assert tape.frames[0].payload == {"name": "agent-a", "argv": ["x"], "tape_id": "tape-1"}
    for prev, f in zip(tape.frames, tape.frames[1:], strict=False):
        assert f.parent == prev.id
    # A tree is always among the refs, so gc and verify see it.
    assert tape.frames[2].tree in tape.frames[2].refs


def test_clean_tape_verifies_and_head_commits_to_every_frame(tmp_path: Path, store: Store) -> None:
    write_tape(tmp_path / "t.jbx", store, n=9)
    tape = Tape.load(tmp_path / "t.jbx", store)
    report = tape.verify()
    assert report.ok and report.problems == []
    assert tape.verify(deep=True).ok
    head = report.head
    ids = [f.id for f in tape.frames]
    assert head.count == 9
    assert head.last_frame_id == ids[-1]
    assert head.merkle_root == merkle.root(ids)
    # Each frame's mroot is the root of the frames before it.
    for i, f in enumerate(tape.frames):
        assert f.mroot == merkle.root(ids[:i])
    assert tape.head == head


def test_writer_head_matches_loaded_head(tmp_path: Path, store: Store) -> None:
    with TapeWriter.create(tmp_path / "t.jbx", store, "h", fsync=True) as w:
        w.append("run_start", {})
        w.append("note", {"text": "hello"})
        head = w.head
    assert Tape.load(tmp_path / "t.jbx").head == head


def test_every_frame_re_encodes_byte_identically(tmp_path: Path, store: Store) -> None:
    write_tape(tmp_path / "t.jbx", store)
    for f in Tape.load(tmp_path / "t.jbx").frames:
        again = encode_frame(seq=f.seq, kind=f.kind, time_ns=f.time_ns, parent=f.parent,
                             mroot=f.mroot, payload=f.payload, refs=f.refs, tree=f.tree)
        assert again == f.raw


def test_canonical_json_rules() -> None:
    assert canonical_json({"b": 1, "a": [True, None, 1.5, "é"]}) == (
        '{"a":[true,null,1.5,"é"],"b":1}'.encode()
    )
    assert canonical_json({"x": b"\x00\xff"}) == b'{"x":"00ff"}'
    with pytest.raises(ValueError, match="NaN or infinity"):
        canonical_json({"x": float("nan")})
    with pytest.raises(ValueError, match="not valid Unicode"):
        canonical_json({"x": "\ud800"})
    with pytest.raises(TypeError, match="cannot hold a set"):
        canonical_json({"x": {1, 2}})


def test_the_formatted_envelope_is_the_encoders_bytes() -> None:
    # A frame's fields around its payload are formatted, not encoded (encode_frame): the bytes
    # must be the canonical JSON of the whole frame, for every shape the fields take.
    ids = [hash_object("blob", b"%d" % i) for i in range(3)]
    payload = {"é": [1, 2.5, None, {"z": "\u2615"}], "a": "x"}
    for kind in ("run_start", "sql", "note", "hologram"):  # the last: not a known kind
        for parent in (None, ids[0]):
            for tree in (None, ids[1]):
                for refs in ((), [ids[2], ids[0], ids[2]]):
                    for seq, t in ((0, 0), (7, -1), (10**17, 1_767_225_600_000_000_000)):
                        whole = canonical_json({
                            "v": 1, "seq": seq, "kind": kind, "time_ns": t,
                            "parent": parent.hex() if parent else None, "mroot": ids[1].hex(),
                            "payload": payload, "refs": sorted({r.hex() for r in refs}),
                            "tree": tree.hex() if tree else None,
                        })
                        kw = {"seq": seq, "kind": kind, "time_ns": t, "parent": parent,
                              "mroot": ids[1], "payload": payload, "refs": refs, "tree": tree}
                        assert encode_frame(**kw) == whole
                        assert encode_frame(**kw, payload_json=canonical_json(payload)) == whole


def test_the_writer_still_writes_the_golden_tapes_bytes(tmp_path: Path) -> None:
    # tests/make_golden.py reproduces the committed tape byte for byte: the writer's encoding
    # of today is the one the golden tape's ids commit to.
    from tests.make_golden import build

    build(tmp_path / "golden")
    assert (tmp_path / "golden" / "tape.jbx").read_bytes() == (GOLDEN / "tape.jbx").read_bytes()


def test_a_payload_holding_itself_or_the_blob_key(tmp_path: Path) -> None:
    looped: dict = {"a": 1}
    looped["self"] = [looped]
    with pytest.raises(ValueError, match="nested too deeply"):
        canonical_json(looped)
    with TapeWriter.create(tmp_path / "t.jbx", None, "t") as w:
        w.append("run_start", {})
        with pytest.raises(ValueError, match="nested too deeply"):
            w.append("note", looped)
        # Said first, whatever else is wrong with the payload.
        with pytest.raises(ValueError, match="reserved key"):
            w.append("note", {"x": {"$blob": "00"}, "y": {1, 2}})
        with pytest.raises(TypeError, match="cannot hold a set"):
            w.append("note", {"y": {1, 2}})
        # The key's text as a value, or a key deeper than a top-level value's, is no spill.
        kept = w.append("note", {"text": "$blob", "x": [{"$blob": "00"}], "y": {"z": "$blob"}})
    assert Tape.load(tmp_path / "t.jbx").frames[-1].payload == kept.payload
    assert len(Tape.load(tmp_path / "t.jbx").frames) == 2


def test_writer_refuses_bad_frames(tmp_path: Path, store: Store) -> None:
    with TapeWriter.create(tmp_path / "t.jbx", store, "t") as w:
        with pytest.raises(ValueError, match="first frame of a tape must be run_start"):
            w.append("note", {})
        with pytest.raises(ValueError, match="names tape 'other'"):
            w.append("run_start", {"tape_id": "other"})
        w.append("run_start", {})
        with pytest.raises(ValueError, match="unknown frame kind 'bogus'"):
            w.append("bogus", {})
        with pytest.raises(ValueError, match="only be the first frame"):
            w.append("run_start", {})
        with pytest.raises(ValueError, match="reserved key"):
            w.append("note", {"x": {"$blob": "00"}})
    with pytest.raises(FileExistsError):
        TapeWriter.create(tmp_path / "t.jbx", store, "t")
    # Refused appends left nothing behind.
    assert len(Tape.load(tmp_path / "t.jbx").frames) == 1


def test_concurrent_appends_keep_one_chain(tmp_path: Path) -> None:
    with TapeWriter.create(tmp_path / "t.jbx", None, "t", fsync=False) as w:
        w.append("run_start", {})

        def spam(k: int) -> None:
            for i in range(50):
                w.append("note", {"thread": k, "i": i})

        threads = [threading.Thread(target=spam, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    tape = Tape.load(tmp_path / "t.jbx")
    assert len(tape.frames) == 201 and tape.verify().ok


def test_large_payload_values_go_to_the_store(tmp_path: Path, store: Store) -> None:
    big = {"messages": [{"role": "user", "content": "x" * SPILL_THRESHOLD}]}
    with TapeWriter.create(tmp_path / "t.jbx", store, "t") as w:
        w.append("run_start", {})
        written = w.append("llm_turn", {"request": big, "model": "m"})
    f = Tape.load(tmp_path / "t.jbx", store).frames[1]
    assert len(f.raw) < 1000
    ref = f.payload["request"]["$blob"]
    assert f.payload["model"] == "m"
    assert ObjectId.from_hex(ref) in f.refs and written.refs == f.refs
    assert f.resolve_payload(store) == {"request": big, "model": "m"}
    assert store.get(ObjectId.from_hex(ref)) == canonical_json(big)


def test_unknown_kinds_load_for_forward_compatibility(tmp_path: Path) -> None:
    path = tmp_path / "t.jbx"
    with TapeWriter.create(path, None, "t") as w:
        first = w.append("run_start", {}, time_ns=1)
    raw = encode_frame(seq=1, kind="hologram", time_ns=2, parent=first.id,
                       mroot=merkle.root([first.id]), payload={"z": 1})
    with open(path, "ab") as f:
        f.write(struct.pack("<I", len(raw)) + raw + frame_id(raw))
    tape = Tape.load(path)
    assert tape.verify().ok
    assert tape.frames[1].kind == "hologram" and not tape.frames[1].known_kind
    assert tape.frames[1].payload == {"z": 1}


def test_non_canonical_frame_with_valid_id_is_tampering(tmp_path: Path) -> None:
    path = tmp_path / "t.jbx"
    with TapeWriter.create(path, None, "t") as w:
        first = w.append("run_start", {}, time_ns=1)
    obj = json.loads(encode_frame(seq=1, kind="note", time_ns=2, parent=first.id,
                                  mroot=merkle.root([first.id]), payload={"a": 1, "b": 2}))
    raw = json.dumps(obj, sort_keys=True).encode()  # spaces after separators: not canonical
    with open(path, "ab") as f:
        f.write(struct.pack("<I", len(raw)) + raw + frame_id(raw))
    report = Tape.load(path).verify(deep=True)
    assert not report.ok
    assert any(isinstance(p, TamperedTape) and p.seq == 1 for p in report.problems)
    with pytest.raises(TamperedTape, match="not a canonical version 1 frame"):
        _ = Tape.load(path).frames[1].payload
    with pytest.raises(TamperedTape, match=f"{path} was altered at frame 1"):
        Tape.load(path).tree_at(1)
    summary = Tape.load(path).summary()
    assert summary["damaged"] is True and summary["frames"] == 2 and summary["tape_id"] == "t"


def test_tree_at(tmp_path: Path, store: Store) -> None:
    t1, t2 = store.put("tree", b"one"), store.put("tree", b"two")
    with TapeWriter.create(tmp_path / "t.jbx", store, "t") as w:
        w.append("run_start", {})
        w.append("note", {})
        w.append("checkpoint", {}, tree=t1)
        w.append("fs", {})
        w.append("rollback", {}, tree=t2)
        w.append("exit", {"code": 0})
    tape = Tape.load(tmp_path / "t.jbx")
    assert [tape.tree_at(n) for n in range(6)] == [None, None, t1, t1, t2, t2]
    with pytest.raises(IndexError, match="there is no frame 6"):
        tape.tree_at(6)


@pytest.mark.parametrize(
    ("frames", "status"),
    [
        ([], "RUNNING"),
        ([("exit", {"code": 0})], "EXITED"),
        ([("commit", {}), ("exit", {"code": 0})], "COMMITTED"),
        ([("rollback", {"final": True}), ("exit", {})], "ROLLED_BACK"),
        ([("rollback", {}), ("exit", {})], "EXITED"),
        ([("discard", {})], "DISCARDED"),
        ([("commit", {}), ("fork", {"tape_id": "t"})], "RUNNING"),
    ],
)
def test_summary(tmp_path: Path, frames: list, status: str) -> None:
    with TapeWriter.create(tmp_path / "t.jbx", None, "t") as w:
        w.append("run_start", {"name": "bot"}, time_ns=1_000)
        w.append("llm_turn", {"cost_usd": 0.5}, time_ns=2_000)
        w.append("llm_turn", {"cost_usd": 0.25}, time_ns=3_000)
        for i, (kind, payload) in enumerate(frames):
            w.append(kind, payload, time_ns=4_000 + i)
    s = Tape.load(tmp_path / "t.jbx").summary()
    assert s["status"] == status
    assert (s["tape_id"], s["name"], s["frames"], s["cost_usd"]) == ("t", "bot", 3 + len(frames),
                                                                     0.75)
    assert s["started_ns"] == 1_000
    assert s["duration_ns"] == (4_000 + len(frames) - 1 if frames else 3_000) - 1_000
    assert s["torn"] is False


# -- damage: foreign files, flipped bytes, torn tails, missing objects ---------------------------


def test_foreign_file_and_newer_version_are_input_errors(tmp_path: Path) -> None:
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello, I am not a tape\n")
    with pytest.raises(NotATape, match="is not a Jukebox tape") as e:
        Tape.load(foreign)
    assert e.value.exit_code == 2 and isinstance(e.value, JukeboxError)
    (tmp_path / "empty.jbx").write_bytes(b"")
    with pytest.raises(NotATape):
        Tape.load(tmp_path / "empty.jbx")
    newer = tmp_path / "v2.jbx"
    newer.write_bytes(MAGIC + struct.pack("<HHI", 2, 0, 0))
    with pytest.raises(UnsupportedVersion, match="format version 2") as e2:
        Tape.load(newer)
    assert e2.value.exit_code == 2


def test_every_single_byte_flip_is_detected(tmp_path: Path, store: Store) -> None:
    path = tmp_path / "t.jbx"
    write_tape(path, store, n=4)
    good = path.read_bytes()
    bad = tmp_path / "bad.jbx"
    last_start = records(path)[-1][0]
    for offset in range(len(good)):
        flipped = bytearray(good)
        flipped[offset] ^= 0x01
        bad.write_bytes(flipped)
        try:
            # No store: the objects are untouched, and deep=True still decodes every frame.
            tape = Tape.load(bad)
        except (NotATape, UnsupportedVersion):
            assert offset < HEADER_SIZE
            continue
        report = tape.verify(deep=True)
        assert not report.ok, f"flip at byte {offset} went unnoticed"
        kinds = {type(p) for p in report.problems}
        assert kinds <= {TamperedTape, TornTape}, (offset, kinds)
        if offset < last_start:
            # Damage before the last record is tampering, never mistaken for a torn write
            # (a length prefix grown past the end of the file is reported as torn, after it).
            assert TamperedTape in kinds or report.problems[0].offset <= offset, offset
        for p in report.problems:
            assert isinstance(p, CheckFailed) and p.exit_code == 1
            assert "\n" not in str(p)


def test_flip_in_a_middle_record_names_the_frame(tmp_path: Path, store: Store) -> None:
    path = tmp_path / "t.jbx"
    write_tape(path, store, n=5)
    start, _ = records(path)[2]
    data = bytearray(path.read_bytes())
    data[start + 20] ^= 0x40
    path.write_bytes(data)
    report = Tape.load(path).verify()
    first = report.problems[0]
    assert isinstance(first, TamperedTape) and first.seq == 2
    assert "altered at frame 2" in str(first)
    with pytest.raises(TamperedTape):
        report.raise_for_problems()
    with pytest.raises(TamperedTape):
        TapeWriter.open_append(path, store)


def test_rewritten_frame_breaks_the_next_parent_link(tmp_path: Path, store: Store) -> None:
    """Re-hashing a changed frame is not enough: its successor still names the old id."""
    path = tmp_path / "t.jbx"
    write_tape(path, store, n=4)
    tape = Tape.load(path)
    f = tape.frames[1]
    raw = encode_frame(seq=1, kind=f.kind, time_ns=f.time_ns + 1, parent=f.parent, mroot=f.mroot,
                       payload=f.payload, refs=f.refs, tree=f.tree)
    start, end = records(path)[1]
    data = path.read_bytes()
    path.write_bytes(data[:start] + struct.pack("<I", len(raw)) + raw + frame_id(raw) + data[end:])
    problems = Tape.load(path).verify().problems
    assert [(type(p), p.seq) for p in problems] == [(TamperedTape, 2)] * 2 + [(TamperedTape, 3)]
    assert "parent link" in str(problems[0]) and "Merkle root" in str(problems[1])
    assert "Merkle root" in str(problems[2])


def test_frames_out_of_order_are_tampering(tmp_path: Path, store: Store) -> None:
    path = tmp_path / "t.jbx"
    write_tape(path, store, n=4)
    recs = records(path)
    data = path.read_bytes()
    (s1, e1), (s2, e2) = recs[1], recs[2]
    path.write_bytes(data[:s1] + data[s2:e2] + data[s1:e1] + data[e2:])
    problems = Tape.load(path).verify().problems
    assert problems and all(isinstance(p, TamperedTape) for p in problems)
    assert "seq 2" in str(problems[0])


def test_truncation_anywhere_in_the_last_record_is_a_torn_tail(
    tmp_path: Path, store: Store
) -> None:
    path = tmp_path / "t.jbx"
    write_tape(path, store, n=4)
    good = path.read_bytes()
    start, end = records(path)[-1]
    cut = tmp_path / "cut.jbx"
    for size in range(start + 1, end):
        cut.write_bytes(good[:size])
        tape = Tape.load(cut, store)
        assert tape.torn_tail is not None and tape.torn_tail.offset == start
        assert len(tape.frames) == 3
        report = tape.verify()
        assert [type(p) for p in report.problems] == [TornTape]
        assert f"torn record at byte {start}" in str(report.problems[0])
        assert report.head.count == 3
    # A zero-filled tail (the size was updated, the data blocks were not) is torn too.
    cut.write_bytes(good[:start + 4] + bytes(end - start - 4))
    assert Tape.load(cut).torn_tail is not None
    # Cut exactly at the record boundary: a shorter, intact tape.
    cut.write_bytes(good[:start])
    assert Tape.load(cut).verify().ok


def test_open_append_cuts_a_torn_tail_and_continues(tmp_path: Path, store: Store) -> None:
    path = tmp_path / "t.jbx"
    write_tape(path, store, n=4)
    start, end = records(path)[-1]
    with open(path, "r+b") as f:
        f.truncate(end - 5)
    with TapeWriter.open_append(path, store) as w:
        assert w.repaired is not None and w.repaired.offset == start
        assert w.count == 3
        w.append("exit", {"code": 0})
    tape = Tape.load(path, store)
    assert tape.verify().ok
    assert [f.kind for f in tape.frames][-1] == "exit" and len(tape.frames) == 4


def test_missing_and_corrupt_objects(tmp_path: Path, store: Store) -> None:
    path = tmp_path / "t.jbx"
    write_tape(path, store, n=4)
    with Store.open(tmp_path / "other-store") as empty:
        report = Tape.load(path, empty).verify()
    missing = [p for p in report.problems if isinstance(p, MissingObject)]
    assert {p.seq for p in missing} == {1, 2}
    assert "missing from the store" in str(missing[0])
    # Without objects checked, the tape itself is fine.
    assert Tape.load(path, empty).verify(check_objects=False).ok

    store.flush()
    pack = next((tmp_path / "store" / "packs").iterdir())
    data = bytearray(pack.read_bytes())
    data[-3] ^= 0xFF  # inside the last object's compressed bytes
    pack.write_bytes(data)
    with Store.open(tmp_path / "store") as damaged:
        problems = Tape.load(path, damaged).verify().problems
    assert problems and all(isinstance(p, CorruptObject | MissingObject) for p in problems)
    assert any(isinstance(p, CorruptObject) for p in problems)


# -- forks ---------------------------------------------------------------------------------------


def test_fork_shares_the_prefix_and_proves_consistency(tmp_path: Path, store: Store) -> None:
    original = tmp_path / "a.jbx"
    write_tape(original, store, n=7)
    tape = Tape.load(original, store)
    at = 4
    with TapeWriter.fork_from(tape, at, tmp_path / "b.jbx", "tape-2") as w:
        w.append("llm_turn", {"model": "other", "cost_usd": 1.0})
    fork = Tape.load(tmp_path / "b.jbx", store)
    assert fork.verify().ok
    prefix_end = records(original)[at - 1][1]
    assert fork.path.read_bytes()[:prefix_end] == original.read_bytes()[:prefix_end]
    assert fork.tape_id == "tape-2" and tape.tape_id == "tape-1"
    note = fork.frames[at]
    assert note.kind == "fork" and note.parent == tape.frames[at - 1].id
    assert note.payload["forked_from"] == {
        "tape": "tape-1", "at": at, "head": tape.head.to_json()
    }
    # The original's frame `at` commits to the root of the shared prefix: prove the fork extends it.
    old_root = tape.frames[at].mroot
    proof = fork.consistency_proof(at)
    assert merkle.verify_consistency(at, fork.head.count, old_root, fork.head.merkle_root, proof)
    # And both tapes agree on where the prefix's last frame sits.
    ids = [f.id for f in fork.frames]
    proof = fork.inclusion_proof(at - 1)
    assert merkle.verify_inclusion(ids[at - 1], at - 1, len(ids), proof, fork.head.merkle_root)


def test_fork_refuses_bad_points(tmp_path: Path, store: Store) -> None:
    write_tape(tmp_path / "a.jbx", store, n=3)
    tape = Tape.load(tmp_path / "a.jbx")
    for at in (0, 4):
        with pytest.raises(ValueError, match=r"fork at 1\.\.3"):
            TapeWriter.fork_from(tape, at, tmp_path / "b.jbx", "b")
    assert not (tmp_path / "b.jbx").exists()


# -- the golden tape -----------------------------------------------------------------------------


def test_golden_tape_loads_and_verifies_with_its_store(tmp_path: Path) -> None:
    # Opening a store writes lock and WAL files: work on a copy, never on the committed bytes.
    shutil.copytree(GOLDEN / ".jukebox" / "store", tmp_path / "store")
    with Store.open(tmp_path / "store", create=False) as store:
        tape = Tape.load(GOLDEN / "tape.jbx", store)
        report = tape.verify(deep=True)
        assert report.ok, [str(p) for p in report.problems]
        assert report.head.merkle_root.hex() == GOLDEN_HEAD
        assert report.head.last_frame_id.hex() == GOLDEN_LAST
        kinds = [f.kind for f in tape.frames]
        assert kinds[0] == "run_start" and kinds[-1] == "exit"
        spilled = [f for f in tape.frames if f.payload != f.resolve_payload(store)]
        assert spilled, "the golden tape must hold a payload moved to the store"
        assert tape.summary()["status"] == "COMMITTED"
        assert tape.tree_at(len(tape.frames) - 1) is not None
    for f in tape.frames:
        again = encode_frame(seq=f.seq, kind=f.kind, time_ns=f.time_ns, parent=f.parent,
                             mroot=f.mroot, payload=f.payload, refs=f.refs, tree=f.tree)
        assert again == f.raw


def test_golden_trees_read_and_re_encode_as_version_1(tmp_path: Path) -> None:
    # Tree version 2 (fifos, sockets, devices, hard links) left version 1 trees as they were:
    # the golden tree decodes, and re-encodes to its very bytes, hence its very id.
    from shadowfs.tree import decode_tree, encode_tree

    shutil.copytree(GOLDEN / ".jukebox" / "store", tmp_path / "store")
    with Store.open(tmp_path / "store", create=False) as store:
        tape = Tape.load(GOLDEN / "tape.jbx", store)
        trees = {f.tree for f in tape.frames if f.tree is not None}
        assert trees
        for oid in trees:
            data = store.get(oid)
            assert data[0] == 1 and encode_tree(decode_tree(data)) == data


def test_golden_store_is_small() -> None:
    size = sum(p.stat().st_size for p in (GOLDEN / ".jukebox" / "store").rglob("*") if p.is_file())
    assert size < 50_000
    assert os.path.getsize(GOLDEN / "tape.jbx") < 20_000


# -- the fixed-position fast path agrees with a full decode, whatever the payload holds ----------

_keys = st.sampled_from(
    ["seq", "kind", "refs", "tree", "v", "parent", "mroot", "payload", "a", "é"]
)
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20),
    st.sampled_from([',"seq":7,', '"}', '\\",\\"seq\\":', "null", "{", "]"]),
)
# "$blob" marks a spilled value and is refused as a key of a payload's dict (`spill_payload`).
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(_keys | st.text(max_size=5).filter(lambda k: k != "$blob"), inner,
                      max_size=4),
    max_leaves=20,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(payloads=st.lists(st.dictionaries(_keys | st.text(max_size=8), _json, max_size=5),
                         min_size=1, max_size=4))
def test_any_payload_round_trips_and_verifies(tmp_path: Path, payloads: list) -> None:
    path = tmp_path / f"h{uuid.uuid4().hex}.jbx"  # hypothesis may replay an example
    with TapeWriter.create(path, None, "h", fsync=False) as w:
        w.append("run_start", {})
        for p in payloads:
            w.append("note", p)
    tape = Tape.load(path)
    report = tape.verify(deep=True)
    assert report.ok, [str(p) for p in report.problems]
    for p, f in zip(payloads, tape.frames[1:], strict=True):
        assert f.payload == json.loads(canonical_json(p))
    path.unlink()


def test_open_append_on_a_tape_with_no_frames_yet(tmp_path: Path) -> None:
    path = tmp_path / "t.jbx"
    TapeWriter.create(path, None, "early").close()
    with pytest.raises(ValueError, match="pass tape_id="):
        TapeWriter.open_append(path, None)
    with TapeWriter.open_append(path, None, tape_id="early") as w:
        w.append("run_start", {"name": "late"})
    tape = Tape.load(path)
    assert tape.verify().ok and tape.tape_id == "early"
    foreign = tmp_path / "foreign.jbx"
    foreign.write_bytes(b"SQLite format 3\x00" + bytes(100))
    with pytest.raises(NotATape):
        TapeWriter.open_append(foreign, None)
    assert foreign.read_bytes().startswith(b"SQLite")


def test_refs_the_caller_made_durable_are_not_flushed_again_but_spilled_objects_are(
    tmp_path: Path,
) -> None:
    with Store.open(tmp_path / "store") as store:
        w = TapeWriter.create(tmp_path / "t.jbx", store, "t1", fsync=False)
        w.append("run_start", {})
        oid = store.put("blob", b"put, not flushed")
        # A group commit flushes before it writes its frames; a second flush per frame would
        # fsync, under its lock, what checkpoints put meanwhile.
        w.append("note", {"event": "a"}, refs=[oid], refs_durable=True)
        with Store.open(tmp_path / "store", create=False) as other:
            assert not other.has(oid)
        big = w.append("note", {"event": "b", "log": "x" * (SPILL_THRESHOLD + 1)},
                       refs=[oid], refs_durable=True)
        spilled = [r for r in big.refs if r != oid]
        assert len(spilled) == 1
        with Store.open(tmp_path / "store", create=False) as other:
            assert other.has(spilled[0]) and other.has(oid)
        w.close()


def test_a_large_encoded_payload_is_joined_not_encoded_again_and_the_bytes_are_the_same(
    tmp_path: Path,
) -> None:
    # Past the threshold in total, with no value over it (a streamed llm_turn), or with one
    # that spills: the writer splices the join of the values' encodings in, and the frames
    # must be the very bytes the plain encoding of the payload gives.
    half = "y" * (SPILL_THRESHOLD // 2)
    payloads = [
        {"a": half, "b": half, "é": [1, 2.5, None, {"z": "ü"}]},  # 4 KiB+ in total, no spill
        {"a": half, "big": "x" * (SPILL_THRESHOLD + 1), "n": 1},  # one value spills
        {"small": 1},
    ]
    for p in payloads:
        with Store.open(tmp_path / "s0") as store:
            body, refs, joined = spill_encoded(encode_payload(p), store)
        assert joined == canonical_json(body), "the join is the payload's canonical JSON"
        assert len(refs) == ("big" in p)
    raws = []
    for i, wrap in enumerate((dict, encode_payload)):
        with Store.open(tmp_path / f"s{i + 1}") as store:
            w = TapeWriter.create(tmp_path / f"t{i}.jbx", store, "same", fsync=False)
            w.append("run_start", {}, time_ns=1)
            for n, p in enumerate(payloads):
                f = w.append("note", wrap(p), time_ns=2 + n)
                again = encode_frame(seq=f.seq, kind=f.kind, time_ns=f.time_ns, parent=f.parent,
                                     mroot=f.mroot, payload=f.payload, refs=f.refs, tree=f.tree)
                assert again == f.raw
            w.close()
            tape = Tape.load(tmp_path / f"t{i}.jbx", store)
            assert tape.verify(deep=True).ok
            assert [f.resolve_payload(store) for f in tape.frames[1:]] == [
                json.loads(canonical_json(p)) for p in payloads
            ]
            raws.append([f.raw for f in tape.frames])
    assert raws[0] == raws[1]


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(
    st.text(), st.integers(-(2**80), 2**80), st.floats(), st.booleans(), st.none(),
    st.sampled_from(["\ud800", "\u2028", "\x00\x1f\x7f\"\\"]),
))  # fmt: skip
def test_a_scalar_is_encoded_as_the_encoder_does_or_refused_alike(value: object) -> None:
    # canonical_json encodes bare scalars without the json encoder (its set-up per call was
    # most of the cost): the bytes, and a refusal's message, must be the encoder's.
    from jukebox.tape.frame import _ENCODER

    def general() -> bytes:
        try:
            return _ENCODER.encode(value).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a lone surrogate") from None

    try:
        expected = general()
    except ValueError:
        with pytest.raises(ValueError, match=r"NaN or infinity|lone surrogate"):
            canonical_json(value)
        return
    assert canonical_json(value) == expected
