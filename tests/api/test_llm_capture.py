"""Model calls made with the real OpenAI and Anthropic SDKs inside @jb.track reach the tape."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from jukebox.api.api import Jukebox
from jukebox.guard.breaker import CircuitBreaker
from jukebox.redact import REDACTED
from jukebox.tape.tape import Tape
from tests.llm.upstream import FakeUpstream

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

OPENAI_KEY = "sk-test-" + "Q" * 24
ANTHROPIC_KEY = "sk-ant-test-" + "Z" * 24


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeUpstream]:
    """The fake provider, named by the same variables a user sets for a real one."""
    up = FakeUpstream().start()
    monkeypatch.setenv("OPENAI_BASE_URL", up.openai_url)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", up.url)
    monkeypatch.setenv("OPENAI_API_KEY", OPENAI_KEY)
    monkeypatch.setenv("ANTHROPIC_API_KEY", ANTHROPIC_KEY)
    yield up
    up.stop()


def test_sdk_calls_land_on_the_open_transactions_tape(
    jb: Jukebox, upstream: FakeUpstream, work: Path
) -> None:
    @jb.track(name="sdk-agent")
    def agent(question: str) -> str:
        # Clients made inside the call, configured only by the environment, as users write them.
        o = openai.OpenAI(max_retries=0)
        a = anthropic.Anthropic(max_retries=0)
        with jb.transaction(tape_id="sdk") as tx:
            first = o.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": question}]
            )
            second = a.messages.create(
                model="claude-3-5-haiku-latest", max_tokens=50,
                messages=[{"role": "user", "content": "and again"}],
            )
            tx.stage_file_write("answer.txt", first.choices[0].message.content or "")
            tx.commit()
        # Outside any transaction: the run gets a tape of its own for this call.
        o.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "after"}]
        )
        return second.content[0].text

    assert agent("hello there") == "echo: and again"
    assert os.environ["OPENAI_BASE_URL"] == upstream.openai_url  # put back after the run
    assert len(upstream.seen) == 3
    tape = Tape.load(jb.tapes.tape_path("sdk"))
    kinds = [f.kind for f in tape.frames]
    assert kinds == ["run_start", "llm_turn", "llm_turn", "fs", "commit", "exit"]
    turns = [f.payload for f in tape.frames if f.kind == "llm_turn"]
    assert [(t["provider"], t["endpoint"]) for t in turns] == [
        ("openai", "chat.completions"), ("anthropic", "messages")
    ]
    assert (work / "answer.txt").read_text() == "echo: hello there"
    raw = jb.tapes.tape_path("sdk").read_bytes()
    assert OPENAI_KEY.encode() not in raw and ANTHROPIC_KEY.encode() not in raw
    others = [p for p in jb.tapes.tape_paths() if p.name != "sdk.jbx"]
    assert len(others) == 1
    own = Tape.load(others[0])
    assert [f.kind for f in own.frames] == ["run_start", "llm_turn", "exit"]
    assert own.frames[0].payload["run"]["id"] == tape.frames[0].payload["run"]["id"]
    assert own.verify().ok and tape.verify().ok



def test_the_proxys_secret_stays_off_the_runs_record(
    jb: Jukebox, upstream: FakeUpstream, work: Path
) -> None:
    """The base URL a tracked call finds in its environment carries the proxy's secret; a call
    handed it, returning it or failing with it in its message (as `requests` and httpx errors
    name the URL) records it redacted, like the environment's secret values."""
    urls: list[str] = []

    def ask(url: str) -> None:
        openai.OpenAI(max_retries=0).chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "at " + url}]
        )

    @jb.track(name="handed")
    def handed(url: str) -> str:
        ask(url)
        return url

    @jb.track(name="failing")
    def failing(url: str) -> None:
        ask(url)
        raise ConnectionError(f"Max retries exceeded with url: {url}/models")

    @jb.track(name="outer")
    def outer() -> str:
        urls.append(os.environ["OPENAI_BASE_URL"])
        handed(urls[0])
        with pytest.raises(ConnectionError):
            failing(urls[0])
        return urls[0]

    outer()
    secret = urls[0].split("/")[3]
    assert len(secret) == 43 and len(upstream.seen) == 2
    frames = [f.payload for p in jb.tapes.tape_paths() for f in Tape.load(p).frames]
    starts = {f["name"]: f["run"]["args"] for f in frames if "run" in f and "name" in f}
    assert starts["handed"]["values"] == starts["failing"]["values"] == {"url": REDACTED}
    ends = [f for f in frames if "code" in f]
    # handed's (outer made no model call of its own: it has no tape)
    assert [f["result"] for f in ends if "result" in f] == [REDACTED]
    (error,) = [f["error"] for f in ends if "error" in f]
    shown = urls[0].replace(secret, REDACTED)
    assert error["message"] == f"Max retries exceeded with url: {shown}/models"
    on_disk = b"".join(p.read_bytes() for p in jb.tapes.path.rglob("*") if p.is_file())
    assert secret.encode() not in on_disk

def test_the_breaker_stops_sdk_calls_and_the_transaction_rolls_back(
    work: Path, upstream: FakeUpstream
) -> None:
    jb = Jukebox(tape_dir="tapes", breaker=CircuitBreaker(max_turns=1))

    @jb.track(name="looping")
    def agent() -> None:
        o = openai.OpenAI(max_retries=0)
        with jb.transaction(tape_id="loop") as tx:
            tx.stage_file_write("out.txt", "x")
            for _ in range(3):
                o.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "again"}]
                )
            tx.commit()

    with pytest.raises(openai.BadRequestError, match="circuit breaker"):
        agent()
    tape = Tape.load(jb.tapes.tape_path("loop"))
    kinds = [f.kind for f in tape.frames]
    assert "breaker" in kinds and kinds[-2:] == ["rollback", "exit"]
    assert tape.summary()["status"] == "ROLLED_BACK"
    assert not (work / "out.txt").exists()
    jb.close()


def test_capture_can_be_turned_off(jb: Jukebox, upstream: FakeUpstream) -> None:
    quiet = Jukebox(tape_dir=jb.tapes.path, capture_llm="never")

    @quiet.track
    def agent() -> None:
        assert os.environ["OPENAI_BASE_URL"] == upstream.openai_url

    agent()
    with pytest.raises(ValueError, match="capture_llm"):
        Jukebox(tape_dir=jb.tapes.path, capture_llm="sometimes")
    quiet.close()


def test_an_unpriced_model_is_the_current_runs_decision(
    work: Path, upstream: FakeUpstream
) -> None:
    jb = Jukebox(tape_dir="tapes", breaker=CircuitBreaker(max_cost_usd=1.0, unknown_cost="deny"))

    @jb.track(name="unpriced")
    def agent() -> None:
        o = openai.OpenAI(max_retries=0)
        with jb.transaction(tape_id="unpriced"):
            o.chat.completions.create(
                model="local-llama", messages=[{"role": "user", "content": "hi"}]
            )

    with pytest.raises(openai.BadRequestError, match="unknown_cost"):
        agent()
    assert not any(path.endswith("/chat/completions") for _, path, _, _ in upstream.seen)
    jb.close()

    priced = Jukebox(
        tape_dir="tapes2",
        breaker=CircuitBreaker(max_cost_usd=1.0, unknown_cost="price=1000/1000"),
    )

    @priced.track(name="priced")
    def agent2() -> None:
        o = openai.OpenAI(max_retries=0)
        with priced.transaction(tape_id="priced") as tx:
            o.chat.completions.create(
                model="local-llama", messages=[{"role": "user", "content": "hi"}]
            )
            tx.commit()

    agent2()
    turns = [f for f in Tape.load(priced.tapes.tape_path("priced")).frames if f.kind == "llm_turn"]
    assert len(turns) == 1 and turns[0].payload["cost_usd"] > 0
    priced.close()
