"""Text for people: frame one-liners, aligned tables, durations and money.

Plain strings on purpose: importing a rich console costs tens of milliseconds, and `jukebox log`
and `replay` must start fast. Everything here is pure formatting; nothing reads a tape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

WIDTH_FALLBACK = 120


def terminal_width() -> int:
    # Imported here: a replay renders a line, not a table, and shutil (with bz2 and lzma) is
    # 6 M instructions at each start.
    import shutil

    return shutil.get_terminal_size((WIDTH_FALLBACK, 24)).columns


def money(value: float) -> str:
    return f"${value:.4f}"


def seconds(ns: int) -> str:
    s = ns / 1e9
    if s < 1:
        return f"{s * 1000:.1f}ms"
    if s < 120:
        return f"{s:.2f}s"
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def timestamp(t: float) -> str:
    """A moment in local time with its zone, so that two people's output compare."""
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t))


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def size(n: int) -> str:
    """Bytes in binary units, as `--max-scratch` and the image sizes are written: 1.5 GiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def short(text: Any, limit: int = 60) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    right: Iterable[int] = (),
    paint: Mapping[int, Callable[[str], str]] | None = None,
) -> str:
    """Columns sized to their content; `right` names columns to right-align (numbers). When the
    CLI turned colour on (jukebox.display.style), the header is bold and `paint` colours the cells
    of the columns it names (a status)."""
    from jukebox.display import style
    from jukebox.display.names import printable

    # Cells quote tapes and trees (names, messages): a terminal must not act on what they hold.
    cells = [[printable(c) for c in headers]] + [[printable(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    align_right = set(right)
    painters = dict(paint or {}) if style.enabled() else {}
    lines = []
    for n, row in enumerate(cells):
        parts = []
        for i, c in enumerate(row):
            pad = " " * (widths[i] - len(c))
            shown = style.header(c) if n == 0 else painters.get(i, str)(c)
            parts.append(pad + shown if i in align_right else shown + pad)
        lines.append("   ".join(parts).rstrip())
    return "\n".join(lines)


def describe(kind: str, payload: dict[str, Any]) -> str:
    """One human line for a frame's payload, by kind (fields as in docs/tape-format.md)."""
    p = payload
    cost = p.get("cost_usd")
    priced = f" {money(cost)}" if isinstance(cost, int | float) and cost else ""
    if kind == "run_start":
        argv = p.get("argv")
        what = " ".join(map(str, argv)) if isinstance(argv, list) else p.get("function", "")
        return f"{p.get('name') or ''} {short(what, 50)}".strip()
    if kind == "agent_turn":
        who = p.get("agent_name") or p.get("agent") or "agent"
        model = f" [{p['model']}]" if p.get("model") else ""
        return f"{who}: {short(p.get('message', p.get('text', '')))}{model}{priced}"
    if kind == "llm_turn":
        tokens_in = p.get("tokens_in", (p.get("usage") or {}).get("input"))
        tokens_out = p.get("tokens_out", (p.get("usage") or {}).get("output"))
        tokens = f" {tokens_in}→{tokens_out} tok" if tokens_in is not None else ""
        # A named upstream by its name; endpoints other than the chat ones by theirs.
        who = p.get("upstream") or p.get("provider", "?")
        endpoint = p.get("endpoint")
        if endpoint and endpoint not in ("chat.completions", "responses", "messages"):
            who += f" {endpoint}"
        return f"{who} {p.get('model', '?')}{tokens}{priced}"
    if kind == "tool_call":
        # An MCP call (docs/mcp.md) names its server, and what the stage gate decided.
        where = f"{p['server']}/" if p.get("server") else ""
        decision = p.get("decision")
        said = ""
        if decision in ("stage", "commit") and p.get("staged_id"):
            said = f" {'staged' if decision == 'stage' else 'ran'} {p['staged_id']}"
        elif decision == "deny":
            said = " denied"
        return f"{where}{p.get('tool', '?')}({short(p.get('args', ''), 40)}){said}"
    if kind in ("fs", "checkpoint"):
        from jukebox.display.names import visible

        number = f"#{p['id']} " if p.get("id") is not None else ""
        label = f"'{p['label']}' " if p.get("label") else ""
        paths = p.get("paths")
        shown = ", ".join(visible(str(path)) for path in paths) if paths else ""
        changed = f"{len(paths)} path(s): {short(shown, 50)}" if paths else ""
        why = f"({p['reason']})" if kind == "fs" and p.get("reason") and not changed else ""
        return (number + label + changed + why).strip() or "file state"
    if kind == "rollback":
        target = f"to #{p['to']} " if p.get("to") is not None else ""
        label = f"'{p['label']}' " if p.get("label") else ""
        reason = p.get("reason", "")
        return (target + label + ("" if reason == "request" else short(reason))).strip()
    if kind == "note":
        rest = {k: v for k, v in p.items() if k != "event"}
        details = ", ".join(f"{k}={short(v, 20)}" for k, v in sorted(rest.items()))
        return short(f"{p.get('event', '')} {details}".strip(), 70)
    if kind == "verify":
        cmd = p.get("cmd")
        cmd_text = " ".join(map(str, cmd)) if isinstance(cmd, list) else str(cmd or "")
        if p.get("skipped"):
            return f"skipped ({short(p['skipped'], 30)}) {short(cmd_text, 40)}".strip()
        return f"{'passed' if p.get('ok') else 'FAILED'} {short(cmd_text, 40)}".strip()
    if kind == "commit":
        return f"{p['changes']} change(s) applied" if "changes" in p else "committed"
    if kind == "discard":
        return short(p.get("reason", "discarded"))
    if kind == "breaker":
        return f"tripped {p.get('rule', '?')}: {short(p.get('detail', ''))}"
    if kind == "sql":
        # One statement through the SQL proxy (docs/sql.md): where, what, and what came of it.
        error = p.get("error")
        if isinstance(error, dict):
            came = f"ERROR {error.get('code', '')}: {short(error.get('message', ''), 30)}"
        else:
            came = str(p.get("tag") or "")
        where = f"{p.get('db', '?')}#{p.get('conn', '?')}"
        return f"{where} {short(p.get('statement', ''), 40)} → {came}"
    if kind == "exit":
        if p.get("code") is None and isinstance(p.get("signal"), int):
            return f"killed by {signal_name(p['signal'])}"
        signal = f", signal {p['signal']}" if p.get("signal") else ""
        return f"exit {p.get('code')}{signal}"
    return short(", ".join(f"{k}={short(v, 20)}" for k, v in sorted(p.items())), 70)
