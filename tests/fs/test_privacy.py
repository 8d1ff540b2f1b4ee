"""shadowfs.privacy.make_private_tree: a tree an agent made (modes, owners, links, depth of its
choosing) made private for good, without ever touching a file outside it."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from shadowfs.privacy import make_private_tree
from tests.fs.conftest import NOBODY, run_attack

# Builds the hostile tree in argv[1] (and a victim beside it), makes it private, reports.
ATTACK = r"""
import json, os, stat, sys
sys.path.insert(0, sys.argv[2])
from shadowfs.privacy import make_private_tree
work = sys.argv[1]
tree, victim = os.path.join(work, "tree"), os.path.join(work, "victim")
with open(victim, "w") as f:
    f.write("host file\n")
os.chmod(victim, 0o4755)  # what the tightening must never change: it lies outside
os.makedirs(os.path.join(tree, "d", "e"))
for name, mode in (("sid", 0o4755), ("sgid", 0o2755), ("world", 0o666), ("exe", 0o755)):
    with open(os.path.join(tree, name), "w") as f:
        f.write(name)
    os.chmod(os.path.join(tree, name), mode)
os.link(victim, os.path.join(tree, "d", "hard"))  # another name of the host's file
os.symlink(victim, os.path.join(tree, "d", "sym"))
os.symlink(os.path.join(work), os.path.join(tree, "d", "dirsym"))
os.mkfifo(os.path.join(tree, "d", "fifo"), 0o666)
deep = os.open(os.path.join(tree, "d", "e"), os.O_RDONLY)
for _ in range(1200):  # deeper than Python's recursion limit
    os.mkdir("x", 0o777, dir_fd=deep)
    inner = os.open("x", os.O_RDONLY, dir_fd=deep)
    os.close(deep)
    deep = inner
os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o4777, dir_fd=deep))
os.close(deep)
os.chmod(os.path.join(tree, "d", "e"), 0)
os.chmod(os.path.join(tree, "d"), 0o2777)
make_private_tree(tree, owner=(os.geteuid(), os.getegid()))
out = {"victim": oct(os.stat(victim).st_mode), "loose": [], "names": [], "uids": []}
out["deepest"] = 0
todo = [(os.open(tree, os.O_RDONLY), "", 0)]  # fd by fd: os.walk recurses, paths get long
while todo:
    fd, rel, depth = todo.pop()
    out["deepest"] = max(out["deepest"], depth)
    for name in os.listdir(fd):
        st = os.lstat(name, dir_fd=fd)
        if stat.S_ISLNK(st.st_mode):
            continue
        if stat.S_ISDIR(st.st_mode):
            todo.append((os.open(name, os.O_RDONLY, dir_fd=fd), rel + "/" + name, depth + 1))
        is_dir = stat.S_ISDIR(st.st_mode)
        want = 0o700 if is_dir else 0o600
        if stat.S_IMODE(st.st_mode) & ~want or (is_dir and st.st_mode & want != want):
            out["loose"].append([(rel + "/" + name)[-40:], oct(st.st_mode)])
        out["uids"].append(st.st_uid)
        if depth <= 1 and not (depth and rel != "/d"):
            out["names"].append((rel + "/" + name)[1:])
    os.close(fd)
print(json.dumps(out))
"""


@pytest.mark.parametrize("user", [None, NOBODY], ids=["root", "nobody"])
def test_an_agents_tree_is_made_private_and_nothing_outside_is_touched(
    tmp_path: Path, user: int | None
) -> None:
    # Where nobody can reach it; a tmpfs where there is one (1,200 mkdirs are 1.3 s on this
    # VM's ext4, 10 ms there).
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")
    work = base / f"jukebox-privacy-{os.getpid()}-{tmp_path.name}"
    work.mkdir()
    try:
        out = run_attack(ATTACK, work, user)
    finally:
        subprocess.run(["rm", "-rf", str(work)])  # shutil.rmtree recurses: not this deep
    assert out["loose"] == [] and out["deepest"] == 1202
    # The host's file, linked and symlinked into the tree, kept its mode (set-id bit included);
    # its link was unlinked rather than changed, the symlinks were left as they are.
    assert out["victim"] == oct(stat.S_IFREG | 0o4755)
    names = set(out["names"])  # type: ignore[arg-type]
    assert "d/hard" not in names and {"sid", "sgid", "world", "exe", "d/fifo", "d/e"} <= names
    assert set(out["uids"]) == {user if user is not None else os.geteuid()}  # type: ignore[arg-type]


def test_a_file_the_agent_gave_away_is_taken_back(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown")
    tree = tmp_path / "tree"
    tree.mkdir()
    given = tree / "given"
    given.write_text("x")
    os.chown(given, 1000, 1000)
    given.chmod(0o4700)  # setuid to a user, readable by them alone: still theirs to run
    make_private_tree(tree, owner=(0, 0))
    st = given.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)


def test_another_file_system_inside_the_tree_is_left_alone_and_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    tree = tmp_path / "tree"
    (tree / "m").mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "none", str(tree / "m")]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (tree / "m" / "f").write_text("x")
        (tree / "m" / "f").chmod(0o644)
        with pytest.raises(OSError):  # the caller removes the tree instead
            make_private_tree(tree)
        assert stat.S_IMODE((tree / "m" / "f").lstat().st_mode) == 0o644
    finally:
        subprocess.run(["umount", "-l", str(tree / "m")])
