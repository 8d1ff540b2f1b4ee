"""`fork --model` per provider: a run calling both OpenAI and Anthropic (the real SDKs, in a
booth), forked with a model for each, or a bare name for the provider of the frame forked at,
sends each provider's calls its own model and leaves the other provider's alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jukebox.tape.tape import Tape
from shadowfs.store import Store
from tests.llm.conftest import ANTHROPIC_KEY, OPENAI_KEY
from tests.llm.upstream import FakeUpstream
from tests.timetravel.conftest import JUKEBOX

SCENARIO = str(Path(__file__).parents[1] / "llm" / "scenario.py")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")


class Both:
    def __init__(self, upstream: FakeUpstream, tapes: Path) -> None:
        self.upstream = upstream
        self.tapes = tapes

    def jukebox(self, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, OPENAI_API_KEY=OPENAI_KEY, ANTHROPIC_API_KEY=ANTHROPIC_KEY)
        env.update(OPENAI_BASE_URL=self.upstream.openai_url, ANTHROPIC_BASE_URL=self.upstream.url)
        env["JUKEBOX_TAPE_DIR"] = str(self.tapes)
        return subprocess.run(
            [JUKEBOX, *args], capture_output=True, text=True, env=env, timeout=120, cwd="/"
        )

    def calls(self, provider: str) -> list[int]:
        with Store.open(self.tapes / ".jukebox" / "store") as store:
            frames = Tape.load(self.tapes / "both.jbx", store).frames
            return [
                f.seq for f in frames if f.kind == "llm_turn" and f.payload["provider"] == provider
            ]

    def models_sent(self, since: int) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {"openai": set(), "anthropic": set()}
        for _, path, _, body in self.upstream.seen[since:]:
            out["anthropic" if path.startswith("/v1/messages") else "openai"].add(body["model"])
        return out


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Both]:
    root = tmp_path_factory.mktemp("fork-models")
    (root / "tree").mkdir()
    upstream = FakeUpstream().start()
    try:
        rec = Both(upstream, root / "tapes")
        proc = rec.jukebox("booth", "run", "--tree", str(root / "tree"), "--tape-id", "both",
                           "--", sys.executable, SCENARIO, "out.json")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        yield rec
    finally:
        upstream.stop()


def test_each_provider_gets_its_own_model(both: Both) -> None:
    at = min(both.calls("openai") + both.calls("anthropic"))  # every call goes live
    since = len(both.upstream.seen)
    proc = both.jukebox(
        "fork", "both", "--at", str(at), "--exec", "--model", "openai=gpt-4.1-mini",
        "--model", "anthropic=claude-sonnet-4-5", "--tape-id", "per-provider", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert both.models_sent(since) == {
        "openai": {"gpt-4.1-mini"},
        "anthropic": {"claude-sonnet-4-5"},
    }
    result = json.loads(proc.stdout)
    assert result["overrides"] == {
        "model": {"openai": "gpt-4.1-mini", "anthropic": "claude-sonnet-4-5"}
    }
    # The fork tape replays strictly: each provider's calls are matched with its own override.
    replay = both.jukebox("replay", "per-provider", "--exec", "--no-record")
    assert replay.returncode == 0, replay.stderr


def test_a_bare_name_is_for_the_provider_of_the_frame_forked_at(both: Both) -> None:
    at = both.calls("anthropic")[0]
    since = len(both.upstream.seen)
    proc = both.jukebox(
        "fork", "both", "--at", str(at), "--exec", "--model", "claude-other", "--tape-id", "bare"
    )
    assert proc.returncode == 0, proc.stderr
    sent = both.models_sent(since)
    assert sent["anthropic"] == {"claude-other"}
    # OpenAI calls after the fork keep the models the agent asked for.
    assert sent["openai"] and "claude-other" not in sent["openai"]
    assert "model='anthropic=claude-other'" in proc.stderr


def test_bad_model_options_are_refused_before_anything_is_written(both: Both) -> None:
    before = sorted(both.tapes.glob("*.jbx"))
    for args, said in (
        (("--model", "mistral=large"), "unknown provider 'mistral' in --model mistral=large"),
        (("--model", "a", "--model", "b"), "one bare model name at most"),
        (("--model", "openai=x", "--model", "openai=y"), "give each provider one non-empty model"),
        (("--model", "m", "--model", "openai=x"), "which --model openai=x names already"),
    ):
        proc = both.jukebox("fork", "both", "--at", str(both.calls("openai")[0]), *args)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert sorted(both.tapes.glob("*.jbx")) == before
