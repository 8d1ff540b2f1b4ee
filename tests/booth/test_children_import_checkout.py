"""The children booth tests start (from `/`, maybe as nobody) run the checkout under test."""

from __future__ import annotations

from tests.booth.conftest import NOBODY, REPO, run_py

PROBE = "import jukebox, shadowfs; print(jukebox.__file__); print(shadowfs.__file__)"


def test_a_child_started_from_root_dir_imports_this_checkout() -> None:
    proc = run_py(PROBE)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.split():
        assert line.startswith(f"{REPO}/"), (line, REPO)


def test_a_child_run_as_nobody_imports_this_checkout(nobody_python: str) -> None:
    proc = run_py(PROBE, python=nobody_python, user=NOBODY)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.split():
        assert line.startswith(f"{REPO}/"), (line, REPO)
