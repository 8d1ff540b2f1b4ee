"""The git checkpoint baseline: `git add -A && git commit -q` after a step changed 1, 10 or 100
small files, in a 1,000-file and (outside --quick) a 100,000-file repo.

This is what a checkpoint costs when an agent's tree is snapshotted with git; the checkpoint
benchmarks compare shadowfs snapshots against these rows (match on `files_changed` and
`repo_files`). Repos are generated once and cached (see `bench.fs_workloads.cached`); each run
works on a fresh copy, with the index refreshed before timing so no row pays for re-hashing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.fs_workloads import cached, git, git_env, make_git_repo
from bench.harness import summarize_us

GROUP = "git_baseline"
CHANGED = (1, 10, 100)


def _commit_us(repo: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter_ns()
    for args in (["add", "-A"], ["commit", "-q", "-m", "checkpoint"]):
        proc = subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(f"git {args[0]} failed in {repo}: {proc.stderr.decode()[-300:]}")
    return (time.perf_counter_ns() - t0) / 1000.0


def _change(repo: Path, paths: list[Path], k: int, round_: int) -> None:
    # A step of an agent: k files edited in place, each differently every round.
    for i in range(k):
        path = paths[(round_ * 7919 + i * 104729) % len(paths)]
        with open(path, "a") as f:
            f.write(f"# round {round_} edit {i}\n")


def bench_repo(n_files: int, reps: int) -> list[dict[str, Any]]:
    base = cached(f"git-repo-{n_files}", lambda tmp: make_git_repo(tmp / "repo", n_files))
    scratch = Path(tempfile.mkdtemp(prefix="jukebox-bench-git-"))
    try:
        repo = scratch / "repo"
        subprocess.run(["cp", "-a", str(base / "repo"), str(repo)], check=True)
        # A copy has new inodes and ctimes: refresh the index once so timing sees a clean tree.
        git(repo, "update-index", "-q", "--refresh")
        paths = sorted(p for p in repo.rglob("*.py"))
        env = git_env()
        rows = []
        round_ = 0
        for k in CHANGED:
            samples = []
            for _ in range(reps + 1):  # the first round warms the caches and is dropped
                round_ += 1
                _change(repo, paths, k, round_)
                samples.append(_commit_us(repo, env))
            row: dict[str, Any] = {
                "group": GROUP,
                "case": f"git add -A && git commit, {k} changed, {n_files:,}-file repo",
                "system": "git",
                **summarize_us(samples[1:]),
                "files_changed": k,
                "repo_files": n_files,
            }
            rows.append(row)
        return rows
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(quick: bool = False) -> list[dict[str, Any]]:
    rows = bench_repo(1_000, reps=5 if quick else 20)
    if not quick:
        t0 = time.perf_counter()
        rows += bench_repo(100_000, reps=5)
        print(f"bench: git_baseline 100k repo {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rows
