"""A tape recorded as a booth records one: the real openai and anthropic clients through the
real proxy against the test upstream (chat, streams, Responses, Messages, embeddings, legacy
completions, an upstream error), then Jukebox's own frames with real trees in a real store."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jukebox.llm.server import ProxyServer
from jukebox.tape.tape import Tape, TapeWriter
from shadowfs import tree
from shadowfs.store import Store
from tests.export import phoenix as phoenix_server
from tests.export.phoenix import Phoenix
from tests.llm import scenario
from tests.llm.upstream import FakeUpstream

# A value in the exporting process's environment under a secret-looking name, and a key-shaped
# value nobody declared: both are pasted into a prompt, neither may leave with the content.
ENV_SECRET = "hunter2-correct-horse-battery"
KEY_SHAPED = "sk-proj-abcdefghijklmnop0123456789"
ARGV_KEY = "sk-live-0123456789abcdef"
PROMPT = f"write hello; my password is {ENV_SECRET} and the key {KEY_SHAPED}"


@dataclass
class Recorded:
    tape_dir: Path
    path: Path
    tape_id: str

    def load(self) -> Tape:
        return Tape.load(self.path, Store.open(self.tape_dir / ".jukebox" / "store"))


def record_tape(root: Path, upstream: FakeUpstream) -> Recorded:
    import openai

    store = Store.open(root / ".jukebox" / "store", create=True)
    work = root / "work"
    work.mkdir()
    (work / "a.txt").write_text("one\n")
    base = tree.build_tree(store, work)
    writer = TapeWriter.create(root / "otelrun.jbx", store, "otelrun")
    writer.append(
        "run_start",
        {"name": "otel-agent", "argv": ["python", "agent.py", "--api-key", ARGV_KEY],
         "cwd": str(work), "image": "host"},
        tree=base,
    )  # fmt: skip
    upstreams = {"openai": upstream.openai_url, "anthropic": upstream.url}
    with ProxyServer(upstreams=upstreams, record=writer.append) as proxy:
        urls = proxy.base_urls()
        scenario.run(urls, prompt=PROMPT)
        o = openai.OpenAI(
            api_key=scenario.OPENAI_KEY, base_url=urls["OPENAI_BASE_URL"], max_retries=0
        )
        o.embeddings.create(model="text-embedding-3-small", input=["alpha beta", "gamma"])
        o.completions.create(model="gpt-3.5-turbo-instruct", prompt="say one", max_tokens=5)
        with contextlib.suppress(openai.RateLimitError):
            o.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "fail please"}],
                extra_headers={"x-fake-fail": "429:1"},
            )
    writer.append(
        "tool_call",
        {"tool": "write_file", "id": "call_fake_1", "args": {"path": "hello.txt", "why": PROMPT},
         "result": f"wrote hello.txt ({KEY_SHAPED})", "ok": True, "seconds": 0.25},
    )  # fmt: skip
    writer.append("tool_call", {"tool": "rm", "args": {"path": "/"}, "result": "no", "ok": False})
    (work / "hello.txt").write_text("hello\n")
    (work / "a.txt").unlink()
    changed = tree.build_tree(store, work, previous=base)
    writer.append(
        "checkpoint", {"id": 1, "label": "tests-pass", "reason": "request"}, tree=changed
    )
    writer.append(
        "verify",
        {"cmd": ["pytest", "-q"], "exit": 1, "signal": None, "ok": False, "seconds": 1.5,
         "output": f"1 failed: {KEY_SHAPED}\n"},
    )  # fmt: skip
    writer.append(
        "breaker",
        {"rule": "max_cost_usd", "limit": 0.5, "value": 0.75, "detail": "over budget"},
    )
    writer.append(
        "rollback", {"to": 0, "label": "start", "reason": "verifier failed"}, tree=base
    )
    writer.append("exit", {"code": 0, "signal": None, "seconds": 3.0})
    writer.append(
        "rollback",
        {"to": 0, "label": "start", "reason": "the verifier failed", "final": True},
        tree=base,
    )
    writer.close()
    store.close()
    return Recorded(root, root / "otelrun.jbx", "otelrun")


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected what they deselect
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start Phoenix at collection, not at the first test that needs it (see
    tests.export.phoenix.start_early), when a selected test needs it. Not in a worker of
    `pytest -n`: every worker collects every test and most run none of these; the one the
    "phoenix" group lands on starts it at the group's first test."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any("phoenix" in getattr(item, "fixturenames", ()) for item in items):
        phoenix_server.start_early()


@pytest.fixture(scope="package")
def phoenix_launch() -> Phoenix | None:
    """Arize Phoenix, started when these tests were collected; None when `make receivers` has
    not installed it."""
    return phoenix_server.early()


@pytest.fixture(scope="package")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    up = FakeUpstream().start()
    try:
        yield record_tape(tmp_path_factory.mktemp("otel"), up)
    finally:
        up.stop()


@pytest.fixture(scope="package")
def phoenix(phoenix_launch: Phoenix | None) -> Phoenix:
    if phoenix_launch is None:
        message = "Arize Phoenix is not installed here: `make receivers` installs it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    phoenix_launch.wait_ready()
    return phoenix_launch
