"""A commit stages from the booth's kept scratch files (shadowfs.kept) only what passes its
checks: attacks on those files between the booth and its commit, performed for real by their
owner (root, and nobody for an unprivileged booth), each end with the tree holding exactly the
booth's content and nothing outside it linked in or changed.

One pending booth per user rewrites 300 files (a commit staged as a whole, the size from which
kept files are used); before its commit the owner of the tape dir

- rewrites one kept file with other bytes of the same size;
- replaces one with a hard link to a file outside, of exactly the right content;
- replaces one with a symlink to such a file;
- replaces one with a fifo (the commit must not hang on it);
- holds one open for writing, unchanged, and writes through that fd once the commit is done;
- points the map's entry of one path at the kept file of another;
- gives one directory of the tree a default ACL (its new files must inherit it, which a file
  linked there would not).

Root's commit is killed just past its commit point first, and recovery finishes it: the
untouched files are moved into place, their inode in the tree the kept one's. Nobody's is
killed just before it, and recovery undoes it: the tree is the old one, with no staged file
left, and the commit after it writes everything from the store.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
from pathlib import Path

import pytest

from shadowfs.commit import CRASH_ENV
from shadowfs.kept import MAP_NAME
from tests.booth.conftest import nobody_dir  # noqa: F401  (fixture)
from tests.reliability.conftest import AGENT_PYTHON, NOBODY, booth_argv, jb

pytestmark = pytest.mark.usefixtures("booth_ready")

N_DIRS, PER_DIR = 3, 100
AGENT = """
import os
for d in range(3):
    for f in range(100):
        with open(f"d{d}/f{f:03d}", "w") as out:
            out.write(f"new {d} {f}\\n" * 20)
"""
# Run by the tape dir's owner once the booth is pending: the attacks. Prints "ready" once the
# writer holds its fd, then waits for a line before writing through it.
ATTACK = r"""
import json, os, sys
kept, outside = sys.argv[1], sys.argv[2]
m = json.load(open(f"{kept}/paths.json"))
names = {p: str(ino) for p, ino in m["files"]}
def at(p):
    return f"{kept}/{names[p]}"
def body(p):
    d, f = int(p[1]), int(p.split("/f")[1])
    return (f"new {d} {f}\n" * 20).encode()
with open(at("d0/f000"), "r+b") as f:
    f.write(b"X" * len(body("d0/f000")))
for p, how in (("d0/f001", "link"), ("d0/f002", "symlink")):
    victim = f"{outside}/{how}-victim"
    with open(victim, "wb") as f:
        f.write(body(p))
    os.chmod(victim, 0o600)
    os.utime(victim, ns=(10**18, 10**18))
    os.unlink(at(p))
    (os.link if how == "link" else os.symlink)(victim, at(p))
os.unlink(at("d0/f003"))
os.mkfifo(at("d0/f003"), 0o600)
m["files"] = [[p, ino if p != "d0/f005" else int(names["d0/f006"])] for p, ino in m["files"]]
with open(f"{kept}/paths.json", "w") as f:
    json.dump(m, f)
held = os.open(at("d0/f004"), os.O_RDWR)
print("ready", flush=True)
sys.stdin.readline()
os.pwrite(held, b"EVIL", 0)
print("wrote", flush=True)
"""


# A default ACL granting nobody rw- (acl_ea_header version 2, then tag, perm, id per entry).
_ANY = 0xFFFFFFFF
DEFAULT_ACL = struct.pack("<I", 2) + b"".join(
    struct.pack("<HHI", tag, perm, uid)
    for tag, perm, uid in ((0x01, 6, _ANY), (0x02, 6, NOBODY), (0x04, 4, _ANY), (0x10, 6, _ANY),
                           (0x20, 4, _ANY))
)  # fmt: skip


def _body(d: int, f: int, what: str = "new") -> bytes:
    return (f"{what} {d} {f}\n" * 20).encode()


def _all() -> list[tuple[int, int]]:
    return [(d, f) for d in range(N_DIRS) for f in range(PER_DIR)]


def _bodies(tree: Path) -> dict[tuple[int, int], bytes]:
    return {(d, f): (tree / f"d{d}" / f"f{f:03d}").read_bytes() for d, f in _all()}


@pytest.mark.parametrize("who", ["root", "nobody"])
def test_kept_files_that_fail_a_check_are_written_from_the_store(
    who: str, request: pytest.FixtureRequest, nobody_dir: Path  # noqa: F811
) -> None:
    user = None
    python = None
    left: set[str] = set()
    if who == "nobody":
        python = request.getfixturevalue("nobody_python")
        request.getfixturevalue("open_dev_fuse")
        user = NOBODY
    work = nobody_dir
    tree, tapes, outside = work / "tree", work / "tapes", work / "outside"
    for d in range(N_DIRS):
        (tree / f"d{d}").mkdir(parents=True)
        for f in range(PER_DIR):
            (tree / f"d{d}" / f"f{f:03d}").write_text(f"old {d} {f}\n" * 20)
    outside.mkdir()
    if user is not None:
        for p in [tree, outside, *tree.rglob("*")]:
            os.chown(p, user, user)
    run = jb(*booth_argv(tree, tapes, "k1", "--commit", "never"), AGENT_PYTHON, "-c", AGENT,
             cwd=work, python=python, user=user)  # fmt: skip
    assert run.returncode == 0, run.stderr
    kept = tapes / ".jukebox" / "kept" / "k1"
    names = {p: str(ino) for p, ino in json.loads((kept / MAP_NAME).read_text())["files"]}
    assert len(names) == N_DIRS * PER_DIR
    inodes = {p: os.lstat(kept / n).st_ino for p, n in names.items()}

    drop = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}",
                                    "--clear-groups"]  # fmt: skip
    attacker = subprocess.Popen(
        [*drop, AGENT_PYTHON, "-c", ATTACK, str(kept), str(outside)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert attacker.stdout is not None and attacker.stdin is not None
        assert attacker.stdout.readline() == "ready\n", attacker.stderr
        victims = {how: os.lstat(outside / f"{how}-victim") for how in ("link", "symlink")}
        os.setxattr(tree / "d2", "system.posix_acl_default", DEFAULT_ACL)
        assert victims["link"].st_nlink == 2  # the kept name is a second name of it
        commit = ("booth", "commit", "k1", "--tape-dir", str(tapes))
        # Killed with the kept files staged: root's just past its commit point, nobody's just
        # before it (the check done), which recovery undoes.
        point = "journal" if who == "root" else "checked"
        killed = jb(*commit, cwd=work, python=python, user=user, env={CRASH_ENV: point})
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        if who == "nobody":
            listed = jb("booth", "ls", "--tape-dir", str(tapes), cwd=work, python=python,
                        user=user)  # fmt: skip
            assert "undone" in listed.stderr, listed.stderr
            assert _bodies(tree) == {(d, f): _body(d, f, "old") for d, f in _all()}
            assert not [p for p in tree.rglob(".jbx-stage-*")]
            left = set(os.listdir(kept))
        done = jb(*commit, cwd=work, python=python, user=user)
        assert done.returncode == 0, done.stderr
        if who == "root":
            assert "finished by recovery" in done.stdout
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        assert attacker.stdout.readline() == "wrote\n"
    finally:
        attacker.kill()
        attacker.wait()

    assert _bodies(tree) == {(d, f): _body(d, f) for d, f in _all()}
    got = {p: os.lstat(tree / p) for p in names}
    attacked = {"d0/f000", "d0/f001", "d0/f002", "d0/f003", "d0/f004", "d0/f005"}
    for p, st in got.items():
        assert st.st_nlink == 1 and st.st_mode & 0o777 == 0o644, p
        assert st.st_uid == (user if user is not None else 0), p
        if p.startswith("d2/"):  # written anew, inheriting the default ACL
            assert "system.posix_acl_access" in os.listxattr(tree / p), p
            assert st.st_ino != inodes[p], p
        elif p not in attacked and who == "root":
            assert st.st_ino == inodes[p], p  # moved into place, not written anew
        elif p not in attacked:  # moved into staging, then undone: gone from the kept dir
            assert names[p] not in left and st.st_ino != inodes[p], p
    for how, before in victims.items():
        victim = outside / f"{how}-victim"
        now = os.lstat(victim)
        assert (now.st_mode, now.st_mtime_ns, now.st_ino) == (
            before.st_mode, before.st_mtime_ns, before.st_ino
        )  # fmt: skip
        assert victim.read_bytes() == _body(0, 1 if how == "link" else 2)
        assert all(st.st_ino != now.st_ino for st in got.values())
