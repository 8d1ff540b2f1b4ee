"""The async API (`@jb.track` on a coroutine, `async with jb.transaction`, `await tx.commit()`)
on trio, not only asyncio, under trio's MockClock: agents that wait an hour between steps run
in no real time, interleaved, and each run's frames land on its own tapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from jukebox.api.api import Jukebox, Tape

pytestmark = pytest.mark.trio


def _tape(jb: Jukebox, tape_id: str) -> Tape:
    return Tape.load(jb.tapes.tape_path(tape_id))


async def test_tracked_agents_interleave_on_trio_each_on_its_own_run(
    autojump_clock: trio.testing.MockClock, jb: Jukebox, work: Path
) -> None:
    steps: list[tuple[str, str, float]] = []

    @jb.track
    async def agent(name: str, think_s: float) -> str:
        async with jb.transaction(tape_id=f"{name}-tx") as tx:
            tx.stage_file_write(f"{name}.txt", f"by {name}\n")
            steps.append((name, "staged", trio.current_time()))
            await trio.sleep(think_s)  # a model call that takes its time
            tx.state["done"] = True
            outcome = await tx.commit()
            steps.append((name, "committed", trio.current_time()))
        return outcome.status

    start = trio.current_time()
    results: dict[str, str] = {}

    async def run(name: str, think_s: float) -> None:
        results[name] = await agent(name, think_s)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "slow", 3600.0)
        nursery.start_soon(run, "quick", 60.0)
    assert results == {"slow": "COMMITTED", "quick": "COMMITTED"}
    # Both were in their transactions at once; the quick one committed an hour's wait earlier.
    committed = {name: at - start for name, what, at in steps if what == "committed"}
    assert committed == {"slow": pytest.approx(3600.0), "quick": pytest.approx(60.0)}
    assert [what for _, what, _ in steps[:2]] == ["staged", "staged"]
    assert (work / "slow.txt").read_text() == "by slow\n"
    assert (work / "quick.txt").read_text() == "by quick\n"
    # Each task's run is its own (trio gives each task its own context): two run ids.
    runs = {name: _tape(jb, f"{name}-tx").frames[0].payload["run"]["id"] for name in results}
    assert runs["slow"] != runs["quick"]
    for name in results:
        frames = _tape(jb, f"{name}-tx").frames
        assert [f.kind for f in frames] == ["run_start", "fs", "commit", "exit"]
        assert frames[-1].payload["result"] == "COMMITTED"
