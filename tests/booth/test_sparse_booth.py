"""An agent's sparse file, through a whole booth: hashed without reading its holes, and
committed into the real tree still sparse."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.booth.test_booth_run import booth_run

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

SIZE = 2 << 30


@pytest.mark.parametrize("fs", ["fuse", "overlay"])
def test_truncate_2g_stays_sparse_after_commit(tmp_path: Path, fs: str) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    proc = booth_run(
        tree, tapes, f"truncate -s {SIZE} big.bin && echo tail >> big.bin", "--fs", fs
    )
    assert proc.returncode == 0, proc.stderr
    st = os.stat(tree / "big.bin")
    assert st.st_size == SIZE + 5
    # Content without blocks: the chunk holding "tail", not 2 GiB of zeros.
    assert st.st_blocks * 512 <= 8 << 20, st.st_blocks * 512
    with open(tree / "big.bin", "rb") as f:
        f.seek(SIZE - 3)
        assert f.read() == b"\0\0\0tail\n"
