"""What every fuzz harness shares: the target record, seed mutation, and the short driver."""

from __future__ import annotations

import random
import signal
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Target:
    """One fuzz target: `one_input(data)` raises only when the property is broken.

    `seeds()` returns valid inputs, so mutation starts inside the format rather than at its door.
    """

    name: str
    one_input: Callable[[bytes], None]
    seeds: Callable[[], list[bytes]]
    doc: str = ""
    # Inputs worth keeping as regressions: bytes that once broke the target.
    regressions: list[bytes] = field(default_factory=list)


class Hang(Exception):
    """One input ran longer than the per-input limit."""


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Turn a hang into a Hang exception (main thread only; SIGALRM)."""

    def fire(signum: int, frame: types.FrameType | None) -> None:
        raise Hang(f"one input ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


_INTERESTING = (0, 1, 0x7F, 0x80, 0xFF)
_INTERESTING_WIDE = (
    b"\x00\x00\x00\x00",
    b"\xff\xff\xff\xff",
    b"\xff\xff\xff\x7f",
    b"\x00" * 8,
    b"\xff" * 8,
    b"\x00\x00\x00\x80",
)


def mutate(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    """A libFuzzer-like mutation: 1-4 of flip, set, insert, delete, truncate, splice, overwrite
    with a boundary value. Cheap and deterministic for a given rng."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        n = len(buf)
        if op == 0 and n:
            buf[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            buf[rng.randrange(n)] = (
                rng.choice(_INTERESTING) if rng.random() < 0.5 else rng.randrange(256)
            )
        elif op == 2:
            at = rng.randint(0, n)
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3 and n:
            at = rng.randrange(n)
            del buf[at : at + rng.randint(1, 16)]
        elif op == 4 and n:
            del buf[rng.randint(0, n) :]
        elif op == 5 and seeds:
            other = rng.choice(seeds)
            if other:
                a = rng.randrange(len(other))
                piece = other[a : a + rng.randint(1, 64)]
                at = rng.randint(0, n)
                buf[at : at + len(piece)] = piece
        elif op == 6 and n >= 8:
            wide = rng.choice(_INTERESTING_WIDE)
            at = rng.randrange(n - len(wide) + 1) if n >= len(wide) else 0
            buf[at : at + len(wide)] = wide
        elif op == 7 and n:
            # Duplicate a slice: repeated records and repeated names are classic edge cases.
            a = rng.randrange(n)
            piece = buf[a : a + rng.randint(1, 256)]
            at = rng.randint(0, n)
            buf[at:at] = piece
    return bytes(buf)


def inputs(target: Target, iterations: int, seed: int) -> Iterator[bytes]:
    """Seeds, regressions, a few degenerate inputs, then `iterations` mutations of the seeds."""
    rng = random.Random(seed)
    seeds = target.seeds()
    yield from seeds
    yield from target.regressions
    yield from (b"", b"\x00", b"\xff" * 64, bytes(range(256)))
    for _ in range(iterations):
        base = (
            rng.choice(seeds)
            if seeds and rng.random() < 0.9
            else rng.randbytes(rng.randint(0, 128))
        )
        yield mutate(rng, base, seeds)


def run_short(target: Target, iterations: int, seed: int, per_input_s: int = 10) -> int:
    """Feed the target; the first input that breaks the property raises, naming the input."""
    count = 0
    for data in inputs(target, iterations, seed):
        try:
            with time_limit(per_input_s):
                target.one_input(data)
        except BaseException as exc:
            raise AssertionError(
                f"fuzz target {target.name} broke on input {data[:200]!r} "
                f"({len(data)} bytes): {type(exc).__name__}: {exc}"
            ) from exc
        count += 1
    return count
