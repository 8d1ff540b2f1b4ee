"""A recorded booth run shared by the time-travel tests: the agent in agent.py, three turns,
recorded once (package-scoped: under `pytest -n` its tests run on one worker,
tests/conftest.py) against the fake upstream, which keeps running (forks go live)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.llm.upstream import FakeUpstream

AGENT = str(Path(__file__).with_name("agent.py"))
JUKEBOX = str(Path(sys.executable).parent / "jukebox")
DEAD = "http://127.0.0.1:9"  # nothing listens there: a run pointed at it is offline


@dataclass
class Recording:
    upstream: FakeUpstream
    tree: Path
    tapes: Path
    tape: Path
    stdout: str  # what the agent printed: its model replies, one JSON per line
    files: dict[str, str]

    def env(self, live: bool = False, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("JB_")}
        env["OPENAI_BASE_URL"] = self.upstream.openai_url if live else DEAD + "/v1"
        env["ANTHROPIC_BASE_URL"] = self.upstream.url if live else DEAD
        env.update(extra)
        return env

    def jukebox(self, *args: str, live: bool = False, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [JUKEBOX, *args], capture_output=True, text=True, env=self.env(live, **extra),
            timeout=90, cwd="/",
        )  # fmt: skip


@pytest.fixture(scope="package")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recording]:
    if os.geteuid() != 0:
        pytest.skip("booths here run as root")
    root = tmp_path_factory.mktemp("timetravel")
    tree, tapes = root / "tree", root / "tapes"
    tree.mkdir()
    (tree / "README").write_text("the agent's tree\n")
    upstream = FakeUpstream().start()
    rec = Recording(upstream, tree, tapes, tapes / "rec.jbx", "", {})
    try:
        proc = rec.jukebox(
            "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "rec",
            "--", sys.executable, AGENT, live=True,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        rec.stdout = proc.stdout
        rec.files = {p.name: p.read_text() for p in sorted(tree.iterdir())}
        yield rec
    finally:
        upstream.stop()
