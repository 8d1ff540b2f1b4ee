"""jukebox installed where the image hides (a venv under /tmp, as in a CI checkout) still works
from inside a booth: its interpreter and installation stay reachable, read-only."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.booth.test_booth_run import frames

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


@pytest.fixture
def tmp_venv_python() -> str:
    """A venv under /tmp (hidden by the host image's private /tmp) that loads this checkout."""
    base = Path("/tmp") / f"jukebox-test-tmp-venv-{uuid.uuid4().hex[:8]}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base)], check=True)
    site = next((base / "lib").glob("python3*/site-packages"))
    ours = next((Path(sys.prefix) / "lib").glob("python3*/site-packages"))
    (site / "jukebox-dev.pth").write_text(f"import site; site.addsitedir({str(ours)!r})\n")
    yield str(base / "bin" / "python")
    shutil.rmtree(base, ignore_errors=True)


def test_jukebox_under_a_hidden_tmp_runs_inside_the_booth(
    tmp_path: Path, tmp_venv_python: str
) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    cli = f"{tmp_venv_python} -c 'from jukebox.cli import main; main()'"
    script = f"echo v1 > f.txt && {cli} booth checkpoint --label one && echo v2 > f.txt"
    proc = subprocess.run(
        [
            tmp_venv_python,
            "-c",
            "from jukebox.cli import main; main()",
            "booth",
            "run",
            "--tree",
            str(tree),
            "--tape-dir",
            str(tapes),
            "--tape-id",
            "t1",
            "--",
            "sh",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tree / "f.txt").read_text() == "v2\n"
    assert [f["payload"].get("label") for f in frames(tapes) if f["kind"] == "checkpoint"] == [
        "one"
    ]
    # The installation is reachable, never writable: the agent cannot plant code in it.
    probe = subprocess.run(
        [
            tmp_venv_python,
            "-c",
            "from jukebox.cli import main; main()",
            "booth",
            "run",
            "--tree",
            str(tree),
            "--tape-dir",
            str(tapes),
            "--tape-id",
            "t2",
            "--commit",
            "never",
            "--",
            "sh",
            "-c",
            f"touch {Path(tmp_venv_python).parent}/planted",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert probe.returncode != 0
    assert not (Path(tmp_venv_python).parent / "planted").exists()
