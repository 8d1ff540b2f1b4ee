"""@jb.track: run_start records the function and its arguments; the exit frame its result."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jukebox.api.api import BSide, Jukebox, Report, Tape
from jukebox.tape.tape import Tape as PlainTape


def _tape(jb: Jukebox, tape_id: str) -> Tape:
    return Tape.load(jb.tapes.tape_path(tape_id))


def test_sync_track_records_import_path_arguments_and_result(jb: Jukebox, work: Path) -> None:
    @jb.track(name="sync-agent")
    def agent(task: str, limit: int = 3, *, tags: tuple[str, ...] = ("a",)) -> dict:
        with jb.transaction(tape_id="s1") as tx:
            tx.record_agent_turn("solo", f"doing {task}", model="m1", cost_usd=0.001)
            tx.commit()
        return {"done": task}

    assert agent("audit") == {"done": "audit"}
    tape = _tape(jb, "s1")
    start = tape.frames[0].payload
    assert start["name"] == "sync-agent"
    run = start["run"]
    assert run["function"]["import_path"] == f"{__name__}:{agent.__qualname__}"
    assert run["function"]["file"] == __file__
    assert run["function"]["async"] is False
    assert run["args"]["values"] == {"task": "audit", "limit": 3, "tags": ["a"]}
    assert run["args"]["replayable"] is False  # a tuple does not come back as itself
    assert run["args"]["opaque"] == ["tags"]
    exit_frame = tape.frames[-1]
    assert exit_frame.kind == "exit"
    assert exit_frame.payload == {"code": 0, "result": {"done": "audit"}, "run": run["id"]}
    assert tape.summary()["status"] == "COMMITTED"


def test_async_track_and_two_transactions_in_one_run(jb: Jukebox, work: Path) -> None:
    @jb.track
    async def pipeline(n: int) -> int:
        async with jb.transaction(tape_id="first") as tx:
            tx.stage_file_write("one.txt", "1")
            await tx.commit()
        async with jb.transaction(tape_id="second") as tx:
            tx.stage_file_write("two.txt", "2")
            await tx.rollback("second thoughts")
        return n * 2

    assert asyncio.run(pipeline(21)) == 42
    first, second = _tape(jb, "first"), _tape(jb, "second")
    assert first.frames[0].payload["name"] == pipeline.__qualname__
    assert first.frames[0].payload["run"]["function"]["async"] is True
    assert first.frames[0].payload["run"]["id"] == second.frames[0].payload["run"]["id"]
    assert [f.kind for f in first.frames] == ["run_start", "fs", "commit", "exit"]
    assert [f.kind for f in second.frames] == ["run_start", "fs", "rollback", "exit"]
    assert first.summary()["status"] == "COMMITTED"
    assert second.summary()["status"] == "ROLLED_BACK"
    assert (work / "one.txt").exists() and not (work / "two.txt").exists()


def test_secrets_never_reach_the_tape(jb: Jukebox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-very-secret-value")
    key = "sk-" + "A1b2C3d4" * 4

    @jb.track(name="secretive")
    def agent(api_key: str, prompt: str, headers: dict, note: str) -> str:
        with jb.transaction(tape_id="sec") as tx:
            tx.commit()
        return f"used {api_key}"

    agent(key, f"my key is {key}", {"Authorization": "Bearer abc12345678"},
          "tok-very-secret-value")
    raw = jb.tapes.tape_path("sec").read_bytes()
    assert key.encode() not in raw
    assert b"abc12345678" not in raw
    assert b"tok-very-secret-value" not in raw
    args = _tape(jb, "sec").frames[0].payload["run"]["args"]
    assert args["values"]["api_key"] == "[REDACTED]"
    assert args["values"]["prompt"] == "[REDACTED]"
    assert args["values"]["headers"] == {"Authorization": "[REDACTED]"}
    assert sorted(args["redacted"]) == ["api_key", "headers", "note", "prompt"]
    assert args["replayable"] is False


def test_a_failing_tracked_function_records_its_error(jb: Jukebox, work: Path) -> None:
    @jb.track(name="fails")
    def agent() -> None:
        with jb.transaction(tape_id="f1") as tx:
            tx.stage_file_write("x.txt", "x")
            raise RuntimeError("upstream said no")

    with pytest.raises(RuntimeError):
        agent()
    tape = _tape(jb, "f1")
    assert [f.kind for f in tape.frames][-2:] == ["rollback", "exit"]
    assert tape.frames[-1].payload["code"] == 1
    assert tape.frames[-1].payload["error"] == {
        "type": "RuntimeError", "message": "upstream said no"
    }
    assert tape.summary()["status"] == "ROLLED_BACK"
    assert not (work / "x.txt").exists()


def test_untracked_transactions_have_no_run(jb: Jukebox) -> None:
    with jb.transaction(tape_id="plain", name="hand-written") as tx:
        tx.commit()
    tape = _tape(jb, "plain")
    assert "run" not in tape.frames[0].payload
    assert tape.frames[0].payload["name"] == "hand-written"
    assert [f.kind for f in tape.frames] == ["run_start", "commit"]


def test_generators_cannot_be_tracked(jb: Jukebox) -> None:
    with pytest.raises(TypeError, match="generator"):

        @jb.track
        def gen():  # type: ignore[no-untyped-def]
            yield 1


def test_report_compares_two_tapes_and_fork_plans_a_b_side(jb: Jukebox, work: Path) -> None:
    @jb.track(name="refunds")
    def agent(amount: float, model: str) -> str:
        with jb.transaction(tape_id=f"r{int(amount)}") as tx:
            tx.record_agent_turn("planner", f"refund {amount}", model=model, cost_usd=0.002)
            tx.stage_file_write("ledger.json", f'{{"refund": {amount}}}')
            if amount > 500:
                tx.rollback("over threshold")
                return "no"
            tx.commit()
            return "yes"

    # The rolled-back run first, so the two sides start from the same files.
    agent(900.0, "claude-3-7-sonnet-latest")
    agent(420.0, "gpt-4o")
    report = Report.between(jb.tapes.tape_path("r420"), jb.tapes.tape_path("r900"))
    md = report.to_markdown()
    assert "| status | COMMITTED | ROLLED_BACK |" in md
    assert "| models | gpt-4o | claude-3-7-sonnet-latest |" in md
    assert "| model * | gpt-4o | claude-3-7-sonnet-latest |" in md
    assert "| reply * | refund 420.0 | refund 900.0 |" in md
    assert "| endpoint | agent turn (planner), not a model call |" in md
    assert "- `D` ledger.json" in md
    data = report.to_json()
    assert data["shared_prefix"] == 0 and data["messages"]["differing_turns"] == [1]
    assert data["a"]["cost_usd"] == data["b"]["cost_usd"] == 0.002

    tape = Tape.load(jb.tapes.tape_path("r420"))
    assert isinstance(tape, PlainTape)
    b_side = tape.fork(at_frame=2, override_model="claude-3-7-sonnet-latest")
    assert isinstance(b_side, BSide) and b_side.function is not None
    assert b_side.arguments is not None
    assert b_side.arguments["values"] == {"amount": 420.0, "model": "gpt-4o"}
    with pytest.raises(ValueError, match=r"fork at 1\.\.5"):
        tape.fork(at_frame=9)
