"""The circuit breaker: each rule trips at exactly its count, with the numbers that broke it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jukebox.booth.supervisor import BREAKER_GRACE_S
from jukebox.errors import CheckFailed, UsageError
from jukebox.guard.breaker import BreakerTripped, CircuitBreaker, Reservation, Trip
from jukebox.tape.tape import Tape


def read_file(path: str, call_id: str = "call_0") -> dict:
    """An OpenAI-shaped tool call, as a proxy would see it in a response."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "read_file", "arguments": f'{{"path": "{path}"}}'},
    }


# --------------------------------------------------------------------------- budgets


def test_cost_trips_on_the_turn_that_goes_over() -> None:
    b = CircuitBreaker(max_cost_usd=0.30)
    # 0.1 three times is exactly the budget (no float drift): allowed.
    for _ in range(3):
        assert b.observe(cost_usd=0.1) is None
    assert b.totals["cost_usd"] == 0.3
    trip = b.observe(cost_usd=0.05)
    assert trip is not None
    assert (trip.rule, trip.limit, trip.value) == ("max_cost_usd", 0.3, pytest.approx(0.35))
    assert "$0.3500" in trip.detail and "$0.3000" in trip.detail and "--max-cost-usd" in trip.detail


def test_admit_refuses_a_call_once_the_budget_is_spent() -> None:
    b = CircuitBreaker(max_cost_usd=0.25, max_tokens=1000)
    assert b.admit() is None
    b.observe(cost_usd=0.20, tokens=500)
    assert b.admit() is None
    b.observe(cost_usd=0.05, tokens=100)
    trip = b.admit()
    assert trip is not None and (trip.rule, trip.limit, trip.value) == ("max_cost_usd", 0.25, 0.25)
    assert b.tripped is trip


def test_tokens_trip_on_the_turn_that_goes_over() -> None:
    b = CircuitBreaker(max_tokens=1000)
    assert b.observe(tokens=400) is None
    assert b.observe(tokens=600) is None  # exactly the budget
    assert b.admit() is not None and b.tripped.value == 1000
    b.reset()
    b.observe(tokens=999)
    assert b.admit() is None
    trip = b.observe(tokens=2)
    assert (trip.rule, trip.limit, trip.value) == ("max_tokens", 1000, 1001)
    assert "1001 tokens" in trip.detail


def test_turns_admit_stops_the_call_after_the_last() -> None:
    b = CircuitBreaker(max_turns=3)
    for _ in range(3):
        assert b.admit() is None
        assert b.observe(text="step") is None
    trip = b.admit()
    assert (trip.rule, trip.limit, trip.value) == ("max_turns", 3, 4)
    assert "turn 4 would exceed max_turns 3" in trip.detail


def test_turns_observe_alone_trips_on_the_extra_turn() -> None:
    b = CircuitBreaker(max_turns=2)
    assert b.observe() is None
    assert b.observe() is None
    trip = b.observe()
    assert (trip.rule, trip.limit, trip.value) == ("max_turns", 2, 3)


# --------------------------------------------------------------------------- semantic repeat


def test_the_same_read_file_call_trips_on_the_third() -> None:
    b = CircuitBreaker(max_semantic_repeat=3)
    # The same call re-issued (fresh ids each time, arguments spelled differently).
    assert b.observe(tool_calls=[read_file("src/app.py", "call_1")]) is None
    assert b.totals["repeat_run"] == 1
    call = {
        "type": "tool_use",
        "id": "toolu_2",
        "name": "read_file",
        "input": {"path": "src/app.py"},
    }
    assert b.observe(tool_calls=[call]) is None
    assert b.totals["repeat_run"] == 2
    trip = b.observe(tool_calls=[read_file("src/app.py", "call_3")])
    assert (trip.rule, trip.limit, trip.value) == ("max_semantic_repeat", 3, 3)
    assert "3 near-duplicate outputs in a row" in trip.detail


def test_steady_progress_through_many_files_never_trips() -> None:
    b = CircuitBreaker(max_semantic_repeat=2)
    for i in range(50):
        trip = b.observe(
            text=f"Reading module_{i}.py to check its imports.",
            tool_calls=[read_file(f"src/module_{i}.py", f"call_{i}")],
        )
        assert trip is None, trip
    assert b.totals["repeat_run"] == 1


def test_reworded_text_trips_and_a_new_output_restarts_the_run() -> None:
    b = CircuitBreaker(max_repeat=3)  # the CLI's name for max_semantic_repeat
    assert b.max_semantic_repeat == 3
    b.observe(text="I need to read the file src/app.py to understand the bug. Let me read it.")
    b.observe(text="I need to read src/app.py to understand the bug. Let me read it again.")
    assert b.totals["repeat_run"] == 2
    assert b.observe(text="The bug is in the date parser; I will write a failing test.") is None
    assert b.totals["repeat_run"] == 1
    assert b.observe(text="The bug is in the date parser, so I'll write a failing test.") is None
    trip = b.observe(text="The bug is in the date parser. Now I will write a failing test.")
    assert trip is not None and trip.value == 3


def test_turns_without_output_leave_the_run_alone() -> None:
    b = CircuitBreaker(max_semantic_repeat=3)
    b.observe(text="Retrying the download of data.csv")
    b.observe(cost_usd=0.01)  # a cost-only record
    b.observe(text="Retrying the download of data.csv")
    assert b.totals["repeat_run"] == 2


def test_threshold_one_counts_only_identical_outputs() -> None:
    b = CircuitBreaker(max_semantic_repeat=2, similarity_threshold=1.0)
    b.observe(text="I need to read the file src/app.py to understand the bug. Let me read it.")
    assert (
        b.observe(text="I need to read src/app.py to understand the bug. Let me read it.") is None
    )
    assert b.observe(text="I need to read src/app.py to understand the bug. Let me read it.")


# --------------------------------------------------------------------------- repeated failures


def test_the_same_failure_trips_on_the_nth_in_a_row() -> None:
    b = CircuitBreaker(max_repeat_failures=3)
    call = [read_file("missing.txt")]
    error = "FileNotFoundError: [Errno 2] No such file or directory: 'missing.txt'"
    assert b.observe(tool_calls=call, failed=error) is None
    assert b.observe(tool_calls=call, failed="  " + error.replace(" ", "\n ", 1)) is None
    trip = b.observe(tool_calls=call, failed=error)
    assert (trip.rule, trip.limit, trip.value) == ("max_repeat_failures", 3, 3)
    assert "read_file" in trip.detail and "No such file" in trip.detail


def test_a_success_or_another_error_restarts_the_failure_run() -> None:
    b = CircuitBreaker(max_repeat_failures=2)
    call = [read_file("a.txt")]
    b.observe(tool_calls=call, failed="timeout")
    b.observe(tool_calls=call)  # succeeded this time
    assert b.totals["failure_run"] == 0
    b.observe(tool_calls=call, failed="timeout")
    assert b.observe(tool_calls=call, failed="permission denied") is None
    assert b.observe(tool_calls=[read_file("b.txt")], failed="permission denied") is None
    assert b.totals["failure_run"] == 1


def test_failure_of_the_last_calls_reported_later_and_hex_addresses_masked() -> None:
    """A proxy learns of a failure from the next request: `failed` without calls of its own."""
    b = CircuitBreaker(max_repeat_failures=2)
    b.observe(tool_calls=[read_file("x.bin")])
    b.observe(failed="Segfault at 0x7f3a2b10")
    trip = b.observe(failed="Segfault at 0x7f99ffe0")
    assert trip is not None and trip.value == 2 and "x.bin" in trip.detail


def test_failed_as_a_flag() -> None:
    b = CircuitBreaker(max_repeat_failures=2)
    b.observe(tool_calls=[read_file("a")], failed=True)
    b.observe(failed=False)  # a success
    assert b.totals["failure_run"] == 0
    b.observe(failed=True)
    trip = b.observe(failed=True)
    assert trip is not None and trip.rule == "max_repeat_failures" and trip.value == 2


# --------------------------------------------------------------------------- trips stand


def test_a_trip_stands_until_reset_and_spend_still_counts() -> None:
    b = CircuitBreaker(max_turns=1, max_cost_usd=1.0)
    b.observe(cost_usd=0.5)
    trip = b.observe(cost_usd=0.2)
    assert trip.rule == "max_turns"
    assert b.observe(cost_usd=0.9) is trip  # the first trip is the one reported
    assert b.admit() is trip
    assert b.totals["cost_usd"] == pytest.approx(1.6) and b.totals["turns"] == 3
    b.reset()
    assert b.tripped is None and b.totals == {
        "cost_usd": 0.0,
        "tokens": 0,
        "turns": 0,
        "repeat_run": 0,
        "failure_run": 0,
    }
    assert b.admit() is None


def test_first_rule_in_order_wins_when_several_break_at_once() -> None:
    b = CircuitBreaker(max_cost_usd=0.1, max_tokens=10)
    trip = b.observe(cost_usd=0.2, tokens=20)
    assert trip.rule == "max_cost_usd"


def test_check_raises_breaker_tripped_naming_the_rule() -> None:
    b = CircuitBreaker(max_tokens=100)
    b.check(tokens=60)
    with pytest.raises(BreakerTripped) as caught:
        b.check(tokens=60)
    error = caught.value
    assert isinstance(error, CheckFailed) and error.exit_code == 1
    assert error.trip is b.tripped and error.trip.rule == "max_tokens"
    assert str(error).startswith("circuit breaker tripped on max_tokens: ")
    assert "120 tokens" in str(error)
    with pytest.raises(BreakerTripped):
        b.check()  # still tripped


def test_trip_is_frozen_and_its_payload_is_plain() -> None:
    trip = Trip("max_turns", 5, 6, "turn 6 would exceed max_turns 5")
    assert trip.to_payload() == {
        "rule": "max_turns",
        "limit": 5,
        "value": 6,
        "detail": "turn 6 would exceed max_turns 5",
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        trip.rule = "max_tokens"  # type: ignore[misc]


# --------------------------------------------------------------------------- state / restore


def test_restore_rewinds_the_conversation_but_not_the_spend() -> None:
    b = CircuitBreaker(max_semantic_repeat=3, max_cost_usd=1.0)
    b.observe(text="Let me read config.py again.", cost_usd=0.1, tokens=10)
    saved = b.state()
    b.observe(text="Let me read config.py again.", cost_usd=0.1, tokens=10)
    assert b.totals["repeat_run"] == 2
    b.restore(saved)
    assert b.totals == {
        "cost_usd": pytest.approx(0.2),
        "tokens": 20,
        "turns": 2,
        "repeat_run": 1,
        "failure_run": 0,
    }
    # The rewound run continues from the snapshot: two more repeats, not one, reach 3.
    assert b.observe(text="Let me read config.py again.") is None
    assert b.observe(text="Let me read config.py again.").rule == "max_semantic_repeat"


def test_restore_with_spend_rewinds_everything_including_the_trip() -> None:
    b = CircuitBreaker(max_turns=2)
    b.observe(cost_usd=0.1, tokens=5, text="a")
    saved = b.state()
    b.observe(text="b")
    assert b.observe(text="c").rule == "max_turns"
    b.restore(saved, spend=True)
    assert b.tripped is None
    assert b.totals["turns"] == 1 and b.totals["tokens"] == 5
    assert b.observe(text="d") is None


def test_state_is_a_cheap_immutable_snapshot() -> None:
    b = CircuitBreaker(max_semantic_repeat=5)
    b.observe(text="x " * 5000)
    s1 = b.state()
    s2 = b.state()
    assert s1 == s2 and isinstance(s1, tuple)
    assert s1.last_vector is s2.last_vector  # shared, not copied
    with pytest.raises(ValueError, match=r"CircuitBreaker\.state"):
        b.restore((1, 2, 3))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_cost_usd": 0}, "max_cost_usd"),
        ({"max_cost_usd": -0.5}, "max_cost_usd"),
        ({"max_cost_usd": math.nan}, "max_cost_usd"),
        ({"max_cost_usd": math.inf}, "max_cost_usd"),
        ({"max_cost_usd": "1"}, "max_cost_usd"),
        ({"max_cost_usd": True}, "max_cost_usd"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_turns": -3}, "max_turns"),
        ({"max_turns": "5"}, "max_turns"),
        ({"max_semantic_repeat": 1}, "max_semantic_repeat"),
        ({"max_semantic_repeat": 0}, "max_semantic_repeat"),
        ({"max_repeat": -1}, "max_semantic_repeat"),
        ({"max_repeat_failures": 1}, "max_repeat_failures"),
        ({"similarity_threshold": 0.0}, "similarity_threshold"),
        ({"similarity_threshold": 1.5}, "similarity_threshold"),
        ({"similarity_threshold": "high"}, "similarity_threshold"),
        ({"max_repeat": 3, "max_semantic_repeat": 4}, "max_repeat"),
    ],
)
def test_bad_limits_name_the_parameter_and_the_range(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name) as caught:
        CircuitBreaker(**kwargs)
    message = str(caught.value)
    assert any(word in message for word in (">=", "positive", "(0, 1]", "only one"))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"cost_usd": -0.1}, "cost_usd"),
        ({"cost_usd": math.nan}, "cost_usd"),
        ({"cost_usd": math.inf}, "cost_usd"),
        ({"cost_usd": "0.1"}, "cost_usd"),
        ({"tokens": -1}, "tokens"),
        ({"tokens": 1.5}, "tokens"),
        ({"text": 42}, "text"),
        ({"tool_calls": "read_file"}, "tool_calls"),
        ({"tool_calls": ["read_file"]}, "tool_calls"),
        ({"failed": RuntimeError("x")}, "failed"),
    ],
)
def test_bad_observations_are_refused_without_counting(kwargs: dict, name: str) -> None:
    b = CircuitBreaker(max_turns=5)
    with pytest.raises(ValueError, match=name):
        b.observe(**kwargs)
    assert b.totals["turns"] == 0


def test_equal_alias_values_are_accepted() -> None:
    assert CircuitBreaker(max_repeat=3, max_semantic_repeat=3).max_semantic_repeat == 3


# --------------------------------------------------------------------------- CLI options


def test_from_options_none_without_flags_and_both_repeat_rules_from_max_repeat() -> None:
    assert CircuitBreaker.from_options() is None
    b = CircuitBreaker.from_options(max_cost_usd=2.5, max_tokens=10, max_turns=7, max_repeat=4)
    assert b is not None
    assert b.limits == {
        "max_cost_usd": 2.5,
        "max_tokens": 10,
        "max_turns": 7,
        "max_semantic_repeat": 4,
        "max_repeat_failures": 4,
        "similarity_threshold": 0.92,
        "unknown_cost": "warn",
    }


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"max_cost_usd": -1.0}, "--max-cost-usd"),
        ({"max_tokens": 0}, "--max-tokens"),
        ({"max_turns": 0}, "--max-turns"),
        ({"max_repeat": 1}, "--max-repeat"),
    ],
)
def test_from_options_errors_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(UsageError, match=flag):
        CircuitBreaker.from_options(**kwargs)


# --------------------------------------------------------------------------- threads


def test_concurrent_observers_lose_nothing() -> None:
    b = CircuitBreaker(max_tokens=10**9, max_semantic_repeat=10**6)

    def worker(n: int) -> None:
        for i in range(200):
            b.observe(tokens=1, cost_usd=0.001, text=f"worker {n} step {i}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.totals["tokens"] == 800 and b.totals["turns"] == 800
    assert b.totals["cost_usd"] == pytest.approx(0.8)


# --------------------------------------------------------------------------- through a booth

AGENT = """\
import json, os, signal, sys, time, urllib.error, urllib.request
base = os.environ["OPENAI_BASE_URL"].rstrip("/")
if os.environ.get("AGENT_IGNORES_SIGTERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open("written.txt", "w").write("the agent was here\\n")
for i in range(int(sys.argv[1])):
    prompt = sys.argv[2] if len(sys.argv) > 2 else f"step {i}"
    body = {"model": "fake-echo", "messages": [{"role": "user", "content": prompt}]}
    req = urllib.request.Request(
        base + "/chat/completions", json.dumps(body).encode(),
        {"content-type": "application/json", "authorization": "Bearer sk-test-secret"},
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as response:
            print("ok", i, flush=True)
    except urllib.error.HTTPError as error:
        print("refused", i, error.code, flush=True)
        if os.environ.get("AGENT_IGNORES_SIGTERM") or os.environ.get("AGENT_HANGS"):
            time.sleep(60)  # hangs: only the booth's signal ends it
        sys.exit(3)
"""


@pytest.fixture
def booth_env(tmp_path: Path):
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("booth runs need root and /dev/fuse")
    try:
        import jukebox.llm.session
        from tests.llm.upstream import FakeUpstream
    except ImportError as error:
        pytest.skip(f"the LLM proxy or its fake upstream is not importable: {error}")
    upstream = FakeUpstream().start()
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("base\n")
    agent = tree / "agent.py"  # the booth's /tmp is private: the agent lives in its tree
    agent.write_text(AGENT)
    jukebox = str(Path(sys.executable).parent / "jukebox")

    def run(*args: str, tape_id: str, env: dict | None = None) -> tuple[int, list, str]:
        env = {**os.environ, "OPENAI_BASE_URL": upstream.openai_url, **(env or {})}
        proc = subprocess.run(
            [
                jukebox,
                "booth",
                "run",
                "--tree",
                str(tree),
                "--tape-dir",
                str(tmp_path / "tapes"),
                "--tape-id",
                tape_id,
                *args,
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=90,
        )
        tape = Tape.load(tmp_path / "tapes" / f"{tape_id}.jbx")
        return proc.returncode, [(f.kind, f.payload) for f in tape.frames], proc.stderr

    yield run, tree, agent, tmp_path / "tapes"
    upstream.stop()


@pytest.mark.parametrize(
    ("flags", "rule", "limit", "value", "turns"),
    [
        (["--max-turns", "2"], "max_turns", 2, 3, 2),
        # The fake model answers 9 prompt + 3 completion tokens; the second call's 73-byte
        # body reserves 19 tokens, 12 + 19 = 31 > 20: refused before it is forwarded.
        (["--max-tokens", "20"], "max_tokens", 20, 31, 1),
    ],
)
def test_booth_trip_stops_the_agent_and_rolls_back(booth_env, flags, rule, limit, value, turns):
    run, tree, agent, _ = booth_env
    code, frames, stderr = run(*flags, "--", "python3", str(agent), "5", tape_id="trip")
    kinds = [k for k, _ in frames]
    assert code != 0
    assert kinds.count("llm_turn") == turns
    breaker = [p for k, p in frames if k == "breaker"]
    assert len(breaker) == 1
    assert {k: breaker[0][k] for k in ("rule", "limit", "value")} == {
        "rule": rule,
        "limit": limit,
        "value": value,
    }
    assert rule in breaker[0]["detail"]
    assert kinds[-1] == "rollback" and rule in frames[-1][1]["reason"]
    assert f"circuit breaker tripped ({rule})" in stderr
    assert sorted(p.name for p in tree.iterdir()) == ["a.txt", "agent.py"]  # no written.txt
    start = frames[0][1]
    assert start["policy"]["breaker"][rule] == limit


def test_booth_semantic_repeat_under_commit_never_stays_pending(booth_env):
    run, tree, agent, tapes = booth_env
    code, frames, _ = run(
        "--max-repeat",
        "3",
        "--commit",
        "never",
        "--",
        "python3",
        str(agent),
        "6",
        "please read config.py",
        tape_id="loop",
    )
    assert code != 0
    breaker = [p for k, p in frames if k == "breaker"]
    assert [(p["rule"], p["limit"], p["value"]) for p in breaker] == [("max_semantic_repeat", 3, 3)]
    assert [k for k, _ in frames].count("llm_turn") == 3
    assert "rollback" not in [k for k, _ in frames]
    record = json.loads((tapes / ".jukebox" / "booths" / "loop.json").read_text())
    assert record["status"] == "pending"
    assert not (tree / "written.txt").exists()


@pytest.mark.parametrize(("ignores", "signal_number"), [(False, 15), (True, 9)])
def test_booth_stops_the_agent_with_sigterm_then_sigkill(booth_env, ignores, signal_number):
    run, _, agent, _ = booth_env
    code, frames, _ = run(
        "--max-turns", "1", "--", "python3", str(agent), "5",
        tape_id="stop",
        env={"AGENT_IGNORES_SIGTERM": "1"} if ignores else {"AGENT_HANGS": "1"},
    )  # fmt: skip
    exit_payload = next(p for k, p in frames if k == "exit")
    assert exit_payload["signal"] == signal_number
    if ignores:
        assert exit_payload["seconds"] >= BREAKER_GRACE_S
    assert code == 128 + signal_number


def test_reservations_hold_calls_in_flight_until_they_settle() -> None:
    b = CircuitBreaker(max_tokens=100)
    first = Reservation.of(60, 0.0)
    assert b.admit(first) is None
    b.release(first)
    b.release(first)  # idempotent: given back once
    whole = Reservation.of(100, 0.0)
    assert b.admit(whole) is None  # inclusive: exactly the budget fits
    assert b.observe(tokens=30, reservation=whole) is None  # settled at the real usage
    assert b.totals["tokens"] == 30
    assert b.admit(Reservation.of(70, 0.0)) is None
    trip = b.admit(Reservation.of(1, 0.0))  # 30 used + 70 in flight + 1 > 100
    assert trip is not None and (trip.rule, trip.value) == ("max_tokens", 101)


def test_turns_in_flight_count_and_a_failed_retry_is_no_turn() -> None:
    b = CircuitBreaker(max_turns=2, max_repeat_failures=2)
    a, c = Reservation(), Reservation()
    assert b.admit(a) is None and b.admit(c) is None
    assert b.observe(failed="HTTP 429: slow down", reservation=a) is None
    assert b.observe(failed="HTTP 429: slow down", reservation=c, retry=True) is None
    assert b.totals["turns"] == 1 and b.totals["failure_run"] == 1
    assert b.admit(Reservation()) is None  # the retry's turn was given back
    trip = b.admit(Reservation())
    assert trip is not None and (trip.rule, trip.value) == ("max_turns", 3)
