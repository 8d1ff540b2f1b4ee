"""Serving a server's recorded answers back, offline: `jukebox mcp wrap --replay TAPE`.

Stands in for the `ClientSession` the gateway (jukebox.mcp.gateway) talks to: no server is
started. Initialize, lists, resource reads and prompts are answered from the tape's notes (for a
list or a read asked more often than recorded, the last recorded answer); tool calls are taken in
the order they were recorded, and a call whose tool or arguments differ from the next recorded
one, or one past the end of the recording, is a divergence, reported as a model divergence is
(jukebox.llm.replay.Divergence): a `divergence` note on the replay's tape, an error to the agent,
exit status 1. After a divergence every later call fails too: the tape no longer describes the
run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mcp.types as types
from mcp.shared.exceptions import MCPError

from jukebox.errors import UsageError
from jukebox.llm.replay import Divergence, json_diff

DIVERGED_CODE = -32002


class RecordedServer:
    """One server's recorded traffic on a tape, and the replay's position in it."""

    def __init__(self, tape: str | Path, tape_dir: str | Path | None, server: str | None,
                 on_divergence: Callable[[Divergence], None],
                 scrub: Callable[[Any], Any] = lambda value: value) -> None:  # fmt: skip
        from jukebox.tape import Tape
        from jukebox.tapedir import TapeRef
        from shadowfs.store import Store

        ref = TapeRef.parse(str(tape), tape_dir)
        self.path = ref.path
        with Store.open(ref.tape_dir.store_path) as store:
            loaded = Tape.load(self.path, store)
            loaded.check_chain()
            frames = [(f.seq, f.kind, f.resolve_payload(store)) for f in loaded.intact_frames
                      if f.kind in ("tool_call", "note")]  # fmt: skip
        names = {p.get("server") for _, kind, p in frames
                 if kind == "note" and p.get("event") == "mcp_server"}  # fmt: skip
        if server is None:
            if len(names) != 1:
                raise UsageError(
                    f"the tape {self.path} records {len(names)} MCP servers "
                    f"({', '.join(sorted(map(str, names))) or 'none'}): name one with --name"
                )
            server = next(iter(names))
        elif server not in names:
            raise UsageError(f"the tape {self.path} records no MCP server named {server!r}")
        self.server = str(server)
        mine = [(seq, kind, p) for seq, kind, p in frames if p.get("server") == self.server]
        self.init = next(p["initialize"] for _, kind, p in mine if p.get("event") == "mcp_server")
        self.lists: dict[str, list[Any]] = {}
        self.reads: dict[str, list[Any]] = {}
        self.calls: list[tuple[int, dict[str, Any]]] = []
        for seq, kind, p in mine:
            if kind == "note" and p.get("event") == "mcp_list":
                self.lists.setdefault(p["what"], []).append(p["result"])
            elif kind == "note" and p.get("event") in ("mcp_read", "mcp_prompt"):
                key = p.get("uri") or f"prompt:{p.get('prompt')}"
                self.reads.setdefault(key, []).append(p["result"])
            elif kind == "tool_call" and p.get("decision") != "commit":
                self.calls.append((seq, p))
        self.position = 0
        self.taken: dict[str, int] = {}
        self.divergence: Divergence | None = None
        self.on_divergence = on_divergence
        # The tape holds arguments with known secrets redacted: compare the same way.
        self.scrub = scrub
        self.replayed_from: int | None = None

    def initialize_result(self) -> types.InitializeResult:
        return types.InitializeResult.model_validate(self.init)

    def _answer(self, table: dict[str, list[Any]], key: str, model: Any, what: str) -> Any:
        answers = table.get(key)
        if not answers:
            raise MCPError(DIVERGED_CODE, f"jukebox replay: the tape holds no answer to {what}")
        n = self.taken.get(key, 0)
        self.taken[key] = n + 1
        return model.model_validate(answers[min(n, len(answers) - 1)])

    # -- what the gateway asks of its upstream -------------------------------------------------

    async def list_tools(self, params: Any = None) -> types.ListToolsResult:
        return self._answer(self.lists, "tools/list", types.ListToolsResult, "tools/list")

    async def list_resources(self, params: Any = None) -> types.ListResourcesResult:
        return self._answer(self.lists, "resources/list", types.ListResourcesResult,
                            "resources/list")  # fmt: skip

    async def list_resource_templates(self, params: Any = None) -> Any:
        what = "resources/templates/list"
        return self._answer(self.lists, what, types.ListResourceTemplatesResult, what)

    async def list_prompts(self, params: Any = None) -> types.ListPromptsResult:
        return self._answer(self.lists, "prompts/list", types.ListPromptsResult, "prompts/list")

    async def read_resource(self, uri: str) -> types.ReadResourceResult:
        return self._answer(self.reads, uri, types.ReadResourceResult, f"resources/read {uri}")

    async def get_prompt(self, name: str, arguments: Any = None) -> types.GetPromptResult:
        return self._answer(self.reads, f"prompt:{name}", types.GetPromptResult,
                            f"prompts/get {name}")  # fmt: skip

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        got = {"tool": name, "args": self.scrub(arguments or {})}
        if self.divergence is not None:
            raise MCPError(DIVERGED_CODE, f"jukebox: {self.divergence.message()}")
        endpoint = f"tools/call {name}"
        if self.position >= len(self.calls):
            self._diverge(Divergence("beyond_recording", f"mcp:{self.server}", endpoint, None,
                                     None, got, [], self.position))  # fmt: skip
        seq, recorded = self.calls[self.position]
        expected = {"tool": recorded["tool"], "args": recorded.get("args") or {}}
        if expected != got:
            diff = json_diff(expected, got)
            self._diverge(Divergence("request_mismatch", f"mcp:{self.server}", endpoint, seq,
                                     expected, got, diff, self.position))  # fmt: skip
        self.position += 1
        self.replayed_from = seq
        if "result" not in recorded:
            error = recorded.get("error") or {}
            raise MCPError(int(error.get("code", types.INTERNAL_ERROR)),
                           str(error.get("message", "recorded error")))  # fmt: skip
        result = recorded["result"]
        if isinstance(result, dict) and result.get("truncated"):
            raise MCPError(DIVERGED_CODE, (
                f"jukebox replay: frame {seq} recorded only the size of this result "
                f"({result.get('bytes')} bytes), not the result"
            ))  # fmt: skip
        return types.CallToolResult.model_validate(result)

    def _diverge(self, divergence: Divergence) -> None:
        self.divergence = divergence
        self.on_divergence(divergence)
        raise MCPError(DIVERGED_CODE, f"jukebox: {divergence.message()}")
