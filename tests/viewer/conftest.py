"""Fixtures of the viewer tests: tapes recorded by really running an agent in a booth (with the
fake model upstream), `jukebox view` run as a user runs it, and one headless Chromium (Debian's,
driven by Playwright) shared by the module. Screenshots go to $JUKEBOX_TEST_ARTEFACTS when set,
else to a `viewer-screenshots` dir under pytest's tmp dir (docs/viewer.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.llm.upstream import FakeUpstream

AGENT = str(Path(__file__).with_name("agent.py"))
JUKEBOX = str(Path(sys.executable).parent / "jukebox")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root Chromium refuses its own sandbox (the pages here are the tests' own); a container's
# small /dev/shm would crash its renderer.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage"]


@dataclass
class Tapes:
    dir: Path
    tree: Path
    rec: Path  # the run: three turns, checkpoints, a rollback, a verifier, committed
    fork: Path  # rec forked at its second model call with another model
    tripped: Path  # a run the breaker stopped (--max-turns 1)
    fork_at: int


def jukebox(
    *args: str, env: dict[str, str] | None = None, **kw: Any
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [JUKEBOX, *args], capture_output=True, text=True, env=env, timeout=90, cwd="/", **kw
    )


# Package-scoped, not session: under `pytest -n` the tests using it then run on one worker
# (tests/conftest.py), which records these runs once instead of once per worker.
@pytest.fixture(scope="package")
def tapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tapes]:
    if os.geteuid() != 0:
        pytest.skip("booths here run as root")
    from jukebox.tape.tape import Tape

    root = tmp_path_factory.mktemp("viewer")
    tree, tapes_dir = root / "tree", root / "tapes"
    tree.mkdir()
    (tree / "README").write_text("the agent's tree\n")
    upstream = FakeUpstream().start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JB_")}
    env["OPENAI_BASE_URL"] = upstream.openai_url
    other = root / "other-tree"  # the breaker's run, beside the first (a booth each)
    other.mkdir()
    tripping = subprocess.Popen(
        [JUKEBOX, "booth", "run", "--tree", str(other), "--tape-dir", str(tapes_dir),
         "--tape-id", "tripped", "--max-turns", "1", "--", sys.executable, AGENT],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/",
    )  # fmt: skip
    try:
        run = jukebox(
            "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes_dir), "--tape-id", "rec",
            "--verify", "test -f notes.txt", "--", sys.executable, AGENT, env=env,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        rec = tapes_dir / "rec.jbx"
        turns = [f.seq for f in Tape.load(rec).frames if f.kind == "llm_turn"]
        fork_at = turns[1]
        fork = jukebox(
            "fork", str(rec), "--at", str(fork_at), "--model", "gpt-4.1", "--exec",
            "--tape-id", "fork", "--tape-dir", str(tapes_dir), env=env,
        )  # fmt: skip
        assert fork.returncode == 0, fork.stderr
        _, err = tripping.communicate(timeout=90)
        assert tripping.returncode != 0 and "max_turns" in err, err
        yield Tapes(
            tapes_dir, tree, rec, tapes_dir / "fork.jbx", tapes_dir / "tripped.jbx", fork_at
        )
    finally:
        if tripping.poll() is None:
            tripping.kill()
            tripping.wait()
        upstream.stop()


@pytest.fixture(scope="session")
def artefacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    named = os.environ.get("JUKEBOX_TEST_ARTEFACTS")
    if named:
        path = Path(named) / "viewer"
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("viewer-screenshots")


# Module-scoped: sync Playwright keeps its event loop marked running on this thread until it
# stops, and a later test's `asyncio.run` (tests/export) refuses to start under it.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright import sync_api as playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is not installed: run `make setup` (APT_PACKAGES)")
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.errors = []  # type: ignore[attr-defined]
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    yield page
    context.close()


class Served:
    """`jukebox view ... --json` running: its URL, and its process to stop."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [JUKEBOX, "view", *args, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd="/",
        )  # fmt: skip
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.proc.wait(10)
            raise AssertionError(f"jukebox view did not start: {self.proc.stderr.read()}")  # type: ignore[union-attr]
        started = json.loads(line)
        self.url: str = started["url"]
        self.port: int = started["port"]

    def stop(self) -> subprocess.CompletedProcess:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        out, err = self.proc.communicate(timeout=20)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[Served] = []

    def start(*args: str) -> Served:
        server = Served(*args)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
