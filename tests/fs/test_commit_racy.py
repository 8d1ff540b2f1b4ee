"""The racy window a commit trusts recorded file identities by (shadowfs.tree.racy_window, used
by jukebox.trees.basetree.known_files): a few ticks of the kernel's coarse clock on the local
file systems that stamp nanoseconds, two seconds anywhere else. On real file systems: the
race the window exists for is run against the kernel itself."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jukebox.tape.tapedir import TapeDir
from jukebox.trees import basetree
from shadowfs import tree
from shadowfs.store import Store

SHM = Path("/dev/shm")


def _window(path: Path) -> tree.RacyWindow:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return tree.racy_window(fd)
    finally:
        os.close(fd)


def _fine(path: Path) -> tree.RacyWindow:
    window = _window(path)
    if window.fine_ns == tree.RACY_NS:
        pytest.skip(f"{path} is on no file system of shadowfs.tree.FINE_FS_TYPES")
    return window


def _places(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path  # the root file system's (ext4 here)
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        shm = SHM / f"jbx-racy-{os.getpid()}"
        shm.mkdir()
        try:
            yield shm
        finally:
            for p in shm.iterdir():
                p.unlink()
            shm.rmdir()


def test_a_write_after_the_reference_is_never_stamped_before_the_window(tmp_path: Path) -> None:
    """The race: an instant is taken (a build's start), then a file is written. Its ctime comes
    from the coarse clock and may lie before that instant (a write within the same tick after
    a build read the file would then keep the ctime the build saw): by at most the window, or
    a file written after the build could be taken as unchanged."""
    for place in _places(tmp_path):
        window = _fine(place)
        lagged = 0
        for _ in range(20):
            time.sleep(0.005)  # a fresh tick, as a build starting at any moment meets
            written: list[tuple[Path, int]] = []
            for i in range(100):
                path = place / f"f{i}"
                started = time.time_ns()
                # No stat in between: a stat makes the next stamp fine-grained (Linux 6.13's
                # multigrain times), and a build's writer does not stat.
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.write(fd, b"written after the reference")
                finally:
                    os.close(fd)
                written.append((path, started))
            for path, started in written:
                st = path.stat()
                lag = started - st.st_ctime_ns
                lagged += lag > 0
                assert lag < window.racy_ns(st.st_dev, st.st_ctime_ns), (
                    f"{path}: written after the reference, stamped {lag} ns before it"
                )
                path.unlink()
        # The race is real here: with no window, these files would have passed as older.
        assert lagged, f"no stamp on {place} lagged its write: the race was not run"


def test_the_fine_window_is_for_nanosecond_stamps_on_the_listed_file_systems(
    tmp_path: Path,
) -> None:
    window = _fine(tmp_path)
    dev = os.stat(tmp_path).st_dev
    tick = time.clock_getres(5)  # CLOCK_REALTIME_COARSE
    assert window.fine_ns == tree.FINE_RACY_TICKS * round(tick * 1e9) < tree.RACY_NS
    assert window.racy_ns(dev, 1_700_000_000_123_456_789) == window.fine_ns
    # Whole seconds (an ext4 of 128-byte inodes), another device (a mount inside the tree):
    assert window.racy_ns(dev, 1_700_000_000_000_000_000) == tree.RACY_NS
    assert window.racy_ns(dev + 1, 1_700_000_000_123_456_789) == tree.RACY_NS
    proc = _window(Path("/proc"))  # not one of FINE_FS_TYPES
    assert proc.racy_ns(os.stat("/proc").st_dev, 1_700_000_000_123_456_789) == tree.RACY_NS


def test_a_commit_trusts_only_identities_older_than_the_window(tmp_path: Path) -> None:
    """`known_files` (the identities `booth commit`'s conflict check trusts unread): past the
    fine window on the tree's own device with nanosecond stamps; else past RACY_NS."""
    tree_dir, tapes = tmp_path / "tree", TapeDir(tmp_path / "tapes")
    tree_dir.mkdir()
    window = _fine(tree_dir)
    for name in ("old", "racy", "seconds", "elsewhere", "long-ago"):
        (tree_dir / name).write_bytes(name.encode())
    with Store.open(tapes.store_path, create=True) as store:
        base = basetree.build_base_tree(store, tapes, str(tree_dir))
        store.flush()
    built_with, stats = basetree.read_stats(tapes, str(tree_dir))
    dev, _, ctime = stats[b"old"]
    # The build's start moved to just past the fine window after "old" was written.
    started = ctime + window.fine_ns + 1_000_000
    record = tapes.state / "base-trees.json"
    known = json.loads(record.read_text())
    known[str(tree_dir)]["started_ns"] = started
    record.write_text(json.dumps(known))
    stats[b"racy"] = (dev, stats[b"racy"][1], started - window.fine_ns // 2)
    whole = (started - 1_000_000_000) // 1_000_000_000 * 1_000_000_000  # a second-grained stamp
    stats[b"seconds"] = (dev, stats[b"seconds"][1], whole)
    stats[b"elsewhere"] = (dev + 1, stats[b"elsewhere"][1], started - 1_000_000_007)
    stats[b"long-ago"] = (dev + 1, stats[b"long-ago"][1], started - 3 * tree.RACY_NS + 7)
    basetree._write_stats(tapes, str(tree_dir), built_with, stats)
    assert sorted(basetree.known_files(tapes, str(tree_dir), base)) == [b"long-ago", b"old"]
