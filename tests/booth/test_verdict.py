"""decide_verdict, the booth's verdict from a finished run's facts, row by row: which facts win
over which, and the reason the operator is told."""

from __future__ import annotations

from typing import Any

import pytest

from jukebox.booth.supervisor import DISCARD, BoothVerdict, decide_verdict

OK = {"code": 0, "signal": None}
FAILED = {"code": 3, "signal": None}
KILLED = {"code": None, "signal": 9}
NOT_STARTED = {"code": 127, "signal": None, "setup_error": "CMD not found: nope"}
PASSED = {"cmd": "make test", "ok": True, "exit": 0}
REFUSED = {"cmd": "make test", "ok": False, "exit": 2}
TRIP = "the circuit breaker tripped (cost)"

# commit mode, exit status, verifier, interrupted, tripped rule, tree changed -> verdict
Row = tuple[str, dict[str, Any], dict[str, Any] | None, bool, str | None, bool, BoothVerdict]
ROWS: list[Row] = [
    ("auto", OK, None, False, None, True, BoothVerdict("commit")),
    ("auto", OK, PASSED, False, None, True, BoothVerdict("commit")),
    ("auto", OK, None, False, None, False, BoothVerdict("commit")),
    ("auto", OK, REFUSED, False, None, True,
     BoothVerdict("discard", "the verifier failed (exit 2)")),
    ("auto", FAILED, None, False, None, True,
     BoothVerdict("discard", "the agent exited with status 3")),
    # A failed agent's verifier is skipped: the agent's failure is the reason given.
    ("auto", FAILED, {"cmd": "make test", "skipped": "the agent failed", "ok": False}, False,
     None, True, BoothVerdict("discard", "the agent exited with status 3")),
    ("auto", KILLED, None, False, None, True,
     BoothVerdict("discard", "the agent exited with signal 9 (SIGKILL)")),
    ("auto", NOT_STARTED, None, False, None, True,
     BoothVerdict("discard", "CMD not found: nope")),
    # An interruption keeps the work, whatever the agent's status.
    ("auto", OK, None, True, None, True, BoothVerdict("keep", "interrupted")),
    ("auto", FAILED, None, True, None, True, BoothVerdict("keep", "interrupted")),
    ("ask", FAILED, None, True, None, True, BoothVerdict("keep", "interrupted")),
    ("never", OK, PASSED, False, None, True, BoothVerdict("keep")),
    ("never", FAILED, None, False, None, True, BoothVerdict("keep")),
    ("never", OK, None, True, None, True, BoothVerdict("keep", "interrupted")),
    # `ask` asks only when there is something to commit, whatever the agent's status.
    ("ask", OK, None, False, None, True, BoothVerdict("ask")),
    ("ask", FAILED, REFUSED, False, None, True, BoothVerdict("ask")),
    ("ask", OK, None, False, None, False, BoothVerdict("commit")),
    # A scratch booth (replay, fork) ends discarded without a reason, even when interrupted.
    (DISCARD, OK, None, False, None, True, BoothVerdict("discard")),
    (DISCARD, FAILED, None, True, None, True, BoothVerdict("discard")),
    # A breaker trip wins over everything; only `never` keeps the work.
    ("auto", OK, PASSED, False, "cost", True, BoothVerdict("discard", TRIP)),
    ("auto", OK, None, True, "cost", True, BoothVerdict("discard", TRIP)),
    ("ask", OK, None, False, "cost", True, BoothVerdict("discard", TRIP)),
    (DISCARD, OK, None, False, "cost", True, BoothVerdict("discard", TRIP)),
    ("never", OK, None, False, "cost", True, BoothVerdict("keep", TRIP)),
]


@pytest.mark.parametrize(
    ("commit_mode", "status", "verified", "interrupted", "tripped", "changed", "expected"), ROWS
)
def test_decide_verdict(
    commit_mode: str,
    status: dict[str, Any],
    verified: dict[str, Any] | None,
    interrupted: bool,
    tripped: str | None,
    changed: bool,
    expected: BoothVerdict,
) -> None:
    verdict = decide_verdict(
        commit_mode, status, verified, interrupted=interrupted, tripped=tripped, changed=changed
    )
    assert verdict == expected


@pytest.mark.parametrize(
    ("decision", "unchanged", "dbs", "staged", "alone"),
    [
        ("commit", True, None, [], True),  # nothing to commit: the tape alone
        ("discard", False, None, [], True),  # the layer goes; the real tree is not touched
        ("discard", True, None, [], True),
        ("commit", False, None, [], False),  # the real tree changes after the sync
        ("keep", False, None, [], False),  # a pending record must name a durable tape
        ("keep", True, None, [], False),
        ("commit", True, {"db": object()}, [], False),  # a transaction ends with it
        ("discard", False, {"db": object()}, [], False),
        ("commit", True, None, [object()], False),  # staged MCP calls run after it
    ],
)
def test_which_verdicts_need_no_sync_of_their_own_before_them(
    decision: str, unchanged: bool, dbs: Any, staged: list[Any], alone: bool
) -> None:
    from jukebox.booth.supervisor import _verdict_alone

    assert _verdict_alone(decision, unchanged, dbs, staged) is alone
