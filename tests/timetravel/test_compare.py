"""compare_tapes on tapes written directly (no booth): the shared prefix, models, the first
differing turn, tool calls, files, tokens and cost, and the markdown and JSON renderings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jukebox.tape.compare import compare_tapes, prompt_text
from jukebox.tape.tape import Tape, TapeWriter
from shadowfs.store import Store
from shadowfs.tree import build_tree


def turn(model: str, prompt: str, reply: str, *, tool: str | None = None, cost: float = 0.01,
         tokens: tuple[int, int] = (10, 5)) -> dict[str, Any]:  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": reply}
    calls = []
    if tool:
        arguments = {"path": tool}
        message["tool_calls"] = [
            {"id": "c1", "type": "function",
             "function": {"name": "write_file", "arguments": json.dumps(arguments)}}
        ]  # fmt: skip
        calls = [{"name": "write_file", "arguments": arguments}]
    return {
        "provider": "openai",
        "endpoint": "chat.completions",
        "model": model,
        "status": 200,
        "stream": False,
        "usage": {"input": tokens[0], "output": tokens[1], "cached": 0},
        "tool_calls": calls,
        "cost_usd": cost,
        "request": {"model": model, "messages": [{"role": "user", "content": prompt}]},
        "response": {"model": model, "choices": [{"index": 0, "message": message}]},
    }


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store.open(tmp_path / "store", create=True) as s:
        yield s


def files(store: Store, root: Path, contents: dict[str, str]) -> Any:
    root.mkdir()
    for name, text in contents.items():
        (root / name).write_text(text)
    return build_tree(store, root)


def test_a_fork_against_its_origin(store: Store, tmp_path: Path) -> None:
    base = files(store, tmp_path / "base", {"README": "hi\n"})
    after = files(store, tmp_path / "after", {"README": "hi\n", "a.txt": "A\n"})
    other = files(store, tmp_path / "other", {"README": "changed\n", "b.txt": "B\n"})
    a_path = tmp_path / "a.jbx"
    with TapeWriter.create(a_path, store, "a") as w:
        w.append("run_start", {"argv": ["agent"]}, tree=base)
        w.append("llm_turn", turn("gpt-4o-mini", "write a", "", tool="a.txt"))
        w.append("checkpoint", {"id": 1, "label": "one"}, tree=after)
        w.append("llm_turn", turn("gpt-4o-mini", "and now?", "all done"))
        w.append("fs", {"reason": "exit"}, tree=after)
        w.append("exit", {"code": 0})
    a = Tape.load(a_path, store)
    b_path = tmp_path / "b.jbx"
    with TapeWriter.fork_from(a, 3, b_path, "b") as w:
        w.append("llm_turn", turn("claude-x", "and now?", "something | else", cost=0.5,
                                  tokens=(12, 40)))  # fmt: skip
        w.append("llm_turn", turn("claude-x", "more", "", tool="b.txt", cost=0.25))
        w.append("fs", {"reason": "exit"}, tree=other)
        w.append("exit", {"code": 3})
    b = Tape.load(b_path, store)

    c = compare_tapes(a, b, store)
    assert c.shared_prefix == 3
    assert c.a.models == ["gpt-4o-mini"] and c.b.models == ["gpt-4o-mini", "claude-x"]
    assert c.differing_turns == [1, 2]
    first_a, first_b = c.first_turn_diff
    assert (first_a.seq, first_b.seq) == (3, 4)
    assert (first_a.reply, first_b.reply) == ("all done", "something | else")
    assert c.b.tokens == {"input": 32, "output": 50, "cached": 0}
    assert c.b.cost_usd == pytest.approx(0.76) and c.a.cost_usd == pytest.approx(0.02)
    assert [x["arguments"]["path"] for x in c.b.tool_calls] == ["a.txt", "b.txt"]
    # Sorted by path bytes, as diff_trees sorts them.
    assert [(f.status, f.path) for f in c.files] == [
        ("modified", "README"), ("deleted", "a.txt"), ("added", "b.txt")
    ]  # fmt: skip
    assert (c.a.exit_code, c.b.exit_code) == (0, 3) and not c.identical

    md = c.to_markdown()
    for section in ("# Tape comparison: a vs b", "## Shared prefix", "## Models", "## Messages",
                    "## Tool calls", "## Files", "## Tokens and cost"):  # fmt: skip
        assert section in md
    assert "Frames 0..2 (3 frame(s)) are identical byte for byte" in md
    assert "| model * | gpt-4o-mini | claude-x |" in md
    assert "something \\| else" in md  # a pipe must not split the table cell
    assert "| prompt | and now? | and now? |" in md  # the same prompt is not starred
    assert "- `A` b.txt" in md and "- `D` a.txt" in md and "- `M` README" in md
    assert "| cost (USD) | $0.0200 | $0.7600 | +$0.7400 |" in md
    data = c.to_json()
    json.dumps(data)  # plain data all the way down
    assert data["shared_prefix"] == 3 and data["messages"]["differing_turns"] == [2, 3]
    assert data["messages"]["first_difference"]["b"]["model"] == "claude-x"
    assert {f["path"] for f in data["files"]} == {"a.txt", "b.txt", "README"}


def test_a_tape_against_itself_is_identical(store: Store, tmp_path: Path) -> None:
    tree = files(store, tmp_path / "t", {"x": "1\n"})
    path = tmp_path / "t.jbx"
    with TapeWriter.create(path, store, "t") as w:
        w.append("run_start", {"argv": ["agent"]}, tree=tree)
        w.append("llm_turn", turn("m", "p", "r"))
        w.append("exit", {"code": 0})
    tape = Tape.load(path, store)
    c = compare_tapes(tape, tape, store)
    assert c.identical and c.shared_prefix == 3 and c.files == []
    md = c.to_markdown()
    assert "All 1 turn(s) match" in md and "The final file states are the same" in md
    assert "Same: m." in md


def test_prompt_text_reads_each_api_shape() -> None:
    assert prompt_text({"messages": [{"role": "user", "content": "hi"}]}) == "hi"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert prompt_text({"messages": [{"role": "user", "content": parts}]}) == "a b"
    assert prompt_text({"input": "summarize"}) == "summarize"
    assert prompt_text({"input": [{"role": "user", "content": "x"}]}) == "x"
    assert prompt_text({"$text": "not json"}) == "" and prompt_text(None) == ""
