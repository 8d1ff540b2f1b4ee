"""Many booths over one tree at once: isolated while they run, serializable when they commit.

Eight booths start over the same tree, each writing a file of its own plus an edit that
overlaps with others' (the same file rewritten, the same file deleted, the same new file added).
A TCP barrier holds every agent until all eight are running, so every booth's base is the same
tree and every commit races every other. The outcome must be serializable: every booth either
committed whole or was refused with the conflicting path named; per overlapping group exactly
one wins; the final tree is the base plus exactly the winners' changes (no lost update, no
half commit); the one store all eight supervisors wrote verifies clean, and so does every tape.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shadowfs.store import Store
from tests.reliability.conftest import AGENT_PYTHON, JUKEBOX, booth_argv, jb

pytestmark = pytest.mark.usefixtures("booth_ready")

N = 8
# booth -> (group, what it does to the shared paths); every booth also writes own-<i>.txt.
GROUPS: dict[str, list[int]] = {
    "shared.txt": [0, 1, 2, 3],  # each rewrites it
    "gone.txt": [4, 5],  # both delete it
    "sub/new.txt": [6, 7],  # both create it, differently
}

AGENT = r"""
import json, os, socket, sys
cfg = json.loads(sys.argv[1])
for path, text in cfg["writes"].items():
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
for path in cfg["deletes"]:
    os.unlink(path)
s = socket.create_connection(("127.0.0.1", cfg["port"]), timeout=60)
f = s.makefile("rwb")
f.write(b"%d\n" % cfg["i"])
f.flush()
f.readline()  # every booth is running and has made its edits
f.write((json.dumps(sorted(n for n in os.listdir(".") if n.startswith("own-"))) + "\n").encode())
f.flush()
s.close()
"""


def edits(i: int) -> tuple[dict[str, str], list[str]]:
    writes = {f"own-{i}.txt": f"booth {i}\n"}
    deletes: list[str] = []
    if i in GROUPS["shared.txt"]:
        writes["shared.txt"] = f"rewritten by booth {i}\n"
    elif i in GROUPS["gone.txt"]:
        deletes.append("gone.txt")
    else:
        writes["sub/new.txt"] = f"added by booth {i}\n"
    return writes, deletes


def base_files() -> dict[str, str]:
    return {"shared.txt": "base\n", "gone.txt": "to be deleted\n", "keep.txt": "kept\n"}


def files_of(tree: Path) -> dict[str, str]:
    return {str(p.relative_to(tree)): p.read_text() for p in sorted(tree.rglob("*")) if p.is_file()}


def expected_after(winners: set[int]) -> dict[str, str]:
    files = base_files()
    for i in sorted(winners):
        writes, deletes = edits(i)
        files.update(writes)
        for path in deletes:
            files.pop(path)
    return files


@dataclass
class Barrier:
    """Holds N agents on a TCP port until all have connected, then collects what they saw."""

    n: int
    sock: socket.socket = field(default_factory=socket.socket)
    seen: dict[int, list[str]] = field(default_factory=dict)
    arrived: list[int] = field(default_factory=list)  # in order: a failure names who never came
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(self.n)
        self.sock.settimeout(60)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def _serve(self) -> None:
        try:
            conns = []
            for _ in range(self.n):
                conn, _ = self.sock.accept()
                f = conn.makefile("rwb")
                conns.append((int(f.readline()), conn, f))
                self.arrived.append(conns[-1][0])
            for _, _, f in conns:
                f.write(b"go\n")
                f.flush()
            for i, conn, f in conns:
                self.seen[i] = json.loads(f.readline())
                conn.close()
        except BaseException as error:  # reported by the test, not lost in the thread
            self.error = error
        finally:
            self.sock.close()


@pytest.fixture
def work(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    for name, text in base_files().items():
        (tree / name).write_text(text)
    yield tree, tapes


def start_booths(tree: Path, tapes: Path, port: int, *opts: str) -> list[subprocess.Popen[str]]:
    procs = []
    env = dict(os.environ, PATH=f"{Path(JUKEBOX).parent}:{os.environ.get('PATH', '')}")
    for i in range(N):
        writes, deletes = edits(i)
        cfg = {"i": i, "port": port, "writes": writes, "deletes": deletes}
        argv = [JUKEBOX, *booth_argv(tree, tapes, f"c{i}", *opts)]
        argv += [AGENT_PYTHON, "-I", "-c", AGENT, json.dumps(cfg)]
        procs.append(
            subprocess.Popen(
                argv,
                cwd=tree,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        out.append((p.returncode, err))
    return out


def check_serializable(tree: Path, results: list[tuple[int, str]]) -> set[int]:
    """Each booth committed whole or was refused naming its path; one winner per group; the
    tree is exactly the base plus the winners' changes."""
    winners = {i for i, (code, _) in enumerate(results) if code == 0}
    for i, (code, err) in enumerate(results):
        if code != 0:
            assert code == 1, (i, code, err)
            group = next(g for g, members in GROUPS.items() if i in members)
            # Named by the path, or by the new directory above it that now exists.
            assert "refused" in err and group.split("/")[0] in err, (i, err)
    for group, members in GROUPS.items():
        assert len(winners & set(members)) == 1, (group, sorted(winners), results)
    assert files_of(tree) == expected_after(winners)
    return winners


def check_store_and_tapes(tapes: Path) -> None:
    with Store.open(tapes / ".jukebox" / "store") as store:
        assert store.verify() == []
    for i in range(N):
        proc = jb("verify", str(tapes / f"c{i}.jbx"), "--tape-dir", str(tapes))
        assert proc.returncode == 0, (i, proc.stdout, proc.stderr)


def test_eight_booths_commit_at_once_serializably(work: tuple[Path, Path]) -> None:
    tree, tapes = work
    barrier = Barrier(N)
    results = finish(start_booths(tree, tapes, barrier.port, "--commit", "auto"))
    barrier.thread.join(10)
    assert barrier.error is None, (barrier.error, barrier.arrived, results)
    # Isolated while running: each agent saw its own file only, though all eight had written.
    assert barrier.seen == {i: [f"own-{i}.txt"] for i in range(N)}
    winners = check_serializable(tree, results)
    listed = json.loads(jb("booth", "ls", "--json", "--tape-dir", str(tapes)).stdout)
    # The refused stay pending as conflicts, with their work intact for a later look.
    assert sorted(b["id"] for b in listed) == sorted(f"c{i}" for i in range(N) if i not in winners)
    assert all(b["status"] == "conflict" for b in listed)
    check_store_and_tapes(tapes)


def test_eight_pending_booths_committed_by_eight_processes_at_once(
    work: tuple[Path, Path],
) -> None:
    tree, tapes = work
    barrier = Barrier(N)
    runs = finish(start_booths(tree, tapes, barrier.port, "--commit", "never"))
    assert all(code == 0 for code, _ in runs), runs
    assert files_of(tree) == base_files()  # nothing reached the tree yet
    env = dict(os.environ)
    procs = [
        subprocess.Popen(
            [JUKEBOX, "booth", "commit", f"c{i}", "--tape-dir", str(tapes)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(N)
    ]
    check_serializable(tree, finish(procs))
    check_store_and_tapes(tapes)


def test_one_pending_booth_committed_by_four_processes_applies_once(
    work: tuple[Path, Path],
) -> None:
    tree, tapes = work
    script = "echo more >> keep.txt; echo once > once.txt"
    run = jb(*booth_argv(tree, tapes, "one", "--commit", "never"), "sh", "-c", script)
    assert run.returncode == 0, run.stderr
    procs = [
        subprocess.Popen(
            [JUKEBOX, "booth", "commit", "one", "--tape-dir", str(tapes)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = sorted(finish(procs))
    assert [code for code, _ in results] == [0, 1, 1, 1], results
    for _, err in results[1:]:  # the others are told the booth was committed, and by whom
        assert "booth one was already committed (2 change(s))" in err, err
        assert "by `jukebox booth commit`" in err, err
    assert (tree / "keep.txt").read_text() == "kept\nmore\n"
    assert (tree / "once.txt").read_text() == "once\n"
