"""Trees an agent nested deeper than the process's limit of open files, walked whole: a pending
booth's scratch made private for good (`scratchdir.keep_scratch`, through
`shadowfs.privacy.make_private_tree`) and the set-id strip of a `--rw` path
(`jukebox.booth.paths.strip_set_id`). Both held one directory fd per level: a few hundred levels
down they ran out (EMFILE), so the kept scratch was removed instead of kept, and the strip
stopped with set-id files left below (their removal: tests/booth/test_deep_removal.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.booth.conftest import NOBODY, run_py
from tests.booth.test_deep_removal import _scratch_dir

# Builds, in argv[1], a booth's scratch and a --rw directory argv[2] levels deep under a limit
# of 256 open files, with the agent's leavings every 1,000 levels and at the bottom; keeps the
# scratch and strips the --rw directory; prints what a walk of each finds afterwards.
DEEP = r"""
import json, os, resource, stat, sys, time
from pathlib import Path
work, depth = Path(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
root = os.geteuid() == 0
victim = work / "victim"
victim.write_text("host")
os.chmod(victim, 0o4755)  # outside both trees: linked and symlinked to, never changed
since = time.time_ns() - 1_000_000_000

def leave(fd, kept):
    for name, mode in (("sid", 0o4755), ("sgid", 0o2755), ("world", 0o666)):
        os.close(os.open(name, os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
        os.chmod(name, mode, dir_fd=fd)
    if root:  # given away: a kept scratch takes it back
        os.chown("world", 1000, 1000, dir_fd=fd)
    os.symlink(victim, "out", dir_fd=fd)
    if kept:  # another name of the host's file (a strip would take its bits: not here)
        os.link(victim, "hard", dst_dir_fd=fd)
    os.mkdir("shut", 0, dir_fd=fd)

def nest(top, kept):
    os.makedirs(top)
    fd = os.open(top, os.O_RDONLY)
    for i in range(depth):
        if i % 1000 == 0:
            leave(fd, kept)
        os.mkdir("d", 0o777, dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    leave(fd, kept)
    os.close(fd)

def survey(top):
    # Down the chain one fd at a time (the tree is deeper than the fds): what is left loose.
    out = {"levels": 0, "loose": [], "set_id": 0, "uids": set(), "names": set()}
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    while True:
        inner = None
        for name in os.listdir(fd):
            st = os.lstat(name, dir_fd=fd)
            out["names"].add(name)
            if stat.S_ISLNK(st.st_mode):
                continue
            out["uids"].add(st.st_uid)
            mode = stat.S_IMODE(st.st_mode)
            out["set_id"] += bool(mode & 0o6000)
            is_dir = stat.S_ISDIR(st.st_mode)
            if mode & ~(0o700 if is_dir else 0o600) or (is_dir and mode != 0o700):
                out["loose"].append([out["levels"], name, oct(mode)])
            if name == "d":
                inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        os.close(fd)
        if inner is None:
            break
        fd, out["levels"] = inner, out["levels"] + 1
    out["loose"] = out["loose"][:5]
    out["uids"], out["names"] = sorted(out["uids"]), sorted(out["names"])
    return out

tapes = work / "tapes"
state = tapes / ".jukebox"
nest(state / "scratch" / "b1", kept=True)
for d in (tapes, state, state / "scratch"):
    os.chmod(d, 0o700)
rw = work / "venv"
nest(rw, kept=False)

from jukebox.booth.paths import strip_set_id
from jukebox.booth.scratchdir import keep_scratch
from jukebox.tape.tapedir import TapeDir

state_fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY)
kept = keep_scratch(TapeDir(tapes), "b1", state_fd)
stripped, stopped = strip_set_id([str(rw)], since)
print(json.dumps({
    "kept": kept,
    "kept_tree": survey(state / "kept" / "b1") if kept else None,
    "stripped": len(stripped), "deepest": max(map(len, stripped), default=0),
    "stopped": stopped,
    "rw_tree": survey(rw),
    "victim": oct(victim.stat().st_mode), "victim_links": victim.stat().st_nlink,
}))
"""


@pytest.mark.parametrize("user", [None, NOBODY], ids=["root", "nobody"])
def test_trees_deeper_than_the_fd_limit_are_made_private_and_stripped_whole(
    request: pytest.FixtureRequest, tmp_path: Path, user: int | None
) -> None:
    depth = 3000
    python = sys.executable if user is None else request.getfixturevalue("nobody_python")
    work = _scratch_dir() / f"jukebox-deep-walks-{os.getpid()}-{tmp_path.name}"
    work.mkdir()
    try:
        if user is not None:
            os.chown(work, user, user)
        proc = run_py(DEEP, str(work), str(depth), python=python, user=user, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.splitlines()[-1])
    finally:
        subprocess.run(["rm", "-rf", str(work)])  # shutil.rmtree recurses: not this deep
    uid = os.geteuid() if user is None else user
    # The scratch was kept (not removed for want of fds), private all the way down: every dir
    # 0700, every file at most 0600, the given-away file taken back, the host's file unlinked.
    assert out["kept"] is True
    kept = out["kept_tree"]
    assert kept["levels"] == depth and kept["loose"] == [] and kept["set_id"] == 0
    assert kept["uids"] == [uid]
    assert kept["names"] == ["d", "out", "sgid", "shut", "sid", "world"]
    # Every set-id file of the --rw directory lost its bits, the deepest 3,000 levels down
    # (2 a level, at 0, 1,000, 2,000 and the bottom), and the walk went to its end.
    assert out["stopped"] is False
    assert out["stripped"] == 8 and out["rw_tree"]["set_id"] == 0
    assert out["rw_tree"]["levels"] == depth and out["deepest"] > 2 * depth
    # The host's file, linked and symlinked into the trees, kept its mode and lost a name.
    assert out["victim"] == oct(0o104755) and out["victim_links"] == 1
