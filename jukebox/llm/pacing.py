"""Honoring the recorded timing in a replay: each answer after its recorded latency, and in
its recorded order.

A replay answers at once by default, so calls made in parallel complete in whatever order the
replay serves them, not the order they completed in when recorded; an agent whose next calls
depend on which call finished first then asks for something the recording does not hold next.
With `honor_timing`, the `Pacer` holds each recorded answer until:

* its recorded latency has passed since the request arrived: a JSON body after the whole
  latency; a stream's headers after the time the upstream took to start it, then each of its
  chunks at the recorded offset from the headers;
* and every recorded call of its concurrency window that completed before it (a lower frame;
  jukebox.llm.replay.concurrency_windows) has been answered, so completions come in the
  recorded order. That wait is bounded (ORDER_GRACE_S past the latency): an agent that never
  asks for such a call does not hang the replay, it only loses the order.
"""

from __future__ import annotations

import itertools

import trio

from jukebox.llm.replay import Recorded

# How long past its own latency an answer waits for the calls recorded as completing before it.
ORDER_GRACE_S = 1.0


def latency_s(rec: Recorded) -> float:
    return max(rec.end_ns - rec.start_ns, 0) / 1e9


def headers_after_s(rec: Recorded) -> float:
    """When a stream's headers came after its request: its latency less its last event's offset
    (event offsets count from the headers)."""
    offsets = [e.t_ms for e in rec.events or ()]
    return max(latency_s(rec) - max(offsets, default=0.0) / 1000, 0.0)


class Pacer:
    """The recorded timing of one replay's exchanges (a ReplaySource's `exchanges`); its
    methods run on the proxy's trio loop, `arrived` in trio.current_time()."""

    def __init__(self, exchanges: list[Recorded]) -> None:
        self._answered = {ex.seq: trio.Event() for ex in exchanges}
        windows: dict[int, list[int]] = {}
        for ex in sorted(exchanges, key=lambda e: e.seq):
            windows.setdefault(ex.window, []).append(ex.seq)
        # Each call's predecessors are the calls of its window before it: its window's frames
        # in order, and its place among them.
        self._place: dict[int, tuple[list[int], int]] = {
            seq: (seqs, i) for seqs in windows.values() for i, seq in enumerate(seqs)
        }

    async def until(self, arrived: float, offset_s: float) -> None:
        await trio.sleep_until(arrived + offset_s)

    async def in_turn(self, rec: Recorded, arrived: float) -> None:
        """Waits until the calls recorded as completing before `rec` are answered, or until
        ORDER_GRACE_S past its recorded latency."""
        seqs, place = self._place.get(rec.seq, ([], 0))
        with trio.move_on_at(arrived + latency_s(rec) + ORDER_GRACE_S):
            for seq in itertools.islice(seqs, place):
                await self._answered[seq].wait()

    def answered(self, rec: Recorded) -> None:
        event = self._answered.get(rec.seq)
        if event is not None:
            event.set()
