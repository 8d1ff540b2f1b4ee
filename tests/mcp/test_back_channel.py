"""A server's requests of its client outside any call (jukebox.mcp.back_channel), the SDK's
client in front. Over streamable HTTP (tests/mcp/http_server.py's `aside`, on its standalone
stream) through the booth's HTTP gateway as the supervisor runs it (a real stage gate on a real
tape): the gateway's client declares sampling, elicitation and roots to the server; each
request reaches the one agent session and its answer the server; with a second session open,
nobody is asked; and nobody else can answer in the agent's place. Over stdio
(tests/mcp/hostile_server.py's `aside`) through `jukebox mcp wrap`: the same. And, with the same
gateway, the relay's calls to a plain-HTTP server share one kept connection."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import mcp.types as types
import pytest

from tests.mcp.conftest import agent_session, hostile_server, http_gateway_before, payloads, wrapped

HERE = Path(__file__).resolve().parent
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    # The notes server answering JSON bodies; each test's agent sessions end (a DELETE) with it,
    # so the next test's is the one session open.
    tmp = tmp_path_factory.mktemp("back")
    notes = tmp / "notes.txt"
    script = HERE / "http_server.py"
    with http_gateway_before(script, "n", tmp, TIMEOUT, str(notes), "--log-auth",
                             "--json") as gateway:  # fmt: skip
        yield {**gateway, "peers": notes.with_suffix(".peers")}


async def named(ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
    assert params.message == "What is your name?"
    return types.ElicitResult(action="accept", content={"name": "agent-7"})


async def sampled(ctx: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
    asked = params.messages[0].content
    assert isinstance(asked, types.TextContent)
    return types.CreateMessageResult(
        role="assistant", model="m", content=types.TextContent(type="text", text=f"{asked.text}=6")
    )


async def rooted(ctx: Any) -> types.ListRootsResult:
    return types.ListRootsResult(roots=[types.Root(uri="file:///work/agent-7")])


def asides(tape: Path) -> list[dict[str, Any]]:
    return [n for n in payloads(tape, "note") if n.get("event") == "mcp_asked"]


def asides_since(gateway: dict[str, Any]) -> list[dict[str, Any]]:
    """The mcp_asked notes since the last call of this (the module's gateway is shared)."""
    said = asides(gateway["tape"])
    seen = gateway.get("seen", 0)
    gateway["seen"] = len(said)
    return said[seen:]


def test_the_servers_requests_outside_any_call_reach_the_agent(gateway: dict[str, Any]) -> None:
    async def agent() -> list[str]:
        async with agent_session(
            gateway["url"],
            elicitation_callback=named,
            sampling_callback=sampled,
            list_roots_callback=rooted,
        ) as session:
            await session.list_tools()
            texts = []
            for args in ({}, {"what": "name"}, {"what": "model"}, {"what": "roots"}):
                result = await session.call_tool("caps" if not args else "aside", args)
                assert not result.is_error, result
                texts.append(result.content[0].text)
            return texts

    caps, name, model, roots = anyio.run(agent)
    # What the server sees of the gateway's client: the capabilities its requests need.
    declared = json.loads(caps)
    assert {"sampling", "elicitation", "roots"} <= declared.keys(), declared
    assert (name, model, roots) == ("hello agent-7", "the model said 3+3=6", "file:///work/agent-7")
    said = asides_since(gateway)
    assert [a["method"] for a in said] == ["elicitation/create", "sampling/createMessage",
                                           "roots/list"]  # fmt: skip
    assert said[0]["answer"]["result"]["content"] == {"name": "agent-7"}
    assert said[1]["params"]["messages"][0]["content"]["text"] == "3+3"
    assert said[2]["answer"]["result"]["roots"][0]["uri"] == "file:///work/agent-7"


def test_an_agent_that_declared_nothing_is_not_asked(gateway: dict[str, Any]) -> None:
    async def agent() -> str:
        async with agent_session(gateway["url"]) as session:
            result = await session.call_tool("aside", {"what": "model"})
            return str(result.content[0].text)

    said = anyio.run(agent)
    asides_since(gateway)
    assert said.startswith(
        "refused: jukebox: the MCP gateway asks no agent this sampling/createMessage: the "
        "agent's client did not declare sampling"
    ), said


def test_no_other_client_is_asked_or_answers_in_the_agents_place(gateway: dict[str, Any]) -> None:
    # While the agent is asked, another client (no session, or a made-up one) posts answers
    # under every small id: none reaches the server as the agent's. Then a second session opens
    # beside the agent's: a request outside any call names no session, so neither is asked
    # (its content would reach a session it may not be meant for).
    intruders: list[int] = []
    second_asked: list[str] = []

    def intrude() -> None:
        for session_id in (None, "x"):
            for n in [*range(0, 8), *(f"jukebox-{i}" for i in range(1, 4))]:
                headers = {"content-type": "application/json",
                           "accept": "application/json, text/event-stream"}  # fmt: skip
                if session_id is not None:
                    headers["mcp-session-id"] = session_id
                said = {"action": "accept", "content": {"name": "intruder"}}
                body = {"jsonrpc": "2.0", "id": n, "result": said}
                request = urllib.request.Request(gateway["url"], data=json.dumps(body).encode(),
                                                 headers=headers, method="POST")  # fmt: skip
                try:
                    with urllib.request.urlopen(request, timeout=10) as answer:
                        intruders.append(answer.status)
                except urllib.error.HTTPError as refused:
                    intruders.append(refused.code)

    async def asked_while_intruded(ctx: Any, params: Any) -> types.ElicitResult:
        await anyio.to_thread.run_sync(intrude)
        return types.ElicitResult(action="accept", content={"name": "agent-7"})

    async def second(ctx: Any, params: Any) -> types.ElicitResult:
        second_asked.append(params.message)
        return types.ElicitResult(action="accept", content={"name": "second"})

    async def agent() -> tuple[str, str]:
        async with agent_session(
            gateway["url"], elicitation_callback=asked_while_intruded
        ) as session:
            first = await session.call_tool("aside", {"what": "name"})
            # A second agent session, opened (initialized) and held while the first calls.
            async with agent_session(gateway["url"], elicitation_callback=second):
                then = await session.call_tool("aside", {"what": "name"})
            return str(first.content[0].text), str(then.content[0].text)

    first, then = anyio.run(agent)
    assert first == "hello agent-7"
    assert len(intruders) == 22 and all(code >= 400 for code in intruders), intruders
    assert then.startswith("refused: jukebox: the MCP gateway asks no agent this "
                           "elicitation/create: it came outside any call and 2 agent sessions "
                           "are open"), then  # fmt: skip
    assert second_asked == []
    said = asides_since(gateway)
    assert said[0]["answer"]["result"]["content"] == {"name": "agent-7"}
    assert "2 agent sessions are open" in said[1]["answer"]["error"]["message"]


def test_over_stdio_the_servers_requests_reach_the_agent(tmp_path: Path) -> None:
    tapes = tmp_path / "tapes"

    async def agent() -> str:
        async with wrapped(hostile_server(), "--tape-dir", str(tapes), sampling_callback=sampled,
                           list_roots_callback=rooted) as session:  # fmt: skip
            await session.list_tools()
            result = await session.call_tool("aside", {})
            assert not result.is_error, result
            return str(result.content[0].text)

    assert anyio.run(agent) == "the model said 3+3=6; roots file:///work/agent-7"
    [tape] = list(tapes.glob("*.jbx"))
    said = asides(tape)
    assert [a["method"] for a in said] == ["sampling/createMessage", "roots/list"]
    assert said[0]["answer"]["result"]["content"]["text"] == "3+3=6"


def test_relayed_calls_share_a_kept_connection(gateway: dict[str, Any]) -> None:
    # The relay's POSTs to a plain-HTTP server (jukebox.mcp.http_upstream) go on a socket it
    # keeps: six relayed calls, one after the other, reach the server on one connection. (The
    # server answers with JSON bodies: each read to its end, and the socket given back, before
    # the agent has its answer.)
    peers = gateway["peers"]

    async def agent() -> list[str]:
        async with agent_session(gateway["url"]) as session:
            await session.list_tools()
            peers.unlink(missing_ok=True)  # the gateway's own requests so far
            texts = []
            for i in range(6):
                result = await session.call_tool("echo", {"text": f"n{i}"})
                texts.append(str(result.content[0].text))
            return texts

    assert anyio.run(agent) == [f"n{i}" for i in range(6)]
    posts = [line.split()[1] for line in peers.read_text().splitlines()
             if line.startswith("POST")]  # fmt: skip
    assert len(posts) == 6, posts
    assert len(set(posts)) == 1, posts
    calls = payloads(gateway["tape"], "tool_call")[-6:]
    assert [c["result"]["content"][0]["text"] for c in calls] == [f"n{i}" for i in range(6)]
