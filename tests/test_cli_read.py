"""The read side of the CLI, run as a user runs it: the real console script in a subprocess."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from jukebox.tape.tape import TapeWriter
from jukebox.tape.tapedir import TapeDir
from shadowfs import tree
from shadowfs.store import Store


def record_run(
    tape_dir: Path, work: Path, tape_id: str = "tr_demo", name: str = "demo-agent"
) -> Path:
    """A small run: two file states, a paid turn and a verdict, written with the real writer."""
    home = TapeDir(tape_dir)
    tape_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "notes.txt").write_text("line one\nline two\n")
    with Store.open(home.store_path) as store:
        base = tree.build_tree(store, work)
        writer = TapeWriter.create(home.tape_path(tape_id), store, tape_id)
        writer.append("run_start", {"tape_id": tape_id, "name": name, "argv": ["agent"]}, tree=base)
        writer.append(
            "agent_turn", {"agent_name": "planner", "message": "edit notes", "cost_usd": 0.008}
        )
        (work / "notes.txt").write_text("line one\nline 2\n")
        (work / "new file.py").write_text("print('hi')\n")
        after = tree.build_tree(store, work, previous=base)
        writer.append("checkpoint", {"label": "edited"}, tree=after)
        writer.append("commit", {"changes": 2}, tree=after)
        writer.close()
    return home.tape_path(tape_id)


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    return record_run(tmp_path / "tapes", tmp_path / "work")


def test_ls_lists_tapes_as_table_and_json(recorded: Path, jukebox_cli) -> None:
    out = jukebox_cli("ls", check=True).stdout
    header, row = out.splitlines()
    assert header.split() == [
        "TRACK", "ID", "STARTED", "AGENT", "NAME", "FRAMES", "COST", "STATUS"
    ]
    track, day, clock, zone, *rest = row.split()
    assert [track, *rest] == ["tr_demo", "demo-agent", "4", "$0.0080", "COMMITTED"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}", f"{day} {clock} {zone}")
    rows = json.loads(jukebox_cli("ls", "--json", check=True).stdout)
    assert [(r["tape_id"], r["frames"], r["status"]) for r in rows] == [("tr_demo", 4, "COMMITTED")]


def test_ls_ignores_a_tape_that_is_a_symlink(tmp_path: Path, recorded: Path, jukebox_cli) -> None:
    # A received tape dir links a "tape" to a file elsewhere: it is no tape of this dir.
    target = record_run(tmp_path / "elsewhere", tmp_path / "work2", tape_id="tr_other")
    (recorded.parent / "linked.jbx").symlink_to(target)
    rows = json.loads(jukebox_cli("ls", "--json", check=True).stdout)
    assert [r["tape_id"] for r in rows] == ["tr_demo"]
    assert TapeDir(recorded.parent).tape_paths() == [recorded]


def test_log_shows_every_frame(recorded: Path, jukebox_cli) -> None:
    out = jukebox_cli("log", "tr_demo", check=True).stdout
    assert re.search(r", started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}, ", out), out
    for marker in ("@0", "run_start", "planner: edit notes", "'edited'", "commit"):
        assert marker in out
    frames = json.loads(jukebox_cli("log", str(recorded), "--json", check=True).stdout)["frames"]
    assert [f["kind"] for f in frames] == ["run_start", "agent_turn", "checkpoint", "commit"]


def test_verify_and_replay_succeed_on_an_intact_tape(recorded: Path, jukebox_cli) -> None:
    assert jukebox_cli("verify", "tr_demo", check=True).stdout.startswith("ok: 4 frame(s) verified")
    out = jukebox_cli("replay", str(recorded), check=True).stdout
    assert "replayed 4 frame(s) of tr_demo offline: 3 file state(s) rebuilt" in out
    data = json.loads(jukebox_cli("replay", "tr_demo", "--json", check=True).stdout)
    assert data["ok"] and data["file_states"] == 3


def one_line_error(proc, code: int) -> str:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_flipped_byte_is_tampering_exit_1(recorded: Path, jukebox_cli) -> None:
    data = bytearray(recorded.read_bytes())
    data[60] ^= 0x01
    recorded.write_bytes(bytes(data))
    line = one_line_error(jukebox_cli("verify", "tr_demo"), 1)
    assert "altered at frame 0" in line
    one_line_error(jukebox_cli("replay", "tr_demo"), 1)


def test_truncated_tape_is_torn_exit_1(recorded: Path, jukebox_cli) -> None:
    os.truncate(recorded, recorded.stat().st_size - 5)
    line = one_line_error(jukebox_cli("verify", "tr_demo"), 1)
    assert "torn record" in line and "3 frame(s) before it are intact" in line


def test_foreign_file_is_input_error_exit_2(tmp_path: Path, jukebox_cli) -> None:
    foreign = tmp_path / "notes.jbx"
    foreign.write_text("just some text\n")
    assert "is not a Jukebox tape" in one_line_error(jukebox_cli("verify", str(foreign)), 2)


def test_missing_object_is_named_exit_1(recorded: Path, tmp_path: Path, jukebox_cli) -> None:
    home = TapeDir(tmp_path / "tapes")
    with Store.open(home.store_path) as store:
        kept = store.gc(set(), grace_seconds=0)
    assert kept.removed > 0
    assert "missing from the store" in one_line_error(jukebox_cli("verify", "tr_demo"), 1)


def test_bad_arguments_get_one_line_exit_2(recorded: Path, jukebox_cli) -> None:
    assert "no tape 'nope'" in one_line_error(jukebox_cli("log", "nope"), 2)
    assert "there is no frame 9" in one_line_error(jukebox_cli("diff", "tr_demo@9"), 2)
    assert "bad frame selector" in one_line_error(jukebox_cli("diff", "tr_demo@x"), 2)
    assert "--bogus" in one_line_error(jukebox_cli("ls", "--bogus"), 2)
    # A mistyped --tape-dir is an error for both listings, not an empty list.
    for listing in (("ls",), ("booth", "ls")):
        missing = one_line_error(jukebox_cli(*listing, "--tape-dir", "/nonexistent-tapes"), 2)
        assert "the tape dir /nonexistent-tapes does not exist" in missing


def test_a_mistyped_tape_dir_variable_is_named(recorded: Path, jukebox_cli, tmp_path: Path) -> None:
    env = {"JUKEBOX_TAPE_DIR": str(tmp_path / "tapse")}
    for command in (("ls",), ("booth", "ls"), ("log", "tr_demo"), ("gc",), ("booth", "diff", "x")):
        line = one_line_error(jukebox_cli(*command, env=env), 2)
        assert f"JUKEBOX_TAPE_DIR={tmp_path / 'tapse'} does not exist" in line
    assert "is not a directory" in one_line_error(jukebox_cli("ls", "--tape-dir", "/dev/null"), 2)
    # Unset, the default is the XDG data dir, and its absence only means nothing is recorded.
    listed = jukebox_cli("ls", env={"JUKEBOX_TAPE_DIR": "", "XDG_DATA_HOME": str(tmp_path / "xdg")})
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == f"no tapes in {tmp_path / 'xdg' / 'jukebox' / 'tapes'}"


def test_log_says_a_skipped_verifier_and_a_killing_signal_as_such(
    tmp_path: Path, jukebox_cli
) -> None:
    home = TapeDir(tmp_path / "tapes")
    with Store.open(home.store_path, create=True) as store:
        writer = TapeWriter.create(home.tape_path("killed"), store, "killed")
        writer.append("run_start", {"tape_id": "killed", "argv": ["agent"]})
        writer.append("exit", {"code": None, "signal": 15})
        writer.append(
            "verify", {"cmd": ["make", "test"], "skipped": "the agent failed", "ok": False}
        )
        writer.close()
    out = jukebox_cli("log", "killed", "--tape-dir", str(home.path), check=True).stdout
    assert "killed by SIGTERM" in out and "signal 15" not in out, out
    assert "skipped (the agent failed) make test" in out and "FAILED" not in out, out


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (("verify", "tr_demo@1"), "drop the @1"),
        (("log", "tr_demo@1"), "drop the @1"),
        (("replay", "tr_demo@1"), "--exec --until 1 serves frames 0..1"),
        (("replay", "tr_demo@1", "--exec"), "--until 1 serves frames 0..1"),
        (("fork", "tr_demo@1", "--at", "2", "--model", "m"), "--at 1"),
    ],
)
def test_a_frame_given_to_a_whole_tape_command_is_refused_not_ignored(
    recorded: Path, jukebox_cli, args: tuple[str, ...], hint: str
) -> None:
    error = one_line_error(jukebox_cli(*args), 2)
    assert f"`jukebox {args[0]}` takes a whole tape, not frame @1" in error and hint in error


def test_diff_between_frames_names_changes(recorded: Path, jukebox_cli) -> None:
    out = jukebox_cli("diff", "tr_demo@0", "tr_demo@2", "--patch", check=True).stdout
    assert "2 change(s)" in out
    assert "M  notes.txt" in out and "A  new file.py" in out
    assert "-line two" in out and "+line 2" in out
    assert "0 change(s)" in jukebox_cli("diff", "tr_demo@3", check=True).stdout
    first = jukebox_cli("diff", "tr_demo@0", check=True).stdout.splitlines()[0]
    assert first == f"diff {recorded}@0 (against an empty tree): 1 change(s)", first
    data = json.loads(jukebox_cli("diff", "tr_demo@2", "--json", check=True).stdout)
    assert sorted((c["path"], c["status"]) for c in data["changes"]) == [
        ("new file.py", "added"),
        ("notes.txt", "modified"),
    ]


def test_gc_keeps_what_tapes_reference_and_drops_the_rest(
    recorded: Path, tmp_path: Path, jukebox_cli
) -> None:
    home = TapeDir(tmp_path / "tapes")
    with Store.open(home.store_path) as store:
        orphan = store.put("blob", b"nobody references me")
        store.flush()
    dry = json.loads(jukebox_cli("gc", "--grace", "0", "--dry-run", "--json", check=True).stdout)
    assert dry["removed"] == 1 and dry["dry_run"]
    done = json.loads(jukebox_cli("gc", "--grace", "0", "--json", check=True).stdout)
    assert done["removed"] == 1
    with Store.open(home.store_path) as store:
        assert not store.has(orphan)
    assert jukebox_cli("replay", "tr_demo").returncode == 0


def test_golden_tape_verifies_from_the_command_line(tmp_path: Path, jukebox_cli) -> None:
    import shutil

    golden = Path(__file__).parent / "data" / "golden"
    copy = tmp_path / "golden"
    shutil.copytree(golden, copy)  # opening a store writes lock files: never touch the original
    out = jukebox_cli("verify", str(copy / "tape.jbx"), check=True).stdout
    assert out.startswith("ok: 10 frame(s) verified")
    assert "objects not checked" not in out
    assert "status COMMITTED" in jukebox_cli("replay", str(copy / "tape.jbx"), check=True).stdout


def test_a_closed_pipe_ends_quietly_as_for_any_unix_tool(recorded: Path, tmp_path: Path) -> None:
    """`jukebox diff A@0 A | head -1`: the reader is gone; no traceback, no internal error."""
    import signal
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "jukebox"
    env = dict(os.environ, JUKEBOX_TAPE_DIR=str(tmp_path / "tapes"))
    for args in (("diff", "tr_demo@0", "tr_demo"), ("log", "tr_demo"), ("ls",)):
        read_end, write_end = os.pipe()
        os.close(read_end)  # every write to stdout now fails with EPIPE
        try:
            proc = subprocess.run(
                [str(exe), *args], stdout=write_end, stderr=subprocess.PIPE, text=True, env=env
            )
        finally:
            os.close(write_end)
        assert proc.returncode == 128 + signal.SIGPIPE, (args, proc.stderr)
        assert proc.stderr == "", (args, proc.stderr)
