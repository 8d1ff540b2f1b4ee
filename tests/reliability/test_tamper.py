"""Tampering at scale: random byte damage across a realistic tape and a multi-pack store, and
verification must catch every single trial.

Each trial damages a copy of the tape (or the live pack, restored afterwards) with 1 to 4 random
byte changes, or with a structural edit (records swapped, duplicated, dropped, cut). The tape is
checked with `Tape.load(path, store).verify(deep=True)`, the store with `Store.verify()`; a trial
counts as caught when load refuses the file or verify reports a problem. Reads of damaged objects
must never return wrong bytes.

JUKEBOX_TAMPER_TRIALS sets the trials per medium (default 2,000); JUKEBOX_TAMPER_SEED the sample.
"""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jukebox.errors import JukeboxError
from jukebox.tape.tape import HEADER_SIZE, Tape, TapeWriter
from shadowfs.errors import StoreError
from shadowfs.oid import ObjectId
from shadowfs.store import Store, encode_chunks
from shadowfs.tree import build_tree

TRIALS = int(os.environ.get("JUKEBOX_TAMPER_TRIALS", "2000"))
SEED = int(os.environ.get("JUKEBOX_TAMPER_SEED", "1337"))
FRAMES = 40


@dataclass
class World:
    root: Path
    tape: Path
    contents: dict[ObjectId, bytes]


def _source_like(i: int, n: int) -> bytes:
    line = f"def handler_{i}(request):\n    return respond(request, code={i})\n".encode()
    return (line * (n // len(line) + 1))[:n]


def _fill_tree(path: Path, rng: random.Random) -> None:
    for d in range(4):
        sub = path / f"pkg{d}"
        sub.mkdir(parents=True)
        for f in range(6):
            (sub / f"mod{f}.py").write_bytes(_source_like(d * 10 + f, rng.randint(0, 3000)))
    (path / "data.bin").write_bytes(rng.randbytes(5000))
    (path / "link").symlink_to("pkg0/mod0.py")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("tamper")
    rng = random.Random(SEED)
    root = tmp / "store"
    contents: dict[ObjectId, bytes] = {}
    # Two stores writing at once get a pack each, so damage is spread over several packs.
    with Store.open(root) as a, Store.open(root) as b:
        for i in range(30):
            store = a if i % 2 else b
            data = _source_like(i, 200 + 97 * i)
            oid = store.put("blob", data)
            contents[oid] = data
            if i % 3 == 0:
                d = data + b"# edited\n"
                contents[store.put("blob", d, delta_base=oid)] = d
        r = rng.randbytes(700)
        contents[a.put("blob", r)] = r
        contents[a.put("blob", b"")] = b""
        small = [o for o, v in contents.items() if v][:3]
        c = encode_chunks([(o, len(contents[o])) for o in small])
        contents[b.put("chunks", c)] = c
        a.flush()  # puts wait in memory until a flush: write while both hold their pack
        b.flush()
    src = tmp / "src"
    _fill_tree(src, rng)
    with Store.open(root) as store:
        trees = []
        for step in range(3):
            (src / f"step{step}.txt").write_bytes(b"step %d\n" % step)
            trees.append(build_tree(store, src))
        tape = tmp / "t.jbx"
        with TapeWriter.create(tape, store, "tamper-tape", fsync=False) as w:
            w.append("run_start", {"name": "tamper", "argv": ["agent"]}, time_ns=1)
            for i in range(1, FRAMES):
                if i % 7 == 0:
                    w.append("checkpoint", {"label": f"c{i}"}, tree=trees[i % 3], time_ns=i)
                elif i % 5 == 0:
                    # Large values spill into the store as json objects.
                    w.append("llm_turn", {"request": "x" * 6000, "model": "m"}, time_ns=i)
                elif i % 3 == 0:
                    w.append("fs", {"path": f"f{i}"}, refs=[list(contents)[i]], time_ns=i)
                else:
                    w.append("tool_call", {"tool": "sh", "argv": ["ls", str(i)]}, time_ns=i)
            w.append("exit", {"code": 0}, time_ns=FRAMES)
        assert Tape.load(tape, store).verify(deep=True).ok
        assert store.verify() == []
    assert len(list((root / "packs").glob("pack-*.pack"))) >= 2
    yield World(root, tape, contents)


def _flips(rng: random.Random, data: bytearray, lo: int = 0) -> None:
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(lo, len(data))
        data[at] ^= rng.randint(1, 255)


def _records(data: bytes) -> list[tuple[int, int]]:
    out, pos = [], HEADER_SIZE
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        out.append((pos, pos + 4 + n + 32))
        pos += 4 + n + 32
    return out


def _structural(rng: random.Random, good: bytes) -> bytes:
    recs = _records(good)
    parts = [good[a:b] for a, b in recs]
    edit = rng.randrange(4)
    if edit == 0:  # two frames swapped
        i, j = rng.sample(range(len(parts)), 2)
        parts[i], parts[j] = parts[j], parts[i]
    elif edit == 1:  # a frame replayed
        i = rng.randrange(len(parts))
        parts.insert(rng.randrange(len(parts) + 1), parts[i])
    elif edit == 2:  # a frame dropped from the middle
        del parts[rng.randrange(len(parts) - 1)]
    else:  # history cut and a later frame kept
        i = rng.randrange(1, len(parts) - 1)
        parts = parts[:i] + parts[i + 1 :]
    return good[:HEADER_SIZE] + b"".join(parts)


def test_every_tape_tampering_is_caught(world: World, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    good = world.tape.read_bytes()
    bad = tmp_path / "bad.jbx"
    missed: list[int] = []
    refused = reported = 0
    with Store.open(world.root) as store:
        for trial in range(TRIALS):
            if trial % 10 == 9:
                data = _structural(rng, good)
            else:
                damaged = bytearray(good)
                _flips(rng, damaged)
                data = bytes(damaged)
            if data == good:
                continue
            bad.write_bytes(data)
            try:
                tape = Tape.load(bad, store)
            except JukeboxError:
                refused += 1
                continue
            if tape.verify(deep=True).ok:
                missed.append(trial)
            else:
                reported += 1
    print(f"tape tampering: {TRIALS} trials, {refused} refused at load, {reported} reported")
    assert missed == []
    assert refused + reported >= TRIALS * 0.99  # only an identity edit may be skipped


def test_every_pack_tampering_is_caught(world: World) -> None:
    rng = random.Random(SEED + 1)
    packs = sorted((world.root / "packs").glob("pack-*.pack"))
    originals = {p: p.read_bytes() for p in packs}
    missed: list[tuple[str, list[int]]] = []
    wrong_bytes: list[str] = []
    caught = 0
    with Store.open(world.root) as store:
        for _ in range(TRIALS):
            pack = rng.choice(packs)
            good = originals[pack]
            damaged = bytearray(good)
            _flips(rng, damaged)
            changed = [i for i in range(len(good)) if damaged[i] != good[i]]
            fd = os.open(pack, os.O_WRONLY)
            try:
                for i in changed:
                    os.pwrite(fd, damaged[i : i + 1], i)
                if store.verify():
                    caught += 1
                else:
                    missed.append((pack.name, changed))
                # Reading must fail loudly or give the right bytes, never wrong ones.
                for oid in rng.sample(list(world.contents), 8):
                    try:
                        if store.get(oid) != world.contents[oid]:
                            wrong_bytes.append(str(oid))
                    except StoreError:
                        pass
            finally:
                for i in changed:
                    os.pwrite(fd, good[i : i + 1], i)
                os.close(fd)
        assert store.verify() == []
    print(f"pack tampering: {TRIALS} trials over {len(packs)} packs, {caught} caught")
    assert missed == []
    assert wrong_bytes == []
    assert {p: p.read_bytes() for p in packs} == originals
