"""`make demo` end to end: the agent's mistake is undone in the booth, the good work committed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_demo_commits_the_good_work_and_not_the_mistake(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    env = dict(os.environ, JUKEBOX_DEMO_DIR=str(root))
    proc = subprocess.run(
        [sys.executable, "-m", "jukebox.demo"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    project = root / "project"
    calc = (project / "calc.py").read_text()
    assert "def multiply" in calc and "return a + b" in calc
    assert (project / "CHANGELOG.md").exists()
    assert not (project / "scratch.tmp").exists()
    assert "tests pass after the refactor? False" in proc.stdout
    assert "tests pass after the rollback? True" in proc.stdout
    assert "COMMITTED" in proc.stdout and "verified: hash chain" in proc.stdout
