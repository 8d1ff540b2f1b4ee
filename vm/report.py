"""What each kernel's run came to, read from the JUnit XML pytest wrote in the guest."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class KernelResult:
    kernel: str
    version: str
    accel: str
    seconds: float
    cpu_seconds: float
    attempts: int
    exit_code: int | None
    passed: int = 0
    failed: list[str] = field(default_factory=list)  # "test id: first line of the message"
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> how many
    modules: list[str] = field(default_factory=list)  # the guest's module lines
    fuse: str = ""  # the FUSE protocol the kernel offered, and so the invalidation path taken
    problem: str | None = None  # why there are no results at all
    budget_ran_out: str = ""  # the guest's line when pytest was interrupted: results are partial

    @property
    def ok(self) -> bool:
        # 124: the budget interrupted pytest; what ran is reported, and it is partial.
        return self.exit_code in (0, 124) and not self.failed and self.problem is None

    def as_json(self) -> dict:
        d = asdict(self)
        d["skipped_total"] = sum(self.skipped.values())
        d["ok"] = self.ok
        return d


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:200] if lines else ""


def read(result: KernelResult, run_dir: Path) -> KernelResult:
    guest_log = run_dir / "guest.log"
    if guest_log.exists():
        result.modules = [ln.removeprefix("guest: ") for ln in guest_log.read_text(
            errors="replace").splitlines() if ln.startswith("guest: module")]
        fuse = [ln for ln in guest_log.read_text(errors="replace").splitlines()
                if ln.startswith("guest: fuse protocol")]
        result.fuse = fuse[0].removeprefix("guest: ") if fuse else "fuse protocol not probed"
        ran_out = [ln for ln in guest_log.read_text(errors="replace").splitlines()
                   if ln.startswith("guest: budget of")]
        result.budget_ran_out = ran_out[0].removeprefix("guest: ") if ran_out else ""
    junit = run_dir / "junit.xml"
    if not junit.exists():
        result.problem = (
            "no exit code came back from the guest" if result.exit_code is None
            else f"pytest wrote no results (exit {result.exit_code}); see {run_dir}/guest.log"
        )
        return result
    skipped: Counter[str] = Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # what pytest writes for the test a budget's Ctrl-C interrupted
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            result.failed.append(f"{name}: {_first_line(bad.get('message'))}")
        elif skip is not None:
            skipped[_first_line(skip.get("message")) or "no reason given"] += 1
        else:
            result.passed += 1
    result.skipped = dict(skipped.most_common())
    if result.exit_code is None:
        result.problem = "no exit code came back from the guest (results are partial)"
    return result


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def render(results: list[KernelResult]) -> str:
    out = []
    for r in results:
        head = (f"{r.kernel} ({r.version}, {r.accel}): {r.passed} passed, {len(r.failed)} failed, "
                f"{sum(r.skipped.values())} skipped in {_minutes(r.seconds)} "
                f"(CPU {_minutes(r.cpu_seconds)})")
        if r.attempts > 1:
            head += f" ({r.attempts} boots)"
        out.append(head)
        if r.fuse:
            out.append(f"  {r.fuse}")
        if r.budget_ran_out:
            out.append(f"  PARTIAL: {r.budget_ran_out}; the tests after these did not run")
        if r.problem:
            out.append(f"  PROBLEM: {r.problem}")
        out.extend(f"  module: {m.removeprefix('module ')}" for m in r.modules
                   if not m.endswith(" ok"))
        out.extend(f"  FAILED {f}" for f in r.failed)
        out.extend(f"  skipped {n}x: {reason}" for reason, n in r.skipped.items())
    return "\n".join(out)
