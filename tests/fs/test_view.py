"""The read-only view: a real FUSE mount of a stored tree."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadowfs.store import CHUNK_SIZE, Store
from shadowfs.tree import build_tree
from shadowfs.view import ViewError, mounted_view

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse"),
]

BIG = 2 * CHUNK_SIZE + 123_457  # three chunks, the last one partial


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "store") as s:
        yield s


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "README").write_text("hello\n")
    (src / "pkg" / "mod.py").write_text("x = 1\n" * 100)
    (src / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 64)
    (src / "exec.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(src / "exec.sh", 0o755)
    os.chmod(src / "README", 0o600)
    os.chmod(src / "empty", 0o700)
    (src / "zero").write_bytes(b"")
    os.symlink("pkg/mod.py", src / "link")
    os.symlink("/nowhere/at/all", src / "dangling")
    os.utime(src / "README", ns=(1_000_000_123, 1_500_000_000_987_654_321))
    (src / "with space").write_text("space\n")
    with open(os.fsencode(src) + b"/bad\xffname", "wb") as f:
        f.write(b"bad utf-8\n")
    (src / "big.bin").write_bytes(random.Random(7).randbytes(BIG))
    return src


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def test_view_shows_the_tree_exactly(tmp_path: Path, store: Store, source: Path) -> None:
    tree = build_tree(store, source)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with mounted_view(store, tree, mnt):
        assert _mounted(mnt)
        # Names, kinds, modes, sizes, mtimes and symlink targets, all as recorded.
        assert build_tree(store, mnt) == tree
        # Directory sizes are file-system specific (trees record 0), so sizes for files only.
        for args in (["-printf", "%y %m %T@ %p\n"], ["-type", "f", "-printf", "%s %p\n"]):
            found = subprocess.run(["find", ".", "-mindepth", "1", *args], cwd=mnt,
                                   capture_output=True, check=True).stdout
            expect = subprocess.run(["find", ".", "-mindepth", "1", *args], cwd=source,
                                    capture_output=True, check=True).stdout
            assert sorted(found.splitlines()) == sorted(expect.splitlines())
        cat = subprocess.run(["cat", "README", "pkg/mod.py"], cwd=mnt, capture_output=True,
                             check=True).stdout
        assert cat == b"hello\n" + b"x = 1\n" * 100
        diff = subprocess.run(["diff", "-r", "--no-dereference", str(source), str(mnt)],
                              capture_output=True, text=True)
        assert diff.returncode == 0, diff.stdout + diff.stderr
        st = os.stat(mnt / "README")
        assert st.st_mtime_ns == 1_500_000_000_987_654_321 and st.st_mode & 0o7777 == 0o600
        assert os.readlink(mnt / "dangling") == "/nowhere/at/all"
        # Inodes are stable for the life of the mount.
        assert os.stat(mnt / "pkg" / "mod.py").st_ino == os.stat(mnt / "pkg" / "mod.py").st_ino
    assert not _mounted(mnt)


def test_view_refuses_every_write(tmp_path: Path, store: Store, source: Path) -> None:
    tree = build_tree(store, source)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    attempts = [
        lambda: open(mnt / "README", "w"),  # noqa: SIM115
        lambda: open(mnt / "README", "a"),  # noqa: SIM115
        lambda: open(mnt / "new.txt", "w"),  # noqa: SIM115
        lambda: os.mkdir(mnt / "d"),
        lambda: os.unlink(mnt / "README"),
        lambda: os.rmdir(mnt / "empty"),
        lambda: os.rename(mnt / "README", mnt / "R"),
        lambda: os.symlink("x", mnt / "s"),
        lambda: os.link(mnt / "README", mnt / "h"),
        lambda: os.chmod(mnt / "README", 0o644),
        lambda: os.utime(mnt / "README", (0, 0)),
        lambda: os.truncate(mnt / "README", 0),
        lambda: os.setxattr(mnt / "README", "user.k", b"v"),
    ]
    with mounted_view(store, tree, mnt):
        for attempt in attempts:
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == errno.EROFS
        assert (mnt / "README").read_text() == "hello\n"
        assert sorted(os.listdir(mnt)) == sorted(os.listdir(source))


def test_large_chunked_file_reads_at_random_offsets(tmp_path: Path, store: Store,
                                                    source: Path) -> None:
    tree = build_tree(store, source)
    want = (source / "big.bin").read_bytes()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    rng = random.Random(11)
    with mounted_view(store, tree, mnt):
        fd = os.open(mnt / "big.bin", os.O_RDONLY | os.O_DIRECT)  # bypass the page cache
        try:
            assert os.fstat(fd).st_size == BIG
            for _ in range(60):
                off = rng.randrange(0, BIG) & ~4095  # O_DIRECT wants aligned offsets
                n = rng.choice([4096, 65536, CHUNK_SIZE])  # some reads straddle chunks
                assert os.preadv(fd, [buf := bytearray(n)], off) == min(n, BIG - off)
                assert bytes(buf[: min(n, BIG - off)]) == want[off : off + n]
            assert os.pread(fd, 4096, BIG + 4096) == b""
        finally:
            os.close(fd)
        with open(mnt / "big.bin", "rb") as f:
            assert f.read() == want


def test_daemon_serves_until_fusermount_unmounts(tmp_path: Path, store: Store,
                                                source: Path) -> None:
    tree = build_tree(store, source)
    store.flush()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run([sys.executable, "-m", "shadowfs.view", str(tmp_path / "store"),
                           tree.hex(), str(mnt)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    try:
        assert _mounted(mnt)  # ready as soon as the command returns
        assert (mnt / "pkg" / "mod.py").read_text() == "x = 1\n" * 100
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
    assert not _mounted(mnt)
    deadline = time.monotonic() + 10
    while _daemon_alive(mnt) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _daemon_alive(mnt)


def _daemon_alive(mnt: Path) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if b"shadowfs.view" in args and os.fsencode(mnt) in args:
                return True
    return False


def test_daemon_reports_a_missing_tree(tmp_path: Path, store: Store) -> None:
    store.flush()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run([sys.executable, "-m", "shadowfs.view", str(tmp_path / "store"),
                           "ab" * 32, str(mnt)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "missing" in proc.stderr
    assert not _mounted(mnt)


def test_mounted_view_reports_a_bad_mount_point(tmp_path: Path, store: Store,
                                                source: Path) -> None:
    tree = build_tree(store, source)
    with pytest.raises(ViewError, match="not a directory"), \
            mounted_view(store, tree, tmp_path / "absent"):
        pass
