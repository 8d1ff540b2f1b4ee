"""A booth's cgroup, made and removed on the real cgroup file systems of this host.

The booth runs themselves (processes joining, limits binding root) are in
tests/reliability/test_escape_syscalls.py; here: which hierarchy is used, cgroup v2 seen alone,
stale cgroups of killed supervisors, and an unprivileged caller.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from jukebox.booth import cgroups
from tests.booth.conftest import NOBODY, run_py

pytestmark = pytest.mark.usefixtures("root_only")


def test_limits_are_written_and_the_cgroup_removed() -> None:
    cg = cgroups.create("unit", processes=7, memory=64 << 20)
    try:
        hierarchies = cgroups.mounted_hierarchies()
        for controller, protection in cgroups.PROTECTION_NAMES.items():
            if controller not in hierarchies:
                assert cg.states[protection].startswith("unavailable: "), cg.states
                continue
            assert cg.states[protection] == "on", cg.states
        pids = next(d for d in cg.dirs if os.path.exists(os.path.join(d, "pids.max")))
        assert Path(pids, "pids.max").read_text().strip() == "7"
        assert all(os.path.basename(d) == f"{os.getpid()}-unit" for d in cg.dirs)
    finally:
        dirs = list(cg.dirs)
        cg.remove()
    assert not any(os.path.exists(d) for d in dirs)


def test_cgroup_v2_alone_is_used_only_where_it_offers_the_controllers(tmp_path: Path) -> None:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    v2 = [ln for ln in lines if " - cgroup2 " in ln]
    if not v2:
        pytest.skip("no cgroup2 mount here")
    only_v2 = tmp_path / "mountinfo"
    only_v2.write_text("\n".join(v2) + "\n")
    mount = v2[0].split(" - ")[0].split(" ")[4]
    offered = Path(mount, "cgroup.controllers").read_text().split()
    cg = cgroups.create("v2", processes=9, memory=None, mountinfo=str(only_v2))
    try:
        if "pids" in offered:
            assert cg.states["pids_cgroup"] == "on", cg.states
            assert Path(cg.dirs[0], "pids.max").read_text().strip() == "9"
        else:  # a hybrid host: v1 holds pids, and the booth says so rather than pretend
            assert cg.states["pids_cgroup"] == (
                "unavailable: no cgroup hierarchy here offers the pids controller"
            )
            assert cg.dirs == []
    finally:
        cg.remove()


def test_a_killed_supervisors_cgroup_is_removed_by_the_next_booth() -> None:
    hierarchy = cgroups.mounted_hierarchies().get("pids")
    if hierarchy is None:
        pytest.skip("no pids controller here")
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now: what a SIGKILLed supervisor leaves in a cgroup's name
    base = os.path.normpath(os.path.join(hierarchy.mount, hierarchy.own.lstrip("/")))
    stale = Path(base, cgroups.GROUP_DIR, f"{dead.pid}-killed")
    stale.mkdir(parents=True)
    cg = cgroups.create("next", processes=5, memory=None)
    try:
        assert not stale.exists()
    finally:
        cg.remove()
        if stale.exists():
            stale.rmdir()


def test_nobody_cannot_make_one_and_is_told_why(nobody_python: str) -> None:
    proc = run_py(
        "import json; from jukebox.booth import cgroups;"
        "cg = cgroups.create('nobody', processes=5, memory=1 << 30);"
        "print(json.dumps([cg.states, cg.dirs]))",
        python=nobody_python,
        user=NOBODY,
    )
    assert proc.returncode == 0, proc.stderr
    states, dirs = json.loads(proc.stdout)
    assert dirs == []
    for protection in ("pids_cgroup", "memory_cgroup"):
        assert states[protection].startswith("unavailable: "), states
    assert "as uid 65534" in states["pids_cgroup"], states


PREFORKED_JOINS = r"""
import json, os, time
from jukebox.booth import cgroups, isolation
cg = cgroups.create("prefork", processes=50, memory=None)
shim = isolation.PreforkedShim.fork(cg.procs_files)
members = {}
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    members = {p: open(p).read().split() for p in cg.procs_files}
    if all(str(shim.pid) in m for m in members.values()):
        break
    time.sleep(0.01)
joined = {p: str(shim.pid) in m for p, m in members.items()}
files = len(cg.procs_files)
shim.close()
cg.remove()
print(json.dumps({"joined": joined, "files": files}))
"""


def test_the_preforked_shim_joins_the_booths_cgroup_before_its_spec() -> None:
    """The cgroup join (an RCU grace period in the kernel) happens while the supervisor still
    mounts: the shim is in the booth's cgroups before any spec was sent to it."""
    proc = run_py(PREFORKED_JOINS)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["files"]:
        pytest.skip("no cgroup hierarchy with the booth's controllers here")
    assert all(result["joined"].values()), result
