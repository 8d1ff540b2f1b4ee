"""`jukebox booth run --upstream NAME=URL` and Azure from AZURE_OPENAI_ENDPOINT, end to end: the
agent finds each upstream in its environment, every call (chat, embeddings, legacy completions
and Azure deployment paths) is recorded by name, and `jukebox replay --exec` replays the run
offline; telemetry the environment turns on is named before the agent starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.tape.tape import Tape
from shadowfs.store import Store
from tests.llm.conftest import OPENAI_KEY
from tests.llm.upstream import FakeUpstream

JUKEBOX = str(Path(sys.executable).parent / "jukebox")
AZURE_KEY = "azure-test-SECRET789abc"
GEMINI_KEY = "AIzaSyFAKE-gemini-SECRET-0123456789abcd"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")

# An agent using a local OpenAI-compatible server, Azure and OpenAI's embeddings, found by the
# variables the booth sets (AzureOpenAI reads AZURE_OPENAI_ENDPOINT itself).
AGENT = """
import json, os, openai
local = openai.OpenAI(api_key="ollama", base_url=os.environ["JUKEBOX_UPSTREAM_LOCAL_BASE_URL"],
                      max_retries=0)
azure = openai.AzureOpenAI(api_version="2024-10-21", max_retries=0)
plain = openai.OpenAI(max_retries=0)
ask = [{"role": "user", "content": "write hello"}]
seen = [
    local.chat.completions.create(model="llama3", messages=ask).model_dump(),
    local.completions.create(model="llama3", prompt="hello", max_tokens=5).model_dump(),
    azure.chat.completions.create(model="my-gpt4o", messages=ask).model_dump(),
    plain.embeddings.create(model="text-embedding-3-small", input="hello").model_dump(),
]
from google import genai  # GOOGLE_GEMINI_BASE_URL and GEMINI_API_KEY from the environment
gemini = genai.Client()  # kept in a name: a collected client closes its connection
seen.append(gemini.models.generate_content(model="gemini-2.5-flash", contents="hello gemini").text)
with open("out.json", "w") as f:
    json.dump(seen, f)
# The agent's copy of the list names the proxy, never the upstreams' own URLs.
print(json.dumps({w.split("=")[0]: w.split("=", 1)[1].startswith("http://127.0.0.1:") and
                  "/upstream/" in w for w in os.environ["JUKEBOX_UPSTREAMS"].split()}))
"""


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [JUKEBOX, *args], capture_output=True, text=True, env=env, timeout=90, cwd="/"
    )


def test_named_and_azure_upstreams_record_and_replay_offline(
    upstream: FakeUpstream, tmp_path: Path
) -> None:
    local = FakeUpstream().start()
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "agent.py").write_text(AGENT)
    env = dict(os.environ, OPENAI_API_KEY=OPENAI_KEY, AZURE_OPENAI_API_KEY=AZURE_KEY,
               GOOGLE_GEMINI_BASE_URL=upstream.url, GEMINI_API_KEY=GEMINI_KEY,
               OPENAI_BASE_URL=upstream.openai_url, AZURE_OPENAI_ENDPOINT=upstream.url,
               LANGCHAIN_TRACING_V2="true")  # fmt: skip
    try:
        bad = run_cli("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes),
                      "--upstream", "local", "--", sys.executable, "agent.py", env=env)  # fmt: skip
        assert bad.returncode == 2 and "write NAME=URL" in bad.stderr
        listed = {**env, "JUKEBOX_UPSTREAMS": "ok=http://127.0.0.1:9 Bad=http://x"}
        bad = run_cli("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes),
                      "--", sys.executable, "agent.py", env=listed)  # fmt: skip
        assert bad.returncode == 2 and "bad upstream name 'Bad'" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and not tapes.exists()
        # One upstream from the list, one from the flag.
        env["JUKEBOX_UPSTREAMS"] = f"spare={local.openai_url}"
        proc = run_cli("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes),
                       "--tape-id", "rec", "--upstream", f"local={local.openai_url}",
                       "--", sys.executable, "agent.py", env=env)  # fmt: skip
    finally:
        local.stop()
    assert proc.returncode == 0, proc.stderr
    listed_in_agent = json.loads(proc.stdout.strip().splitlines()[-1])
    assert listed_in_agent == {"azure": True, "local": True, "spare": True}
    assert "LANGCHAIN_TRACING_V2 turns on LangSmith tracing" in proc.stderr
    recorded = json.loads((tree / "out.json").read_text())
    assert recorded[2]["choices"][0]["message"]["tool_calls"] is None
    assert recorded[2]["choices"][0]["message"]["content"] == "echo: write hello"
    assert [path for _, path, _, _ in local.seen] == ["/v1/chat/completions", "/v1/completions"]
    with Store.open(tapes / ".jukebox" / "store") as store:
        tape = Tape.load(tapes / "rec.jbx", store)
        turns = [f.resolve_payload(store) for f in tape.frames if f.kind == "llm_turn"]
    assert [(t["endpoint"], t.get("upstream")) for t in turns] == [
        ("chat.completions", "local"),
        ("completions", "local"),
        ("chat.completions", "azure"),
        ("embeddings", None),
        ("generateContent", None),
    ]
    assert recorded[4] == "echo: hello gemini" and turns[4]["provider"] == "gemini"
    upstream.stop()
    # Offline: the upstreams' variables are gone, the replay gives the agent the same names.
    gone = ("AZURE_OPENAI_ENDPOINT", "OPENAI_BASE_URL", "AZURE_OPENAI_API_KEY",
            "GOOGLE_GEMINI_BASE_URL", "GEMINI_API_KEY")  # fmt: skip
    offline = {k: v for k, v in env.items() if k not in gone}
    replay = run_cli("replay", str(tapes / "rec.jbx"), "--exec", "--json", env=offline)
    assert replay.returncode == 0, replay.stderr
    result = json.loads(replay.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["agent_status"] == 0 and not result["problems"], result
    assert (result["llm_served"], result["llm_live"], result["difference"]) == (5, 0, None)
