"""The agent of the viewer tests, run in a real booth against the fake upstream over the real
OpenAI SDK: turns of tool use, each writing files and taking a checkpoint, a rollback, and
text that would run in a page if the viewer ever read it as markup (in a prompt, a file's
lines, a file's name). JB_TURNS turns (default 3); a model call refused (the breaker) ends the
run with status 3.
"""

from __future__ import annotations

import json
import os
import socket
import sys

# Each one sets window.__pwned if a page ever runs it.
HOSTILE = (
    '<script>window.__pwned = "script"</script>'
    "<img src=x onerror=\"window.__pwned = 'img'\">"
    '<a href="javascript:window.__pwned=1">click</a>'
)
PROMPT_1 = (
    HOSTILE
    + "\n\n# Plan\n\nWrite **hello** with `code`, then:\n\n```python\nprint('hi')\n```\n"
    + "- one\n- two\n"
)
HOSTILE_NAME = "<img src=x onerror=window.__pwned=3>.txt"


def control(op: str, **fields: object) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(os.environ["JUKEBOX_SOCKET"])
        sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            part = sock.recv(65536)
            if not part:
                break
            reply += part
    answer = json.loads(reply)
    if not answer.get("ok"):
        sys.exit(f"{op} failed: {reply!r}")
    return answer


def write(name: str, text: str) -> None:
    with open(name, "w") as f:
        f.write(text)


def main() -> None:
    import openai

    o = openai.OpenAI(api_key="sk-test-SECRET123", max_retries=0)
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {}}}]
    turns = int(os.environ.get("JB_TURNS", "3"))
    for i in range(1, turns + 1):
        prompt = PROMPT_1 if i == 1 else f"{os.environ.get('JB_PROMPT', 'write more')} #{i}"
        try:
            o.chat.completions.create(
                model="gpt-4o-mini",
                messages=[
                    {"role": "system", "content": "You are a file agent."},
                    {"role": "user", "content": prompt},
                ],
                tools=tools,
            )
        except openai.APIError as error:
            print(f"the model call was refused: {error}", file=sys.stderr)
            sys.exit(3)
        if i == 1:
            write("notes.txt", "".join(f"line {n}\n" for n in range(1, 8)))
        elif i == 2:
            write("notes.txt", "".join(f"line {n}\n" for n in range(1, 8)).replace("4", "four"))
            write("evil.html", HOSTILE + "\n")
            write(HOSTILE_NAME, "a hostile name\n")
        else:
            write(f"file{i}.txt", f"turn {i}\n")
        control("checkpoint", label=f"turn-{i}")
        if i == 2:
            control("rollback", to="turn-1")


if __name__ == "__main__":
    main()
