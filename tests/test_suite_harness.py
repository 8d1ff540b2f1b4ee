"""The suite's own machinery (tests/conftest.py): what a test's commands inherit, and how
`pytest -n` keeps tests that share a fixture on one worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

# A child's ignored signals, from its /proc status: bit n-1 for signal n.
IGNORED = "print(int(open('/proc/self/status').read().split('SigIgn:')[1].split()[0], 16))"


def test_a_tests_commands_get_ctrl_c_however_the_suite_was_started() -> None:
    # A suite started with SIGINT and SIGQUIT ignored: once tests/conftest.py is loaded, what
    # its tests start takes them as from a terminal (Python keeps an inherited ignore, and
    # `jukebox view` then never stopped on the SIGINT a test sent).
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {IGNORED!r}])"
    for code, expect_ignored in ((child, True), ("import tests.conftest; " + child, False)):
        # What a shell does to a background job (`make test &`), then the suite's process.
        out = subprocess.run(
            ["sh", "-c", 'trap "" INT QUIT; exec "$0" -c "$1"', sys.executable, code],
            capture_output=True, text=True, cwd=REPO, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        ignored = int(out.stdout)
        for sig in (signal.SIGINT, signal.SIGQUIT):
            assert bool(ignored & (1 << (sig - 1))) is expect_ignored, (code, hex(ignored))


def test_tests_sharing_a_module_fixture_run_on_one_worker_of_pytest_n(tmp_path: Path) -> None:
    # Under `pytest -n 2 --dist loadgroup` two tests using a module-scoped fixture run on one
    # worker, which makes the fixture once; a third sharing nothing may go to the other. Tests
    # using a package-scoped fixture run on one worker too, and with them the other tests of
    # their modules that share a module-scoped one (else made again on the other worker).
    made = tmp_path / "made"

    def once(name: str, scope: str) -> str:
        return (
            f"@pytest.fixture(scope={scope!r})\n"
            f"def {name}():\n"
            f"    with open({str(made)!r}, 'a') as f:\n"
            f"        f.write({name!r} + ' ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        )

    (tmp_path / "test_shared.py").write_text(
        "import os, pytest\n" + once("made_once", "module") +
        "def test_one(made_once):\n    pass\n"
        "def test_two(made_once):\n    pass\n"
        "def test_alone():\n    pass\n"
    )  # fmt: skip
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "conftest.py").write_text("import os, pytest\n" + once("per_package", "package"))
    (pkg / "test_a.py").write_text(
        "import os, pytest\n" + once("per_module", "module") +
        "def test_a1(per_package, per_module):\n    pass\n"
        "def test_a2(per_module):\n    pass\n"
    )  # fmt: skip
    (pkg / "test_b.py").write_text("def test_b1(per_package):\n    pass\n")
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "tests.conftest",
         "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-rA",
         "--rootdir", str(tmp_path), "--confcutdir", str(tmp_path), "test_shared.py", "pkg"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    # Named `...@group`, which is what pytest-xdist's scheduler groups by.
    assert "PASSED test_shared.py::test_one@test_shared.py" in out.stdout, out.stdout
    assert "PASSED test_shared.py::test_alone\n" in out.stdout, out.stdout
    assert "PASSED pkg/test_b.py::test_b1@pkg\n" in out.stdout, out.stdout
    assert "PASSED pkg/test_a.py::test_a2@pkg\n" in out.stdout, out.stdout
    lines = made.read_text().splitlines()
    assert sorted(line.split()[0] for line in lines) == ["made_once", "per_module", "per_package"]
    # The module's fixture on the worker of its package's.
    workers = dict(line.split() for line in lines)
    assert workers["per_module"] == workers["per_package"], lines


def test_the_serial_pass_imports_only_files_that_name_serial_and_misses_no_serial_test(
    tmp_path: Path,
) -> None:
    # `pytest -m serial` (make test's second pass) skips, unimported, a test file that never
    # says "serial"; a serial test such a file would hide (its mark added by a conftest) stops
    # every full collection, as make test's first pass under -n 2 is, and fails it.
    imported = tmp_path / "imported"  # named in no test file: its path says "serial"
    note = "open(__import__('os').environ['IMPORTED'], 'a').write(__name__ + '\\n')\n"
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n" + note +
        "@pytest.mark.serial\ndef test_alone():\n    pass\n"
        "def test_beside():\n    pass\n"
    )  # fmt: skip
    (tmp_path / "test_plain.py").write_text(note + "def test_plain():\n    pass\n")
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(REPO),
           "IMPORTED": str(imported)}  # fmt: skip

    def pytest(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "tests.conftest",
             "-p", "no:cacheprovider", "-rA", "--rootdir", str(tmp_path),
             "--confcutdir", str(tmp_path), *args, "."],
            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
        )  # fmt: skip

    out = pytest("-m", "serial")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASSED test_marked.py::test_alone" in out.stdout, out.stdout
    assert "1 passed, 1 deselected" in out.stdout, out.stdout
    assert imported.read_text() == "test_marked\n"  # test_plain.py was never imported

    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "def pytest_itemcollected(item):\n"
        "    if item.name == 'test_plain':\n"
        "        item.add_marker(pytest.mark.serial)\n"
    )  # fmt: skip
    out = pytest("-m", "not serial", "-n", "2")  # make test's first pass
    assert out.returncode != 0, out.stdout
    said = out.stdout + out.stderr
    assert "would never run the serial tests of test_plain.py" in said, said
