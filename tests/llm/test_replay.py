"""Replay: recorded exchanges served back with no network, strict and loose matching."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import h11
import pytest

from jukebox.llm.replay import Divergence, ReplaySource, json_diff, normalize
from jukebox.llm.rewrite import RequestRewriter
from jukebox.llm.sse import SSEParser
from tests.llm import scenario
from tests.llm.conftest import Recording, clients
from tests.llm.upstream import FakeUpstream


def record_scenario(upstream: FakeUpstream, recording: Recording, prompt: str = "write hello"):
    with recording.proxy(upstream) as proxy:
        return scenario.run(proxy.base_urls(), prompt=prompt)


def replay_proxy(recording: Recording, tmp_path: Path, **kwargs: Any):
    """A proxy serving `recording`'s tape, recording onto a second tape, with no upstream."""
    source = ReplaySource.from_tape(recording.tape(), recording.store, **kwargs)
    second = Recording(tmp_path / "replay")
    diverged: list[Divergence] = []
    proxy = second.proxy(None, replay=source, on_divergence=diverged.append)
    return proxy, source, second, diverged


def raw_chunks(port: int, path: str, body: dict[str, Any]) -> list[bytes]:
    """The HTTP chunks of one response, exactly as the proxy framed them."""
    conn = h11.Connection(h11.CLIENT)
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        headers = [("host", "x"), ("content-type", "application/json"),
                   ("content-length", str(len(data)))]  # fmt: skip
        sock.sendall(conn.send(h11.Request(method="POST", target=path, headers=headers)))
        sock.sendall(conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
        chunks: list[bytes] = []
        current = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Data):
                current += event.data
                if event.chunk_end:
                    chunks.append(current)
                    current = b""
            elif isinstance(event, h11.EndOfMessage):
                return chunks


def test_replay_gives_identical_sdk_results_without_the_upstream(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    live = record_scenario(upstream, recording)
    upstream.stop()
    proxy, source, second, diverged = replay_proxy(recording, tmp_path)
    with proxy:
        replayed = scenario.run(proxy.base_urls())
    assert replayed == live
    assert not diverged and source.remaining() == 0
    # The replay's own tape names the frames it served, at zero cost.
    frames = [f.payload for f in second.tape().frames if f.kind == "llm_turn"]
    assert [p["replayed_from"] for p in frames] == list(range(1, 11))
    assert {p["cost_usd"] for p in frames} == {0.0}
    second.close()


def test_streams_replay_with_the_recorded_chunk_boundaries(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    body = {"model": "claude-haiku-4-5", "max_tokens": 9, "stream": True,
            "messages": [{"role": "user", "content": "one two three four five six"}]}  # fmt: skip
    with recording.proxy(upstream) as proxy:
        live = raw_chunks(proxy.port, f"/{proxy.secret}/anthropic/v1/messages", body)
    assert len(live) > 3
    proxy, _, second, _ = replay_proxy(recording, tmp_path, honor_timing=True)
    with proxy:
        again = raw_chunks(proxy.port, f"/{proxy.secret}/anthropic/v1/messages", body)
    # Same chunks, same events in each; the JSON inside is re-encoded (keys sorted on the tape).
    assert events_per_chunk(again) == events_per_chunk(live)
    second.close()


def events_per_chunk(chunks: list[bytes]) -> list[list[tuple[str | None, Any]]]:
    out = []
    parser = SSEParser()
    for chunk in chunks:
        out.append([(e.event, e.json() or e.data) for e in parser.feed(chunk, 0.0)])
    return out


def test_strict_replay_reports_a_changed_prompt_at_its_frame(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    import openai

    record_scenario(upstream, recording)
    upstream.stop()
    proxy, _, second, diverged = replay_proxy(recording, tmp_path)
    with proxy, pytest.raises(openai.BadRequestError) as caught:
        scenario.run(proxy.base_urls(), prompt="write goodbye")
    (divergence,) = diverged
    assert divergence.seq == 1 and divergence.kind == "request_mismatch"
    assert 'messages[1].content: "write hello" -> "write goodbye"' in divergence.diff
    message = str(caught.value)
    assert "replay diverged at frame 1" in message and "write goodbye" in message
    assert caught.value.status_code == 400  # not retried by the SDK
    notes = [f.payload for f in second.tape().frames if f.kind == "note"]
    assert notes[0]["event"] == "divergence" and notes[0]["frame"] == 1
    second.close()


def test_strict_divergence_later_in_the_run_names_the_later_frame(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    import openai

    with recording.proxy(upstream) as proxy:
        o, _ = clients(proxy.base_urls())
        for word in ("one", "two", "three"):
            o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": word}])
    proxy, _, second, diverged = replay_proxy(recording, tmp_path)
    with proxy:
        o, _ = clients(proxy.base_urls())
        for word in ("one", "two"):
            o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": word}])
        with pytest.raises(openai.BadRequestError, match="frame 3"):
            o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "3"}])
        # Once diverged, a strict replay serves nothing more.
        with pytest.raises(openai.BadRequestError, match="frame 3"):
            o.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "three"}]
            )
    assert [d.seq for d in diverged] == [3]
    second.close()


def test_loose_replay_serves_by_order_per_endpoint(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    live = record_scenario(upstream, recording)
    proxy, _, second, diverged = replay_proxy(recording, tmp_path, mode="loose")
    with proxy:
        replayed = scenario.run(proxy.base_urls(), prompt="something else entirely")
    assert replayed == live  # the recorded answers, whatever was asked
    assert not diverged
    second.close()


def test_a_call_beyond_the_recording_fails_clearly_without_network(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    import anthropic

    with recording.proxy(upstream) as proxy:
        _, a = clients(proxy.base_urls())
        a.messages.create(
            model="claude-haiku-4-5", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    calls = len(upstream.seen)
    proxy, _, second, diverged = replay_proxy(recording, tmp_path, mode="loose")
    with proxy:
        _, a = clients(proxy.base_urls())
        a.messages.create(
            model="claude-haiku-4-5", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
        with pytest.raises(anthropic.BadRequestError, match="beyond the recording"):
            a.messages.create(
                model="claude-haiku-4-5", max_tokens=8, messages=[{"role": "user", "content": "x"}]
            )
    assert len(upstream.seen) == calls  # nothing reached the network
    assert diverged[0].kind == "beyond_recording"
    second.close()


def test_until_serves_recorded_frames_then_goes_live_with_overrides(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    with recording.proxy(upstream) as proxy:
        o, _ = clients(proxy.base_urls())
        for word in ("one", "two"):
            o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": word}])
    calls = len(upstream.seen)
    source = ReplaySource.from_tape(recording.tape(), recording.store, until=1)
    second = Recording(tmp_path / "fork")
    rewriter = RequestRewriter(model="gpt-4.1", system_prompt="Be brief.")
    with second.proxy(upstream, replay=source, rewriter=rewriter) as proxy:
        o, _ = clients(proxy.base_urls())
        first = o.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "one"}]
        )
        later = o.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "two"}]
        )
    assert first.model == "gpt-4o" and later.model == "gpt-4.1"
    assert len(upstream.seen) == calls + 1
    sent = upstream.seen[-1][3]
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."}
    frames = [f.resolve_payload(second.store) for f in second.tape().frames[1:]]
    assert frames[0]["replayed_from"] == 1 and frames[1]["rewritten"] is True
    second.close()


def test_normalization_drops_volatile_fields_and_diff_is_compact() -> None:
    a = {"model": "m", "messages": [{"role": "user", "content": "x"}], "user": "u1",
         "stream_options": {"include_usage": True}, "metadata": {"id": 1}}  # fmt: skip
    b = {"messages": [{"content": "x", "role": "user"}], "model": "m", "user": "u2"}
    assert normalize(a) == normalize(b)
    diff = json_diff({"a": [1, 2], "b": "x", "c": 1}, {"a": [1, 3, 4], "b": "y", "d": 2})
    assert diff == ["a[1]: 2 -> 3", "a: 2 items expected, 3 came", 'b: "x" -> "y"',
                    "c: missing (expected 1)", "d: unexpected 2"]  # fmt: skip


def test_rewriter_covers_each_protocol() -> None:
    r = RequestRewriter(model="m2", system_prompt="S")
    dev = [{"role": "developer", "content": "old"}]
    chat = r.apply("openai", "chat.completions", {"model": "m", "messages": dev})
    assert chat == {"model": "m2", "messages": [{"role": "developer", "content": "S"}]}
    sys_in = [{"role": "system", "content": "old"}, "hi"]
    resp = r.apply("openai", "responses", {"model": "m", "input": sys_in})
    assert resp == {"model": "m2", "input": ["hi"], "instructions": "S"}
    msg = r.apply("anthropic", "messages", {"model": "m", "system": "old", "messages": []})
    assert msg == {"model": "m2", "system": "S", "messages": []}
    assert RequestRewriter().apply("openai", "chat.completions", {"a": 1}) == {"a": 1}
