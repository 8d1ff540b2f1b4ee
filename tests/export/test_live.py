"""Live export from real booths: with OTEL_EXPORTER_OTLP_ENDPOINT set, a run's spans reach a
real Arize Phoenix while the agent still runs (the agent itself reads them back), with the ids
`jukebox export otel` gives the same tape; a collector that is not there never fails the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.export import otel_ids
from jukebox.export.otel_send import plan_tape
from jukebox.tape.tape import Tape
from shadowfs.store import Store
from tests.export.phoenix import Phoenix
from tests.export.test_export_cli import closed_port
from tests.llm.conftest import ANTHROPIC_KEY, OPENAI_KEY
from tests.llm.upstream import FakeUpstream

JUKEBOX = str(Path(sys.executable).parent / "jukebox")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")

# One model call, then wait until the collector shows its span: proof that it left while the
# run was still going, not at its end.
AGENT = """
import json, sys, time, urllib.request
import openai
url, trace = sys.argv[1], sys.argv[2]
client = openai.OpenAI(max_retries=0)
client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
seen, deadline = False, time.monotonic() + 90
while not seen and time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(url + "/v1/projects/default/spans?limit=1000") as r:
            spans = json.load(r)["data"]
    except Exception:
        spans = []
    seen = any(s["context"]["trace_id"] == trace and s["name"] == "chat gpt-4o-mini"
               for s in spans)
    time.sleep(0.2)
with open("seen.json", "w") as f:
    json.dump(seen, f)
"""


def booth(tmp_path: Path, tape_id: str, endpoint: str, upstream: FakeUpstream, *argv: str):
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "agent.py").write_text(AGENT)
    env = dict(os.environ, OPENAI_API_KEY=OPENAI_KEY, ANTHROPIC_API_KEY=ANTHROPIC_KEY)
    env["OPENAI_BASE_URL"] = upstream.openai_url
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    proc = subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--net", "host",
         "--tape-id", tape_id, "--verify", "true", "--", *argv],
        capture_output=True, text=True, env=env, timeout=180, cwd="/",
    )  # fmt: skip
    store = Store.open(tapes / ".jukebox" / "store")
    return proc, tree, Tape.load(tapes / f"{tape_id}.jbx", store)


@pytest.fixture(scope="module")
def upstream():
    up = FakeUpstream().start()
    yield up
    up.stop()


def test_a_booth_run_exports_span_by_span(
    phoenix: Phoenix, upstream: FakeUpstream, tmp_path: Path
) -> None:
    trace = f"{otel_ids.trace_id('live'):032x}"
    proc, tree, tape = booth(
        tmp_path, "live", phoenix.url, upstream, sys.executable, "agent.py", phoenix.url, trace
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tree / "seen.json").read_text()) is True  # seen while running
    assert "live OpenTelemetry export" not in proc.stderr  # nothing went wrong

    # Every frame's span and the run's, with the ids a later `jukebox export otel` sends.
    expected = {(f"{p.span_id:016x}", p.name) for p in plan_tape(tape).spans}
    spans = phoenix.wait_for(trace, len(expected))
    assert {(s["context"]["span_id"], s["name"]) for s in spans} == expected
    root = next(s for s in spans if s["parent_id"] is None)
    assert root["attributes"]["jukebox.status"] == "COMMITTED"
    assert root["attributes"]["gen_ai.provider.name"] == "openai"
    chat = next(s for s in spans if s["name"] == "chat gpt-4o-mini")
    assert chat["attributes"]["gen_ai.operation.name"] == "chat"
    assert chat["attributes"]["gen_ai.usage.input_tokens"] > 0
    assert "gen_ai.input.messages" not in chat["attributes"]
    assert {s["name"] for s in spans} >= {"jukebox.verify", "jukebox.commit", "jukebox.exit"}


def test_a_collector_that_is_not_there_never_fails_the_run(
    upstream: FakeUpstream, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    script = "import openai; openai.OpenAI(max_retries=0).embeddings.create(model='e', input='x')"
    proc, _, tape = booth(tmp_path, "nocollector", url, upstream, sys.executable, "-c", script)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "live OpenTelemetry" in line]
    assert len(warnings) == 1, proc.stderr  # once, however many frames followed
    assert f"live OpenTelemetry export to {url} stopped" in warnings[0]
    assert "jukebox export otel nocollector" in warnings[0]
    assert tape.verify().ok
    assert [f.kind for f in tape.frames if f.kind in ("llm_turn", "commit")] == [
        "llm_turn",
        "commit",
    ]
