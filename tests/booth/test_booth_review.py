"""Reviewing a pending booth: `booth diff --exclude`, the default exclusions, `booth export`
to a git patch (applied with real git), and `booth commit --only`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.booth.conftest import NOBODY
from tests.booth.in_process import here
from tests.booth.test_booth_run import JUKEBOX, jb

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

GIT_ID = ["-c", "user.email=review@example.com", "-c", "user.name=Review"]

# One agent run making every kind of change a patch must carry: text edits with and without a
# final newline, an exec bit, a deletion, binary files added and changed, a symlink retargeted,
# an empty file, a Latin-1 file, hostile names, an empty directory, and the noise review hides.
AGENT = r"""
set -e
echo two >> a.txt
rm keep.txt
printf 'noeol2' > ne.txt
printf 'z\000\001\002w' > old.bin
printf 'n\000ew' > new.bin
ln -sf ne.txt link
chmod +x a.txt
: > empty.txt
mkdir -p sub emptyd __pycache__ .venv/lib node_modules/x deep/__pycache__
printf 'caf\351\n' > sub/latin.txt
printf 'q\n' > 'we ird"name'
printf 'esc\n' > "$(printf 'evil\033[31m.txt')"
echo c > __pycache__/m.pyc
echo c > deep/__pycache__/n.pyc
echo v > .venv/lib/site.py
echo n > node_modules/x/index.js
echo l > run.log
mkfifo pipe
"""


def git(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *GIT_ID, *args], cwd=cwd, capture_output=True, text=True)


@pytest.fixture
def reviewed(tmp_path: Path) -> tuple[Path, Path]:
    """A git-initialised tree and a pending booth `t1` over it that ran AGENT."""
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    (tree / "keep.txt").write_text("keep\n")
    (tree / "ne.txt").write_text("noeol")
    (tree / "old.bin").write_bytes(b"x\0y")
    os.symlink("a.txt", tree / "link")
    assert git("init", "-q", cwd=tree).returncode == 0
    assert git("add", "-A", cwd=tree).returncode == 0
    assert git("commit", "-qm", "base", cwd=tree).returncode == 0
    proc = jb(
        "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "t1",
        "--commit", "never", "--", "sh", "-c", AGENT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return tree, tapes


def files_of(root: Path) -> dict[str, tuple[str, bytes, bool]]:
    """Every file and symlink under root but .git: (kind, content or target, executable)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path).encode(), False)
            elif not os.path.isfile(path):
                out[rel] = ("special", b"", False)  # a fifo: opening it would block
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", f.read(), os.access(path, os.X_OK))
    return out


def test_booth_diff_hides_the_default_excludes_and_globs_and_says_how_many(reviewed) -> None:
    _tree, tapes = reviewed
    proc = here("booth", "diff", "t1", "--tape-dir", str(tapes))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "M a.txt" in out and "A run.log" in out
    for hidden in ("__pycache__", ".venv", "node_modules"):
        assert hidden not in out.split("change(s) hidden")[0], out
    # __pycache__ (2 dirs, 2 files), .venv (2 dirs, 1 file), node_modules (2 dirs, 1 file)
    assert "10 change(s) hidden (.git/objects, .venv, __pycache__, node_modules)" in out, out
    assert "--no-default-excludes" in out

    globbed = here("booth", "diff", "t1", "--exclude", "*.log", "--exclude", "sub/*",
                 "--tape-dir", str(tapes)).stdout  # fmt: skip
    assert "run.log" not in globbed.split("hidden")[0] and "latin" not in globbed, globbed
    assert "A sub\n" in globbed  # the anchored glob hides what is under sub/, not sub itself
    assert "12 change(s) hidden" in globbed and "no --exclude" in globbed, globbed

    every = here("booth", "diff", "t1", "--no-default-excludes", "--tape-dir", str(tapes)).stdout
    assert "A __pycache__/m.pyc" in every and "A deep/__pycache__/n.pyc" in every
    assert "A .venv/lib/site.py" in every and "hidden" not in every, every

    data = json.loads(here("booth", "diff", "t1", "--json", "--tape-dir", str(tapes)).stdout)
    assert data["hidden"] == 10 and ".venv" in data["excluded"]
    assert not any("pycache" in c["path"] for c in data["changes"])

    # `show` of the exit frame: the same files, sizes, short diffs, the same excludes.
    shown = here("show", "t1@2", "--tape-dir", str(tapes))
    assert shown.returncode == 0, shown.stderr
    assert "fs, " in shown.stdout and "files changed: 15\n" in shown.stdout, shown.stdout
    assert "  M a.txt  (4 → 8 bytes)\n" in shown.stdout and "      +two\n" in shown.stdout
    assert "  M link  (-> a.txt → ne.txt)\n" in shown.stdout
    assert "  A evil\\x1b[31m.txt" in shown.stdout and "\033" not in shown.stdout
    assert "10 change(s) hidden" in shown.stdout

    bad = here("booth", "diff", "t1", "--exclude", "/", "--tape-dir", str(tapes))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr


def test_booth_export_is_a_patch_git_applies_to_the_base_tree(reviewed, tmp_path) -> None:
    tree, tapes = reviewed
    proc = subprocess.run(
        [JUKEBOX, "booth", "export", "t1", "--tape-dir", str(tapes)],
        capture_output=True, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    patch = tmp_path / "change.patch"
    patch.write_bytes(proc.stdout)
    stderr = proc.stderr.decode()
    assert "(2 binary)" in stderr and "10 change(s) hidden" in stderr, stderr
    assert "1 empty director" in stderr and b"  emptyd\n" in proc.stdout
    assert "1 special file(s)" in stderr and b"git cannot hold:\n  pipe\n" in proc.stdout
    assert b'diff --git "a/evil\\033[31m.txt" "b/evil\\033[31m.txt"' in proc.stdout
    assert b"\033" not in proc.stdout.split(b"\n---\n")[0]  # the message holds no escapes

    applied = tmp_path / "applied"
    assert git("clone", "-q", str(tree), str(applied), cwd=tmp_path).returncode == 0
    check = git("apply", "--check", str(patch), cwd=applied)
    assert check.returncode == 0, check.stderr
    assert git("apply", str(patch), cwd=applied).returncode == 0

    mailed = tmp_path / "mailed"
    assert git("clone", "-q", str(tree), str(mailed), cwd=tmp_path).returncode == 0
    am = git("am", str(patch), cwd=mailed)
    assert am.returncode == 0, am.stderr
    assert git("log", "-1", "--format=%s", cwd=mailed).stdout.strip() == "booth t1"
    assert git("apply", "-R", "--check", str(patch), cwd=mailed).returncode == 0

    # What git made of the patch is what the booth would commit, bit for bit.
    committed = here("booth", "commit", "t1", "--tape-dir", str(tapes))
    assert committed.returncode == 0, committed.stderr
    noise = ("__pycache__", ".venv", "node_modules")
    committed = files_of(tree)
    assert committed.pop("pipe")[0] == "special"  # committed, and named, not in the patch
    expected = {p: v for p, v in committed.items() if not any(n in p for n in noise)}
    assert files_of(applied) == expected
    assert files_of(mailed) == expected
    assert expected["a.txt"] == ("file", b"one\ntwo\n", True)
    assert expected["link"] == ("link", b"ne.txt", False)
    assert expected["sub/latin.txt"][1] == b"caf\xe9\n"
    verdict = here("show", "t1", "--tape-dir", str(tapes), "--json")
    view = json.loads(verdict.stdout)
    assert view["kind"] == "commit" and view["payload"]["by"] == "booth commit"
    assert {f["path"] for f in view["files"]} >= {"a.txt", "keep.txt", "run.log"}


def test_booth_commit_only_commits_part_and_keeps_the_rest_pending(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    (tree / "d").mkdir(parents=True)
    (tree / "a.txt").write_text("one\n")
    (tree / "b.txt").write_text("b\n")
    (tree / "d" / "x").write_text("x\n")
    (tree / "f").write_text("a file, then a directory\n")
    proc = jb(
        "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "p1",
        "--commit", "never", "--", "sh", "-c",
        "echo two >> a.txt; echo bb >> b.txt; mkdir -p new/sub; echo n > new/sub/n.txt; "
        "echo y > d/y; rm d/x; rm f; mkdir f; echo g > f/g",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    t = ("--tape-dir", str(tapes))

    def pending() -> list[str]:
        data = json.loads(here("booth", "diff", "p1", "--json", *t).stdout)
        return [c["path"] for c in data["changes"]]

    # Refused, nothing written: a path the booth did not change, one outside the tree, PATHs
    # without --only, --only without PATHs.
    for args, why in (
        (("--only", "nothing.txt"), "changes nothing at nothing.txt"),
        (("--only", "/etc"), "not a path inside the booth's tree"),
        (("a.txt",), "put --only first"),
        (("--only",), "--only needs the paths"),
        (("--only", "f/g"), "f is not a directory on both sides (its type changed); take f"),
    ):
        bad = here("booth", "commit", "p1", *args, *t)
        assert bad.returncode == 2 and why in bad.stderr and bad.stderr.count("\n") == 1, bad
    assert (tree / "a.txt").read_text() == "one\n"

    # A host edit of a selected path is a conflict, as for a whole commit; of another, is not.
    (tree / "b.txt").write_text("edited on the host\n")
    conflict = here("booth", "commit", "p1", "--only", "b.txt", *t)
    assert conflict.returncode == 1 and "b.txt" in conflict.stderr, conflict.stderr
    assert (tree / "b.txt").read_text() == "edited on the host\n"

    # From inside the tree, paths are relative to where one stands, as in git.
    done = here("booth", "commit", "p1", "--only", "sub/n.txt", "../a.txt", *t, cwd=tree / "d")
    assert done.returncode == 2, done.stderr  # d/sub/n.txt: the booth changed nothing there
    done = here(
        "booth", "commit", "p1", "--only", "../new/sub/n.txt", "../a.txt", *t, cwd=tree / "d"
    )
    assert done.returncode == 0, done.stderr
    assert "committed 4 change(s) of booth p1; 5 change(s) stay pending" in done.stdout, done
    assert (tree / "a.txt").read_text() == "one\ntwo\n"
    assert (tree / "new" / "sub" / "n.txt").read_text() == "n\n"
    assert (tree / "d" / "x").exists() and not (tree / "d" / "y").exists()
    assert pending() == ["b.txt", "d/x", "d/y", "f", "f/g"]  # what is left

    # A partial commit killed past its commit point is finished by the next command, which
    # then does its own work; the booth stays pending.
    killed = jb("booth", "commit", "p1", "--only", "d", *t, env={"SHADOWFS_CRASH_AT": "applied"})
    assert killed.returncode == -9, killed.stderr
    listed = here("booth", "ls", "--json", *t)
    assert "recovered the interrupted partial commit of booth p1: finished" in listed.stderr
    assert [b["status"] for b in json.loads(listed.stdout)] == ["pending"]
    assert not (tree / "d" / "x").exists() and (tree / "d" / "y").read_text() == "y\n"
    assert pending() == ["b.txt", "f", "f/g"]
    frames = json.loads(here("log", "p1", "--json", *t).stdout)["frames"]
    notes = [f["payload"] for f in frames if f["payload"].get("event") == "partial_commit"]
    assert [n["paths"] for n in notes] == [["a.txt", "new/sub/n.txt"], ["d"]]
    assert notes[1]["recovered"] is True and notes[0]["by"] == "booth commit"
    assert json.loads(here("ls", "--json", *t).stdout)[0]["status"] == "PENDING"

    # What is left commits whole once the host edit is gone: the tree is the booth's final one.
    (tree / "b.txt").write_text("b\n")
    rest = here("booth", "commit", "p1", *t)
    assert rest.returncode == 0 and "3 change(s)" in rest.stdout, rest.stderr
    assert (tree / "b.txt").read_text() == "b\nbb\n" and (tree / "f" / "g").read_text() == "g\n"
    assert json.loads(here("ls", "--json", *t).stdout)[0]["status"] == "COMMITTED"
    assert here("verify", "p1", *t).returncode == 0


def test_booth_commit_only_as_nobody_is_conflict_checked(
    nobody_python: str, nobody_dir: Path, nobody_tree: tuple[Path, Path], open_dev_fuse: None
) -> None:
    tree, tapes = nobody_tree

    def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
        return jb(*args, python=nobody_python, user=NOBODY, cwd=nobody_dir)

    run = as_nobody(
        "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "u1",
        "--commit", "never", "--", "sh", "-c", "echo two >> a.txt; echo new > b.txt",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (tree / "a.txt").write_text("edited on the host\n")  # the attack: a selected path changed
    refused = as_nobody("booth", "commit", "u1", "--only", "a.txt", "--tape-dir", str(tapes))
    assert refused.returncode == 1 and "a.txt" in refused.stderr, refused.stderr
    assert (tree / "a.txt").read_text() == "edited on the host\n" and not (tree / "b.txt").exists()
    done = as_nobody("booth", "commit", "u1", "--only", "b.txt", "--tape-dir", str(tapes))
    assert done.returncode == 0 and "1 change(s) stay pending" in done.stdout, done.stderr
    assert (tree / "b.txt").read_text() == "new\n" and (tree / "b.txt").stat().st_uid == NOBODY
    assert (tree / "a.txt").read_text() == "edited on the host\n"
