"""The seed example from the product announcement, run verbatim as a user would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jukebox.tape.tape import Tape

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "seed_example.py"
FORK_EXAMPLE = REPO / "examples" / "seed_fork.py"
SEED_DOC = Path("/work/shared/seed-example.md")
LEDGER = Path("tapes") / "staged_ledger_demo.json"
JUKEBOX = Path(sys.executable).parent / "jukebox"


def test_example_is_the_seed_verbatim() -> None:
    if not SEED_DOC.exists():
        pytest.skip("the shared seed document is not present on this machine")
    blocks = re.findall(r"```python\n(.*?)```", SEED_DOC.read_text(), re.S)
    assert EXAMPLE.read_text() == blocks[0]
    assert FORK_EXAMPLE.read_text() == blocks[1]


def _example(cwd: Path, amount: str = "420.00") -> Path:
    text = EXAMPLE.read_text()
    if amount != "420.00":
        text = text.replace('run_accounting_agent("cust_9981", 420.00)',
                            f'run_accounting_agent("cust_9981", {amount})')
        assert amount in text
    path = cwd / "example.py"
    path.write_text(text)
    return path


def _run(cwd: Path, watch: Path | None = None, script: str = "example.py"
         ) -> tuple[subprocess.CompletedProcess[str], bool]:
    """Run a script in cwd; with `watch`, poll for that path the whole time it runs."""
    env = {k: v for k, v in os.environ.items() if k != "JUKEBOX_TAPE_DIR"}
    proc = subprocess.Popen(
        [sys.executable, script], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    seen = False
    if watch is not None:
        while proc.poll() is None:
            seen = seen or watch.exists()
            time.sleep(0.0002)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen


def _ls_rows(cwd: Path) -> list[list[str]]:
    ls = subprocess.run([str(JUKEBOX), "ls", "--tape-dir", "./tapes"], cwd=cwd,
                        capture_output=True, text=True, check=True)
    lines = ls.stdout.splitlines()
    assert lines[0].split()[:3] == ["TRACK", "ID", "STARTED"]
    # The start time (date, time, zone) is dropped: the rows compare as recorded.
    return [line.split()[:1] + line.split()[4:] for line in lines[1:]]


def test_commit_prints_the_announced_result_and_lists_as_announced(tmp_path: Path) -> None:
    _example(tmp_path)
    proc, _ = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "{'status': 'COMMITTED', 'tape_id': 'tr_8f92a1c4'}\n"
    ledger = tmp_path / LEDGER
    assert ledger.read_text() == '{"customer": "cust_9981", "refund_usd": 420.0}'
    assert _ls_rows(tmp_path) == [
        ["tr_8f92a1c4", "invoice-reconciliation-agent", "5", "$0.0080", "COMMITTED"]
    ]
    for command in (["verify"], ["replay"], ["log"], ["diff"]):
        target = "./tapes/tr_8f92a1c4.jbx" if command != ["diff"] else "tr_8f92a1c4@2"
        done = subprocess.run([str(JUKEBOX), *command, target, "--tape-dir", "./tapes"],
                              cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        if command == ["diff"]:
            assert "A  tapes/staged_ledger_demo.json" in done.stdout


def test_rollback_never_shows_the_file_and_the_tape_says_why(tmp_path: Path) -> None:
    _example(tmp_path, "900.00")
    proc, seen = _run(tmp_path, watch=tmp_path / LEDGER)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "{'status': 'ROLLED_BACK', 'tape_id': 'tr_8f92a1c4'}\n"
    assert not seen
    assert not (tmp_path / LEDGER).exists()
    assert [p.name for p in (tmp_path / "tapes").iterdir() if not p.name.startswith(".")] == [
        "tr_8f92a1c4.jbx"
    ]
    assert _ls_rows(tmp_path) == [
        ["tr_8f92a1c4", "invoice-reconciliation-agent", "5", "$0.0080", "ROLLED_BACK"]
    ]
    tape = Tape.load(tmp_path / "tapes" / "tr_8f92a1c4.jbx")
    final = [f for f in tape.frames if f.kind == "rollback" and f.payload.get("final") is True]
    assert len(final) == 1
    assert final[0].payload["reason"] == "Refund exceeds $500 autonomous threshold"
    assert tape.verify().ok


def test_running_it_twice_keeps_both_tapes(tmp_path: Path) -> None:
    _example(tmp_path)
    first, _ = _run(tmp_path)
    first_bytes = (tmp_path / "tapes" / "tr_8f92a1c4.jbx").read_bytes()
    second, _ = _run(tmp_path)
    for proc in (first, second):
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "{'status': 'COMMITTED', 'tape_id': 'tr_8f92a1c4'}\n"
    tapes = tmp_path / "tapes"
    # The earlier run moved aside byte for byte; the id names the latest run.
    assert (tapes / "tr_8f92a1c4.1.jbx").read_bytes() == first_bytes
    latest = Tape.load(tapes / "tr_8f92a1c4.jbx")
    assert latest.frames[0].payload["previous_run"] == "tr_8f92a1c4.1.jbx"
    rows = _ls_rows(tmp_path)
    assert len(rows) == 2 and all(r[-1] == "COMMITTED" for r in rows)
    assert (tmp_path / LEDGER).exists()


def test_a_second_process_sees_nothing_while_the_first_is_staged(tmp_path: Path) -> None:
    """Staged writes stay in the layer: another reader of the real tree sees nothing."""
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, time\n"
        "from jukebox import Jukebox\n"
        "jb = Jukebox(tape_dir='./tapes')\n"
        "with jb.transaction() as tx:\n"
        "    tx.stage_file_write('out.txt', 'hello')\n"
        "    assert tx.fs.read('out.txt') == b'hello'\n"
        "    print('staged', flush=True)\n"
        "    sys.stdin.readline()\n"
        "    tx.commit()\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "staged\n"
        assert not (tmp_path / "out.txt").exists()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "out.txt").read_text() == "hello"


def test_import_jukebox_stays_cheap() -> None:
    code = (
        "import sys, jukebox\n"
        "heavy = [m for m in ('jukebox.api.api', 'jukebox.api.transaction', 'shadowfs.layer', "
        "'shadowfs.store') if m in sys.modules]\n"
        "print(heavy)\n"
        "jukebox.Jukebox\n"
        "print('jukebox.api.api' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\nTrue\n"




def test_the_fork_snippet_prints_a_report_of_the_b_side(tmp_path: Path) -> None:
    """The seed's second snippet, verbatim, after the first: a B side sharing frames 0..2,
    re-executed from frame 3 in a scratch copy, and a markdown report."""
    _example(tmp_path)
    first, _ = _run(tmp_path)
    assert first.returncode == 0, first.stderr
    ledger = tmp_path / LEDGER
    stamp = ledger.stat().st_mtime_ns
    (tmp_path / "fork.py").write_text(FORK_EXAMPLE.read_text())
    proc, _ = _run(tmp_path, script="fork.py")
    assert proc.returncode == 0, proc.stderr
    md = proc.stdout
    assert md.startswith("# Tape comparison: tr_8f92a1c4 vs tr_")
    for section in ("## Re-execution", "## Shared prefix", "## Fork (B)", "## Models",
                    "## Messages", "## Files", "## Tokens and cost"):
        assert section in md, section
    assert "| frames | 5 | 6 |" in md
    assert "Frames 0..2 (3 frame(s)) are identical byte for byte" in md
    assert "- model override: claude-3-7-sonnet-latest" in md
    assert "- B: gpt-4o (fork override from frame 3: claude-3-7-sonnet-latest)" in md
    assert "All 1 turn(s) match" in md and "The final file states are the same" in md
    assert "| cost | $0.0080 | $0.0080 |" in md
    # The B side is a tape like any other; the real tree and the A side are untouched.
    rows = _ls_rows(tmp_path)
    assert len(rows) == 2 and {r[1] for r in rows} == {"invoice-reconciliation-agent"}
    b_id = md.splitlines()[0].rsplit(" ", 1)[1]
    tape = Tape.load(tmp_path / "tapes" / f"{b_id}.jbx")
    assert [f.kind for f in tape.frames] == [
        "run_start", "agent_turn", "fs", "fork", "commit", "exit"
    ]
    assert tape.verify().ok
    assert ledger.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in (tmp_path / "tapes").iterdir() if not p.name.startswith(".")) \
        == sorted(["staged_ledger_demo.json", "tr_8f92a1c4.jbx", f"{b_id}.jbx"])
