"""A command imports the modules of its own sub-command only (jukebox.cli.COMMAND_MODULES), and
never the LLM proxy's stack unless it starts a proxy. Asserts which modules a process loaded,
never how long it took (docs/benchmarks.md has the times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from jukebox import cli as cli_module

PROXY_STACK = ("trio", "httpx", "h11", "genai_prices", "pydantic", "jukebox.llm.server")

# Runs the CLI in this interpreter, then writes what it imported: at exit, which commands that
# skip the interpreter's teardown (jukebox.cli.skip_teardown) still run.
# It also lists the source text given to compile() (the import system's, bytes, aside): a
# process's first compile() sets up the AST types, about 10 M instructions.
WRAPPER = """
import atexit, builtins, gc, json, sys
compiled = []
_compile = builtins.compile

def compile(source, *args, **kwargs):
    if isinstance(source, str):
        compiled.append(source[:60])
    return _compile(source, *args, **kwargs)

builtins.compile = compile
from jukebox.cli import main
out = sys.argv.pop(1)
sys.argv[0] = "jukebox"

def dump():
    with open(out, "w") as f:
        gc_state = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
        json.dump({"modules": sorted(sys.modules), "gc": gc_state, "compiled": compiled}, f)

atexit.register(dump)
main()
"""


def imported(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[int, set[str], str]:
    """Runs `jukebox ARGS` in a fresh interpreter: its exit code, the modules it had loaded
    at the end, and its stderr."""
    out = tmp_path / "modules.json"
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(out), *args],
        capture_output=True, text=True, cwd="/", timeout=60,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert out.exists(), proc.stderr
    data = json.loads(out.read_text())
    return proc.returncode, set(data["modules"]), proc.stderr


def test_every_command_is_mapped_to_the_modules_that_register_it() -> None:
    for name in cli_module.ALL_COMMAND_MODULES:
        __import__(f"jukebox.cli.{name}")
    for name, command in cli_module.cli.commands.items():
        if name == "help":  # it walks every command: a command line naming it imports them all
            continue
        registered_by = {command.callback.__module__}
        if isinstance(command, click.Group):
            registered_by |= {sub.callback.__module__ for sub in command.commands.values()}
        assert {f"jukebox.cli.{m}" for m in cli_module.COMMAND_MODULES[name]} >= registered_by
    assert set(cli_module.COMMAND_MODULES) == set(cli_module.cli.commands) - {"help"}


def test_a_command_imports_only_its_own_sub_command(tmp_path: Path) -> None:
    (tmp_path / "tapes").mkdir()
    code, modules, _ = imported(tmp_path, "ls", "--tape-dir", str(tmp_path / "tapes"))
    assert code == 0
    assert "jukebox.cli.tapes" in modules
    assert not {"jukebox.cli.booth", "jukebox.cli.timetravel", "jukebox.cli.mount"} & modules


def test_help_lists_every_command_and_imports_no_proxy(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from jukebox.cli import main; main()", "--help"],
        capture_output=True, text=True, cwd="/", timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0
    listed = {line.split()[0] for line in proc.stdout.split("Commands:")[1].splitlines() if line}
    assert listed == {*cli_module.COMMAND_MODULES, "help"}
    code, modules, _ = imported(tmp_path, "--help")
    assert code == 0
    assert not [m for m in modules if m.split(".")[0] in PROXY_STACK or m in PROXY_STACK]


def test_an_unknown_command_is_still_told_apart_from_close_ones(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from jukebox.cli import main; main()", "replya", "x"],
        capture_output=True, text=True, cwd="/", timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "replay" in proc.stderr  # the suggestion needs every command registered


def collector_after(tmp_path: Path) -> dict[str, Any]:
    """The garbage collector's state at the end of the last `imported` run in `tmp_path`:
    whether it ran, and how many objects were frozen (jukebox.cli.fast.resume_gc)."""
    state: dict[str, Any] = json.loads((tmp_path / "modules.json").read_text())["gc"]
    return state


def compiled_after(tmp_path: Path) -> list[str]:
    """The source text the last `imported` run in `tmp_path` gave to compile(), each cut."""
    texts: list[str] = json.loads((tmp_path / "modules.json").read_text())["compiled"]
    return texts


def _jukebox(cwd: Path, env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", "from jukebox.cli import main; main()", *args],
        capture_output=True, text=True, cwd=cwd, timeout=60, env={**os.environ, **env},
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def test_replay_runs_without_click_and_says_what_click_says(tmp_path: Path) -> None:
    """`jukebox replay TAPE` skips click (jukebox.cli.fast); `replay -- TAPE` means the same
    and goes through click: output, errors and exit codes must be the same."""
    from tests.test_cli_read import record_run

    tapes = tmp_path / "tapes"
    record_run(tapes, tmp_path / "work")
    (tapes / "torn.jbx").write_bytes((tapes / "tr_demo.jbx").read_bytes()[:-5])
    env = {"JUKEBOX_TAPE_DIR": str(tapes)}
    code, modules, _ = imported(tmp_path, "replay", "tr_demo", env=env)
    assert code == 0
    assert not [m for m in modules if m == "click" or m.startswith("click.")]
    assert "shutil" not in modules  # and bz2, lzma behind it: a replay removes no tree
    # The classes on its path are shadowfs.values.Value: dataclasses (with inspect, ast, dis
    # and tokenize behind it) was a third of a replay's instructions.
    assert not {"dataclasses", "inspect", "ast"} & modules
    # typing is for type checking only on its path (a module's `TYPE_CHECKING = False`): its
    # import was a fifth of what a replay runs above `python -c pass`.
    assert "typing" not in modules
    # The collector was paused while it started (jukebox.cli.fast.pause_gc), and runs again,
    # what the start made frozen, once the tape is read; likewise after a refusal.
    assert collector_after(tmp_path)["enabled"] and collector_after(tmp_path)["frozen"] > 0
    code, _, _ = imported(tmp_path, "replay", "nope", env=env)
    assert code == 2 and collector_after(tmp_path)["enabled"]
    cases = [  # the options, the tape, the exit code
        ((), "tr_demo", 0), (("--json",), "tr_demo", 0), (("-q", "--no-color"), "tr_demo", 0),
        ((), "tr_demo@1", 2), ((), "nope", 2), ((), "torn", 1),
        (("--tape-dir", str(tmp_path / "work")), "tr_demo", 2),
    ]  # fmt: skip
    for options, tape, code in cases:
        fast = _jukebox(tmp_path, env, "replay", *options, tape)
        assert fast[0] == code, (options, tape, fast[2])
        assert fast == _jukebox(tmp_path, env, "replay", *options, "--", tape), (options, tape)
