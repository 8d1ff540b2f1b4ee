"""shadowfs.fdwalk.FdWalk, the walk under removal, privacy and the set-id strip: an agent racing
it (a directory swapped for a symlink out of the tree, a directory moved out from under it)
never leads it out of the tree. Its depth: tests/booth/test_deep_walks.py and
tests/booth/test_deep_removal.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.fs.conftest import NOBODY, run_attack

# Walks two trees in argv[1] while racing the walk from its hooks, as an agent would from
# outside; prints what the walk saw and how it ended.
RACE = r"""
import errno, json, os, sys
sys.path.insert(0, sys.argv[2])
from shadowfs.fdwalk import OPEN_DIRS, FdWalk
work = sys.argv[1]
outside = os.path.join(work, "outside")
os.makedirs(os.path.join(outside, "secret"))
open(os.path.join(outside, "secret", "f"), "w").close()

class Seen(FdWalk):
    def __init__(self, race):
        super().__init__()
        self.race, self.seen, self.left = race, [], []

    def enter(self, name, parent_fd):
        self.seen.append("/".join([*self.names(), name]))
        try:
            return super().enter(name, parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink now: never entered
                return None
            raise

    def file(self, dir_fd, entry):
        self.seen.append("/".join([*self.names(), entry.name]))
        self.race(entry.name)

    def leave(self, name, parent_fd):
        self.left.append(name)

def walk(tree, race):
    walker = Seen(race)
    top = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        walker.walk(top)
        ended = "whole"
    except OSError as exc:
        ended = errno.errorcode[exc.errno]
    finally:
        os.close(top)
    return {"seen": walker.seen, "left": walker.left, "ended": ended}

# 1. Between the listing of a/ and the entering of a/sub, sub becomes a symlink to outside.
swap = os.path.join(work, "swap")
os.makedirs(os.path.join(swap, "a", "sub"))
open(os.path.join(swap, "a", "x"), "w").close()
def swap_race(name):
    if name == "x":
        os.rename(os.path.join(swap, "a", "sub"), os.path.join(work, "sub-away"))
        os.symlink(outside, os.path.join(swap, "a", "sub"))

# 2. Deeper than the fds the walk keeps: at the bottom, the second level moves outside; the
# way up must not go on through outside's `..`.
deep = os.path.join(work, "deep")
levels = OPEN_DIRS + 10
os.makedirs(os.path.join(deep, *["d"] * levels))
open(os.path.join(deep, *["d"] * levels, "bottom"), "w").close()
def move_race(name):
    if name == "bottom":
        os.rename(os.path.join(deep, "d", "d"), os.path.join(outside, "moved"))

print(json.dumps({"swap": walk(swap, swap_race), "deep": walk(deep, move_race),
                  "levels": levels}))
"""


@pytest.mark.parametrize("user", [None, NOBODY], ids=["root", "nobody"])
def test_a_walk_raced_by_the_agent_never_leaves_the_tree(tmp_path: Path, user: int | None) -> None:
    # Where nobody can reach it (pytest's tmp_path is root's alone).
    work = Path("/tmp") / f"jukebox-fdwalk-{os.getpid()}-{tmp_path.name}"
    work.mkdir()
    try:
        out: dict[str, Any] = run_attack(RACE, work, user)
    finally:
        shutil.rmtree(work)
    # The symlink swapped in for a/sub was not entered: nothing of outside was seen.
    swap = out["swap"]
    assert swap["ended"] == "whole" and swap["seen"] == ["a", "a/x", "a/sub"]
    assert swap["left"] == ["a"]
    # The walk went down to the bottom, back up to the moved directory, and stopped there
    # (ESTALE): outside's `..` was not taken for the tree's first level.
    deep = out["deep"]
    levels = out["levels"]
    assert deep["ended"] == "ESTALE"
    assert deep["seen"][-1] == "/".join(["d"] * levels + ["bottom"])
    assert not [name for name in deep["seen"] if "secret" in name]
    assert deep["left"] == ["d"] * (levels - 2)  # every level below the moved one, no more
