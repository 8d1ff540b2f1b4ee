"""Random operations through a booth's mount, mirrored on a plain directory (the model).

Every checkpoint must hold exactly the model's state at that moment, and every rollback must
bring the mount back to the model's state at that checkpoint. Operations include files kept open
for writing across checkpoints, mmap writes, sparse writes, renames over existing names, hard
links and names with spaces, newlines and invalid UTF-8. Both backends run; the runs are seeded,
so a failure names the seed and the operation that diverged, and replays.

JUKEBOX_MODEL_SEEDS=N runs N seeds per backend instead of the few CI runs, and
JUKEBOX_MODEL_OPS=N that many operations per run (a soak).
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shadowfs.oid import ObjectId
from shadowfs.store import Store
from shadowfs.tree import walk
from tests.fs.conftest import needs_fuse, populate
from tests.fs.conftest import tree_state as walked_state

State = dict[bytes, tuple[Any, ...]]

SEEDS = list(range(int(os.environ.get("JUKEBOX_MODEL_SEEDS", "4"))))
OPS_PER_RUN = int(os.environ.get("JUKEBOX_MODEL_OPS", "400"))
NAMES = [b"a", b"b.txt", b"with space", b"new\nline", b"bad-\xff", b"c.py", b"d", b"e.md"]
SIZES = [0, 1, 17, 700, 4096, 5000, 70_000]


def disk_state(root: bytes) -> State:
    """Every entry under root: kind, permission bits, and content digest or link target."""
    return {path: (fmt, mode, digest) for path, (fmt, mode, _size, _mtime, digest)
            in walked_state(root).items()}


def tree_state(store: Store, tree_id: ObjectId) -> State:
    """The same as `disk_state`, of a checkpoint's tree."""
    out: State = {}
    for path, e in walk(store, tree_id):
        if e.kind == "file":
            assert e.oid is not None
            digest = hashlib.blake2b(store.read_bytes(e.oid)).hexdigest()
            out[path] = (stat.S_IFREG, e.mode, digest)
        elif e.kind == "symlink":
            out[path] = (stat.S_IFLNK, e.mode & 0o7777, e.target)
        else:
            out[path] = (stat.S_IFDIR, e.mode, None)
    return out


def difference(got: State, want: State) -> str:
    lines = []
    for path in sorted(got.keys() | want.keys()):
        if got.get(path) != want.get(path):
            lines.append(f"  {path!r}: got {got.get(path)!r}, want {want.get(path)!r}")
    return "\n".join(lines[:12])


@dataclass
class Booth:
    """What a run drives: a mount point, checkpoints and rollbacks."""

    mnt: bytes
    checkpoint: Callable[[], ObjectId]
    rollback: Callable[[ObjectId], None]
    # overlayfs (redirect_dir=off) refuses to rename a directory from the base with EXDEV,
    # which tools answer by copying; the model would simply rename.
    renames_dirs: bool
    # The FUSE layer's count of staged bytes (the scratch limit's), by its running total
    # (False) or recounted (True); None where the backend keeps no count.
    staged_bytes: Callable[[bool], int] | None = None


class Run:
    """One seeded run: each operation is done on the mount and on the model with the same
    arguments; both must succeed or fail with the same errno."""

    def __init__(self, seed: int, booth: Booth, store: Store, model: Path, saved: Path) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.booth = booth
        self.store = store
        self.model = os.fsencode(model)
        self.saved = saved
        self.checkpoints: list[tuple[ObjectId, bytes]] = []
        self.held: list[tuple[int, int]] = []  # (fd in the mount, fd in the model)
        # Shared writable mappings kept across operations and checkpoints, as a database keeps
        # its file: (file, mapping) in the mount, then in the model.
        self.maps: list[tuple[Any, mmap.mmap, Any, mmap.mmap]] = []
        self.log: list[str] = []

    # ------------------------------------------------------------------ picking paths

    def _entries(self, want: Callable[[int], bool]) -> list[bytes]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.model):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                if want(os.lstat(p).st_mode):
                    out.append(os.path.relpath(p, self.model))
        return sorted(out)

    def files(self) -> list[bytes]:
        return self._entries(stat.S_ISREG)

    def dirs(self) -> list[bytes]:
        return self._entries(stat.S_ISDIR)

    def new_path(self) -> bytes:
        parent = self.rng.choice([b"", *self.dirs()])
        name = self.rng.choice(NAMES) + b"%d" % self.rng.randrange(6)
        return os.path.join(parent, name) if parent else name

    def content(self) -> bytes:
        n = self.rng.choice(SIZES)
        return self.rng.randbytes(n)

    # ------------------------------------------------------------------ doing

    def both(self, what: str, fn: Callable[[bytes], Any]) -> None:
        self.log.append(what)
        outcomes = []
        for root in (self.booth.mnt, self.model):
            try:
                fn(root)
                outcomes.append(None)
            except OSError as exc:
                outcomes.append(errno.errorcode.get(exc.errno or 0, str(exc.errno)))
        assert outcomes[0] == outcomes[1], (
            f"seed {self.seed}, op {len(self.log)} {what}: mount {outcomes[0] or 'ok'}, "
            f"model {outcomes[1] or 'ok'}"
        )

    def step(self) -> None:
        rng = self.rng
        files = self.files()
        roll = rng.random()
        j = os.path.join
        if roll < 0.12 or not files:
            p, data = self.new_path(), self.content()
            self.both(f"create {p!r} {len(data)}B", lambda r: _write(j(r, p), data, "wb"))
        elif roll < 0.22:
            p, data = rng.choice(files), self.content()
            self.both(f"overwrite {p!r} {len(data)}B", lambda r: _write(j(r, p), data, "wb"))
        elif roll < 0.32:
            p, data = rng.choice(files), self.content()
            self.both(f"append {p!r} {len(data)}B", lambda r: _write(j(r, p), data, "ab"))
        elif roll < 0.38:
            p, data = rng.choice(files), self.content()[:3000]
            off = rng.randrange(os.path.getsize(j(self.model, p)) + 9000)
            self.both(f"pwrite {p!r} @{off}", lambda r: _pwrite(j(r, p), data, off))
        elif roll < 0.43:
            p = rng.choice(files)
            size = rng.randrange(2 * os.path.getsize(j(self.model, p)) + 100)
            self.both(f"truncate {p!r} {size}", lambda r: os.truncate(j(r, p), size))
        elif roll < 0.47:
            p = rng.choice(files)
            self.both(f"unlink {p!r}", lambda r: os.unlink(j(r, p)))
        elif roll < 0.52:
            p = self.new_path()
            self.both(f"mkdir {p!r}", lambda r: os.mkdir(j(r, p)))
        elif roll < 0.55:
            dirs = self.dirs()
            if dirs:
                p = rng.choice(dirs)
                self.both(f"rmdir {p!r}", lambda r: os.rmdir(j(r, p)))
        elif roll < 0.63:
            src = rng.choice(files)
            dst = rng.choice(files) if rng.random() < 0.4 else self.new_path()
            self.both(f"rename {src!r} -> {dst!r}", lambda r: os.rename(j(r, src), j(r, dst)))
        elif roll < 0.65 and self.booth.renames_dirs:
            dirs = self.dirs()
            if dirs:
                src, dst = rng.choice(dirs), self.new_path()
                self.both(f"rename dir {src!r} -> {dst!r}",
                          lambda r: os.rename(j(r, src), j(r, dst)))
        elif roll < 0.68:
            p = self.new_path()
            target = rng.choice([*files, b"dangling", b"../outside"])
            self.both(f"symlink {p!r} -> {target!r}", lambda r: os.symlink(target, j(r, p)))
        elif roll < 0.72:
            p = rng.choice(files + self.dirs())
            is_dir = os.path.isdir(j(self.model, p))
            mode = rng.choice([0o755, 0o700, 0o750] if is_dir else [0o644, 0o600, 0o755, 0o444])
            self.both(f"chmod {p!r} {mode:o}", lambda r: os.chmod(j(r, p), mode))
        elif roll < 0.75:
            src, dst = rng.choice(files), self.new_path()
            self.both(f"link {src!r} -> {dst!r}", lambda r: os.link(j(r, src), j(r, dst)))
        elif roll < 0.81:
            self._held_write(files)
        elif roll < 0.84:
            self._release()
        elif roll < 0.87:
            p = rng.choice(files)
            size = os.path.getsize(j(self.model, p))
            if size:
                off = rng.randrange(size)
                data = rng.randbytes(min(rng.choice([1, 100, 5000]), size - off))
                self.both(f"mmap write {p!r} @{off}", lambda r: _mmap_write(j(r, p), off, data))
        elif roll < 0.90:
            self._mapping(files)
        elif roll < 0.96:
            self.checkpoint()
        elif self.checkpoints:
            self.rollback()

    def _held_write(self, files: list[bytes]) -> None:
        # A file kept open for writing, across checkpoints: its writes count when they return.
        rng = self.rng
        if self.held and rng.random() < 0.5:
            i = rng.randrange(len(self.held))
            data = self.content()[:4000]
            self.log.append(f"held write #{i} {len(data)}B")
            for fd in self.held[i]:
                os.write(fd, data)
            return
        p = rng.choice(files) if rng.random() < 0.6 else self.new_path()
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        fds = []
        self.log.append(f"hold open {p!r}")
        for root in (self.booth.mnt, self.model):
            try:
                fds.append(os.open(os.path.join(root, p), flags, 0o644))
            except OSError as exc:
                fds.append(-exc.errno if exc.errno else -1)
        if fds[0] < 0 or fds[1] < 0:
            assert fds[0] == fds[1], f"seed {self.seed}: open {p!r} gave {fds}"
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            return
        self.held.append((fds[0], fds[1]))

    def _mapping(self, files: list[bytes]) -> None:
        rng = self.rng
        if self.maps and rng.random() < 0.7:
            i = rng.randrange(len(self.maps))
            f1, m1, f2, m2 = self.maps[i]
            # Only pages inside the file as it is now: a page past its end is SIGBUS.
            end = min(len(m1), os.fstat(f1.fileno()).st_size, os.fstat(f2.fileno()).st_size)
            if end:
                off = rng.randrange(end)
                data = rng.randbytes(min(rng.choice([1, 64, 3000]), end - off))
                self.log.append(f"mapped write #{i} @{off} {len(data)}B")
                m1[off : off + len(data)] = data
                m2[off : off + len(data)] = data
            return
        sized = [p for p in files if os.path.getsize(os.path.join(self.model, p))]
        if not sized:
            return
        p = rng.choice(sized)
        self.log.append(f"map {p!r}")
        pair: list[Any] = []
        for root in (self.booth.mnt, self.model):
            f = open(os.path.join(root, p), "r+b")  # noqa: SIM115 - kept open while mapped
            pair += [f, mmap.mmap(f.fileno(), 0)]
        self.maps.append((pair[0], pair[1], pair[2], pair[3]))

    def _release(self) -> None:
        self.log.append("release held")
        for pair in self.held:
            for fd in pair:
                os.close(fd)
        self.held.clear()
        for f1, m1, f2, m2 in self.maps:
            m1.close()
            m2.close()
            f1.close()
            f2.close()
        self.maps.clear()

    def checkpoint(self) -> None:
        self.log.append("checkpoint")
        tree_id = self.booth.checkpoint()
        if self.booth.staged_bytes is not None:
            counted, recounted = self.booth.staged_bytes(False), self.booth.staged_bytes(True)
            assert counted == recounted, (
                f"seed {self.seed}, after op {len(self.log)}: the layer counts {counted} staged "
                f"bytes, its nodes hold {recounted}"
            )
        want = disk_state(self.model)
        got = tree_state(self.store, tree_id)
        assert got == want, (
            f"seed {self.seed}, checkpoint after op {len(self.log)} ({self.log[-2:]}) differs "
            f"from the model:\n{difference(got, want)}\n{self.history(got, want)}"
        )
        copy = os.fsencode(self.saved / f"{len(self.checkpoints)}")
        _copy(self.model, copy)
        self.checkpoints.append((tree_id, copy))

    def rollback(self) -> None:
        # Descriptors open across a rollback see what they see; the model cannot say what
        # that is, so they are closed first.
        self._release()
        tree_id, copy = self.rng.choice(self.checkpoints)
        self.log.append(f"rollback to {tree_id.short}")
        self.booth.rollback(tree_id)
        shutil.rmtree(self.model)
        _copy(copy, self.model)
        self.compare(f"rollback to {tree_id.short}")

    def compare(self, when: str) -> None:
        got, want = disk_state(self.booth.mnt), disk_state(self.model)
        assert got == want, (
            f"seed {self.seed}, after op {len(self.log)} ({when}) the mount differs from the "
            f"model:\n{difference(got, want)}\n{self.history(got, want)}"
        )

    def history(self, got: State, want: State) -> str:
        """The operations that named a differing path's file name, and the rollbacks."""
        names = {os.path.basename(p) for p in got.keys() ^ want.keys()}
        names |= {os.path.basename(p) for p in got.keys() & want.keys() if got[p] != want[p]}
        picked = [
            f"  op {i + 1}: {what}" for i, what in enumerate(self.log)
            if any(repr(n)[2:-1] in what for n in names) or what.startswith(("rollback", "hold"))
        ]
        return "operations:\n" + "\n".join(picked[-25:])

    def run(self, ops: int) -> None:
        try:
            for i in range(ops):
                self.step()
                if i % 40 == 39:
                    self.compare(self.log[-1])
            self.checkpoint()
            self._release()
            self.compare("the end")
        finally:
            self._release()


def _write(path: bytes, data: bytes, mode: str) -> None:
    with open(path, mode) as f:
        f.write(data)


def _pwrite(path: bytes, data: bytes, off: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def _copy(src: bytes, dst: bytes) -> None:
    """A copy of a model directory that keeps its hard links, as checkpoints now do."""
    subprocess.run(["cp", "-a", src, dst], check=True)


def _mmap_write(path: bytes, off: int, data: bytes) -> None:
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[off : off + len(data)] = data


@pytest.fixture
def model_dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    base = tmp_path / "base"
    populate(base)
    model = tmp_path / "model"
    shutil.copytree(base, model, symlinks=True)
    saved = tmp_path / "saved"
    saved.mkdir()
    return base, model, saved


@pytest.fixture
def fuse_booth(
    model_dirs: tuple[Path, Path, Path], tmp_path: Path
) -> Iterator[tuple[Booth, Store]]:
    from shadowfs.layer import Layer
    from shadowfs.mountctl import Mount

    base = model_dirs[0]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with Store.open(tmp_path / "store") as store:
        layer = Layer(base, store, tmp_path / "scratch")
        # In a child process: this one then touches the mount any way it likes (mmap faults
        # hold the GIL), as the agent would.
        m = Mount(layer, mnt, process=True).start()
        try:
            booth = Booth(
                os.fsencode(mnt), lambda: layer.snapshot()[0], layer.restore, True,
                layer.staged_bytes,
            )
            yield booth, store
        finally:
            m.stop()
            layer.close()


@pytest.fixture
def overlay_booth(
    model_dirs: tuple[Path, Path, Path], tmp_path: Path
) -> Iterator[tuple[Booth, Store]]:
    if os.geteuid() != 0:
        pytest.skip("kernel overlay mounts need root")
    from shadowfs.overlay import OverlayLayer

    base = model_dirs[0]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with (
        Store.open(tmp_path / "store") as store,
        OverlayLayer(base, store, tmp_path / "booth").mounted(mnt) as layer,
    ):
        yield Booth(os.fsencode(mnt), layer.snapshot, layer.restore, False), store


@pytest.mark.fuse
@needs_fuse
@pytest.mark.parametrize("seed", SEEDS)
def test_fuse_booth_matches_the_model(
    seed: int, fuse_booth: tuple[Booth, Store], model_dirs: tuple[Path, Path, Path]
) -> None:
    booth, store = fuse_booth
    Run(seed, booth, store, model_dirs[1], model_dirs[2]).run(OPS_PER_RUN)


@pytest.mark.parametrize("seed", SEEDS)
def test_overlay_booth_matches_the_model(
    seed: int, overlay_booth: tuple[Booth, Store], model_dirs: tuple[Path, Path, Path]
) -> None:
    booth, store = overlay_booth
    Run(1000 + seed, booth, store, model_dirs[1], model_dirs[2]).run(OPS_PER_RUN)
