"""Copy-up of a big base file shares its blocks on a reflink file system (XFS, loop image).

Both backends should copy up in O(1) disk when the base and the booth's scratch share a file
system that can clone: the FUSE layer copies with copy_file_range, kernel overlayfs clones on
copy-up. A copy done by reading and writing (or overlay options that defeat cloning) would take
the whole file's size in new blocks, which these tests see in the file system's free space.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shadowfs.store import Store
from shadowfs.tree import walk
from tests.fs.conftest import needs_fuse

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop and overlay mounts need root")

BIG = 64 << 20
# (snapshot -> tree id, settle: closes whatever still holds the staged file)
Booth = tuple[Callable[[], bytes], Callable[[], None]]
TAIL = b"appended after the copy-up\n"


@pytest.fixture
def xfs(tmp_path: Path) -> Iterator[Path]:
    assert shutil.which("mkfs.xfs"), "mkfs.xfs is missing: make test installs xfsprogs"
    image, mnt = tmp_path / "xfs.img", tmp_path / "xfs"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(1 << 30)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        base = mnt / "base"
        base.mkdir()
        block = os.urandom(1 << 20)
        with open(base / "big.bin", "wb") as f:
            for i in range(BIG >> 20):
                f.write(block[i:] + block[:i])
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _free_bytes(path: Path) -> int:
    os.sync()
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def _expected(base: Path) -> bytes:
    return hashlib.blake2b((base / "big.bin").read_bytes() + TAIL).digest()


def _append(mnt: Path) -> None:
    with open(mnt / "big.bin", "ab") as f:
        f.write(TAIL)


def _check_new_blocks(before: int, fs_root: Path) -> None:
    """Counted once the staged file is closed: while a writer holds it open, XFS reserves
    speculative blocks past its end, which it gives back on the last close."""
    used = before - _free_bytes(fs_root)
    # A full copy would take 64 MiB; a clone takes metadata and the tail's block.
    assert used < 4 << 20, f"the copy-up took {used >> 20} MiB of new blocks"


def _snapshot_holds_append(store: Store, tree: bytes, want: bytes) -> None:
    files = {p: e for p, e in walk(store, tree) if e.kind == "file"}
    got = hashlib.blake2b(store.read_bytes(files[b"big.bin"].oid)).digest()
    assert got == want


@contextlib.contextmanager
def _fuse_booth(base: Path, store: Store, xfs: Path, mnt: Path) -> Iterator[Booth]:
    from shadowfs.layer import Layer
    from shadowfs.mountctl import Mount

    layer = Layer(base, store, xfs / "scratch")
    m = Mount(layer, mnt, process=True).start()
    try:
        # The server holds the staged file open until it stops.
        yield lambda: m.snapshot()[0], m.stop  # snapshot() is (tree, journal)
    finally:
        m.stop()
        layer.close()


@contextlib.contextmanager
def _overlay_booth(base: Path, store: Store, xfs: Path, mnt: Path) -> Iterator[Booth]:
    from shadowfs.overlay import OverlayLayer

    with OverlayLayer(base, store, xfs / "booth").mounted(mnt) as lay:
        yield lay.snapshot, lambda: None  # the writer's close closed the upper file


@pytest.mark.parametrize(
    "booth",
    [
        pytest.param(_fuse_booth, marks=needs_fuse, id="fuse"),
        pytest.param(_overlay_booth, id="overlay"),
    ],
)
def test_copy_up_clones(booth, xfs: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    base = xfs / "base"
    want = _expected(base)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with Store.open(tmp_path / "store") as store, booth(base, store, xfs, mnt) as (snap, settle):
        before = _free_bytes(xfs)
        _append(mnt)
        tree = snap()
        settle()
        _check_new_blocks(before, xfs)
        _snapshot_holds_append(store, tree, want)
