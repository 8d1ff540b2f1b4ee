"""The gateway's upstream inside the booth of a replay or fork (`$JUKEBOX_MCP_REPLAY` set): the
supervisor answers every request from the original tape (jukebox.mcp.booth_replay), and no
server starts, until the supervisor says the recording of this server has ended (a fork past
its frame, a replay past `--until`). From then on the real server is started once and every
request goes to it, through the booth's policy as in any booth.

The live session runs in a task of its own (the SDK's stdio client is a task group, which must
be left by the task that entered it); requests wait for it to be ready.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import anyio
import mcp.types as types
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from jukebox.mcp.record import REPLAY_ENV
from jukebox.redact import Scrubber

__all__ = ["REPLAY_ENV", "BoothReplayUpstream"]


class BoothReplayUpstream:
    def __init__(self, server: str, argv: list[str], scrubber: Scrubber,
                 start_timeout: float, socket_path: str | None = None,
                 ask: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 connect: Callable[[], Any] | None = None) -> None:  # fmt: skip
        # ask(request): the supervisor's answer, asked directly by a gateway that runs in the
        # supervisor (the streamable-HTTP one); connect(): its live transport (read, write, ...).
        self.ask = ask
        self.connect = connect
        self.server = server
        self.argv = argv
        self.scrubber = scrubber
        self.start_timeout = start_timeout
        self.socket_path = socket_path
        self.live: ClientSession | None = None
        self.live_error: str | None = None
        self.going_live = False
        self.live_started = False
        self._ready = anyio.Event()
        self._done = anyio.Event()
        self._tasks: Any = None  # the serving task group, where the live session runs
        self.replayed_from: int | None = None

    async def _ask(self, method: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """The supervisor's answer; None once the recording has ended (live)."""
        from jukebox.booth import control

        if self.going_live:
            return None
        request = {"op": "mcp_replay", "server": self.server, "method": method,
                   "params": params}  # fmt: skip
        try:
            if self.ask is not None:
                answer = self.ask(request)
            else:
                answer = await anyio.to_thread.run_sync(control.request, request, self.socket_path)
        except (control.ControlError, control.RequestError) as error:
            raise MCPError(types.INTERNAL_ERROR, f"jukebox replay: {error}") from None
        if answer.get("live"):
            self.going_live = True
            return None
        return answer

    async def initialize_result(self) -> types.InitializeResult | None:
        answer = await self._ask("initialize", {})
        if answer is None:
            return None
        if "error" in answer:
            raise MCPError(int(answer["error"]["code"]), str(answer["error"]["message"]))
        return types.InitializeResult.model_validate(answer["result"])

    async def recorded_call(self, tool: str, args: dict[str, Any]) -> dict[str, Any] | None:
        from jukebox.mcp.record import scrub

        # The tape holds arguments with known secrets redacted: compare them the same way.
        clean = scrub({"a": args}, self.scrubber)["a"]
        return await self._ask("tools/call", {"name": tool, "arguments": clean})

    # -- the live session, past the recording ----------------------------------------------------

    def attach(self, tasks: Any) -> None:
        self._tasks = tasks

    def close(self) -> None:
        self._done.set()

    async def _session(self) -> ClientSession:
        if self.live is None and self.live_error is None:
            if self._tasks is not None and not self.live_started:
                self.live_started = True
                self._tasks.start_soon(self._run_live)
            await self._ready.wait()
        if self.live is None:
            raise MCPError(types.INTERNAL_ERROR, f"jukebox: {self.live_error}")
        return self.live

    async def _run_live(self) -> None:
        if self.connect is not None:
            transport = self.connect()
        else:
            params = StdioServerParameters(command=self.argv[0], args=self.argv[1:],
                                           env=dict(os.environ))  # fmt: skip
            transport = stdio_client(params, errlog=sys.stderr)
        try:
            async with transport as (read, write, *_), ClientSession(read, write) as session:
                with anyio.fail_after(self.start_timeout):
                    await session.initialize()
                self.live = session
                self._ready.set()
                await self._done.wait()
        except Exception as error:  # a server that does not start: each request says why
            self.live_error = (
                f"the MCP server {self.server!r} ({self.argv[0] if self.argv else '?'}) could not "
                f"start past the recording: {type(error).__name__}: {error}"
            )
        finally:
            self.live = None
            self._ready.set()

    # -- what the gateway asks of its upstream ---------------------------------------------------

    async def _answer(self, method: str, params: dict[str, Any], model: Any) -> Any:
        answer = await self._ask(method, params)
        if answer is None:
            return None
        if "error" in answer:
            raise MCPError(int(answer["error"]["code"]), str(answer["error"]["message"]))
        return model.model_validate(answer["result"])

    async def list_tools(self, params: Any = None) -> Any:
        return await self._answer("tools/list", {}, types.ListToolsResult) or await (
            await self._session()
        ).list_tools(params=params)

    async def list_resources(self, params: Any = None) -> Any:
        return await self._answer("resources/list", {}, types.ListResourcesResult) or await (
            await self._session()
        ).list_resources(params=params)

    async def list_resource_templates(self, params: Any = None) -> Any:
        return await self._answer(
            "resources/templates/list", {}, types.ListResourceTemplatesResult
        ) or await (await self._session()).list_resource_templates(params=params)

    async def list_prompts(self, params: Any = None) -> Any:
        return await self._answer("prompts/list", {}, types.ListPromptsResult) or await (
            await self._session()
        ).list_prompts(params=params)

    async def read_resource(self, uri: str) -> Any:
        return await self._answer(
            "resources/read", {"uri": uri}, types.ReadResourceResult
        ) or await (await self._session()).read_resource(uri)

    async def get_prompt(self, name: str, arguments: Any = None) -> Any:
        return await self._answer("prompts/get", {"name": name}, types.GetPromptResult) or await (
            await self._session()
        ).get_prompt(name, arguments)

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        # Only past the recording: the gateway asked recorded_call first.
        return await (await self._session()).call_tool(name, arguments)
