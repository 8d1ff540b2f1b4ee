"""The stage gate at a booth's verdict: staged calls run after a commit, dropped at a discard,
kept in the record of a pending booth (jukebox.booth.supervisor calls these; jukebox.mcp.staging
does the work)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from jukebox.mcp.servers import ServerSpec
from jukebox.mcp.staging import StagedCall, calls_up_to, run_staged

Append = Callable[[str, dict[str, Any]], Any]


def keep(record: Any, servers: dict[str, ServerSpec], calls: list[StagedCall]) -> None:
    """A pending booth's record carries its staged calls and the servers they go to (sealed)."""
    record.mcp_staged = [c.to_json() for c in calls] or None
    record.mcp_servers = {n: s.to_json() for n, s in servers.items()} if calls else None


def from_record(record: Any) -> tuple[dict[str, ServerSpec], list[StagedCall]]:
    servers = {n: ServerSpec.from_json(s) for n, s in (record.mcp_servers or {}).items()}
    return servers, [StagedCall.from_json(c) for c in record.mcp_staged or []]


def commit_staged(
    calls: list[StagedCall], servers: dict[str, ServerSpec], append: Append, tree: str,
    booth_id: str, checkpoint: int | None = None,
) -> int:  # fmt: skip
    """Runs the staged calls (those before `checkpoint`, if given) after the files were
    committed; says which ran. Returns 0, or 1 when one failed."""
    from jukebox.display.progress import note

    chosen = calls_up_to(calls, checkpoint)
    if len(chosen) < len(calls):
        dropped = [c.id for c in calls if c not in chosen]
        append("note", {"event": "mcp_dropped", "ids": dropped,
                        "reason": f"staged after checkpoint {checkpoint}"})  # fmt: skip
    if not chosen:
        return 0
    report = run_staged(chosen, servers, _scrubbed(append, servers), tree, dict(os.environ))
    ran = ", ".join(report["ran"]) or "none"
    if report["failed"] is None:
        note(f"ran {len(report['ran'])} staged MCP call(s) of booth {booth_id}: {ran}")
        return 0
    compensated = ""
    if "compensated" in report:
        failed = ", ".join(report["compensation_failed"]) or "none"
        compensated = (f"; compensated: {', '.join(report['compensated']) or 'none'}; "
                       f"compensation failed: {failed}")  # fmt: skip
    _alert(
        f"staged MCP call {report['failed']} of booth {booth_id} failed ({report['error']}); "
        f"ran before it: {ran}; not run: {', '.join(report['not_run']) or 'none'}"
        f"{compensated}. The files are committed; the calls that ran cannot be undone"
    )
    return 1


def _scrubbed(append: Append, servers: dict[str, ServerSpec]) -> Append:
    """`append` with the secrets known here taken out of every frame: the declared servers'
    (an HTTP server's URL password and headers) and this environment's secret-looking
    variables. A booth's supervisor scrubs its own frames too; a pending booth committed later
    has only these (its staged calls carry the arguments shown when they were staged)."""
    from jukebox.mcp.record import scrub
    from jukebox.redact import Scrubber, is_secret_env_name

    scrubber = Scrubber(v for k, v in os.environ.items() if is_secret_env_name(k))
    for spec in servers.values():
        scrubber.add(spec.secrets())
    return lambda kind, payload: append(kind, scrub(payload, scrubber))


def _alert(message: str) -> None:
    import sys

    from jukebox.display.names import printable

    sys.stderr.write(f"jukebox: {printable(message)}\n")
    sys.stderr.flush()


def drop(calls: list[StagedCall], append: Append, reason: str) -> None:
    if calls:
        append("note", {"event": "mcp_dropped", "ids": [c.id for c in calls], "reason": reason})
