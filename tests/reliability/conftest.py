"""Fixtures for the reliability suites: real booths, real processes, real host files.

Escape and concurrency tests drive `jukebox booth run` exactly as a user does (the console script
in a subprocess), then compare hashed walks of the real tree, the tape dir and canary files on
the host before and after. The unprivileged fixtures come from tests/booth (a tiny venv the
`nobody` user can run, a /dev/fuse it may open).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.booth.conftest import (  # noqa: F401  (fixtures re-exported for this directory)
    NOBODY,
    nobody_python,
    open_dev_fuse,
    root_only,
)
from tests.conftest import slow

JUKEBOX = str(Path(sys.executable).parent / "jukebox")
# The agents themselves run on the system interpreter: the venv's lives under /root (0700), out of
# an unprivileged booth's reach, and the agents need nothing beyond the standard library.
AGENT_PYTHON = "/usr/bin/python3"

Entry = tuple[object, ...]

# The opening of every red-team agent script: `cfg` from argv[1], libc through ctypes, and
# `attempt(key, fn)`, which records in `out` "ok", the errno's name, or what `fn` returned (a
# str, int, dict or list); `c(r)` turns a raw libc return into "ok" or the errno's name.
AGENT_PRELUDE = r"""
import ctypes, errno, json, os, platform, sys

cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}

def en(e):
    return errno.errorcode.get(e, str(e))

def c(r):
    return "ok" if r >= 0 else en(ctypes.get_errno())

def attempt(key, fn):
    try:
        r = fn()
        out[key] = r if isinstance(r, (str, dict, list, int)) else "ok"
    except OSError as e:
        out[key] = en(e.errno)
    except Exception as e:
        out[key] = "error " + type(e).__name__ + ": " + str(e)
"""


def tree_state(root: str | os.PathLike[str]) -> dict[str, Entry]:
    """Every path under `root` (itself included) with its type, mode, owner, mtime and content
    hash or link target; symlinks are never followed. Equal states mean an untouched tree."""
    root = os.fspath(root)
    out: dict[str, Entry] = {}

    def one(path: str, rel: str) -> None:
        st = os.lstat(path)
        fmt = stat.S_IFMT(st.st_mode)
        if fmt == stat.S_IFREG:
            with open(path, "rb") as f:
                body: object = hashlib.sha256(f.read()).hexdigest()
        elif fmt == stat.S_IFLNK:
            body = os.readlink(path)
        else:
            body = None
        mtime = None if fmt == stat.S_IFDIR and rel == "." else st.st_mtime_ns
        out[rel] = (fmt, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, mtime, body)

    one(root, ".")
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            one(path, os.path.relpath(path, root))
    return out


def jb(
    *args: str,
    cwd: str | os.PathLike[str] = "/",
    env: dict[str, str] | None = None,
    python: str | None = None,
    user: int | None = None,
    timeout: float = 90,
) -> subprocess.CompletedProcess[str]:
    """The real `jukebox` command; as `user` (through setpriv) with `python` when given."""
    cmd = [JUKEBOX, *args]
    if python is not None:
        cmd = [python, "-c", "from jukebox.cli import main; main()", *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    full_env = dict(os.environ, PATH=f"{Path(JUKEBOX).parent}:{os.environ.get('PATH', '')}")
    full_env.update(env or {})
    return subprocess.run(
        cmd, capture_output=True, text=True, cwd=cwd, env=full_env, timeout=slow(timeout)
    )


def booth_argv(tree: Path, tapes: Path, tape_id: str, *opts: str) -> list[str]:
    return [
        "booth",
        "run",
        "--tree",
        str(tree),
        "--tape-dir",
        str(tapes),
        "--tape-id",
        tape_id,
        *opts,
        "--",
    ]


@pytest.fixture(scope="session")
def booth_ready() -> None:
    """Skips unless a FUSE booth can run here (root, /dev/fuse, the layer importable). Not
    autouse: other suites in this directory need none of it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create mount namespaces and become nobody")
    try:
        import shadowfs.fuse
        import shadowfs.layer  # noqa: F401
    except ImportError as error:
        pytest.skip(f"the FUSE layer is not importable: {error}")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")


@dataclass
class Canaries:
    """Host files outside any tree that no booth may change."""

    srv: Path  # a directory under /srv holding file.txt and dir/inner.txt
    root_file: Path  # a file under /root (0700: unreadable to nobody)

    @property
    def file(self) -> Path:
        return self.srv / "file.txt"

    @property
    def dir(self) -> Path:
        return self.srv / "dir"

    def state(self) -> dict[str, object]:
        return {"srv": tree_state(self.srv), "root": tree_state(self.root_file)}


@pytest.fixture(scope="module")
def canaries() -> Iterator[Canaries]:
    if os.geteuid() != 0:
        pytest.skip("needs root to plant canaries under /srv and /root")
    srv = Path("/srv") / f"jukebox-canary-{os.getpid()}"
    (srv / "dir").mkdir(parents=True)
    (srv / "file.txt").write_text("canary: must never change\n")
    (srv / "dir" / "inner.txt").write_text("inner canary\n")
    # World-writable on purpose: only the booth's read-only host view stands between the agent
    # and these files, not their permissions.
    for p in (srv, srv / "dir", srv / "file.txt", srv / "dir" / "inner.txt"):
        p.chmod(0o777 if p.is_dir() else 0o666)
    root_file = Path("/root") / f"jukebox-canary-{os.getpid()}.txt"
    root_file.write_text("root canary\n")
    yield Canaries(srv, root_file)
    shutil.rmtree(srv, ignore_errors=True)
    root_file.unlink(missing_ok=True)
