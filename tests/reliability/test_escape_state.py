"""The booth's state and scratch on the host: nothing in them is any other local user's to read
or run.

One agent per configuration tries to read the user's commit key, writes a 0600 `.env`, makes a
setuid copy of `id`, and hands an fd of that copy over an abstract unix socket to whoever
connects. While it waits, an attacker
running as `nobody` on the host connects, executes the fd it got, and tries to reach the copy
through the tape dir's scratch dir and through the supervisor's /proc root. Then the modes of
everything under the tape dir are checked, once for booths run as root (FUSE and overlay) and
once for a booth run as nobody (a pending booth's kept scratch included: the agent's setuid
copy, kept on the host out of the booth's nosuid bind, must be a plain 0600 file); an
old-style, world-readable tape dir must be tightened the next time a command opens it, without
following a received tape dir's symlinks; and a mounted view of the tape shows the `.env` no
more openly than the agent left it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jukebox.trees.realtree import commit_key, commit_key_dir
from tests.reliability.conftest import AGENT_PYTHON, JUKEBOX, NOBODY, booth_argv, jb

SECRET = "API_KEY=sk-state-canary-0600"

# The agent: runs in the booth, on the system interpreter, standard library only.
AGENT = r"""
import errno, json, os, shutil, socket, sys
try:  # the user's commit key, which seals the booth records a commit accepts
    key = "read %d bytes" % len(open(sys.argv[3], "rb").read())
except OSError as e:
    key = errno.errorcode.get(e.errno, str(e))
with open(".env", "w") as f:
    f.write(sys.argv[2] + "\n")
os.chmod(".env", 0o600)
shutil.copy("/usr/bin/id", "sid")
os.chmod("sid", 0o4755)
fd = os.open("sid", os.O_RDONLY)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\0" + sys.argv[1])
srv.listen(2)
for turn in range(2):  # the attacker gets the fd; then the test says it is done
    conn, _ = srv.accept()
    if turn == 0:
        socket.send_fds(conn, [b"x"], [fd])
    conn.recv(1)  # until the peer closes
    conn.close()
print("AGENT " + json.dumps({"sid_mode": oct(os.stat("sid").st_mode), "commit_key": key}))
"""

# The attacker: another local user (nobody) on the host, outside any booth.
ATTACKER = r"""
import errno, json, os, socket, subprocess, sys, time
name, paths = sys.argv[1], json.loads(sys.argv[2])
out = {}

def en(e):
    return errno.errorcode.get(e.errno, str(e))

def run_id(path, fds=()):
    try:
        r = subprocess.run([path, "-u"], capture_output=True, text=True, pass_fds=fds)
        return r.stdout.strip() or "rc %d" % r.returncode
    except OSError as e:
        return en(e)

s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
for _ in range(600):
    try:
        s.connect("\0" + name)
        break
    except OSError:
        time.sleep(0.05)
else:
    print("ATTACK " + json.dumps({"connect": "timed out"}))
    sys.exit(0)
_, fds, _, _ = socket.recv_fds(s, 1, 1)
out["fd_exec_euid"] = run_id("/proc/self/fd/%d" % fds[0], fds) if fds else "no fd"
for key, path in paths.items():
    try:
        os.stat(path)
        out[key + "_stat"] = "ok"
    except OSError as e:
        out[key + "_stat"] = en(e)
    out[key + "_exec_euid"] = run_id(path)
print("ATTACK " + json.dumps(out))
s.close()
"""

LOOSE_DIR, LOOSE_FILE = 0o755, 0o644


@dataclass
class Run:
    fs: str
    user: str
    tapes: Path
    booth_id: str
    agent: dict[str, object]
    attack: dict[str, object]
    staged: dict[str, int]  # the FUSE layer's staged files, by name: their modes on disk
    scratch_modes: dict[str, int]  # .jukebox, scratch and scratch/<id>, while it ran
    modes: dict[str, int]  # everything under the tape dir after the run, by relative path


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.lstat().st_mode)}
    for path in root.rglob("*"):
        if not path.is_symlink():
            out[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return out


def _tagged(stdout: str, tag: str) -> dict[str, object]:
    line = next((ln for ln in stdout.splitlines() if ln.startswith(tag + " ")), None)
    assert line, f"no {tag} line in:\n{stdout}"
    return json.loads(line[len(tag) + 1 :])


def _attacked_booth(work: Path, fs: str) -> Run:
    """A root booth whose agent leaves a setuid copy and an fd of it for nobody to take."""
    tree, tapes, booth_id = work / f"tree-{fs}", work / f"tapes-{fs}", f"state-{fs}"
    tree.mkdir()
    (tree / "a.txt").write_text("base\n")
    name = f"jukebox-test-state-{os.getpid()}-{fs}"
    argv = [
        JUKEBOX,
        *booth_argv(tree, tapes, booth_id, "--fs", fs, "--commit", "never"),
        AGENT_PYTHON,
        "-I",
        "-c",
        AGENT,
        name,
        SECRET,
        str(commit_key_dir() / "commit.key"),
    ]
    env = dict(os.environ, PATH=f"{Path(JUKEBOX).parent}:{os.environ['PATH']}")
    booth = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=work, env=env)  # fmt: skip
    try:
        scratch = tapes / ".jukebox" / "scratch" / booth_id
        record = tapes / ".jukebox" / "booths" / f"{booth_id}.json"
        deadline = time.monotonic() + 60
        while not (record.exists() and scratch.exists()) and booth.poll() is None:
            assert time.monotonic() < deadline, "the booth never started"
            time.sleep(0.05)
        supervisor = json.loads(record.read_text())["pid"]
        paths = {
            "state_dir": str(tapes / ".jukebox" / "booths"),
            "scratch": str(scratch / "upper" / "sid") if fs == "overlay" else str(scratch),
            # Where the supervisor's namespace holds the layer (jukebox.booth.scratchdir).
            "proc_root": f"/proc/{supervisor}/root{tapes}/.jukebox/mnt/{booth_id}/sid",
        }
        attacker = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             AGENT_PYTHON, "-I", "-c", ATTACKER, name, json.dumps(paths)],
            capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
        attack = _tagged(attacker.stdout, "ATTACK")
        # Still running: the agent waits for the all-clear below.
        staged = {
            p.name: stat.S_IMODE(p.lstat().st_mode)
            for p in scratch.rglob("*")
            if fs == "fuse" and p.is_file()
        }
        scratch_modes = {
            str(p.relative_to(tapes)): stat.S_IMODE(p.stat().st_mode)
            for p in (tapes / ".jukebox", scratch.parent, scratch)
        }
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as done:
            done.connect("\0" + name)
        out, err = booth.communicate(timeout=60)
    finally:
        if booth.poll() is None:
            booth.kill()
            booth.wait()
    assert booth.returncode == 0, err
    return Run(fs, "root", tapes, booth_id, _tagged(out, "AGENT"), attack, staged,
               scratch_modes, _modes(tapes))  # fmt: skip


def _nobody_booth(work: Path, python: str) -> Run:
    tree, tapes = work / "tree", work / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("base\n")
    for p in (work, tree, tree / "a.txt"):
        os.chown(p, NOBODY, NOBODY)
    agent = f"import os; open('.env', 'w').write({SECRET!r}); os.chmod('.env', 0o600)"
    run = jb(*booth_argv(tree, tapes, "state-nobody", "--commit", "never"),
             AGENT_PYTHON, "-I", "-c", agent, cwd=work, python=python, user=NOBODY)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return Run("fuse", "nobody", tapes, "state-nobody", {}, {}, {}, {}, _modes(tapes))


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Run]]:
    request.getfixturevalue("booth_ready")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to attack as nobody")
    # Traversable by anyone, as a home directory or a project dir usually is: only the booth's
    # own modes may stand between nobody and the scratch dir.
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="jukebox-state-"))
    work.chmod(0o755)
    try:
        found = {fs: _attacked_booth(work, fs) for fs in ("fuse", "overlay")}
        python = request.getfixturevalue("nobody_python")
        request.getfixturevalue("open_dev_fuse")
        nobody_work = Path("/tmp") / f"jukebox-state-nobody-{os.getpid()}"
        nobody_work.mkdir()
        try:
            found["nobody"] = _nobody_booth(nobody_work, python)
            yield found
        finally:
            shutil.rmtree(nobody_work, ignore_errors=True)
    finally:
        for fs in ("fuse", "overlay"):
            jb("booth", "discard", f"state-{fs}", "--tape-dir", str(work / f"tapes-{fs}"))
        shutil.rmtree(work, ignore_errors=True)


def _loose(modes: dict[str, int]) -> dict[str, str]:
    """Every path but the tape dir itself that group or others may use at all."""
    return {p: oct(m) for p, m in modes.items() if p != "." and m & 0o077}


# ------------------------------------------------------------------------ while the booth ran


@pytest.mark.parametrize("fs", ["fuse", "overlay"])
def test_the_setuid_copy_does_not_make_nobody_root(runs: dict[str, Run], fs: str) -> None:
    run = runs[fs]
    assert run.attack.get("connect") != "timed out", run.attack
    # The attack is real: the agent's copy is setuid root, and its fd reached nobody.
    if fs == "overlay":
        assert int(str(run.agent["sid_mode"]), 8) & stat.S_ISUID, run.agent
    for way in ("scratch", "state_dir", "proc_root"):
        assert run.attack[f"{way}_exec_euid"] == "EACCES", (way, run.attack[f"{way}_exec_euid"])
        assert run.attack[f"{way}_stat"] == "EACCES", (way, run.attack)
    # The kernel grants no set-id through another namespace's mount, and the layer is nosuid.
    assert run.attack["fd_exec_euid"] == str(NOBODY), run.attack
    assert all(mode == 0o700 for mode in run.scratch_modes.values()), run.scratch_modes


@pytest.mark.parametrize("fs", ["fuse", "overlay"])
def test_the_agent_cannot_read_the_users_commit_key(runs: dict[str, Run], fs: str) -> None:
    assert commit_key(create=False) is not None, "the booth made no key: nothing was attacked"
    assert runs[fs].agent["commit_key"] == "ENOENT", runs[fs].agent  # under an empty cover


def test_fuse_stages_files_private_and_without_setid_bits(runs: dict[str, Run]) -> None:
    staged = runs["fuse"].staged
    assert staged, "the FUSE layer staged nothing: the attack did not run"
    assert {n: oct(m) for n, m in staged.items() if m & 0o7077} == {}


# --------------------------------------------------------------------------- after the booth


@pytest.mark.parametrize("which", ["fuse", "overlay", "nobody"])
def test_everything_under_the_tape_dir_is_private(runs: dict[str, Run], which: str) -> None:
    modes = runs[which].modes
    assert ".jukebox/store/index.sqlite" in modes and f"{runs[which].booth_id}.jbx" in modes
    assert _loose(modes) == {}
    assert modes[".jukebox"] == 0o700 and modes[f"{runs[which].booth_id}.jbx"] == 0o600
    # The pending booth's kept scratch (jukebox.booth.scratchdir.keep_scratch): out of the
    # booth's nosuid bind, the agent's setuid copy is a plain private file.
    kept = {p: m for p, m in modes.items() if p.startswith(f".jukebox/kept/{runs[which].booth_id}")}
    assert kept and {p: oct(m) for p, m in kept.items() if m & 0o7000} == {}
    if which == "overlay":
        assert kept[f".jukebox/kept/{runs[which].booth_id}/upper/sid"] == 0o600


def test_an_old_world_readable_tape_dir_is_tightened_on_open(runs: dict[str, Run]) -> None:
    for which in ("fuse", "overlay"):  # the overlay's kept upper dir is deeper than depth 2
        run = runs[which]
        for rel in run.modes:
            path = run.tapes / rel
            path.chmod(LOOSE_DIR if path.is_dir() else LOOSE_FILE)
        assert any(rel.startswith(".jukebox/kept/") for rel in run.modes)  # walked whole
        listed = jb("booth", "ls", "--tape-dir", str(run.tapes))
        assert listed.returncode == 0 and run.booth_id in listed.stdout, listed.stderr
        after = _modes(run.tapes)
        assert _loose(after) == {}, which
        assert after["."] == LOOSE_DIR, "the tape dir itself is the user's: left as it was"
    # Still usable after tightening: the store and the pending booth are intact.
    run = runs["fuse"]
    diff = jb("booth", "diff", run.booth_id, "--tape-dir", str(run.tapes))
    assert diff.returncode == 0 and ".env" in diff.stdout, diff.stderr


def test_tightening_a_received_tape_dir_never_follows_its_symlinks(tmp_path: Path) -> None:
    victim = tmp_path / "etc"  # what a hostile tape dir points at: root's own files
    (victim / "sub").mkdir(parents=True)
    (victim / "passwd").write_text("root:x:0:0\n")
    before = _modes(victim)
    whole, inner = tmp_path / "whole", tmp_path / "inner"
    whole.mkdir()
    (whole / ".jukebox").symlink_to(victim)
    (inner / ".jukebox").mkdir(parents=True, mode=LOOSE_DIR)
    (inner / ".jukebox" / "store").symlink_to(victim)
    (inner / "t.jbx").symlink_to(victim / "passwd")

    for tapes in (whole, inner):
        listed = jb("booth", "ls", "--tape-dir", str(tapes))
        assert listed.returncode == 0, listed.stderr

    assert _modes(victim) == before and before["passwd"] == LOOSE_FILE
    assert stat.S_IMODE((inner / ".jukebox").stat().st_mode) == 0o700


def test_a_mounted_view_keeps_the_env_file_private(runs: dict[str, Run]) -> None:
    run = runs["overlay"]
    view = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="jukebox-state-view-"))
    view.chmod(0o755)
    try:
        mounted = jb("mount", str(run.tapes / f"{run.booth_id}.jbx"), str(view))
        assert mounted.returncode == 0, mounted.stderr
        try:
            assert (view / ".env").read_text().strip() == SECRET  # the owner still reads it
            peek = subprocess.run(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 "cat", str(view / ".env")],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert peek.returncode != 0 and "Permission denied" in peek.stderr, peek
            assert SECRET not in peek.stdout
        finally:
            jb("umount", str(view))
    finally:
        shutil.rmtree(view, ignore_errors=True)
