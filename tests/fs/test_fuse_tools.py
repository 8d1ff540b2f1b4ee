"""Real tools inside a shadowfs mount: git, sqlite, tar, sed -i, editor saves, cp -a, rm -rf.

After each tool the layer's snapshot is materialised and compared with what the mount shows, so
what a checkpoint records is exactly what the tools saw. The base stays untouched (fixture).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from shadowfs import tree
from shadowfs.layer import Layer
from shadowfs.store import Store
from tests.fs.conftest import needs_fuse, tree_state

pytestmark = [pytest.mark.fuse, needs_fuse]


def run(cmd: list[str], cwd: Path, **env: str) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    assert proc.returncode == 0, f"{cmd} failed: {proc.stderr}"
    return proc.stdout


def snapshot_matches_mount(mount: Path, layer: Layer, store: Store, out: Path) -> None:
    t, _ = layer.snapshot()
    tree.materialize(store, t, out)
    assert tree_state(out) == tree_state(mount)


@pytest.fixture
def git_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    return {
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }


def test_git_init_add_commit_status_checkout(
    mount: Path, layer: Layer, store: Store, tmp_path: Path, git_env: dict[str, str]
) -> None:
    git = ["git", "-c", "init.defaultBranch=main"]
    run([*git, "init", "-q"], mount, **git_env)
    run([*git, "add", "-A"], mount, **git_env)
    run([*git, "commit", "-qm", "first"], mount, **git_env)
    assert run([*git, "status", "--porcelain"], mount, **git_env) == ""
    (mount / "src" / "main.py").write_text("print('changed')\n")
    assert run([*git, "status", "--porcelain"], mount, **git_env) == " M src/main.py\n"
    run([*git, "checkout", "-qb", "feature"], mount, **git_env)
    run([*git, "commit", "-qam", "second"], mount, **git_env)
    run([*git, "checkout", "-q", "main"], mount, **git_env)
    assert (mount / "src" / "main.py").read_text() == "print('hello')\n"
    run([*git, "checkout", "-q", "feature"], mount, **git_env)
    assert (mount / "src" / "main.py").read_text() == "print('changed')\n"
    assert run([*git, "log", "--format=%s"], mount, **git_env).split() == ["second", "first"]
    run([*git, "fsck", "--strict", "--no-progress"], mount, **git_env)
    assert run([*git, "status", "--porcelain"], mount, **git_env) == ""
    snapshot_matches_mount(mount, layer, store, tmp_path / "out")


@pytest.mark.parametrize("journal_mode", ["DELETE", "WAL"])
def test_sqlite(mount: Path, layer: Layer, store: Store, tmp_path: Path, journal_mode: str) -> None:
    db = mount / "app.db"
    con = sqlite3.connect(db)
    assert con.execute(f"PRAGMA journal_mode={journal_mode}").fetchone()[0].upper() == journal_mode
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    for batch in range(10):
        with con:
            con.executemany(
                "INSERT INTO t (v) VALUES (?)", [(f"row {batch}-{i}" * 5,) for i in range(200)]
            )
    reader = sqlite3.connect(db)
    assert reader.execute("SELECT count(*) FROM t").fetchone()[0] == 2000
    con.execute("BEGIN")
    con.execute("DELETE FROM t")
    con.rollback()
    with con:
        con.execute("UPDATE t SET v = 'x' WHERE id % 2 = 0")
    assert reader.execute("SELECT count(*) FROM t WHERE v = 'x'").fetchone()[0] == 1000
    reader.close()
    con.close()
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert con.execute("SELECT count(*) FROM t").fetchone()[0] == 2000
    con.close()
    t, _ = layer.snapshot()
    out = tmp_path / "out"
    tree.materialize(store, t, out)
    copy = sqlite3.connect(out / "app.db")
    assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert copy.execute("SELECT count(*) FROM t WHERE v = 'x'").fetchone()[0] == 1000
    copy.close()


def test_tar_extract_and_create(
    mount: Path, base: Path, layer: Layer, store: Store, tmp_path: Path
) -> None:
    archive = tmp_path / "in.tar"
    # pax format: nanosecond mtimes (the default formats keep whole seconds).
    run(["tar", "--format=posix", "-cf", str(archive), "-C", str(base), "."], tmp_path)
    (mount / "x").mkdir()
    run(["tar", "-xpf", str(archive), "-C", str(mount / "x")], tmp_path)
    assert tree_state(mount / "x") == tree_state(base)
    out_archive = tmp_path / "out.tar"
    run(["tar", "--format=posix", "-cf", str(out_archive), "-C", str(mount / "x"), "."], tmp_path)
    listing = run(["tar", "-tvf", str(out_archive)], tmp_path)
    assert listing == run(["tar", "-tvf", str(archive)], tmp_path)
    snapshot_matches_mount(mount, layer, store, tmp_path / "out")


def test_sed_in_place(mount: Path) -> None:
    target = mount / "src" / "main.py"
    ino = os.stat(target).st_ino
    run(["sed", "-i", "s/hello/bye/", str(target)], mount)
    assert target.read_text() == "print('bye')\n"
    assert os.stat(target).st_ino != ino, "sed -i replaces the file by a rename"
    assert [n for n in os.listdir(mount / "src") if n.startswith("sed")] == []


def test_editor_write_temp_then_rename_save(mount: Path, layer: Layer, store: Store) -> None:
    target = mount / "README"
    swap = mount / ".README.swp"
    fd = os.open(swap, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
    os.write(fd, b"saved by the editor\n")
    os.fsync(fd)
    os.close(fd)
    os.chmod(swap, os.stat(target).st_mode & 0o7777)
    os.rename(swap, target)
    dfd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    assert target.read_text() == "saved by the editor\n" and not swap.exists()
    t, _ = layer.snapshot()
    assert store.read_bytes(tree.lookup(store, t, b"README").oid) == b"saved by the editor\n"
    assert tree.lookup(store, t, b".README.swp") is None


def test_cp_archive(mount: Path, base: Path, layer: Layer, store: Store, tmp_path: Path) -> None:
    run(["cp", "-a", f"{base}/.", str(mount / "copy")], tmp_path)
    assert tree_state(mount / "copy") == tree_state(base)
    run(["cp", "-a", str(mount / "copy"), str(tmp_path / "back")], tmp_path)
    assert tree_state(tmp_path / "back") == tree_state(base)
    snapshot_matches_mount(mount, layer, store, tmp_path / "out")


def test_rm_rf(mount: Path, layer: Layer, store: Store, tmp_path: Path) -> None:
    for i in range(30):
        (mount / "docs" / f"gen{i}").mkdir()
        (mount / "docs" / f"gen{i}" / "f").write_text(str(i))
    run(["rm", "-rf", str(mount / "docs"), str(mount / "src"), str(mount / "empty")], tmp_path)
    assert sorted(os.listdir(mount)) == sorted(
        n for n in os.listdir(mount) if n not in ("docs", "src", "empty")
    )
    assert not (mount / "docs").exists() and not (mount / "src").exists()
    snapshot_matches_mount(mount, layer, store, tmp_path / "out")
    run(["rm", "-rf", *[str(mount / n) for n in os.listdir(mount)]], tmp_path)
    assert os.listdir(mount) == []
    t, _ = layer.snapshot()
    assert tree.read_tree(store, t) == []


def test_python_tools_shutil_copytree_and_rmtree(mount: Path, base: Path) -> None:
    shutil.copytree(base, mount / "tree", symlinks=True)
    assert tree_state(mount / "tree") == tree_state(base)
    assert (mount / "tree" / "big.bin").read_bytes() == (base / "big.bin").read_bytes()
    shutil.rmtree(mount / "tree")
    assert not (mount / "tree").exists()


def make_wheel(dest: Path) -> Path:
    """A minimal pure-Python wheel, built by hand so the test needs no network or build tools."""
    whl = dest / "tinypkg-1.0-py3-none-any.whl"
    files = {
        "tinypkg/__init__.py": "VALUE = 42\n",
        "tinypkg/data.txt": "payload\n",
        "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        record = "".join(f"{n},,\n" for n in files) + "tinypkg-1.0.dist-info/RECORD,,\n"
        z.writestr("tinypkg-1.0.dist-info/RECORD", record)
    return whl


def test_pip_install_a_local_wheel(mount: Path, tmp_path: Path) -> None:
    whl = make_wheel(tmp_path)
    site = mount / "site"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(whl),
        ],
        tmp_path,
    )
    out = run(
        [sys.executable, "-c", "import tinypkg; print(tinypkg.VALUE)"],
        tmp_path,
        PYTHONPATH=str(site),
    )
    assert out.strip() == "42"
    assert (site / "tinypkg" / "data.txt").read_text() == "payload\n"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--upgrade",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(whl),
        ],
        tmp_path,
    )
    assert (site / "tinypkg" / "__init__.py").read_text() == "VALUE = 42\n"
