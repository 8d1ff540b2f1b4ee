"""The two ext4 disks a test VM gets: a fresh scratch disk, and the Python image.

Both are made with `mkfs.ext4` as plain files (no loop device, no mount on the host). The Python
image holds the checkout's .venv and, unless it is the system's, the interpreter the venv was
made from, so the guest imports from a block device instead of 9p.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRATCH_SIZE = "24G"  # sparse: only what the tests write takes host disk


def _mkfs(image: Path, label: str, size: str, root: Path | None = None) -> None:
    image.unlink(missing_ok=True)
    cmd = ["mkfs.ext4", "-q", "-F", "-L", label, "-E", "lazy_itable_init=1,lazy_journal_init=1"]
    if root is not None:
        cmd += ["-d", str(root)]
    # stderr for mkfs's chatter: under --parallel, stdout carries each kernel's JSON report.
    subprocess.run([*cmd, str(image), size], check=True, stdout=sys.stderr)


def scratch(path: Path) -> Path:
    """A new empty ext4 file system, mounted as /tmp in the guest."""
    _mkfs(path, "jbx-scratch", SCRATCH_SIZE)
    return path


def venv_paths(repo: Path) -> tuple[Path, Path | None]:
    """The checkout's venv, and the interpreter prefix to copy (None for the system's)."""
    venv = repo / ".venv"
    home = None
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            home = Path(value.strip()).parent
    if home is None or str(home) in ("/usr", "/usr/local"):
        return venv, None  # the system's interpreter: over 9p like the rest of /usr
    return venv, home


def _not_for_a_venv(rel: str) -> bool:
    # The venv does not read the base interpreter's site-packages, nor its own test suite.
    parts = rel.split(os.sep)
    return len(parts) >= 3 and parts[0] == "lib" and parts[2] in ("site-packages", "test")


def _stage(src: Path, dst: Path, skip=lambda rel: False) -> int:
    """dst mirrors src with hard links (copies across file systems); returns bytes staged."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        if rel != "." and skip(rel):
            dirnames[:] = []
            continue
        out = dst / rel
        out.mkdir(parents=True, exist_ok=True)
        shutil.copystat(dirpath, out)
        for name in filenames:
            s, d = os.path.join(dirpath, name), out / name
            if os.path.islink(s):
                os.symlink(os.readlink(s), d)
                continue
            try:
                os.link(s, d)
            except OSError:
                shutil.copy2(s, d)
            total += os.lstat(s).st_size
        for name in dirnames:
            s = os.path.join(dirpath, name)
            if os.path.islink(s):
                os.symlink(os.readlink(s), out / name)
    return total


def python_image(repo: Path, cache: Path, log=print) -> Path:
    """CACHE/python.img, rebuilt when the venv was re-installed or the interpreter moved."""
    venv, prefix = venv_paths(repo)
    image = cache / "python.img"
    stamp = venv / ".installed"
    key = f"{prefix} {sys.version_info[:3]} {stamp.stat().st_mtime_ns if stamp.exists() else 0}\n"
    keyfile = cache / "python.img.key"
    if image.exists() and keyfile.exists() and keyfile.read_text() == key:
        return image
    log("vm: building the Python image (the interpreter and .venv, once per venv install)")
    stage = cache / "python-stage"
    shutil.rmtree(stage, ignore_errors=True)
    size = _stage(venv, stage / "venv")
    if prefix is not None:
        size += _stage(prefix, stage / "prefix", _not_for_a_venv)
    mib = size * 13 // 10 // 2**20 + 256  # room for metadata and small files' blocks
    _mkfs(image, "jbx-python", f"{mib}M", stage)
    shutil.rmtree(stage, ignore_errors=True)
    keyfile.write_text(key)
    return image


def private_view(image: Path, path: Path) -> Path:
    """A qcow2 file over image, for one VM: QEMU locks a raw disk for writing, so two VMs could
    not share the Python image, while a backing file is opened read-only and may be shared."""
    path.unlink(missing_ok=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image), "-F", "raw",
                    str(path)], check=True, stdout=sys.stderr)
    return path
