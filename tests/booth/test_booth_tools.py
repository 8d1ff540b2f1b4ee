"""Real tools as booth agents, end to end: `jukebox booth run` of a shell script, a Python script,
git and sqlite (WAL), committed to the real tree and then used there; rollbacks from inside while
the agent runs leave the tools' on-disk formats consistent."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

JUKEBOX = str(Path(sys.executable).parent / "jukebox")
PYTHON = "/usr/bin/python3"  # the agents' interpreter: plain, with the stdlib's sqlite3
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_AUTHOR_NAME": "agent",
    "GIT_AUTHOR_EMAIL": "agent@example.com",
    "GIT_COMMITTER_NAME": "agent",
    "GIT_COMMITTER_EMAIL": "agent@example.com",
}


@pytest.fixture
def work(tmp_path: Path) -> tuple[Path, Path]:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "README").write_text("a project\n")
    return tree, tapes


def booth(
    tree: Path, tapes: Path, tape_id: str, *cmd: str, opts: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PATH=f"{Path(JUKEBOX).parent}:{os.environ.get('PATH', '')}", **GIT_ENV)
    argv = [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes)]
    argv += ["--tape-id", tape_id, *opts, "--", *cmd]
    return subprocess.run(argv, capture_output=True, text=True, cwd=tree, env=env, timeout=60)


def git(tree: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", *args], cwd=tree, capture_output=True, text=True, env={**os.environ, **GIT_ENV}
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def kinds(tapes: Path, tape_id: str) -> list[str]:
    proc = subprocess.run(
        [JUKEBOX, "log", str(tapes / f"{tape_id}.jbx"), "--json"], capture_output=True, text=True
    )
    data = json.loads(proc.stdout)
    return [f["kind"] for f in (data["frames"] if isinstance(data, dict) else data)]


def test_shell_script(work: tuple[Path, Path]) -> None:
    tree, tapes = work
    (tree / "tool.sh").write_text(
        "set -e\n"
        "sed -i 's/a project/an edited project/' README\n"
        "mkdir -p src/lib && printf 'x = 1\\n' > src/lib/mod.py\n"
        "cp README src/README.copy && mv src/README.copy src/README\n"
        "ln -s lib/mod.py src/link.py\n"
    )
    proc = booth(tree, tapes, "sh1", "sh", "tool.sh")
    assert proc.returncode == 0, proc.stderr
    assert (tree / "README").read_text() == "an edited project\n"
    assert (tree / "src" / "README").read_text() == "an edited project\n"
    assert os.readlink(tree / "src" / "link.py") == "lib/mod.py"
    assert (tree / "src" / "link.py").read_text() == "x = 1\n"
    assert kinds(tapes, "sh1")[-1] == "commit"


def test_python_script_status_decides_the_verdict(work: tuple[Path, Path]) -> None:
    tree, tapes = work
    script = (
        "import json, sys\n"
        "data = {'items': list(range(5))}\n"
        "open('data.json', 'w').write(json.dumps(data))\n"
        "open('README', 'a').write('touched\\n')\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    failed = booth(tree, tapes, "py1", PYTHON, "-c", script, "3")
    assert failed.returncode == 3
    assert not (tree / "data.json").exists() and (tree / "README").read_text() == "a project\n"
    passed = booth(tree, tapes, "py2", PYTHON, "-c", script, "0")
    assert passed.returncode == 0, passed.stderr
    assert json.loads((tree / "data.json").read_text()) == {"items": [0, 1, 2, 3, 4]}
    assert (tree / "README").read_text() == "a project\ntouched\n"


def test_git_repository_made_in_a_booth_works_in_the_real_tree(work: tuple[Path, Path]) -> None:
    tree, tapes = work
    script = (
        "set -e; git -c init.defaultBranch=main init -q; git add -A; git commit -qm first; "
        "echo change >> README; git commit -qam second; git gc -q; git log --oneline"
    )
    proc = booth(tree, tapes, "git1", "sh", "-c", script)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2  # git log ran inside, over the layer
    log = git(tree, "log", "--format=%s")
    assert log.split() == ["second", "first"]
    git(tree, "fsck", "--strict", "--no-progress")
    assert git(tree, "status", "--porcelain") == ""


def test_git_rollback_from_inside_while_running(work: tuple[Path, Path]) -> None:
    tree, tapes = work
    script = (
        "set -e; git -c init.defaultBranch=main init -q; git add -A; git commit -qm good; "
        "jukebox booth checkpoint --label good >/dev/null; "
        "echo broken > README; rm -f .git/index; git add -A; git commit -qm bad; "
        "jukebox booth rollback --to good >/dev/null; "
        "git fsck --no-progress; git log --format=%s; cat README"
    )
    proc = booth(tree, tapes, "git2", "sh", "-c", script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["good", "a", "project"]  # the agent saw the rollback live
    assert git(tree, "log", "--format=%s").split() == ["good"]
    git(tree, "fsck", "--strict", "--no-progress")
    assert (tree / "README").read_text() == "a project\n"
    assert "rollback" in kinds(tapes, "git2")


SQLITE_AGENT = r"""
import os, sqlite3, sys
con = sqlite3.connect("app.db")
assert con.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
con.executemany("INSERT INTO t (v) VALUES (?)", [(f"row {i}",) for i in range(200)])
con.commit()
con.execute("UPDATE t SET v = 'updated' WHERE id <= 10")
con.commit()
if sys.argv[1] == "crash":
    os._exit(0)  # no close, no checkpoint: the rows live in app.db-wal only
con.close()
"""


@pytest.mark.parametrize("ending", ["close", "crash"])
def test_sqlite_wal_database_committed_and_opened_outside(
    work: tuple[Path, Path], ending: str
) -> None:
    tree, tapes = work
    proc = booth(tree, tapes, f"db-{ending}", PYTHON, "-c", SQLITE_AGENT, ending)
    assert proc.returncode == 0, proc.stderr
    if ending == "crash":
        assert (tree / "app.db-wal").stat().st_size > 0  # committed as the agent left it
    con = sqlite3.connect(tree / "app.db")
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert con.execute("SELECT count(*) FROM t").fetchone()[0] == 200
        assert con.execute("SELECT count(*) FROM t WHERE v = 'updated'").fetchone()[0] == 10
    finally:
        con.close()


def test_sqlite_rollback_from_inside_while_running(work: tuple[Path, Path]) -> None:
    tree, tapes = work
    script = (
        "import sqlite3, subprocess\n"
        "def db():\n"
        "    con = sqlite3.connect('app.db')\n"
        "    con.execute('PRAGMA journal_mode=WAL')\n"
        "    return con\n"
        "con = db()\n"
        "con.execute('CREATE TABLE t (v)')\n"
        "con.executemany('INSERT INTO t VALUES (?)', [(i,) for i in range(50)])\n"
        "con.commit(); con.close()\n"
        "subprocess.run(['jukebox', 'booth', 'checkpoint', '--label', 'fifty'], check=True,\n"
        "               stdout=subprocess.DEVNULL)\n"
        "con = db(); con.execute('DELETE FROM t'); con.commit(); con.close()\n"
        "subprocess.run(['jukebox', 'booth', 'rollback', '--to', 'fifty'], check=True,\n"
        "               stdout=subprocess.DEVNULL)\n"
        "con = db()\n"
        "print(con.execute('SELECT count(*) FROM t').fetchone()[0])\n"
        "con.execute('INSERT INTO t VALUES (50)'); con.commit(); con.close()\n"
    )
    proc = booth(tree, tapes, "db-rb", PYTHON, "-c", script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["50"]
    con = sqlite3.connect(tree / "app.db")
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert con.execute("SELECT count(*), max(v) FROM t").fetchone() == (51, 50)
    finally:
        con.close()
