"""`jukebox rm`, `prune` and `du`, run as a user runs them: the real console script."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.booth.conftest import (  # noqa: F401 (fixtures)
    dev_fuse,
    nobody_dir,
    nobody_python,
    open_dev_fuse,
    root_only,
)
from tests.booth.test_booth_run import booth_run
from tests.test_cli_read import one_line_error, record_run


@pytest.fixture
def tapes(tmp_path: Path) -> Path:
    record_run(tmp_path / "tapes", tmp_path / "work-a", tape_id="alpha")
    record_run(tmp_path / "tapes", tmp_path / "work-b", tape_id="beta")
    return tmp_path / "tapes"


def listed(jukebox_cli) -> list[str]:
    return [r["track_id"] for r in json.loads(jukebox_cli("ls", "--json", check=True).stdout)]


def test_rm_deletes_by_id_and_by_path_and_says_what_gc_frees(tapes: Path, jukebox_cli) -> None:
    dry = json.loads(
        jukebox_cli("rm", "alpha", "--dry-run", "--grace", "0", "--json", check=True).stdout
    )
    assert dry["dry_run"] and [t["track_id"] for t in dry["removed"]] == ["alpha"]
    assert dry["gc"]["bytes_freed"] > 0 and not dry["gc"]["ran"]  # alpha's own files
    assert listed(jukebox_cli) == ["alpha", "beta"]

    out = jukebox_cli("rm", "alpha", "--grace", "0", check=True).stdout
    assert out.splitlines()[0].startswith("removed alpha (")
    assert f"`jukebox gc` would then free {dry['gc']['bytes_freed']} B" in out
    assert listed(jukebox_cli) == ["beta"]
    assert sorted(os.listdir(tapes)) == [".jukebox", "beta.jbx"]  # no trash left behind

    done = json.loads(
        jukebox_cli(
            "rm", str(tapes / "beta.jbx"), "--gc", "--grace", "0", "--json", check=True
        ).stdout
    )
    assert done["gc"]["ran"] and done["gc"]["objects"] > 0
    assert listed(jukebox_cli) == []
    after = json.loads(jukebox_cli("gc", "--grace", "0", "--dry-run", "--json", check=True).stdout)
    assert after["removed"] == 0  # --gc collected everything


def test_rm_refuses_bad_names_and_removes_nothing(tapes: Path, tmp_path: Path, jukebox_cli) -> None:
    outside = record_run(tmp_path / "elsewhere", tmp_path / "work-c", tape_id="alpha")
    error = one_line_error(jukebox_cli("rm", "beta", str(outside)), 2)
    assert "is not in the tape dir" in error
    assert "no tape 'gamma'" in one_line_error(jukebox_cli("rm", "beta", "gamma"), 2)
    assert "bad tape id" in one_line_error(jukebox_cli("rm", "--", "-x"), 2)
    assert outside.exists() and listed(jukebox_cli) == ["alpha", "beta"]


def test_rm_and_prune_of_a_symlinked_tape_never_touch_its_target(
    tapes: Path, tmp_path: Path, jukebox_cli
) -> None:
    victim = record_run(tmp_path / "victim", tmp_path / "work-v", tape_id="precious")
    victim_bytes = victim.read_bytes()
    (tapes / "evil.jbx").symlink_to(victim)
    (tapes / "evil2.jbx").symlink_to(victim)
    (tapes / "sub").symlink_to(victim.parent)  # a path through a link to another dir
    assert "is not in the tape dir" in one_line_error(
        jukebox_cli("rm", str(tapes / "sub" / "precious.jbx")), 2
    )
    out = json.loads(jukebox_cli("rm", "evil", "--json", check=True).stdout)
    assert out["removed"] == [{"track_id": "evil", "bytes": 0, "symlink": True}]
    assert not os.path.lexists(tapes / "evil.jbx")
    pruned = json.loads(jukebox_cli("prune", "--older-than", "0s", "--json", check=True).stdout)
    assert sorted(t["track_id"] for t in pruned["removed"]) == ["alpha", "beta", "evil2"]
    assert not os.path.lexists(tapes / "evil2.jbx")
    assert victim.read_bytes() == victim_bytes and victim.parent.is_dir()


def test_prune_by_age_and_status(tapes: Path, tmp_path: Path, jukebox_cli) -> None:
    assert "bad duration '7days'" in one_line_error(
        jukebox_cli("prune", "--older-than", "7days"), 2
    )
    assert one_line_error(jukebox_cli("prune", "--older-than", "1d", "--status", "nope"), 2)
    young = json.loads(jukebox_cli("prune", "--older-than", "2w", "--json", check=True).stdout)
    assert young["removed"] == [] and listed(jukebox_cli) == ["alpha", "beta"]
    # record_run ends its tapes with a commit: none of them is discarded.
    none = json.loads(
        jukebox_cli(
            "prune", "--older-than", "0s", "--status", "discarded", "--json", check=True
        ).stdout
    )
    assert none["removed"] == []
    out = jukebox_cli(
        "prune", "--older-than", "0s", "--status", "committed", "--dry-run", check=True
    )
    assert out.stdout.splitlines()[:2] == [
        "would remove alpha (1.6 KiB)",
        "would remove beta (1.6 KiB)",
    ]
    assert listed(jukebox_cli) == ["alpha", "beta"]
    jukebox_cli("prune", "--older-than", "0m", "--status", "COMMITTED", check=True)
    assert listed(jukebox_cli) == []


def test_a_removal_killed_between_its_steps_leaves_no_tape_and_is_swept(
    tapes: Path, jukebox_cli
) -> None:
    # What a kill after the rename leaves: the tape under its trash name.
    os.rename(tapes / "alpha.jbx", tapes / ".alpha.jbx.removing-0badf00d")
    assert listed(jukebox_cli) == ["beta"]
    assert "UNREADABLE" not in jukebox_cli("ls", check=True).stdout
    jukebox_cli("rm", "beta", check=True)
    assert sorted(os.listdir(tapes)) == [".jukebox"]


def test_du_says_what_holds_space(tapes: Path, jukebox_cli) -> None:
    usage = json.loads(jukebox_cli("du", "--json", check=True).stdout)
    on_disk = sum(os.stat(tapes / f"{t}.jbx").st_blocks * 512 for t in ("alpha", "beta"))
    assert usage["tapes"] == {"count": 2, "bytes": on_disk}
    assert usage["store"]["packs"] >= 1 and usage["store"]["pack_bytes"] > 0
    assert usage["total"]["bytes"] >= on_disk + usage["store"]["bytes"]
    table = jukebox_cli("du", check=True).stdout.splitlines()
    assert table[1].split() == ["WHAT", "HOLDS", "ON", "DISK"]
    assert table[2].split()[:3] == ["tapes", "2", "tape(s)"]
    assert "does not exist" in one_line_error(jukebox_cli("du", "--tape-dir", str(tapes / "no")), 2)


@pytest.mark.usefixtures("root_only", "dev_fuse")
def test_rm_refuses_a_pending_booths_tape(tmp_path: Path, jukebox_cli) -> None:
    tree, tape_dir = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    assert booth_run(tree, tape_dir, "echo two >> a.txt", "--commit", "never").returncode == 0
    usage = json.loads(jukebox_cli("du", "--json", check=True).stdout)
    assert usage["tapes"]["count"] == 1
    error = one_line_error(jukebox_cli("rm", "t1"), 2)
    assert "booth t1 is pending" in error and "`jukebox booth discard t1`" in error
    pruned = json.loads(jukebox_cli("prune", "--older-than", "0s", "--json", check=True).stdout)
    assert pruned["removed"] == [] and [k["track_id"] for k in pruned["kept"]] == ["t1"]
    assert (tape_dir / "t1.jbx").exists()
    jukebox_cli("booth", "discard", "t1", check=True)
    jukebox_cli("rm", "t1", check=True)
    assert not (tape_dir / "t1.jbx").exists()


def test_as_nobody_rm_and_prune_of_a_symlinked_tape_never_touch_its_target(
    nobody_python: str,  # noqa: F811
    nobody_dir: Path,  # noqa: F811
) -> None:
    from tests.booth.conftest import NOBODY
    from tests.booth.test_booth_run import jb

    tapes = nobody_dir / "tapes"
    record_run(tapes, nobody_dir / "work", tape_id="alpha")
    # The target is nobody's own: a removal that followed the link could delete it.
    victim = record_run(nobody_dir / "victim", nobody_dir / "work-v", tape_id="precious")
    (tapes / "evil.jbx").symlink_to(victim)
    (tapes / "evil2.jbx").symlink_to(victim)
    for path in [nobody_dir, *nobody_dir.rglob("*")]:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    as_nobody = {"python": nobody_python, "user": NOBODY}
    removed = jb("rm", "evil", "--tape-dir", str(tapes), "--json", **as_nobody)
    assert removed.returncode == 0, removed.stderr
    pruned = jb("prune", "--older-than", "0s", "--tape-dir", str(tapes), "--json", **as_nobody)
    assert pruned.returncode == 0, pruned.stderr
    assert sorted(t["track_id"] for t in json.loads(pruned.stdout)["removed"]) == ["alpha", "evil2"]
    assert sorted(os.listdir(tapes)) == [".jukebox"] and victim.is_file()


@pytest.mark.usefixtures("root_only", "dev_fuse")
def test_rm_refuses_a_running_booths_tape(tmp_path: Path, jukebox_cli) -> None:
    import subprocess
    import time

    from tests.booth.test_booth_run import JUKEBOX

    tree, tape_dir = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    run = subprocess.Popen(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tape_dir),
         "--tape-id", "t1", "--commit", "never", "--", "sh", "-c", "read go"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        record = tape_dir / ".jukebox" / "booths" / "t1.json"
        for _ in range(1200):  # waiting for a state, not timing it: the agent waits on stdin
            if record.exists() or run.poll() is not None:
                break
            time.sleep(0.05)
        error = one_line_error(jukebox_cli("rm", "t1"), 2)
        assert "booth t1 is still running (pid " in error and "`jukebox booth commit t1`" in error
        assert (tape_dir / "t1.jbx").exists()
        run.communicate("go\n", timeout=60)
        assert run.returncode == 0
    finally:
        if run.poll() is None:  # a failed test must not leave a booth (or its mount) behind
            run.kill()
            run.wait()
