"""Endpoints beyond chat and messages, named upstreams, Azure paths and telemetry, with the real
openai and anthropic SDKs: each is recorded, then served by a strict replay with the upstream
gone; a changed request diverges at its frame."""

from __future__ import annotations

import http.client
from pathlib import Path
from typing import Any

import httpx
import pytest

from jukebox.display.render import describe
from jukebox.errors import UsageError
from jukebox.llm.providers import DEFAULT_UPSTREAMS
from jukebox.llm.replay import ReplaySource
from jukebox.llm.server import MAX_WARNINGS, ProxyServer, upstreams_from_env
from tests.llm.conftest import OPENAI_KEY, Recording, clients
from tests.llm.upstream import FakeUpstream

AZURE_KEY = "azure-test-SECRET789abc"
DEFAULT_OPENAI = DEFAULT_UPSTREAMS["openai"]
API_VERSION = "2024-10-21"


def _dump(obj: Any) -> Any:
    return obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj


def other_endpoints(base_urls: dict[str, str], text: str = "the quick fox") -> list[Any]:
    """One call of every newly recorded endpoint, as the agent saw them."""
    o, a = clients(base_urls)
    seen = [
        _dump(o.embeddings.create(model="text-embedding-3-small", input=[text, "two"])),
        _dump(
            o.embeddings.create(model="text-embedding-3-small", input=text, encoding_format="float")
        ),
        _dump(o.completions.create(model="gpt-3.5-turbo-instruct", prompt=text, max_tokens=8)),
        [
            _dump(c)
            for c in o.completions.create(
                model="gpt-3.5-turbo-instruct", prompt=text, max_tokens=8, stream=True
            )
        ],
        _dump(o.moderations.create(model="omni-moderation-latest", input=f"an attack on {text}")),
        _dump(
            a.messages.count_tokens(
                model="claude-haiku-4-5", messages=[{"role": "user", "content": text}]
            )
        ),
    ]
    return seen


def turns(recording: Recording) -> list[dict[str, Any]]:
    tape = recording.tape()
    return [f.resolve_payload(recording.store) for f in tape.frames if f.kind == "llm_turn"]


def notes(recording: Recording) -> list[dict[str, Any]]:
    return [f.payload for f in recording.tape().frames if f.kind == "note"]


def replaying(recording: Recording, tmp_path: Path, **kwargs: Any) -> tuple[ProxyServer, Any]:
    """A proxy serving `recording`'s tape with no upstream at all, recording a second tape."""
    source = ReplaySource.from_tape(recording.tape(), recording.store, mode="strict")
    second = Recording(tmp_path / "replay")
    return second.proxy(None, replay=source, **kwargs), second


def test_embeddings_completions_moderations_count_tokens_replay_offline(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    import openai

    with recording.proxy(upstream) as proxy:
        live = other_endpoints(proxy.base_urls())
    assert live[0]["data"][0]["embedding"] != live[0]["data"][1]["embedding"]
    assert live[3][-1]["usage"] is None  # the SDK did not ask: the usage chunk stays hidden
    assert live[4]["results"][0]["flagged"] is True and live[5]["input_tokens"] > 0
    recorded = turns(recording)
    assert [(t["provider"], t["endpoint"], t["stream"]) for t in recorded] == [
        ("openai", "embeddings", False),
        ("openai", "embeddings", False),
        ("openai", "completions", False),
        ("openai", "completions", True),
        ("openai", "moderations", False),
        ("anthropic", "messages.count_tokens", False),
    ]
    assert recorded[0]["usage"]["input"] == 4 and not recorded[0].get("usage_estimated")
    assert recorded[2]["usage"]["output"] > 0
    assert recorded[3]["usage_requested"] and recorded[3]["usage"]["output"] > 0
    assert recorded[5]["usage"] == {"input": 0, "output": 0, "cached": 0}
    assert not [n for n in notes(recording) if n.get("event") == "llm_passthrough"]
    upstream.stop()
    proxy, second = replaying(recording, tmp_path)
    with proxy:
        assert other_endpoints(proxy.base_urls()) == live
        # A changed embedding input is a divergence at its frame, answered 400, not retried.
        o, _ = clients(proxy.base_urls())
        with pytest.raises(openai.BadRequestError) as caught:
            o.embeddings.create(model="text-embedding-3-small", input="something else")
    message = str(caught.value)
    assert "replay diverged" in message and "openai embeddings call #3" in message
    served = turns(second)
    assert [t["replayed_from"] for t in served] == [t["seq"] for t in _seqs(recording)]
    assert not [n for n in notes(second) if n.get("event") == "replay_refused"]
    second.close()


def _seqs(recording: Recording) -> list[dict[str, int]]:
    return [{"seq": f.seq} for f in recording.tape().frames if f.kind == "llm_turn"]


def test_free_endpoints_do_not_count_as_turns(upstream: FakeUpstream, recording: Recording) -> None:
    from jukebox.guard.breaker import CircuitBreaker

    breaker = CircuitBreaker.from_options(max_turns=1)
    with recording.proxy(upstream, breaker=breaker) as proxy:
        o, a = clients(proxy.base_urls())
        for _ in range(3):
            a.messages.count_tokens(model="claude-haiku-4-5",
                                    messages=[{"role": "user", "content": "hi"}])  # fmt: skip
            o.moderations.create(input="hello")
        o.embeddings.create(model="text-embedding-3-small", input="one")  # the one turn
        assert proxy.trip is None
        with pytest.raises(Exception, match="circuit breaker tripped: max_turns"):
            o.embeddings.create(model="text-embedding-3-small", input="two")


def test_a_named_upstream_is_recorded_by_name_and_replayed_offline(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    import openai

    local = FakeUpstream().start()
    try:
        upstreams = {"openai": upstream.openai_url, "anthropic": upstream.url,
                     "local": local.openai_url}  # fmt: skip
        with ProxyServer(upstreams=upstreams, record=recording.writer.append) as proxy:
            urls = proxy.base_urls()
            base = urls["JUKEBOX_UPSTREAM_LOCAL_BASE_URL"]
            assert base == f"{proxy.url}/upstream/local"
            ask = {"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}
            on_local = openai.OpenAI(api_key="ollama", base_url=base, max_retries=0)
            first = on_local.chat.completions.create(**ask).model_dump()
            o, _ = clients(urls)
            second = o.chat.completions.create(**ask).model_dump()
            on_local.models.list()  # not recorded: passes through, to the named upstream
    finally:
        local.stop()
    assert [path for _, path, _, _ in local.seen] == ["/v1/chat/completions", "/v1/models"]
    assert [path for _, path, _, _ in upstream.seen] == ["/v1/chat/completions"]
    recorded = turns(recording)
    assert [t.get("upstream") for t in recorded] == ["local", None]
    # `jukebox log` names the upstream (and an endpoint other than chat).
    assert describe("llm_turn", recorded[0]).startswith("local llama3 ")
    assert describe("llm_turn", {**recorded[1], "endpoint": "embeddings"}).startswith(
        "openai embeddings llama3 "
    )
    upstream.stop()
    # Offline, in the other order: each upstream has its own recording, so neither diverges.
    proxy, second_tape = replaying(recording, tmp_path)
    with proxy:
        urls = proxy.base_urls()
        o, _ = clients(urls)
        on_local = openai.OpenAI(
            api_key="ollama", base_url=urls["JUKEBOX_UPSTREAM_LOCAL_BASE_URL"], max_retries=0
        )
        assert o.chat.completions.create(**ask).model_dump() == second
        assert on_local.chat.completions.create(**ask).model_dump() == first
        with pytest.raises(openai.BadRequestError, match=r"local chat\.completions call #2"):
            on_local.chat.completions.create(**ask)
    assert [t.get("upstream") for t in turns(second_tape)] == [None, "local"]
    second_tape.close()


def test_an_anthropic_compatible_upstream_is_recorded_as_anthropic(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    import anthropic

    gateway = FakeUpstream().start()
    try:
        upstreams = {"openai": upstream.openai_url, "anthropic": upstream.url,
                     "gw": f"anthropic+{gateway.url}"}  # fmt: skip
        with ProxyServer(upstreams=upstreams, record=recording.writer.append) as proxy:
            urls = proxy.base_urls()
            assert urls["JUKEBOX_UPSTREAM_GW_BASE_URL"] == f"{proxy.url}/upstream/gw"
            assert urls["JUKEBOX_UPSTREAMS"] == f"gw=anthropic+{proxy.url}/upstream/gw"
            client = anthropic.Anthropic(api_key="gw-key", max_retries=0,
                                         base_url=urls["JUKEBOX_UPSTREAM_GW_BASE_URL"])  # fmt: skip
            ask = {"model": "glm-4.6", "max_tokens": 16,
                   "messages": [{"role": "user", "content": "hi gateway"}]}  # fmt: skip
            live = client.messages.create(**ask).model_dump()
    finally:
        gateway.stop()
    assert [path for _, path, _, _ in gateway.seen] == ["/v1/messages"] and not upstream.seen
    (turn,) = turns(recording)
    assert (turn["provider"], turn["endpoint"], turn["upstream"]) == ("anthropic", "messages", "gw")
    upstream.stop()
    # The protocol is on the tape: the replay serves the name as Anthropic's, offline.
    proxy, second = replaying(recording, tmp_path)
    with proxy:
        url = proxy.base_urls()["JUKEBOX_UPSTREAM_GW_BASE_URL"]
        client = anthropic.Anthropic(api_key="gw-key", base_url=url, max_retries=0)
        assert client.messages.create(**ask).model_dump() == live
    second.close()


def test_azure_deployment_paths_are_recorded_and_replayed(
    upstream: FakeUpstream, recording: Recording, tmp_path: Path
) -> None:
    import openai

    upstreams = {"openai": upstream.openai_url, "anthropic": upstream.url, "azure": upstream.url}
    with ProxyServer(upstreams=upstreams, record=recording.writer.append) as proxy:
        endpoint = proxy.base_urls()["AZURE_OPENAI_ENDPOINT"]
        azure = openai.AzureOpenAI(azure_endpoint=endpoint, api_key=AZURE_KEY,
                                   api_version=API_VERSION, max_retries=0)  # fmt: skip
        chat = azure.chat.completions.create(
            model="my-gpt4o", messages=[{"role": "user", "content": "hi azure"}]
        ).model_dump()
        vectors = azure.embeddings.create(model="my-embedder", input="hi").model_dump()
    assert [(path, headers.get("api-key")) for _, path, headers, _ in upstream.seen] == [
        (f"/openai/deployments/my-gpt4o/chat/completions?api-version={API_VERSION}", AZURE_KEY),
        (f"/openai/deployments/my-embedder/embeddings?api-version={API_VERSION}", AZURE_KEY),
    ]
    recorded = turns(recording)
    assert [(t["endpoint"], t["upstream"], t["path"]) for t in recorded] == [
        ("chat.completions", "azure",
         f"/openai/deployments/my-gpt4o/chat/completions?api-version={API_VERSION}"),
        ("embeddings", "azure",
         f"/openai/deployments/my-embedder/embeddings?api-version={API_VERSION}"),
    ]  # fmt: skip
    assert AZURE_KEY not in str(recorded)
    upstream.stop()
    proxy, second = replaying(recording, tmp_path)
    with proxy:
        endpoint = proxy.base_urls()["AZURE_OPENAI_ENDPOINT"]
        azure = openai.AzureOpenAI(azure_endpoint=endpoint, api_key=AZURE_KEY,
                                   api_version=API_VERSION, max_retries=0)  # fmt: skip
        again = azure.chat.completions.create(
            model="my-gpt4o", messages=[{"role": "user", "content": "hi azure"}]
        )
        assert again.model_dump() == chat
        assert azure.embeddings.create(model="my-embedder", input="hi").model_dump() == vectors
    second.close()


def test_agents_sdk_traces_warn_and_never_fail_a_replay(
    upstream: FakeUpstream,
    recording: Recording,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trace = {"data": [{"object": "trace", "id": "trace_1", "workflow_name": "Agent workflow"}]}
    headers = {"authorization": f"Bearer {OPENAI_KEY}", "openai-beta": "traces=v1"}
    with recording.proxy(upstream) as proxy:
        # What the Agents SDK posts where its trace endpoint follows OPENAI_BASE_URL.
        ingest = proxy.base_urls()["OPENAI_BASE_URL"] + "/traces/ingest"
        for _ in range(2):
            assert httpx.post(ingest, json=trace, headers=headers).status_code == 200
        o, _ = clients(proxy.base_urls())
        o.models.list()
        o.models.list()
        # A path that would clear the user's terminal if printed as it is.
        httpx.get(proxy.base_urls()["OPENAI_BASE_URL"] + "/x%1b[2J")
        # An agent inventing paths gets a bounded number of lines.
        for i in range(MAX_WARNINGS + 5):
            httpx.get(proxy.base_urls()["OPENAI_BASE_URL"] + f"/made-up-{i}")
    seen = [path for _, path, _, _ in upstream.seen]
    assert seen[:5] == ["/v1/traces/ingest"] * 2 + ["/v1/models"] * 2 + ["/v1/x%1b[2J"]
    err = capsys.readouterr().err
    assert err.count("OpenAI Agents SDK's tracing") == 1  # once per run, not per batch
    assert "OPENAI_AGENTS_DISABLE_TRACING=1" in err and OPENAI_KEY not in err
    assert err.count("GET /models (openai) is not a recorded endpoint") == 1
    assert "\x1b" not in err and "/x\\x1b[2J" in err  # the agent's path, escaped
    lines = [line for line in err.splitlines() if line.startswith("jukebox: ")]
    assert len(lines) == MAX_WARNINGS + 1 and "further warnings" in lines[-1]
    events = [n["event"] for n in notes(recording)]
    assert events == ["telemetry"] * 2 + ["llm_passthrough"] * (3 + MAX_WARNINGS + 5)
    upstream.stop()
    proxy, second = replaying(recording, tmp_path)
    with proxy:
        ingest = proxy.base_urls()["OPENAI_BASE_URL"] + "/traces/ingest"
        assert httpx.post(ingest, json=trace, headers=headers).status_code == 200
    replayed = notes(second)
    assert [(n["event"], n.get("answered")) for n in replayed] == [("telemetry", "locally")]
    assert "a replay answers them itself" in capsys.readouterr().err
    second.close()


def test_an_agents_sdk_with_tracing_on_is_named_once(
    upstream: FakeUpstream, recording: Recording, capsys: pytest.CaptureFixture[str]
) -> None:
    import openai

    ask = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    warned = []
    for agent_env in ({}, {"OPENAI_AGENTS_DISABLE_TRACING": "1"}):
        with recording.proxy(upstream) as proxy:
            proxy.agent_environ = agent_env
            # The User-Agent the Agents SDK's model calls carry.
            sdk = openai.OpenAI(api_key=OPENAI_KEY, base_url=proxy.base_urls()["OPENAI_BASE_URL"],
                                default_headers={"User-Agent": "Agents/Python 0.24.0"})  # fmt: skip
            sdk.chat.completions.create(**ask)
            sdk.chat.completions.create(**ask)
            clients(proxy.base_urls())[0].chat.completions.create(**ask)
        warned.append(capsys.readouterr().err)
    seen = [n for n in notes(recording) if n["event"] == "telemetry"]
    assert [(n["seen"], n["path"]) for n in seen] == [("user-agent", "/chat/completions")]
    assert warned[0].count("OpenAI Agents SDK (Agents/Python 0.24.0)") == 1
    assert "OPENAI_AGENTS_DISABLE_TRACING=1" in warned[0]
    assert "Agents SDK" not in warned[1]


def test_bad_upstream_names_are_refused() -> None:
    from jukebox.llm.upstreams import BadUpstream, parse

    assert parse("local=http://127.0.0.1:11434/v1/") == ("local", "http://127.0.0.1:11434/v1")
    assert parse("gw=anthropic+https://gw.example/") == ("gw", "anthropic+https://gw.example")
    bad = ("local", "Local=http://x", "local=ftp://x", "../x=http://x", "a b=http://x",
           "gw=cohere+https://x", "gw=anthropic+ftp://x")  # fmt: skip
    for spec in bad:
        with pytest.raises(BadUpstream):
            parse(spec)
    with pytest.raises(ValueError, match="bad upstream name"):
        ProxyServer(upstreams={"openai": "http://x", "anthropic": "http://x", "a/b": "http://x"})
    # $JUKEBOX_UPSTREAMS: the same words, for every proxy the environment starts.
    got = upstreams_from_env({"JUKEBOX_UPSTREAMS": "a=http://x,b=https://y/v1/ "})
    assert (got["a"], got["b"], got["openai"]) == ("http://x", "https://y/v1", DEFAULT_OPENAI)
    with pytest.raises(UsageError, match="write NAME=URL"):
        upstreams_from_env({"JUKEBOX_UPSTREAMS": "a"})


def test_jukebox_help_models_tells_how_to_add_an_upstream() -> None:
    from jukebox.cli.help import topic_text

    text = topic_text("models") or ""
    assert "--upstream local=" in text and "JUKEBOX_UPSTREAMS" in text
    assert "OPENAI_AGENTS_DISABLE_TRACING=1" in text


def test_environment_that_turns_on_direct_telemetry_is_named() -> None:
    from jukebox.llm.telemetry import environment_warnings

    assert environment_warnings({"LANGCHAIN_TRACING_V2": "false"}, offline=True) == []
    (line,) = environment_warnings(
        {"LANGSMITH_TRACING": "true", "LANGCHAIN_TRACING_V2": "true"}, offline=True
    )
    assert "LangSmith" in line and "--net none" in line and "LANGSMITH_TRACING=false" in line


def test_a_named_upstream_keeps_its_requests_inside_it(
    upstream: FakeUpstream, recording: Recording
) -> None:
    """`..` cannot climb from /upstream/NAME to another upstream or the rest of its host, a
    name the proxy does not serve is 404, and without the secret nothing is served."""
    upstreams = {"openai": upstream.openai_url, "anthropic": upstream.url,
                 "local": upstream.openai_url + "/local"}  # fmt: skip
    with ProxyServer(upstreams=upstreams, record=recording.writer.append) as proxy:

        def post(target: str) -> int:
            # http.client sends the target as written (httpx would resolve the dots first).
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            conn.request("POST", target, body=b'{"model": "m"}')
            status = conn.getresponse().status
            conn.close()
            return status

        secret = f"/{proxy.secret}"
        escapes = ["/upstream/local/../chat/completions", "/upstream/local/%2e%2e/x",
                   "/upstream/local/a/%2E%2E/../../openai/v1/chat/completions",
                   "/upstream/local/..%2fchat/completions"]  # fmt: skip
        assert [post(secret + t) for t in escapes] == [400] * len(escapes)
        assert post(secret + "/upstream/other/chat/completions") == 404
        assert post(secret + "/upstream/../openai/v1/chat/completions") == 404
        assert post("/upstream/local/chat/completions") == 403
        assert post(secret + "/upstream/local/x/../chat/completions") == 200
    assert [path for _, path, _, _ in upstream.seen] == ["/v1/local/chat/completions"]
    assert [t.get("upstream") for t in turns(recording)] == ["local"]


def test_free_endpoints_count_against_the_record_limit(
    upstream: FakeUpstream, recording: Recording
) -> None:
    """A token count is free, not unlimited: its bytes count toward what the proxy records."""
    import anthropic

    with recording.proxy(upstream, record_limit=4096) as proxy:
        _, a = clients(proxy.base_urls())
        big = [{"role": "user", "content": "x" * 3000}]
        a.messages.count_tokens(model="claude-haiku-4-5", messages=big)
        with pytest.raises(anthropic.BadRequestError, match="past the booth's limit"):
            a.messages.count_tokens(model="claude-haiku-4-5", messages=big)
        assert proxy.trip is not None and proxy.trip.rule == "recorded"
    assert len(turns(recording)) == 1
