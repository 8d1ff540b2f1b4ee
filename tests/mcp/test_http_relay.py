"""A streamable-HTTP server that talks back in the middle of a relayed call
(tests/mcp/asking_http_server.py), through the booth's HTTP gateway as the supervisor runs it
(jukebox.mcp.http_gateway, a real stage gate recording on a real tape), the SDK's client in
front: the server's elicitation and sampling requests reach the agent's client and its answers
reach the server; a call whose event stream the server closes is resumed by the gateway
(Last-Event-ID); a stream the gateway cannot resume is refused in so many words; and a relayed
call the agent cancels is cancelled on the server and recorded so."""

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

from tests.mcp.conftest import agent_session, http_gateway_before, payloads

HERE = Path(__file__).resolve().parent
# Long enough that a request left unanswered shows as this timeout's error, not a hang.
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("relay")
    marker = tmp / "cancelled.txt"
    script = HERE / "asking_http_server.py"
    with http_gateway_before(script, "a", tmp, TIMEOUT, str(marker)) as gateway:
        yield {**gateway, "marker": marker}


ELICITED = 0


async def elicited(ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
    global ELICITED
    assert params.message == "What is your name?"
    ELICITED += 1
    # From the second time on the answer holds a key "method" (which the server ignores): an
    # answer, all the same, that must reach the server.
    extra = {"method": "x"} if ELICITED > 1 else {}
    return types.ElicitResult(action="accept", content={"name": "agent-7", **extra})


async def sampled(ctx: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
    asked = params.messages[0].content
    assert isinstance(asked, types.TextContent)
    return types.CreateMessageResult(
        role="assistant", model="m", content=types.TextContent(type="text", text=f"{asked.text}=4")
    )


def test_the_servers_requests_mid_call_reach_the_agent(gateway: dict[str, Any]) -> None:
    async def agent() -> list[str]:
        async with agent_session(
            gateway["url"], elicitation_callback=elicited, sampling_callback=sampled
        ) as session:
            await session.list_tools()  # the gateway knows the tools are read-only: relayed
            texts = []
            for tool, args in (("ask", {}), ("sample", {"prompt": "2+2"}), ("ask", {})):
                result = await session.call_tool(tool, args)
                assert not result.is_error, result
                texts.append(result.content[0].text)
            return texts

    assert anyio.run(agent) == ["hello agent-7", "the model said 2+2=4", "hello agent-7"]
    calls = [c for c in payloads(gateway["tape"], "tool_call") if c["tool"] in ("ask", "sample")]
    assert [c["ok"] for c in calls] == [True, True, True], calls
    # The tape holds what the server asked and what the agent answered, within the call.
    asked = calls[1]["asked"]
    assert [a["method"] for a in asked] == ["sampling/createMessage"]
    assert asked[0]["params"]["messages"][0]["content"]["text"] == "2+2"
    assert asked[0]["answer"]["result"]["content"]["text"] == "2+2=4"
    assert calls[0]["asked"][0]["answer"]["result"] == {"action": "accept",
                                                        "content": {"name": "agent-7"}}  # fmt: skip


def test_a_closed_stream_is_resumed_and_the_gateway_refuses_to_resume_its_own(
    gateway: dict[str, Any],
) -> None:
    async def agent() -> str:
        async with agent_session(gateway["url"]) as session:
            await session.list_tools()
            result = await session.call_tool("pause", {})
            assert not result.is_error, result
            return str(result.content[0].text)

    # The server closes the call's stream before its answer: the gateway resumes it upstream
    # with Last-Event-ID, as the SDK's client would have, and the agent never sees the break.
    assert anyio.run(agent) == "resumed"
    [pause] = [c for c in payloads(gateway["tape"], "tool_call") if c["tool"] == "pause"]
    assert pause["ok"] is True and pause["result"]["content"][0]["text"] == "resumed"
    # The gateway's own answers carry no event ids, so an agent has nothing to resume; one
    # that asks anyway is told so, not left with a bare server error.
    request = urllib.request.Request(gateway["url"], headers={
        "accept": "text/event-stream", "last-event-id": "1", "mcp-session-id": "x"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    body = refused.value.read().decode()
    assert "does not resume event streams (Last-Event-ID)" in body, body


def test_a_relayed_call_the_agent_cancels_is_cancelled_upstream(gateway: dict[str, Any]) -> None:
    async def agent() -> str:
        async with agent_session(gateway["url"], elicitation_callback=elicited) as session:
            await session.list_tools()
            with anyio.move_on_after(1) as waited:
                await session.call_tool("wait", {})
            assert waited.cancelled_caught  # the SDK's client sends notifications/cancelled
            result = await session.call_tool("ask", {})  # the gateway still serves the session
            return str(result.content[0].text)

    assert anyio.run(agent) == "hello agent-7"
    [wait] = [c for c in payloads(gateway["tape"], "tool_call") if c["tool"] == "wait"]
    assert wait["ok"] is False and wait["cancelled"] is True, wait
    assert wait["error"] == {"message": "cancelled by the agent"}
    # The cancellation reached the server (its tool saw it), as the SDK's client sends it.
    assert gateway["marker"].read_text() == "cancelled\n"


def test_another_client_cannot_answer_a_request_the_server_put_to_this_one(
    gateway: dict[str, Any],
) -> None:
    # The gateway's ids for the server's requests are guessable (jukebox-N): while the agent
    # is being asked, another client (no session, or a made-up one) posts answers under every
    # such id. None may reach the server as the agent's: only the asked session answers.
    intruders: list[int] = []

    def intrude() -> None:
        for session_id in (None, "x"):
            for n in range(1, 20):
                headers = {"content-type": "application/json",
                           "accept": "application/json, text/event-stream"}  # fmt: skip
                if session_id is not None:
                    headers["mcp-session-id"] = session_id
                said = {"action": "accept", "content": {"name": "intruder"}}
                body = {"jsonrpc": "2.0", "id": f"jukebox-{n}", "result": said}
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

    async def agent() -> str:
        async with agent_session(
            gateway["url"], elicitation_callback=asked_while_intruded
        ) as session:
            await session.list_tools()
            result = await session.call_tool("ask", {})
            assert not result.is_error, result
            return str(result.content[0].text)

    assert anyio.run(agent) == "hello agent-7"
    assert len(intruders) == 38 and all(code >= 400 for code in intruders), intruders
    last = [c for c in payloads(gateway["tape"], "tool_call") if c["tool"] == "ask"][-1]
    assert last["asked"][0]["answer"]["result"]["content"] == {"name": "agent-7"}

