"""The compiled seccomp filter a booth keeps in the user's state dir: reused when it is this
exact filter and intact, never taken from a directory someone else can write, and what a booth
loads refuses what the filter refuses."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.booth import syscall_filter

pytestmark = pytest.mark.skipif(
    syscall_filter.unavailable_reason() is not None, reason="no seccomp filters here"
)

EVERY_GROUP = list(syscall_filter.GROUPS)

# keyctl (the keyring group) in a child that installs the program: EPERM under the filter.
REFUSED_IN_CHILD = r"""
import ctypes, os, sys
from jukebox.booth import syscall_filter
program = open(sys.argv[1], "rb").read()
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
syscall_filter.load_compiled(program)
libc.syscall.restype = ctypes.c_long
r = libc.syscall(ctypes.c_long(250), ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0))
print(r, ctypes.get_errno())
"""


def _fresh(allow: list[str] | tuple[str, ...] = ()) -> bytes:
    return syscall_filter.compiled(allow)


def _cached_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".bpf")


def test_the_program_is_compiled_once_and_reused(tmp_path: Path) -> None:
    cache = tmp_path / "seccomp"
    first = syscall_filter.cached((), cache)
    assert first == _fresh()
    (path,) = _cached_files(cache)
    assert cache.stat().st_mode & 0o777 == 0o700
    mtime = path.stat().st_mtime_ns
    assert syscall_filter.cached((), cache) == first
    assert path.stat().st_mtime_ns == mtime  # read, not written again
    # Another filter (an image's allow list) is another entry, never the same one.
    loose = syscall_filter.cached(["ptrace", "keyring"], cache)
    assert loose != first and loose == _fresh(["ptrace", "keyring"])
    assert len(_cached_files(cache)) == 2


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty"])
def test_a_torn_or_altered_cache_file_is_never_loaded(tmp_path: Path, damage: str) -> None:
    cache = tmp_path / "seccomp"
    good = syscall_filter.cached((), cache)
    (path,) = _cached_files(cache)
    data = path.read_bytes()
    if damage == "truncated":
        data = data[: len(data) - 8]
    elif damage == "flipped":
        data = data[:-1] + bytes([data[-1] ^ 1])
    else:
        data = b""
    path.write_bytes(data)
    assert syscall_filter.cached((), cache) == good
    assert path.read_bytes() != data  # rewritten whole


def test_a_program_planted_where_others_can_write_is_not_loaded(tmp_path: Path) -> None:
    """The attack: a looser program (every group allowed), with a valid digest, under the key
    of the default filter, in a cache directory another user can write."""
    cache = tmp_path / "seccomp"
    strict = syscall_filter.cached((), cache)
    (path,) = _cached_files(cache)
    loose = _fresh(EVERY_GROUP)
    path.write_bytes(syscall_filter.digest(loose) + loose)
    cache.chmod(0o777)
    assert syscall_filter.cached((), cache) is None  # not loaded: compiled where installed
    # A symlink in the key's place is not followed either.
    cache.chmod(0o700)
    other = tmp_path / "planted.bpf"
    other.write_bytes(syscall_filter.digest(loose) + loose)
    path.unlink()
    path.symlink_to(other)
    assert syscall_filter.cached((), cache) == strict


def test_the_cached_program_refuses_what_the_filter_refuses(tmp_path: Path) -> None:
    program = syscall_filter.cached((), tmp_path / "seccomp")
    assert program is not None
    saved = tmp_path / "program"
    saved.write_bytes(program)
    proc = subprocess.run([sys.executable, "-c", REFUSED_IN_CHILD, str(saved)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["-1", str(errno.EPERM)]


def test_a_malformed_program_is_refused_before_the_kernel_sees_it() -> None:
    with pytest.raises(syscall_filter.FilterError):
        syscall_filter.load_compiled(b"\0" * 12)
    with pytest.raises(syscall_filter.FilterError):
        syscall_filter.load_compiled(b"")


KEYCTL_AGENT = (
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
    "r = libc.syscall(250, 0, 0, 0, 0); print('keyctl', r, ctypes.get_errno())"
)


@pytest.mark.usefixtures("root_only", "dev_fuse")
def test_a_booth_compiles_into_the_cache_and_its_agent_is_filtered(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    state = tmp_path / "state"
    jukebox = str(Path(sys.executable).parent / "jukebox")
    # The first compiles and keeps it, the second loads what was kept, the third finds the
    # cache writable by others and leaves the compiling to the agent's process, as before.
    for run in range(3):
        if run == 2:
            (state / "jukebox" / "seccomp").chmod(0o777)
        proc = subprocess.run(
            [jukebox, "booth", "run", "--tree", str(tree), "--tape-dir", str(tmp_path / "tapes"),
             "--commit", "never", "--", "/usr/bin/python3", "-c", KEYCTL_AGENT],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "XDG_STATE_HOME": str(state)},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert f"keyctl -1 {errno.EPERM}" in proc.stdout
        assert len(_cached_files(state / "jukebox" / "seccomp")) == 1
