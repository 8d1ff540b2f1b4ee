"""The base-tree stat cache between booths: a rewrite with the mtime put back is still seen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jukebox.tape.tape import Tape
from jukebox.tape.tapedir import TapeDir
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


def test_directory_signatures_spare_the_identities_until_something_changes(
    tmp_path: Path,
) -> None:
    from jukebox.trees.basetree import build_base_tree

    src, tapes = tmp_path / "tree", TapeDir(tmp_path / "tapes")
    for d in ("a", "b"):
        (src / d).mkdir(parents=True)
        (src / d / "f").write_bytes(b"old " + d.encode())
    time.sleep(tree.RACY_NS / 1e9 + 0.2)  # past the racy window: the first build signs them
    with Store.open(tapes.store_path, create=True) as store:
        first = build_base_tree(store, tapes, str(src))
        dirs = list((tapes.state / "base-tree-dirs").iterdir())
        stats = next((tapes.state / "base-tree-stats").iterdir())
        assert len(dirs) == 1
        stamp = stats.stat().st_mtime_ns
        record = tapes.state / "base-trees.json"
        written = record.stat().st_ino  # each write replaces the file: a new inode
        assert build_base_tree(store, tapes, str(src)) == first
        assert stats.stat().st_mtime_ns == stamp  # not read, not rewritten
        assert record.stat().st_ino == written  # nothing learnt: not rewritten either
        # A same-size rewrite with its mtime put back: b is built again and its file read.
        target = src / "b" / "f"
        subprocess.run([sys.executable, "-c", REWRITE, str(target)], check=True)
        third = build_base_tree(store, tapes, str(src))
        entry = tree.lookup(store, third, b"b/f")
        assert entry is not None and entry.oid is not None
        assert store.read_bytes(entry.oid) == b"EVILb"
        assert tree.lookup(store, third, b"a") == tree.lookup(store, first, b"a")
        assert record.stat().st_ino != written  # a new tree: recorded


def test_a_commit_reads_the_identities_once_and_forgets_what_it_touched(tmp_path: Path) -> None:
    """`booth commit` reads the recorded identities once (`read_stats`) for the files its
    conflict check trusts and for the records it drops after: the same records as reading
    them at each step, and those of another build's tree are never trusted."""
    from jukebox.trees import basetree

    tree_dir, tapes_dir = tmp_path / "tree", tmp_path / "tapes"
    for name in ("a", "b", "sub/c"):
        (tree_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (tree_dir / name).write_bytes(name.encode())
        os.utime(tree_dir / name, ns=(OLD_NS, OLD_NS))
    tapes = TapeDir(tapes_dir)
    with Store.open(tapes.store_path, create=True) as store:
        base = basetree.build_base_tree(store, tapes, str(tree_dir))
        # The files' ctimes are from just now, racily clean for the build that just ran: its
        # start moved 10 s on, as a build seconds after the last write would have it.
        cache = tapes.state / "base-trees.json"
        known = json.loads(cache.read_text())
        known[str(tree_dir)]["started_ns"] += 10_000_000_000
        cache.write_text(json.dumps(known))
        (tree_dir / "a").write_bytes(b"A")
        final = tree.build_tree(store, tree_dir)
        store.flush()
        stats = basetree.read_stats(tapes, str(tree_dir))
        assert sorted(stats[1]) == [b"a", b"b", b"sub/c"]
        trusted = basetree.known_files(tapes, str(tree_dir), base, stats)
        assert sorted(trusted) == [b"a", b"b", b"sub/c"]
        assert trusted == basetree.known_files(tapes, str(tree_dir), base)
        assert basetree.known_files(tapes, str(tree_dir), final, stats) == {}
        basetree.forget_committed(tapes, str(tree_dir), store, base, final, stats)
        assert sorted(basetree.read_stats(tapes, str(tree_dir))[1]) == [b"b", b"sub/c"]
