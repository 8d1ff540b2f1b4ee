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
from typing import TYPE_CHECKING, Any

import mcp.types as types
from mcp.shared.exceptions import MCPError

from jukebox.errors import JukeboxError, UsageError
from jukebox.llm.replay import Divergence, json_diff

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

DIVERGED_CODE = -32002
Frame = tuple[int, str, dict[str, Any]]
LIST_METHODS = ("tools/list", "resources/list", "resources/templates/list", "prompts/list")


class GoLive(JukeboxError):
    """The recording of this server ends here and the run may go on live (a fork, or a replay
    with --until): the gateway forwards this request, and every later one, to the real server."""


def load_frames(tape: str | Path, tape_dir: str | Path | None) -> tuple[Path, list[Frame]]:
    """The tool_call and note frames of a tape (payloads resolved), checked."""
    from jukebox.tape.tape import Tape
    from jukebox.tape.tapedir import TapeRef
    from shadowfs.store import Store

    ref = TapeRef.parse(str(tape), tape_dir)
    with Store.open(ref.tape_dir.store_path) as store:
        loaded = Tape.load(ref.path, store)
        loaded.check_chain()
        return ref.path, mcp_frames(loaded, store)


def mcp_frames(tape: Any, store: ObjectReader, until: int | None = None) -> list[Frame]:
    """(seq, kind, payload) of a loaded tape's MCP frames, through frame `until`."""
    return [(f.seq, f.kind, f.resolve_payload(store)) for f in tape.intact_frames
            if f.kind in ("tool_call", "note") and (until is None or f.seq <= until)]  # fmt: skip


def server_names(frames: list[Frame]) -> list[str]:
    return sorted({str(p.get("server")) for _, kind, p in frames
                   if kind == "note" and p.get("event") == "mcp_server"})  # fmt: skip


class RecordedServer:
    """One server's recorded traffic on a tape, and the replay's position in it."""

    def __init__(self, server: str, frames: list[Frame], path: str | Path,
                 on_divergence: Callable[[Divergence], None],
                 scrub: Callable[[Any], Any] = lambda value: value,
                 live_after: bool = False) -> None:  # fmt: skip
        self.path = Path(path)
        self.server = server
        mine = [(seq, kind, p) for seq, kind, p in frames if p.get("server") == self.server]
        self.init = next((p["initialize"] for _, kind, p in mine
                          if p.get("event") == "mcp_server"), None)  # fmt: skip
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
        # Past the end of the recording: GoLive (a fork, --until) or a divergence.
        self.live_after = live_after
        self.replayed_from: int | None = None
        # The frame the last call was served from, as recorded (decision, why, staged_id).
        self.served: dict[str, Any] | None = None

    @classmethod
    def load(cls, tape: str | Path, tape_dir: str | Path | None, server: str | None,
             on_divergence: Callable[[Divergence], None],
             scrub: Callable[[Any], Any] = lambda value: value) -> RecordedServer:  # fmt: skip
        """The server `server` (None: the only one) of the tape `tape`."""
        path, frames = load_frames(tape, tape_dir)
        names = server_names(frames)
        if server is None:
            if len(names) != 1:
                raise UsageError(
                    f"the tape {path} records {len(names)} MCP servers "
                    f"({', '.join(names) or 'none'}): name one with --name"
                )
            server = names[0]
        elif server not in names:
            raise UsageError(f"the tape {path} records no MCP server named {server!r}")
        return cls(server, frames, path, on_divergence, scrub)

    def remaining(self) -> int:
        return len(self.calls) - self.position

    def initialize_result(self) -> types.InitializeResult:
        if self.init is None:
            raise MCPError(DIVERGED_CODE, (
                f"jukebox replay: the tape holds no session with the MCP server {self.server!r}"
            ))  # fmt: skip
        return types.InitializeResult.model_validate(self.init)

    def _answer(self, table: dict[str, list[Any]], key: str, what: str) -> Any:
        answers = table.get(key)
        if not answers:
            if self.live_after:
                raise GoLive(what)
            raise MCPError(DIVERGED_CODE, f"jukebox replay: the tape holds no answer to {what}")
        n = self.taken.get(key, 0)
        self.taken[key] = n + 1
        return answers[min(n, len(answers) - 1)]

    def respond(self, method: str, params: dict[str, Any]) -> Any:
        """The recorded answer (as on the wire) to a request other than a tool call."""
        if method in LIST_METHODS:
            return self._answer(self.lists, method, method)
        if method == "resources/read":
            uri = str(params.get("uri"))
            return self._answer(self.reads, uri, f"resources/read {uri}")
        if method == "prompts/get":
            name = str(params.get("name"))
            return self._answer(self.reads, f"prompt:{name}", f"prompts/get {name}")
        if method == "initialize":
            return self.initialize_result().model_dump(by_alias=True, mode="json",
                                                       exclude_none=True)  # fmt: skip
        raise MCPError(types.METHOD_NOT_FOUND, f"jukebox replay: cannot answer {method}")

    # -- what the gateway asks of its upstream -------------------------------------------------

    async def list_tools(self, params: Any = None) -> types.ListToolsResult:
        return types.ListToolsResult.model_validate(self.respond("tools/list", {}))

    async def list_resources(self, params: Any = None) -> types.ListResourcesResult:
        return types.ListResourcesResult.model_validate(self.respond("resources/list", {}))

    async def list_resource_templates(self, params: Any = None) -> Any:
        answer = self.respond("resources/templates/list", {})
        return types.ListResourceTemplatesResult.model_validate(answer)

    async def list_prompts(self, params: Any = None) -> types.ListPromptsResult:
        return types.ListPromptsResult.model_validate(self.respond("prompts/list", {}))

    async def read_resource(self, uri: str) -> types.ReadResourceResult:
        return types.ReadResourceResult.model_validate(self.respond("resources/read", {"uri": uri}))

    async def get_prompt(self, name: str, arguments: Any = None) -> types.GetPromptResult:
        return types.GetPromptResult.model_validate(self.respond("prompts/get", {"name": name}))

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        return types.CallToolResult.model_validate(self.take_call(name, arguments))

    def take_call(self, name: str, arguments: dict[str, Any] | None) -> Any:
        """The recorded result (as on the wire) of the next tool call, which must be this one;
        MCPError for a recorded error or a divergence, GoLive past the end with `live_after`."""
        got = {"tool": name, "args": self.scrub(arguments or {})}
        if self.divergence is not None:
            raise MCPError(DIVERGED_CODE, f"jukebox: {self.divergence.message()}")
        endpoint = f"tools/call {name}"
        if self.position >= len(self.calls):
            if self.live_after:
                raise GoLive(endpoint)
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
        self.served = recorded
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
        return result

    def _diverge(self, divergence: Divergence) -> None:
        self.divergence = divergence
        self.on_divergence(divergence)
        raise MCPError(DIVERGED_CODE, f"jukebox: {divergence.message()}")
