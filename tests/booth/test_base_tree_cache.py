"""The base-tree stat cache between booths: a rewrite with the mtime put back is still seen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.tape import Tape
from jukebox.tapedir import TapeDir
from shadowfs import tree
from shadowfs.oid import ObjectId
from shadowfs.store import Store
from tests.booth.test_booth_run import booth_run

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

OLD_NS = 1_600_000_000_000_000_000

REWRITE = """
import os, sys
path = sys.argv[1]
st = os.stat(path)
with open(path, "r+b") as f:
    f.write(b"EVIL")
os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
"""


def test_next_booth_records_a_rewrite_whose_mtime_was_put_back(tmp_path: Path) -> None:
    tree_dir, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree_dir.mkdir()
    target = tree_dir / "config.txt"
    target.write_bytes(b"good")
    os.utime(target, ns=(OLD_NS, OLD_NS))
    first = booth_run(tree_dir, tapes, "true")
    assert first.returncode == 0, first.stderr
    before = os.stat(target)
    # Another process (an agent outside any booth, say) rewrites it and puts the mtime back.
    subprocess.run([sys.executable, "-c", REWRITE, str(target)], check=True)
    after = os.stat(target)
    assert (after.st_size, after.st_mtime_ns, after.st_mode) == (
        before.st_size, before.st_mtime_ns, before.st_mode
    )  # fmt: skip
    second = booth_run(tree_dir, tapes, "true", "--tape-id", "t2")
    assert second.returncode == 0, second.stderr
    with Store.open(TapeDir(tapes).store_path) as store:
        start = Tape.load(tapes / "t2.jbx", store).frames[0]
        base = ObjectId.from_hex(start.payload["base_tree"])
        entry = tree.lookup(store, base, b"config.txt")
        assert entry is not None and entry.oid is not None
        assert store.read_bytes(entry.oid) == b"EVIL"
