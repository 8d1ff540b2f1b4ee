"""A tape dir received from someone else cannot hurt the user who opens it.

The corpus in tests/data/hostile (made by tests/make_hostile_tapes.py; its docstring lists the
tricks) is copied into a fresh home dir, as if received; every command that reads a tape runs
over every tape as a user runs it (the console script, cwd the home dir). The safe outcome is a
refusal or a damage mark, never a traceback, never a write outside the tape dir (the home dir
around it is hashed before and after, and the host marker the tapes' command writes must not
appear).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.booth.conftest import nobody_dir  # noqa: F401  (a fixture)
from tests.make_hostile_tapes import MARKER
from tests.reliability.conftest import JUKEBOX, tree_state

CORPUS = Path(__file__).resolve().parent.parent / "data" / "hostile"
DAMAGED = {"flipped": 2, "forged": 3}  # tape -> the first frame the chain does not vouch for
INTACT = ("image-path", "loose-image", "booth-7", "truncated")


def jb(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "JUKEBOX_TAPE_DIR"}
    env["JUKEBOX_TAPE_DIR"] = str(home / "received")
    # Nothing listens on port 9: a replay that went live would fail, not spend.
    env["OPENAI_BASE_URL"] = "http://127.0.0.1:9/v1"
    env["ANTHROPIC_BASE_URL"] = "http://127.0.0.1:9"
    proc = subprocess.run(
        [JUKEBOX, *args], capture_output=True, text=True, cwd=home, env=env, timeout=120
    )
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode in (0, 1, 2, 130), (args, proc.returncode, proc.stderr)
    return proc


def jb_here(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The same command in this process (the CLI's own code and error handling, without an
    interpreter start per call); cwd the home dir. Only for commands that start no booth."""
    from click.testing import CliRunner

    from jukebox.cli import booth, cli, mount, tapes, timetravel, view  # noqa: F401  (registers)

    old = os.getcwd()
    os.chdir(home)
    try:
        env = {"JUKEBOX_TAPE_DIR": str(home / "received")}
        result = CliRunner().invoke(cli, list(args), env=env)
    finally:
        os.chdir(old)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: {result.exception!r}") from result.exception
    proc = subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)
    assert proc.returncode in (0, 1, 2), (args, proc.returncode, proc.stderr)
    return proc


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def outside(home: Path) -> dict:
    """The home dir around the received tape dir, hashed."""
    return {k: v for k, v in tree_state(home).items() if not k.startswith("received")}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("booths here run as root")
    home = tmp_path / "home"
    home.mkdir()
    shutil.copytree(CORPUS, home / "received")
    (home / "victim").mkdir()  # where the edited booth record points the tree
    with open(MARKER, "a"):
        pass
    os.unlink(MARKER)
    return home


def test_every_reading_command_over_every_hostile_tape(home: Path) -> None:
    before = outside(home)
    tapes = home / "received"
    for name in (*DAMAGED, *INTACT):
        tape = str(tapes / f"{name}.jbx")
        runs = {
            "log": jb_here(home, "log", tape),
            "log --json": jb_here(home, "log", tape, "--json"),
            "verify": jb_here(home, "verify", tape),
            "replay": jb_here(home, "replay", tape),
            "diff @N": jb_here(home, "diff", f"{tape}@2"),
            "diff A B": jb_here(home, "diff", tape, str(tapes / "image-path.jbx")),
            "fork": jb_here(home, "fork", tape, "--at", "1", "--tape-id", f"{name}-f"),
        }
        # The viewer's page shows a damaged tape up to the damage, marked, and writes only
        # where it was told (inside the received dir here, which `outside` leaves out).
        page = tapes / f"{name}.html"
        viewed = jb_here(home, "view", tape, "--html", str(page))
        assert viewed.returncode == 0 and page.stat().st_size > 0, (name, viewed.stderr)
        if name in DAMAGED:
            assert f"was altered at frame {DAMAGED[name]}" in page.read_text(), name
        if name not in ("image-path", "loose-image"):  # those replay in tests of their own
            runs["replay --exec"] = jb(home, "replay", tape, "--exec", "--no-record")
        if name in DAMAGED:
            mnt = home / "received" / "mnt"
            mnt.mkdir(exist_ok=True)
            runs["mount"] = jb_here(home, "mount", f"{tape}@1", str(mnt))
            if os.path.ismount(mnt):  # a regression: leave no mount behind, then fail below
                subprocess.run([JUKEBOX, "umount", str(mnt)], capture_output=True)
            seq = DAMAGED[name]
            for what, proc in runs.items():
                assert proc.returncode == 1, (name, what, proc.stderr)
                said = proc.stderr + proc.stdout  # --json says it in its output
                assert f"was altered at frame {seq}" in said, (name, what, said)
            assert not (tapes / f"{name}-f.jbx").exists()
            assert not os.path.ismount(mnt)
        else:
            assert runs["log"].returncode == 0 and runs["diff @N"].returncode == 0, name
    assert not os.path.exists(MARKER), "a replay wrote on the host"
    for args in (("ls",), ("ls", "--json"), ("booth", "ls"), ("gc", "--dry-run")):
        jb_here(home, *args)
    for verb in ("diff", "commit", "discard"):
        jb_here(home, "booth", verb, "booth-7")
    assert outside(home) == before
    assert not os.path.exists(MARKER)


def test_a_flipped_byte_is_shown_up_to_the_damage_and_marked_in_ls(home: Path) -> None:
    tape = str(home / "received" / "flipped.jbx")
    proc = jb(home, "log", tape)
    assert proc.returncode == 1
    assert "flipped.jbx was altered at frame 2" in one_line(proc)
    assert "DAMAGED" in proc.stdout.splitlines()[0]
    assert [line.split()[0] for line in proc.stdout.splitlines()[2:]] == ["@0", "@1"]
    data = json.loads(jb(home, "log", tape, "--json").stdout)
    assert [f["seq"] for f in data["frames"]] == [0, 1] and "frame 2" in data["damage"]
    rows = {r["track_id"]: r for r in json.loads(jb(home, "ls", "--json").stdout)}
    for name in DAMAGED:
        assert rows[name]["damaged"] is True and rows[name]["status"] == "DAMAGED"
        assert rows[name]["damaged_at"] == DAMAGED[name]
    for name in INTACT:
        assert rows[name]["damaged"] is False and rows[name]["status"] != "DAMAGED"
    assert rows["truncated"]["torn"] is True
    table = {line.split()[0]: line for line in jb(home, "ls").stdout.splitlines()[1:]}
    assert table["flipped"].endswith("DAMAGED") and table["forged"].endswith("DAMAGED")
    assert table["truncated"].endswith("(torn)")


def test_a_forged_frame_with_a_valid_id_is_refused_where_it_breaks_the_chain(home: Path) -> None:
    tape = str(home / "received" / "forged.jbx")
    proc = jb(home, "log", tape)
    assert proc.returncode == 1
    assert "was altered at frame 3: its parent link does not name the frame before it" in (
        proc.stderr
    )
    assert "commit" not in proc.stdout  # the forged verdict is never shown as a frame


def test_a_truncated_tape_is_read_up_to_its_torn_tail(home: Path) -> None:
    proc = jb(home, "log", str(home / "received" / "truncated.jbx"))
    assert proc.returncode == 0
    assert "warning: torn tail" in proc.stderr
    assert jb(home, "verify", str(home / "received" / "truncated.jbx")).returncode == 1


def test_an_image_named_as_a_path_by_the_tape_is_never_loaded(home: Path) -> None:
    proc = jb(home, "replay", str(home / "received" / "image-path.jbx"), "--exec")
    # Under the built-in image the host is read-only: the command's write fails, so the run
    # diverges at its exit status; on the tape's own evil.toml it would have succeeded.
    assert not os.path.exists(MARKER)
    assert proc.returncode == 1, proc.stderr
    assert "records no image content to compare; this run used 'host'" in proc.stderr
    assert "the agent's status differs" in proc.stderr
    # Asked for, the recorded image does not exist: the name is never resolved as a path.
    proc = jb(home, "replay", str(home / "received" / "image-path.jbx"), "--exec",
              "--image", "recorded")  # fmt: skip
    assert proc.returncode == 2
    assert "records no image content" in one_line(proc)
    assert not os.path.exists(MARKER)


def test_a_loosened_recorded_image_is_reported_and_needs_confirmation(home: Path) -> None:
    tape = str(home / "received" / "loose-image.jbx")
    proc = jb(home, "replay", tape, "--exec", "--json")
    assert not os.path.exists(MARKER)
    image = json.loads(proc.stdout.splitlines()[-1])["image"]
    assert image["name"] == "host" and image["loosened"] == []
    assert "differ in readonly_host, private_tmp" in image["difference"]
    assert "image: the tape was recorded under 'host'" in proc.stderr
    replays = sorted((home / "received").glob("loose-image-replay-*.jbx"))
    proc = jb(home, "replay", tape, "--exec", "--image", "recorded")
    assert proc.returncode == 2
    line = one_line(proc)
    assert "fs.readonly_host = false (the host is writable)" in line
    assert "fs.private_tmp = false" in line and "--trust-recorded-image" in line
    assert sorted((home / "received").glob("loose-image-replay-*.jbx")) == replays  # no booth
    proc = jb(home, "fork", tape, "--at", "1", "--exec", "--image", "recorded")
    assert proc.returncode == 2 and "--trust-recorded-image" in one_line(proc)
    assert not os.path.exists(MARKER)


def test_an_edited_booth_record_commits_nothing_anywhere(home: Path) -> None:
    before = outside(home)
    tapes = home / "received"
    tape_before = (tapes / "booth-7.jbx").read_bytes()
    for verb in ("commit", "diff", "discard"):
        proc = jb(home, "booth", verb, "booth-7")
        assert proc.returncode == 1, (verb, proc.stderr)
        line = one_line(proc)
        assert "does not match its tape: field 'tree'" in line, line
        assert "'victim'" in line and "/home/mallory/work" in line
    assert list((home / "victim").iterdir()) == []
    assert outside(home) == before
    assert (tapes / "booth-7.jbx").read_bytes() == tape_before  # no verdict frame either
    assert (tapes / ".jukebox" / "booths" / "booth-7.json").exists()
    listed = json.loads(jb(home, "booth", "ls", "--json").stdout)
    assert [(b["id"], b["status"]) for b in listed] == [("booth-7", "tampered")]


def forge_consistently(home: Path) -> dict:
    """What a sender who rewrites tape and record together makes: the tape's run_start names
    the victim dir as its tree, so the record pointing there matches it field for field."""
    from jukebox.tape.tape import Tape, TapeWriter
    from shadowfs.store import Store

    victim = str(home / "victim")
    tape_path = home / "received" / "booth-7.jbx"
    with Store.open(home / "received" / ".jukebox" / "store") as store:
        frames = [(f.kind, f.resolve_payload(store), f.tree)
                  for f in Tape.load(tape_path, store).frames]  # fmt: skip
        tape_path.unlink()
        with TapeWriter.create(tape_path, store, "booth-7") as w:
            for kind, payload, tree in frames:
                w.append(kind, {**payload, "tree": victim} if kind == "run_start" else payload,
                         tree=tree)  # fmt: skip
    path = home / "received" / ".jukebox" / "booths" / "booth-7.json"
    record = json.loads(path.read_text())
    record["tree"] = victim
    path.write_text(json.dumps(record))
    return record


def test_a_record_whose_final_tree_was_swapped_is_refused(home: Path) -> None:
    """Tape and record agree on the tree, but the record's final tree names another tree."""
    record = forge_consistently(home)
    last = record["base_tree"][-1]
    record["final_tree"] = record["base_tree"][:-1] + ("0" if last != "0" else "1")
    (home / "received" / ".jukebox" / "booths" / "booth-7.json").write_text(json.dumps(record))
    proc = jb(home, "booth", "commit", "booth-7")
    assert proc.returncode == 1
    assert "field 'final_tree'" in one_line(proc)
    assert list((home / "victim").iterdir()) == []


def test_a_booth_forged_whole_is_never_committed(home: Path) -> None:
    """Tape and record rewritten together pass the binding; the record carries no seal of this
    user's, so commit refuses; diff still shows what the sender proposes."""
    forge_consistently(home)
    before = outside(home)
    proc = jb(home, "booth", "commit", "booth-7", "--allow-hooks")
    assert proc.returncode == 1
    assert "booth booth-7 was not run by this user here" in one_line(proc)
    assert list((home / "victim").iterdir()) == [] and outside(home) == before
    proc = jb(home, "booth", "diff", "booth-7")
    assert proc.returncode == 0 and ".ssh/authorized_keys" in proc.stdout, proc.stderr
    listed = json.loads(jb(home, "booth", "ls", "--json").stdout)
    assert [(b["id"], b["status"]) for b in listed] == [("booth-7", "foreign")]


def test_a_custom_image_is_replayed_and_forked_and_never_swapped(tmp_path: Path) -> None:
    """Honest use: a tape recorded under `--image ./mine.toml`, a custom image named like the
    built-in one, replays and forks from another directory; the replay reports the difference
    from the built-in image, and `--image recorded` runs the recorded content itself."""
    if os.geteuid() != 0:
        pytest.skip("booths here run as root")
    tree, tapes, elsewhere = tmp_path / "tree", tmp_path / "tapes", tmp_path / "elsewhere"
    tree.mkdir()
    elsewhere.mkdir()
    (tree / "a.txt").write_text("a\n")
    from jukebox.booth.images import load_image

    secret = json.dumps(list(load_image(None).env_secret))  # the built-in's: tighter limits only
    (tmp_path / "mine.toml").write_text(
        f'name = "host"\n[env]\nsecret = {secret}\n'
        '[limits]\nprocesses = 4096\nopen_files = 1024\nfile_size = "1G"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "JUKEBOX_TAPE_DIR"}

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([JUKEBOX, *args], capture_output=True, text=True, cwd=cwd,
                              env=env, timeout=120)  # fmt: skip
        assert "Traceback" not in proc.stderr
        return proc

    proc = run("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "m",
               "--image", "./mine.toml", "--", sys.executable, "-c",
               "open('b.txt', 'w').write('b')", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    from jukebox.booth.recorded_image import content_hash, image_from_record
    from jukebox.tape.tape import Tape

    start = Tape.load(tapes / "m.jbx").frames[0].payload
    recorded = start["sandbox_image"]
    assert recorded["blake3"] == content_hash(recorded["content"])
    assert recorded["content"]["limits"]["processes"] == 4096
    mine = load_image(str(tmp_path / "mine.toml"))
    assert image_from_record(recorded, "m").limits == mine.limits

    proc = run("replay", str(tapes / "m.jbx"), "--exec", "--json", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    image = json.loads(proc.stdout.splitlines()[-1])["image"]
    assert image["name"] == "host" and image["blake3"] != recorded["blake3"]
    assert image["difference"].endswith("they differ in limits")
    assert "image: the tape was recorded under 'host'" in proc.stderr  # not silently swapped

    proc = run("replay", str(tapes / "m.jbx"), "--exec", "--image", "recorded", "--json",
               cwd=elsewhere)  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # tighter than the built-in: no confirmation
    image = json.loads(proc.stdout.splitlines()[-1])["image"]
    assert image["blake3"] == recorded["blake3"] and image["difference"] is None
    replay = sorted(tapes.glob("m-replay-*.jbx"))[-1]
    assert Tape.load(replay).frames[0].payload["sandbox_image"]["blake3"] == recorded["blake3"]

    # A relative --image is the caller's file, found in the caller's cwd.
    proc = run("fork", str(tapes / "m.jbx"), "--at", "2", "--exec", "--image", "./mine.toml",
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "image:" not in proc.stderr  # the same content: nothing to report
    proc = run("fork", str(tapes / "m.jbx"), "--at", "2", "--exec", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert "differ in limits" in proc.stderr


# --------------------------------------------------------------------------- the Python API


def _function_tape(tape_dir: Path, module: str, file: str | None, tree_files: dict) -> Path:
    """A tape whose run_start names a tracked function `module:agent` and whose base tree holds
    `tree_files`: what a sender controls."""
    from jukebox.tape.tape import TapeWriter
    from shadowfs.store import Store
    from shadowfs.tree import Entry, encode_tree

    with Store.open(tape_dir / ".jukebox" / "store", create=True) as store:
        entries = [Entry(name.encode(), "file", 0o644, len(body), 0, store.put("blob", body), None)
                   for name, body in sorted(tree_files.items())]  # fmt: skip
        base = store.put("tree", encode_tree(entries))
        function = {"import_path": f"{module}:agent", "module": module, "qualname": "agent",
                    "file": file}  # fmt: skip
        path = tape_dir / "api.jbx"
        with TapeWriter.create(path, store, "api") as w:
            w.append("run_start", {
                "name": "api", "root": "/home/mallory/work", "cwd": "/home/mallory/work",
                "base_tree": base.hex(),
                "run": {"id": "r", "function": function, "transaction": 0,
                        "args": {"values": {}, "replayable": True}},
            }, tree=base)  # fmt: skip
            w.append("exit", {"code": 0})
    return path


def test_replay_and_diff_never_imports_code_the_tape_brought(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook or `python -c` has '' (the cwd) on sys.path: a module the tape's tree holds
    must not be imported from the scratch copy, nor a module file inside the tape dir run."""
    from jukebox.api.api import Tape

    monkeypatch.syspath_prepend("")
    marker = tmp_path / "pwned"
    body = f"open({str(marker)!r}, 'w').write('ran')\ndef agent():\n    return 1\n".encode()
    tapes = tmp_path / "received"
    tapes.mkdir()
    path = _function_tape(tapes, "jbx_hostile_in_tree", None, {"jbx_hostile_in_tree.py": body})
    with pytest.raises(ValueError, match="its module is not importable"):
        Tape.load(path).fork(1).replay_and_diff(endpoint="http://127.0.0.1:9/v1")
    assert not marker.exists()
    assert sorted(p.name for p in tapes.glob("*.jbx")) == ["api.jbx"]  # no B side was made

    other = tmp_path / "received-2"
    other.mkdir()
    (other / "evil.py").write_bytes(body)
    path = _function_tape(other, "jbx_hostile_in_dir", str(other / "evil.py"), {})
    with pytest.raises(ValueError, match="inside the tape dir itself"):
        Tape.load(path).fork(1).replay_and_diff(endpoint="http://127.0.0.1:9/v1")
    assert not marker.exists()


def test_as_nobody_the_same_tricks_fail_the_same_way(
    nobody_python: str, nobody_dir: Path, open_dev_fuse: None  # noqa: F811
) -> None:
    """An unprivileged user opening a received tape dir: the edited record commits nothing, the
    flipped tape is refused, the tape's image is not loaded (nobody may write /var/tmp)."""
    from tests.booth.conftest import NOBODY, run_py

    home = nobody_dir / "home"
    shutil.copytree(CORPUS, home / "received")
    (home / "victim").mkdir()
    for root, dirs, files in os.walk(nobody_dir):
        for name in (*dirs, *files):
            os.chown(os.path.join(root, name), NOBODY, NOBODY)
    with open(MARKER, "a"):
        pass
    os.unlink(MARKER)
    before = outside(home)

    def jb_nobody(*args: str) -> subprocess.CompletedProcess[str]:
        code = "import sys; from jukebox.cli import main; sys.argv[0] = 'jukebox'; main()"
        proc = run_py(code, *args, "--tape-dir", str(home / "received"), python=nobody_python,
                      user=NOBODY, cwd=str(home), timeout=120)  # fmt: skip
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc

    proc = jb_nobody("booth", "commit", "booth-7")
    assert proc.returncode == 1 and "field 'tree'" in one_line(proc)
    proc = jb_nobody("log", str(home / "received" / "flipped.jbx"))
    assert proc.returncode == 1 and "altered at frame 2" in proc.stderr
    proc = jb_nobody("replay", str(home / "received" / "image-path.jbx"), "--exec", "--no-record")
    assert proc.returncode == 1 and "the agent's status differs" in proc.stderr, proc.stderr
    assert not os.path.exists(MARKER)
    assert list((home / "victim").iterdir()) == []
    assert outside(home) == before


def test_a_real_pending_booth_binds_its_identity_and_seal(tmp_path: Path) -> None:
    """The user's own booth: an edited tree identity or seal is refused by name; as the run
    left it, the record commits."""
    if os.geteuid() != 0:
        pytest.skip("booths here run as root")
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "JUKEBOX_TAPE_DIR"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [JUKEBOX, "booth", args[0], "--tape-dir", str(tapes), *args[1:]]
        return subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env,
                              timeout=120)  # fmt: skip

    proc = run("run", "--tree", str(tree), "--tape-id", "own", "--commit", "never",
               "--", "/bin/sh", "-c", "echo new > new.txt")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    path = tapes / ".jukebox" / "booths" / "own.json"
    honest = json.loads(path.read_text())
    assert honest["tree_ino"] == os.stat(tree).st_ino and honest["seal"]
    listed = json.loads(run("ls", "--json").stdout)
    assert [(b["id"], b["status"]) for b in listed] == [("own", "pending")]
    for key, value, said in (("tree_ino", honest["tree_ino"] + 1, "field 'tree_ino'"),
                             ("seal", "0" * 64, "was not run by this user here")):  # fmt: skip
        path.write_text(json.dumps({**honest, key: value}))
        proc = run("commit", "own")
        assert proc.returncode == 1 and said in one_line(proc), proc.stderr
        assert not (tree / "new.txt").exists()
    path.write_text(json.dumps(honest))
    proc = run("commit", "own")
    assert proc.returncode == 0, proc.stderr
    assert (tree / "new.txt").read_text() == "new\n"


def test_the_corpus_holds_the_tricks_its_script_describes(tmp_path: Path) -> None:
    """Each tape is broken where tests/make_hostile_tapes.py says (a copy: opening a store
    writes its lock files)."""
    from tests.make_hostile_tapes import check

    shutil.copytree(CORPUS, tmp_path / "corpus")
    check(tmp_path / "corpus")


def test_a_record_that_is_not_one_is_refused_in_one_line(home: Path) -> None:
    booths = home / "received" / ".jukebox" / "booths"
    (booths / "junk.json").write_text('{"id": "junk", "tree": "victim", "hooks": ["rm -rf ~"]}')
    (booths / "garbage.json").write_text("not json at all")
    for name in ("junk", "garbage"):
        for verb in ("commit", "diff", "discard"):
            proc = jb(home, "booth", verb, name)
            assert proc.returncode == 1, (verb, proc.stderr)
            assert "is not a booth record" in one_line(proc)
    assert list((home / "victim").iterdir()) == []
