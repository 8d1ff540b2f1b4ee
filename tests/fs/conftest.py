"""Fixtures for file-system tests: a store, a populated base tree, a layer over it, a live mount.

Mounts are real FUSE mounts served from threads of the test process (the read-only view runs
on pyfuse3, which allows one per process, so tests mount one at a time). Every mount test checks
that the base is byte-for-byte untouched when it ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadowfs.store import Store


def fuse_unusable() -> str | None:
    """Why real FUSE mounts cannot run here, or None when they can."""
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        return f"/dev/fuse is not usable ({exc.strerror})"
    os.close(fd)
    if os.geteuid() != 0 and not shutil.which("fusermount3"):
        return "not root and fusermount3 is not installed"
    try:
        import pyfuse3  # noqa: F401
        import trio  # noqa: F401
    except ImportError as exc:
        return f"pyfuse3/trio missing ({exc})"
    return None


_WHY = fuse_unusable()
needs_fuse = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def tree_state(root: Path | str) -> dict[bytes, tuple[object, ...]]:
    """Every entry under root with kind, mode, size, mtime and content digest (or link target)."""
    out: dict[bytes, tuple[object, ...]] = {}
    base = os.fsencode(root)
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, base)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest: object = hashlib.blake2b(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            else:
                digest = None
            size = 0 if stat.S_ISDIR(st.st_mode) else st.st_size
            out[rel] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, size, st.st_mtime_ns, digest)
    return out


NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]


def run_attack(code: str, work: Path, user: int | None) -> dict[str, object]:
    """Runs ``code`` with the work dir and this checkout as argv[1] and argv[2], as root (this
    python) or as ``user`` (the system python3 through setpriv: shadowfs needs no venv's
    packages for it), and returns the JSON it prints. ``work`` is handed to ``user``."""
    if user is None:
        argv = [sys.executable]
    else:
        python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
        if os.geteuid() != 0 or not shutil.which("setpriv") or python is None:
            pytest.skip("needs root, setpriv and a system python3 to run as nobody")
        os.chown(work, user, user)
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", python]
    proc = subprocess.run([*argv, "-c", code, str(work), str(REPO)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def populate(base: Path) -> None:
    (base / "src").mkdir(parents=True)
    (base / "src" / "main.py").write_text("print('hello')\n")
    (base / "src" / "util.py").write_text("def f():\n    return 1\n")
    (base / "docs" / "deep" / "er").mkdir(parents=True)
    (base / "docs" / "deep" / "er" / "note.md").write_text("# note\n")
    (base / "empty").mkdir()
    (base / "README").write_text("readme\n")
    (base / "run.sh").write_text("#!/bin/sh\necho run\n")
    (base / "run.sh").chmod(0o755)
    (base / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    os.symlink("README", base / "link")
    os.symlink("src", base / "srclink")
    (base / "with space.txt").write_text("spaces\n")
    (base / "new\nline.txt").write_text("newline\n")
    with open(os.path.join(os.fsencode(base), b"bad-\xff\xfe.txt"), "wb") as f:
        f.write(b"invalid utf-8 name\n")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture
def base(tmp_path: Path) -> Path:
    b = tmp_path / "base"
    populate(b)
    return b


@pytest.fixture
def layer(base: Path, store: Store, tmp_path: Path) -> Iterator[object]:
    from shadowfs.layer import Layer

    before = tree_state(base)
    lay = Layer(base, store, tmp_path / "scratch")
    yield lay
    lay.close()
    assert tree_state(base) == before, "the base changed"


@pytest.fixture
def mount(layer: object, tmp_path: Path) -> Iterator[Path]:
    """The layer served at tmp_path/mnt from a child process; yields the mount point.

    A child, not a thread: this process may then touch the mount any way it likes (mmap page
    faults hold the GIL), and a test that dies cannot leave the process blocked on its own mount.
    The layer's snapshot/restore/path methods are forwarded to the child."""
    if _WHY is not None:
        pytest.skip(_WHY)
    from shadowfs.mountctl import Mount, is_mounted

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mount(layer, mnt, process=True).start()  # type: ignore[arg-type]
    try:
        yield mnt
    finally:
        m.stop()
    assert not is_mounted(mnt)
