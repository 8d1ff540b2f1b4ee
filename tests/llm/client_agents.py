"""The same small agent written with each popular client library, for the client matrix.

Each agent is configured the way a user's agent in a booth is: by the environment alone (base
URLs, API keys). It asks the model to write a file, runs the `write_file` tool the model calls,
sends the result back and gets the model's last word, then streams a second reply. The fake
upstream (upstream.py) always calls the first tool offered and then says `done: <tool result>`.

`run(NAME, prompt)` returns what the agent saw, as plain data, so a recording and its replay
compare for equality. As a script (the booth's agent), `python client_agents.py NAME...` runs
each agent in turn in one process (the libraries are slow to import: seconds each) and prints
`{NAME: what it saw, or {"error": ...}}` as one JSON line; `$JB_CLIENT_PROMPT` replaces the
prompt.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from typing import Any

OPENAI_MODEL = "gpt-4o-mini"
ANTHROPIC_MODEL = "claude-haiku-4-5"
STREAM_PROMPT = "stream a few words"

# No network beyond 127.0.0.1: litellm fetches its price map at import, the Agents SDK posts
# traces to the provider, LangSmith and Logfire would send theirs.
QUIET_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "LANGCHAIN_TRACING_V2": "false",
    "LANGSMITH_TRACING": "false",
    "LOGFIRE_SEND_TO_LOGFIRE": "false",
}


def write_file(path: str, text: str) -> str:
    """Write text to the file at path."""
    with open(path, "w") as f:
        f.write(text + "\n")
    return f"wrote {path}"


WRITE_FILE_SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
    "required": ["path", "text"],
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file.",
            "parameters": WRITE_FILE_SCHEMA,
        },
    }
]


def _openai_chat_loop(create: Callable[..., Any], prompt: str) -> list[str]:
    """An OpenAI-shaped tool loop (the openai SDK and litellm answer alike)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    seen = []
    for _ in range(4):
        reply = create(model=OPENAI_MODEL, messages=messages, tools=OPENAI_TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            seen.append(message.content)
            return seen
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": c.function.arguments}}
                    for c in message.tool_calls
                ],
            }
        )  # fmt: skip
        for call in message.tool_calls:
            result = write_file(**json.loads(call.function.arguments))
            seen.append(f"tool {call.function.name}: {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise RuntimeError("the model never stopped calling tools")


def run_openai(prompt: str) -> dict[str, Any]:
    import openai

    client = openai.OpenAI()
    seen = _openai_chat_loop(client.chat.completions.create, prompt)
    # Without stream_options.include_usage: the proxy asks for the usage itself.
    chunks = client.chat.completions.create(
        model=OPENAI_MODEL, messages=[{"role": "user", "content": STREAM_PROMPT}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return {"turns": seen, "stream": text}


def run_anthropic(prompt: str) -> dict[str, Any]:
    import anthropic

    client = anthropic.Anthropic()
    tools = [{"name": "write_file", "description": "Write text to a file.",
              "input_schema": WRITE_FILE_SCHEMA}]  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    seen = []
    while True:
        reply = client.messages.create(
            model=ANTHROPIC_MODEL, max_tokens=256, messages=messages, tools=tools
        )
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            seen.append("".join(b.text for b in reply.content if b.type == "text"))
            break
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        results = []
        for use in uses:
            result = write_file(**use.input)
            seen.append(f"tool {use.name}: {result}")
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
        messages.append({"role": "user", "content": results})
    with client.messages.stream(
        model=ANTHROPIC_MODEL, max_tokens=64, messages=[{"role": "user", "content": STREAM_PROMPT}]
    ) as stream:
        text = "".join(stream.text_stream)
    return {"turns": seen, "stream": text}


def run_litellm(prompt: str) -> dict[str, Any]:
    import litellm

    def create(**kwargs: Any) -> Any:
        return litellm.completion(**{**kwargs, "model": "openai/" + kwargs["model"]})

    seen = _openai_chat_loop(create, prompt)
    chunks = litellm.completion(
        model="anthropic/" + ANTHROPIC_MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": STREAM_PROMPT}],
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return {"turns": seen, "stream": text}


def _langchain_loop(model: Any, prompt: str) -> dict[str, Any]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    writer = tool(write_file)
    with_tools = model.bind_tools([writer])
    messages: list[Any] = [HumanMessage(prompt)]
    seen = []
    while True:
        reply = with_tools.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            seen.append(reply.text if isinstance(reply.text, str) else reply.text())
            break
        for call in reply.tool_calls:
            result = writer.invoke(call["args"])
            seen.append(f"tool {call['name']}: {result}")
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    text = "".join(str(chunk.content) for chunk in model.stream(STREAM_PROMPT))
    return {"turns": seen, "stream": text}


def run_langchain_openai(prompt: str) -> dict[str, Any]:
    from langchain_openai import ChatOpenAI

    return _langchain_loop(ChatOpenAI(model=OPENAI_MODEL), prompt)


def run_langchain_anthropic(prompt: str) -> dict[str, Any]:
    from langchain_anthropic import ChatAnthropic

    return _langchain_loop(ChatAnthropic(model=ANTHROPIC_MODEL, max_tokens=256), prompt)


def run_pydantic_ai(prompt: str) -> dict[str, Any]:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel

    model = OpenAIChatModel(OPENAI_MODEL)
    agent = Agent(model, tools=[write_file])
    result = agent.run_sync(prompt)
    calls = [
        f"tool {part.tool_name}: {part.content}"
        for message in result.all_messages()
        for part in message.parts
        if part.part_kind == "tool-return"
    ]

    async def stream() -> str:
        async with Agent(model).run_stream(STREAM_PROMPT) as streamed:
            return await streamed.get_output()

    return {"turns": [*calls, result.output], "stream": asyncio.run(stream())}


def run_openai_agents(prompt: str) -> dict[str, Any]:
    import openai
    from agents import Agent, Runner, function_tool, set_default_openai_client

    async def both() -> dict[str, Any]:
        # One event loop for both runs and a client of its own: the SDK's shared client stays
        # bound to the first event loop that used it.
        set_default_openai_client(openai.AsyncOpenAI())
        agent = Agent(name="writer", instructions="You write files.", model=OPENAI_MODEL,
                      tools=[function_tool(write_file)])  # fmt: skip
        result = await Runner.run(agent, prompt)
        calls = [
            f"tool write_file: {item.output}"
            for item in result.new_items
            if item.type == "tool_call_output_item"
        ]
        streamed = Runner.run_streamed(Agent(name="talker", model=OPENAI_MODEL), STREAM_PROMPT)
        texts = []
        async for event in streamed.stream_events():
            data = getattr(event, "data", None)
            if getattr(data, "type", None) == "response.output_text.delta":
                texts.append(data.delta)
        return {"turns": [*calls, result.final_output], "stream": "".join(texts)}

    return asyncio.run(both())


AGENTS: dict[str, Callable[[str], dict[str, Any]]] = {
    "openai": run_openai,
    "anthropic": run_anthropic,
    "litellm": run_litellm,
    "langchain-openai": run_langchain_openai,
    "langchain-anthropic": run_langchain_anthropic,
    "pydantic-ai": run_pydantic_ai,
    "openai-agents": run_openai_agents,
}


def run(name: str, prompt: str = "write hello") -> dict[str, Any]:
    return AGENTS[name](prompt)


if __name__ == "__main__":
    os.environ.update(QUIET_ENV)
    outcomes: dict[str, Any] = {}
    for name in sys.argv[1:]:
        try:
            outcomes[name] = run(name, os.environ.get("JB_CLIENT_PROMPT", "write hello"))
        except Exception as error:  # one client's failure must not hide the others' results
            outcomes[name] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(outcomes), flush=True)
    # Tearing down these libraries' modules takes seconds (litellm alone 2-4 s): skip it.
    os._exit(0)
