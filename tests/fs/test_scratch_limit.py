"""The layer's scratch limit (`Layer(scratch_limit=...)`): the staged files' apparent sizes add
up to at most the limit; past it a write, a copy-up or a growing truncate fails with ENOSPC, as
on a full disk, and deleting files or rolling back gives the room back. Through a real mount,
`statvfs` (df) shows the limit as the file system's size.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadowfs.layer import Layer
from shadowfs.store import Store
from tests.fs.conftest import needs_fuse, tree_state

KIB = 1024
MIB = 1024 * KIB
LIMIT = 1 * MIB


@pytest.fixture
def limited(base: Path, store: Store, tmp_path: Path) -> Iterator[Layer]:
    before = tree_state(base)
    layer = Layer(base, store, tmp_path / "scratch", scratch_limit=LIMIT)
    yield layer
    layer.close()
    assert tree_state(base) == before, "the base changed"


def assert_no_space(fn: object) -> None:
    with pytest.raises(OSError) as caught:
        fn()  # type: ignore[operator]
    assert caught.value.errno == errno.ENOSPC, caught.value


def test_writes_past_the_limit_fail_with_enospc_and_deleting_gives_the_room_back(
    limited: Layer,
) -> None:
    limited.write_file("a.bin", b"a" * (600 * KIB))
    assert limited.staged_bytes() == 600 * KIB
    assert_no_space(lambda: limited.write_file("b.bin", b"b" * (600 * KIB)))
    assert not limited.exists("b.bin")  # refused before anything changed
    # Replacing a staged file counts only the difference.
    limited.write_file("a.bin", b"A" * LIMIT)
    limited.write_file("a.bin", b"a" * (600 * KIB))
    assert limited.staged_bytes() == 600 * KIB
    limited.delete("a.bin")
    assert limited.staged_bytes() == 0
    limited.write_file("b.bin", b"b" * (600 * KIB))
    assert limited.read_file("b.bin") == b"b" * (600 * KIB)
    assert limited.staged_bytes() == limited.staged_bytes(recount=True) == 600 * KIB


def test_a_base_file_bigger_than_the_limit_reads_but_cannot_be_copied_up(
    limited: Layer, base: Path
) -> None:
    big = (base / "big.bin").read_bytes()  # 3 MiB and a bit, over the 1 MiB limit
    node = limited.resolve("big.bin")
    assert_no_space(lambda: limited.open(node.ino, os.O_WRONLY))
    h = limited.open(node.ino, os.O_RDONLY)
    try:
        assert limited.read(h, 0, len(big) + 1) == big
    finally:
        limited.release(h.fh)
    assert limited.staged_bytes() == 0
    # Truncated to nothing first, it needs no copy and fits.
    limited.write_file("big.bin", b"small now")
    assert limited.read_file("big.bin") == b"small now"
    assert limited.staged_bytes() == len(b"small now")


def test_a_sparse_truncate_past_the_limit_is_refused(limited: Layer) -> None:
    limited.write_file("sparse", b"x")
    ino = limited.resolve("sparse").ino
    assert_no_space(lambda: limited.setattr(ino, size=1 << 40))
    assert limited.stat("sparse").st_size == 1
    limited.setattr(ino, size=LIMIT)  # exactly the limit is allowed
    assert limited.staged_bytes() == LIMIT
    limited.setattr(ino, size=10)
    assert limited.staged_bytes() == 10


def test_rollback_gives_back_what_the_undone_step_staged(limited: Layer) -> None:
    before, _ = limited.snapshot()
    limited.write_file("a.bin", b"a" * (900 * KIB))
    limited.snapshot()
    assert_no_space(lambda: limited.write_file("b.bin", b"b" * (200 * KIB)))
    limited.restore(before)
    assert limited.staged_bytes() == limited.staged_bytes(recount=True) == 0
    limited.write_file("b.bin", b"b" * (900 * KIB))
    assert limited.staged_bytes() == 900 * KIB


def test_a_negative_limit_is_refused(base: Path, store: Store, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scratch_limit"):
        Layer(base, store, tmp_path / "scratch", scratch_limit=-1)


@pytest.fixture
def limited_mount(limited: Layer, tmp_path: Path) -> Iterator[tuple[Path, list[OSError]]]:
    """The limited layer served from this process's threads (so its hook is ours to see);
    yields the mount point and the errors the hook was called with."""
    from shadowfs.mountctl import mounted

    refused: list[OSError] = []
    limited.on_write_refused = refused.append
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with mounted(limited, mnt):
        yield mnt, refused


def dd(path: Path, blocks: int) -> subprocess.CompletedProcess[str]:
    """``blocks`` 64 KiB blocks of zeros into ``path``, fsynced: as a tool writes a file."""
    return subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=64K", f"count={blocks}", "conv=fsync"],
        capture_output=True,
        text=True,
    )


@pytest.mark.fuse
@needs_fuse
def test_through_a_mount_df_shows_the_limit_and_a_write_past_it_fails(
    limited: Layer, limited_mount: tuple[Path, list[OSError]]
) -> None:
    mnt, refused = limited_mount
    st = os.statvfs(mnt)
    assert st.f_blocks * st.f_frsize == LIMIT
    assert st.f_bavail * st.f_frsize == LIMIT
    (mnt / "a.bin").write_bytes(b"a" * (512 * KIB))
    st = os.statvfs(mnt)
    assert st.f_bavail * st.f_frsize == LIMIT - 512 * KIB
    assert refused == []

    # The kernel caches writes, so the error comes at fsync or close; the tool exits non-zero,
    # as on a full disk, and the hook hears of it.
    proc = dd(mnt / "b.bin", 16)
    assert proc.returncode != 0
    assert "No space left on device" in proc.stderr
    assert refused and all(e.errno == errno.ENOSPC for e in refused)
    assert limited.staged_bytes() <= LIMIT

    os.unlink(mnt / "b.bin")
    os.unlink(mnt / "a.bin")
    # The kernel sends RELEASE for dd's file after dd has exited, in the background; like an
    # unlinked file still open on ext4, b.bin holds its room until then.
    deadline = time.monotonic() + 10
    while limited.staged_bytes() > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert limited.staged_bytes() == 0
    proc = dd(mnt / "c.bin", 15)
    assert proc.returncode == 0, proc.stderr
    assert (mnt / "c.bin").stat().st_size == 15 * 64 * KIB
    assert limited.staged_bytes() == limited.staged_bytes(recount=True) == 15 * 64 * KIB


@pytest.mark.fuse
@needs_fuse
def test_through_a_mount_a_copy_up_past_the_limit_is_refused_and_nothing_is_staged(
    limited: Layer, limited_mount: tuple[Path, list[OSError]], base: Path
) -> None:
    mnt, refused = limited_mount
    with pytest.raises(OSError) as caught, open(mnt / "big.bin", "ab") as f:
        f.write(b"more")
    assert caught.value.errno == errno.ENOSPC
    assert [e.errno for e in refused] == [errno.ENOSPC]
    assert limited.staged_bytes() == 0
    # What a checkpoint or commit would take is the base's content (the kernel may have set
    # the file's mtime: it keeps times itself under its writeback cache).
    limited.snapshot()
    assert limited.read_file("big.bin") == (base / "big.bin").read_bytes()


@pytest.mark.fuse
@needs_fuse
def test_through_a_mount_a_truncate_past_the_limit_fails_at_once(
    limited: Layer, limited_mount: tuple[Path, list[OSError]]
) -> None:
    mnt, refused = limited_mount
    (mnt / "s").write_bytes(b"x")
    with pytest.raises(OSError) as caught:
        os.truncate(mnt / "s", 1 << 40)
    assert caught.value.errno == errno.ENOSPC
    assert (mnt / "s").stat().st_size == 1
    assert refused == []  # refused before the kernel took anything: nothing to stop
