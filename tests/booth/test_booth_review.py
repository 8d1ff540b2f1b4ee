"""Reviewing a pending booth: `booth diff --exclude`, the default exclusions, `booth export`
to a git patch (applied with real git), and `booth commit --only`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

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
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", f.read(), os.access(path, os.X_OK))
    return out


def test_booth_diff_hides_the_default_excludes_and_globs_and_says_how_many(reviewed) -> None:
    _tree, tapes = reviewed
    proc = jb("booth", "diff", "t1", "--tape-dir", str(tapes))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "M a.txt" in out and "A run.log" in out
    for hidden in ("__pycache__", ".venv", "node_modules"):
        assert hidden not in out.split("change(s) hidden")[0], out
    # __pycache__ (2 dirs, 2 files), .venv (2 dirs, 1 file), node_modules (2 dirs, 1 file)
    assert "10 change(s) hidden (.git/objects, .venv, __pycache__, node_modules)" in out, out
    assert "--no-default-excludes" in out

    globbed = jb("booth", "diff", "t1", "--exclude", "*.log", "--exclude", "sub/*",
                 "--tape-dir", str(tapes)).stdout  # fmt: skip
    assert "run.log" not in globbed.split("hidden")[0] and "latin" not in globbed, globbed
    assert "A sub\n" in globbed  # the anchored glob hides what is under sub/, not sub itself
    assert "12 change(s) hidden" in globbed and "no --exclude" in globbed, globbed

    every = jb("booth", "diff", "t1", "--no-default-excludes", "--tape-dir", str(tapes)).stdout
    assert "A __pycache__/m.pyc" in every and "A deep/__pycache__/n.pyc" in every
    assert "A .venv/lib/site.py" in every and "hidden" not in every, every

    data = json.loads(jb("booth", "diff", "t1", "--json", "--tape-dir", str(tapes)).stdout)
    assert data["hidden"] == 10 and ".venv" in data["excluded"]
    assert not any("pycache" in c["path"] for c in data["changes"])

    # `show` of the exit frame: the same files, sizes, short diffs, the same excludes.
    shown = jb("show", "t1@2", "--tape-dir", str(tapes))
    assert shown.returncode == 0, shown.stderr
    assert "fs, " in shown.stdout and "files changed: 14\n" in shown.stdout, shown.stdout
    assert "  M a.txt  (4 → 8 bytes)\n" in shown.stdout and "      +two\n" in shown.stdout
    assert "  M link  (-> a.txt → ne.txt)\n" in shown.stdout
    assert "  A evil\\x1b[31m.txt" in shown.stdout and "\033" not in shown.stdout
    assert "10 change(s) hidden" in shown.stdout

    bad = jb("booth", "diff", "t1", "--exclude", "/", "--tape-dir", str(tapes))
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
    committed = jb("booth", "commit", "t1", "--tape-dir", str(tapes))
    assert committed.returncode == 0, committed.stderr
    noise = ("__pycache__", ".venv", "node_modules")
    expected = {p: v for p, v in files_of(tree).items() if not any(n in p for n in noise)}
    assert files_of(applied) == expected
    assert files_of(mailed) == expected
    assert expected["a.txt"] == ("file", b"one\ntwo\n", True)
    assert expected["link"] == ("link", b"ne.txt", False)
    assert expected["sub/latin.txt"][1] == b"caf\xe9\n"
    verdict = jb("show", "t1", "--tape-dir", str(tapes), "--json")
    view = json.loads(verdict.stdout)
    assert view["kind"] == "commit" and view["payload"]["by"] == "booth commit"
    assert {f["path"] for f in view["files"]} >= {"a.txt", "keep.txt", "run.log"}
