"""Trees an agent nested deeper than Python's recursion limit, freed whole: a booth's scratch and
kept scratch (`scratchdir.remove_scratch`), a commit's trash (`shadowfs.trash.empty`), and a
booth discarded after its agent made one. `shutil.rmtree` and `os.walk` recurse (Python 3.11):
they raised RecursionError and left the tree behind."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.booth.conftest import NOBODY, run_py

# Builds, in argv[1], a commit trash and a booth's scratch and kept scratch holding trees
# argv[2] levels deep (what `mkdir d; cd d` in a loop makes), frees them, prints what is left.
# With fewer fds than levels: the removal must hold a bounded number open.
DEEP = r"""
import json, os, resource, sys
from pathlib import Path
work, depth = Path(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
victim = work / "victim"
victim.mkdir()
(victim / "f").write_text("host")

def nest(top, depth):
    os.makedirs(top, mode=0o700)
    fd = os.open(top, os.O_RDONLY)
    marks = []
    for i in range(depth):
        os.mkdir("d", dir_fd=fd)
        if i % 1000 == 0:  # a file, a symlink out of the tree, a dir it will make mode 0
            os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o4755, dir_fd=fd))
            os.symlink(victim, "out", dir_fd=fd)
            os.mkdir("shut", dir_fd=fd)
            marks.append(os.open("shut", os.O_RDONLY, dir_fd=fd))
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    marks.append(fd)  # the deepest: unwritable
    for mark in marks[:-1]:
        os.fchmod(mark, 0)
    os.fchmod(marks[-1], 0o500)
    for mark in marks:
        os.close(mark)
    os.chmod(top, 0)

trash = work / "commit-trash"
nest(trash / "replaced", depth)
tapes = work / "tapes"
state = tapes / ".jukebox"
nest(state / "scratch" / "b1" / "upper", depth)
os.makedirs(state / "scratch" / "b1" / "work" / "work")
os.chmod(state / "scratch" / "b1" / "work" / "work", 0)  # an overlay's, as nobody's
nest(state / "kept" / "b1", depth // 2)
for d in (tapes, state, state / "scratch", state / "kept"):
    os.chmod(d, 0o700)

from shadowfs.trash import empty
from jukebox.booth.scratchdir import remove_scratch
from jukebox.tape.tapedir import TapeDir

emptied = empty(trash)
remove_scratch(TapeDir(tapes), "b1")
print(json.dumps({
    "emptied": emptied,
    "left": sorted(str(p.relative_to(work)) for p in [trash, *state.rglob("*")] if p.exists()),
    "victim": (victim / "f").read_text(),
}))
"""


def _scratch_dir() -> Path:
    # A tmpfs where there is one: a mkdir on this VM's root disk is about 1 ms.
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")


@pytest.mark.parametrize("user", [None, NOBODY], ids=["root", "nobody"])
def test_trees_deeper_than_the_recursion_limit_are_freed_whole(
    request: pytest.FixtureRequest, tmp_path: Path, user: int | None
) -> None:
    python = None
    if user is not None:
        python = request.getfixturevalue("nobody_python")
    work = _scratch_dir() / f"jukebox-deep-{os.getpid()}-{tmp_path.name}"
    work.mkdir()
    try:
        if user is not None:
            os.chown(work, user, user)
        kw = {"python": python, "user": user} if python is not None else {}
        proc = run_py(DEEP, str(work), "5000", timeout=60, **kw)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.splitlines()[-1])
    finally:
        subprocess.run(["rm", "-rf", str(work)])  # shutil.rmtree recurses: not this deep
    assert out["emptied"] is True
    # Nothing of the trash, of scratch/b1 or of kept/b1 is left: only the dirs they were in.
    assert out["left"] == ["tapes/.jukebox/kept", "tapes/.jukebox/scratch"]
    assert out["victim"] == "host"  # the symlinks out were removed, never followed


# The agent nests 3,000 directories with dir fds (a shell's `cd` would outgrow PATH_MAX).
NEST = (
    "import os\n"
    "fd = os.open('.', os.O_RDONLY)\n"
    "for _ in range(3000):\n"
    "    os.mkdir('d', dir_fd=fd)\n"
    "    inner = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
    "    os.close(fd)\n"
    "    fd = inner\n"
)


def test_a_booth_whose_agent_nests_3000_directories_leaves_no_residue(
    tmp_path: Path, root_only: None, dev_fuse: None
) -> None:
    # Its overlay's upper dir holds them: the snapshot refuses a tree that deep (tree.MAX_DEPTH)
    # and the booth fails, but its scratch was left behind, and `booth discard` failed on it.
    from tests.booth.test_booth_run import jb, leftovers

    work = _scratch_dir() / f"jukebox-deep-booth-{os.getpid()}-{tmp_path.name}"
    tree, tapes = work / "tree", work / "tapes"
    tree.mkdir(parents=True)
    (tree / "a.txt").write_text("one\n")
    try:
        proc = jb(
            "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "t1",
            "--fs", "overlay", "--commit", "never", "--", "python3", "-c", NEST,
        )  # fmt: skip
        assert "deeper than" in proc.stderr, proc.stderr[-2000:]
        jb("booth", "discard", "t1", "--tape-dir", str(tapes))
        state = tapes / ".jukebox"
        left = leftovers(tapes) + [
            f"{sub}/{name}" for sub in ("mnt", "commit-trash") if (state / sub).is_dir()
            for name in os.listdir(state / sub)
        ]
        in_tree = sorted(os.listdir(tree))
    finally:
        subprocess.run(["rm", "-rf", str(work)])
    assert left == []
    assert in_tree == ["a.txt"]
