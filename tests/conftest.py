"""Suite-wide fixtures. File-system fixtures that mount things live in tests/fs/conftest.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _absolute_pythonpath() -> None:
    """Children started in another directory (booth tests run theirs from `/`) must import the
    checkout under test: a relative PYTHONPATH such as `.`, which a run from a worktree sets,
    would name their own directory and let them import whatever the venv installed instead."""
    raw = os.environ.get("PYTHONPATH")
    if raw:
        entries = [str(Path(e).resolve()) if e else e for e in raw.split(os.pathsep)]
        os.environ["PYTHONPATH"] = os.pathsep.join(entries)


_absolute_pythonpath()


def _terminal_keys() -> None:
    """The commands a test starts get Ctrl-C and Ctrl-\\ as from a terminal, however the suite
    was started. A shell starts a background job (`make test &`, `nohup ... &`, some CI runners)
    with SIGINT and SIGQUIT ignored; an ignore is inherited across exec, and Python keeps an
    inherited one instead of raising KeyboardInterrupt. `jukebox view`, `jukebox log -f` and
    every other child would then ignore the SIGINT a test sends as Ctrl-C, and the test wait
    out its timeout (what failed `make test` in the background, serially or under -n 2)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


_terminal_keys()


def _slowdown() -> float:
    raw = os.environ.get("JUKEBOX_TEST_SLOWDOWN", "1")
    try:
        factor = float(raw)
    except ValueError:
        raise SystemExit(  # a one-line error, not a traceback from every test module
            f"JUKEBOX_TEST_SLOWDOWN={raw!r} is not a number: set a factor like 10"
        ) from None
    return max(factor, 1.0)


SLOWDOWN = _slowdown()


def slow(seconds: float) -> float:
    """A test's wait for something that takes real time (a child to answer, a booth to start),
    stretched by JUKEBOX_TEST_SLOWDOWN on slow machines: `make vm-test` sets it under software
    emulation. The default, 1, leaves every wait as written."""
    return seconds * SLOWDOWN


@pytest.fixture
def jukebox_cli(tmp_path: Path):
    """Runs the real `jukebox` console script in a subprocess, as a user would."""
    import subprocess

    def run(*args: str, check: bool = False, **kwargs) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, **kwargs.pop("env", {}))
        env.setdefault("JUKEBOX_TAPE_DIR", str(tmp_path / "tapes"))
        exe = Path(sys.executable).parent / "jukebox"
        proc = subprocess.run(
            [str(exe), *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=kwargs.pop("cwd", tmp_path),
            **kwargs,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"jukebox {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
            )
        return proc

    return run


@pytest.fixture(autouse=True, scope="session")
def no_user_config() -> None:
    """The developer's own ~/.config/jukebox/config.toml must not change what a test sees: every
    test, and every jukebox it starts (as nobody too), looks for its config in a directory that
    does not exist, unless it names its own."""
    import tempfile

    os.environ.pop("JUKEBOX_CONFIG", None)
    os.environ["XDG_CONFIG_HOME"] = os.path.join(
        tempfile.gettempdir(), f"jukebox-tests-no-config-{os.getpid()}"
    )
    # Nor the developer's own `jukebox warm` server: a test's jukebox would run in its child,
    # not as the test's own child process (tests/booth/test_warm.py starts its own servers).
    os.environ["JUKEBOX_WARM"] = "off"


def left_out_of_serial_pass(path: Path) -> bool:
    """Whether `pytest -m serial` skips a file without importing it: a test file whose text
    never names `serial` (in any case: `@pytest.mark.serial`, `pytestmark = ...`, an alias
    `SERIAL = ...`) holds no serial test."""
    if path.suffix != ".py" or not path.name.startswith("test_") or not path.is_file():
        return False
    return b"serial" not in path.read_bytes().lower()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`pytest -m serial` (make test's second pass) imports only the test files that can hold
    a serial test: collecting the whole suite to select 17 tests took 12 s. A serial mark that
    comes from elsewhere (a conftest adding it) is refused at every full collection, as make
    test's first pass is (`_no_serial_test_left_out`), so no such test is silently dropped."""
    if config.getoption("markexpr", "") == "serial" and left_out_of_serial_pass(collection_path):
        return True
    return None


def _no_serial_test_left_out(session: pytest.Session, items: list[pytest.Item]) -> None:
    left_out = sorted({item.nodeid.split("::", 1)[0] for item in items
                       if item.get_closest_marker("serial") is not None
                       and left_out_of_serial_pass(item.path)})  # fmt: skip
    if left_out:  # stops the run (a UsageError in a worker of pytest -n loses its message)
        session.shouldfail = (
            f"`pytest -m serial` would never run the serial tests of {', '.join(left_out)}: "
            "it skips a test file whose text never says 'serial' (tests/conftest.py)"
        )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(session: pytest.Session, items: list[pytest.Item]) -> None:
    """Under `pytest -n` (make test), a test sharing a module- or package-scoped fixture runs
    on the same worker as the other tests of that module or package, so the fixture (a booth
    run, a recorded tape, a wheel, Arize Phoenix) is made once, not once per worker or each
    time a worker comes back to the module. Every other test goes to whichever worker is free."""
    _no_serial_test_left_out(session, items)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process runs everything (and pytest-xdist may not even be loaded)
    groups: dict[pytest.Item, str] = {}
    package_of: dict[str, str] = {}  # a module to the package group one of its tests is in
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        module = item.nodeid.split("::", 1)[0]
        for name in item.fixturenames:
            defs = info.name2fixturedefs.get(name)
            scope = defs[-1].scope if defs else None
            if scope == "package":
                groups[item] = package_of[module] = defs[-1].baseid or "tests"
                break
            if scope == "module":
                groups[item] = module
    for item, group in groups.items():
        # A module's tests stay together: one of them in its package's group takes the others
        # (their module-scoped fixtures would be made again on the other worker).
        group = package_of.get(group, group)
        item.add_marker(pytest.mark.xdist_group(group))
        _name_group(item, group)


def _name_group(item: pytest.Item, group: str) -> None:
    """What pytest-xdist does with an xdist_group mark, done here: the group goes at the end of
    the test's id (`...::test@group`), which is all its scheduler groups by. pytest-xdist 3.8
    sets `item._nodeid`, which pytest 9 no longer reads (an item's id is `item._id`): without
    this every test was scheduled alone, its module's fixtures made again on each worker."""
    if item.nodeid.endswith(f"@{group}"):
        return  # named already (a pytest-xdist that does it itself)
    try:
        from _pytest.nodeid import coerce_node_id  # private: a later pytest may move it
    except ImportError:  # a pytest that reads item._nodeid (8), or one without the function:
        item._nodeid = f"{item.nodeid}@{group}"  # grouped as pytest-xdist does, or not at all
        return
    item._id = coerce_node_id(f"{item.nodeid}@{group}")
