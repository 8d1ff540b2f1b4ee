"""The agent of the time-travel tests: turns of tool use over OpenAI's wire protocol, editing a file
and taking a checkpoint (over the booth's control socket) per turn, then a streamed Responses
call. It speaks the protocol with httpx, as the openai SDK does, and as strictly: the key from
$OPENAI_API_KEY or a refusal to start without one, any answer not 2xx an error. The subject here
is replay and fork, run two dozen times; importing the SDK cost ~1 s of CPU per run. The real
SDKs go through the same booth, replay and fork in tests/llm/test_clients.py
(test_booth_record_then_strict_replay_offline, without API keys) and
tests/timetravel/test_fork_models.py. With `--sdk` the same run goes over the real openai SDK
(bench/bench_replay.py times that, as a person would wait for it).

Every model reply is printed on stdout as one JSON line, its keys sorted (a replay serves the
recorded JSON in its own key order; the SDK's models print fields in theirs), so a recorded run
and its replay can be compared by their output. Steered by the environment, since a replay
re-runs the same argv: JB_TURNS (default 3), JB_PROMPT (default "write hello") and JB_PROMPT_<i>
for turn i alone, JB_STRAY=1 writes an extra file in turn 1, JB_DELAY_MS asks the fake upstream
to be slow, JB_KEY_FROM_ENV=1 leaves the API key to $OPENAI_API_KEY (as most agents do),
JB_LIST_MODELS=1 lists the models (a call no replay serves) and carries on whatever the answer,
JB_EXIT=N exits with status N at the end, JB_TIMES=1 prints how long each chat call took, as the
agent saw it, on stderr (`took_ms turn N: MS`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator


def checkpoint(label: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(os.environ["JUKEBOX_SOCKET"])
        sock.sendall(json.dumps({"op": "checkpoint", "label": label}).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            part = sock.recv(65536)
            if not part:
                break
            reply += part
    if not json.loads(reply).get("ok"):
        sys.exit(f"checkpoint failed: {reply!r}")


class APIError(Exception):
    """What the SDK raises for an answer that is not 2xx, or no answer."""


def _checked(response) -> None:  # httpx.Response
    if not response.is_success:
        response.read()
        raise APIError(f"Error code: {response.status_code} - {response.text}")


class OverHttp:
    """The calls over httpx, as strict as the SDK's: what the tests run."""

    def __init__(self) -> None:
        import httpx

        base = (os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        from_env = os.environ.get("JB_KEY_FROM_ENV")
        key = os.environ.get("OPENAI_API_KEY") if from_env else "sk-test-SECRET123"
        if not key:  # as openai.OpenAI() refuses to start
            sys.exit(
                "The api_key client option must be set ... OPENAI_API_KEY environment variable"
            )
        headers = {"authorization": f"Bearer {key}"}
        delay = os.environ.get("JB_DELAY_MS")
        if delay:
            headers["x-fake-delay-ms"] = delay
        self.client = httpx.Client(base_url=base + "/", headers=headers, timeout=600)
        self.errors = (APIError, httpx.HTTPError)

    def list_models(self) -> None:
        _checked(self.client.get("models"))

    def chat(self, body: dict) -> tuple[str, str]:
        """The reply as printed, and its tool call's arguments."""
        response = self.client.post("chat/completions", json=body)
        _checked(response)
        reply = response.json()
        arguments = reply["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        return json.dumps(reply, sort_keys=True), arguments

    def summary(self, body: dict) -> Iterator[tuple[str, dict]]:
        """The stream's events, as printed and as a dict."""
        with self.client.stream("POST", "responses", json=body) as response:
            _checked(response)
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue  # event: names, blank lines between events
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                yield json.dumps(event, sort_keys=True), event


class OverSdk:
    """The same calls over the real openai SDK: what bench/bench_replay.py times (`--sdk`)."""

    def __init__(self) -> None:
        import openai

        delay = os.environ.get("JB_DELAY_MS")
        headers = {"x-fake-delay-ms": delay} if delay else None
        key = None if os.environ.get("JB_KEY_FROM_ENV") else "sk-test-SECRET123"
        self.client = openai.OpenAI(api_key=key, max_retries=0, default_headers=headers)
        self.errors = (openai.APIError,)

    def list_models(self) -> None:
        self.client.models.list()

    def chat(self, body: dict) -> tuple[str, str]:
        reply = self.client.chat.completions.create(**body)
        return reply.model_dump_json(), reply.choices[0].message.tool_calls[0].function.arguments

    def summary(self, body: dict) -> Iterator[tuple[str, dict]]:
        for event in self.client.responses.create(**body):
            yield event.model_dump_json(), event.model_dump()


def main() -> None:
    o = OverSdk() if sys.argv[1:] == ["--sdk"] else OverHttp()
    if os.environ.get("JB_LIST_MODELS"):
        try:
            o.list_models()
        except o.errors as error:
            print(f"listing the models failed, going on: {error}", file=sys.stderr)
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {}}}]
    turns = int(os.environ.get("JB_TURNS", "3"))
    for i in range(1, turns + 1):
        prompt = os.environ.get(f"JB_PROMPT_{i}") or os.environ.get("JB_PROMPT", "write hello")
        started = time.monotonic()
        printed, arguments = o.chat(
            {
                "messages": [
                    {"role": "system", "content": "You are a file agent."},
                    {"role": "user", "content": f"{prompt} #{i}"},
                ],
                "model": "gpt-4o-mini",
                "tools": tools,
            }
        )
        if os.environ.get("JB_TIMES"):
            took = (time.monotonic() - started) * 1000
            print(f"took_ms turn {i}: {took:.3f}", file=sys.stderr, flush=True)
        print(printed, flush=True)
        args = json.loads(arguments)
        with open(f"file{i}.txt", "w") as f:
            f.write(args["text"] + "\n")
        if i == 1 and os.environ.get("JB_STRAY"):
            with open("stray.txt", "w") as f:
                f.write("not on the tape\n")
        checkpoint(f"turn-{i}")
    text = []
    body = {"input": f"summarize {turns} turns", "model": "gpt-4.1", "stream": True}
    for printed, event in o.summary(body):
        print(printed, flush=True)
        if event.get("type") == "response.output_text.delta":
            text.append(event["delta"])
    with open("summary.txt", "w") as f:
        f.write("".join(text) + "\n")
    sys.exit(int(os.environ.get("JB_EXIT", "0")))


if __name__ == "__main__":
    main()
