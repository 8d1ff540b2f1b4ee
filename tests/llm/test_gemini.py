"""Gemini's native API through the proxy with the real google-genai SDK: generateContent with a
function call and its answer, streamGenerateContent (`alt=sse`), countTokens and embeddings are
recorded, replayed offline by a strict replay, and another model or prompt diverges."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from jukebox.llm.replay import ReplaySource
from jukebox.llm.rewrite import RequestRewriter
from jukebox.llm.server import ProxyServer
from jukebox.tape.tape import Tape, TapeWriter
from tests.llm.conftest import Recording
from tests.llm.upstream import FakeUpstream

GEMINI_KEY = "AIzaSyFAKE-gemini-SECRET-0123456789abcd"
MODEL = "gemini-2.5-flash"

genai = pytest.importorskip("google.genai")
types = pytest.importorskip("google.genai.types")


def client(base_url: str) -> Any:
    return genai.Client(api_key=GEMINI_KEY, http_options=types.HttpOptions(base_url=base_url))


def conversation(base_url: str, prompt: str = "write hello", model: str = MODEL) -> list[Any]:
    """What an agent sees over one tool round trip, a stream, a token count and embeddings."""
    c = client(base_url)
    schema = {"type": "OBJECT", "properties": {"path": {"type": "STRING"}}}
    tool = types.Tool(
        function_declarations=[types.FunctionDeclaration(name="write_file", parameters=schema)]
    )
    config = types.GenerateContentConfig(tools=[tool], max_output_tokens=64)
    asked = [types.Content(role="user", parts=[types.Part(text=prompt)])]
    first = c.models.generate_content(model=model, contents=asked, config=config)
    call = first.function_calls[0]
    answer = types.Part.from_function_response(name=call.name, response={"result": "wrote it"})
    asked += [first.candidates[0].content, types.Content(role="user", parts=[answer])]
    second = c.models.generate_content(model=model, contents=asked, config=config)
    streamed = [chunk.text for chunk in c.models.generate_content_stream(
        model=model, contents="stream one two three")]  # fmt: skip
    counted = c.models.count_tokens(model=model, contents="how many tokens")
    vectors = c.models.embed_content(model="gemini-embedding-001", contents=["alpha", "beta"])
    return [
        [call.name, dict(call.args)],
        second.text,
        streamed,
        counted.total_tokens,
        [e.values for e in vectors.embeddings],
    ]


def test_gemini_native_records_and_replays_offline(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    with recording.proxy(upstream) as proxy:
        base = proxy.base_urls()["GOOGLE_GEMINI_BASE_URL"]
        assert base == f"{proxy.url}/gemini" == proxy.base_urls()["GEMINI_API_BASE"]
        live = conversation(base)
        # litellm's way: the key in the query.
        raw = httpx.post(
            f"{base}/v1beta/models/{MODEL}:generateContent?key={GEMINI_KEY}",
            json={"contents": [{"role": "user", "parts": [{"text": "by query"}]}]},
        )
        assert raw.json()["candidates"][0]["content"]["parts"][0]["text"] == "echo: by query"
    assert live[1] == "done: " + '{"result": "wrote it"}' and len(live[2]) > 2
    tape = recording.tape()
    turns = [f.resolve_payload(recording.store) for f in tape.frames if f.kind == "llm_turn"]
    assert [(t["provider"], t["endpoint"], t["stream"]) for t in turns] == [
        ("gemini", "generateContent", False),
        ("gemini", "generateContent", False),
        ("gemini", "streamGenerateContent", True),
        ("gemini", "countTokens", False),
        ("gemini", "batchEmbedContents", False),
        ("gemini", "generateContent", False),
    ]
    first, _, stream, *_ = turns
    assert first["model"] == f"{MODEL}-001" and first["tool_calls"] == [
        {"name": "write_file", "arguments": {"path": "hello.txt", "text": "write hello"}}
    ]
    assert stream["path"].endswith(f"/models/{MODEL}:streamGenerateContent?alt=sse")
    assert stream["usage"]["output"] == 5 + 2  # the last cumulative count: 5 words, 2 thinking
    assert not stream.get("usage_estimated")
    assert turns[4]["usage_estimated"]  # Gemini's embeddings report no usage
    assert "key=[REDACTED]" in turns[5]["path"]
    data = recording.path.read_bytes() + b"".join(
        recording.store.get(oid) for oid in recording.store.iter_oids()
    )
    assert GEMINI_KEY.encode() not in data
    upstream.stop()

    source = ReplaySource.from_tape(recording.tape(), recording.store, mode="strict")
    second = Recording(tmp_path / "replay")
    with second.proxy(None, replay=source) as proxy:
        base = proxy.base_urls()["GOOGLE_GEMINI_BASE_URL"]
        assert conversation(base) == live
        c = client(base)  # kept: a client collected mid-call closes its connection
        with pytest.raises(genai.errors.ClientError) as other_model:
            c.models.generate_content(model="gemini-2.5-pro", contents="write hello")
    assert other_model.value.code == 400
    assert "goes beyond the recording" in str(other_model.value)
    assert "gemini generateContent gemini-2.5-pro call #1" in str(other_model.value)
    second.close()

    source = ReplaySource.from_tape(recording.tape(), recording.store, mode="strict")
    third = Recording(tmp_path / "changed")
    with (
        third.proxy(None, replay=source) as proxy,
        pytest.raises(genai.errors.ClientError, match="the request differs"),
    ):
        conversation(proxy.base_urls()["GOOGLE_GEMINI_BASE_URL"], prompt="write goodbye")
    third.close()


def test_a_stream_without_sse_is_read_as_its_json_array() -> None:
    from jukebox.llm.providers import summarize

    chunks = [
        {"candidates": [{"content": {"parts": [{"text": "one "}]}}],
         "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 1}},
        {"candidates": [{"content": {"parts": [{"text": "two"}]}}], "modelVersion": "gemini-x",
         "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 2}},
    ]  # fmt: skip
    s = summarize("gemini", "streamGenerateContent", {}, chunks)
    assert (s.text, s.model, s.input, s.output, s.reported) == ("one two", "gemini-x", 4, 2, True)


def test_a_fork_sends_gemini_calls_to_its_model_in_the_path_and_replays_strictly(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    """`fork --model gemini=M`, as `fork --exec` runs it: the first call served from the tape,
    every later one sent live with M in its path (google-genai names the model there, not in
    the body) and recorded as sent; the fork tape then replays strictly, offline."""
    with recording.proxy(upstream) as proxy:
        conversation(proxy.base_urls()["GOOGLE_GEMINI_BASE_URL"])
    origin = recording.tape()
    first = next(f.seq for f in origin.frames if f.kind == "llm_turn")
    overrides = {"model": {"gemini": "gemini-2.5-pro"}}
    fork_path = tmp_path / "fork.jbx"
    writer = TapeWriter.fork_from(origin, first + 1, fork_path, "fork", store=recording.store,
                                  extra={"overrides": overrides, "exec": True})  # fmt: skip

    def after_the_fork(kind: str, payload: Any) -> None:  # the prefix is on the tape already
        if "replayed_from" not in payload:
            writer.append(kind, payload)

    before = len(upstream.seen)
    source = ReplaySource.from_tape(origin, recording.store, until=first)
    rewriter = RequestRewriter(model=overrides["model"])
    with ProxyServer(upstreams={"gemini": upstream.url}, record=after_the_fork, replay=source,
                     rewriter=rewriter) as proxy:  # fmt: skip
        forked = conversation(proxy.base_urls()["GOOGLE_GEMINI_BASE_URL"])
    writer.close()
    sent = [path for _, path, _, _ in upstream.seen[before:]]
    assert len(sent) == 4 and all("/models/gemini-2.5-pro:" in path for path in sent)
    assert MODEL not in "".join(sent)
    tape = Tape.load(fork_path, recording.store)
    live = [f.resolve_payload(recording.store) for f in tape.frames[first + 2 :]]
    assert all(t["rewritten"] and "/models/gemini-2.5-pro:" in t["path"] for t in live)
    assert live[0]["model"] == "gemini-2.5-pro-001"
    upstream.stop()

    source = ReplaySource.from_tape(tape, recording.store, mode="strict")
    replay = Recording(tmp_path / "replay")
    with replay.proxy(None, replay=source) as proxy:
        assert conversation(proxy.base_urls()["GOOGLE_GEMINI_BASE_URL"]) == forked
    replay.close()
    assert source.divergence is None and source.remaining() == 0
