"""The circuit breaker's cost per model turn: `CircuitBreaker.observe()` p50 / p99.

The proxy calls `observe()` once per model exchange, after the response is recorded, so this is
what the breaker adds to every turn. Texts are real prose and code from this repository, cut into
1 KB and 10 KB pieces; each turn gets a different piece than the one before it (the common case:
a new output is vectorized and compared with the last one). Beside them: a near-duplicate (one
word changed), the identical text again (no vectorizing at all), a tool call, counters only, and
`difflib.SequenceMatcher.ratio()` on the same 1 KB pieces as a reference for what comparing two
texts the obvious way costs.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import measure_us
from jukebox.guard.breaker import CircuitBreaker

REPO = Path(__file__).resolve().parent.parent
PIECES = 12


def corpus() -> str:
    """Deterministic real text: the docs, then the jukebox sources."""
    parts = [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))]
    parts += [p.read_text() for p in sorted((REPO / "jukebox").glob("*.py"))]
    return "\n".join(parts)


def pieces(size: int, count: int = PIECES) -> list[str]:
    text = corpus()
    while len(text) < size * count:
        text += text
    return [text[i * size : (i + 1) * size] for i in range(count)]


def _breaker() -> CircuitBreaker:
    # Every rule armed, none reachable: the work is done, nothing trips.
    return CircuitBreaker(
        max_cost_usd=1e9,
        max_tokens=10**15,
        max_turns=10**9,
        max_semantic_repeat=10**9,
        max_repeat_failures=10**9,
    )


def _row(case: str, system: str, fn: Callable[[], object], n: int, note: str = "") -> dict:
    row: dict[str, Any] = {"group": "breaker", "case": case, "system": system}
    row.update(measure_us(fn, n=n, warmup=5))
    if note:
        row["note"] = note
    return row


def run(quick: bool = False) -> list[dict[str, Any]]:
    n = 200 if quick else 2000
    rows: list[dict[str, Any]] = []

    for size, label in ((1024, "1 KB"), (10 * 1024, "10 KB")):
        texts = itertools.cycle(pieces(size))
        b = _breaker()
        rows.append(
            _row(
                f"observe, {label} text, new each turn",
                "jukebox",
                lambda b=b, texts=texts: b.observe(cost_usd=0.001, tokens=900, text=next(texts)),
                n,
                "vectorize + cosine with the previous output",
            )
        )
        base = pieces(size, 1)[0]
        variants = itertools.cycle([base, base.replace(" the ", " a ", 1)])
        b = _breaker()
        rows.append(
            _row(
                f"observe, {label} text, near-duplicate",
                "jukebox",
                lambda b=b, v=variants: b.observe(tokens=900, text=next(v)),
                n,
                "one word changed each turn; the repeat run grows",
            )
        )
        b = _breaker()
        rows.append(
            _row(
                f"observe, {label} text, identical",
                "jukebox",
                lambda b=b, base=base: b.observe(tokens=900, text=base),
                n,
                "equal to the last output: no vectorizing",
            )
        )

    files = itertools.cycle(f"src/module_{i}.py" for i in range(PIECES))
    b = _breaker()
    rows.append(
        _row(
            "observe, one read_file tool call",
            "jukebox",
            lambda: b.observe(
                tokens=300,
                tool_calls=[
                    {
                        "id": "call_1",
                        "function": {
                            "name": "read_file",
                            "arguments": f'{{"path": "{next(files)}"}}',
                        },
                    }
                ],
            ),
            n,
        )
    )
    b = _breaker()
    rows.append(
        _row("observe, counters only", "jukebox", lambda: b.observe(cost_usd=0.001, tokens=900), n)
    )
    b = _breaker()
    rows.append(_row("admit", "jukebox", b.admit, n))

    small = pieces(1024)
    pairs = itertools.cycle(itertools.pairwise(small))
    rows.append(
        _row(
            "compare two 1 KB texts",
            "difflib",
            lambda: difflib.SequenceMatcher(None, *next(pairs)).ratio(),
            max(20, n // 10),
            "SequenceMatcher.ratio(), for reference",
        )
    )
    return rows


if __name__ == "__main__":
    for r in run(quick=True):
        print(
            f"{r['case']:<42} {r['system']:<8} p50 {r['p50_us']:9.1f} µs  p99 {r['p99_us']:9.1f} µs"
        )
