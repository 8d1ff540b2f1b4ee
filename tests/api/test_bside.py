"""`Tape.fork(...).replay_and_diff(...)`: a tracked agent using the real openai SDK, re-executed
from frame N against a local model endpoint with another model and system prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from jukebox.api.api import Jukebox, Report, Tape
from tests.llm.upstream import FakeUpstream

openai = pytest.importorskip("openai")

DEAD = "http://127.0.0.1:9"  # nothing listens: a call that got here would fail
PROMPT = "You are a strict SQL auditor."
# What the agent does differently on a re-run (the divergence test flips it).
BEHAVIOUR = {"first_question": "plan the refund"}


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeUpstream]:
    up = FakeUpstream().start()
    monkeypatch.setenv("OPENAI_BASE_URL", up.openai_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-" + "Q" * 24)
    yield up
    up.stop()


def make_agent(jb: Jukebox):  # type: ignore[no-untyped-def]
    @jb.track(name="sdk-refunds")
    def agent(customer: str) -> str:
        client = openai.OpenAI(max_retries=0)

        def ask(text: str) -> str:
            reply = client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "system", "content": "You are helpful."},
                          {"role": "user", "content": text}],
            )  # fmt: skip
            return reply.choices[0].message.content or ""

        with jb.transaction(tape_id="sdk-run") as tx:
            plan = ask(f"{BEHAVIOUR['first_question']} for {customer}")
            tx.stage_file_write("plan.txt", plan)
            tx.record_agent_turn("planner", plan, model="gpt-4o-mini", cost_usd=0.001)
            verdict = ask("check the ledger")
            tx.stage_file_write("verdict.txt", verdict)
            tx.record_agent_turn("auditor", verdict, model="gpt-4o-mini", cost_usd=0.001)
            tx.commit()
        return verdict

    return agent


def record(jb: Jukebox, work: Path, agent) -> tuple[Tape, int]:  # type: ignore[no-untyped-def]
    assert agent("cust_1") == "echo: check the ledger"
    tape = Tape.load(jb.tapes.tape_path("sdk-run"), jb.store)
    kinds = [f.kind for f in tape.frames]
    assert kinds == ["run_start", "llm_turn", "fs", "agent_turn", "llm_turn", "fs", "agent_turn",
                     "commit", "exit"]  # fmt: skip
    return tape, kinds.index("llm_turn", 2)  # fork at the second model call


def test_fork_goes_live_with_the_overrides_and_the_report_shows_it(
    jb: Jukebox, upstream: FakeUpstream, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tracked function must still be alive to be found (it is not importable by name).
    agent = make_agent(jb)
    tape, at = record(jb, work, agent)
    files = {p: (work / p).read_text() for p in ("plan.txt", "verdict.txt")}
    stamps = {p: (work / p).stat().st_mtime_ns for p in files}
    calls = len(upstream.seen)
    # The endpoint given wins over the environment, which now points nowhere.
    monkeypatch.setenv("OPENAI_BASE_URL", DEAD + "/v1")
    b_side = tape.fork(at_frame=at, override_model="other-model", override_system_prompt=PROMPT)
    report = b_side.replay_and_diff(endpoint=upstream.openai_url)
    assert isinstance(report, Report)

    # One call went live, rewritten; the first was answered from the tape.
    sent = [body for _, _, _, body in upstream.seen[calls:]]
    assert len(sent) == 1 and sent[0]["model"] == "other-model"
    assert sent[0]["messages"][0] == {"role": "system", "content": PROMPT}

    md = report.to_markdown()
    assert f"Frames 0..{at - 1} ({at} frame(s)) are identical byte for byte" in md
    assert "| model * | gpt-4o-mini | other-model |" in md
    assert "- model override: openai=other-model" in md  # the provider of the frame forked at
    assert f"- system prompt override: {PROMPT}" in md
    assert "| models | gpt-4o-mini | gpt-4o-mini, other-model (fork override from frame" in md
    # The auditor's own turn after the fork shows the override, marked as the agent's record.
    auditor = report.to_json()["b"]["turns"][3]
    assert auditor["kind"] == "agent_turn" and auditor["model"] == "other-model"
    assert auditor["recorded_model"] == "gpt-4o-mini"
    assert "## Tokens and cost" in md  # agent turns' own costs count with the model calls'
    assert "## Re-execution" in md and "Diverged" not in md
    data = report.to_json()
    assert data["reexecution"]["difference"] is None and data["reexecution"]["matched"] == at
    assert data["b"]["llm_calls"] == 2 and data["b"]["agent_turns"] == 2
    assert data["a"]["cost_usd"] >= 0.002 and data["b"]["cost_usd"] >= 0.002
    json.dumps(data)

    # The B side: the shared prefix byte for byte, the fork frame, then the new run.
    a_bytes = jb.tapes.tape_path("sdk-run").read_bytes()
    b = Tape.load(b_side.path, jb.store)
    assert b.verify().ok
    assert [f.id for f in b.frames[:at]] == [f.id for f in tape.frames[:at]]
    assert b.frames[at].kind == "fork"
    overrides = {"model": {"openai": "other-model"}, "system_prompt": PROMPT}
    assert b.frames[at].payload["overrides"] == overrides
    after = [f.resolve_payload(jb.store) for f in b.frames[at + 1 :]]
    assert [f.kind for f in b.frames[at + 1 :]] == ["llm_turn", "fs", "agent_turn", "commit",
                                                    "exit"]  # fmt: skip
    assert after[0]["model"] == "other-model" and "replayed_from" not in after[0]
    assert after[2]["model"] == "gpt-4o-mini" and after[2]["model_override"] == "other-model"
    # Nothing of the B side reached the real tree or the original tape.
    assert {p: (work / p).read_text() for p in files} == files
    assert {p: (work / p).stat().st_mtime_ns for p in files} == stamps
    assert jb.tapes.tape_path("sdk-run").read_bytes() == a_bytes
    assert sorted(p.name for p in jb.tapes.tape_paths()) == sorted(["sdk-run.jbx",
                                                                    b_side.path.name])


def test_a_run_that_no_longer_matches_its_prefix_is_reported_and_never_goes_live(
    jb: Jukebox, upstream: FakeUpstream, work: Path
) -> None:
    agent = make_agent(jb)
    tape, at = record(jb, work, agent)
    calls = len(upstream.seen)
    BEHAVIOUR["first_question"] = "plan something else"
    try:
        b_side = tape.fork(at_frame=at, override_model="other-model")
        report = b_side.replay_and_diff(endpoint=upstream.openai_url)
    finally:
        BEHAVIOUR["first_question"] = "plan the refund"
    assert len(upstream.seen) == calls  # the divergence stopped the run before any live call
    difference = report.to_json()["reexecution"]["difference"]
    assert "diverged at frame 1" in difference and "plan something else" in difference
    assert "**Diverged**" in report.to_markdown()
    b = Tape.load(b_side.path, jb.store)
    assert [f.kind for f in b.frames[at:]] == ["fork", "note"]
    assert b.frames[-1].payload["event"] == "fork_exec_failed"


def test_replay_and_diff_refuses_what_it_cannot_re_execute(jb: Jukebox, work: Path) -> None:
    with jb.transaction(tape_id="untracked") as tx:
        tx.commit()
    plain = Tape.load(jb.tapes.tape_path("untracked"))
    with pytest.raises(ValueError, match=r"not recorded by a @jb\.track function"):
        plain.fork(at_frame=1).replay_and_diff()

    @jb.track
    def secretive(api_key: str) -> None:
        with jb.transaction(tape_id="secret") as tx:
            tx.commit()

    secretive("sk-" + "x" * 30)
    tape = Tape.load(jb.tapes.tape_path("secret"))
    with pytest.raises(ValueError, match="api_key"):
        tape.fork(at_frame=1).replay_and_diff()
    assert sorted(p.name for p in jb.tapes.tape_paths()) == ["secret.jbx", "untracked.jbx"]


def test_the_model_override_is_per_provider(
    jb: Jukebox, upstream: FakeUpstream, work: Path
) -> None:
    tape, at = record(jb, work, make_agent(jb))
    # A bare name is for the provider of the frame forked at; a mapping names each provider.
    assert tape.fork(at_frame=at, override_model="m").overrides == {"model": {"openai": "m"}}
    both = {"openai": "gpt-4.1-mini", "anthropic": "claude-sonnet-4-5"}
    assert tape.fork(at_frame=at, override_model=both).overrides == {"model": both}
    with pytest.raises(ValueError, match="unknown provider 'mistral'"):
        tape.fork(at_frame=at, override_model={"mistral": "m"})
    # Gemini names its model in the URL path, which a fork rewrites.
    assert tape.fork(at_frame=at, override_model={"gemini": "g"}).overrides == {
        "model": {"gemini": "g"}
    }
