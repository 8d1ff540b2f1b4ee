"""Fixtures for the MCP gateway's tests: real servers (the memory server from npm, mcp-server-git
from PyPI, a small hostile one written with the SDK) reached through `jukebox mcp wrap` by the
SDK's own ClientSession."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.booth.conftest import dev_fuse, root_only  # noqa: F401  (booth tests' fixtures)

HERE = Path(__file__).resolve().parent
MEMORY_SERVER = HERE / "node" / "node_modules" / ".bin" / "mcp-server-memory"
HOSTILE_SERVER = HERE / "hostile_server.py"
JUKEBOX = str(Path(sys.executable).parent / "jukebox")


def memory_server() -> list[str]:
    if not MEMORY_SERVER.exists() or shutil.which("node") is None:
        pytest.fail(
            f"{MEMORY_SERVER} is missing: `make setup` installs it (npm ci in tests/mcp/node)"
        )
    return [str(MEMORY_SERVER)]


def hostile_server(*mode: str) -> list[str]:
    return [sys.executable, str(HOSTILE_SERVER), *mode]


def git_server(repo: Path) -> list[str]:
    return [str(Path(sys.executable).parent / "mcp-server-git"), "--repository", str(repo)]


@contextlib.asynccontextmanager
async def wrapped(
    server: list[str], *wrap_args: str, env: dict[str, str] | None = None,
    timeout: float = 30.0, **callbacks: Any,
) -> AsyncIterator[Any]:  # fmt: skip
    """A ClientSession (the SDK's, with `callbacks`: sampling_callback...) talking to `jukebox
    mcp wrap WRAP_ARGS -- SERVER`."""
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=JUKEBOX,
        args=["mcp", "wrap", *wrap_args, "--", *server],
        env={**os.environ, **(env or {})},
    )
    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write, read_timeout_seconds=timeout, **callbacks) as session,
    ):
        await session.initialize()
        yield session


def payloads(tape: Path, kind: str | None = None, event: str | None = None,
             server: str | None = None) -> list[dict]:  # fmt: skip
    """The payloads (spilled values loaded back) of a tape's frames of `kind` (and `event`,
    and `server`)."""
    from jukebox.tape.tape import Tape
    from shadowfs.store import Store

    with Store.open(tape.parent / ".jukebox" / "store") as store:
        out = []
        for f in Tape.load(tape, store).intact_frames:
            if kind is not None and f.kind != kind:
                continue
            p = f.resolve_payload(store)
            if (event is None or p.get("event") == event) and (
                server is None or p.get("server") == server
            ):
                out.append(p)
    return out


def only_tape(tape_dir: Path) -> Path:
    tapes = sorted(tape_dir.glob("*.jbx"))
    assert len(tapes) == 1, tapes
    return tapes[0]


@contextlib.asynccontextmanager
async def agent_session(url: str, **callbacks: Any) -> AsyncIterator[Any]:
    """An agent's ClientSession (the SDK's, with `callbacks`: elicitation_callback...) with the
    streamable-HTTP gateway at `url`, initialized."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with (
        streamable_http_client(url) as (read, write, *_),
        ClientSession(read, write, read_timeout_seconds=30, **callbacks) as session,
    ):
        await session.initialize()
        yield session


@contextlib.contextmanager
def http_gateway_before(script: Path, name: str, tmp: Path, timeout: float,
                        *args: str) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The booth's HTTP gateway as the supervisor runs it (a real stage gate recording on a real
    tape) in front of the streamable-HTTP server `script` (which prints its port), served as
    server `name`: yields the gateway's URL for it and the tape."""
    import socket
    import subprocess

    from jukebox.mcp.http_gateway import HttpGateways
    from jukebox.mcp.policy import Policy
    from jukebox.mcp.servers import ServerSpec
    from jukebox.mcp.staging import StageGate
    from jukebox.tape.tape import TapeWriter
    from shadowfs.store import Store

    server = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    assert server.stdout is not None
    url = f"http://127.0.0.1:{int(server.stdout.readline())}/mcp"
    store = Store.open(tmp / ".jukebox" / "store", create=True)
    tape = tmp / f"{name}.jbx"
    writer = TapeWriter.create(tape, store, name, fsync=False)
    writer.append("run_start", {"name": name})
    gate = StageGate({name: ServerSpec(name, "", url=url)}, writer.append)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    gateways = HttpGateways({name: url}, gate, Policy("staged_acid"),
                            lambda server, tool, args: "never", lambda p: p,
                            timeout=timeout).start(listener)  # fmt: skip
    try:
        yield {"url": gateways.urls()[name], "tape": tape}
    finally:
        gateways.stop()
        writer.close()
        store.close()
        server.terminate()
        server.wait(timeout=10)
