"""Builds the hostile-tape corpus tests/data/hostile/: one tape dir as someone might send it.

Each tape is a trick a received tape dir can play on whoever opens it
(tests/reliability/test_hostile_tapes.py runs every reading command over each):

    image-path.jbx    run_start names its image `./evil.toml`, which its own base tree holds
                      (a host-writable image); its command writes on the host.
    loose-image.jbx   run_start records a host-writable image content under the name `host`.
    booth-7.jbx       a pending booth whose record (.jukebox/booths/booth-7.json) was edited
                      to point the tree at `victim` (relative: the opener's cwd), where a
                      commit would write .ssh/authorized_keys.
    flipped.jbx       one byte of a frame's payload flipped.
    truncated.jbx     the last record cut short (what a crash leaves).
    forged.jbx        a `commit` frame put in place of the exit, its own id re-hashed so it
                      looks valid, but its parent link names no frame of the tape.

The command of every tape writes MARKER on the host: a replay that ran it outside a read-only
host would leave the file there.

Re-create it (it refuses to overwrite an existing directory):

    rm -rf tests/data/hostile && .venv/bin/python tests/make_hostile_tapes.py
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from blake3 import blake3

from jukebox.tape.frame import canonical_json, encode_frame
from jukebox.tape.tape import Tape, TapeWriter
from shadowfs.oid import ObjectId
from shadowfs.store import Store
from shadowfs.tree import Entry, encode_tree

T0 = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z
MARKER = "/var/tmp/jukebox-hostile-tape-pwned"
RECORDER_TREE = "/home/mallory/work"
COMMAND = ["/bin/sh", "-c", f"echo pwned > {MARKER}"]
EVIL_IMAGE = b"""name = "evil"
net = "host"
[fs]
readonly_host = false
private_tmp = false
"""
LOOSE_CONTENT = {"name": "host", "net": "host",
                 "fs": {"readonly_host": False, "private_tmp": False}}  # fmt: skip
HELLO = b"hello from the sender\n"
KEYS = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMallory mallory@evil\n"


def _tree(store: Store, files: dict[bytes, bytes]) -> ObjectId:
    entries, dirs = [], {}
    for name, body in files.items():
        top, _, rest = name.partition(b"/")
        if rest:
            dirs.setdefault(top, {})[rest] = body
        else:
            entries.append(Entry(name, "file", 0o644, len(body), T0, store.put("blob", body), None))
    for name, sub in dirs.items():
        entries.append(Entry(name, "dir", 0o700, 0, T0, _tree(store, sub), None))
    return store.put("tree", encode_tree(sorted(entries, key=lambda e: e.name)))


def _booth_tape(
    path: Path, store: Store, tape_id: str, base: ObjectId, final: ObjectId, *,
    image: str = "host", sandbox_image: dict | None = None, verdict: str | None = "commit",
) -> None:  # fmt: skip
    start = {
        "tape_id": tape_id, "booth": tape_id, "name": None, "argv": COMMAND,
        "cwd": RECORDER_TREE, "tree": RECORDER_TREE, "base_tree": base.hex(), "image": image,
        "policy": {"image": image, "image_path": image, "net": "host", "fs": "fuse",
                   "readonly_host": False, "commit": "auto"},
        "host": {"hostname": "evil", "uid": 0},
        "env": {"names": ["PATH"], "secret_names": []},
    }  # fmt: skip
    if sandbox_image is not None:
        start["sandbox_image"] = sandbox_image
    with TapeWriter.create(path, store, tape_id) as w:
        w.append("run_start", start, tree=base, time_ns=T0)
        w.append("note", {"event": "agent_started", "ok": True, "pid": 7}, time_ns=T0 + 1)
        w.append("fs", {"reason": "exit"}, tree=final, time_ns=T0 + 2)
        w.append("exit", {"code": 0, "signal": None}, time_ns=T0 + 3)
        if verdict == "commit":
            w.append("commit", {"ok": True, "changes": 0, "by": "auto"}, tree=final,
                     time_ns=T0 + 4)  # fmt: skip


def _records(path: Path) -> list[tuple[int, int]]:
    """(offset, length) of each record's frame bytes."""
    data, pos, out = path.read_bytes(), 16, []
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        out.append((pos + 4, length))
        pos += 4 + length + 32
    return out


def build(target: Path) -> None:
    if target.exists():
        raise SystemExit(f"{target} exists: remove it first (see the docstring)")
    target.mkdir(parents=True)
    with Store.open(target / ".jukebox" / "store", create=True) as store:
        base = _tree(store, {b"hello.txt": HELLO})
        evil_base = _tree(store, {b"hello.txt": HELLO, b"evil.toml": EVIL_IMAGE})
        with_keys = _tree(store, {b"hello.txt": HELLO, b".ssh/authorized_keys": KEYS})
        store.flush()

        _booth_tape(target / "image-path.jbx", store, "image-path", evil_base, evil_base,
                    image="./evil.toml")  # fmt: skip
        digest = blake3(canonical_json(LOOSE_CONTENT)).hexdigest()  # as docs/reliability.md says
        loose = {"name": "host", "blake3": digest, "content": LOOSE_CONTENT}
        _booth_tape(target / "loose-image.jbx", store, "loose-image", base, base,
                    sandbox_image=loose)  # fmt: skip

        _booth_tape(target / "booth-7.jbx", store, "booth-7", base, with_keys, verdict=None)
        booths = target / ".jukebox" / "booths"
        booths.mkdir(parents=True)
        record = {
            "id": "booth-7", "tree": "victim", "base_tree": base.hex(),
            "final_tree": with_keys.hex(), "tape": str(target.resolve() / "booth-7.jbx"),
            "created": T0 / 1e9, "status": "pending", "name": None, "pid": None,
            "agent_status": 0, "verify": None, "note": None,
        }  # fmt: skip
        # The tape path is relative to the tape dir: whoever opens the corpus puts it elsewhere.
        record["tape"] = "booth-7.jbx"
        (booths / "booth-7.json").write_text(json.dumps(record, indent=1, sort_keys=True))

        for name in ("flipped", "truncated", "forged"):
            _booth_tape(target / f"{name}.jbx", store, name, base, base)

    flipped = target / "flipped.jbx"
    data = bytearray(flipped.read_bytes())
    offset, length = _records(flipped)[2]
    at = data.index(b'"exit"', offset, offset + length) + 1
    data[at] ^= 0x20  # "exit" -> "Exit": one bit of one payload byte
    flipped.write_bytes(bytes(data))

    truncated = target / "truncated.jbx"
    offset, length = _records(truncated)[-1]
    with open(truncated, "r+b") as f:
        f.truncate(offset + length // 2)

    forged = target / "forged.jbx"
    data = forged.read_bytes()
    offset, length = _records(forged)[3]
    raw = encode_frame(seq=3, kind="commit", time_ns=T0 + 3, parent=b"\x11" * 32,
                       mroot=b"\x22" * 32, payload={"ok": True, "by": "auto"}, refs=set(),
                       tree=None)  # fmt: skip
    digest = blake3(b"frame %d\x00" % len(raw) + raw).digest()
    record_bytes = struct.pack("<I", len(raw)) + raw + digest
    forged.write_bytes(data[: offset - 4] + record_bytes + data[offset + length + 32 :])


def check(target: Path) -> None:
    """The corpus says what it should: its tricks are where the docstring puts them."""
    with Store.open(target / ".jukebox" / "store", create=False) as store:
        for name in ("image-path", "loose-image", "booth-7"):
            Tape.load(target / f"{name}.jbx", store).verify(deep=True).raise_for_problems()
        assert Tape.load(target / "flipped.jbx").damage.seq == 2
        assert Tape.load(target / "forged.jbx").damage.seq == 3
        truncated = Tape.load(target / "truncated.jbx")
        assert truncated.damage is None and truncated.torn_tail is not None


def main(argv: list[str]) -> None:
    target = Path(argv[1]) if len(argv) > 1 else Path(__file__).parent / "data" / "hostile"
    build(target)
    check(target)
    print(f"wrote {target}")


if __name__ == "__main__":
    main(sys.argv)
