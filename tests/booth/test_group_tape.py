"""The booth's group-commit tape writer: checkpoints never wait for the disk's fsync."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jukebox.booth.supervisor import GroupTape
from jukebox.tape.tape import Tape, TapeWriter
from shadowfs import wakeups
from shadowfs.store import Store


class GatedStore:
    """A real store whose flush waits at a gate first: it holds the group commit mid-flush, as
    a slow fsync does, for as long as the test needs."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def flush(self) -> None:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        self.store.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class WatchedCondition(threading.Condition):
    """The tape's condition for frames in flight, which tells the test when a thread waits on
    it: the event a sync that must wait for the background flush is seen to reach."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


@contextlib.contextmanager
def flush_held(tmp_path: Path) -> Iterator[tuple[Store, GatedStore, GroupTape]]:
    """A started group-commit tape whose first checkpoint's flush is held at the gate."""
    with Store.open(tmp_path / "store", create=True) as store:
        gated = GatedStore(store)
        writer = TapeWriter.create(tmp_path / "t1.jbx", store, "t1", fsync=False)
        tape = GroupTape(writer, gated, delay=0.01)
        tape.append("run_start", {"tape_id": "t1"})
        tape.start()
        gated.gate.clear()
        first = store.put("blob", b"step one")
        assert tape.append("checkpoint", {"n": 1}, refs=[first], defer=True) == 1
        assert gated.entered.wait(5), "the group commit never started"
        try:
            yield store, gated, tape
        finally:
            gated.gate.set()


def test_a_checkpoint_queues_behind_a_flush_in_progress_instead_of_waiting_for_it(
    tmp_path: Path,
) -> None:
    with flush_held(tmp_path) as (store, gated, tape):
        # The flush is stuck in its fsync; a checkpoint and a plain frame arrive meanwhile.
        got: list[int] = []

        def arrive() -> None:
            second = store.put("blob", b"step two")
            got.append(tape.append("checkpoint", {"n": 2}, refs=[second], defer=True))
            got.append(tape.append("note", {"event": "after"}))

        arriving = threading.Thread(target=arrive)
        arriving.start()
        arriving.join(5)
        assert not arriving.is_alive(), "an append waited for the flush in progress"
        assert got == [2, 3] and tape.count == 4

        # A sync (before a commit or a verdict) must wait for the frames in flight: it is seen
        # waiting for them to land (not merely not done yet after a while, which a sync thread
        # that has not run at all also is), and once it returns they are all on the tape.
        landed = WatchedCondition(tape._lock)
        with tape._lock:
            tape._landed = landed
        on_tape_at_return: list[list[Any]] = []

        def sync() -> None:
            tape.sync()
            loaded = Tape.load(tmp_path / "t1.jbx")
            on_tape_at_return.append([f.payload.get("n", f.kind) for f in loaded.frames])

        syncing = threading.Thread(target=sync)
        syncing.start()
        deadline = time.monotonic() + 10
        while not landed.waiting.is_set() and syncing.is_alive():
            assert time.monotonic() < deadline, "sync neither waited for the frames nor returned"
            landed.waiting.wait(0.01)
        assert syncing.is_alive() and not on_tape_at_return, (
            "sync returned while frames were still in flight"
        )
        gated.gate.set()
        syncing.join(10)
        assert not syncing.is_alive()
        assert on_tape_at_return == [["run_start", 1, 2, "note"]]
        tape.close()

        recorded = Tape.load(tmp_path / "t1.jbx", store)
        assert [(f.kind, f.payload.get("n")) for f in recorded.frames] == [
            ("run_start", None),
            ("checkpoint", 1),
            ("checkpoint", 2),
            ("note", None),
        ]
        assert recorded.verify(check_objects=True).ok


def test_a_plain_frame_that_came_during_the_flush_is_written_with_it_not_a_round_later(
    tmp_path: Path,
) -> None:
    with flush_held(tmp_path) as (_, gated, tape):
        tape.delay = 30.0  # the next round is far off: only the batch can write the note
        assert tape.append("note", {"event": "during the flush"}) == 2
        gated.gate.set()
        deadline = time.monotonic() + 10
        while len(Tape.load(tmp_path / "t1.jbx").frames) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        kinds = [f.kind for f in Tape.load(tmp_path / "t1.jbx").frames]
        assert kinds == ["run_start", "checkpoint", "note"]
        tape.close()


def test_a_failed_group_commit_writes_no_frame_naming_objects_not_on_disk(tmp_path: Path) -> None:
    with Store.open(tmp_path / "store", create=True) as store:

        class FailingStore(GatedStore):
            def flush(self) -> None:
                self.entered.set()
                raise OSError(28, "No space left on device")

        failing = FailingStore(store)
        writer = TapeWriter.create(tmp_path / "t1.jbx", store, "t1", fsync=False)
        tape = GroupTape(writer, failing, delay=0.01)
        tape.append("run_start", {"tape_id": "t1"})
        tape.start()
        oid = store.put("blob", b"step")
        tape.append("checkpoint", {"n": 1}, refs=[oid], defer=True)
        assert failing.entered.wait(5)
        with pytest.raises(Exception, match="No space left on device"):
            tape.sync()
        with pytest.raises(Exception, match="No space left on device"):
            tape.close()
        assert [f.kind for f in Tape.load(tmp_path / "t1.jbx", store).frames] == ["run_start"]


class CountedCondition(threading.Condition):
    """The tape's wake-up condition, counting the notifications its flusher gets."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_a_checkpoint_answered_from_the_control_thread_wakes_the_flusher_only_after(
    tmp_path: Path,
) -> None:
    # The control server answers inside wakeups.deferred(): the flusher, woken earlier, would
    # take turns at the interpreter lock with the answer. Woken after, it still writes the frame.
    with Store.open(tmp_path / "store", create=True) as store:
        writer = TapeWriter.create(tmp_path / "t1.jbx", store, "t1", fsync=False)
        tape = GroupTape(writer, store, delay=0.01)
        tape.append("run_start", {"tape_id": "t1"})
        wake = tape._wake = CountedCondition(tape._lock)
        tape.start()
        with wakeups.deferred():
            oid = store.put("blob", b"step")
            assert tape.append("checkpoint", {"n": 1}, refs=[oid], defer=True) == 1
            assert wake.notified == 0
        assert wake.notified == 1
        deadline = time.monotonic() + 10
        while len(Tape.load(tmp_path / "t1.jbx").frames) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [f.kind for f in Tape.load(tmp_path / "t1.jbx", store).frames] == [
            "run_start", "checkpoint",
        ]  # fmt: skip
        tape.close()
