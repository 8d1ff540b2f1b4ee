"""shadowfs.commit on real directories: every change type, conflicts, hostile input, recovery."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from blake3 import blake3

from shadowfs import commit, tree
from shadowfs.commit import CommitReport, apply, clean_residue, recover
from shadowfs.errors import ConflictError, ShadowfsError, TreeError
from shadowfs.store import Store
from shadowfs.tree import Entry, build_tree, encode_tree, materialize, read_tree
from tests.conftest import slow

OLD_NS = 1_600_000_000_123_456_789  # 2020: outside build_tree's racy window
REPO = Path(__file__).resolve().parents[2]

Snapshot = dict[bytes, tuple[object, ...]]
Builder = Callable[[Path], None]


# --- helpers shared with test_commit_crash.py -------------------------------------------------


def snapshot(root: Path, *, with_root: bool = False) -> Snapshot:
    """Everything lstat and the bytes say about a tree, symlinks never followed."""
    top = os.fsencode(root)
    out: Snapshot = {}
    if with_root:
        st = os.lstat(top)
        out[b"."] = ("root", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
    stack = [b""]
    while stack:
        rel = stack.pop()
        for name in os.listdir(os.path.join(top, rel) if rel else top):
            path = rel + b"/" + name if rel else name
            full = os.path.join(top, path)
            st = os.lstat(full)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                out[path] = ("dir", mode, st.st_mtime_ns)
                stack.append(path)
            elif stat.S_ISLNK(st.st_mode):
                out[path] = ("symlink", st.st_mtime_ns, os.readlink(full))
            else:
                h = blake3()
                with open(full, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                out[path] = ("file", mode, st.st_size, st.st_mtime_ns, h.hexdigest())
    return out


def write(path: Path, data: bytes, mode: int = 0o644, mtime_ns: int | None = OLD_NS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def link(path: Path, target: str | bytes) -> None:
    os.symlink(target, path)
    os.utime(path, ns=(OLD_NS, OLD_NS), follow_symlinks=False)


class Scenario:
    """A base tree, a new tree, a target holding the base and a reference holding the new."""

    def __init__(self, tmp: Path, store: Store, build: Builder, mutate: Builder) -> None:
        self.tmp = tmp
        self.store = store
        src = tmp / "src"
        src.mkdir()
        build(src)
        self.base = build_tree(store, src)
        mutate(src)
        self.new = build_tree(store, src)
        store.flush()
        self.journal = tmp / "journal"
        self.reference = tmp / "reference"
        materialize(store, self.new, self.reference)
        self.target = self.fresh_target("target")

    def fresh_target(self, name: str) -> Path:
        path = self.tmp / name
        materialize(self.store, self.base, path)
        return path

    def apply(self, progress: commit.Progress | None = None) -> CommitReport:
        return apply(
            self.store, self.target, self.base, self.new,
            journal_dir=self.journal, progress=progress,
        )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    tree.clear_cache()
    with Store.open(tmp_path / "store", create=True) as s:
        yield s


# --- scenarios --------------------------------------------------------------------------------


def base_tree(src: Path) -> None:
    write(src / "keep.txt", b"unchanged\n")
    write(src / "edit.txt", b"hello world\n")
    write(src / "grow.txt", b"short\n")
    write(src / "chmod.sh", b"#!/bin/sh\n", 0o644)
    write(src / "touch.txt", b"same bytes\n")
    write(src / "gone.txt", b"bye\n")
    link(src / "link-retarget", "keep.txt")
    link(src / "link-gone", "keep.txt")
    write(src / "dir-gone/a/b/c.txt", b"deep\n")
    write(src / "dir-gone/d.txt", b"d\n")
    write(src / "f2d", b"file that becomes a dir\n")
    write(src / "d2f/child.txt", b"child\n")
    write(src / "d2l/child.txt", b"child\n")
    link(src / "l2f", "keep.txt")
    write(src / "f2l", b"file that becomes a link\n")
    write(src / "sub/inner.txt", b"inner\n")
    write(src / "ro/existing.txt", b"existing\n")
    for d in ("dir-gone/a/b", "dir-gone/a", "dir-gone", "d2f", "d2l", "sub", "ro"):
        os.utime(src / d, ns=(OLD_NS, OLD_NS))


def base_with_big(src: Path) -> None:
    base_tree(src)
    write(src / "big.bin", os.urandom((4 << 20) + 4096))  # over CHUNK_SIZE: the chunked path


def _edit(src: Path) -> None:
    (src / "edit.txt").write_bytes(b"HELLO WORLD\n")  # same size


def _grow(src: Path) -> None:
    with open(src / "grow.txt", "ab") as f:
        f.write(b"and longer now\n")


def _chmod(src: Path) -> None:
    (src / "chmod.sh").chmod(0o755)


def _touch(src: Path) -> None:
    os.utime(src / "touch.txt", ns=(OLD_NS + 10**9, OLD_NS + 10**9))


def _delete(src: Path) -> None:
    (src / "gone.txt").unlink()


def _retarget(src: Path) -> None:
    (src / "link-retarget").unlink()
    os.symlink("edit.txt", src / "link-retarget")


def _unlink_symlink(src: Path) -> None:
    (src / "link-gone").unlink()


def _rmtree(src: Path) -> None:
    shutil.rmtree(src / "dir-gone")


def _file_to_dir(src: Path) -> None:
    (src / "f2d").unlink()
    write(src / "f2d/nested/child.txt", b"now a dir\n", mtime_ns=None)


def _dir_to_file(src: Path) -> None:
    shutil.rmtree(src / "d2f")
    write(src / "d2f", b"now a file\n", 0o600, mtime_ns=None)


def _dir_to_symlink(src: Path) -> None:
    shutil.rmtree(src / "d2l")
    os.symlink("sub", src / "d2l")


def _symlink_to_file(src: Path) -> None:
    (src / "l2f").unlink()
    write(src / "l2f", b"now a file\n", mtime_ns=None)


def _file_to_symlink(src: Path) -> None:
    (src / "f2l").unlink()
    os.symlink("keep.txt", src / "f2l")


def _dir_mode(src: Path) -> None:
    (src / "sub/inner.txt").write_bytes(b"inner, edited\n")
    (src / "sub").chmod(0o700)


def _readonly_dir_gains_a_file(src: Path) -> None:
    write(src / "ro/added.txt", b"added\n", mtime_ns=None)
    (src / "ro").chmod(0o555)


def _add_tree(src: Path) -> None:
    write(src / "new/x/y/z.txt", b"z\n", mtime_ns=None)
    (src / "new/empty").mkdir()
    write(src / "new/setuid", b"#!/bin/sh\n", 0o4755, mtime_ns=None)
    write(src / "new/empty-file", b"", mtime_ns=None)
    os.symlink("../keep.txt", src / "new/link")


def _big_edit(src: Path) -> None:
    if not (src / "big.bin").exists():
        return  # most scenarios leave the big file out to stay quick
    with open(src / "big.bin", "r+b") as f:
        f.seek(2 << 20)
        f.write(b"changed in the middle")


MUTATIONS: dict[str, Builder] = {
    "modify same size": _edit,
    "modify longer": _grow,
    "mode only": _chmod,
    "mtime only": _touch,
    "delete file": _delete,
    "retarget symlink": _retarget,
    "delete symlink": _unlink_symlink,
    "delete tree": _rmtree,
    "file to dir": _file_to_dir,
    "dir to file": _dir_to_file,
    "dir to symlink": _dir_to_symlink,
    "symlink to file": _symlink_to_file,
    "file to symlink": _file_to_symlink,
    "dir mode": _dir_mode,
    "read-only dir gains a file": _readonly_dir_gains_a_file,
    "add tree": _add_tree,
    "big file edit": _big_edit,
}


def everything(src: Path) -> None:
    for mutate in MUTATIONS.values():
        mutate(src)


def assert_committed(s: Scenario) -> None:
    assert snapshot(s.target) == snapshot(s.reference)
    assert build_tree(s.store, s.target) == s.new
    assert not os.listdir(s.journal)


# --- applying every kind of change ------------------------------------------------------------


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_change_type_is_applied_exactly(tmp_path: Path, store: Store, name: str) -> None:
    build = base_with_big if name == "big file edit" else base_tree
    s = Scenario(tmp_path, store, build, MUTATIONS[name])
    assert snapshot(s.target) != snapshot(s.reference)
    report = s.apply()
    assert report.changed > 0
    assert_committed(s)


def test_all_changes_at_once_and_the_report(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_with_big, everything)
    seen: list[tuple[str, int, int]] = []
    report = s.apply(progress=lambda phase, done, total: seen.append((phase, done, total)))
    assert_committed(s)
    written = sum(e.size for _, e in tree.walk(store, s.new) if e.kind == "file") - sum(
        len((s.reference / p).read_bytes())
        for p in ("keep.txt", "touch.txt", "chmod.sh", "ro/existing.txt")
    )
    assert report.bytes_written == written
    assert report.changed >= len(MUTATIONS)
    last = {phase: (done, total) for phase, done, total in seen}
    assert set(last) == {"check", "stage", "apply"}
    assert all(done == total > 0 for done, total in last.values())


def test_commit_back_to_the_base_undoes_it(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, everything)
    s.apply()
    old = tmp_path / "old"
    materialize(store, s.base, old)
    apply(store, s.target, s.new, s.base, journal_dir=s.journal)
    assert snapshot(s.target) == snapshot(old)


def test_identical_trees_commit_nothing(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, lambda src: None)
    before = snapshot(s.target, with_root=True)
    assert s.apply() == CommitReport(0, 0)
    assert snapshot(s.target, with_root=True) == before


def test_awkward_names(tmp_path: Path, store: Store) -> None:
    names = [b"with space", b"new\nline", b"caf\xe9", b"\xff\xfe", b" lead", b"-dash", b"*?[]"]

    def build(src: Path) -> None:
        top = os.fsencode(src)
        for i, n in enumerate(names):
            write(Path(os.fsdecode(os.path.join(top, n))), b"v1 %d\n" % i)
        os.mkdir(os.path.join(top, b"dir \n\xe9"))
        write(Path(os.fsdecode(os.path.join(top, b"dir \n\xe9", b"inner\x80"))), b"x")

    def mutate(src: Path) -> None:
        top = os.fsencode(src)
        with open(os.path.join(top, b"with space"), "ab") as f:
            f.write(b"more")
        os.unlink(os.path.join(top, b"new\nline"))
        os.chmod(os.path.join(top, b"caf\xe9"), 0o600)
        os.symlink(b"caf\xe9", os.path.join(top, b"link \xe9\n"))
        shutil.rmtree(os.path.join(top, b"dir \n\xe9"))
        os.makedirs(os.path.join(top, b"added \xfe/\n"))
        with open(os.path.join(top, b"added \xfe/\n/f\x81 g"), "wb") as f:
            f.write(b"new")

    s = Scenario(tmp_path, store, build, mutate)
    s.apply()
    assert_committed(s)


# --- conflicts: refused with nothing written --------------------------------------------------


def _same_size_edit_keeping_mtime(target: Path) -> None:
    p = target / "edit.txt"
    st = p.stat()
    p.write_bytes(b"hello WORLD\n")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def _create_where_layer_adds(target: Path) -> None:
    (target / "new").mkdir()


def _delete_what_layer_edits(target: Path) -> None:
    (target / "edit.txt").unlink()


def _extra_file_in_a_deleted_dir(target: Path) -> None:
    (target / "dir-gone/a/surprise").write_bytes(b"!")


def _mode_changed_underneath(target: Path) -> None:
    (target / "chmod.sh").chmod(0o600)


def _symlink_retargeted_underneath(target: Path) -> None:
    (target / "link-retarget").unlink()
    os.symlink("grow.txt", target / "link-retarget")


def _parent_swapped_for_a_symlink(target: Path) -> None:
    outside = target.parent / "outside"
    shutil.copytree(target / "sub", outside, symlinks=True)
    shutil.rmtree(target / "sub")
    os.symlink(outside, target / "sub")


CONFLICTS: dict[str, tuple[Builder, list[str]]] = {
    "file edited underneath": (_same_size_edit_keeping_mtime, ["edit.txt"]),
    "path added underneath": (_create_where_layer_adds, ["new"]),
    "file deleted underneath": (_delete_what_layer_edits, ["edit.txt"]),
    "extra entry in a deleted dir": (_extra_file_in_a_deleted_dir, ["dir-gone/a/surprise"]),
    "mode changed underneath": (_mode_changed_underneath, ["chmod.sh"]),
    "symlink changed underneath": (_symlink_retargeted_underneath, ["link-retarget"]),
    "parent swapped for a symlink": (_parent_swapped_for_a_symlink, ["sub", "sub/inner.txt"]),
}


@pytest.mark.parametrize("name", list(CONFLICTS))
def test_conflict_is_refused_with_nothing_written(tmp_path: Path, store: Store, name: str) -> None:
    tamper, expected = CONFLICTS[name]
    s = Scenario(tmp_path, store, base_tree, everything)
    tamper(s.target)
    outside = tmp_path / "outside"
    before = snapshot(s.target, with_root=True)
    before_outside = snapshot(outside) if outside.exists() else None
    with pytest.raises(ConflictError) as info:
        s.apply()
    assert info.value.conflicts == expected
    assert "nothing was applied" in str(info.value)
    assert snapshot(s.target, with_root=True) == before
    if before_outside is not None:
        assert snapshot(outside) == before_outside
    assert not os.listdir(s.journal)


def _base_and_many(src: Path) -> None:
    base_tree(src)
    for i in range(commit.SYNCFS_FROM + 20):
        write(src / "many" / f"d{i:03d}" / "f", b"old %d\n" % i)


def _everything_and_many(src: Path) -> None:
    everything(src)
    for i in range(commit.SYNCFS_FROM + 20):
        write(src / "many" / f"d{i:03d}" / "f", b"new %d\n" % i)


def _calls(calls: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big commit's per-file calls in compiled batches (shadowfs/_batchio.c, built by the
    install) or, as where they are not built, from Python; "default": whichever is there."""
    if calls == "python":
        monkeypatch.setattr(commit, "_batchio", None)


CALLS = ["python", pytest.param("compiled", marks=pytest.mark.skipif(
    commit._batchio is None, reason="shadowfs/_batchio.c was not built (`make setup`)"
))]  # fmt: skip


# One of each way the check beside the staging finds a conflict: a read (the main thread
# checks it again), a name in a removed directory, an entry decided without the store, and a
# staging directory that is no directory any more.
# The last one again with the per-file calls made from Python (the staging fails in a thread).
@pytest.mark.parametrize(
    ("name", "calls"),
    [("file edited underneath", "default"), ("extra entry in a deleted dir", "default"),
     ("symlink changed underneath", "default"), ("parent swapped for a symlink", "default"),
     ("parent swapped for a symlink", "python")],
)  # fmt: skip
def test_a_commit_staged_in_threads_refuses_a_conflict_leaving_no_trace(
    tmp_path: Path, store: Store, name: str, calls: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past SYNCFS_FROM staged files the conflict check runs beside the staging: a conflict
    then undoes what was staged, and the tree is exactly as before (the staging directories'
    mtimes too); a staging that fails on the tampered tree (a parent swapped for a symlink)
    is reported by its conflicts. So it is with the per-file calls made in batches by
    compiled code (shadowfs/_batchio.c) and from Python."""
    _calls(calls, monkeypatch)
    tamper, expected = CONFLICTS[name]
    s = Scenario(tmp_path, store, _base_and_many, _everything_and_many)
    tamper(s.target)
    before = snapshot(s.target, with_root=True)
    with pytest.raises(ConflictError) as info:
        s.apply()
    assert info.value.conflicts == expected
    assert snapshot(s.target, with_root=True) == before
    assert not os.listdir(s.journal)
    assert commit.clean_residue(s.target) == 0


@pytest.mark.parametrize("calls", CALLS)
def test_a_big_commit_of_every_change_is_exact_either_way(
    tmp_path: Path, store: Store, calls: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past SYNCFS_FROM files the staging, the re-check and the renames run in batches of
    compiled calls where those are built, else the same calls from Python: every kind of
    change lands exactly either way, and the trash holds each replaced file."""
    _calls(calls, monkeypatch)
    s = Scenario(tmp_path, store, _base_and_many, _everything_and_many)
    many = [s.target / "many" / f"d{i:03d}" / "f" for i in range(commit.SYNCFS_FROM + 20)]
    inodes = {os.lstat(p).st_ino for p in many}
    apply(store, s.target, s.base, s.new, journal_dir=s.journal, free_trash=False)
    assert snapshot(s.target) == snapshot(s.reference)
    trash = s.journal / commit.TRASH_NAME
    assert inodes <= {os.lstat(p).st_ino for p in trash.rglob("*") if p.is_file()}
    assert recover(s.target, s.journal) is False  # frees the trash
    assert_committed(s)


def test_a_big_check_decides_every_file_from_its_lstat(tmp_path: Path, store: Store) -> None:
    """Past SYNCFS_FROM paths the check's lstats of the base's regular files are made in
    compiled batches (where built; else one by one) and compared afterwards: each way a file
    can differ is still found, and only those; a vouched-for file written since (its ctime
    moved) is read and found edited; the others pass unread."""
    s = Scenario(tmp_path, store, _base_and_many, _everything_and_many)
    many = s.target / "many"
    known = _identities(s.target)
    os.chmod(many / "d001" / "f", 0o600)  # mode
    (many / "d002" / "f").write_bytes(b"longer than before\n")  # size
    (many / "d003" / "f").unlink()  # gone
    (many / "d004" / "f").unlink()
    (many / "d004" / "f").mkdir()  # a directory where the file was
    (many / "d005" / "f").unlink()
    os.symlink("elsewhere", many / "d005" / "f")  # a symlink where the file was
    edited = many / "d006" / "f"
    st = edited.stat()
    edited.write_bytes(b"odl 6\n")  # same size, mtime put back: the ctime and content tell
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns))
    before = snapshot(s.target, with_root=True)
    with pytest.raises(ConflictError) as info:
        apply(store, s.target, s.base, s.new, journal_dir=s.journal, known=known)
    assert info.value.conflicts == [f"many/d{i:03d}/f" for i in range(1, 7)]
    assert snapshot(s.target, with_root=True) == before


def test_every_conflict_is_listed(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, everything)
    _same_size_edit_keeping_mtime(s.target)
    _create_where_layer_adds(s.target)
    _mode_changed_underneath(s.target)
    with pytest.raises(ConflictError) as info:
        s.apply()
    assert info.value.conflicts == ["chmod.sh", "edit.txt", "new"]


def _many_files(src: Path) -> None:
    # More directories than a chunk of threaded reads holds (commit._CHUNK_DIRS), a big file
    # among them: the reads of the conflict check go to threads in several chunks.
    for i in range(commit._CHUNK_DIRS + 20):
        write(src / f"d{i:03d}" / "f", b"old %d\n" % i)
    write(src / "big", b"b" * (3 << 20))


def _rewrite_every_file(src: Path) -> None:
    for i in range(commit._CHUNK_DIRS + 20):
        write(src / f"d{i:03d}" / "f", b"new %d\n" % i)
    write(src / "big", b"B" * (3 << 20))


@pytest.mark.parametrize("vouched", [False, True])
def test_a_big_check_finds_every_edit_underneath(
    tmp_path: Path, store: Store, vouched: bool
) -> None:
    """The files the caller does not vouch for are read and hashed in threads, each compared
    with its own base content: a same-size edit anywhere among them is found, and only it."""
    s = Scenario(tmp_path, store, _many_files, _rewrite_every_file)
    known = _identities(s.target) if vouched else None  # taken before the edits below
    for rel, data in (("d003/f", b"OLD 3\n"), ("d140/f", b"odl 140\n"), ("big", b"c" * (3 << 20))):
        p = s.target / rel
        st = p.stat()
        p.write_bytes(data)  # same size, mtime put back: only the content tells
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    before = snapshot(s.target, with_root=True)
    with pytest.raises(ConflictError) as info:
        apply(store, s.target, s.base, s.new, journal_dir=s.journal, known=known)
    assert info.value.conflicts == ["big", "d003/f", "d140/f"]
    assert snapshot(s.target, with_root=True) == before


def test_second_apply_of_the_same_change_conflicts(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, _edit)
    s.apply()
    with pytest.raises(ConflictError) as info:
        s.apply()
    assert info.value.conflicts == ["edit.txt"]
    assert_committed(s)


def _identities(root: Path) -> dict[bytes, tuple[int, int, int]]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                out[os.fsencode(rel)] = (st.st_dev, st.st_ino, st.st_ctime_ns)
    return out


def test_known_files_are_trusted_unread_until_written(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, everything)
    known = _identities(s.target)  # what a build of the base saw
    _same_size_edit_keeping_mtime(s.target)  # a write: its ctime moves, so it is read again
    with pytest.raises(ConflictError) as info:
        apply(store, s.target, s.base, s.new, journal_dir=s.journal, known=known)
    assert info.value.conflicts == ["edit.txt"]

    # The identity taken after that edit vouches for the edited file: the check believes it
    # unread (so a caller must list only files it read whole, as build_tree's cache does).
    apply(store, s.target, s.base, s.new, journal_dir=s.journal, known=_identities(s.target))
    assert_committed(s)


def test_replaced_and_removed_files_wait_in_the_trash_until_freed(
    tmp_path: Path, store: Store
) -> None:
    s = Scenario(tmp_path, store, base_tree, everything)
    replaced = ("edit.txt", "grow.txt", "gone.txt", "dir-gone/d.txt", "f2l", "link-gone")
    inodes = {os.lstat(s.target / p).st_ino for p in replaced}
    apply(store, s.target, s.base, s.new, journal_dir=s.journal, free_trash=False)
    assert snapshot(s.target) == snapshot(s.reference)
    # Moved aside whole, not freed: the very inodes the tree held, nothing else.
    trash = s.journal / commit.TRASH_NAME
    assert os.listdir(s.journal) == [commit.TRASH_NAME]
    assert inodes <= {os.lstat(p).st_ino for p in trash.iterdir()}
    # The next recovery (or apply) with that journal directory frees them.
    assert recover(s.target, s.journal) is False
    assert_committed(s)


def test_a_journal_dir_on_another_file_system_frees_in_place(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, everything)
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    s.journal = Path(tempfile.mkdtemp(dir=shm))
    try:
        apply(store, s.target, s.base, s.new, journal_dir=s.journal, free_trash=False)
        assert_committed(s)  # no trash there: a rename across file systems cannot be
    finally:
        shutil.rmtree(s.journal)


def test_emptying_a_trash_twice_or_at_once_is_harmless(tmp_path: Path) -> None:
    from shadowfs import trash

    bin_ = tmp_path / "trash"
    (bin_ / "sub" / "deeper").mkdir(parents=True)
    for i in range(200):  # past the threaded threshold
        write(bin_ / f"f{i}", b"x")
    write(bin_ / "sub" / "deeper" / "g", b"y")
    os.symlink("/etc/passwd", bin_ / "sym")
    busy = os.open(bin_, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(busy, fcntl.LOCK_EX)  # another process emptying it
        assert trash.empty(bin_, wait=False) is False
        assert len(os.listdir(bin_)) == 202
    finally:
        os.close(busy)
    assert trash.empty(bin_) is True
    assert not bin_.exists()
    assert Path("/etc/passwd").exists()
    assert trash.empty(bin_) is False  # already gone


# --- hostile input ----------------------------------------------------------------------------


def _plant_journal(s: Scenario, ops: list[list[object]]) -> None:
    fd = os.open(s.target, os.O_RDONLY | os.O_DIRECTORY)
    st = os.fstat(fd)
    os.close(fd)
    record = {"target": [st.st_dev, st.st_ino], "token": "t", "ops": ops, "fsync": [""]}
    s.journal.mkdir(exist_ok=True)
    (s.journal / commit.JOURNAL_NAME).write_bytes(commit._seal(record))


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "a//b", "", "./x", "a/../../x"])
def test_a_journal_with_a_hostile_path_is_refused(tmp_path: Path, store: Store, path: str) -> None:
    s = Scenario(tmp_path, store, base_tree, _edit)
    write(tmp_path / "outside.txt", b"precious")
    before = snapshot(s.target, with_root=True)
    _plant_journal(s, [["unlink", path]])
    with pytest.raises(TreeError, match="hostile path"):
        recover(s.target, s.journal)
    assert (tmp_path / "outside.txt").read_bytes() == b"precious"
    assert snapshot(s.target, with_root=True) == before


def test_redo_never_follows_a_symlink_out_of_the_target(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, _edit)
    outside = tmp_path / "outside"
    write(outside / "victim.txt", b"precious")
    os.symlink(outside, s.target / "escape")
    _plant_journal(s, [["unlink", "escape/victim.txt"], ["rmdir", "escape"]])
    assert recover(s.target, s.journal) is True
    assert (outside / "victim.txt").read_bytes() == b"precious"
    assert (s.target / "escape").is_symlink()


def test_a_journal_for_another_directory_is_refused(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, _edit)
    _plant_journal(s, [["unlink", "keep.txt"]])
    other = s.fresh_target("other")
    with pytest.raises(ShadowfsError, match="belongs to another directory"):
        recover(other, s.journal)
    assert (other / "keep.txt").exists()


def test_a_missing_target_is_one_clear_error(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, _edit)
    with pytest.raises(ShadowfsError, match="cannot open commit target"):
        apply(store, tmp_path / "nope", s.base, s.new, journal_dir=s.journal)


# --- recovery without a crash -----------------------------------------------------------------


def test_recover_with_nothing_to_do(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, _edit)
    before = snapshot(s.target, with_root=True)
    assert recover(s.target, tmp_path / "no-journal-dir") is False
    assert not (tmp_path / "no-journal-dir").exists()
    s.journal.mkdir()
    assert recover(s.target, s.journal) is False
    assert snapshot(s.target, with_root=True) == before


def test_a_damaged_journal_counts_as_absent(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, _edit)
    before = snapshot(s.target)
    _plant_journal(s, [["unlink", "keep.txt"]])
    path = s.journal / commit.JOURNAL_NAME
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    assert recover(s.target, s.journal) is False
    assert snapshot(s.target) == before
    assert not os.listdir(s.journal)


def test_clean_residue_removes_only_staged_files(tmp_path: Path, store: Store) -> None:
    s = Scenario(tmp_path, store, base_tree, _edit)
    before = snapshot(s.target)
    for rel in (".jbx-stage-aa-0", "sub/.jbx-stage-bb-1", "dir-gone/a/b/.jbx-stage-cc-2"):
        (s.target / rel).write_bytes(b"stale")
    os.symlink("x", s.target / "d2f/.jbx-stage-dd-3")
    keep_dir = s.target / ".jbx-stage-not-a-file"
    keep_dir.mkdir()
    os.symlink(tmp_path / "outside", s.target / "sub/out")
    write(tmp_path / "outside/.jbx-stage-ee-4", b"outside the tree")
    assert clean_residue(s.target) == 4
    keep_dir.rmdir()
    (s.target / "sub/out").unlink()
    assert {p: v[0] for p, v in snapshot(s.target).items()} == {p: v[0] for p, v in before.items()}
    assert (tmp_path / "outside/.jbx-stage-ee-4").exists()


def test_journal_is_json_with_a_checksum(tmp_path: Path) -> None:
    sealed = commit._seal({"ops": [["unlink", "caf\udce9"]]})
    head, body = sealed.split(b"\n", 1)
    assert head.startswith(b"JBXCOMMIT1 ")
    assert json.loads(body)["ops"][0][1].encode("utf-8", "surrogateescape") == b"caf\xe9"
    assert commit._unseal(sealed) == json.loads(body)
    assert commit._unseal(sealed[:-1]) is None


# --- a big file in constant memory ------------------------------------------------------------

# Eight times the bound on RSS growth below: a commit that held the file whole would show it.
# `JUKEBOX_COMMIT_BIG_BYTES=$((4 << 30))` tries a bigger one (the suite keeps to its budget).
BIG_BYTES = int(os.environ.get("JUKEBOX_COMMIT_BIG_BYTES", 512 << 20))

_MEMORY_PROBE = textwrap.dedent(
    """
    import resource, sys
    from shadowfs.commit import apply
    from shadowfs.oid import ObjectId
    from shadowfs.store import Store
    store_dir, target, base, new, journal = sys.argv[1:]
    with Store.open(store_dir) as store:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        report = apply(store, target, ObjectId.from_hex(base), ObjectId.from_hex(new),
                       journal_dir=journal)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(report.bytes_written, (after - before) * 1024)
    """
)


@pytest.mark.slow
def test_a_big_file_commits_in_constant_memory(tmp_path: Path, store: Store) -> None:
    """Stages a BIG_BYTES file (written data, not zeros, which become holes) and changes the
    mode of another."""
    target = tmp_path / "target"
    target.mkdir()
    block = bytes(range(1, 256)) * ((8 << 20) // 255 + 1)
    fd = os.open(target / "big.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        left = BIG_BYTES
        while left:
            left -= os.write(fd, block[: min(left, len(block))])
    finally:
        os.close(fd)
    base = build_tree(store, target)
    big = next(e for e in read_tree(store, base) if e.name == b"big.bin")
    copy = Entry(b"copy.bin", "file", 0o640, big.size, OLD_NS, big.oid, None)
    new = store.put("tree", encode_tree([*read_tree(store, base), copy]))
    store.flush()
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(tmp_path / "store"), str(target),
         base.hex(), new.hex(), str(tmp_path / "journal")],
        capture_output=True, text=True, cwd=REPO, timeout=slow(300),
    )
    assert proc.returncode == 0, proc.stderr
    written, growth = map(int, proc.stdout.split())
    assert written == BIG_BYTES
    assert growth < 64 << 20, f"commit grew the RSS by {growth >> 20} MiB"
    st = os.stat(target / "copy.bin")
    assert (st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (BIG_BYTES, 0o640, OLD_NS)
    assert st.st_blocks * 512 >= BIG_BYTES  # written: the content holds no chunk of zeros
    assert new == build_tree(store, target)


def _sparse(path: Path, size: int, data_at: int, data: bytes) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(data_at)
        f.write(data)


def test_a_sparse_file_stays_sparse_through_commit(tmp_path: Path, store: Store) -> None:
    """An agent's `truncate -s 2G` file takes no 2 GiB of real disk once committed, and a
    sparse file the commit replaces is checked against its old content without reading holes."""
    base, new, target = tmp_path / "base", tmp_path / "new", tmp_path / "target"
    for d in (base, new, target):
        d.mkdir()
        _sparse(d / "old.bin", 64 << 20, 40 << 20, b"old data")
    _sparse(new / "big.bin", 2 << 30, 1 << 30, b"in the middle")
    _sparse(new / "ends-in-a-hole.bin", 9 << 20, 0, b"head")
    (new / "old.bin").unlink()
    if os.stat(new / "big.bin").st_blocks * 512 > 16 << 20:
        pytest.skip("this file system does not keep the file sparse")
    base_tree, new_tree = build_tree(store, base), build_tree(store, new)
    # The real tree's old.bin changed inside its hole (same size, mode): a conflict.
    with open(target / "old.bin", "r+b") as f:
        f.seek(10 << 20)
        f.write(b"host edit")
    with pytest.raises(ConflictError):
        apply(store, target, base_tree, new_tree, journal_dir=tmp_path / "journal")
    _sparse(target / "old.bin", 64 << 20, 40 << 20, b"old data")
    apply(store, target, base_tree, new_tree, journal_dir=tmp_path / "journal")
    big = os.stat(target / "big.bin")
    assert big.st_size == 2 << 30 and big.st_blocks * 512 <= 8 << 20
    tail = os.stat(target / "ends-in-a-hole.bin")
    assert tail.st_size == 9 << 20 and tail.st_blocks * 512 <= 8 << 20
    assert not (target / "old.bin").exists()
    assert build_tree(store, target) == build_tree(store, new)


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the commit as nobody, then as root")
def test_a_device_node_is_committed_only_by_a_committer_with_cap_mknod() -> None:
    work = Path("/tmp") / f"jukebox-commit-mknod-{os.getpid()}"
    work.mkdir()
    try:
        target, store_dir = work / "tree", work / "store"
        target.mkdir()
        (target / "a.txt").write_text("one\n")
        with Store.open(store_dir, create=True) as store:
            base = build_tree(store, target)
            null = Entry(b"null", "chardev", 0o600, 0, 0, None, None, os.makedev(1, 3))
            new = store.put("tree", encode_tree([*read_tree(store, base), null]))
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", work], check=True)
        before = snapshot(target)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit code
            code = 1
            try:
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
                with Store.open(store_dir) as store:
                    apply(store, target, base, new, journal_dir=work / "journal")
            except ShadowfsError as exc:
                code = 3 if "needs CAP_MKNOD" in str(exc) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3
        assert snapshot(target) == before, "nothing applied, nothing staged left behind"
        with Store.open(store_dir) as store:
            apply(store, target, base, new, journal_dir=work / "journal")
        st = os.lstat(target / "null")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_big_commit_gives_every_file_its_mode_whatever_the_umask(
    tmp_path: Path, store: Store, umask: int
) -> None:
    """Past SYNCFS_FROM files the threads create the staged files with their final mode when
    the umask keeps all of it, and fchmod the others (setuid, setgid, sticky, bits the umask
    clears): each file ends with exactly its tree's mode either way."""
    modes = [0o644, 0o755, 0o444, 0o600, 0o4755, 0o2750, 0o1644, 0o666]

    def mutate(src: Path) -> None:
        for i in range(commit.SYNCFS_FROM + 8):
            write(src / f"d{i % 3}/f{i}", b"x%d\n" % i, modes[i % len(modes)], mtime_ns=None)

    s = Scenario(tmp_path, store, lambda src: write(src / "keep", b"k\n"), mutate)
    old = os.umask(umask)
    try:
        s.apply()
    finally:
        os.umask(old)
    assert snapshot(s.target) == snapshot(s.reference)
    for i in range(commit.SYNCFS_FROM + 8):
        st = os.lstat(s.target / f"d{i % 3}/f{i}")
        assert stat.S_IMODE(st.st_mode) == modes[i % len(modes)]
