"""`make demo`: a small agent works on a project inside a booth, and everything it did is replayed.

The agent edits code, checkpoints, makes a mistake, notices its tests fail, rolls back to its
checkpoint while still running, finishes the job, and exits. The verifier passes, so the booth
commits to the real tree. Then `jukebox ls`, `log` and `replay` show the tape.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

CALC = """\
def add(a, b):
    return a + b
"""

TESTS = """\
from calc import add

assert add(2, 3) == 5
print("tests pass")
"""

AGENT = '''\
"""A scripted stand-in for an LLM agent: the file work and the undo are real."""
import pathlib
import subprocess

def step(text):
    print(f"[agent] {text}", flush=True)

def booth(*args):
    subprocess.run(["jukebox", "booth", *args], check=True)

def tests_pass():
    # -B: no __pycache__ left in the project, for the commit to carry into the real tree
    return subprocess.run(["python3", "-B", "test_calc.py"], capture_output=True).returncode == 0

calc = pathlib.Path("calc.py")
step("adding multiply() to calc.py")
calc.write_text(calc.read_text() + "\\n\\ndef multiply(a, b):\\n    return a * b\\n")
tests = pathlib.Path("test_calc.py")
tests.write_text(tests.read_text() + "from calc import multiply\\nassert multiply(3, 4) == 12\\n")
booth("checkpoint", "--label", "multiply-added")

step("refactoring add() ... and getting it wrong")
calc.write_text(calc.read_text().replace("return a + b", "return a - b"))
pathlib.Path("scratch.tmp").write_text("half-finished notes\\n")
step(f"tests pass after the refactor? {tests_pass()}")

step("rolling back to the checkpoint, without stopping")
booth("rollback", "--to", "multiply-added")
step(f"tests pass after the rollback? {tests_pass()}")

step("writing the changelog")
pathlib.Path("CHANGELOG.md").write_text("- add multiply()\\n")
step("done")
'''


def run(cmd: list[str], agent_file: Path | None = None, **kwargs) -> int:
    """Runs `cmd`, shown first as a line that can be pasted back into a shell (after the
    demo's `export` line): quoted, and the agent's source read from the file that holds it."""
    args = cmd[1:-1] if agent_file is not None else cmd[1:]
    shown = shlex.join([Path(cmd[0]).name, *args])  # the program is found on the demo's PATH
    if agent_file is not None:
        shown += f' "$(cat {shlex.quote(str(agent_file))})"'
    print(f"\n$ {shown}", flush=True)
    return subprocess.run(cmd, **kwargs).returncode


def main() -> int:
    root = Path(os.environ.get("JUKEBOX_DEMO_DIR", "demo-work")).resolve()
    if root.exists():
        shutil.rmtree(root)
    project, tapes = root / "project", root / "tapes"
    project.mkdir(parents=True)
    (project / "calc.py").write_text(CALC)
    (project / "test_calc.py").write_text(TESTS)
    (root / "agent.py").write_text(AGENT)  # for reading; it runs from argv, as /tmp is private
    bin_dir = str(Path(sys.executable).parent)
    env = dict(
        os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}", JUKEBOX_TAPE_DIR=str(tapes)
    )
    jukebox = [str(Path(bin_dir) / "jukebox")]
    print(
        textwrap.dedent(f"""\
        Jukebox demo
        ------------
        project: {project}
        tapes:   {tapes}
        The agent runs in a copy-on-write booth: the project is untouched until the verdict.
        Every command below runs as printed, in this environment:""")
    )
    exports = f"PATH={shlex.quote(bin_dir)}:\"$PATH\" JUKEBOX_TAPE_DIR={shlex.quote(str(tapes))}"
    print(f"\n$ export {exports}")
    print(f"$ cd {shlex.quote(str(project))}")
    status = run(
        [
            *jukebox,
            "booth",
            "run",
            "--tree",
            str(project),
            "--tape-id",
            "demo-run",
            "--name",
            "calculator-agent",
            "--commit",
            "auto",
            "--verify",
            "python3 -B test_calc.py",  # -B: no __pycache__ written into the project
            "--",
            "python3",
            "-c",
            AGENT,
        ],
        agent_file=root / "agent.py",
        env=env,
        cwd=project,
    )
    if status != 0:
        print(f"demo: the booth ended with status {status}", file=sys.stderr)
        return status
    print("\nThe verifier passed and the booth committed. The real project now holds:")
    for path in sorted(project.iterdir()):
        print(f"  {path.name}")
    for cmd in (
        ["ls"],
        ["log", "demo-run"],
        ["replay", "demo-run"],
        ["diff", "demo-run@0", "demo-run"],
    ):
        if run([*jukebox, *cmd], env=env) != 0:
            return 1
    print(
        "\nYour turn: put jukebox on your PATH and look at the demo's tapes yourself:\n"
        f"  source {shlex.quote(bin_dir)}/activate    # or call {bin_dir}/jukebox\n"
        f"  export JUKEBOX_TAPE_DIR={shlex.quote(str(tapes))}\n"
        "  jukebox ls\n"
        "Without JUKEBOX_TAPE_DIR, tapes go to ~/.local/share/jukebox/tapes."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
