"""A booth's verdict is on disk before its record goes and before `booth run` returns: traced
with strace (the real system calls of a real booth), since no timing can show an order."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


def _traced_booth(tmp_path: Path, *args: str, code: int = 0) -> tuple[list[str], Path, str]:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("no strace (make installs it)")
    tree, tapes, log = tmp_path / "tree", tmp_path / "tapes", tmp_path / "strace.log"
    tree.mkdir(exist_ok=True)
    (tree / "a.txt").write_text("one\n")
    proc = subprocess.run(
        [strace, "-f", "-qq", "-y", "-s", "64", "-o", str(log),
         "-e", "trace=write,fdatasync,fsync,unlink",
         str(Path(sys.executable).parent / "jukebox"), "booth", "run", "--tree", str(tree),
         "--tape-dir", str(tapes), "--tape-id", "t1", *args],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr
    # One line per call: strace splits a call another thread interrupted in two lines.
    lines = [line for line in log.read_text().splitlines() if "resumed>" not in line]
    return lines, tapes / "t1.jbx", proc.stderr


def _order(lines: list[str], tape: Path, verdict: str) -> tuple[int, int, int]:
    """(the line writing the verdict frame, the tape's first fdatasync after it, the unlink of
    the booth's record)."""
    frame = rf'write\(\d+<{re.escape(str(tape))}>, ".*\\"kind\\":\\"{verdict}\\"'
    wrote = [i for i, line in enumerate(lines) if re.search(frame, line)]
    assert len(wrote) == 1, lines
    synced = [i for i, line in enumerate(lines)
              if i > wrote[0] and re.search(rf"fdatasync\(\d+<{re.escape(str(tape))}>\) = 0",
                                            line)]  # fmt: skip
    gone = [i for i, line in enumerate(lines)
            if re.search(r'unlink\(".*/booths/t1\.json"\) = 0', line)]  # fmt: skip
    assert synced and len(gone) == 1, lines
    return wrote[0], synced[0], gone[0]


def test_a_booth_with_nothing_to_commit_syncs_its_verdict_before_its_record_goes(
    tmp_path: Path,
) -> None:
    lines, tape, stderr = _traced_booth(tmp_path, "--", "true")
    assert "no changes to commit" in stderr
    wrote, synced, gone = _order(lines, tape, "commit")
    assert wrote < synced < gone


def test_a_discarded_booth_syncs_its_verdict_before_its_record_goes(tmp_path: Path) -> None:
    lines, tape, stderr = _traced_booth(
        tmp_path, "--", "sh", "-c", "echo two > a.txt; exit 3", code=3
    )
    assert "rolled back" in stderr
    assert (tmp_path / "tree" / "a.txt").read_text() == "one\n"  # rolled back
    wrote, synced, gone = _order(lines, tape, "rollback")
    assert wrote < synced < gone
