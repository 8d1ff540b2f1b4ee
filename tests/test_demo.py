"""`make demo` end to end: the agent's mistake is undone in the booth, the good work committed."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path


def test_demo_commits_the_good_work_and_not_the_mistake(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    env = dict(os.environ, JUKEBOX_DEMO_DIR=str(root))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as on a user's machine: Python writes bytecode
    proc = subprocess.run(
        [sys.executable, "-m", "jukebox.demo"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    project = root / "project"
    calc = (project / "calc.py").read_text()
    assert "def multiply" in calc and "return a + b" in calc
    assert (project / "CHANGELOG.md").exists()
    assert not (project / "scratch.tmp").exists()
    # Python run in the booth (the verifier, the agent's own test run) leaves no bytecode for the
    # commit to carry into the project, whatever the caller's PYTHONDONTWRITEBYTECODE.
    assert sorted(p.name for p in project.iterdir()) == ["CHANGELOG.md", "calc.py", "test_calc.py"]
    assert "tests pass after the refactor? False" in proc.stdout
    assert "tests pass after the rollback? True" in proc.stdout
    assert "COMMITTED" in proc.stdout and "verified: hash chain" in proc.stdout
    assert f"jukebox: committed 3 changes to {project} " in proc.stderr
    assert "the booth committed" in proc.stdout

    # What it prints can be pasted back: the commands parse to what ran (quoted), and the
    # closing lines find the demo's tapes from a shell that has no jukebox on its PATH.
    shown = [line[2:] for line in proc.stdout.splitlines() if line.startswith("$ jukebox booth")]
    (booth_run,) = shown
    argv = shlex.split(booth_run.split(' "$(cat')[0])
    assert argv[argv.index("--verify") + 1] == "python3 -B test_calc.py"
    yours = proc.stdout.split("Your turn", 1)[1].splitlines()[1:4]
    script = "\n".join(line.split("#")[0].strip() for line in yours)
    assert script.startswith("source ") and script.endswith("jukebox ls"), script
    bare = {k: v for k, v in os.environ.items() if k not in ("JUKEBOX_TAPE_DIR", "VIRTUAL_ENV")}
    bare["PATH"] = "/usr/bin:/bin"
    listed = subprocess.run(["bash", "-c", f"set -e\n{script}"], capture_output=True, text=True,
                            env=bare, cwd=tmp_path, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "demo-run" in listed.stdout and "COMMITTED" in listed.stdout
