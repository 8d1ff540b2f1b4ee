"""Tool calls in a Python API transaction (`jukebox.api.transaction`): `await tx.tool(session, name,
args)` over an `mcp.ClientSession` under the transaction's `mcp_mode`, and
`tx.stage_tool_call(tool, args, run)` for tools that are not MCP.

The same rules as the booth's stage gate (docs/mcp.md): a read-only MCP tool (its own
`readOnlyHint`) runs at once; any other is staged under `mcp_mode="staged_acid"` and refused under
`"deny"`. A staged call runs only at the commit, after the files, in the order staged; the first
failure stops the rest. `rollback_to` drops the calls staged after that checkpoint; `rollback`
drops all. Calls whose runner is a coroutine function (every MCP call) need `await tx.commit()`:
the commit's awaiting runs them.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from jukebox.mcp.policy import Policy
from jukebox.mcp.record import wire
from jukebox.mcp.relay import ms_since

Append = Callable[..., Any]  # (kind, payload) -> Frame


@dataclass
class _Staged:
    id: str
    tool: str
    server: str | None
    args: dict[str, Any]
    run: Callable[[], Any]
    after_checkpoint: int
    # Run if a call staged after this one fails at the commit, once this one has run.
    compensate: Callable[[], Any] | None = None
    compensate_tool: str | None = None
    compensate_args: dict[str, Any] | None = None


class ToolStage:
    def __init__(self, append: Append, mode: str) -> None:
        self.append = append
        self.policy = Policy(mode)
        self.calls: list[_Staged] = []
        self.report: dict[str, Any] | None = None
        self._next = 1
        self._annotations: dict[int, dict[str, Any]] = {}

    def _frame(self, call: _Staged, **fields: Any) -> dict[str, Any]:
        frame: dict[str, Any] = {"tool": call.tool, "args": call.args, "staged_id": call.id}
        if call.server is not None:
            frame["server"] = call.server
        return {**frame, **fields}

    def stage(self, tool: str, args: dict[str, Any], run: Callable[[], Any], server: str | None,
              after_checkpoint: int, why: str = "stage_tool_call",
              compensate: Callable[[], Any] | None = None,
              compensate_tool: str | None = None,
              compensate_args: dict[str, Any] | None = None) -> str:  # fmt: skip
        call = _Staged(f"stage-{self._next}", tool, server, args, run, after_checkpoint,
                       compensate, compensate_tool, compensate_args)  # fmt: skip
        self._next += 1
        self.calls.append(call)
        self.append("tool_call", self._frame(call, decision="stage", why=why, ok=True,
                                             result={"staged": True}))  # fmt: skip
        return call.id

    def drop_after(self, checkpoint: int) -> None:
        dropped = [c.id for c in self.calls if c.after_checkpoint >= checkpoint]
        self.calls = [c for c in self.calls if c.after_checkpoint < checkpoint]
        if dropped:
            self.append("note", {"event": "mcp_dropped", "ids": dropped,
                                 "reason": f"rollback to checkpoint {checkpoint}"})  # fmt: skip

    def drop_all(self, reason: str) -> None:
        if self.calls:
            self.append("note", {"event": "mcp_dropped", "ids": [c.id for c in self.calls],
                                 "reason": reason})  # fmt: skip
            self.calls = []

    # -- MCP --------------------------------------------------------------------------------------

    async def tool(self, session: Any, name: str, args: dict[str, Any], server: str | None,
                   after_checkpoint: int, rules: Any = None, ask: Any = None,
                   compensate: tuple[str, dict[str, Any]] | None = None) -> Any:  # fmt: skip
        import mcp.types as types

        known = self._annotations.get(id(session))
        if known is None or name not in known:
            listing = await session.list_tools()
            known = {t.name: (wire(t.annotations) if t.annotations is not None else None)
                     for t in listing.tools}  # fmt: skip
            self._annotations[id(session)] = known
        policy = self.policy
        if rules:
            from jukebox.mcp.policy import Policy, build_policy

            policy = Policy(self.policy.mode, build_policy(
                None, flags=[(d, p) for p, d in rules.items()]).rules)  # fmt: skip
        decision = policy.decide(server or "", name, known.get(name))
        base: dict[str, Any] = {"tool": name, "args": args, **decision.as_dict()}
        if server is not None:
            base["server"] = server
        if decision.decision == "ask" and ask is not None:
            # The operator here is the caller's function: ask(server, tool, args) -> bool.
            answer = ask(server, name, args)
            if inspect.isawaitable(answer):
                answer = await answer
            approved = bool(answer)
            self.append("note", {"event": "mcp_answer", "server": server, "tool": name,
                                 "answer": "approve" if approved else "deny",
                                 "by": "ask="})  # fmt: skip
            from jukebox.mcp.policy import Decision

            decision = Decision("allow" if approved else "deny", "ask: the operator " + (
                "approved" if approved else "refused"))  # fmt: skip
            base.update(decision.as_dict())
        if decision.decision in ("deny", "ask"):
            text = (f"jukebox refused this call of {name!r} ({decision.why}; the transaction's "
                    "mcp_mode); it did not run.")  # fmt: skip
            result = types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                          is_error=True)  # fmt: skip
            self.append("tool_call", {**base, "decision": "deny", "result": wire(result),
                                      "ok": False})  # fmt: skip
            return result
        if decision.decision == "stage":
            undo = None
            if compensate is not None:
                undo_call = (compensate[0], dict(compensate[1]))

                def undo() -> Any:
                    return session.call_tool(*undo_call)

            undo_tool, undo_args = compensate if compensate is not None else (None, None)
            staged = self.stage(name, args, lambda: session.call_tool(name, args), server,
                                after_checkpoint, why=decision.why, compensate=undo,
                                compensate_tool=undo_tool, compensate_args=undo_args)  # fmt: skip
            text = (f"jukebox staged this call as {staged}: it has not run. It runs only if the "
                    "transaction commits, in the order it was staged.")  # fmt: skip
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=text)],
                structured_content={"jukebox": {"staged": True, "id": staged}},
            )
        started = time.perf_counter()
        result = await session.call_tool(name, args)
        self.append("tool_call", {**base, "result": wire(result),
                                  "ok": not getattr(result, "is_error", False),
                                  "latency_ms": ms_since(started)})  # fmt: skip
        return result

    # -- the commit -----------------------------------------------------------------------------

    def after_commit(self) -> Coroutine[Any, Any, dict[str, Any]] | None:
        """Runs the staged calls in order. Runners that return plain values run here; at the
        first that returns an awaitable, the rest is a coroutine for the caller to await.
        Returns None when everything ran (or nothing was staged)."""
        if not self.calls:
            return None
        report: dict[str, Any] = {"event": "mcp_commit", "ran": [], "failed": None, "not_run": []}
        self.report = report
        calls, self.calls = self.calls, []
        for i, call in enumerate(calls):
            started = time.perf_counter()
            try:
                value = call.run()
            except Exception as error:
                self._failed(calls, i, report, f"{type(error).__name__}: {error}", started)
                return None
            if inspect.isawaitable(value):
                return self._finish_async(calls, i, value, report)
            self._ran(call, value, report, started)
        self.append("note", report)
        return None

    async def _finish_async(self, calls: list[_Staged], i: int, first: Any,
                            report: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        for j in range(i, len(calls)):
            call, started = calls[j], time.perf_counter()
            try:
                value = first if j == i else call.run()
                if inspect.isawaitable(value):
                    value = await value
            except Exception as error:
                await self._failed_async(calls, j, report, f"{type(error).__name__}: {error}",
                                         started)  # fmt: skip
                return report
            if getattr(value, "is_error", False):
                await self._failed_async(calls, j, report, "the tool reported an error", started,
                                         value)  # fmt: skip
                return report
            self._ran(call, value, report, started)
        self.append("note", report)
        return report

    def _ran(self, call: _Staged, value: Any, report: dict[str, Any], started: float) -> None:
        frame = self._frame(call, decision="commit", ok=True, result=_jsonable(value),
                            latency_ms=ms_since(started))  # fmt: skip
        self.append("tool_call", frame)
        report["ran"].append(call.id)

    def _failed(self, calls: list[_Staged], i: int, report: dict[str, Any], error: str,
                started: float, value: Any = None) -> None:  # fmt: skip
        self._fail_frame(calls, i, report, error, started, value)
        for call in self._to_compensate(calls, i, report):
            begun = time.perf_counter()
            try:
                undone = call.compensate() if call.compensate is not None else None
                if inspect.isawaitable(undone):
                    close = getattr(undone, "close", None)
                    if close is not None:
                        close()
                    raise RuntimeError("a coroutine compensation needs `await tx.commit()`")
            except Exception as exc:
                self._compensated(call, report, None, f"{type(exc).__name__}: {exc}", begun)
                continue
            self._compensated(call, report, undone, None, begun)
        self.append("note", report)

    async def _failed_async(self, calls: list[_Staged], i: int, report: dict[str, Any],
                            error: str, started: float, value: Any = None) -> None:  # fmt: skip
        self._fail_frame(calls, i, report, error, started, value)
        for call in self._to_compensate(calls, i, report):
            begun = time.perf_counter()
            try:
                undone = call.compensate() if call.compensate is not None else None
                if inspect.isawaitable(undone):
                    undone = await undone
            except Exception as exc:
                self._compensated(call, report, None, f"{type(exc).__name__}: {exc}", begun)
                continue
            failed = "the tool reported an error" if getattr(undone, "is_error", False) else None
            self._compensated(call, report, undone, failed, begun)
        self.append("note", report)

    def _fail_frame(self, calls: list[_Staged], i: int, report: dict[str, Any], error: str,
                    started: float, value: Any) -> None:  # fmt: skip
        fields: dict[str, Any] = {"decision": "commit", "ok": False, "error": {"message": error},
                                  "latency_ms": ms_since(started)}  # fmt: skip
        if value is not None:
            fields["result"] = _jsonable(value)
        self.append("tool_call", self._frame(calls[i], **fields))
        report.update(failed=calls[i].id, error=error, not_run=[c.id for c in calls[i + 1 :]])

    @staticmethod
    def _to_compensate(calls: list[_Staged], i: int, report: dict[str, Any]) -> list[_Staged]:
        """The calls that ran before the failed one and declared a compensation, newest first."""
        ran = set(report["ran"])
        chosen = [c for c in reversed(calls[:i]) if c.id in ran and c.compensate is not None]
        if chosen:
            report.update(compensated=[], compensation_failed=[])
        return chosen

    def _compensated(self, call: _Staged, report: dict[str, Any], value: Any, error: str | None,
                     started: float) -> None:  # fmt: skip
        frame: dict[str, Any] = {"tool": call.compensate_tool or call.tool,
                                 "args": call.compensate_args or {},
                                 "staged_id": call.id, "decision": "compensate",
                                 "ok": error is None, "latency_ms": ms_since(started)}  # fmt: skip
        if call.server is not None:
            frame["server"] = call.server
        if value is not None:
            frame["result"] = _jsonable(value)
        if error is not None:
            frame["error"] = {"message": error}
        self.append("tool_call", frame)
        report["compensated" if error is None else "compensation_failed"].append(call.id)


def _jsonable(value: Any) -> Any:
    import json

    value = wire(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)[:2000]
    return value

