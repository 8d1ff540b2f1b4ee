"""`jukebox booth run` refusals that used to be internal errors: one line, exit 2, nothing made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.booth.test_booth_run import jb

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


def one_line(proc, code: int = 2) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" not in lines[0], proc.stderr
    return lines[0]


def test_a_tape_dir_that_is_not_a_directory(tmp_path: Path) -> None:
    tree, afile = tmp_path / "tree", tmp_path / "afile"
    tree.mkdir()
    afile.write_text("mine\n")
    for tape_dir in (afile, Path("/dev/null"), afile / "sub"):
        line = one_line(jb("booth", "run", "--tree", str(tree), "--tape-dir", str(tape_dir),
                           "--", "true"))
        assert f"the tape dir {tape_dir} " in line and "pass --tape-dir a directory" in line
    assert afile.read_text() == "mine\n"


def test_a_booth_inside_a_booth_says_nesting_is_not_supported(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "inner").mkdir()
    inner = (
        "jukebox booth run --tree inner --tape-dir inner-tapes -- touch inner/made "
        "2>inner.err; echo inner status $?"
    )
    outer = jb("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--commit",
               "never", "--tape-id", "outer", "--", "sh", "-c", inner + "; cat inner.err")
    assert outer.returncode == 0, outer.stderr
    assert "inner status 2" in outer.stdout
    (line,) = [ln for ln in outer.stdout.splitlines() if ln.startswith("jukebox:")]
    assert "a booth cannot run inside a booth (nesting is not supported)" in line
    discard = jb("booth", "discard", "outer", "--tape-dir", str(tapes))
    assert discard.returncode == 0, discard.stderr
    assert os.listdir(tree) == ["inner"] and os.listdir(tree / "inner") == []
