"""Tape crash consistency: tape writers SIGKILLed at random moments mid-append.

The writer appends frames (some near a megabyte, so a kill can land inside the write itself) and
prints the frame count once `append` returned, which fsyncs. After the kill the tape loads and
holds at least every frame the writer reported. A kill rarely lands inside write(2), so when it
fell between records the test appends what such a kill (or a power cut before the fsync) leaves:
a prefix of a record, or zeros. Then, every trial: the torn tail is reported as TornTape and as
nothing else, the intact prefix verifies, `open_append` cuts the tail off, and the repaired tape
takes the next writer's frames and verifies clean.

Cutting the last record at every byte offset is tests/test_tape.py's
test_truncation_anywhere_in_the_last_record_is_a_torn_tail; this file adds real kills.

JUKEBOX_TAPE_CRASH_TRIALS sets the number of kills (default 8); JUKEBOX_TAPE_CRASH_SEED the
sample.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from jukebox.tape.errors import TornTape
from jukebox.tape.tape import HEADER_SIZE, Tape, TapeWriter
from shadowfs.store import Store

REPO = Path(__file__).resolve().parents[2]
TRIALS = int(os.environ.get("JUKEBOX_TAPE_CRASH_TRIALS", "8"))
SEED = int(os.environ.get("JUKEBOX_TAPE_CRASH_SEED", "99"))

WRITER = textwrap.dedent(
    """
    import os, random, sys
    from jukebox.tape.tape import TapeWriter
    from shadowfs.store import Store
    path, store_dir, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    store = Store.open(store_dir)
    if os.path.exists(path):
        w = TapeWriter.open_append(path, store)
    else:
        w = TapeWriter.create(path, store, "crash-tape")
        w.append("run_start", {"name": "crash"})
    print(w.count, flush=True)
    while True:
        roll = rng.random()
        if roll < 0.15:
            # Many values each under the spill threshold: one frame of about a megabyte.
            payload = {f"k{i}": "v" * 4000 for i in range(rng.randint(50, 300))}
            w.append("note", payload)
        elif roll < 0.6:
            blob = store.put("blob", rng.randbytes(rng.randint(1, 5000)))
            w.append("fs", {"path": "f"}, refs=[blob])
        else:
            w.append("tool_call", {"argv": ["ls", str(rng.random())]})
        print(w.count, flush=True)
    """
)


def _last_record(path: Path) -> bytes:
    data = path.read_bytes()
    pos, last = HEADER_SIZE, b""
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        last = data[pos : pos + 4 + n + 32]
        pos += len(last)
    return last


def test_killed_tape_writers_leave_a_verifiable_prefix_that_open_append_repairs(
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    tape_path = tmp_path / "t.jbx"
    store_dir = tmp_path / "store"
    torn_seen = clean_kills = 0
    reported = 0
    for trial in range(TRIALS):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tape_path), str(store_dir), str(trial + SEED)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        start = int(proc.stdout.readline())
        assert start >= reported  # a reopened tape keeps every frame reported before
        time.sleep(rng.uniform(0.01, 0.15))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        counts = [int(x) for x in out.split("\n")[:-1]]
        reported = max([start, *counts])

        with Store.open(store_dir) as store:
            tape = Tape.load(tape_path, store)
            assert len(tape.frames) >= reported, f"trial {trial}: a reported frame was lost"
            if tape.torn_tail is None:
                # The kill fell between records, as most do. Leave what a kill inside write(2)
                # (or a power cut before the fsync) leaves: part of the next record, or zeros.
                clean_kills += 1
                last = _last_record(tape_path)
                cut = rng.randrange(1, len(last))
                with open(tape_path, "ab") as f:
                    f.write(last[:cut] if trial % 2 else bytes(cut))
                tape = Tape.load(tape_path, store)
                assert tape.torn_tail is not None
            else:
                torn_seen += 1
            report = tape.verify(deep=True)
            assert [type(p) for p in report.problems] == [TornTape]
            assert report.problems[0].offset == tape.torn_tail.offset
            intact = len(tape.frames)
            with TapeWriter.open_append(tape_path, store) as w:
                assert w.repaired is not None
                assert w.count == intact
            assert os.path.getsize(tape_path) == tape.torn_tail.offset
            assert Tape.load(tape_path, store).verify(deep=True).ok
            reported = intact

    with Store.open(store_dir) as store:
        with TapeWriter.open_append(tape_path, store) as w:
            w.append("exit", {"code": 0})
        final = Tape.load(tape_path, store)
        assert final.verify(deep=True).ok
        assert final.torn_tail is None
        assert store.verify() == []
    print(
        f"tape crash: {TRIALS} writers killed; {torn_seen} tore a record themselves, "
        f"{clean_kills} died between records and got a torn record appended; every torn tail "
        f"reported and cut by open_append; {len(final.frames)} frames verify"
    )


def test_a_zero_filled_tail_is_a_torn_tail_not_tampering(tmp_path: Path) -> None:
    """A record in flight at a power cut can leave the file longer with zeros where its bytes
    should be; 4 KiB of zeros was once reported as 113 tampered frames."""
    path = tmp_path / "t.jbx"
    with Store.open(tmp_path / "store") as store:
        with TapeWriter.create(path, store, "zeros", fsync=False) as w:
            w.append("run_start", {})
            w.append("note", {"n": 1})
        size = os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(bytes(4096))
        tape = Tape.load(path, store)
        assert len(tape.frames) == 2
        problems = tape.verify(deep=True).problems
        assert [type(p) for p in problems] == [TornTape]
        assert "zeros" in str(problems[0])
        with TapeWriter.open_append(path, store) as w:
            w.append("exit", {"code": 0})
        assert os.path.getsize(path) > size
        assert Tape.load(path, store).verify(deep=True).ok
