"""Transactions: staging, verdicts, checkpoints, conflicts, crash recovery, policies."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jukebox.api.api import Jukebox, SandboxPolicy
from jukebox.api.transaction import Outcome, TransactionClosed
from jukebox.guard.breaker import BreakerTripped, CircuitBreaker
from jukebox.tape.tape import Tape
from shadowfs.errors import ConflictError


def _tape(jb: Jukebox, tape_id: str) -> Tape:
    return Tape.load(jb.tapes.tape_path(tape_id))


def _kinds(tape: Tape) -> list[str]:
    return [f.kind for f in tape.frames]


def test_staged_writes_stay_off_disk_until_commit(jb: Jukebox, work: Path) -> None:
    with jb.transaction(tape_id="t1") as tx:
        tx.stage_file_write("notes/plan.md", "step 1\n")
        tx.fs.write("README.md", b"rewritten\n")
        tx.fs.delete("src/app.py")
        # The transaction sees its own changes...
        assert tx.fs.read_text("notes/plan.md") == "step 1\n"
        assert tx.fs.read(work / "README.md") == b"rewritten\n"
        assert not tx.fs.exists("src/app.py")
        assert tx.fs.listdir(".") == ["README.md", "notes", "src", "tapes"]
        assert tx.fs.listdir("tapes") == []  # the tape dir's own records are not in view
        # ...the disk does not.
        assert not (work / "notes").exists()
        assert (work / "README.md").read_text() == "hello\n"
        assert (work / "src" / "app.py").exists()
        outcome = tx.commit()
    assert isinstance(outcome, Outcome) and outcome.status == "COMMITTED"
    assert (work / "notes" / "plan.md").read_text() == "step 1\n"
    assert (work / "README.md").read_text() == "rewritten\n"
    assert not (work / "src" / "app.py").exists()
    tape = _tape(jb, "t1")
    assert _kinds(tape) == ["run_start", "fs", "commit"]
    assert tape.summary()["status"] == "COMMITTED"
    assert tape.frames[-1].tree == tape.frames[-1].tree  # committed tree recorded
    assert tape.verify().ok


def test_an_exception_rolls_back_and_names_itself(jb: Jukebox, work: Path) -> None:
    with pytest.raises(KeyError), jb.transaction(tape_id="boom") as tx:
        tx.stage_file_write("out.txt", "partial")
        raise KeyError("missing invoice")
    assert tx.status == "ROLLED_BACK"
    assert not (work / "out.txt").exists()
    last = _tape(jb, "boom").frames[-1]
    assert last.kind == "rollback" and last.payload["final"] is True
    assert "KeyError" in last.payload["reason"] and "missing invoice" in last.payload["reason"]
    assert last.payload["exception"] == {"type": "KeyError", "message": "'missing invoice'"}
    with pytest.raises(TransactionClosed):
        tx.stage_file_write("late.txt", "x")


def test_leaving_without_a_verdict_rolls_back(jb: Jukebox, work: Path) -> None:
    with jb.transaction(tape_id="quiet") as tx:
        tx.fs.write("draft.txt", "x")
    assert not (work / "draft.txt").exists()
    tape = _tape(jb, "quiet")
    assert tape.summary()["status"] == "ROLLED_BACK"
    assert "without commit() or rollback()" in tape.frames[-1].payload["reason"]


def test_async_rollback_discards_files_and_memory(jb: Jukebox, work: Path) -> None:
    async def agent() -> Outcome:
        async with jb.transaction(tape_id="async") as tx:
            tx.state["plan"] = ["refund"]
            tx.stage_file_write("ledger.json", "{}")
            outcome = await tx.rollback(reason="too risky")
            assert len(tx.state) == 0
            return outcome

    outcome = asyncio.run(agent())
    assert outcome.status == "ROLLED_BACK" and outcome.reason == "too risky"
    assert not (work / "ledger.json").exists()
    final = _tape(jb, "async").frames[-1].payload
    assert final["reason"] == "too risky" and "discarded_state" in final


def test_rollback_to_restores_memory_and_files_together(jb: Jukebox, work: Path) -> None:
    with jb.transaction(tape_id="tt") as tx:
        tx.state.set("step", 1)
        tx.state.set("plan", {"todo": ["a", "b"]})
        tx.fs.write("a.txt", "a1")
        cp = tx.checkpoint("after-a")
        tx.state.set("step", 2)
        tx.state.delete("plan")
        tx.fs.write("a.txt", "a2")
        tx.fs.write("b.txt", "b")
        tx.fs.delete("README.md")
        later = tx.checkpoint("later")
        tx.rollback_to(cp)
        assert tx.state.version is cp.state  # a pointer swap, not a copy
        assert tx.state["step"] == 1 and tx.state["plan"] == {"todo": ["a", "b"]}
        assert tx.fs.read_text("a.txt") == "a1"
        assert not tx.fs.exists("b.txt") and tx.fs.exists("README.md")
        # Forward again by label: later checkpoints stay reachable.
        tx.rollback_to("later")
        assert tx.state["step"] == 2 and "plan" not in tx.state
        assert tx.fs.read_text("a.txt") == "a2" and not tx.fs.exists("README.md")
        tx.rollback_to(1)  # by number: 0 is the start, the first checkpoint is 1
        tx.commit()
    assert (cp.n, later.n) == (1, 2)
    assert (work / "a.txt").read_text() == "a1"
    assert not (work / "b.txt").exists()
    assert (work / "README.md").exists()
    tape = _tape(jb, "tt")
    checkpoints = [f for f in tape.frames if f.kind == "checkpoint"]
    assert [c.payload["label"] for c in checkpoints] == ["after-a", "later"]
    # The memory is on the tape: the checkpoint's version loads back from the store.
    from jukebox.api.state import StateVersion

    saved = StateVersion.load(jb.store, checkpoints[0].payload["state"])
    assert saved.to_dict() == {"step": 1, "plan": {"todo": ["a", "b"]}}
    assert tape.frames[-1].kind == "commit"


def test_a_conflicting_change_on_disk_refuses_the_commit(jb: Jukebox, work: Path) -> None:
    with pytest.raises(ConflictError) as info, jb.transaction(tape_id="cf") as tx:
        tx.fs.write("README.md", "mine\n")
        (work / "README.md").write_text("someone else's\n")
        tx.commit()
    assert "README.md" in info.value.conflicts
    assert (work / "README.md").read_text() == "someone else's\n"
    tape = _tape(jb, "cf")
    assert tape.summary()["status"] == "ROLLED_BACK"
    assert tape.frames[-1].payload["conflicts"] == ["README.md"]


def test_paths_outside_the_root_or_inside_the_tape_records_are_refused(
    jb: Jukebox, work: Path, tmp_path: Path
) -> None:
    with jb.transaction() as tx:
        with pytest.raises(ValueError, match="outside the transaction's root"):
            tx.stage_file_write(tmp_path / "elsewhere.txt", "x")
        with pytest.raises(ValueError, match="outside the transaction's root"):
            tx.fs.write("../escape.txt", "x")
        with pytest.raises(ValueError, match="tape dir's own records"):
            tx.fs.write("tapes/.jukebox/store/evil", "x")
        with pytest.raises(ValueError, match="tape dir's own records"):
            tx.fs.write(f"tapes/{tx.tape_id}.jbx", "x")
        tx.rollback("nothing to do")
    assert tx.tape_id.startswith("tr_") and len(tx.tape_id) == 11


def test_unknown_policy_values_list_the_valid_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JUKEBOX_TAPE_DIR", str(tmp_path / "tapes"))  # what tape_dir=None reads
    with pytest.raises(ValueError, match="'copy_on_write', 'passthrough'"):
        SandboxPolicy(filesystem="overlay")
    with pytest.raises(ValueError, match="'staged_acid', 'deny'"):
        SandboxPolicy(mcp_mode="yolo")
    with pytest.raises(TypeError, match="SandboxPolicy"):
        Jukebox(sandbox={"filesystem": "copy_on_write"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad tape id"):
        Jukebox(tape_dir=None).transaction(tape_id="../x")


def test_the_breaker_trips_names_the_rule_and_rolls_back(work: Path) -> None:
    jb = Jukebox(tape_dir="tapes", breaker=CircuitBreaker(max_cost_usd=0.01))
    with pytest.raises(BreakerTripped, match="max_cost_usd") as info, jb.transaction(
        tape_id="br"
    ) as tx:
        tx.stage_file_write("out.txt", "x")
        tx.record_agent_turn("planner", "first", model="gpt-4o", cost_usd=0.008)
        tx.record_agent_turn("planner", "second", model="gpt-4o", cost_usd=0.008)
        pytest.fail("the breaker should have tripped")
    assert info.value.trip.rule == "max_cost_usd"
    assert tx.status == "ROLLED_BACK"
    assert not (work / "out.txt").exists()
    tape = _tape(jb, "br")
    assert _kinds(tape)[-2:] == ["breaker", "rollback"]
    assert tape.frames[-2].payload["rule"] == "max_cost_usd"
    assert "max_cost_usd" in tape.frames[-1].payload["reason"]
    assert tape.summary()["cost_usd"] == pytest.approx(0.016)
    jb.close()


def test_semantic_repeats_trip_the_breaker(work: Path) -> None:
    jb = Jukebox(tape_dir="tapes", breaker=CircuitBreaker(max_semantic_repeat=3))
    with pytest.raises(BreakerTripped, match="max_semantic_repeat"), jb.transaction() as tx:
        for _ in range(5):
            tx.record_agent_turn("coder", "Let me run the tests again.", cost_usd=0.0)
    jb.close()


def test_passthrough_and_deny_policies(work: Path) -> None:
    jb = Jukebox(tape_dir="tapes", sandbox=SandboxPolicy(filesystem="passthrough"))
    with jb.transaction(tape_id="pt") as tx:
        tx.stage_file_write("direct.txt", "now")
        assert (work / "direct.txt").read_text() == "now"  # no staging: on disk at once
        tx.rollback("changed my mind")
    assert (work / "direct.txt").exists()  # and rollback cannot take it back
    assert _tape(jb, "pt").frames[-1].payload["files_restored"] is False
    deny = Jukebox(tape_dir="tapes", sandbox=SandboxPolicy(mcp_mode="deny"))
    with deny.transaction(tape_id="dn") as tx:
        with pytest.raises(PermissionError, match="mcp_mode='deny'"):
            tx.stage_file_write("x.txt", "x")
        tx.fs.write("scratch.txt", "allowed through tx.fs")
        tx.commit()
    assert (work / "scratch.txt").exists() and not (work / "x.txt").exists()
    assert "tool_call" in _kinds(_tape(deny, "dn"))


_CRASH_SCRIPT = textwrap.dedent(
    """
    from jukebox import Jukebox
    jb = Jukebox(tape_dir="tapes")
    with jb.transaction(tape_id="crash") as tx:
        tx.stage_file_write("ledger.json", '{"refund": 420}')
        tx.fs.write("src/app.py", "print('v2')\\n")
        tx.commit()
    print("not reached")
    """
)


@pytest.mark.parametrize(
    ("point", "committed"), [("staged", False), ("journal", True), ("op:1", True)]
)
def test_a_commit_killed_midway_is_settled_on_the_next_open(
    work: Path, point: str, committed: bool
) -> None:
    (work / "crash.py").write_text(_CRASH_SCRIPT)
    env = dict(os.environ, SHADOWFS_CRASH_AT=point)
    proc = subprocess.run([sys.executable, "crash.py"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert Tape.load(work / "tapes" / "crash.jbx").summary()["status"] == "RUNNING"

    jb = Jukebox(tape_dir="tapes")
    assert jb.recovered == [("crash", "COMMITTED" if committed else "ROLLED_BACK")]
    if committed:
        assert (work / "ledger.json").read_text() == '{"refund": 420}'
        assert (work / "src" / "app.py").read_text() == "print('v2')\n"
    else:
        assert not (work / "ledger.json").exists()
        assert (work / "src" / "app.py").read_text() == "print('v1')\n"
    leftovers = [p.name for p in work.rglob(".jbx-stage-*")]
    assert leftovers == []
    tape = Tape.load(work / "tapes" / "crash.jbx")
    assert tape.summary()["status"] == ("COMMITTED" if committed else "ROLLED_BACK")
    assert tape.frames[-1].payload["recovered"] is True
    assert tape.verify().ok
    assert not list((work / "tapes" / ".jukebox" / "scratch").iterdir())
    # Settled once: a second open finds nothing to do, and new work commits normally.
    jb.close()
    again = Jukebox(tape_dir="tapes")
    assert again.recovered == []
    with again.transaction() as tx:
        tx.fs.write("after.txt", "ok")
        tx.commit()
    assert (work / "after.txt").exists()
    again.close()


def test_a_transaction_is_single_use(jb: Jukebox) -> None:
    tx = jb.transaction()
    with pytest.raises(TransactionClosed, match="never opened"):
        tx.record_agent_turn("a", "b")
    with tx:
        tx.commit()
        with pytest.raises(TransactionClosed, match="COMMITTED"):
            tx.commit()
    with pytest.raises(TransactionClosed, match="already opened"), tx:
        pass


def test_checkpoint_0_is_the_start_as_in_a_booth(jb: Jukebox, work: Path) -> None:
    with jb.transaction(tape_id="st") as tx:
        tx.state.set("step", 1)
        tx.fs.write("a.txt", "a1")
        tx.fs.delete("README.md")
        assert tx.checkpoint("one").n == 1
        start = tx.rollback_to(0)
        assert (start.n, start.label, start.tree) == (0, "start", tx.base_tree)
        assert "step" not in tx.state and not tx.fs.exists("a.txt")
        assert tx.fs.exists("README.md")
        tx.rollback_to("one")
        assert tx.state["step"] == 1
        assert tx.rollback_to("start").n == 0 and "step" not in tx.state
        assert tx.checkpoint().n == 2
        tx.commit()
    assert not (work / "a.txt").exists() and (work / "README.md").exists()
    rollbacks = [f.payload for f in _tape(jb, "st").frames if f.kind == "rollback"]
    assert [(r["to"], r["label"]) for r in rollbacks] == [(0, "start"), (1, "one"), (0, "start")]
    checkpoints = [f.payload["id"] for f in _tape(jb, "st").frames if f.kind == "checkpoint"]
    assert checkpoints == [1, 2]


def test_checkpoint_without_changes_and_bad_targets(jb: Jukebox) -> None:
    with jb.transaction() as tx:
        cp = tx.checkpoint()
        assert cp.tree == tx.base_tree
        with pytest.raises(ValueError, match="no checkpoint 3"):
            tx.rollback_to(3)
        with pytest.raises(ValueError, match="no checkpoint labelled 'x'"):
            tx.rollback_to("x")
        tx.commit()
    assert tx.status == "COMMITTED"


def test_gc_keeps_every_node_of_a_checkpointed_memory(work: Path) -> None:
    jb = Jukebox(tape_dir="tapes")
    with jb.transaction(tape_id="mem") as tx:
        tx.state.update({f"fact{i}": {"n": i} for i in range(300)})
        cp = tx.checkpoint("many facts")
        tx.state["fact7"] = "changed"
        tx.checkpoint("one change")
        tx.rollback("keep nothing on disk")
    jb.close()
    gc = subprocess.run(
        [str(Path(sys.executable).parent / "jukebox"), "gc", "--tape-dir", "tapes",
         "--grace", "0"], cwd=work, capture_output=True, text=True, timeout=60,
    )
    assert gc.returncode == 0, gc.stderr
    from jukebox.api.state import StateVersion
    from shadowfs.store import Store

    with Store.open(work / "tapes" / ".jukebox" / "store", create=False) as store:
        tape = Tape.load(work / "tapes" / "mem.jbx", store)
        assert tape.verify().ok
        for frame in tape.frames:
            if frame.kind == "checkpoint":
                version = StateVersion.load(store, frame.payload["state"])
                assert len(version) == 300
        assert StateVersion.load(store, cp.state_id) == cp.state


def test_a_scratch_limit_refuses_writes_past_it_like_a_full_disk(work: Path) -> None:
    import errno

    jb = Jukebox(tape_dir="tapes", sandbox=SandboxPolicy(max_scratch_bytes=4096))
    with jb.transaction(tape_id="sl") as tx:
        tx.stage_file_write("small.txt", "x" * 3000)
        with pytest.raises(OSError) as info:
            tx.stage_file_write("big.txt", "y" * 2000)
        assert info.value.errno == errno.ENOSPC
        assert not tx.fs.exists("big.txt")  # refused whole: nothing staged
        tx.fs.delete("small.txt")  # gives its room back
        tx.stage_file_write("big.txt", "y" * 2000)
        tx.commit()
    assert (work / "big.txt").read_text() == "y" * 2000
    assert not (work / "small.txt").exists()
    assert _tape(jb, "sl").frames[0].payload["policy"]["max_scratch_bytes"] == 4096
    jb.close()
    for bad in (0, -1, "1G", True):
        with pytest.raises(ValueError, match="max_scratch_bytes must be a positive number"):
            SandboxPolicy(max_scratch_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="writes go straight to disk"):
        SandboxPolicy(filesystem="passthrough", max_scratch_bytes=4096)
