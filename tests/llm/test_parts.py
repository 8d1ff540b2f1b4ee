"""The proxy's parts on their own: SSE parsing, prices, redaction, summaries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jukebox.errors import UsageError
from jukebox.llm.pricing import PriceTable
from jukebox.llm.providers import summarize
from jukebox.llm.sse import SSEEvent, SSEParser, encode_event, event_from_record
from jukebox.llm.stream_end import FINAL_TYPES, is_final
from jukebox.redact import Scrubber, redact_headers


def test_sse_parser_handles_split_lines_crlf_comments_and_an_unterminated_tail() -> None:
    p = SSEParser()
    assert p.feed(b": keep-alive\r\nevent: a\r\nda", 1.0) == []
    first, second = p.feed(b'ta: {"x": 1}\r\n\r\ndata: line1\ndata: line2\n\ndata: [DO', 2.0)
    assert (first.event, first.json(), first.chunk) == ("a", {"x": 1}, 1)
    assert second.data == "line1\nline2" and p.events == [first, second]
    (tail,) = p.close(3.0)
    assert tail.data == "[DO" and tail.chunk == 1
    again = event_from_record(first.to_record())
    assert encode_event(again) == b'event: a\ndata: {"x":1}\n\n'


_SSE_LINES = st.lists(st.sampled_from(
    ["", "", ": ping", "event: a", "id: 7", 'data: {"x": 1}', "data: é", "data:", "data: [DONE]"]
), max_size=12)  # fmt: skip


def _parsed(data: bytes, cuts: list[int]) -> tuple[list[tuple[str, str | None]], bytes, bytes]:
    p = SSEParser()
    ready = b""
    for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
        p.feed(data[a:b], 0.0)
        ready += p.take_ready()
    p.close(1.0)
    return [(e.data, e.event) for e in p.events], ready, p.take_rest()


@settings(max_examples=150, deadline=None)
@given(lines=_SSE_LINES, cuts=st.lists(st.integers(0, 200), max_size=4))
def test_sse_parser_gives_the_same_events_for_lf_and_crlf_lines_however_read(
    lines: list[str], cuts: list[int]
) -> None:
    # Streams end lines in \n (split at once) or \r\n (searched line by line): both parse
    # alike, and what is passed on is every byte, cut only between events.
    lf = "".join(f"{line}\n" for line in lines).encode()
    crlf = lf.replace(b"\n", b"\r\n")
    for data in (lf, crlf):
        events, ready, rest = _parsed(data, sorted(c for c in cuts if c <= len(data)))
        assert events == _parsed(lf, [])[0]
        assert ready + rest == data
        alone = SSEParser()
        alone.feed(ready, 0.0)
        assert alone.close(1.0) == [], "passed on in the middle of an event"


def test_each_final_type_ends_a_stream_and_other_events_do_not() -> None:
    for kind in FINAL_TYPES:
        assert is_final(SSEEvent(f'{{"type": "{kind}"}}'))
        assert is_final(SSEEvent("{}", event=kind))
    assert is_final(SSEEvent("[DONE]"))
    assert not is_final(SSEEvent('{"type": "message_delta", "text": "an error"}'))
    assert not is_final(SSEEvent('{"choices": [{"delta": {"content": "hi"}}]}'))


@pytest.mark.parametrize(
    ("model", "provider", "rates"),
    [
        ("o3-pro", "openai", (20.0, 80.0)),  # prefix matching priced it as o3, ten times too low
        ("o3-pro-2025-06-10", "openai", (20.0, 80.0)),
        ("gpt-5-pro", "openai", (15.0, 120.0)),
        ("gpt-5-2025-08-07", "openai", (1.25, 10.0)),
        ("gpt-5.1", "openai", (1.25, 10.0)),  # the hand-kept table had no price: counted $0
        ("gpt-4o-mini-2024-07-18", "openai", (0.15, 0.60)),
        ("claude-sonnet-4-5-20250929", "anthropic", (3.0, 15.0)),
        ("claude-haiku-4-5", "anthropic", (1.0, 5.0)),
        ("gemini-2.5-flash", "gemini", (0.30, 2.50)),  # Gemini's native API: Google's prices
        ("gpt-4o-pro", "openai", None),  # another model, not gpt-4o: no price, not a wrong one
        ("llama3.1", "openai", None),  # a local model behind an OpenAI-compatible server
    ],
)
def test_the_catalogue_prices_a_model_as_itself_or_a_dated_snapshot_never_a_sibling(
    model: str, provider: str, rates: tuple[float, float] | None
) -> None:
    price = PriceTable.shipped().known(model, provider)
    assert (price and (price.input, price.output)) == rates


def test_the_catalogue_prices_tiers_and_cache_reads_and_writes() -> None:
    table = PriceTable.shipped()
    # Anthropic's long-context rate: past 200k prompt tokens every input token costs $6/M.
    assert table.cost("claude-sonnet-4-5", {"input": 100_000}, "anthropic") == 0.3
    assert table.cost("claude-sonnet-4-5", {"input": 300_000}, "anthropic") == 1.8
    # `input` counts every prompt token: 500k fresh at $1, 200k read at $0.10, 300k written
    # at $1.25.
    usage = {"input": 1_000_000, "cached": 200_000, "cache_write": 300_000, "output": 0}
    assert table.cost("claude-haiku-4-5", usage, "anthropic") == 0.5 + 0.02 + 0.375
    assert table.cost("nobody-knows", {"input": 5}, "openai") is None


def test_a_call_is_priced_as_its_upstream_host_charges() -> None:
    table = PriceTable.shipped().with_upstreams(
        {"openai": "https://api.openai.com/v1", "groq": "https://api.groq.com/openai/v1",
         "openrouter": "https://openrouter.ai/api/v1", "local": "http://127.0.0.1:11434/v1"}
    )  # fmt: skip
    groq = table.known("llama-3.1-8b-instant", "openai", "groq")
    assert groq is not None and (groq.input, groq.output) == (0.05, 0.08)
    # Without its upstream the OpenAI protocol's model list has no such model.
    assert table.known("llama-3.1-8b-instant", "openai") is None
    router = table.known("anthropic/claude-haiku-4.5", "openai", "openrouter")
    assert router is not None and (router.input, router.output) == (1.0, 5.0)
    # A local server's models cost what --unknown-cost says, not a hosted price.
    assert table.known("llama3.1", "openai", "local") is None
    assert table.with_fallback(None).upstream_urls == table.upstream_urls


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare -n needs root")
def test_the_catalogue_prices_with_no_network_at_all() -> None:
    # A fresh network namespace has no route anywhere: the prices ship in the wheel.
    code = (
        "from jukebox.llm.pricing import PriceTable\n"
        "print(PriceTable.shipped().cost('gpt-4o', {'input': 10**6, 'output': 10**6}, 'openai'))"
    )
    proc = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "12.5"


def test_user_prices_win_over_the_catalogue(tmp_path: Path) -> None:
    (tmp_path / "prices.toml").write_text('[models."gpt-4o"]\ninput = 1.0\noutput = 2.0\n')
    mine = tmp_path / "mine.toml"
    mine.write_text(
        '[models."my-model"]\ninput = 10\noutput = 20\ncached_input = 1\nfamily = true\n'
    )
    table = PriceTable.load(tmp_path, {"JUKEBOX_PRICES": str(mine)})
    assert table.cost("gpt-4o", {"input": 1_000_000, "output": 0}, "openai") == 1.0
    assert table.cost("gpt-4o-2024-08-06", {"input": 1_000_000}, "openai") == 1.0  # a snapshot
    assert table.cost("gpt-4o-mini", {"input": 1_000_000}, "openai") == 0.15  # the catalogue's
    # 500k uncached at $10, 500k cached at $1, 1M out at $20.
    usage = {"input": 1_000_000, "cached": 500_000, "output": 1_000_000}
    assert table.cost("my-model-v2", usage) == 5.0 + 0.5 + 20.0  # a family: any suffix
    mine.write_text('[models."bad"]\ninput = 1\noutput = 1\nfamily = "yes"\n')
    with pytest.raises(UsageError, match="family"):
        PriceTable.load(None, {"JUKEBOX_PRICES": str(mine)})
    mine.write_text('[models."bad"]\ninput = "x"\n')
    with pytest.raises(UsageError, match="numeric"):
        PriceTable.load(None, {"JUKEBOX_PRICES": str(mine)})


def test_redaction_of_headers_and_scrubbing_of_learned_values() -> None:
    headers = [
        ("Authorization", "Bearer sk-abcdefgh123"),
        ("X-Api-Key", "ant-12345678"),
        ("x-ratelimit-remaining-tokens", "99"),
        ("Content-Type", "application/json"),
    ]
    assert redact_headers(headers) == {
        "authorization": "[REDACTED]",
        "x-api-key": "[REDACTED]",
        "x-ratelimit-remaining-tokens": "99",
        "content-type": "application/json",
    }
    s = Scrubber(["short", "env-value-123456"])
    s.learn_headers(headers)
    text = b"sk-abcdefgh123 ant-12345678 env-value-123456 short"
    assert s.bytes(text) == b"[REDACTED] [REDACTED] [REDACTED] short"


def test_anthropic_usage_counts_cache_reads_and_writes_as_input() -> None:
    usage = {"input_tokens": 10, "output_tokens": 5,
             "cache_read_input_tokens": 100, "cache_creation_input_tokens": 20}  # fmt: skip
    response = {"model": "claude-haiku-4-5", "content": [], "usage": usage}
    s = summarize("anthropic", "messages", {}, response)
    assert s.usage() == {"input": 130, "output": 5, "cached": 100, "cache_write": 20}
    events = [{"type": "message_start", "message": {"model": "m", "usage": response["usage"]}},
              {"type": "message_delta", "usage": {"output_tokens": 9}}]  # fmt: skip
    assert summarize("anthropic", "messages", {}, events=events).usage()["input"] == 130
    assert summarize("anthropic", "messages", {}, events=events).output == 9
