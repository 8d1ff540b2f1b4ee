"""shadowfs.mountinfo reads mount points as the kernel escapes them in /proc/self/mountinfo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shadowfs.mountinfo import mounts_at, unescape


def test_unescape_decodes_octal_escapes_and_passes_plain_fields_through() -> None:
    assert unescape("/var/tmp/plain") == "/var/tmp/plain"
    assert unescape(r"/a\040b\011c\012d\134e") == "/a b\tc\nd\\e"
    assert unescape("") == ""
    # A backslash that does not start three digits is kept as it is.
    assert unescape(r"/x\4") == r"/x\4"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounts in a private mount namespace: needs root and unshare(1)")
def test_mounts_at_finds_mount_points_with_and_without_escapes(tmp_path: Path) -> None:
    plain, spaced = tmp_path / "plain", tmp_path / "with space\\and backslash"
    plain.mkdir()
    spaced.mkdir()
    # In a mount namespace of its own: the mounts go with the process, nothing is left behind.
    script = (
        "import subprocess, sys\n"
        "from shadowfs.mountinfo import mounts_at\n"
        "for p in sys.argv[1:]:\n"
        "    subprocess.run(['mount', '-t', 'tmpfs', 'tmpfs', p], check=True)\n"
        "    found = mounts_at(p)\n"
        "    assert [(m.mount_point, m.fstype) for m in found] == [(p, 'tmpfs')], found\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", script,
         str(plain), str(spaced)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert mounts_at(spaced) == []  # never in this namespace
