"""Repository scale: big trees and many changes, side by side with native and the other overlays.

Five cases, each what a user meets on a real repository (issue 25's table):

- **rewrite**: an agent reads and rewrites every one of N small files (the fs suite's edit
  workload over all of them), on native ext4, kernel overlayfs, fuse-overlayfs and both shadowfs
  backends, each a fresh mount over the same lower dir; timed in a child interpreter.
- **commit**: `jukebox booth commit` of a pending booth in which every one of N files changed,
  next to `git add -A && git commit` of the same change in a native copy; again with both on a
  fresh journaled ext4 loop image (this VM's root ext4 has no journal, see `_journaled_ext4`).
- **append**: append one byte to a big base file (open, write, close: the copy-up), on the temp
  dir's file system and on XFS with reflink, next to `cp --reflink=auto` of the file.
- **first booth**: `jukebox booth run -- true` over an N-file tree with a fresh tape dir (cold:
  hash and store everything) and again (warm: the stat cache), next to `git add -A` of the tree
  into a fresh repo; the store's growth is in the row.
- **gc**: in that tape dir, two booths of ten 1-file checkpoints each, one kept and one
  discarded with its tape removed, then `jukebox gc`; the same on a 1,000-file tree beside it:
  the same garbage in a store 100 times smaller.

Cells are medians of interleaved runs (`--quick`: one run, small sizes). Ratios are over the
row whose ratio is 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import backends as bk
from bench import scratch_fs
from bench.fs_workloads import (
    FIXED_MTIME,
    cached,
    git,
    git_env,
    python_module,
    timed_child,
    write_small_tree,
)

GROUP = "scale"
JUKEBOX = str(Path(sys.executable).parent / "jukebox")
Row = dict[str, Any]


@dataclass(frozen=True)
class Sizes:
    rewrite_files: int
    commit_files: int
    append_bytes: int
    first_files: int
    first_bytes: int  # the first-booth tree's total size, about
    checkpoints: int  # per booth in the gc case
    runs: int

    @classmethod
    def for_mode(cls, quick: bool) -> Sizes:
        if quick:
            return cls(500, 300, 16 << 20, 500, 5 << 20, 2, 1)
        return cls(50_000, 50_000, 1 << 30, 100_000, 2 << 30, 10, 3)


# ============================================================================ fixtures


def _small_tree(n: int) -> Path:
    return cached(f"scale-small-{n}", lambda tmp: write_small_tree(tmp, n))


def _big_file_dir(size: int) -> Path:
    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        block = random.Random(3).randbytes(1 << 20)
        with open(tmp / "big.bin", "wb") as f:
            for _ in range(size >> 20):
                f.write(block)
        os.utime(tmp / "big.bin", (FIXED_MTIME, FIXED_MTIME))

    return cached(f"scale-bigfile-{size >> 20}m", build)


def write_sized_tree(dest: Path, n_files: int, total: int, seed: int = 4) -> None:
    """`n_files` source-like files of about `total` bytes in all (each unique, so nothing
    dedups), in dirs of 100: a monorepo checkout."""
    rng = random.Random(seed)
    templates = [python_module(rng, 4_000).encode() for _ in range(16)]
    mean = total // n_files
    for i in range(n_files):
        d = dest / f"d{i // 1000:03d}" / f"s{(i // 100) % 10}"
        if i % 100 == 0:
            d.mkdir(parents=True, exist_ok=True)
        size = rng.randint(mean // 8, mean * 15 // 8)
        body = templates[i % 16] * (size // 4_000 + 1)
        path = d / f"m{i:06d}.py"
        path.write_bytes(b"# module %d\n" % i + body[:size])
        os.utime(path, (FIXED_MTIME, FIXED_MTIME))


def _sized_tree(n: int, total: int) -> Path:
    return cached(
        f"scale-sized-{n}-{total >> 20}m", lambda tmp: write_sized_tree(tmp, n, total)
    )


def _files_of(root: Path) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out += [os.path.join(rel, n) for n in names]
    return sorted(out)


# ============================================================================ helpers


def _timed(cmd: list[str], **kw: Any) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()[-400:]}")  # fmt: skip
    return took


def _du(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
    return total


def _row(case: str, system: str, samples: list[float], base: float | None, **extra: Any) -> Row:
    secs = statistics.median(samples)
    row: Row = {"group": GROUP, "case": case, "system": system, "seconds": secs}
    if base:
        row["ratio"] = secs / base
    if len(samples) > 1:
        row["runs"] = ", ".join(f"{s:.2f}" for s in samples)
    row.update(extra)
    return row


def _booth(tree: Path, tapes: Path, tape_id: str, agent: list[str], commit: str = "never") -> None:
    _timed([JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id",
            tape_id, "--commit", commit, "--", *agent])  # fmt: skip


# `.git` pruned: in the git side of the commit case the tree is a repo, whose objects are no
# source files (and a background `git gc --auto` may be packing them meanwhile).
REWRITE = (
    "import os, sys\n"
    "for dirpath, dirs, names in os.walk('.'):\n"
    "    dirs[:] = [d for d in dirs if d != '.git']\n"
    "    for n in names:\n"
    "        p = os.path.join(dirpath, n)\n"
    "        with open(p, 'rb') as f: data = f.read()\n"
    "        with open(p, 'wb') as f: f.write(data.replace(b'return', b'return  ', 1))\n"
)


# ============================================================================ the cases


def _interleaved(
    systems: list[bk.Backend], runs: int, once: Callable[[bk.Backend], float]
) -> tuple[dict[str, list[float]], dict[str, str]]:
    samples: dict[str, list[float]] = {}
    failed: dict[str, str] = {}
    for _ in range(runs):
        for b in systems:
            if b.name in failed:
                continue
            if (why := b.unavailable()) is not None:
                failed[b.name] = why
                continue
            try:
                samples.setdefault(b.name, []).append(once(b))
            except Exception as exc:  # one broken backend must not sink the others
                failed[b.name] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
    return samples, failed


def _backend_rows(
    case: str, samples: dict[str, list[float]], failed: dict[str, str], **extra: Any
) -> list[Row]:
    native = statistics.median(samples[bk.NATIVE]) if bk.NATIVE in samples else None
    rows = []
    for name in bk.ALL:
        if name in samples:
            row = _row(case, name, samples[name], native, **extra)
            if bk.FUSE_OVERLAYFS in samples:
                row["ratio_fuse_overlayfs"] = row["seconds"] / statistics.median(
                    samples[bk.FUSE_OVERLAYFS]
                )
            rows.append(row)
        elif name in failed:
            rows.append({"group": GROUP, "case": case, "system": name, "note": failed[name]})
    return rows


def rewrite_case(s: Sizes, scratch: Path) -> list[Row]:
    lower = _small_tree(s.rewrite_files)
    files = _files_of(lower)
    case = f"rewrite all {len(files):,} small files"

    def once(b: bk.Backend) -> float:
        with b.prepare(lower) as mnt:
            os.sync()
            return timed_child("edit", mnt, files)

    samples, failed = _interleaved(bk.backends(scratch), s.runs, once)
    return _backend_rows(case, samples, failed)


def commit_case(s: Sizes, scratch: Path) -> list[Row]:
    """Leaves nothing behind in ``scratch``: its trees, repos and tape dir go as each is done
    with, a failed run's too (the tape dir holds a store of the whole tree)."""
    lower = _small_tree(s.commit_files)
    case = f"commit {s.commit_files:,} changed files"
    booth_s: list[float] = []
    freed_s: list[float] = []
    git_s: list[float] = []
    tapes = scratch / "commit-tapes"
    try:
        for i in range(s.runs):
            tree = scratch / f"commit-tree-{i}"
            try:
                subprocess.run(["cp", "-a", "--", str(lower), str(tree)], check=True)
                _booth(tree, tapes, f"c{i}", [sys.executable, "-c", REWRITE])
                os.sync()
                t0 = time.perf_counter()
                booth_s.append(_timed([JUKEBOX, "booth", "commit", f"c{i}", "--tape-dir",
                                       str(tapes)]))  # fmt: skip
                # The replaced files are freed by a background process: wait for it (the git
                # side must not share the disk with it), and say how long after the commit it
                # was done.
                _drained(tapes / ".jukebox" / "commit-trash")
                freed_s.append(time.perf_counter() - t0)
            finally:
                shutil.rmtree(tree, ignore_errors=True)

            repo = scratch / f"commit-git-{i}"
            try:
                subprocess.run(["cp", "-a", "--", str(lower), str(repo)], check=True)
                git(repo, "init", "-q", "-b", "main")
                # 50,000 loose objects start a detached `git gc --auto`, which would run beside
                # the timed commit (and pack objects from under the rewrite).
                git(repo, "config", "gc.auto", "0")
                git(repo, "add", "-A")
                git(repo, "commit", "-q", "-m", "base")
                subprocess.run([sys.executable, "-c", REWRITE], cwd=repo, check=True)
                os.sync()
                git_s.append(_timed(["sh", "-c", "git add -A && git commit -q -m change"],
                                    cwd=repo, env=git_env()))  # fmt: skip
            finally:
                shutil.rmtree(repo, ignore_errors=True)
    finally:
        _drained(tapes / ".jukebox" / "commit-trash")
        shutil.rmtree(tapes, ignore_errors=True)
    base = statistics.median(git_s)
    return [
        _row(case, "jukebox booth commit", booth_s, base,
             freed_s=statistics.median(freed_s),
             note="check, stage, journal, apply, fsyncs; atomic and crash-safe; replaced "
                  "files linked into a trash, freed in the background (freed_s: from the "
                  "commit's start until they were)"),
        _row(case, "git add -A && git commit", git_s, base,
             note="hash and store the changed files, write index and commit"),
    ]  # fmt: skip


def _drained(trash: Path, timeout: float = 1200) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not any(os.scandir(trash)):
                return
        except FileNotFoundError:
            return
        time.sleep(0.05)


def append_case(s: Sizes) -> list[Row]:
    lower_cached = _big_file_dir(s.append_bytes)
    case = f"append 1 byte to a {s.append_bytes >> 20:,} MiB base file"
    rows: list[Row] = []
    for place in scratch_fs.ALL:
        try:
            with scratch_fs.place(place) as where:
                lower = where.lower(lower_cached)

                def once(b: bk.Backend, lower: Path = lower) -> float:
                    with b.prepare(lower) as mnt:
                        os.sync()
                        t0 = time.perf_counter()
                        with open(mnt / "big.bin", "ab") as f:
                            f.write(b"x")
                        return time.perf_counter() - t0

                systems = [b for b in bk.backends(where.root) if b.name != bk.NATIVE]
                samples, failed = _interleaved(systems, s.runs, once)
                cp_s = []
                for i in range(s.runs):
                    dest = where.root / f"cp-{i}"
                    cp_s.append(_timed(["cp", "--reflink=auto", str(lower / "big.bin"),
                                        str(dest)]))  # fmt: skip
                    dest.unlink()
                samples["cp --reflink=auto"] = cp_s
                base = statistics.median(cp_s)
                label = f"{case}, {where.label}"
                rows.append(_row(label, "cp --reflink=auto", cp_s, base, fs=place,
                                 note="the copy a copy-up amounts to"))  # fmt: skip
                for name in bk.ALL:
                    if name in samples:
                        rows.append(_row(label, name, samples[name], base, fs=place))
                    elif name in failed:
                        rows.append({"group": GROUP, "case": label, "system": name, "fs": place,
                                     "note": failed[name]})  # fmt: skip
        except scratch_fs.ScratchUnavailable as exc:
            rows.append({"group": GROUP, "case": f"{case}, {place}", "system": "-", "fs": place,
                         "note": str(exc)})  # fmt: skip
    return rows


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="jukebox-bench-scale-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


EXT4_IMAGE_BYTES = 8 << 30  # sparse: the commit case writes under 1 GiB to it


def _journaled_ext4() -> contextlib.AbstractContextManager[Path]:
    """A scratch dir on a fresh ext4 loop image with a journal (mkfs.ext4's default). This
    VM's root ext4 has no journal, and without one ext4 skips every inode freed in the last
    minute when it allocates one (docs/benchmarks.md, the inode scan): a commit and git's side,
    which create 50,000 files each, pay that scan there and not on the file system most trees
    are on."""
    return scratch_fs.loop_image(["mkfs.ext4", "-q", "-F"], EXT4_IMAGE_BYTES, "ext4")


def commit_on_ext4_case(s: Sizes) -> list[Row]:
    """`commit_case` with its trees, repos and tape dir on a journaled ext4 image."""
    try:
        with _journaled_ext4() as root:
            rows = commit_case(s, root)
    except scratch_fs.ScratchUnavailable as exc:
        return [{"group": GROUP, "case": f"commit {s.commit_files:,} changed files, "
                 "journaled ext4 image", "system": "-", "note": str(exc)}]  # fmt: skip
    for row in rows:
        row["case"] += ", journaled ext4 image"
    return rows


def _stat_walk(root: Path) -> float:
    """A bare scandir + lstat of every entry: the floor of a warm build, which must stat every
    file to trust its cached hash."""
    t0 = time.perf_counter()
    stack = [str(root)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for de in it:
                de.stat(follow_symlinks=False)
                if de.is_dir(follow_symlinks=False):
                    stack.append(de.path)
    return time.perf_counter() - t0


def first_booth_case(s: Sizes, scratch: Path) -> tuple[list[Row], list[Path]]:
    tree = _sized_tree(s.first_files, s.first_bytes)
    tree_bytes = _du(tree)
    case = f"first booth, {s.first_files:,}-file tree of {tree_bytes / 1e9:.2f} GB"
    cold: list[float] = []
    warm: list[float] = []
    grew: list[int] = []
    git_s: list[float] = []
    walk_s: list[float] = []
    small_s: list[float] = []
    small = _small_tree(1_000)
    tape_dirs = []
    for i in range(s.runs):
        tapes = scratch / f"first-tapes-{i}"
        tape_dirs.append(tapes)
        os.sync()
        cold.append(_timed([JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir",
                            str(tapes), "--tape-id", "cold", "--", "true"]))  # fmt: skip
        grew.append(_du(tapes / ".jukebox" / "store"))
        walk_s.append(_stat_walk(tree))
        warm.append(_timed([JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir",
                            str(tapes), "--tape-id", "warm", "--", "true"]))  # fmt: skip
        for tape_id in ("small-cold", "small-warm"):
            small_s.append(_timed([JUKEBOX, "booth", "run", "--tree", str(small), "--tape-dir",
                                   str(scratch / f"first-small-{i}"), "--tape-id", tape_id, "--",
                                   "true"]))  # fmt: skip
        del small_s[-2]  # the warm one: a booth's cost apart from the tree
        repo = scratch / f"first-git-{i}"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        os.sync()
        git_s.append(_timed(["git", f"--work-tree={tree}", "add", "-A"], cwd=repo,
                            env=git_env()))  # fmt: skip
        shutil.rmtree(repo)
    base = statistics.median(git_s)
    store = statistics.median(grew)
    return [
        _row(case, "jukebox booth run (cold)", cold, base, store_mb=store / 1e6,
             note="fresh tape dir: hash the tree, store what it must"),
        _row(case, "jukebox booth run (warm)", warm, base,
             ratio_stat_walk=statistics.median(warm) / statistics.median(walk_s),
             note="same tape dir again: the stat cache"),
        _row(case, "scandir + lstat of every entry", walk_s, base,
             note="Python, warm cache, just before the warm booth: the floor"),
        _row(case, "jukebox booth run (warm), 1,000-file tree", small_s, base,
             note="right after the warm booth: what a booth costs apart from its tree"),
        _row(case, "git add -A (fresh repo)", git_s, base,
             note="hash and store every file into .git"),
    ], tape_dirs  # fmt: skip


CHECKPOINTS = (
    "import os, subprocess, sys\n"
    "files = sorted(os.path.join(d, n) for d, _, ns in os.walk('.') for n in ns)\n"
    "for i in range(int(sys.argv[3])):\n"
    "    with open(files[int(sys.argv[1]) + i], 'a') as f: f.write('# edit %d\\n' % i)\n"
    "    subprocess.run([sys.argv[2], 'booth', 'checkpoint', '-q'], check=True)\n"
)


def _garbage_and_gc(tree: Path, tapes: Path, n: int) -> tuple[float, int]:
    """Two booths of n checkpoints, one edit each: one kept pending, the other discarded and
    its tape removed (its checkpoints are the garbage); then `jukebox gc --grace 0`, timed."""
    for tape_id, first in (("kept", 0), ("gone", 20)):
        agent = [sys.executable, "-c", CHECKPOINTS, str(first), JUKEBOX, str(n)]
        _booth(tree, tapes, tape_id, agent)
    for cmd in (["booth", "discard", "gone"], ["rm", "gone"]):
        subprocess.run([JUKEBOX, *cmd, "--tape-dir", str(tapes)], check=True, capture_output=True)
    t0 = time.perf_counter()
    proc = subprocess.run([JUKEBOX, "gc", "--tape-dir", str(tapes), "--grace", "0", "--json"],
                          check=True, capture_output=True, text=True)  # fmt: skip
    took = time.perf_counter() - t0
    subprocess.run([JUKEBOX, "booth", "discard", "kept", "--tape-dir", str(tapes)],
                   check=True, capture_output=True)  # fmt: skip
    return took, int(json.loads(proc.stdout)["removed"])


def gc_case(s: Sizes, scratch: Path, big_tapes: list[Path]) -> list[Row]:
    big = _sized_tree(s.first_files, s.first_bytes)
    small = _small_tree(1_000)
    rows = []
    n = s.checkpoints
    for label, tree, dirs in (
        (f"{s.first_files:,}-file tree", big, big_tapes),
        ("1,000-file tree", small, [scratch / f"gc-small-{i}" for i in range(s.runs)]),
    ):
        secs, removed = [], []
        for d in dirs:
            took, gone = _garbage_and_gc(tree, d, s.checkpoints)
            secs.append(took)
            removed.append(gone)
        store = statistics.median(_du(d / ".jukebox" / "store") for d in dirs)
        rows.append(_row(
            f"jukebox gc, {label}, {2 * n} checkpoints of 1 edit, {n} of them garbage",
            "jukebox gc",
            secs, None, store_mb=store / 1e6, removed=max(removed),
            note="mark from every tape and pending booth, sweep packs holding garbage",
        ))  # fmt: skip
    base = rows[-1]["seconds"]
    for row in rows:
        row["ratio"] = row["seconds"] / base
    return rows


def run(quick: bool = False) -> list[Row]:
    s = Sizes.for_mode(quick)
    rows: list[Row] = []
    steps: list[tuple[str, Callable[[Path], list[Row]]]] = []
    with _scratch() as scratch:
        state: dict[str, Any] = {}

        def first(p: Path) -> list[Row]:
            out, state["first_tapes"] = first_booth_case(s, p)
            return out

        steps = [
            ("rewrite", lambda p: rewrite_case(s, p)),
            ("commit", lambda p: commit_case(s, p)),
            ("commit on ext4", lambda p: commit_on_ext4_case(s)),
            ("append", lambda p: append_case(s)),
            ("first booth", first),
            ("gc", lambda p: gc_case(s, p, state.get("first_tapes", []))),
        ]  # fmt: skip
        for name, step in steps:
            t0 = time.perf_counter()
            try:
                rows += step(scratch)
            except Exception as exc:  # one broken case must not hide the others' rows
                rows.append({"group": GROUP, "case": name, "system": "-",
                             "note": f"failed: {type(exc).__name__}: {exc}"[:400]})  # fmt: skip
            took = time.perf_counter() - t0
            print(f"bench: scale {name} {took:.1f} s", file=sys.stderr, flush=True)
    return rows


def _one_case(name: str, quick: bool, runs: int | None) -> list[Row]:
    """One case alone, in a scratch dir of its own that goes with it (`python -m
    bench.bench_scale commit --runs 1`)."""
    s = Sizes.for_mode(quick)
    if runs is not None:
        s = dataclasses.replace(s, runs=runs)
    cases: dict[str, Callable[[Path], list[Row]]] = {
        "rewrite": lambda p: rewrite_case(s, p),
        "commit": lambda p: commit_case(s, p),
        "commit-ext4": lambda p: commit_on_ext4_case(s),
        "append": lambda p: append_case(s),
        "first": lambda p: first_booth_case(s, p)[0],
    }
    if name not in cases:
        raise SystemExit(f"no case {name!r}: one of {', '.join(cases)}")
    with _scratch() as scratch:
        return cases[name](scratch)


if __name__ == "__main__":
    args = sys.argv[1:]
    quick = "--quick" in args
    runs = int(args[args.index("--runs") + 1]) if "--runs" in args else None
    names = [a for i, a in enumerate(args) if not a.startswith("--")
             and (i == 0 or args[i - 1] != "--runs")]  # fmt: skip
    rows = [r for n in names for r in _one_case(n, quick, runs)] if names else run(quick=quick)
    for row in rows:
        print(row)
