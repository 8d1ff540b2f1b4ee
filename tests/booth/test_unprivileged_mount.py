"""A layer mounted by an unprivileged process outside any user namespace: mount(2) is refused,
so the mount goes through the setuid fusermount3, which hands the /dev/fuse fd back."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.booth.conftest import NOBODY, last_json, run_py

CODE = r"""
import json, os, sys
from shadowfs.layer import Layer
from shadowfs.mountctl import Mount, mounts_at
from shadowfs.store import Store

root = sys.argv[1]
base, mnt = os.path.join(root, "base"), os.path.join(root, "mnt")
with Store.open(os.path.join(root, "store"), create=True) as store:
    layer = Layer(base, store, os.path.join(root, "scratch"))
    with Mount(layer, mnt) as m:
        types = [t for _, t in mounts_at(mnt)]
        with open(os.path.join(mnt, "new.txt"), "w") as f:
            f.write("written by nobody\n")
        seen = sorted(os.listdir(mnt))
        old = open(os.path.join(mnt, "old.txt")).read()
        tree, _ = layer.snapshot()
    after = [t for _, t in mounts_at(mnt)]
    layer.close()
print(json.dumps({"types": types, "seen": seen, "old": old, "after": after,
                  "base": sorted(os.listdir(base)), "tree": tree.hex()}))
"""


def test_an_unprivileged_mount_goes_through_fusermount3(
    nobody_python: str, nobody_dir: Path, open_dev_fuse: None
) -> None:
    if shutil.which("fusermount3") is None:
        pytest.skip("fusermount3 is not installed")
    for d in ("base", "mnt"):
        (nobody_dir / d).mkdir()
        os.chown(nobody_dir / d, NOBODY, NOBODY)
    (nobody_dir / "base" / "old.txt").write_text("from the base\n")
    os.chown(nobody_dir / "base" / "old.txt", NOBODY, NOBODY)
    proc = run_py(CODE, str(nobody_dir), python=nobody_python, user=NOBODY, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = last_json(proc)
    assert out["types"] == ["fuse.shadowfs"]
    assert out["seen"] == ["new.txt", "old.txt"]
    assert out["old"] == "from the base\n"
    assert out["after"] == [], "the mount is gone once the Mount stops"
    assert out["base"] == ["old.txt"], "the base is never written"
