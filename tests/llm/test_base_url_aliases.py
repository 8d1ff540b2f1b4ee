"""Clients that read a base URL under another name (langchain-openai and litellm read
OPENAI_API_BASE, langchain-anthropic ANTHROPIC_API_URL, litellm ANTHROPIC_API_BASE) are pointed
at the booth's proxy too: an agent reading only an alias is recorded, and the user's own alias
names the upstream."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.tape.tape import Tape
from shadowfs.store import Store
from tests.llm.conftest import ANTHROPIC_KEY, OPENAI_KEY
from tests.llm.upstream import FakeUpstream

JUKEBOX = str(Path(sys.executable).parent / "jukebox")
CANONICAL = ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL")

# The real SDKs, each given nothing but an alias (the canonical variables are dropped, so the
# SDK cannot fall back to them); the proxy's secret path segment is part of each alias.
AGENT = f"""
import os, sys
import anthropic, openai
for name in {CANONICAL!r}:
    os.environ.pop(name, None)
assert "/openai/v1" in os.environ["OPENAI_API_BASE"]
o = openai.OpenAI(api_key={OPENAI_KEY!r}, base_url=os.environ["OPENAI_API_BASE"], max_retries=0)
o.chat.completions.create(model="gpt-4o-mini", messages=[{{"role": "user", "content": "hi"}}])
for alias in ("ANTHROPIC_API_URL", "ANTHROPIC_API_BASE"):
    a = anthropic.Anthropic(api_key={ANTHROPIC_KEY!r}, base_url=os.environ[alias], max_retries=0)
    a.messages.create(model="claude-haiku-4-5", max_tokens=32,
                      messages=[{{"role": "user", "content": "hi from " + alias}}])
print(os.environ["OPENAI_API_BASE"])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")
def test_an_agent_reading_only_aliases_is_recorded(upstream: FakeUpstream, tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    # The user names the upstreams by aliases only: the proxy forwards there.
    env = {k: v for k, v in os.environ.items() if k not in CANONICAL}
    env.update(OPENAI_API_BASE=upstream.openai_url, ANTHROPIC_API_URL=upstream.url,
               ANTHROPIC_API_BASE=upstream.url)  # fmt: skip
    proc = subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id",
         "alias", "--", sys.executable, "-c", AGENT],
        capture_output=True, text=True, env=env, timeout=60, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    proxy_url = proc.stdout.strip()
    assert proxy_url.startswith("http://127.0.0.1:") and proxy_url != upstream.openai_url
    with Store.open(tapes / ".jukebox" / "store") as store:
        tape = Tape.load(tapes / "alias.jbx", store)
        turns = [f.resolve_payload(store) for f in tape.frames if f.kind == "llm_turn"]
    assert [(t["provider"], t["status"]) for t in turns] == [
        ("openai", 200),
        ("anthropic", 200),
        ("anthropic", 200),
    ]
    assert [path for _, path, _, _ in upstream.seen] == [
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/messages",
    ]
