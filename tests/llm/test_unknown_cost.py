"""A model without a price under --max-cost-usd is a decision (deny, warn, a price), never a
silent $0. Real openai SDK, fake upstream."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jukebox.guard.breaker import CircuitBreaker
from tests.llm.conftest import Recording, clients
from tests.llm.upstream import FakeUpstream

UNPRICED = "gpt-5.1-unpriced"


def ask(o: Any, model: str = UNPRICED) -> Any:
    return o.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])


def notes(recording: Recording) -> list[dict[str, Any]]:
    return [f.payload for f in recording.tape().frames if f.kind == "note"]


def test_deny_refuses_an_unpriced_model_before_forwarding(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import openai

    breaker = CircuitBreaker(max_cost_usd=1.0, unknown_cost="deny")
    with recording.proxy(upstream, breaker=breaker) as proxy:
        o, _ = clients(proxy.base_urls())
        with pytest.raises(openai.BadRequestError, match=r"unknown_cost.*has no price") as caught:
            ask(o)
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert upstream.seen == []
    assert proxy.trip is not None and proxy.trip.rule == "unknown_cost"  # the proxy's own trip


def test_warn_says_so_once_on_stderr_and_on_the_tape(
    upstream: FakeUpstream, recording: Recording, capfd: pytest.CaptureFixture[str]
) -> None:
    breaker = CircuitBreaker(max_cost_usd=1.0)  # warn is the default
    with recording.proxy(upstream, breaker=breaker) as proxy:
        o, _ = clients(proxy.base_urls())
        for _ in range(3):
            ask(o)
        ask(o, "gpt-4o")  # priced: no warning
    err = capfd.readouterr().err
    assert err.count("has no price") == 1 and UNPRICED in err
    unpriced = [n for n in notes(recording) if n.get("event") == "unknown_price"]
    assert unpriced == [
        {"event": "unknown_price", "model": UNPRICED, "policy": "warn", "counted": "$0"}
    ]
    assert breaker.tripped is None


def test_a_fallback_price_counts_and_trips_the_cost_limit(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import openai

    # $10,000 per million tokens each way: a call of ~15 tokens costs about $0.15.
    breaker = CircuitBreaker(max_cost_usd=0.5, unknown_cost="price=10000/10000")
    with recording.proxy(upstream, breaker=breaker) as proxy:
        o, _ = clients(proxy.base_urls())
        with pytest.raises(openai.BadRequestError, match="max_cost_usd"):
            for _ in range(10):
                ask(o)
    turns = [f.payload for f in recording.tape().frames if f.kind == "llm_turn"]
    assert 1 <= len(turns) < 10 and all(t["cost_usd"] > 0 for t in turns)
    assert 0 < breaker.totals["cost_usd"] <= 0.5
    assert [n["counted"] for n in notes(recording) if n.get("event") == "unknown_price"] == [
        "10000/10000 per Mtok"
    ]


@pytest.mark.parametrize("value", ["maybe", "price=3", "price=a/b", "price=-1/2"])
def test_a_bad_unknown_cost_is_a_usage_error(tmp_path: Path, value: str) -> None:
    jukebox = str(Path(sys.executable).parent / "jukebox")
    proc = subprocess.run(
        [jukebox, "booth", "run", "--tree", str(tmp_path), "--max-cost-usd", "1",
         "--unknown-cost", value, "--", "true"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--unknown-cost must be deny, warn or price=IN/OUT" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "tapes").exists()  # nothing half-written
