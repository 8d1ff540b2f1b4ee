"""The host side of `make vm-test` (vm/): what it refuses, what it runs, how it reads results.

Booting VMs is not part of `make test`; these check the parts that run on the host in seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from vm import disks, report
from vm.__main__ import SUBSET, subset


def _vm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vm", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_an_unknown_kernel_is_refused_in_one_line_before_any_download() -> None:
    for bad in (["no-such-suite"], ["/nowhere/vmlinuz-9.9"]):
        proc = _vm(*bad)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and bad[0] in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_bad_timeout_is_refused_in_one_line() -> None:
    proc = _vm("bookworm", "--timeout", "-5")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--timeout" in proc.stderr


def test_a_bad_budget_is_refused_in_one_line() -> None:
    proc = _vm("bookworm", "--budget", "-1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--budget" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "vm", "bookworm"], capture_output=True,
                          text=True, cwd=REPO, timeout=60,
                          env=dict(os.environ, JUKEBOX_VM_BUDGET="soon"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "JUKEBOX_VM_BUDGET=soon" in proc.stderr


def test_every_test_the_vm_subset_names_exists() -> None:
    """A renamed test file would silently drop out of every kernel's run."""
    tests, extra = subset(SUBSET, None)
    assert len(tests) >= 10
    for arg in tests + extra[1::2]:
        path = REPO / arg.split("::")[0]
        assert path.is_file(), f"vm/subset.txt names {arg}, which does not exist"
        if "::" in arg:
            assert f"def {arg.split('::')[1].split('[')[0]}(" in path.read_text(), arg


def test_the_report_counts_what_pytest_wrote(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert True\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "def test_skipped():\n    pytest.skip('this kernel has no frobnicator')\n"
        "def test_skipped_too():\n    pytest.skip('this kernel has no frobnicator')\n"
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={run_dir / 'junit.xml'}", str(tmp_path / "test_sample.py")],
                   capture_output=True, cwd=tmp_path, timeout=120,
                   env=dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))  # as in the guest
    (run_dir / "guest.log").write_text(
        "guest: kernel 6.1.0\nguest: module fuse ok\nguest: module overlay MISSING\n"
        "guest: fuse protocol 7.38: invalidation expires entries\n"
    )
    r = report.read(report.KernelResult("bookworm", "6.1.0", "tcg", 60.0, 30.0, 1, 1), run_dir)
    assert r.passed == 1
    assert len(r.failed) == 1 and "test_bad" in r.failed[0] and "one is not two" in r.failed[0]
    assert r.skipped == {"this kernel has no frobnicator": 2}
    assert r.fuse == "fuse protocol 7.38: invalidation expires entries"
    assert not r.ok
    text = report.render([r])
    assert "1 passed, 1 failed, 2 skipped" in text
    assert "overlay MISSING" in text and "skipped 2x: this kernel has no frobnicator" in text


def test_no_exit_code_is_a_problem_not_a_pass(tmp_path: Path) -> None:
    r = report.read(report.KernelResult("sid", "7.2", "tcg", 1.0, 1.0, 2, None), tmp_path)
    assert not r.ok and r.problem == "no exit code came back from the guest"


def test_the_interpreter_is_copied_unless_it_is_the_systems(tmp_path: Path) -> None:
    for home, prefix in (("/usr/bin", None), ("/opt/py/3.11/bin", Path("/opt/py/3.11"))):
        (tmp_path / ".venv").mkdir(exist_ok=True)
        (tmp_path / ".venv" / "pyvenv.cfg").write_text(f"home = {home}\nversion = 3.11.7\n")
        assert disks.venv_paths(tmp_path) == (tmp_path / ".venv", prefix)


def test_a_run_cut_by_its_budget_reports_what_ran_as_partial(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.booth.test_cgroups" name="test_a"/>'
        '<testcase classname="tests.booth.test_cgroups" name="test_b"/>'
        '<testcase time="0.010"/>'  # the test the interrupt stopped, as pytest writes it
        "</testsuite></testsuites>"
    )
    (tmp_path / "guest.log").write_text("guest: budget of 600 s ran out\n")
    r = report.read(report.KernelResult("trixie", "6.12", "tcg", 700.0, 900.0, 1, 124), tmp_path)
    assert r.passed == 2 and r.ok  # cut short is not a failure, and says so
    assert r.budget_ran_out == "budget of 600 s ran out"
    assert "PARTIAL: budget of 600 s ran out" in report.render([r])


HOLDER = """
import os, subprocess, sys
from vm.__main__ import CACHE, LOCK_FD_ENV, hold_lock
fd = hold_lock(CACHE)
# What a --parallel run's children do: they run under the lock their parent passes them.
child = subprocess.run(
    [sys.executable, "-c", "from vm.__main__ import CACHE, hold_lock; hold_lock(CACHE)"],
    env=dict(os.environ, **{LOCK_FD_ENV: str(fd)}), pass_fds=(fd,), capture_output=True, text=True,
)
print("held", child.returncode, child.stderr.strip(), flush=True)
sys.stdin.readline()
"""


def test_a_second_run_is_refused_while_one_holds_the_lock(tmp_path: Path) -> None:
    # The harness copied: its cache (and lock) are then under tmp_path, never the checkout's,
    # which a real `make vm-test` may be using right now.
    shutil.copytree(REPO / "vm", tmp_path / "vm", ignore=shutil.ignore_patterns("__pycache__"))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=tmp_path, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "held 0 \n"  # its child ran under its lock
        second = subprocess.run([sys.executable, "-m", "vm", "bookworm"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1, second.stderr
        assert "another run holds" in second.stderr and f"(pid {holder.pid})" in second.stderr
        # Refused before it looked at tools, kernels or the venv (none here).
        assert not (tmp_path / ".vm-cache" / "kernels").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # Released with its holder's exit: the next run takes it.
    taken = subprocess.run(
        [sys.executable, "-c", "from vm.__main__ import CACHE, hold_lock; hold_lock(CACHE)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert taken.returncode == 0, taken.stderr


def test_virtme_ng_is_installed_under_the_runs_lock(tmp_path: Path) -> None:
    """`make vm-test` leaves the install to the runner, which makes .vm-cache/vng only while it
    holds the cache's lock: two runs started at once cannot build one venv over the other."""
    recipe = re.search(r"^vm-test:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe is not None
    assert "pip" not in recipe.group(1) and "venv" not in recipe.group(1), recipe.group(1)
    shutil.copytree(REPO / "vm", tmp_path / "vm", ignore=shutil.ignore_patterns("__pycache__"))
    # What the runner checks for before it installs: the tools and a .venv (only looked at).
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("qemu-system-x86_64", "qemu-img", "mkfs.ext4", "dpkg-deb", "apt-get", "depmod",
                 "busybox"):
        (tools / tool).write_text("#!/bin/sh\nexit 0\n")
        (tools / tool).chmod(0o755)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    # A file where the venv goes: the install's first step fails on it at once, offline.
    (tmp_path / ".vm-cache").mkdir()
    (tmp_path / ".vm-cache" / "vng").write_text("in the way\n")
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}")

    def run_vm() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vm", "bookworm"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=tmp_path, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "held 0 \n"
        refused = run_vm()
        assert refused.returncode == 2 and "another run holds" in refused.stderr, refused.stderr
        assert "virtme-ng" not in refused.stderr, refused.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    ran = run_vm()  # the lock is free: this run takes it, then installs
    assert ran.returncode == 2, ran.stderr
    assert "installing virtme-ng: `" in ran.stderr and "Not a directory" in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr
