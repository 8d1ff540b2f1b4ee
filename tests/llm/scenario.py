"""One multi-turn conversation over both SDKs, sync, async and streaming, with tool calls.

`run(base_urls)` returns what the agent saw, as plain data, so a run through the proxy, a direct
run and a replay can be compared for equality. Used in process and as the booth's agent script
(`python scenario.py OUT.json [PROMPT]`, which also edits files in its working directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

OPENAI_KEY = "sk-test-SECRET123"
ANTHROPIC_KEY = "sk-ant-test-SECRET456xyz"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
ANTHROPIC_TOOLS = [{"name": "write_file", "input_schema": {"type": "object"}}]


def _dump(obj: Any) -> Any:
    return obj.model_dump(mode="json")


def run(base_urls: dict[str, str], prompt: str = "write hello", write: bool = False) -> list[Any]:
    import anthropic
    import openai

    o = openai.OpenAI(api_key=OPENAI_KEY, base_url=base_urls["OPENAI_BASE_URL"], max_retries=0)
    a = anthropic.Anthropic(
        api_key=ANTHROPIC_KEY, base_url=base_urls["ANTHROPIC_BASE_URL"], max_retries=0
    )
    seen: list[Any] = []
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a file agent."},
        {"role": "user", "content": prompt},
    ]
    # Turn 1: a tool call, answered; turn 2: the model's final word.
    first = o.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS)
    seen.append(_dump(first))
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    if write:
        with open(args["path"], "w") as f:
            f.write(f"{prompt}\n")
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "wrote " + args["path"]})
    second = o.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS)
    seen.append(_dump(second))
    # Streaming chat, with usage, and a streamed tool call.
    chunks = o.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "stream me a few words please"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    seen.append([_dump(c) for c in chunks])
    chunks = o.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": prompt}], tools=TOOLS, stream=True
    )
    seen.append([_dump(c) for c in chunks])
    # Responses API, JSON and stream.
    seen.append(_dump(o.responses.create(model="gpt-4.1", input=f"summarize: {prompt}")))
    events = o.responses.create(model="gpt-4.1", input="stream a reply", stream=True)
    seen.append([_dump(e) for e in events])
    # Anthropic: JSON with a tool, then a stream through the helper.
    msg = a.messages.create(
        model="claude-haiku-4-5",
        max_tokens=64,
        system="You are careful.",
        messages=[{"role": "user", "content": prompt}],
        tools=ANTHROPIC_TOOLS,
    )
    seen.append(_dump(msg))
    if write:
        with open("notes.txt", "w") as f:
            f.write(json.dumps(msg.content[0].input))
    with a.messages.stream(
        model="claude-haiku-4-5",
        max_tokens=64,
        messages=[{"role": "user", "content": "use the cache and stream"}],
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    seen.append({"texts": texts, "final": _dump(final)})
    seen.append(asyncio.run(_async(base_urls)))
    return seen


async def _async(base_urls: dict[str, str]) -> list[Any]:
    import anthropic
    import openai

    o = openai.AsyncOpenAI(api_key=OPENAI_KEY, base_url=base_urls["OPENAI_BASE_URL"], max_retries=0)
    a = anthropic.AsyncAnthropic(
        api_key=ANTHROPIC_KEY, base_url=base_urls["ANTHROPIC_BASE_URL"], max_retries=0
    )
    out = []
    r = await o.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "async hello"}]
    )
    out.append(_dump(r))
    stream = await a.messages.create(
        model="claude-haiku-4-5",
        max_tokens=32,
        messages=[{"role": "user", "content": "async stream"}],
        stream=True,
    )
    out.append([_dump(e) async for e in stream])
    await o.close()
    await a.close()
    return out


if __name__ == "__main__":
    urls = {k: os.environ[k] for k in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL")}
    result = run(urls, prompt=sys.argv[2] if len(sys.argv) > 2 else "write hello", write=True)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
