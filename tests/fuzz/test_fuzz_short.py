"""The short fuzz pass of `make test`: every target over its seeds and seeded mutations, the
inputs that once broke a target, and one real atheris run proving the long runner reports a
broken target. `make fuzz` runs the coverage-guided search for minutes (see docs/reliability.md).

JUKEBOX_FUZZ_SEED picks another mutation sample; JUKEBOX_FUZZ_SCALE multiplies the counts.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.booth.control import ControlServer, Peer, RequestError, validate
from jukebox.tape.errors import TamperedTape
from jukebox.tape.frame import Frame, encode_frame, frame_id
from shadowfs.errors import StoreError
from shadowfs.store import Store
from tests.fuzz.common import run_short
from tests.fuzz.registry import all_targets

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("JUKEBOX_FUZZ_SEED", "7"))
SCALE = float(os.environ.get("JUKEBOX_FUZZ_SCALE", "1"))

# Mutations per target: the file-backed store targets pay for a sqlite index per input.
ITERATIONS = {
    "tape": 1500,
    "frame": 5000,
    "tree": 5000,
    "pack": 3000,
    "store": 150,
    "index": 150,
    "index-rows": 150,
    "control": 5000,
    "llm": 5000,
    "sql": 5000,
}

TARGETS = all_targets()


def test_every_target_has_a_short_budget() -> None:
    assert set(TARGETS) == set(ITERATIONS)


@pytest.mark.parametrize("name", sorted(ITERATIONS))
def test_target_holds_under_mutation(name: str) -> None:
    n = int(ITERATIONS[name] * SCALE)
    assert run_short(TARGETS[name], n, SEED) >= n


# --------------------------------------------------------------------- inputs that broke things


def test_deeply_nested_control_line_is_refused_not_a_dead_server(tmp_path: Path) -> None:
    line = b"[" * 100_000
    with pytest.raises(RequestError, match="nests too deeply"):
        validate(line)
    server = ControlServer(
        str(tmp_path / "s"), {op: lambda r, p: {} for op in ("checkpoint", "rollback", "status")}
    )
    try:
        answer = json.loads(server.dispatch(line, Peer(1, 0, 0)))
    finally:
        server.close()
    assert answer["ok"] is False


@pytest.mark.parametrize("ref", [5, "zz", "00" * 31, None])
def test_a_hostile_spilled_value_reference_is_tampering(tmp_path: Path, ref: object) -> None:
    raw = encode_frame(
        seq=0, kind="note", time_ns=1, parent=None, mroot=bytes(32), payload={"x": {"$blob": ref}}
    )
    with (
        Store.open(tmp_path / "store") as store,
        pytest.raises(TamperedTape, match="does not name a stored JSON value"),
    ):
        Frame(raw, frame_id(raw)).resolve_payload(store)


def test_a_spilled_reference_to_non_json_bytes_is_tampering(tmp_path: Path) -> None:
    with Store.open(tmp_path / "store") as store:
        oid = store.put("blob", b"\xff not json")
        raw = encode_frame(
            seq=0,
            kind="note",
            time_ns=1,
            parent=None,
            mroot=bytes(32),
            payload={"x": {"$blob": oid.hex()}},
        )
        with pytest.raises(TamperedTape):
            Frame(raw, frame_id(raw)).resolve_payload(store)


def _store_with_index(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    with Store.open(root) as store:
        store.put("blob", b"one")
        store.put("blob", b"two")
    return root


@pytest.mark.parametrize(
    ("sql", "value"),
    [
        ("UPDATE objects SET pack=?", "pack-/../../../etc/passwd.pack"),
        ("UPDATE objects SET pack=?", "pack-\0.pack"),
        ("UPDATE objects SET oid=? WHERE oid IN (SELECT oid FROM objects LIMIT 1)", b"short"),
        ("UPDATE objects SET stored_len=?", 1 << 62),
        ("UPDATE objects SET offset=?", -5),
        ("UPDATE packs SET name=?", "pack-/../../x.pack"),
    ],
)
def test_a_hostile_index_row_is_a_clear_store_error(
    tmp_path: Path, sql: str, value: object
) -> None:
    root = _store_with_index(tmp_path)
    conn = sqlite3.connect(root / "index.sqlite")
    conn.execute(sql, (value,))
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="unusable"), Store.open(root) as store:
        for oid in store.iter_oids():
            store.get(oid)
        store.verify()
        store.put("blob", b"three")
        store.flush()


def test_an_index_with_invalid_utf8_text_is_a_clear_store_error(tmp_path: Path) -> None:
    root = _store_with_index(tmp_path)
    conn = sqlite3.connect(root / "index.sqlite")
    conn.execute("UPDATE meta SET value=CAST(x'ff31' AS TEXT) WHERE key='format'")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="unusable"):
        Store.open(root)


def test_a_deeply_nested_request_body_is_recorded_as_text() -> None:
    from tests.fuzz.fuzz_llm import llm_input

    llm_input(bytes([0x20]) + b"[" * 100_000)


def test_an_index_placing_a_delta_base_in_a_missing_pack_does_not_break_open(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    with Store.open(root) as store:
        text = b"shared text of some length\n" * 50
        base = store.put("blob", text)
        delta = store.put("blob", text + b"more", delta_base=base)
    conn = sqlite3.connect(root / "index.sqlite")
    conn.execute("UPDATE objects SET pack=? WHERE oid=?", ("pack-" + "cd" * 16 + ".pack", base))
    conn.execute("DELETE FROM objects WHERE oid=?", (delta,))
    conn.execute("UPDATE packs SET size=8")  # so the next open re-adopts the delta record
    conn.commit()
    conn.close()
    with Store.open(root) as store:
        assert store.verify()
        assert not store.has(delta)


# --------------------------------------------------------------------- the long runner itself


def test_atheris_runner_holds_and_reports_a_broken_target(tmp_path: Path) -> None:
    """A real, instrumented atheris run of two targets plus the canary, which always breaks."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fuzz",
            "--only",
            "control,tree,canary",
            "--runs",
            "2000",
            "--seconds",
            "20",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "BROKE" in lines["canary"]
    assert list((tmp_path / "crashes").glob("canary-crash-*"))
    for name in ("control", "tree"):
        assert " ok " in lines[name], proc.stdout
        assert int(lines[name].split()[2]) >= 2000
