"""The proxy in process: real SDKs against the fake upstream, directly and through the proxy."""

from __future__ import annotations

import http.client
import json
import os
import socket

import pytest

from jukebox.llm.replay import ReplaySource
from tests.llm import scenario
from tests.llm.conftest import ANTHROPIC_KEY, OPENAI_KEY, Recording, clients, direct_urls
from tests.llm.upstream import FakeUpstream

N_TURNS = 10  # llm_turn frames one scenario run records


def turns(rec: Recording) -> list:
    tape = rec.tape()
    return [f for f in tape.frames if f.kind == "llm_turn"]


def test_sdk_results_through_the_proxy_equal_direct_calls(
    upstream: FakeUpstream, recording: Recording
) -> None:
    direct = scenario.run(direct_urls(upstream))
    with recording.proxy(upstream, secrets=[]) as proxy:
        proxied = scenario.run(proxy.base_urls())
    assert proxied == direct
    frames = turns(recording)
    assert len(frames) == N_TURNS
    # The keys passed through to the upstream.
    posts = [{k.lower(): v for k, v in h.items()} for m, _, h, _ in upstream.seen if m == "POST"]
    keys = {h.get("authorization") or h.get("x-api-key") for h in posts}
    assert keys <= {f"Bearer {OPENAI_KEY}", f"Bearer {ANTHROPIC_KEY}", ANTHROPIC_KEY}
    assert len(keys) == 2


def test_llm_turn_frames_carry_usage_cost_tool_calls_and_stream_events(
    upstream: FakeUpstream, recording: Recording
) -> None:
    big = "lorem ipsum " * 600
    with recording.proxy(upstream) as proxy:
        scenario.run(proxy.base_urls())
        o, _ = clients(proxy.base_urls())
        o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": big}])
    frames = turns(recording)
    store = recording.store
    p = [f.resolve_payload(store) for f in frames]
    first = p[0]
    assert (first["provider"], first["endpoint"], first["model"]) == (
        "openai",
        "chat.completions",
        "gpt-4o-mini",
    )
    assert first["status"] == 200 and first["stream"] is False
    assert first["tool_calls"] == [
        {"name": "write_file", "arguments": {"path": "hello.txt", "text": "write hello"}}
    ]
    assert first["usage"]["input"] > 0 and first["usage"]["output"] > 0
    assert first["cost_usd"] > 0
    assert first["request"]["messages"][1]["content"] == "write hello"
    assert first["request_headers"]["authorization"] == "[REDACTED]"
    # The streamed chat with include_usage: usage from the last chunk, events with timings.
    stream = p[2]
    assert stream["stream"] is True and stream["usage"]["output"] > 0
    assert stream["response"][-1]["text"] == "[DONE]"
    assert all(e["t_ms"] >= 0 for e in stream["response"])
    chunks = [e["chunk"] for e in stream["response"]]
    assert chunks == sorted(chunks) and len(set(chunks)) < len(chunks)  # some chunks hold two
    # A streamed tool call is reassembled from its fragments.
    assert p[3]["tool_calls"][0]["arguments"] == {"path": "hello.txt", "text": "write hello"}
    # Responses API (JSON and stream) and Anthropic (tool use; cached tokens on the stream).
    assert p[4]["endpoint"] == "responses" and p[4]["usage"]["output"] > 0
    assert p[5]["stream"] and p[5]["usage"] == p[4]["usage"] | {"input": p[5]["usage"]["input"]}
    assert p[6]["provider"] == "anthropic" and p[6]["tool_calls"][0]["name"] == "write_file"
    assert p[7]["stream"] and p[7]["usage"]["cached"] == 3
    assert p[7]["cost_usd"] > 0
    assert p[9]["model"] == "claude-haiku-4-5" and p[9]["stream"]
    # Big bodies go to the store as json objects and come back whole.
    assert frames[-1].payload["request"].keys() == {"$blob"} and frames[-1].refs
    assert p[-1]["request"]["messages"][0]["content"] == big
    assert recording.store.kind(frames[-1].refs[0]) == "json"


def test_secrets_never_reach_the_tape_or_the_store(
    upstream: FakeUpstream, recording: Recording
) -> None:
    with recording.proxy(upstream, secrets=["env-secret-value-789"]) as proxy:
        o, _ = clients(proxy.base_urls())
        # A key pasted into a prompt is scrubbed too.
        o.chat.completions.create(
            model="gpt-4o",
            messages=[
                {"role": "user", "content": f"my key is {OPENAI_KEY} and env-secret-value-789"}
            ],
        )
        scenario.run(proxy.base_urls())
    recording.store.flush()
    blob = recording.path.read_bytes()
    for oid in recording.store.iter_oids():
        blob += recording.store.get(oid)
    for secret in (OPENAI_KEY, ANTHROPIC_KEY, "SECRET123", "SECRET456", "env-secret-value-789"):
        assert secret.encode() not in blob
    assert b"[REDACTED]" in blob


def test_other_paths_pass_through_and_unknown_paths_are_refused(
    upstream: FakeUpstream, recording: Recording
) -> None:
    with recording.proxy(upstream) as proxy:
        o, _ = clients(proxy.base_urls())
        assert [m.id for m in o.models.list()] == ["gpt-4o"]
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port)
        conn.request("GET", f"/{proxy.secret}/elsewhere")
        resp = conn.getresponse()
        assert resp.status == 404 and b"no route" in resp.read()
    notes = [f.payload for f in recording.tape().frames if f.kind == "note"]
    assert notes == [notes[0]] and notes[0]["event"] == "llm_passthrough"
    assert not turns(recording)


def test_unreachable_upstream_is_a_502_recorded_as_an_error(recording: Recording) -> None:
    import openai

    with recording.proxy(None) as proxy:
        o, _ = clients(proxy.base_urls())
        with pytest.raises(openai.InternalServerError, match="upstream"):
            o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    (frame,) = turns(recording)
    assert frame.payload["status"] == 502 and "failed" in frame.payload["error"]
    # A failed call is not something replay can serve.
    assert ReplaySource.from_tape(recording.tape(), recording.store).total == 0


def test_upstream_errors_are_recorded_and_returned_unchanged(
    upstream: FakeUpstream, recording: Recording
) -> None:
    with recording.proxy(upstream) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port)
        conn.request("POST", f"/{proxy.secret}/openai/v1/chat/completions/nope", body=b"{}")
        resp = conn.getresponse()
        assert resp.status == 404 and json.loads(resp.read())["error"]["type"] == "not_found"


def _tcp_sockets_of_this_process() -> list[socket.socket]:
    """A duplicate of every connected TCP socket this process holds, once each however many fds
    name it (close them). Once each: an fd the proxy's threads close after the listing may be
    taken by one of these duplicates, and then name the same socket again."""
    out, seen = [], set()
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")  # socket:[inode]
            if not link.startswith("socket:") or link in seen:
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # gone meanwhile, or not a socket after all
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family == socket.AF_INET:
                sock.getpeername()  # connected, not a listener
                seen.add(link)
                out.append(sock)
                continue
        except OSError:
            pass
        sock.close()
    return out


def test_the_proxy_sets_tcp_nodelay_on_the_agents_and_the_upstreams_connections(
    upstream: FakeUpstream, recording: Recording
) -> None:
    # Without it, a reply written in two pieces waits for the peer's delayed ACK (40 ms on
    # Linux): the MCP gateway's listener had that stall on every call.
    body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
    with recording.proxy(upstream) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port)
        conn.request("POST", f"/{proxy.secret}/openai/v1/chat/completions", body=body,
                     headers={"authorization": f"Bearer {OPENAI_KEY}"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read()
        # Both kept alive: the agent's connection, and the proxy's upstream one in its pool.
        socks = _tcp_sockets_of_this_process()
        try:
            accepted = [s for s in socks if s.getsockname()[1] == proxy.port]
            connected = [s for s in socks if s.getpeername()[1] == upstream.port]
            assert len(accepted) == 1 and len(connected) == 1
            for sock in (*accepted, *connected):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        finally:
            for sock in socks:
                sock.close()
        conn.close()
