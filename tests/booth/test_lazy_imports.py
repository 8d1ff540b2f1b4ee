"""What a command imports: the LLM proxy's stack (trio, httpx, h11, the price catalogue's
pydantic) only once an agent calls a model through it. Asserts which modules a process loaded,
never how long it took (docs/benchmarks.md has the times)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.llm.upstream import FakeUpstream
from tests.test_cli_imports import PROXY_STACK, collector_after, compiled_after, imported

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")
# What a booth imports only when its agent calls a model or a --max-* flag is set.
LATER = {"jukebox.llm.pricing", "jukebox.llm.recorder", "jukebox.guard.breaker", "decimal"}

def _imported(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> set[str]:
    code, modules, stderr = imported(tmp_path, *args, env=env)
    assert code == 0, stderr
    return modules


def _stack(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in PROXY_STACK or m in PROXY_STACK)


def test_a_booth_whose_agent_calls_no_model_imports_no_proxy(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    script = 'test -n "$OPENAI_BASE_URL" && echo two > a.txt'  # the URL is there all the same
    modules = _imported(
        tmp_path, "booth", "run", "--tree", str(tree), "--tape-dir", str(tmp_path / "tapes"),
        "--", "sh", "-c", script,
    )  # fmt: skip
    assert (tree / "a.txt").read_text() == "two\n"  # it ran and committed
    assert "jukebox.booth.supervisor" in modules
    assert _stack(modules) == []
    # Nor the proxy's recording side (the price table, the recorder) nor, with no --max-* flag,
    # the circuit breaker: their imports were a fifth of a booth's start.
    assert sorted(modules & LATER) == []
    assert "jukebox.cli.tapes" not in modules  # the read side's commands: not a booth's
    # Such a command line is parsed without click (jukebox.cli.fast), and nothing on a booth's
    # path builds a dataclass (shadowfs.values): together a fifth of the supervisor's imports.
    assert not [m for m in modules if m == "click" or m.startswith("click.")]
    assert not {"dataclasses", "inspect", "ast", "jukebox.cli.booth"} & modules
    # tempfile (with random) only for a seccomp cache miss. (hashlib and subprocess come with
    # this booth's commit: the journal's seal, the trash's freeing process.)
    assert "tempfile" not in modules
    assert "prctl" not in modules  # its calls go through libc (isolation.prctl)
    # The built-in image comes from its parsed copy (jukebox.booth.images.PARSED_NAME).
    assert "tomllib" not in modules
    # The collector, paused for the start, ran again from the agent's start on, the start's
    # objects frozen (jukebox.cli.fast.resume_gc: run_booth's `set_up`).
    assert collector_after(tmp_path)["enabled"] and collector_after(tmp_path)["frozen"] > 0


def test_a_booth_that_changes_nothing_imports_no_commit(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    modules = _imported(
        tmp_path, "booth", "run", "--tree", str(tree), "--tape-dir", str(tmp_path / "tapes"),
        "--", "true",
    )  # fmt: skip
    assert "jukebox.booth.supervisor" in modules
    # No change, no commit: its module (with concurrent.futures, logging and subprocess) was a
    # tenth of such a booth's CPU. Nor the modules of MCP calls staged or asked about.
    assert not {"shadowfs.commit", "concurrent.futures", "logging", "subprocess"} & modules
    assert not {"jukebox.mcp.verdict", "jukebox.mcp.approvals", "copy"} & modules
    # The store's index through the C module alone: the `sqlite3` package's date and time
    # adapters (with `datetime`) are of no use to it (shadowfs.store_index).
    assert "_sqlite3" in modules and not {"sqlite3", "datetime"} & modules
    # typing is for type checking only on its path (a module's `TYPE_CHECKING = False`): its
    # import was a tenth of what the supervisor runs above `python -c pass`.
    assert "typing" not in modules
    # And zstandard's C backend alone, without the package's `platform` (shadowfs.zstd).
    assert "zstandard.backend_c" in modules and not {"zstandard", "platform"} & modules
    # Nothing compiled: no NamedTuple's or TypeVar's annotation written as a string on the
    # way (typing compiles each), so the AST types are never set up (shadowfs.store._Staged).
    assert compiled_after(tmp_path) == []
    # Its last line ("no changes to commit: ...") is printable ASCII, written as it is: the
    # escaping of names (with unicodedata) is for lines that need it (jukebox.display.progress).
    assert not {"jukebox.display.names", "unicodedata"} & modules


def _booth(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "jukebox"), "booth", "run", *args],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=tmp_path, timeout=60,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    return proc.returncode, proc.stderr


def test_a_booth_run_says_the_same_without_click(tmp_path: Path) -> None:
    """`booth run` parsed by jukebox.cli.fast and by click (an option given twice goes to
    click) runs the same booth and says the same; a config file's defaults for `booth run`
    send the command line to click, which applies them."""
    tree = tmp_path / "tree"
    tree.mkdir()
    said = []
    for twice, tape_id in (((), "fast"), (("--commit", "never"), "click")):
        code, stderr = _booth(
            tmp_path, "--tree", "tree", "--tape-dir", "tapes", "--tape-id", tape_id,
            "--commit", "never", *twice, "sh", "-c", "echo $0 > a.txt; exit 3", tape_id,
        )  # fmt: skip
        said.append((code, stderr.replace(tape_id, "ID")))
        assert (tmp_path / "tapes" / f"{tape_id}.jbx").exists()
    assert said[0] == said[1]
    assert said[0][0] == 3 and "kept pending" in said[0][1]
    assert not (tree / "a.txt").exists()  # --commit never: pending, the tree untouched
    config = tmp_path / "config.toml"
    config.write_text('commit = "never"\n')
    code, stderr = _booth(
        tmp_path, "--tree", "tree", "--tape-dir", "tapes", "--", "sh", "-c", "echo x > a.txt",
        env={"JUKEBOX_CONFIG": str(config)},
    )  # fmt: skip
    assert code == 0 and "kept pending" in stderr, stderr
    assert not (tree / "a.txt").exists()


def test_a_bad_price_file_still_stops_a_booth_before_its_agent(tmp_path: Path) -> None:
    """The price table is read at the start only when a file is named: a broken one is still an
    error before anything runs, not a proxy failing at the agent's first call."""
    tree = tmp_path / "tree"
    tree.mkdir()
    prices = tmp_path / "prices.toml"
    prices.write_text("[models\n")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "jukebox"), "booth", "run", "--tree", str(tree),
         "--tape-dir", str(tmp_path / "tapes"), "--", "sh", "-c", "echo ran > ran.txt"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd="/", timeout=60,
        env={**os.environ, "JUKEBOX_PRICES": str(prices)},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"the price table {prices} is not valid TOML" in proc.stderr
    assert not (tree / "ran.txt").exists()


def test_the_first_model_call_starts_the_proxy(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    agent = (
        "import json, os, urllib.request\n"
        "url = os.environ['OPENAI_BASE_URL'] + '/chat/completions'\n"
        "body = json.dumps({'model': 'gpt-4o', 'messages': [{'role': 'user', 'content': 'hi'}]})\n"
        "req = urllib.request.Request(url, body.encode(), {'content-type': 'application/json',"
        " 'authorization': 'Bearer sk-test'})\n"
        "reply = json.load(urllib.request.urlopen(req))\n"
        "open('reply.txt', 'w').write(reply['choices'][0]['message']['content'])\n"
    )
    upstream = FakeUpstream().start()
    try:
        modules = _imported(
            tmp_path, "booth", "run", "--tree", str(tree), "--tape-dir", str(tmp_path / "tapes"),
            "--", sys.executable, "-c", agent,
            env={"OPENAI_BASE_URL": upstream.openai_url},
        )  # fmt: skip
    finally:
        upstream.stop()
    assert (tree / "reply.txt").read_text() == "echo: hi"  # through the proxy and back
    assert len(upstream.seen) == 1
    assert "jukebox.llm.server" in modules


def test_the_agent_holds_no_descriptor_of_the_supervisor(tmp_path: Path) -> None:
    """The agent's shim is forked from the supervisor (isolation.PreforkedShim): none of the
    supervisor's descriptors (the store, the tape, the real tree's fd) may reach the agent."""
    tree = tmp_path / "tree"
    tree.mkdir()
    script = "ls -l /proc/self/fd/ > fds.txt; ls /proc/self/fd | wc -l > count.txt"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "jukebox"), "booth", "run", "--tree", str(tree),
         "--tape-dir", str(tmp_path / "tapes"), "--", "sh", "-c", script],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd="/", timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    listing = (tree / "fds.txt").read_text()
    assert str(tmp_path / "tapes") not in listing and "socket:" not in listing
    # ls's own descriptor for the directory, and stdin, stdout, stderr.
    assert int((tree / "count.txt").read_text()) <= 4, listing
