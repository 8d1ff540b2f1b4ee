"""Where the fs suite runs: the machine's temp dir, or an XFS loop image with reflink.

A copy-on-write layer pays for a write to a big base file with a copy of the whole file, unless
the file system can share blocks: kernel overlayfs clones on copy-up and shadowfs copies up with
`copy_file_range`, and both are O(1) on XFS with reflink or btrfs when lower and upper share the
file system. The suite therefore runs on the temp dir's file system (ext4 on most machines, no
reflink) and again on a fresh XFS image with reflink, so a reader sees both costs side by side.

The XFS image is a sparse file under the temp dir, loop-mounted for the run and removed after;
making it needs root and `mkfs.xfs` (Debian's xfsprogs). The lower dirs are copied onto it once,
untimed, so lower and upper share the file system as they would in a booth whose tape dir sits
beside the tree.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import fs_type_of

TMP = "tmp"
XFS = "xfs"
ALL = (TMP, XFS)
# Sparse: only what the runs write takes disk. The largest run (100 MiB write, a 64 MiB base file
# and its copies, a 10,000-file repo) needs well under 2 GiB at once.
XFS_IMAGE_BYTES = 16 << 30


class ScratchUnavailable(RuntimeError):
    """This place cannot be made here; the message says why and what would make it possible."""


@dataclass
class Place:
    """One file system the suite runs on: scratch dirs and lower dirs both live on it."""

    name: str  # what --fs-on selects
    label: str  # how the report names it
    root: Path
    copy_lowers: bool  # lower dirs are copied onto `root` (else used where they are cached)
    _lowers: dict[Path, Path] = field(default_factory=dict)

    def lower(self, cached: Path) -> Path:
        """The lower dir to mount for `cached`, on this place's file system."""
        if not self.copy_lowers:
            return cached
        found = self._lowers.get(cached)
        if found is None:
            found = self.root / "lowers" / cached.name
            found.parent.mkdir(exist_ok=True)
            # --reflink=never: the lower is a plain copy, so clones made later start from it.
            subprocess.run(
                ["cp", "-a", "--reflink=never", "--", str(cached), str(found)], check=True
            )
            self._lowers[cached] = found
        return found


def parse(spec: str | None) -> list[str]:
    names = [n.strip() for n in (spec or ",".join(ALL)).split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise ValueError(
            f"unknown --fs-on value(s) {', '.join(unknown)}; choose from {', '.join(ALL)}."
        )
    return names


@contextlib.contextmanager
def place(name: str) -> Iterator[Place]:
    """A fresh scratch root on the named file system, removed (and unmounted) on exit."""
    if name == TMP:
        root = Path(tempfile.mkdtemp(prefix="jukebox-bench-scratch-"))
        try:
            yield Place(TMP, f"{tempfile.gettempdir()} ({fs_type_of(root)})", root, False)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    elif name == XFS:
        with _xfs_image() as root:
            yield Place(XFS, "XFS with reflink (loop image)", root, True)
    else:
        raise ValueError(f"unknown scratch place {name!r}")


@contextlib.contextmanager
def _xfs_image() -> Iterator[Path]:
    if shutil.which("mkfs.xfs") is None:
        raise ScratchUnavailable("mkfs.xfs is missing: apt-get install xfsprogs.")
    with loop_image(["mkfs.xfs", "-q", "-m", "reflink=1"], XFS_IMAGE_BYTES, "XFS") as root:
        yield root


@contextlib.contextmanager
def loop_image(mkfs: list[str], size: int, what: str) -> Iterator[Path]:
    """A scratch dir on a fresh sparse image of ``size`` bytes made by ``mkfs`` (the image's
    path appended), loop-mounted, all of it removed after."""
    if os.geteuid() != 0:
        raise ScratchUnavailable(f"an {what} loop image needs root to mount.")
    work = Path(tempfile.mkdtemp(prefix=f"jukebox-bench-{what.lower()}-"))
    image, mnt = work / "image", work / "mnt"
    mounted = False
    try:
        mnt.mkdir()
        with open(image, "wb") as f:
            f.truncate(size)
        _run([*mkfs, str(image)], mkfs[0])
        _run(["mount", "-o", "loop", str(image), str(mnt)], f"mounting the {what} image")
        mounted = True
        root = mnt / "scratch"
        root.mkdir()
        yield root
    finally:
        if mounted and subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            # Still busy (a backend's mount left behind by a failure): detach it lazily, so
            # the image file can go and the real error is the one reported.
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().replace("\n", " ")
        raise ScratchUnavailable(f"{what} failed: {detail or proc.returncode}")
