"""The control socket's directory in /tmp is named by a fixed-length digest of the tape dir and
the booth id: named `jukebox-<booth id>-…`, a booth id of 128 bytes (allowed) made the socket's
path too long to bind, and every such booth died with an internal error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.booth.test_booth_run import jb

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


def test_a_booth_id_of_128_bytes_gets_its_control_socket(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    long_id = "b" * 128
    done = jb(
        "booth", "run", "--tree", str(tree), "--tape-dir", str(tmp_path / "tapes"),
        "--tape-id", long_id, "--", "sh", "-c", "echo x > x && jukebox booth checkpoint",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tree / "x").read_text() == "x\n"
