"""`jukebox mount` / `umount`: any frame's files, read-only, through a real FUSE mount."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.test_cli_read import one_line_error, record_run

pytestmark = pytest.mark.fuse


def test_mount_shows_each_frame_read_only(tmp_path: Path, jukebox_cli) -> None:
    record_run(tmp_path / "tapes", tmp_path / "work")
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    jukebox_cli("mount", "tr_demo@0", str(before), check=True)
    try:
        jukebox_cli("mount", "tr_demo", str(after), check=True)
        try:
            assert (before / "notes.txt").read_text() == "line one\nline two\n"
            assert not (before / "new file.py").exists()
            assert (after / "notes.txt").read_text() == "line one\nline 2\n"
            assert (after / "new file.py").read_text() == "print('hi')\n"
            with pytest.raises(OSError) as refused:
                (after / "notes.txt").write_text("no")
            assert refused.value.errno == errno.EROFS
        finally:
            jukebox_cli("umount", str(after), check=True)
    finally:
        jukebox_cli("umount", str(before), check=True)
    assert not os.path.ismount(before) and not os.path.ismount(after)
    assert os.listdir(after) == []


def test_mount_errors_are_one_line(tmp_path: Path, jukebox_cli) -> None:
    record_run(tmp_path / "tapes", tmp_path / "work")
    assert "is not a directory" in one_line_error(
        jukebox_cli("mount", "tr_demo@1", str(tmp_path / "absent")), 2
    )
    assert "there is no frame 7" in one_line_error(
        jukebox_cli("mount", "tr_demo@7", str(tmp_path)), 2
    )
    assert "is not a mount point" in one_line_error(jukebox_cli("umount", str(tmp_path)), 2)


def test_mount_over_a_folder_with_files_needs_force(tmp_path: Path, jukebox_cli) -> None:
    record_run(tmp_path / "tapes", tmp_path / "work")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "mine.txt").write_text("kept\n")
    attempt = jukebox_cli("mount", "tr_demo", str(folder))
    if os.path.ismount(folder):  # not refused: leave no mount behind for the failure
        jukebox_cli("umount", str(folder), check=True)
        pytest.fail(f"mounted over a folder with files: {attempt.stdout}")
    refused = one_line_error(attempt, 2)
    assert f"{folder} is not empty" in refused and "--force" in refused, refused
    assert (folder / "mine.txt").read_text() == "kept\n"
    jukebox_cli("mount", "tr_demo", str(folder), "--force", check=True)
    try:
        assert sorted(os.listdir(folder)) == ["new file.py", "notes.txt"]
    finally:
        jukebox_cli("umount", str(folder), check=True)
    assert (folder / "mine.txt").read_text() == "kept\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_umount_refuses_what_jukebox_did_not_mount(tmp_path: Path, jukebox_cli) -> None:
    import subprocess

    tmpfs, bound = tmp_path / "tmpfs", tmp_path / "bound"
    tmpfs.mkdir()
    bound.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "jbtest", str(tmpfs)], check=True)
    try:
        (tmpfs / "precious.txt").write_text("keep me\n")
        subprocess.run(["mount", "--bind", str(tmp_path), str(bound)], check=True)
        try:
            line = one_line_error(jukebox_cli("umount", str(tmpfs)), 2)
            assert "is a tmpfs mount, not a tape `jukebox mount` made" in line
            assert "not a tape `jukebox mount` made" in one_line_error(
                jukebox_cli("umount", str(bound)), 2
            )
            assert os.path.ismount(bound)
        finally:
            subprocess.run(["umount", str(bound)], check=True)
        assert os.path.ismount(tmpfs)
        assert (tmpfs / "precious.txt").read_text() == "keep me\n"
    finally:
        subprocess.run(["umount", str(tmpfs)], check=True)
