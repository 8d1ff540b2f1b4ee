"""The benchmark harness runs end to end and reports what it measured (behaviour, never timing)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench import harness

REPO = Path(__file__).resolve().parent.parent

# Selectable: `-m bench` runs only the benchmark harness's tests, `-m "not bench"` skips them.
pytestmark = pytest.mark.bench


def _bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str, dict]:
    out_md, out_json = tmp_path / "report.md", tmp_path / "rows.json"
    env = dict(os.environ, JUKEBOX_BENCH_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", *args, "--out", str(out_md), "--json",
         str(out_json)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, out_md.read_text(), json.loads(out_json.read_text())


@pytest.mark.serial  # a bench: a CPU hog, alone
def test_quick_git_baseline_reports_a_table_with_every_case(tmp_path: Path) -> None:
    proc, report, data = _bench(tmp_path, "--only", "git_baseline")

    assert "--only git_baseline" in report  # the exact command is recorded
    assert "quick pass" in report
    assert "## git_baseline" in report
    assert "## Goals" not in report  # a git baseline alone measures none of them
    assert "| case | system | p50 (µs) | p99 (µs)" in report
    for k in (1, 10, 100):
        assert f"git add -A && git commit, {k} changed, 1,000-file repo" in report
    rows = data["rows"]
    assert {(r["files_changed"], r["repo_files"]) for r in rows} == {
        (1, 1000),
        (10, 1000),
        (100, 1000),
    }
    assert all(r["p50_us"] > 0 and r["p99_us"] >= r["p50_us"] for r in rows)
    assert data["quick"] is True
    assert proc.stdout == report  # stdout carries the same report


@pytest.mark.serial  # a bench: a CPU hog, alone
def test_quick_fs_suite_runs_side_by_side_and_reports_missing_backends(tmp_path: Path) -> None:
    systems = ["native", "kernel-overlay"] if os.geteuid() == 0 else ["native"]
    _, report, data = _bench(
        tmp_path, "--only", "fs", "--fs-backends", ",".join([*systems, "shadowfs-fuse"]),
        "--fs-workloads", "untar,edit",
    )  # fmt: skip

    assert "| workload | " + " | ".join([*systems, "shadowfs-fuse"]) + " |" in report
    assert "| **geometric mean** |" in report
    rows = data["rows"]
    timed = {(r["workload"], r["system"]) for r in rows if "seconds" in r}
    expected = {(w, s) for w in ("untar", "edit") for s in systems}
    assert expected <= timed <= expected | {(w, "shadowfs-fuse") for w in ("untar", "edit")}
    native = [r for r in rows if r.get("system") == "native" and "seconds" in r]
    assert all(r["ratio_native"] == pytest.approx(1.0) for r in native)
    fuse = [r for r in rows if r["system"] == "shadowfs-fuse" and r.get("workload") != "geomean"]
    # shadowfs-fuse is timed, or (missing, broken) each of its rows says why not: never a crash.
    assert fuse and all("seconds" in r or r.get("note") for r in fuse)
    # Both places ran, each with its own section: the temp dir, and an XFS image with reflink
    # (which only root can make; otherwise its section says why it did not run).
    assert {r["fs"] for r in rows} == {"tmp", "xfs"}
    assert f"### On {tempfile.gettempdir()} (" in report
    assert "### On XFS with reflink (loop image)" in report
    xfs_native = {r["workload"] for r in rows if r["fs"] == "xfs" and r["system"] == "native"
                  and "seconds" in r}
    if os.geteuid() == 0:
        assert xfs_native == {"untar", "edit"}
    else:
        assert not xfs_native and "Not run: an XFS loop image needs root" in report


def test_write_docs_keeps_the_hand_written_intro(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nWritten by hand.\n\n{harness.MARKER}\n\nold table\n")

    harness.write_docs("# Results\n\nnew table\n", doc)
    harness.write_docs("# Results\n\nnewer table\n", doc)

    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nWritten by hand.\n")
    assert text.count(harness.MARKER) == 1
    assert "newer table" in text and "old table" not in text and "new table\n" not in text


def test_a_suite_that_fails_becomes_a_row_not_a_crash() -> None:
    result = harness.run_suite(harness.Suite("ghost", "bench.no_such_suite"), True, {})

    assert result.error is not None
    assert result.rows == [
        {"group": "ghost", "case": "(suite)", "system": "-", "note": result.error}
    ]
    assert "ModuleNotFoundError" in result.error


def test_percentiles_interpolate_between_ranks() -> None:
    assert harness.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert harness.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert harness.geomean([1.0, 4.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least one sample"):
        harness.percentile([], 50)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--only", "nosuch"], "unknown group(s) nosuch"),
        (["--only", "fs", "--fs-on", "zfs"], "unknown --fs-on value(s) zfs"),
        (["--only", "fs", "--fs-workloads", "nosuch"], "unknown fs workload(s) nosuch"),
        (["--only", "fs", "--fs-backends", "nosuch"], "unknown fs backend(s) nosuch"),
        (["--only", "loaded", "--loaded-workloads", "nosuch"], "unknown loaded workload(s) nosuch"),
        (["--only", "loaded", "--loaded-conditions", "idle"], "unknown loaded condition(s) idle"),
    ],
)
def test_bad_options_get_one_line_and_exit_2(args: list[str], named: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", *args],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("bench: " + named) and proc.stderr.count("\n") == 1
    assert proc.stdout == ""


@pytest.mark.serial  # a bench: a CPU hog, alone
def test_quick_booth_suite_reports_checkpoints_back_to_back_and_after_a_pause(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        pytest.skip("a booth needs /dev/fuse")
    _, report, data = _bench(tmp_path, "--only", "booth")

    rows = {r["case"]: r for r in data["rows"] if r["system"] == "jukebox booth (fuse)"}
    for k, files in ((1, "1 dirty file"), (10, "10 dirty files")):
        assert rows[f"checkpoint over the socket ({files})"]["n"] == 50
        paused = rows[f"checkpoint over the socket ({files}, 0.2 s after the step)"]
        assert paused["n"] == 5 and paused["p50_us"] > 0, k
    assert "| checkpoint over the socket (10 dirty files, 0.2 s after the step) |" in report


@pytest.mark.serial  # a bench: a CPU hog, alone
def test_quick_scale_suite_measures_every_case_side_by_side(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the scale group mounts overlays and runs booths as root")
    _, report, data = _bench(tmp_path, "--only", "scale")

    rows = data["rows"]
    assert not [r for r in rows if str(r.get("note", "")).startswith("failed")], rows
    timed = {(r["case"].split(" ")[0], r["system"]) for r in rows if "seconds" in r}
    for system in ("native", "kernel-overlay", "shadowfs-fuse", "shadowfs-overlay"):
        assert ("rewrite", system) in timed
    assert {("commit", "jukebox booth commit"), ("commit", "git add -A && git commit")} <= timed
    on_ext4 = {r["system"] for r in rows if r["case"].endswith("journaled ext4 image")}
    assert on_ext4 == {"jukebox booth commit", "git add -A && git commit"}, rows
    appends = {(r["fs"], r["system"]) for r in rows if r["case"].startswith("append")}
    assert {("tmp", "cp --reflink=auto"), ("tmp", "shadowfs-fuse"), ("xfs", "shadowfs-fuse")} <= (
        appends
    )
    first = {r["system"]: r for r in rows if r["case"].startswith("first booth")}
    assert first["jukebox booth run (cold)"]["store_mb"] > 0
    assert "jukebox booth run (warm)" in first
    assert first["jukebox booth run (warm)"]["ratio_stat_walk"] > 0  # the floor, same run
    gc = {r["case"]: r for r in rows if r["system"] == "jukebox gc"}
    assert all(r["removed"] > 0 for r in gc.values()), gc  # the removed tape's checkpoints
    assert set(gc) == {
        "jukebox gc, 500-file tree, 4 checkpoints of 1 edit, 2 of them garbage",
        "jukebox gc, 1,000-file tree, 4 checkpoints of 1 edit, 2 of them garbage",
    }
    assert "## scale" in report


@pytest.mark.skipif(os.geteuid() != 0, reason="the loaded group runs as root only")
def test_loaded_subset_runs_only_the_named_workloads_and_conditions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench import bench_loaded as loaded
    from bench import fs_workloads as fw

    seen: list[tuple[list[str], int]] = []

    def run_on(where: object, chosen: list[fw.Workload], *_: object) -> list[dict[str, object]]:
        seen.append(([w.id for w in chosen], len(os.sched_getaffinity(0))))
        return [{"case": w.id, "system": "x"} for w in chosen]

    monkeypatch.setattr(fw, "_run_on", run_on)
    monkeypatch.setattr(loaded, "cpu_hog", lambda n, apart=False: contextlib.nullcontext())
    rows = loaded.run(quick=True, workloads=["create", "grep"], conditions=["apart", "quiet"])

    assert [ids for ids, _ in seen] == [["create", "grep"], ["create", "grep"]]
    # In the group's own order, whatever order they were named in.
    assert [r["condition"] for r in rows] == [loaded.QUIET] * 2 + [loaded.APART] * 2


@pytest.mark.skipif(os.geteuid() != 0, reason="the bench's FUSE mounts run as root only")
@pytest.mark.serial  # a bench: a CPU hog, alone
def test_fuse_requests_counts_what_the_kernel_sends_for_each_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import fs_workloads as fw
    from bench import fuse_requests
    from shadowfs import fuse_wire as w

    monkeypatch.setattr(fw, "CACHE", tmp_path / "cache")
    (row,) = fuse_requests.count(["create"], quick=True)

    files = fw.Sizes.for_mode(True).create_files
    got = row["requests"]
    assert got[w.MKNOD] == files and got[w.WRITE] == files
    # Python's open() asks isatty of every file: the server answers ENOSYS, which the kernel
    # does not remember for IOCTL, so it asks again at every open.
    assert fuse_requests.NAMES[39] == "IOCTL" and got[39] == files
    # The kernel's look for privileges to drop before a write: FUSE never marks an inode as
    # having none, so each new file's write asks once.
    assert got[w.GETXATTR] == files
    assert any(thread.startswith("shadowfs-fuse") for thread in row["cpu_ms"])
