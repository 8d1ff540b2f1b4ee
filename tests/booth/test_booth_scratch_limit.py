"""`jukebox booth run --max-scratch SIZE`: the booth's layer stages at most SIZE in all. The
agent sees it as the size of its file system (df); a write past it stops the agent like a
circuit breaker trip, and the booth is rolled back with the real tree untouched."""

from __future__ import annotations

import pytest

from tests.booth.test_booth_run import booth_run, frames, leftovers, work  # noqa: F401

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

MIB = 1 << 20


def test_an_agent_within_the_limit_commits_and_sees_the_limit_in_df(work) -> None:  # noqa: F811
    tree, tapes = work
    proc = booth_run(
        tree,
        tapes,
        "df -B1 --output=size,avail . && echo two >> a.txt && jukebox booth status",
        "--max-scratch",
        "1M",
    )
    assert proc.returncode == 0, proc.stderr
    sizes = proc.stdout.split()
    assert sizes[2] == str(MIB), proc.stdout  # the header's two words, then size
    assert int(sizes[3]) <= MIB
    assert "staged 8 B of 1.0 MiB (--max-scratch)" in proc.stdout
    assert (tree / "a.txt").read_text() == "one\ntwo\n"
    start = frames(tapes)[0]
    assert start["payload"]["policy"]["scratch_limit"] == MIB


def test_a_write_past_the_limit_stops_the_agent_and_rolls_the_booth_back(work) -> None:  # noqa: F811
    tree, tapes = work
    before = {p.name: p.read_bytes() for p in tree.iterdir()}
    proc = booth_run(
        tree,
        tapes,
        "echo changed > a.txt; head -c 4M /dev/zero > big; sleep 60; echo survived",
        "--max-scratch",
        "1M",
    )
    assert proc.returncode == 128 + 15  # SIGTERM, as a breaker trip stops an agent
    assert "survived" not in proc.stdout
    assert "rolled back: the circuit breaker tripped (scratch)" in proc.stderr
    assert {p.name: p.read_bytes() for p in tree.iterdir()} == before
    trips = [f["payload"] for f in frames(tapes) if f["kind"] == "breaker"]
    assert len(trips) == 1 and trips[0]["rule"] == "scratch" and trips[0]["limit"] == MIB
    assert trips[0]["value"] <= MIB and "--max-scratch" in trips[0]["detail"]
    assert leftovers(tapes) == []


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (("--max-scratch", "lots"), "'lots' is not a size"),
        (("--max-scratch", "0"), "--max-scratch must be a positive size"),
        (("--fs", "overlay", "--max-scratch", "1G"), "needs --fs fuse"),
    ],
)
def test_a_bad_scratch_limit_is_refused_before_anything_is_made(
    work, opts: tuple[str, ...], message: str  # noqa: F811
) -> None:
    tree, tapes = work
    proc = booth_run(tree, tapes, "echo ran", *opts)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "ran" not in proc.stdout
    assert not (tapes / "t1.jbx").exists()
