"""Builds the golden tape tests/data/golden/tape.jbx and its store (golden/.jukebox/store/).

DO NOT re-run this for the committed files. The golden tape guards compatibility: every later
version of jukebox must still read the bytes committed today. Re-create it only when the tape
format version changes, and then keep the old golden tape too (as tests/data/golden-v1/, say).

It refuses to overwrite an existing golden directory; pass a fresh directory to try it out:

    .venv/bin/python tests/make_golden.py /tmp/golden

Everything but the store's pack names and pack timestamps is fixed, so a re-run in a new directory
reproduces the same tape bytes and head.
"""

from __future__ import annotations

import sys
from pathlib import Path

from jukebox.tape.tape import Tape, TapeWriter
from shadowfs.store import Store
from shadowfs.tree import Entry, encode_tree

T0 = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z

HELLO = b'print("hello, tape")\n'
README = "# Golden\n\nA file written by the golden agent: caf\u00e9 \u2615\n".encode()


def build(target: Path) -> Tape:
    if target.exists():
        raise SystemExit(
            f"{target} exists; the golden tape is never re-made in place (see the docstring)"
        )
    target.mkdir(parents=True)
    with Store.open(target / ".jukebox" / "store", create=True) as store:
        hello = store.put("blob", HELLO)
        readme = store.put("blob", README)
        tree = store.put(
            "tree",
            encode_tree(
                [
                    Entry(b"README.md", "file", 0o644, len(README), T0, readme, None),
                    Entry(b"hello.py", "file", 0o755, len(HELLO), T0, hello, None),
                ]
            ),
        )
        journal = store.put("journal", b'{"op":"write","path":"hello.py","off":0,"len":21}\n')
        # Long enough that it must be moved to the store as a `json` object.
        prompt = "You are a careful agent. Write hello.py and a README. " * 120
        with TapeWriter.create(target / "tape.jbx", store, "golden-0001") as w:
            w.append(
                "run_start",
                {"name": "golden-agent", "argv": ["python", "agent.py"], "cwd": "/work/repo",
                 "jukebox": "0.1.0"},
                time_ns=T0,
            )
            w.append(
                "llm_turn",
                {
                    "provider": "openai",
                    "model": "gpt-4o-mini",
                    "request": {"messages": [{"role": "system", "content": prompt},
                                             {"role": "user", "content": "go"}]},
                    "response": {"content": "I will write hello.py.", "finish": "tool_calls"},
                    "tokens_in": 1523,
                    "tokens_out": 12,
                    "cost_usd": 0.00024,
                    "headers": {"authorization": "[redacted]"},
                },
                time_ns=T0 + 850_000_000,
            )
            w.append(
                "tool_call",
                {"tool": "write_file", "args": {"path": "hello.py"}, "result": "ok"},
                time_ns=T0 + 900_000_000,
            )
            w.append(
                "fs",
                {"ops": 2, "paths": ["README.md", "hello.py"], "bytes": len(HELLO) + len(README)},
                refs=[hello, readme, journal],
                time_ns=T0 + 950_000_000,
            )
            w.append("checkpoint", {"label": "after-hello", "id": 1}, tree=tree,
                     time_ns=T0 + 1_000_000_000)
            w.append("agent_turn", {"text": "Done: caf\u00e9 \u2615, \U0001f3b5", "turn": 1},
                     time_ns=T0 + 1_100_000_000)
            w.append("note", {"raw": b"\x00\x01\xfe\xff", "text": "binary goes in as hex"},
                     time_ns=T0 + 1_150_000_000)
            w.append("verify", {"cmd": ["python", "hello.py"], "exit": 0, "ok": True},
                     time_ns=T0 + 1_300_000_000)
            w.append("commit", {"tree": tree.hex(), "changes": 2}, tree=tree,
                     time_ns=T0 + 1_400_000_000)
            w.append("exit", {"code": 0}, time_ns=T0 + 1_450_000_000)
    with Store.open(target / ".jukebox" / "store", create=False) as store:
        tape = Tape.load(target / "tape.jbx", store)
        report = tape.verify(deep=True)
        report.raise_for_problems()
    return tape


def main(argv: list[str]) -> None:
    target = Path(argv[1]) if len(argv) > 1 else Path(__file__).parent / "data" / "golden"
    tape = build(target)
    head = tape.head
    print(f"wrote {target}: {head.count} frames")
    print(f"head merkle root {head.merkle_root.hex()}")
    print(f"last frame id    {head.last_frame_id.hex() if head.last_frame_id else None}")


if __name__ == "__main__":
    main(sys.argv)
