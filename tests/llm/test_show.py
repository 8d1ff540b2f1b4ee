"""`jukebox show TAPE@N` on frames the real proxy recorded: the OpenAI and Anthropic SDKs, JSON
and streamed, with tool calls and their results, and headers never shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from jukebox.llm.server import ProxyServer
from jukebox.tape.tape import TapeWriter
from shadowfs.store import Store
from tests.llm import scenario
from tests.llm.upstream import FakeUpstream

ESC_PROMPT = "make it \x1b[31mred\x1b[0m and \u202eevil"


def show(*args: str) -> tuple[int, str]:
    import jukebox.cli.show  # noqa: F401  (registers the command)
    from jukebox.cli import cli

    result = CliRunner().invoke(cli, ["show", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: {result.exception!r}") from result.exception
    return result.exit_code, result.stdout + result.stderr


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, upstream_module) -> Path:
    """A tape dir whose tape `run` holds one scenario run through the proxy, a hostile
    prompt, then a tool call, an agent turn and a verifier with hostile output."""
    root = tmp_path_factory.mktemp("show")
    store = Store.open(root / ".jukebox" / "store", create=True)
    writer = TapeWriter.create(root / "run.jbx", store, "run")
    writer.append("run_start", {"argv": ["agent"]})
    upstreams = {"openai": upstream_module.openai_url, "anthropic": upstream_module.url}
    with ProxyServer(upstreams=upstreams, record=writer.append) as proxy:
        scenario.run(proxy.base_urls(), prompt=ESC_PROMPT)
    writer.append("tool_call", {"tool": "write_file", "args": {"path": "x"}, "result": "ok"})
    writer.append(
        "verify",
        {"cmd": ["pytest"], "exit": 1, "ok": False, "output": "1 failed\n\x1b[2Jwiped\n"},
    )
    writer.close()
    store.close()
    return root


@pytest.fixture(scope="module")
def upstream_module():
    up = FakeUpstream().start()
    yield up
    up.stop()


def test_show_reads_every_recorded_shape_as_a_conversation(recorded: Path) -> None:
    tape = str(recorded / "run.jbx")
    code, first = show(f"{tape}@1")
    assert code == 0, first
    assert "frame @1 of" in first and "llm_turn" in first and "model gpt-4o-mini" in first
    assert "  [system]\n    You are a file agent.\n  [user]\n    make it \\x1b[31mred" in first
    assert "reply:\n    → tool call write_file [call_fake_1]\n" in first, first
    assert '"path": "hello.txt"' in first and "\x1b" not in first

    _, answered = show(f"{tape}@2")
    assert "  [tool]\n    ← tool result [call_fake_1]\n      wrote hello.txt\n" in answered
    assert "reply:\n    done: wrote hello.txt" in answered, answered

    _, streamed = show(f"{tape}@3")  # chat stream, text
    assert "streamed" in streamed and "reply (a stream of" in streamed
    assert "echo: stream me a few words please" in streamed.split("reply (a")[1], streamed
    _, streamed_call = show(f"{tape}@4")  # chat stream, a tool call in pieces
    assert "→ tool call write_file" in streamed_call and '"path": "hello.txt"' in streamed_call

    _, responses = show(f"{tape}@6")  # Responses API stream
    assert "  [user]\n    stream a reply\n" in responses
    assert "echo: stream a reply" in responses.split("reply (a stream of")[1], responses

    _, anthropic = show(f"{tape}@7")
    assert "anthropic messages" in anthropic and "  [system]\n    You are careful.\n" in anthropic
    assert "→ tool call write_file [toolu_fake_1]" in anthropic, anthropic
    _, anthropic_stream = show(f"{tape}@8")
    assert "echo: use the cache and stream" in anthropic_stream.split("reply (a stream")[1]

    code, data = show(f"{tape}@4", "--json")
    view = json.loads(data)
    assert view["kind"] == "llm_turn" and view["seq"] == 4
    assert view["messages"] == [
        {"role": "user", "blocks": [{"type": "text", "text": ESC_PROMPT}]}
    ]  # JSON carries the exact text; only a terminal gets it escaped
    assert view["reply"]["blocks"][0]["name"] == "write_file"
    assert view["reply"]["stream_events"] == len(view["payload"]["response"])


def test_show_never_prints_headers_or_acts_on_escapes(recorded: Path) -> None:
    tape = str(recorded / "run.jbx")
    code, last = show(tape)  # no @N: the last frame
    assert code == 0 and "verify" in last and "verifier FAILED: pytest (exit 1)" in last
    assert "\x1b" not in last and "\\x1b[2Jwiped" in last, last
    outputs = []
    for n in range(13):
        for extra in ((), ("--json",)):
            code, out = show(f"{tape}@{n}", *extra)
            assert code == 0, out
            outputs.append(out)
    text = "\n".join(outputs)
    for secret in (scenario.OPENAI_KEY, scenario.ANTHROPIC_KEY, "REDACTED", "authorization"):
        assert secret not in text
    assert "x-stainless" not in text and "_headers" not in text
    texts = outputs[::2]
    assert all("\x1b" not in o and "\u202e" not in o for o in texts)
    assert "make it \\x1b[31mred\\x1b[0m and \\u202eevil" in texts[1], texts[1]

    code, out = show(f"{tape}@99")
    assert code == 2 and "there is no frame 99" in out and out.count("\n") == 1
