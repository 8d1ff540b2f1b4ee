"""One real pending booth whose commit can be tried again and again.

A booth run costs about half a second, so the commit tests record one (`jukebox booth run
--commit never`) and put the world back before each attempt: the tree's contents in place (its
directory keeps its inode, which the booth recorded), and the tape and booth record as the run
left them. The old and new states are hashed walks (`tree_state`) of the tree.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.reliability.conftest import JUKEBOX, booth_argv, jb, tree_state

# Files in several directories, a few big enough that staging takes a while, a mode change, a
# deletion of a whole directory and a new nested one: every kind of operation a commit journals.
SEED_SCRIPT = """
import os, sys
root, per_dir = sys.argv[1], int(sys.argv[2])
for d in range(6):
    os.makedirs(f"{root}/d{d}", exist_ok=True)
    for f in range(per_dir):
        with open(f"{root}/d{d}/f{f}.txt", "w") as out:
            out.write(f"old {d} {f}\\n" * 50)
os.makedirs(f"{root}/gone/deep", exist_ok=True)
open(f"{root}/gone/deep/x", "w").write("x")
with open(f"{root}/big.bin", "wb") as out:
    out.write(os.urandom(1 << 20))
open(f"{root}/exec.sh", "w").write("echo hi\\n")
"""
AGENT_SCRIPT = """
import os, sys
for d in range(6):
    for f in range(0, int(sys.argv[1]), 2):
        with open(f"d{d}/f{f}.txt", "a") as out:
            out.write("new line\\n")
    os.remove(f"d{d}/f1.txt")
import shutil
shutil.rmtree("gone")
os.makedirs("fresh/nested", exist_ok=True)
for i in range(20):
    open(f"fresh/nested/n{i}", "w").write(str(i) * 1000)
with open("big.bin", "r+b") as out:
    out.write(os.urandom(4096))
with open("big2.bin", "wb") as out:
    out.write(os.urandom(3 << 20))
os.chmod("exec.sh", 0o755)
"""


@dataclass
class PendingBooth:
    tree: Path
    tapes: Path
    booth_id: str
    pristine: Path  # the tree, tape and record as the run left them
    old: dict[str, object]
    new: dict[str, object]

    @classmethod
    def record(cls, work: Path, booth_id: str = "pb", per_dir: int = 30) -> PendingBooth:
        """A booth over a tree of 6 directories of ``per_dir`` files, half of them changed."""
        tree, tapes, pristine = work / "tree", work / "tapes", work / "pristine"
        tree.mkdir()
        subprocess.run(["/usr/bin/python3", "-c", SEED_SCRIPT, str(tree), str(per_dir)],
                       check=True)
        run = jb(*booth_argv(tree, tapes, booth_id, "--commit", "never"),
                 "/usr/bin/python3", "-c", AGENT_SCRIPT, str(per_dir), cwd=tree)
        assert run.returncode == 0, run.stderr
        pristine.mkdir()
        shutil.copytree(tree, pristine / "tree", symlinks=True)
        shutil.copy2(tapes / f"{booth_id}.jbx", pristine / "tape.jbx")
        shutil.copy2(tapes / ".jukebox" / "booths" / f"{booth_id}.json", pristine / "record.json")
        world = cls(tree, tapes, booth_id, pristine, tree_state(tree), {})
        done = world.commit()
        assert done.returncode == 0, done.stderr
        world.new = tree_state(tree)
        assert world.new != world.old
        world.reset()
        return world

    def reset(self) -> None:
        """The tree, tape and record exactly as the booth left them, the tree's inode kept."""
        for child in list(self.tree.iterdir()):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        for child in (self.pristine / "tree").iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.copytree(child, self.tree / child.name, symlinks=True)
            else:
                shutil.copy2(child, self.tree / child.name, follow_symlinks=False)
        shutil.copy2(self.pristine / "tape.jbx", self.tapes / f"{self.booth_id}.jbx")
        booths = self.tapes / ".jukebox" / "booths"
        booths.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.pristine / "record.json", booths / f"{self.booth_id}.json")
        (booths / f"{self.booth_id}.lock").unlink(missing_ok=True)
        shutil.rmtree(self.tapes / ".jukebox" / "commit-journals", ignore_errors=True)
        assert tree_state(self.tree) == self.old

    def commit(self, *opts: str, env: dict[str, str] | None = None,
               ) -> subprocess.CompletedProcess[str]:
        return jb("booth", "commit", self.booth_id, "--tape-dir", str(self.tapes), *opts, env=env)

    def start_commit(self, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        full = dict(os.environ, **(env or {}))
        return subprocess.Popen(
            [JUKEBOX, "booth", "commit", self.booth_id, "--tape-dir", str(self.tapes)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
        )

    def frames(self) -> list[dict]:
        proc = jb("log", str(self.tapes / f"{self.booth_id}.jbx"), "--json")
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        return data["frames"] if isinstance(data, dict) else data

    def pending(self) -> bool:
        return (self.tapes / ".jukebox" / "booths" / f"{self.booth_id}.json").exists()

    def journals(self) -> list[str]:
        root = self.tapes / ".jukebox" / "commit-journals"
        return sorted(os.listdir(root)) if root.is_dir() else []

    def state(self) -> str:
        """"old", "new", or "torn" for the tree now."""
        now = tree_state(self.tree)
        return "old" if now == self.old else "new" if now == self.new else "torn"


def wait_stopped(proc: subprocess.Popen[str], timeout: float = 60) -> None:
    """Until ``proc`` stops itself at SHADOWFS_PAUSE_AT (or fail if it exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid and os.WIFSTOPPED(status):
            return
        if pid:
            raise AssertionError(f"the commit exited before its pause (status {status})")
        time.sleep(0.02)
    raise AssertionError("the commit never reached its pause point")


def resume(proc: subprocess.Popen[str], *, signo: int | None = None) -> None:
    """Deliver ``signo`` (queued while stopped), then let it run on."""
    if signo is not None:
        os.kill(proc.pid, signo)
    os.kill(proc.pid, signal.SIGCONT)
