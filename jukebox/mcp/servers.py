"""MCP servers declared by the operator, and configs rewritten to reach them through the gateway.

A Claude-Code or Cursor style config (`.mcp.json`: `{"mcpServers": {NAME: {"command": ...,
"args": [...], "env": {...}}}}`) names stdio servers. `jukebox booth run --mcp-config FILE`
reads it before the agent starts: those servers, and only those, are the ones a commit may run
staged calls against, on the host, with the command the operator wrote (never one the agent
names: the agent could name any program). The agent gets the same config rewritten so that
each server is `jukebox mcp wrap --name NAME -- COMMAND ARGS...`.

Entries with a `url` (streamable-HTTP servers) are kept as they are by `jukebox mcp config`; in
a booth they are declared too, and reached through the supervisor's HTTP gateway
(jukebox.mcp.http_gateway), as are the servers of `--mcp-upstream NAME=URL`.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

from jukebox.errors import UsageError
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any


class ServerSpec(Value):
    __slots__ = FIELDS = ("name", "command", "args", "env", "url", "headers")
    name: str
    command: str
    args: tuple[str, ...]
    env: dict[str, str]
    url: str | None  # a streamable-HTTP server (then no command)
    # An HTTP server's headers (an `Authorization` of the operator's): sent to it by the
    # gateway and the commit, never shown to the agent, never on a tape (secrets).
    headers: dict[str, str]

    def __init__(
        self, name: str, command: str, args: tuple[str, ...] = (),
        env: dict[str, str] | None = None, url: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        setfield(self, "name", name)
        setfield(self, "command", command)
        setfield(self, "args", args)
        setfield(self, "env", {} if env is None else env)
        setfield(self, "url", url)
        setfield(self, "headers", {} if headers is None else headers)

    @property
    def argv(self) -> list[str]:
        return [self.command, *self.args]

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "command": self.command, "args": list(self.args),
               "env": dict(self.env)}  # fmt: skip
        if self.url is not None:
            out["url"] = self.url
        if self.headers:
            out["headers"] = dict(self.headers)
        return out

    def http_transport(self) -> Any:
        """The SDK's streamable-HTTP client for this server (an async context manager giving
        (read, write, link), link an HttpLink), sending its headers with every request."""
        assert self.url is not None
        return _http_client(self.url, dict(self.headers))

    def secrets(self) -> list[str]:
        """What this server's declaration holds that no frame may: its URL's password, its
        headers' values (every one: a config names no header that is safe to show)."""
        from jukebox.redact import secret_values, url_secrets

        out = url_secrets(self.url or "")
        for name, value in self.headers.items():
            out.extend(secret_values(name, value))
        return out

    def describe(self) -> dict[str, Any]:
        """What a tape may say: the command, and the names (never the values) of its env."""
        from jukebox.redact import (
            Scrubber,
            is_secret_env_name,
            redact_argv,
            redact_text,
            url_secrets,
        )

        if self.url is not None:
            out: dict[str, Any] = {"url": redact_text(self.url, Scrubber(url_secrets(self.url)))}
            if self.headers:  # their names only: the values are the operator's secrets
                out["headers"] = sorted(self.headers)
            return out
        # The values of variables whose names do not look secret, so that a fork can start the
        # server as it was (redacted further if they hold a key-shaped value or a URL password).
        values = {}
        for key, value in sorted(self.env.items()):
            if not is_secret_env_name(key):
                values[key] = redact_text(redact_argv([value])[0], Scrubber(url_secrets(value)))
        return {"command": redact_argv(self.argv), "env": sorted(self.env), "env_values": values}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServerSpec:
        return cls(data["name"], data.get("command") or "", tuple(data.get("args") or ()),
                   dict(data.get("env") or {}), data.get("url"),
                   dict(data.get("headers") or {}))  # fmt: skip


class HttpLink:
    """What a request sent beside the SDK's client needs to join its session with the server
    (jukebox.mcp.http_relay): the URL, the httpx client (its headers and its pool), and what
    the SDK's client sends and learns, as seen on the wire: the session id the server gave,
    the protocol version it stamps."""

    def __init__(self, url: str, client: Any) -> None:
        self.url = url
        self.client = client
        self.session_id: str | None = None
        self.protocol_version: str | None = None
        self.transport: Any = None  # the client's transport (its pool), for the relay
        # Set once the server answered the client's standalone GET (its stream for what the
        # server sends outside any call), whatever the answer: the gateway serves the agent
        # after it, so that nothing the server sends there is sent before anyone listens.
        self.listening: Any = None


@contextlib.asynccontextmanager
async def _http_client(url: str, headers: dict[str, str]) -> AsyncIterator[Any]:
    # The SDK's client with an httpx client of jukebox's making: the SDK's timeouts, the
    # server's headers, and a transport that keeps the connection (_keep_alive). The SDK leaves
    # a client it was given open: closed here.
    import anyio
    import httpx2
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

    timeout = httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT)
    transport = _keep_alive(httpx2.AsyncHTTPTransport())
    async with (
        httpx2.AsyncClient(timeout=timeout, headers=headers or None, transport=transport) as client,
        streamable_http_client(url, http_client=client) as (read, write),
    ):
        transport.link = HttpLink(url, client)
        transport.link.transport = transport
        transport.link.listening = anyio.Event()
        yield read, write, transport.link


# How long the end of a POST's event stream is waited for once its answer came, and how many
# bytes of it are read, before the connection is given up (closed) instead of kept.
DRAIN_WAIT = 0.1
DRAIN_BYTES = 64 * 1024


def _keep_alive(inner: Any) -> Any:
    """An httpx transport that keeps the connection of a POST answered with a server-sent event
    stream. The SDK's client closes such a response as soon as the event with its answer came,
    before the end of the body (which the server sends right after it): httpx then closes the
    connection, so every call paid a new TCP connection to the server and the server a new one
    from us (bench/bench_mcp.py: most of what the booth's HTTP gateway added to a call). Here
    closing the response first reads what is left of it, at most DRAIN_BYTES within DRAIN_WAIT,
    so the connection goes back to the pool; a server that holds the stream open past the
    answer makes that wait once, and the transport stops waiting for that server."""
    import anyio
    import httpx2

    class DrainedAtClose(httpx2.AsyncByteStream):
        # A body read through one iterator, so that `aclose` reads on where the reader stopped.
        reader: Any = None

        def __init__(self, body: Any, transport: KeepAlive) -> None:
            self.body = body
            self.transport = transport

        def _iterator(self) -> Any:
            if self.reader is None:
                self.reader = aiter(self.body)
            return self.reader

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self._iterator():
                yield chunk

        async def aclose(self) -> None:
            try:
                seen = 0
                with anyio.move_on_after(DRAIN_WAIT) as waited:
                    async for chunk in self._iterator():
                        seen += len(chunk)
                        if seen > DRAIN_BYTES:
                            break
                if waited.cancelled_caught:
                    self.transport.drain = False
            except Exception:  # a broken stream: closed below, as the SDK would have
                pass
            finally:
                await self.body.aclose()

    class KeepAlive(httpx2.AsyncBaseTransport):
        def __init__(self) -> None:
            self.drain = True
            self.link: HttpLink | None = None

        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            link = self.link
            standalone = request.method == "GET" and "last-event-id" not in request.headers
            try:
                response = await inner.handle_async_request(request)
            finally:
                if standalone and link is not None and link.listening is not None:
                    link.listening.set()
            if link is not None:
                version = request.headers.get("mcp-protocol-version")
                if version is not None:
                    link.protocol_version = version
                session = response.headers.get("mcp-session-id")
                if session is not None:
                    link.session_id = session
            kind = response.headers.get("content-type", "")
            if self.drain and request.method == "POST" and kind.startswith("text/event-stream"):
                assert isinstance(response.stream, httpx2.AsyncByteStream)
                response.stream = DrainedAtClose(response.stream, self)
            return response

        async def aclose(self) -> None:
            await inner.aclose()

    return KeepAlive()


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise UsageError(f"cannot read the MCP config {path}: {error.strerror}") from None
    except ValueError as error:
        raise UsageError(f"the MCP config {path} is not JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers"), dict):
        raise UsageError(
            f'the MCP config {path} has no "mcpServers" object: write it as Claude Code\'s '
            'or Cursor\'s .mcp.json ({"mcpServers": {NAME: {"command": ..., "args": []}}})'
        )
    return data


def stdio_servers(config: dict[str, Any], where: str = "the MCP config") -> dict[str, ServerSpec]:
    # A server's name becomes a `--name` and a frame's `server`: keep it a plain word.
    """The stdio servers a config declares, checked."""
    out: dict[str, ServerSpec] = {}
    for name, entry in config["mcpServers"].items():
        if not name or not name.isprintable() or len(name) > 128 or name.startswith("-"):
            raise UsageError(f"{where}: bad server name {name!r}: use a printable word")
        if not isinstance(entry, dict):
            raise UsageError(f"{where}: server {name!r} must be an object")
        if "command" not in entry:
            continue  # an HTTP server (url): not gated here
        command, args, env = entry.get("command"), entry.get("args", []), entry.get("env", {})
        if not isinstance(command, str) or not command:
            raise UsageError(f'{where}: server {name!r} needs a "command" string')
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise UsageError(f'{where}: server {name!r}: "args" must be a list of strings')
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise UsageError(f'{where}: server {name!r}: "env" must map names to strings')
        out[name] = ServerSpec(name, command, tuple(args), dict(env))
    return out


def http_servers(config: dict[str, Any] | None, upstreams: dict[str, str] | None = None,
                 where: str = "the MCP config") -> dict[str, ServerSpec]:  # fmt: skip
    """The streamable-HTTP servers a config declares (`url`), and those of --mcp-upstream."""
    out: dict[str, ServerSpec] = {}
    entries = dict((config or {}).get("mcpServers") or {})
    for name, entry in entries.items():
        if isinstance(entry, dict) and "command" not in entry and "url" in entry:
            headers = entry.get("headers", {})
            if not isinstance(headers, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) for k, v in headers.items()
            ):
                raise UsageError(f'{where}: server {name!r}: "headers" must map names to strings')
            out[name] = ServerSpec(name, "", url=_check_url(entry["url"], f"{where}: {name!r}"),
                                   headers=dict(headers))  # fmt: skip
    for name, url in (upstreams or {}).items():
        if not name or not name.isprintable() or "/" in name or name.startswith("-"):
            raise UsageError(f"--mcp-upstream: bad server name {name!r}: use a printable word")
        if name in out or ("command" in entries.get(name, {})):
            raise UsageError(f"--mcp-upstream {name}: the MCP config declares {name!r} already")
        out[name] = ServerSpec(name, "", url=_check_url(url, f"--mcp-upstream {name}"))
    return out


def _check_url(url: object, where: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise UsageError(f"{where}: the server's url must be an http:// or https:// URL")
    return url


def wrapped_config(config: dict[str, Any], jukebox: str, extra: list[str] | None = None,
                   http: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The config with each stdio server reached through `jukebox mcp wrap`, and each HTTP
    server in `http` (NAME -> the gateway's URL) through the booth's HTTP gateway."""
    servers = dict(config["mcpServers"])
    for name, url in (http or {}).items():
        # Without the operator's headers: the gateway sends them upstream, the agent never
        # holds them.
        entry = {k: v for k, v in servers.get(name, {}).items() if k != "headers"}
        servers[name] = {**entry, "type": "http", "url": url}
    for name, spec in stdio_servers(config).items():
        entry = dict(servers[name])
        entry["command"] = jukebox
        entry["args"] = ["mcp", "wrap", "--name", name, *(extra or []), "--", *spec.argv]
        servers[name] = entry
    return {**config, "mcpServers": servers}


def write_wrapped_config(config: dict[str, Any], directory: str,
                         http: dict[str, str] | None = None,
                         policy: Any = None) -> str:  # fmt: skip
    """The rewritten config, in a private file the agent can read; its path. With `policy` (the
    booth's jukebox.mcp.policy.Policy), each wrapper reads it from a file beside the config."""
    import os
    import shutil
    import sys

    jukebox = shutil.which("jukebox") or os.path.join(os.path.dirname(sys.executable), "jukebox")
    extra: list[str] = []
    if policy is not None:
        tools: dict[str, str] = {}
        for rule in policy.rules:  # in order, the last of a pattern last: the last match wins
            tools.pop(rule.pattern, None)
            tools[rule.pattern] = rule.decision
        extra = ["--policy", _write_new(os.path.join(directory, "mcp-policy.json"),
                                        {"mode": policy.mode, "tools": tools})]  # fmt: skip
    return _write_new(os.path.join(directory, "mcp.json"),
                      wrapped_config(config, jukebox, extra, http=http))  # fmt: skip


def _write_new(path: str, data: Any) -> str:
    import os

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with open(fd, "w") as f:
        json.dump(data, f, indent=2)
    return path


def restored_env(server: str, described: dict[str, Any], environ: Any,
                 ask: Any = None) -> dict[str, str]:  # fmt: skip
    """A recorded stdio server's environment for a replay or fork: the caller's value of each
    variable it had, else the value on the tape (recorded for names that do not look secret);
    a value on neither (a secret, or one redacted) is asked for with `ask(server, name)` (a
    terminal) or left out, and said in one line: the server needs it only if the run goes past
    its recording."""
    import sys

    from jukebox.redact import REDACTED

    recorded = {k: v for k, v in (described.get("env_values") or {}).items()
                if isinstance(v, str) and REDACTED not in v}  # fmt: skip
    out: dict[str, str] = {}
    missing = []
    for key in described.get("env") or []:
        value = environ.get(key, recorded.get(key))
        if value is None and ask is not None:
            value = ask(server, key)
        if value is None:
            missing.append(key)
        else:
            out[key] = value
    if missing:
        sys.stderr.write(
            f"jukebox: the MCP server {server!r} ran with {', '.join(missing)} set; the tape "
            "keeps no such value: set it in the environment if the run goes past its "
            "recording\n"
        )
    return out


# A header's value for a replay or fork, from the environment: JUKEBOX_MCP_HEADER_<SERVER>_<NAME>.
# The booth keeps these variables from its agent (they are the operator's credentials).
HEADER_ENV_PREFIX = "JUKEBOX_MCP_HEADER_"


def header_env_name(server: str, header: str) -> str:
    """The variable a replay or fork reads `header`'s value of `server` from: the names upper
    case, anything but letters and digits as `_` (`notes`, `Authorization`:
    JUKEBOX_MCP_HEADER_NOTES_AUTHORIZATION)."""
    return HEADER_ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", f"{server}_{header}".upper())


def restored_headers(server: str, names: list[str], given: dict[str, Any] | None,
                     environ: Any, how: str) -> dict[str, str]:  # fmt: skip
    """A recorded HTTP server's headers for a replay or fork that may reach it: the tape names
    them (run_start's `headers`) and never holds a value, so each comes from `given` (that
    server's entry in the caller's --mcp-config) or the environment. A missing one is a
    UsageError naming it and both ways to give it; `how` names the command to run again."""
    from jukebox.display.names import printable

    entry = given or {}
    found = entry.get("headers")
    headers: dict[str, Any] = found if isinstance(found, dict) else {}
    by_name = {str(k).lower(): v for k, v in headers.items() if isinstance(v, str)}
    out: dict[str, str] = {}
    for name in names:
        value = by_name.get(name.lower(), environ.get(header_env_name(server, name)))
        if value is None:
            raise UsageError(printable(
                f"the MCP server {server!r} was sent the header {name!r}, whose value no tape "
                f"keeps: give it in {how} --mcp-config FILE (\"headers\" of {server!r}) or as "
                f"${header_env_name(server, name)}"
            ))  # fmt: skip
        out[name] = value
    return out
