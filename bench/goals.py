"""The shadow booth's speed and memory goals, judged from one run's rows.

`python -m bench` puts this table at the top of its report, so a reader sees where every goal
stands before the tables that back it. `python -m bench.goals ROWS.json` judges a run saved
with `python -m bench --json ROWS.json` again (`--json` for a machine-readable verdict); it exits
1 when a measured goal is missed, 2 when the file cannot be read.

A goal a run did not measure (its suite not chosen, or failed) is "not measured", never met.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import backends as bk
from bench import bench_booth as booth_bench
from bench import bench_checkpoint_fuse as ckpt_bench
from bench import bench_isolation as iso_bench
from bench import bench_loaded as loaded_bench
from bench import bench_mcp as mcp_bench
from bench import bench_proxy as proxy_bench
from bench import bench_startup as startup_bench
from bench import fs_workloads, scratch_fs

Row = dict[str, Any]
TIMES = "\u00d7"

TREES = (1_000, 100_000)
CHECKPOINT_LIMIT_US = 1000.0
GIT_FACTOR = 50.0
ROLLBACK_LIMIT_US = 200.0
BIG_FILE_LIMIT_MIB = 64.0
ISOLATION_LIMIT_MS = 50.0
PROXY_LIMIT_US = 1000.0
MCP_LIMIT_US = 1000.0
# Issue 33: where a user waits.
PAUSED_CHECKPOINT_LIMIT_US = 300.0
LOADED_LIMIT = 1.0
# (system, ratio key, limit, what the issue asks)
FS_GOALS = (
    (bk.SHADOWFS_FUSE, "ratio_fuse_overlayfs", 1.0, "no slower than fuse-overlayfs"),
    (bk.SHADOWFS_OVERLAY, "ratio_native", 1.3, "within 1.3\u00d7 of native"),
)


@dataclass(frozen=True)
class Verdict:
    goal: str
    measured: str
    met: bool | None  # None: not measured in this run

    @property
    def word(self) -> str:
        return {True: "met", False: "**not met**", None: "not measured"}[self.met]


def _find(rows: Iterable[Row], **want: Any) -> Row | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in want.items())), None)


def _limit(goal: str, row: Row | None, key: str, limit: float, shown: str) -> Verdict:
    if row is None or key not in row:
        return Verdict(goal, "", None)
    value = float(row[key])
    runs = f" (runs: {row['runs_p50_us']})" if row.get("runs_p50_us") else ""
    return Verdict(goal, shown.format(value) + runs, value <= limit)


def _checkpoint_goals(rows: list[Row]) -> list[Verdict]:
    out = []
    ckpt = [
        r for r in rows
        if r.get("group") == ckpt_bench.GROUP and r.get("system") == ckpt_bench.SYSTEM
    ]  # fmt: skip
    for n in TREES:
        row = _find(ckpt, case=ckpt_bench.snapshot_case(10, n))
        out.append(_limit(
            f"10-file checkpoint through the mount, {n:,}-file tree: p50 ≤ 1 ms",
            row, "p50_us", CHECKPOINT_LIMIT_US, "p50 {:,.0f} µs",
        ))  # fmt: skip
    for n in TREES:
        steps = [
            r for k in ckpt_bench.CHANGED
            if (r := _find(ckpt, case=ckpt_bench.snapshot_case(k, n)))
            and "vs_git" in r
        ]  # fmt: skip
        goal = f"checkpoint ≥ 50{TIMES} faster than `git add -A && git commit`, {n:,}-file tree"
        if not steps:
            out.append(Verdict(goal, "", None))
            continue
        shown = ", ".join(
            f"{r['files_changed']} file(s) {float(r['vs_git']):,.1f}{TIMES}" for r in steps
        )
        out.append(Verdict(goal, shown, all(float(r["vs_git"]) >= GIT_FACTOR for r in steps)))
    for n in TREES:
        row = _find(ckpt, case=ckpt_bench.restore_in_process_case(n))
        out.append(_limit(
            f"10-file rollback in process, {n:,}-file tree: p50 ≤ 0.2 ms",
            row, "p50_us", ROLLBACK_LIMIT_US, "p50 {:,.0f} µs",
        ))  # fmt: skip
    return out


def _fs_goals(rows: list[Row]) -> list[Verdict]:
    fs = [r for r in rows if r.get("group") == fs_workloads.GROUP]
    places: dict[str, str] = {}
    for r in fs:
        place = r.get("fs", scratch_fs.TMP)
        places.setdefault(place, r.get("fs_label") or place)
    places = places or {scratch_fs.TMP: "the temp dir"}
    out = []
    for system, key, limit, text in FS_GOALS:
        for place, label in places.items():
            row = _find(fs, system=system, workload="geomean", fs=place)
            shown = "geometric mean {:.2f}" + TIMES + (
                f" over {row['workloads']} workloads" if row and row.get("workloads") else ""
            )
            verdict = _limit(f"{system} on {label}: {text}", row, key, limit, shown)
            absent = _find(fs, system=system, case="(all workloads)", fs=place)
            if verdict.met is None and absent is not None:
                verdict = Verdict(verdict.goal, str(absent.get("note", "")), None)
            out.append(verdict)
    return out


def _memory_goal(rows: list[Row]) -> list[Verdict]:
    row = next(
        (r for r in rows if str(r.get("case", "")).startswith(ckpt_bench.BIG_COPY_UP_CASE)), None
    )
    goal = (
        f"2 GiB file copied up, snapshotted and committed within {BIG_FILE_LIMIT_MIB:.0f} MiB "
        "above baseline"
    )
    if row is None or "rss_mib" not in row:
        return [Verdict(goal, "", None)]
    extra = float(row["rss_mib"])
    shown = f"+{extra:.1f} MiB peak, {row.get('seconds', '?')} s"
    return [Verdict(goal, shown, extra <= BIG_FILE_LIMIT_MIB)]


def _isolation_goal(rows: list[Row]) -> list[Verdict]:
    goal = (
        f"`booth run -- true` with every protection within {ISOLATION_LIMIT_MS:.0f} ms of "
        "the previous isolation"
    )
    starts = [r for r in rows
              if r.get("group") == iso_bench.GROUP and r.get("case") == iso_bench.STARTUP_CASE]
    now = _find(starts, system=iso_bench.ALL_ON)
    # The previous version when the run had one, else the switches turned off.
    before = next((r for system in (iso_bench.BASELINE, iso_bench.SWITCHED_OFF)
                   if (r := _find(starts, system=system))), None)  # fmt: skip
    # The fastest run of each: what the protections cost, least disturbed by the machine.
    key = "min_us" if now and before and "min_us" in now and "min_us" in before else "p50_us"
    if now is None or before is None or key not in now or key not in before:
        return [Verdict(goal, "", None)]
    extra_ms = (float(now[key]) - float(before[key])) / 1e3
    shown = (
        f"{extra_ms:+.1f} ms ({key.removesuffix('_us')} {float(now[key]) / 1e3:,.0f} against "
        f"{float(before[key]) / 1e3:,.0f} ms, {before['system']})"
    )
    return [Verdict(goal, shown, extra_ms <= ISOLATION_LIMIT_MS)]


def _proxy_goals(rows: list[Row]) -> list[Verdict]:
    """What the recording LLM proxy adds, at the p50, against calling the upstream directly."""
    proxy = [
        r for r in rows
        if r.get("group") == proxy_bench.GROUP and r.get("system") == proxy_bench.RECORDING
    ]  # fmt: skip
    out = []
    for case, what in (
        (proxy_bench.WHOLE_JSON, "a JSON chat call"),
        (proxy_bench.WHOLE_STREAM, "a streamed chat call"),
        (proxy_bench.FIRST_TOKEN, "a stream's first token"),
        (proxy_bench.PAUSED_FIRST_TOKEN,
         f"a stream's first token, the model pausing {proxy_bench.PAUSE_MS} ms after it"),
    ):
        row = _find(proxy, case=case)
        extra = row.get("overhead_cpu_us") if row else None
        cpu = "" if extra is None else f", {float(extra):,.0f} µs CPU"
        out.append(_limit(
            f"LLM proxy, recording: ≤ 1 ms added to {what} (p50)",
            row, "overhead_p50_us", PROXY_LIMIT_US, "+{:,.0f} µs" + cpu,
        ))  # fmt: skip
    return out


def _mcp_goal(rows: list[Row]) -> list[Verdict]:
    """What the MCP gateway adds to a tool call, at the p50, against calling the server."""
    row = _find(rows, group=mcp_bench.GROUP, case=mcp_bench.STDIO, system=mcp_bench.GATEWAY)
    http = _find(rows, group=mcp_bench.GROUP, case=mcp_bench.HTTP_BOOTH,
                 system=mcp_bench.HTTP_GATEWAY)  # fmt: skip
    return [_limit("MCP gateway: ≤ 1 ms added to a stdio tool call (p50)", row,
                   "overhead_p50_us", MCP_LIMIT_US, "+{:,.0f} µs"),
            _limit("MCP gateway: ≤ 1 ms added to a streamable-HTTP tool call (p50)", http,
                   "overhead_p50_us", MCP_LIMIT_US, "+{:,.0f} µs")]  # fmt: skip


def _command_goal(rows: list[Row], case: str, system: str, limit_ms: float, goal: str) -> Verdict:
    row = _find(rows, group=startup_bench.GROUP, case=case, system=system)
    if row is None or "p50_us" not in row:
        return Verdict(goal, "", None)
    p50 = float(row["p50_us"]) / 1e3
    shown = f"p50 {p50:,.0f} ms, fastest {float(row['min_us']) / 1e3:,.0f} ms, CPU {row['cpu_s']} s"
    if row.get("ratio"):
        shown += f", {float(row['ratio']):.1f}{TIMES} its anchor"
    if row.get("instructions"):
        shown += f", {int(row['instructions']) / 1e6:,.0f}M instructions"
        if row.get("instructions_vs_floor"):
            shown += f" ({row['instructions_vs_floor']}{TIMES} `python -c pass`)"
    return Verdict(goal, shown, p50 <= limit_ms)


def _wait_goals(rows: list[Row]) -> list[Verdict]:
    """Issue 33: a booth's start, a replay, a checkpoint after a pause, FUSE on a busy machine."""
    out = [
        _command_goal(rows, startup_bench.BOOTH_CASE, startup_bench.BOOTH_SYSTEM,
                      startup_bench.BOOTH_GOAL_MS, "`jukebox booth run --tree T -- true`: p50 ≤ "
                      f"{startup_bench.BOOTH_GOAL_MS:.0f} ms"),
        _command_goal(rows, startup_bench.REPLAY_CASE, startup_bench.REPLAY_SYSTEM,
                      startup_bench.REPLAY_GOAL_MS, "`jukebox replay TAPE` (8 frames): p50 ≤ "
                      f"{startup_bench.REPLAY_GOAL_MS:.0f} ms"),
    ]  # fmt: skip
    paused = _find(rows, group=booth_bench.GROUP, system=booth_bench.SYSTEM,
                   case=booth_bench.checkpoint_case(10, booth_bench.PAUSE))  # fmt: skip
    out.append(_limit(
        f"10-file checkpoint {booth_bench.PAUSE} s after the step, in a booth: p50 ≤ 0.3 ms",
        paused, "p50_us", PAUSED_CHECKPOINT_LIMIT_US, "p50 {:,.0f} µs",
    ))  # fmt: skip
    loaded = _find(rows, group=loaded_bench.GROUP, condition=loaded_bench.HOGGED,
                   workload="geomean", system=bk.SHADOWFS_FUSE)  # fmt: skip
    out.append(_limit(
        "shadowfs-fuse with a busy loop per core: no slower than fuse-overlayfs",
        loaded, "ratio_fuse_overlayfs", LOADED_LIMIT, "geometric mean {:.2f}" + TIMES,
    ))  # fmt: skip
    return out


def judge(rows: Sequence[Row]) -> list[Verdict]:
    rows = list(rows)
    return [*_checkpoint_goals(rows), *_fs_goals(rows), *_memory_goal(rows),
            *_isolation_goal(rows), *_proxy_goals(rows), *_mcp_goal(rows),
            *_wait_goals(rows)]  # fmt: skip


def render(verdicts: Sequence[Verdict]) -> str:
    """A markdown table, or "" when the run measured none of the goals."""
    if all(v.met is None for v in verdicts):
        return ""
    out = ["| goal | measured | verdict |", "|---|---|---|"]
    out += [f"| {v.goal} | {v.measured or '—'} | {v.word} |" for v in verdicts]
    met = sum(v.met is True for v in verdicts)
    measured = sum(v.met is not None for v in verdicts)
    out += ["", f"{met} of {measured} measured goals met."]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.goals", description="Judge a saved bench run against the goals."
    )
    p.add_argument("rows", type=Path, help="the file `python -m bench --json FILE` wrote")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    args = p.parse_args(argv)
    try:
        data = json.loads(args.rows.read_text())
        rows = data["rows"] if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ValueError("no list of rows")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else exc
        print(f"bench.goals: cannot read {args.rows} ({why}); pass the file that "
              "`python -m bench --json FILE` wrote", file=sys.stderr)  # fmt: skip
        return 2
    verdicts = judge(rows)
    if args.json:
        print(json.dumps([{**asdict(v), "verdict": v.word.strip("*")} for v in verdicts], indent=1))
    else:
        print(render(verdicts) or "this run measured none of the goals")
    return 1 if any(v.met is False for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
