"""Fixtures for booth tests: real namespaces, real mounts, real processes.

Unprivileged runs use `setpriv` to become `nobody`. The venv's interpreter lives under /root
(mode 0700 here), out of nobody's reach, so those runs use the system Python 3.11 with a tiny venv
whose .pth pulls in this checkout and the project venv's packages.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import slow

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def run_py(
    code: str,
    *args: str,
    python: str = sys.executable,
    user: int | None = None,
    timeout: float = 30,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    cmd = [python, "-c", code, *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=slow(timeout), cwd=cwd or "/"
    )


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON in output (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


@pytest.fixture(scope="session")
def root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create mount namespaces and become nobody")


@pytest.fixture(scope="session")
def nobody_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as nobody")
    system = shutil.which("python3.11", path="/usr/bin:/usr/local/bin")
    if system is None:
        pytest.skip("no system python3.11 readable by nobody")
    base = Path("/tmp") / f"jukebox-test-nobody-venv-{os.getpid()}"
    subprocess.run([system, "-m", "venv", "--without-pip", str(base)], check=True)
    site = next((base / "lib").glob("python3*/site-packages"))
    ours = next((Path(sys.prefix) / "lib").glob("python3*/site-packages"))
    (site / "jukebox-dev.pth").write_text(f"import site; site.addsitedir({str(ours)!r})\n")
    python = str(base / "bin" / "python")
    probe = run_py("import jukebox.booth.isolation, prctl", python=python, user=NOBODY)
    if probe.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"the system python cannot load the project as nobody: {probe.stderr[-300:]}")
    userns = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "unshare",
            "-Urm",
            "true",
        ],
        capture_output=True,
    )
    if userns.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip("the kernel forbids unprivileged user namespaces here")
    yield python
    shutil.rmtree(base, ignore_errors=True)


# Who holds /dev/fuse open to all, and its mode before the first of them: the suite's workers
# (pytest -n) share the device, so the last one to finish restores it, not the first.
DEV_FUSE_USERS = Path(tempfile.gettempdir()) / "jukebox-tests-dev-fuse.json"


@contextlib.contextmanager
def _dev_fuse_users() -> Iterator[dict]:
    """The users' record under an exclusive lock, written back as the block leaves it; pids
    that died (a worker killed before its teardown) are dropped."""
    with open(DEV_FUSE_USERS, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        raw = f.read()
        state = json.loads(raw) if raw.strip() else {"mode": None, "users": []}
        state["users"] = [pid for pid in state["users"] if os.path.exists(f"/proc/{pid}")]
        yield state
        f.seek(0)
        f.truncate()
        f.write(json.dumps(state))


@pytest.fixture(scope="session")
def open_dev_fuse() -> Iterator[None]:
    """/dev/fuse is 0600 on this machine; an unprivileged booth needs to open it."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")
    with _dev_fuse_users() as state:
        if not state["users"]:
            state["mode"] = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
        state["users"].append(os.getpid())
        os.chmod("/dev/fuse", 0o666)
    yield
    with _dev_fuse_users() as state:
        state["users"] = [pid for pid in state["users"] if pid != os.getpid()]
        if not state["users"]:
            os.chmod("/dev/fuse", state["mode"])


@pytest.fixture
def nobody_dir(tmp_path: Path) -> Path:
    """A directory nobody can reach and own: /tmp/<name>, since pytest's tmp root is 0700."""
    d = Path("/tmp") / f"jukebox-nobody-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    os.chown(d, NOBODY, NOBODY)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def nobody_tree(nobody_dir: Path) -> tuple[Path, Path]:
    """A tree owned by nobody (``a.txt`` holding "one"), and where its tapes go."""
    tree, tapes = nobody_dir / "tree", nobody_dir / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    for path in (tree, tree / "a.txt"):
        os.chown(path, NOBODY, NOBODY)
    return tree, tapes


@pytest.fixture
def dev_fuse() -> None:
    """Booth runs mount the FUSE layer."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")
