"""The supervisor's side of a replay or fork of a booth's tool calls (`jukebox replay --exec`,
`jukebox fork`): the MCP answers recorded on the original tape, served to the gateways inside
the new booth.

A gateway in such a booth (`$JUKEBOX_MCP_REPLAY` set; jukebox.mcp.booth_upstream) starts no
server: it asks the supervisor for every answer over the control socket (`mcp_replay`). Each
server's tool calls are taken in their recorded order (jukebox.mcp.replay.RecordedServer); a call
whose tool or arguments differ from the recorded one is a divergence: a `divergence` note on the
new tape, the agent stopped, the replay's report names the frame (as for a model call).

Past the end of a server's recording a replay diverges (`beyond_recording`), while a fork (or a
replay `--until N`) answers `live`: from then on that gateway starts the real server and the
booth's own policy applies again. A fork may override the result of the tool call at its frame.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jukebox.booth.control import RequestError
from jukebox.errors import UsageError
from jukebox.mcp.replay import Frame, GoLive, RecordedServer, mcp_frames, server_names

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

METHODS = ("initialize", "tools/call", "tools/list", "resources/list",
           "resources/templates/list", "prompts/list", "resources/read", "prompts/get")  # fmt: skip


class ToolReplay:
    def __init__(self, frames: list[Frame], path: Path, live_after: bool,
                 override: tuple[int, dict[str, Any]] | None = None) -> None:  # fmt: skip
        self.path = path
        self.live_after = live_after
        # (frame, result as on the wire): the fork's new result for the call at that frame.
        self.override = override
        # record(kind, payload) appends to the new tape; on_divergence stops the agent. Set by
        # the booth and the replay's watch before the agent starts.
        self.record: Callable[[str, dict[str, Any]], Any] | None = None
        self.on_divergence: Callable[[Any], None] | None = None
        self.servers = {
            name: RecordedServer(name, frames, path, self._diverged, live_after=live_after)
            for name in server_names(frames)
        }  # fmt: skip
        self.served = 0
        self._lock = threading.Lock()

    @classmethod
    def from_tape(cls, tape: Any, store: ObjectReader, until: int | None = None,
                  override: tuple[int, dict[str, Any]] | None = None) -> ToolReplay:  # fmt: skip
        """The MCP traffic of `tape` through frame `until` (None: all of it; past it: live),
        and through the overridden frame."""
        through = override[0] if override is not None else until
        return cls(mcp_frames(tape, store, through), Path(tape.path), until is not None, override)

    def remaining(self) -> int:
        """Recorded tool calls nobody asked for (a replay that ends early made fewer)."""
        return sum(s.remaining() for s in self.servers.values())

    def _diverged(self, divergence: Any) -> None:
        if self.record is not None:
            self.record("note", divergence.to_payload())
        if self.on_divergence is not None:
            self.on_divergence(divergence)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """A gateway's `mcp_replay` request: {"result": ...} (with the recorded frame for a tool
        call), {"error": {...}}, or {"live": true}."""
        from mcp.shared.exceptions import MCPError

        server, method, params = request.get("server"), request.get("method"), request.get("params")
        if not isinstance(server, str) or method not in METHODS or not isinstance(params, dict):
            raise RequestError(
                f"mcp_replay needs 'server', 'method' (one of {', '.join(METHODS)}) and 'params'"
            )
        with self._lock:
            recorded = self.servers.get(server)
            if recorded is None:
                if self.live_after:
                    return {"live": True}
                raise RequestError(
                    f"the tape {self.path} holds no session with the MCP server {server!r}: "
                    "a replay never starts a server"
                )
            try:
                if method != "tools/call":
                    return {"result": recorded.respond(method, params)}
                name, args = params.get("name"), params.get("arguments") or {}
                if not isinstance(name, str) or not isinstance(args, dict):
                    raise RequestError("tools/call needs a 'name' and 'arguments' object")
                try:
                    result = recorded.take_call(name, args)
                finally:
                    seq = recorded.replayed_from
                self.served += 1
                frame = recorded.served or {}
                answer = {"frame": seq, "decision": frame.get("decision"), "why": frame.get("why")}
                if self.override is not None and seq == self.override[0]:
                    return {**answer, "result": self.override[1], "overridden": True}
                return {**answer, "result": result}
            except GoLive:
                return {"live": True}
            except MCPError as error:
                out: dict[str, Any] = {"error": {"code": error.code, "message": error.message}}
                if method == "tools/call" and recorded.divergence is None:
                    out["frame"] = recorded.replayed_from
                return out


def tool_result_override(
    tape: Any, store: ObjectReader, at: int, value: str
) -> tuple[int, dict[str, Any]]:
    """`fork --tool-result VALUE` for the tool call at frame `at`: VALUE is a JSON object with
    `content` (an MCP tool result as on the wire), other JSON, or text (`@FILE`: read from FILE);
    anything but a result object becomes one text block."""
    import json

    import mcp.types as types

    frame = tape.frames[at] if 0 <= at < len(tape.frames) else None
    payload = frame.resolve_payload(store) if frame is not None else {}
    if frame is None or frame.kind != "tool_call" or payload.get("decision") == "commit":
        raise UsageError(
            f"--tool-result overrides the tool call at --at {at}, but frame {at} is "
            f"{'a ' + frame.kind + ' frame' if frame is not None else 'not on the tape'}: "
            "fork at a tool_call frame (`jukebox log TAPE` lists them)"
        )
    if value.startswith("@"):
        try:
            value = Path(value[1:]).read_text()
        except OSError as error:
            raise UsageError(f"cannot read --tool-result {value}: {error.strerror}") from None
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    if isinstance(parsed, dict) and ("content" in parsed or "structuredContent" in parsed):
        try:
            result = types.CallToolResult.model_validate({"content": [], **parsed})
        except ValueError as error:
            first = str(error).splitlines()[0]
            raise UsageError(f"--tool-result is not an MCP tool result: {first}") from None
    else:
        text = parsed if isinstance(parsed, str) else json.dumps(parsed)
        result = types.CallToolResult(content=[types.TextContent(type="text", text=text)])
    return at, result.model_dump(by_alias=True, mode="json", exclude_none=True)
