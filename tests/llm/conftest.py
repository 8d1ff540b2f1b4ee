"""Fixtures for the LLM proxy tests: a fake upstream, a real store and tape, SDK clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jukebox.llm.server import ProxyServer
from jukebox.tape.tape import Tape, TapeWriter
from shadowfs.store import Store
from tests.llm.upstream import FakeUpstream

OPENAI_KEY = "sk-test-SECRET123"
ANTHROPIC_KEY = "sk-ant-test-SECRET456xyz"


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    up = FakeUpstream().start()
    yield up
    up.stop()


class Recording:
    """A store and a tape being written, as a booth would hold them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = Store.open(root / "store", create=True)
        self.path = root / "run.jbx"
        self.writer = TapeWriter.create(self.path, self.store, "run")
        self.writer.append("run_start", {"argv": ["agent"]})

    def proxy(self, upstream: FakeUpstream | None, **kwargs: Any) -> ProxyServer:
        upstreams = (
            {"openai": upstream.openai_url, "anthropic": upstream.url, "gemini": upstream.url}
            if upstream is not None
            else dict.fromkeys(("openai", "anthropic", "gemini"), "http://127.0.0.1:9")
        )
        return ProxyServer(upstreams=upstreams, record=self.writer.append, **kwargs)

    def tape(self) -> Tape:
        self.store.flush()
        return Tape.load(self.path, self.store)

    def close(self) -> None:
        self.writer.close()
        self.store.close()


@pytest.fixture
def recording(tmp_path: Path) -> Iterator[Recording]:
    rec = Recording(tmp_path)
    yield rec
    rec.close()


def clients(base_urls: dict[str, str]) -> tuple[Any, Any]:
    import anthropic
    import openai

    o = openai.OpenAI(api_key=OPENAI_KEY, base_url=base_urls["OPENAI_BASE_URL"], max_retries=0)
    a = anthropic.Anthropic(
        api_key=ANTHROPIC_KEY, base_url=base_urls["ANTHROPIC_BASE_URL"], max_retries=0
    )
    return o, a


def direct_urls(upstream: FakeUpstream) -> dict[str, str]:
    return {"OPENAI_BASE_URL": upstream.openai_url, "ANTHROPIC_BASE_URL": upstream.url}
