"""The kernel OverlayFS backend, on real overlay mounts (needs root)."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadowfs import tree
from shadowfs.errors import TreeError
from shadowfs.overlay import OverlayError, OverlayLayer
from shadowfs.store import Store
from shadowfs.tree import build_tree, walk
from tests.conftest import slow

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="kernel overlay mounts need root")

_COARSE = 5  # CLOCK_REALTIME_COARSE: the clock the kernel stamps ctimes with


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "store") as s:
        yield s


def _make_base(base: Path) -> None:
    (base / "src" / "deep").mkdir(parents=True)
    (base / "lib").mkdir()
    (base / "old").mkdir()
    for i in range(5):
        (base / f"f{i}.txt").write_text(f"file {i}\n")
    (base / "src" / "main.py").write_text("print('hi')\n")
    (base / "src" / "deep" / "x").write_text("deep\n")
    (base / "lib" / "util.py").write_text("util v1\n")
    (base / "old" / "gone.txt").write_text("old\n")
    os.symlink("f0.txt", base / "link")
    os.chmod(base / "f4.txt", 0o640)


def _contents(store: Store, tree) -> dict[bytes, tuple]:
    out = {}
    for path, e in walk(store, tree):
        if e.kind == "file":
            out[path] = ("file", store.read_bytes(e.oid), e.mode)
        elif e.kind == "symlink":
            out[path] = ("symlink", e.target)
        else:
            out[path] = ("dir", e.mode)
    return out


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def _next_tick() -> None:
    """Let the coarse clock move past every ctime written so far, so the stat cache may trust
    them (a ctime not older than the snapshot's coarse start is 'racily clean' and re-hashed).
    ctimes can be fine-grained (multigrain timestamps), hence the fine start."""
    start = time.time_ns()
    while time.clock_gettime_ns(_COARSE) <= start:
        time.sleep(0.001)


class _Shell:
    """A bash that keeps running with its cwd inside the mount."""

    def __init__(self, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            ["bash", "--norc", "--noprofile"], cwd=cwd, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )

    def run(self, cmd: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{cmd}; echo __END__\n")
        self.proc.stdin.flush()
        lines = []
        for line in self.proc.stdout:
            if line.rstrip("\n") == "__END__":
                break
            lines.append(line)
        return "".join(lines)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=slow(10))


@pytest.fixture
def layer(tmp_path: Path, store: Store) -> Iterator[tuple[OverlayLayer, Path, Path]]:
    base = tmp_path / "base"
    _make_base(base)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with OverlayLayer(base, store, tmp_path / "booths" / "b1").mounted(mnt) as lay:
        yield lay, base, mnt


def test_snapshot_and_restore_while_a_shell_stays_inside(layer, store: Store) -> None:
    lay, base, mnt = layer
    base_id = build_tree(store, base)
    assert lay.snapshot() == lay.base_tree == base_id

    (mnt / "f1.txt").write_text("file 1 edited\n")
    (mnt / "f2.txt").unlink()
    (mnt / "f3.txt").rename(mnt / "f3-renamed.txt")
    (mnt / "newdir").mkdir()
    (mnt / "newdir" / "n.txt").write_text("new\n")
    shutil.rmtree(mnt / "old")  # a lower dir removed and recreated becomes opaque
    (mnt / "old").mkdir()
    (mnt / "old" / "fresh.txt").write_text("fresh\n")
    os.chmod(mnt / "f4.txt", 0o600)
    first = lay.snapshot()
    # The harvest equals what a full scan of the merged view records, metadata included.
    assert first == build_tree(store, mnt)
    want = _contents(store, first)
    assert want[b"f1.txt"][1] == b"file 1 edited\n"
    assert b"f2.txt" not in want and b"f3.txt" not in want and b"old/gone.txt" not in want
    assert want[b"old/fresh.txt"][1] == b"fresh\n" and want[b"f4.txt"][2] == 0o600

    shell = _Shell(mnt / "src")
    try:
        assert shell.run("cat main.py") == "print('hi')\n"
        (mnt / "f1.txt").write_text("file 1 edited again, longer\n")
        (mnt / "newdir" / "n.txt").unlink()
        (mnt / "src" / "main.py").write_text("print('changed')\n")
        (mnt / "src" / "added.py").write_text("x = 1\n")
        shell.run("echo from-shell > shell.txt")
        (mnt / "f0.txt").unlink()
        second = lay.snapshot()
        assert second == build_tree(store, mnt)
        assert second != first

        lay.restore(first)
        assert lay.restore_stats.method == "in-place"  # the shell holds the mount
        assert lay.restore_stats.frozen >= 1
        assert lay.snapshot() == first
        assert build_tree(store, mnt) == first
        assert (mnt / "f1.txt").read_text() == "file 1 edited\n"
        assert (mnt / "newdir" / "n.txt").read_text() == "new\n"
        assert not (mnt / "src" / "added.py").exists()
        # The shell kept running and sees the restored state from its own cwd.
        assert shell.run("cat main.py") == "print('hi')\n"
        assert shell.run("ls") == "deep\nmain.py\n"
        assert shell.run("cat ../f0.txt") == "file 0\n"

        lay.restore(second)
        assert build_tree(store, mnt) == second
        assert shell.run("cat main.py; cat shell.txt") == "print('changed')\nfrom-shell\n"
        assert shell.proc.poll() is None
    finally:
        shell.close()
    # The base was never written.
    assert build_tree(store, base) == base_id


def test_restore_reaches_a_directory_a_process_sits_in(layer, store: Store, tmp_path) -> None:
    lay, base, mnt = layer
    # A tree that changes lib/, built elsewhere: lib has no upper dir yet while the shell sits
    # in it, so the kernel's pinned dentry must learn of the new upper dir.
    other = tmp_path / "other"
    shutil.copytree(base, other, symlinks=True)
    (other / "lib" / "util.py").write_text("util v2\n")
    (other / "lib" / "more.py").write_text("more\n")
    target = build_tree(store, other)
    shell = _Shell(mnt / "lib")
    try:
        assert shell.run("cat util.py") == "util v1\n"
        lay.restore(target)
        assert lay.restore_stats.method == "in-place"
        assert shell.run("cat util.py more.py") == "util v2\nmore\n"
        assert lay.snapshot() == target
    finally:
        shell.close()


def _cgroup2_root() -> Path | None:
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[2] == "cgroup2" and os.access(parts[1], os.W_OK):
                return Path(parts[1])
    return None


def test_restore_freezes_a_cgroup(tmp_path: Path, store: Store) -> None:
    root = _cgroup2_root()
    if root is None:
        pytest.skip("no writable cgroup v2 hierarchy")
    cg = root / f"jukebox-test-{os.getpid()}"
    cg.mkdir()
    if not (cg / "cgroup.freeze").exists():
        cg.rmdir()
        pytest.skip("this kernel's cgroup v2 has no freezer")
    base = tmp_path / "base"
    _make_base(base)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    lay = OverlayLayer(base, store, tmp_path / "booth", cgroup=cg)
    lay.mount(mnt)
    shell = _Shell(mnt)
    try:
        (cg / "cgroup.procs").write_text(str(shell.proc.pid))
        first = lay.snapshot()
        shell.run("echo scribble > f1.txt")
        lay.restore(first)
        assert lay.restore_stats.frozen == 1
        assert "frozen 0" in (cg / "cgroup.events").read_text()  # thawed again
        assert shell.run("cat f1.txt") == "file 1\n"
    finally:
        shell.close()
        lay.discard()
        cg.rmdir()


def test_restore_when_nobody_holds_the_mount(layer, store: Store) -> None:
    lay, _base, mnt = layer
    (mnt / "f1.txt").write_text("one\n")
    first = lay.snapshot()
    (mnt / "f1.txt").write_text("two\n")
    (mnt / "lib" / "util.py").unlink()
    # Looked up (and cached by the kernel) before the restore changes them behind its back.
    assert (mnt / "f1.txt").read_text() == "two\n" and not (mnt / "lib" / "util.py").exists()
    lay.restore(first)
    assert lay.restore_stats.frozen == 0
    assert _mounted(mnt)
    assert (mnt / "f1.txt").read_text() == "one\n"
    assert (mnt / "lib" / "util.py").read_text() == "util v1\n"
    lay.restore(lay.base_tree)
    assert build_tree(store, mnt) == lay.base_tree


def _is_volatile(path: Path) -> bool:
    # Kernels since 6.x list the option as fsync=volatile, older ones as volatile.
    return bool({"volatile", "fsync=volatile"} & set(_super_options(path)))


def _super_options(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(path):
                return fields[-1].split(",")
    raise AssertionError(f"{path} is not a mount point")


def test_mount_is_volatile_and_stays_so_across_restore(layer, store: Store) -> None:
    # The upper dir is scratch: syncs inside the booth must not reach the disk (snapshots are
    # the durability point), and a restore's remount must not quietly bring the syncs back.
    lay, _base, mnt = layer
    assert _is_volatile(mnt)
    (mnt / "f1.txt").write_text("one\n")
    first = lay.snapshot()
    (mnt / "f1.txt").write_text("two\n")
    lay.restore(first)
    assert _is_volatile(mnt)
    fd = os.open(mnt / "f1.txt", os.O_RDWR)
    try:
        os.fsync(fd)  # answered, not refused
    finally:
        os.close(fd)
    assert (mnt / "f1.txt").read_text() == "one\n"


def test_discard_leaves_the_base_identical_and_no_residue(tmp_path: Path, store: Store) -> None:
    base = tmp_path / "base"
    _make_base(base)
    before = build_tree(store, base)
    booths = tmp_path / "booths"
    lay = OverlayLayer(base, store, booths / "b1", base_tree=before)
    # Mounted over the base's own path, as a booth does.
    lay.mount(base)
    (base / "f1.txt").write_text("scribbled\n")
    shutil.rmtree(base / "src")
    (base / "brand-new").write_text("new\n")
    assert lay.snapshot() != before
    lay.discard()
    assert not _mounted(base)
    assert build_tree(store, base) == before
    assert (base / "f1.txt").read_text() == "file 1\n"
    assert os.listdir(booths) == []


def test_commit_applies_the_layer_to_the_base(tmp_path: Path, store: Store) -> None:
    base = tmp_path / "base"
    _make_base(base)
    lay = OverlayLayer(base, store, tmp_path / "booths" / "b1")
    lay.mount(base)
    (base / "f1.txt").write_text("committed\n")
    (base / "f2.txt").unlink()
    (base / "lib" / "new.py").write_text("new\n")
    tree = lay.commit(tmp_path / "journal")
    assert not _mounted(base)
    assert build_tree(store, base) == tree
    assert (base / "f1.txt").read_text() == "committed\n"
    lay.discard()
    assert os.listdir(tmp_path / "booths") == []


def test_snapshot_rehashes_only_changed_files(tmp_path: Path, store: Store) -> None:
    base = tmp_path / "base"
    for d in range(10):
        (base / f"d{d}").mkdir(parents=True)
        for f in range(100):
            (base / f"d{d}" / f"f{f}.txt").write_text(f"{d}/{f}\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    lay = OverlayLayer(base, store, tmp_path / "booth")
    lay.mount(mnt)
    try:
        for i in range(10):
            (mnt / f"d{i}" / "f0.txt").write_text(f"changed {i}\n")
        _next_tick()
        lay.snapshot()
        assert lay.snapshot_stats.hashed == 10
        for i in range(10):
            (mnt / f"d{i}" / "f1.txt").write_text(f"changed too {i}\n")
        _next_tick()
        tree = lay.snapshot()
        assert lay.snapshot_stats.hashed == 10  # only the new changes were read
        assert lay.snapshot_stats.cache_hits == 10  # the earlier ones were trusted by stat
        assert lay.snapshot_stats.upper_dirs == 11  # the root and the ten touched dirs
        assert tree == build_tree(store, mnt)
        lay.snapshot()
        assert lay.snapshot_stats.hashed == 0 and lay.snapshot_stats.trees_written == 0
    finally:
        lay.discard()


def test_a_time_beyond_what_a_tree_records_does_not_break_snapshots(layer, store: Store) -> None:
    lay, _base, mnt = layer
    late = 10_413_792_000 * 10**9  # 2300-01-01; ext4 keeps it, a tree cannot
    (mnt / "later.txt").write_text("later\n")
    os.utime(mnt / "later.txt", ns=(late, late))
    snap = lay.snapshot()
    e = tree.lookup(store, snap, b"later.txt")
    assert e is not None and e.mtime_ns == (1 << 63) - 1


def test_a_snapshot_deeper_than_a_tree_holds_fails_in_one_line(layer, store: Store) -> None:
    """The kernel lets the agent nest directories past tree.MAX_DEPTH; the snapshot says so
    instead of storing a tree no later booth could read back."""
    lay, _base, mnt = layer
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(tree.MAX_DEPTH + 1):
            os.mkdir("d", dir_fd=fd)
            deeper = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
    finally:
        os.close(fd)
    with pytest.raises(TreeError) as refused:
        lay.snapshot()
    assert "\n" not in str(refused.value) and str(tree.MAX_DEPTH) in str(refused.value)


def test_names_with_spaces_newlines_and_bad_utf8(layer, store: Store) -> None:
    lay, _base, mnt = layer
    odd = [b"with space", b"new\nline", b"bad\xff\xfeutf8"]
    root = os.fsencode(mnt)
    for name in odd:
        with open(root + b"/" + name, "wb") as f:
            f.write(name)
    first = lay.snapshot()
    for name in odd:
        os.unlink(root + b"/" + name)
    lay.restore(first)
    for name in odd:
        with open(root + b"/" + name, "rb") as f:
            assert f.read() == name
    assert build_tree(store, mnt) == first


def test_booth_inside_the_base_is_refused(tmp_path: Path, store: Store) -> None:
    base = tmp_path / "base"
    _make_base(base)
    with pytest.raises(OverlayError, match="inside the base"):
        OverlayLayer(base, store, base / "booth")


def test_a_directory_made_opaque_after_a_snapshot_hides_the_base_again(layer, store: Store) -> None:
    # A lower dir first copied up (merged, not opaque), snapshotted, then removed and made
    # again: the new upper dir is opaque, so the lower entries are gone. Each snapshot must ask
    # again, however the directory's opacity was known at the one before.
    lay, _base, mnt = layer
    for round_ in range(20):
        (mnt / "lib" / f"new{round_}.py").write_text("x\n")  # copies lib up, merged
        _next_tick()
        merged = lay.snapshot()
        assert tree.lookup(store, merged, b"lib/util.py") is not None
        shutil.rmtree(mnt / "lib")
        (mnt / "lib").mkdir()
        (mnt / "lib" / "only.py").write_text("only\n")
        remade = lay.snapshot()
        names = {e.name for e in tree.read_tree(store, tree.lookup(store, remade, b"lib").oid)}
        assert names == {b"only.py"}, f"round {round_}: {names}"
        lay.restore(merged)
        assert (mnt / "lib" / "util.py").read_text() == "util v1\n"


def test_writes_through_a_mapping_kept_across_snapshots_reach_each_one(
    layer, store: Store
) -> None:
    # A write through a shared mapping moves the ctime only when it faults, on the first write
    # to a clean page; a database keeps its file mapped and writes the same pages again.
    lay, _base, mnt = layer
    (mnt / "db").write_bytes(b"\0" * 8192)
    with open(mnt / "db", "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        for i in range(6):
            m[0:8] = b"round %02d" % i
            m[4096:4104] = b"page2 %02d" % i
            _next_tick()  # no racily clean re-read to hide a missed write
            got = store.read_bytes(tree.lookup(store, lay.snapshot(), b"db").oid)
            assert got[0:8] == b"round %02d" % i and got[4096:4104] == b"page2 %02d" % i, i
