"""shadowfs.removal.remove_tree: what it never touches while removing a tree an agent made (its
depth: tests/booth/test_deep_removal.py)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from shadowfs.removal import remove_quietly, remove_tree


def test_symlinks_are_removed_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "sub" / "f").write_text("host")
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "out").symlink_to(victim)
    (tree / "d" / "sub").symlink_to(victim / "sub")
    (tmp_path / "top").symlink_to(victim)
    remove_tree(tmp_path / "top")  # the path itself a symlink: the link goes
    remove_tree(tree)
    remove_tree(tmp_path / "gone")  # nothing there: no error
    assert sorted(os.listdir(tmp_path)) == ["victim"]
    assert (victim / "sub" / "f").read_text() == "host"


def test_another_file_system_inside_is_left_alone(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    tree = tmp_path / "tree"
    (tree / "m").mkdir(parents=True)
    (tree / "f").write_text("x")
    if subprocess.run(["mount", "-t", "tmpfs", "none", str(tree / "m")]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (tree / "m" / "kept").write_text("theirs")
        with pytest.raises(OSError) as refused:
            remove_tree(tree)
        assert refused.value.errno == errno.EXDEV
        # The rest is removed; what the mount holds is not (shutil.rmtree emptied it).
        assert os.listdir(tree) == ["m"] and (tree / "m" / "kept").read_text() == "theirs"
        (tree / "again").mkdir()
        remove_quietly(tree)  # the same refusal, said to no one: the rest goes all the same
        assert os.listdir(tree) == ["m"] and (tree / "m" / "kept").read_text() == "theirs"
    finally:
        subprocess.run(["umount", str(tree / "m")])


def test_quiet_removal_follows_nothing_and_takes_what_it_can(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("host")
    empty, tree = tmp_path / "empty", tmp_path / "tree"
    empty.mkdir()
    (tree / "deep" / "er").mkdir(parents=True)
    (tree / "deep" / "er" / "out").symlink_to(victim)
    (tree / "deep" / "er" / "locked").mkdir(mode=0)  # as an agent or an overlay's work dir
    (tmp_path / "top").symlink_to(victim)
    for path in (empty, tree, tmp_path / "top", tmp_path / "gone"):
        remove_quietly(path)
    assert sorted(os.listdir(tmp_path)) == ["victim"]
    assert (victim / "f").read_text() == "host"
