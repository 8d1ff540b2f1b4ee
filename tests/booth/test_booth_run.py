"""`jukebox booth run` end to end: real namespaces, the real FUSE layer, real commits."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.booth.conftest import NOBODY
from tests.conftest import slow

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

JUKEBOX = str(Path(sys.executable).parent / "jukebox")


@pytest.fixture
def work(tmp_path: Path) -> tuple[Path, Path]:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    (tree / "keep.txt").write_text("untouched\n")
    return tree, tapes


def jb(
    *args: str,
    cwd: Path | None = None,
    env: dict | None = None,
    python: str | None = None,
    user: int | None = None,
) -> subprocess.CompletedProcess[str]:
    cmd = [JUKEBOX, *args] if python is None else [python, "-m", "jukebox.cli.__main__", *args]
    if python is not None:
        cmd = [python, "-c", "from jukebox.cli import main; main()", *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    full_env = dict(
        os.environ, PATH=f"{Path(JUKEBOX).parent}:{os.environ.get('PATH', '')}", **(env or {})
    )
    return subprocess.run(
        cmd, capture_output=True, text=True, cwd=cwd or "/", env=full_env, timeout=slow(60)
    )


def booth_run(
    tree: Path, tapes: Path, script: str, *opts: str, **kw
) -> subprocess.CompletedProcess[str]:
    return jb(
        "booth",
        "run",
        "--tree",
        str(tree),
        "--tape-dir",
        str(tapes),
        "--tape-id",
        "t1",
        *opts,
        "--",
        "sh",
        "-c",
        script,
        **kw,
    )


def frames(tapes: Path, tape_id: str = "t1") -> list[dict]:
    proc = jb("log", str(tapes / f"{tape_id}.jbx"), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    return data["frames"] if isinstance(data, dict) else data


def leftovers(tapes: Path) -> list[str]:
    state = tapes / ".jukebox"
    return sorted(
        str(p.relative_to(state))
        for sub in ("booths", "scratch", "kept")
        if (state / sub).is_dir()
        for p in (state / sub).iterdir()
    )


EDIT = (
    "echo two >> a.txt && echo new > b.txt && jukebox booth checkpoint --label good && "
    "echo MISTAKE > a.txt && rm keep.txt && jukebox booth rollback --to good && "
    "cat a.txt && test -f keep.txt"
)


def test_auto_commit_after_rollback_from_inside_and_passing_verifier(work) -> None:
    tree, tapes = work
    proc = booth_run(tree, tapes, EDIT, "--verify", "grep -q two a.txt && test -f b.txt")
    assert proc.returncode == 0, proc.stderr
    assert "one\ntwo\n" in proc.stdout  # the agent saw the rollback while it kept running
    assert (tree / "a.txt").read_text() == "one\ntwo\n"
    assert (tree / "b.txt").read_text() == "new\n"
    assert (tree / "keep.txt").read_text() == "untouched\n"
    kinds = [f["kind"] for f in frames(tapes)]
    for kind in ("run_start", "checkpoint", "rollback", "fs", "exit", "verify", "commit"):
        assert kind in kinds, kinds
    assert leftovers(tapes) == []


def test_failing_verifier_rolls_back_with_zero_residue(work) -> None:
    tree, tapes = work
    before = sorted(os.listdir(tree))
    proc = booth_run(
        tree,
        tapes,
        "echo broken > a.txt; mkdir d; touch d/x",
        "--verify",
        "echo verifier says no; false",
    )
    assert proc.returncode == 1
    assert "rolled back" in proc.stderr and "verifier says no" in proc.stderr
    assert sorted(os.listdir(tree)) == before and (tree / "a.txt").read_text() == "one\n"
    verify = next(f for f in frames(tapes) if f["kind"] == "verify")
    payload = verify.get("payload", verify)
    assert payload["ok"] is False and "verifier says no" in payload["output"]
    assert leftovers(tapes) == []


def test_agent_status_is_the_run_status_and_failure_rolls_back(work) -> None:
    tree, tapes = work
    proc = booth_run(tree, tapes, "echo x > a.txt; exit 7")
    assert proc.returncode == 7
    assert (tree / "a.txt").read_text() == "one\n"


def test_never_keeps_pending_then_commit_from_another_process(work) -> None:
    tree, tapes = work
    proc = booth_run(tree, tapes, "echo two >> a.txt; echo new > b.txt", "--commit", "never")
    assert proc.returncode == 0, proc.stderr
    assert (tree / "a.txt").read_text() == "one\n" and not (tree / "b.txt").exists()
    listed = json.loads(jb("booth", "ls", "--json", "--tape-dir", str(tapes)).stdout)
    assert [(b["id"], b["status"]) for b in listed] == [("t1", "pending")]
    diff = jb("booth", "diff", "t1", "--tape-dir", str(tapes))
    assert diff.returncode == 0 and "M a.txt" in diff.stdout and "A b.txt" in diff.stdout
    done = jb("booth", "commit", "t1", "--tape-dir", str(tapes))
    assert done.returncode == 0, done.stderr
    assert (tree / "a.txt").read_text() == "one\ntwo\n" and (tree / "b.txt").read_text() == "new\n"
    assert json.loads(jb("booth", "ls", "--json", "--tape-dir", str(tapes)).stdout) == []
    assert frames(tapes)[-1]["kind"] == "commit"


def test_a_pending_booth_commits_one_of_its_checkpoints(work) -> None:
    tree, tapes = work
    script = (
        "echo two >> a.txt && jukebox booth checkpoint --label good && "
        "echo new > b.txt && jukebox booth checkpoint && rm keep.txt && echo worse > a.txt"
    )
    assert booth_run(tree, tapes, script, "--commit", "never").returncode == 0
    diff = jb("booth", "diff", "t1", "--at", "good", "--tape-dir", str(tapes))
    assert diff.returncode == 0, diff.stderr
    assert [line.split()[:2] for line in diff.stdout.splitlines()] == [["M", "a.txt"]]
    diff = jb("booth", "diff", "t1", "--at", "2", "--tape-dir", str(tapes))
    assert sorted(line.split()[:2] for line in diff.stdout.splitlines()) == [
        ["A", "b.txt"], ["M", "a.txt"]
    ]
    for at, message in (
        ("nope", "no checkpoint labelled 'nope': its labels are good, start"),
        ("9", "no checkpoint 9: it has 0, 1, 2 (0 is the start)"),
    ):
        bad = jb("booth", "commit", "t1", "--at", at, "--tape-dir", str(tapes))
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr
    assert (tree / "a.txt").read_text() == "one\n"  # nothing applied by the refusals
    done = jb("booth", "commit", "t1", "--at", "good", "--tape-dir", str(tapes))
    assert done.returncode == 0, done.stderr
    assert "committed checkpoint good of booth t1: 1 change(s)" in done.stdout
    assert (tree / "a.txt").read_text() == "one\ntwo\n"
    assert (tree / "keep.txt").exists() and not (tree / "b.txt").exists()
    last = frames(tapes)[-1]
    assert last["kind"] == "commit"
    assert last["payload"]["checkpoint"] == {"id": 1, "label": "good"}
    assert leftovers(tapes) == []


# Checkpoints an agent asks for over its kept connection: one after the booth folded its step
# (the checkpoint is then only a marker, answered before the layer's bookkeeping), then some
# while another thread keeps replacing a file, each rolled back to afterwards.
RACING = r"""
import json, os, sys, threading, time
from jukebox.booth.control import request
with open("a.txt", "w") as f:
    f.write("folded\n")
time.sleep(0.3)  # still for longer than the booth waits before folding a step
folded = request({"op": "checkpoint"})
done, state = threading.Event(), {"started": -1, "closed": -1}
def replace():
    i = 0
    while not done.is_set():
        state["started"] = i
        with open("c.tmp", "w") as f:
            f.write("%d\n" % i)
        os.replace("c.tmp", "c.txt")
        state["closed"] = i
        i += 1
writer = threading.Thread(target=replace)
writer.start()
raced = []
for _ in range(5):
    time.sleep(0.02)
    low = state["closed"]
    cp = request({"op": "checkpoint"})
    raced.append((cp["checkpoint"], low, state["started"]))
done.set()
writer.join()
seen = []
for n, low, high in raced:
    request({"op": "rollback", "to": n})
    value = int(open("c.txt").read()) if os.path.exists("c.txt") else -1  # none replaced yet
    seen.append((low, value, high))
request({"op": "rollback", "to": folded["checkpoint"]})
print(json.dumps({"folded": folded, "a": open("a.txt").read(),
                  "c": os.path.exists("c.txt"), "seen": seen}))
"""


def test_checkpoints_after_a_fold_and_racing_writes_roll_back_to_what_they_answered(work) -> None:
    tree, tapes = work
    proc = jb(
        "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "t1",
        "--commit", "never", "--", sys.executable, "-c", RACING,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["a"] == "folded\n" and out["c"] is False
    for low, value, high in out["seen"]:
        assert low <= value <= high, "a checkpoint holds the file as it was when asked for"
    checkpoints = {f["payload"]["id"]: f for f in frames(tapes) if f["kind"] == "checkpoint"}
    folded = out["folded"]
    assert checkpoints[folded["checkpoint"]]["tree"] == folded["tree"]
    assert checkpoints[folded["checkpoint"]]["seq"] == folded["frame"]
    assert len(checkpoints) == 6


def test_pending_commit_conflict_exits_1_and_lists_paths_then_discard(work) -> None:
    tree, tapes = work
    assert booth_run(tree, tapes, "echo agent > a.txt", "--commit", "never").returncode == 0
    (tree / "a.txt").write_text("someone else\n")
    proc = jb("booth", "commit", "t1", "--tape-dir", str(tapes))
    assert proc.returncode == 1 and "a.txt" in proc.stderr
    assert (tree / "a.txt").read_text() == "someone else\n"
    assert jb("booth", "discard", "t1", "--tape-dir", str(tapes)).returncode == 0
    assert leftovers(tapes) == [] and (tree / "a.txt").read_text() == "someone else\n"


def _drained(trash: Path) -> None:
    """Waits (no timing asserted) for the detached process that empties the commit trash."""
    deadline = time.monotonic() + slow(60)
    while trash.is_dir() and any(trash.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)


# The agent leaves what would be an attack on the host in an overlay's upper dir kept as it
# was: a setuid copy of a binary, a world-writable file given to another user, a mode-0 dir,
# a hard link and a symlink to a file outside the tree.
HOSTILE = (
    "cp /bin/true sid && chmod 4755 sid && echo w > w.txt && chmod 666 w.txt && "
    "(chown 1000:1000 w.txt || true) && mkdir -p d/e && echo x > d/e/f && ln w.txt d/hard && "
    "ln -s {victim} d/sym && chmod 0 d/e d"
)


def _loose_kept(kept: Path, uid: int) -> list[str]:
    """What in a kept scratch is not private for good: group or other bits, set-id or execute
    bits on a file, a directory without its owner's bits, another owner than ``uid``."""
    loose = []
    for p in [kept, *kept.rglob("*")]:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        is_dir = stat.S_ISDIR(st.st_mode)
        want = 0o700 if is_dir else 0o600
        if stat.S_IMODE(st.st_mode) & ~want or (is_dir and st.st_mode & want != want):
            loose.append(f"{p.relative_to(kept)} {oct(st.st_mode)}")
        elif st.st_uid != uid:
            loose.append(f"{p.relative_to(kept)} uid {st.st_uid}")
    return loose


@pytest.mark.parametrize(("fs", "verdict"), [("fuse", "commit"), ("overlay", "discard")])
def test_a_pending_booth_keeps_its_staged_files_until_its_commit_or_discard(
    work, fs: str, verdict: str
) -> None:
    # Freed at the booth's end, they are what ext4 without a journal scans past, for a minute,
    # at each file the commit then creates near them (docs/booth.md). Kept, they are made
    # private for good (the host sees the overlay's upper files with the agent's modes, and
    # no nosuid bind any more), and moved out of scratch/ to kept/.
    tree, tapes = work
    state = tapes / ".jukebox"
    victim = tree.parent / "victim"
    victim.write_text("host\n")
    victim.chmod(0o644)
    proc = jb("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "t1",
              "--fs", fs, "--commit", "never", "--", "sh", "-c",
              "echo t1 > t1.txt && " + HOSTILE.format(victim=victim))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    kept = state / "kept" / "t1"
    assert any(p.is_file() for p in kept.rglob("*"))
    assert _loose_kept(kept, 0) == [] and not (state / "scratch" / "t1").exists()
    if fs == "overlay":  # the agent's files are there, made private, the linked one unlinked
        upper = kept / "upper"
        assert stat.S_IMODE((upper / "sid").lstat().st_mode) == 0o600
        assert not (upper / "w.txt").exists() and (upper / "d" / "sym").is_symlink()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644 and victim.stat().st_uid == 0
    assert jb("booth", verdict, "t1", "--tape-dir", str(tapes)).returncode == 0
    assert not kept.exists()
    if verdict == "commit":
        assert (tree / "t1.txt").read_text() == "t1\n"
        assert (tree / "sid").is_file() and (tree / "d").is_dir()
        _drained(state / "commit-trash")
        assert not any((state / "commit-trash").iterdir())
    else:
        assert not (tree / "t1.txt").exists()
    assert leftovers(tapes) == []


@pytest.mark.parametrize("fs", ["fuse", "overlay"])
def test_an_unprivileged_pending_booth_keeps_its_scratch_and_its_commit_frees_it(
    nobody_python: str, nobody_dir: Path, nobody_tree: tuple[Path, Path], open_dev_fuse: None,
    fs: str,
) -> None:
    # As nobody the overlay's work dir is mode 000 and owned by nobody, and the agent makes an
    # unreadable directory too: the detached freer, running as nobody, must still empty it all.
    tree, tapes = nobody_tree
    state = tapes / ".jukebox"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return jb(*args, python=nobody_python, user=NOBODY, cwd=nobody_dir)

    victim = nobody_dir / "victim"
    victim.write_text("host\n")
    victim.chmod(0o644)
    os.chown(victim, NOBODY, NOBODY)
    proc = run("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "t1",
               "--fs", fs, "--commit", "never", "--", "sh", "-c",
               "echo two > a.txt && " + HOSTILE.format(victim=victim))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    kept = state / "kept" / "t1"
    assert kept.is_dir() and not (state / "scratch" / "t1").exists()
    assert _loose_kept(kept, NOBODY) == []
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert run("booth", "commit", "t1", "--tape-dir", str(tapes)).returncode == 0
    assert (tree / "a.txt").read_text() == "two\n"
    assert not kept.exists()
    _drained(state / "commit-trash")
    trash = state / "commit-trash"
    assert not trash.is_dir() or not any(trash.iterdir()), sorted(trash.rglob("*"))
    assert leftovers(tapes) == []


def test_opening_a_tape_dir_frees_a_finished_booths_kept_scratch(tmp_path: Path) -> None:
    # A commit killed after its booth was finished, before it freed the kept scratch (or the
    # recovery of such a commit): whoever opens the tape dir next frees it, in the background.
    from jukebox.tape.tapedir import TapeDir

    state = tmp_path / ".jukebox"
    for booth in ("done", "pending"):
        (state / "kept" / booth / "sub").mkdir(parents=True)
        (state / "kept" / booth / "sub" / "f").write_text("x")
    (state / "booths").mkdir()
    (state / "booths" / "pending.json").write_text("{}")
    TapeDir.opened(tmp_path)
    assert not (state / "kept" / "done").exists()
    _drained(state / "commit-trash")
    assert not any((state / "commit-trash").iterdir())
    assert (state / "kept" / "pending" / "sub" / "f").read_text() == "x"


def test_run_start_records_env_names_never_values(work) -> None:
    tree, tapes = work
    env = {"MY_API_KEY": "sk-very-secret-value", "PLAIN_SETTING": "visible-name-only"}
    proc = booth_run(tree, tapes, 'test "${#MY_API_KEY}" = 20', env=env)
    assert proc.returncode == 0, proc.stderr  # the agent got the value
    raw = (tapes / "t1.jbx").read_bytes()
    store = b"".join(
        p.read_bytes() for p in (tapes / ".jukebox" / "store").rglob("*") if p.is_file()
    )
    assert b"sk-very-secret-value" not in raw and b"visible-name-only" not in raw
    assert b"sk-very-secret-value" not in store
    start = frames(tapes)[0]
    text = json.dumps(start)
    assert "MY_API_KEY" in text and "PLAIN_SETTING" in text


def test_tape_dir_inside_the_tree_is_refused(work) -> None:
    tree, _ = work
    proc = booth_run(tree, tree / "tapes", "true")
    assert proc.returncode == 2 and "outside the tree" in proc.stderr


def test_unprivileged_booth(
    nobody_python: str, nobody_dir: Path, nobody_tree: tuple[Path, Path], open_dev_fuse: None
) -> None:
    tree, tapes = nobody_tree
    script = 'echo two >> a.txt && umount . 2>/dev/null; test "$(id -u)" = 0 && echo new > b.txt'
    proc = jb(
        "booth",
        "run",
        "--tree",
        str(tree),
        "--tape-dir",
        str(tapes),
        "--tape-id",
        "u1",
        "--",
        "sh",
        "-c",
        script,
        python=nobody_python,
        user=NOBODY,
        cwd=nobody_dir,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tree / "a.txt").read_text() == "one\ntwo\n" and (tree / "b.txt").exists()
    assert (tree / "b.txt").stat().st_uid == NOBODY  # root inside, nobody outside


def test_a_mistyped_option_before_the_command_is_refused_before_anything_is_made(work) -> None:
    tree, tapes = work
    # Not an option of `booth run`: without the check it became the program to run.
    proc = jb("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--verdict",
              "discard", "--", "true")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "jukebox: no such option: --verdict; the agent's command goes after `--` "
        "(see `jukebox booth run --help`)"
    ]
    assert not tapes.exists()
    assert (tree / "a.txt").read_text() == "one\n"


def test_requests_the_booth_refuses_exit_2_and_the_agent_carries_on(work) -> None:
    tree, tapes = work
    script = (
        "jukebox booth rollback --to nope; echo rc=$?; "
        "jukebox booth rollback --to 9; echo rc=$?; "
        "jukebox booth checkpoint --label ''; echo rc=$?; "
        "jukebox booth checkpoint --label ok; echo rc=$?"
    )
    proc = booth_run(tree, tapes, script, "--commit", "never")
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("rc=")] == [
        "rc=2", "rc=2", "rc=2", "rc=0"
    ]
    assert "no checkpoint labelled 'nope'" in proc.stderr
    assert "no checkpoint 9: this booth has 0..0" in proc.stderr
    assert "a label must be a non-empty string" in proc.stderr
    outside = jb("booth", "rollback", "--to", "ok", env={"JUKEBOX_SOCKET": ""})
    assert outside.returncode == 2 and "JUKEBOX_SOCKET is not set" in outside.stderr


def test_the_agent_reaches_this_jukebox_when_its_path_does_not(work) -> None:
    tree, tapes = work
    bin_dir = str(Path(JUKEBOX).parent)
    env = dict(os.environ, PATH="/usr/bin:/bin")  # a venv's jukebox, run without activating it
    proc = subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id",
         "t1", "--", "sh", "-c", 'jukebox booth checkpoint --label here && echo "PATH=$PATH"'],
        capture_output=True, text=True, cwd="/", env=env, timeout=slow(60),
    )
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint 1 (here)" in proc.stdout
    # Appended: the agent's own tools (python, pip) still come first.
    assert f"PATH=/usr/bin:/bin:{bin_dir}\n" in proc.stdout


def test_an_agent_with_a_long_command_line_runs_under_its_init(tmp_path: Path) -> None:
    # `python3 -c SCRIPT` with a script of some kilobytes: the pre-forked relay and the init
    # name themselves over the supervisor's command line, which once crashed them (SIGSEGV).
    tree = tmp_path / "tree"
    tree.mkdir()
    padding = "#" + "y" * 9000
    script = f"echo INIT=$(tr '\\0' ' ' < /proc/1/cmdline) > init.txt; : '{padding}'"
    done = booth_run(tree, tmp_path / "tapes", script)
    assert done.returncode == 0, done.stderr
    assert (tree / "init.txt").read_text() == "INIT=jukebox-init\n"
