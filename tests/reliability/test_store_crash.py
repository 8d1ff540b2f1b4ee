"""Store crash consistency: writers SIGKILLed at random moments while putting and flushing.

Each writer puts a mix of objects (small ones gathered in the write buffer, large ones written
straight through, deltas) and flushes every few puts; after each `flush()` returns it prints the
ids it made durable. The test kills it at a random moment, then reopens the store and demands:
every id a finished flush reported is readable (the read re-hashes it against its id), `verify()`
is clean, and the next writer works on top of whatever the crash left (a torn pack tail is cut,
an intact unindexed tail is adopted). Some trials run two writers at once over one store.

A SIGKILL loses the process, not the page cache: this proves process-crash consistency. Power
loss is covered by the fsync discipline (pack fsync before the index commit), not by this test.

JUKEBOX_STORE_CRASH_TRIALS sets the number of kills (default 10); JUKEBOX_STORE_CRASH_SEED the
sample.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from shadowfs.oid import ObjectId
from shadowfs.store import Store

REPO = Path(__file__).resolve().parents[2]
TRIALS = int(os.environ.get("JUKEBOX_STORE_CRASH_TRIALS", "10"))
SEED = int(os.environ.get("JUKEBOX_STORE_CRASH_SEED", "4242"))

WRITER = textwrap.dedent(
    """
    import random, sys
    from shadowfs.store import Store
    root, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    store = Store.open(root)
    batch, prev, i = [], None, 0
    print("ready", flush=True)
    while True:
        i += 1
        roll = rng.random()
        if roll < 0.05:
            data = rng.randbytes(1_500_000)  # past the write buffer: straight to the pack
        elif roll < 0.5:
            data = rng.randbytes(rng.randint(0, 3000))
        else:
            line = b"line %d of writer %d\\n" % (i, seed)
            data = line * rng.randint(1, 400)
        base = prev if prev is not None and rng.random() < 0.3 else None
        prev = store.put("blob", data, delta_base=base)
        batch.append(prev.hex())
        if len(batch) >= rng.randint(1, 12):
            store.flush()
            print(" ".join(batch), flush=True)
            batch = []
    """
)


def _writer(root: Path, seed: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), str(seed)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc


def _kill(proc: subprocess.Popen[str]) -> set[ObjectId]:
    """SIGKILL the writer; the ids on every complete line it printed are durable."""
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    durable: set[ObjectId] = set()
    for line in out.split("\n")[:-1]:  # the text after the last newline may be cut
        durable.update(ObjectId.from_hex(h) for h in line.split())
    return durable


def test_killed_writers_lose_nothing_a_finished_flush_made_durable(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    root = tmp_path / "store"
    Store.open(root).close()
    durable: set[ObjectId] = set()
    kills = 0
    for trial in range(TRIALS):
        writers = [_writer(root, SEED * 100 + trial * 2 + k) for k in range(1 + (trial % 4 == 3))]
        time.sleep(rng.uniform(0.02, 0.3))
        for proc in writers:
            durable |= _kill(proc)
            kills += 1
        with Store.open(root) as store:
            missing = [o for o in durable if not store.has(o)]
            assert missing == [], f"trial {trial}: {len(missing)} durable object(s) lost"
            for oid in rng.sample(sorted(durable), min(50, len(durable))):
                store.get(oid)
            assert store.verify() == [], f"trial {trial}"
    # Every durable object, read in full, from an index rebuilt from the packs alone.
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (root / name).unlink(missing_ok=True)
    with Store.open(root) as store:
        for oid in durable:
            store.get(oid)
        assert store.verify() == []
        packs = store.stats().packs
    print(
        f"store crash: {kills} writers killed in {TRIALS} trials, {len(durable)} durable objects "
        f"all present, {packs} pack(s), verify clean"
    )
    assert durable  # the writers got far enough to flush
