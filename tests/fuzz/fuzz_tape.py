"""Tapes and frames: `Tape.load` on any bytes, then everything a reader does with a loaded tape.

Allowed outcome: a `JukeboxError` (NotATape, UnsupportedVersion, TornTape, TamperedTape ...).
A torn or tampered tape must still load (its problems are reported by verify), so only the header
checks may raise from load itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
from functools import cache

from jukebox.errors import JukeboxError
from jukebox.tape.frame import Frame, frame_id
from jukebox.tape.tape import Tape, TapeWriter
from shadowfs.errors import ShadowfsError
from shadowfs.store import Store
from tests.fuzz.common import Target
from tests.fuzz.scratch import scratch

# open_append logs the torn tail it cuts; thousands of fuzz inputs would flood stderr.
logging.getLogger("jukebox.tape.tape").setLevel(logging.ERROR)


@cache
def _store() -> Store:
    return Store.open(scratch() / "tape-store")


def _seed_tape() -> bytes:
    path = scratch() / "seed.jbx"
    path.unlink(missing_ok=True)
    store = _store()
    with TapeWriter.create(path, store, "seed-tape", fsync=False) as w:
        w.append("run_start", {"name": "fuzz", "argv": ["agent", "--x"]}, time_ns=1)
        blob = store.put("blob", b"hello")
        w.append("fs", {"path": "a/b", "op": "write"}, refs=[blob], time_ns=2)
        w.append("checkpoint", {"label": "c1"}, tree=store.put("tree", b"\x01"), time_ns=3)
        w.append("llm_turn", {"model": "m", "cost_usd": 0.5, "big": "x" * 5000}, time_ns=4)
        w.append("note", {"nested": [{"a": [1, 2.5, None, True]}], "u": "\u00e9\n"}, time_ns=5)
        w.append("exit", {"code": 0}, time_ns=6)
    return path.read_bytes()


def tape_input(data: bytes) -> None:
    path = scratch() / "input.jbx"
    path.write_bytes(data)
    try:
        tape = Tape.load(path, store=_store())
    except JukeboxError:
        return
    tape.verify(deep=True)
    tape.verify(check_objects=False)
    tape.head.to_json()
    tape.summary()
    if tape.frames:
        with contextlib.suppress(JukeboxError):
            tape.tree_at(len(tape.frames) - 1)
        tape.inclusion_proof(len(tape.frames) - 1)
        tape.consistency_proof(len(tape.frames))
    for f in tape.frames:
        _read_frame(f)
    try:
        with TapeWriter.open_append(path, None, fsync=False, tape_id="fuzz") as w:
            w.head  # noqa: B018 - computing the head is part of reopening
    except JukeboxError:
        pass


def _read_frame(f: Frame) -> None:
    try:
        fields = (f.seq, f.time_ns, f.parent, f.mroot, f.payload, f.refs, f.tree, f.version)
        if not isinstance(f.known_kind, bool) or not isinstance(fields[0], int):
            raise AssertionError(f"a decoded frame has seq {fields[0]!r}, kind {f.kind!r}")
        f.resolve_payload(_store())
    except (JukeboxError, ShadowfsError):
        pass
    repr(f)


def frame_input(data: bytes) -> None:
    _read_frame(Frame(data, frame_id(data)))


def _seed_frames() -> list[bytes]:
    tape = Tape.load(scratch() / "seed.jbx") if (scratch() / "seed.jbx").exists() else None
    if tape is None:
        _seed_tape()
        tape = Tape.load(scratch() / "seed.jbx")
    frames = [f.raw for f in tape.frames]
    spilled = json.dumps({"x": {"$blob": "00" * 32}}).encode()
    return [*frames, spilled]


TARGETS = [
    Target("tape", tape_input, lambda: [_seed_tape()], "Tape.load + verify/summary/open_append"),
    Target("frame", frame_input, _seed_frames, "lazy frame decoding and resolve_payload"),
]
