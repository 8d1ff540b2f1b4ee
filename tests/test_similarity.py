"""Hashed n-gram vectors: near-duplicates close, progress apart, the same in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.guard.similarity import (
    DIM,
    canonical_json,
    cosine,
    output_vector,
    similarity,
    split_tool_call,
    text_vector,
    tool_call_signature,
    tool_call_vector,
)

REPO = Path(__file__).resolve().parent.parent
# Long prose (early snapshots of two docs pages), frozen here: the docs change, the expected
# similarities must not change with them.
PROSE = REPO / "tests" / "data" / "similarity"
THRESHOLD = 0.92  # the breaker's default

# What a looping agent says again, slightly reworded each time.
LOOPING = [
    (
        "I need to read the file src/app.py to understand the bug. Let me read it.",
        "I need to read src/app.py to understand the bug. Let me read it again.",
    ),
    (
        "The test still fails with ImportError: cannot import name 'parse' from 'utils'. "
        "Let me try fixing the import.",
        "The test still fails with ImportError: cannot import name 'parse' from 'utils'. "
        "Let me try to fix the import again.",
    ),
    (
        "The build failed because the dependency `requests` is missing. I will install it "
        "with pip and run the build again.",
        "The build failed since the dependency `requests` is missing. I'll install it with "
        "pip and then run the build again.",
    ),
    (
        "I'll run the tests to see if the fix works.",
        "Let me run the tests to see whether the fix works.",
    ),
]

# Successive steps of an agent that makes progress.
PROGRESSING = [
    ("Processing item 1", "Processing item 2"),
    (
        "Now I will write the tests for the parser module.",
        "Next, I'll update the README with usage examples.",
    ),
    ("Reading module_1.py", "Reading module_2.py"),
    (
        "Fixed the bug in parser.py: empty input now returns an empty list. "
        "Next I will fix lexer.py.",
        "Fixed the bug in lexer.py: a trailing comment no longer crashes. "
        "Next I will fix emitter.py.",
    ),
    (
        "I'll read the file src/models/user.py to see how users are stored.",
        "I'll read the file src/models/order.py to see how orders are stored.",
    ),
]


@pytest.mark.parametrize(("a", "b"), LOOPING)
def test_reworded_repeats_are_near_duplicates(a: str, b: str) -> None:
    assert similarity(a, b) >= THRESHOLD


@pytest.mark.parametrize(("a", "b"), PROGRESSING)
def test_steps_of_progress_are_not(a: str, b: str) -> None:
    assert similarity(a, b) < THRESHOLD


def test_identical_and_case_and_spacing() -> None:
    text = "Let me open config.py and look at the DATABASE_URL setting."
    assert similarity(text, text) == pytest.approx(1.0)
    assert similarity(text, "  let me   open CONFIG.py and look at the database_url setting. ") == (
        pytest.approx(1.0)
    )


def test_vectors_are_unit_sparse_and_bounded() -> None:
    vec = text_vector("The quick brown fox jumps over the lazy dog. " * 40)
    assert vec
    assert all(0 <= k < DIM for k in vec)
    assert sum(v * v for v in vec.values()) == pytest.approx(1.0)
    assert text_vector("") == {}
    assert text_vector("   ...  !!") == {}
    assert cosine({}, vec) == 0.0


def test_filler_only_text_still_has_a_vector() -> None:
    assert text_vector("ok, let me do it")
    assert similarity("ok, let me do it", "ok, let me do it") == pytest.approx(1.0)


def test_long_text_with_a_small_edit_stays_near_and_a_new_text_does_not() -> None:
    base = (PROSE / "booth-prose.txt").read_text()
    edited = base.replace("supervisor", "parent", 2) + "\nOne more line at the end."
    assert similarity(base, edited) >= THRESHOLD
    other = (PROSE / "architecture-prose.txt").read_text()
    assert similarity(base, other) < 0.7


def test_tool_call_shapes_agree_and_ids_are_ignored() -> None:
    openai = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "src/app.py", "lines": [1, 50]}'},
    }
    anthropic = {
        "type": "tool_use",
        "id": "toolu_9",
        "name": "read_file",
        "input": {"lines": [1, 50], "path": "src/app.py"},
    }
    plain = {"name": "read_file", "args": {"path": "src/app.py", "lines": [1, 50]}}
    assert split_tool_call(openai) == ("read_file", {"path": "src/app.py", "lines": [1, 50]})
    sigs = {tool_call_signature(c) for c in (openai, anthropic, plain)}
    assert sigs == {'read_file {"lines":[1,50],"path":"src/app.py"}'}
    assert cosine(tool_call_vector(openai), tool_call_vector(anthropic)) == pytest.approx(1.0)


def test_same_tool_on_another_file_is_not_a_repeat() -> None:
    a = tool_call_vector({"name": "read_file", "arguments": {"path": "src/a.py"}})
    b = tool_call_vector({"name": "read_file", "arguments": {"path": "src/b.py"}})
    assert cosine(a, b) == pytest.approx(0.0)


def test_long_arguments_compare_as_text() -> None:
    # A small Python module (an early jukebox/errors.py), frozen like the prose above.
    content = (PROSE / "errors-module.txt").read_text()
    write = {"name": "write_file", "arguments": {"path": "errors.py", "content": content}}
    tweaked = {
        "name": "write_file",
        "arguments": {
            "path": "errors.py",
            "content": content.replace("exit_code = 1", "exit_code = 3"),
        },
    }
    elsewhere = {"name": "write_file", "arguments": {"path": "other.py", "content": content}}
    assert cosine(tool_call_vector(write), tool_call_vector(tweaked)) >= THRESHOLD
    # Same content into another file: the exact half differs.
    assert cosine(tool_call_vector(write), tool_call_vector(elsewhere)) == pytest.approx(
        0.5, abs=0.02
    )


def test_unparseable_arguments_are_kept_as_a_string() -> None:
    name, args = split_tool_call({"function": {"name": "sh", "arguments": "ls -la {"}})
    assert (name, args) == ("sh", "ls -la {")


def test_output_joins_text_and_calls() -> None:
    call = {"name": "read_file", "arguments": {"path": "src/app.py"}}
    other = {"name": "read_file", "arguments": {"path": "src/util.py"}}
    same = output_vector("Let me look at the file.", [call])
    assert cosine(same, output_vector("Let me look at the file.", [call])) == pytest.approx(1.0)
    # Same words, another file: the text half agrees, the call half does not.
    assert cosine(same, output_vector("Let me look at the file.", [other])) == pytest.approx(
        0.5, abs=0.02
    )
    assert output_vector(None, None) == {}
    assert output_vector("", []) == {}


def test_canonical_json_is_order_free() -> None:
    assert (
        canonical_json({"b": 1, "a": [1, {"d": 2, "c": "é"}]}) == '{"a":[1,{"c":"é","d":2}],"b":1}'
    )


def test_vectors_are_the_same_in_another_process() -> None:
    texts = [pair[0] for pair in LOOPING] + [(PROSE / "booth-prose.txt").read_text()[:5000]]
    call = {"name": "write_file", "arguments": {"path": "x.py", "content": "print('hi')\n" * 20}}
    code = (
        "import json, sys\n"
        "from jukebox.guard.similarity import text_vector, tool_call_vector\n"
        "texts, call = json.load(sys.stdin)\n"
        "out = [sorted(text_vector(t).items()) for t in texts]\n"
        "out.append(sorted(tool_call_vector(call).items()))\n"
        "print(json.dumps(out))\n"
    )
    here = [sorted(text_vector(t).items()) for t in texts] + [
        sorted(tool_call_vector(call).items())
    ]
    here_json = json.loads(json.dumps(here))
    for seed in ("1", "2"):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps([texts, call]),
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=REPO,
            check=True,
            timeout=30,
        )
        assert json.loads(proc.stdout) == here_json
