"""What differs between two tapes: frames, models, messages, tool calls, files, tokens, cost.

`compare_tapes(tape_a, tape_b, store)` reads two loaded tapes (a run and its fork, a run and its
replay, or any two runs) and returns a `Comparison`: the shared prefix (leading frames identical
byte for byte, as a fork shares its origin's), one `Side` per tape, the turns paired by order
with the first differing pair, and the file changes between the two final trees (mtime-only
differences are not changes). `to_markdown()` renders the report people read (the terminal view
is the same text); `to_json()` returns the same facts as plain data.

Turns are model calls (`llm_turn` frames, what the proxy saw go over the wire) and the steps an
agent recorded itself (`agent_turn` frames from `tx.record_agent_turn`: its own words, model
name and cost, not a call anyone observed). A fork's `fork` frame names its overrides; an
agent_turn written after it carries `model_override`, and its model in the report is the
override, marked as such: the report never presents an agent turn as a call made with it.

Standalone on purpose: the CLI (`jukebox diff TAPE_A TAPE_B`) and the Python API both use it,
and it needs nothing but the tapes and the store holding their objects.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jukebox.display.names import CHANGE_LETTERS, name_json, printable, visible
from jukebox.display.render import money
from jukebox.llm.model_override import describe as describe_model_override
from shadowfs.oid import ObjectId

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

SHOW_CHARS = 160  # how much of a prompt or reply one line of the report shows
SHOW_FILES = 50  # file changes listed before "... and N more"
SHOW_TOOL_CALLS = 20
_TOKEN_KEYS = ("input", "output", "cached")


@dataclass
class Turn:
    """One model exchange of a tape, reduced to what a person compares."""

    seq: int
    provider: str
    endpoint: str
    model: str | None
    prompt: str  # the last user (or tool) text of the request
    reply: str  # the model's text
    tool_calls: list[dict[str, Any]]
    usage: dict[str, int]
    cost_usd: float
    status: int | None
    replayed: bool
    kind: str = "llm_turn"  # or "agent_turn"
    agent: str | None = None
    recorded_model: str | None = None  # an agent_turn's own model when an override replaced it

    def key(self) -> tuple[Any, ...]:
        calls = json.dumps(self.tool_calls, sort_keys=True, default=str)
        return (self.provider, self.endpoint, self.model, self.prompt, self.reply, calls)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Side:
    """One tape's numbers."""

    label: str
    tape_id: str | None
    path: str
    frames: int
    status: str
    exit_code: int | None
    models: list[str]
    turns: list[Turn]
    checkpoints: int
    final_tree: ObjectId | None
    tokens: dict[str, int] = field(default_factory=dict)
    cost_usd: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    fork: dict[str, Any] | None = None  # the last fork frame: {"at", "from", "overrides"}

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [call for turn in self.turns for call in turn.tool_calls]

    @property
    def llm_calls(self) -> int:
        return sum(1 for t in self.turns if t.kind == "llm_turn")

    @property
    def agent_turns(self) -> int:
        return sum(1 for t in self.turns if t.kind == "agent_turn")

    def models_text(self) -> str:
        text = ", ".join(self.models) or "-"
        model = (self.fork or {}).get("overrides", {}).get("model")
        if model:
            shown = describe_model_override(model)
            # model came from self.fork, so it is a dict here
            text += f" (fork override from frame {self.fork['at']}: {shown})"  # type: ignore[index]
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "tape_id": self.tape_id,
            "path": self.path,
            "frames": self.frames,
            "status": self.status,
            "exit_code": self.exit_code,
            "models": self.models,
            "llm_calls": self.llm_calls,
            "agent_turns": self.agent_turns,
            "fork": self.fork,
            "tool_calls": self.tool_calls,
            "checkpoints": self.checkpoints,
            "final_tree": self.final_tree.hex() if self.final_tree is not None else None,
            "tokens": self.tokens,
            "cost_usd": round(self.cost_usd, 10),
            "kinds": self.kinds,
            "turns": [t.to_json() for t in self.turns],
        }


@dataclass
class FileChange:
    status: str
    path: str  # as shown: jukebox.display.names.visible(raw)
    raw: bytes = b""


@dataclass
class Comparison:
    a: Side
    b: Side
    shared_prefix: int  # frames 0..shared_prefix-1 are identical byte for byte
    differing_turns: list[int]  # indexes into the paired turns that differ
    first_turn_diff: tuple[Turn | None, Turn | None] | None
    files: list[FileChange] | None  # None: no store to read the trees from

    @property
    def identical(self) -> bool:
        """Same model behaviour and the same files (frame bytes and timings may differ)."""
        return (
            not self.differing_turns
            and self.files is not None
            and not self.files
            and self.a.exit_code == self.b.exit_code
        )

    # ------------------------------------------------------------------ rendering

    def to_json(self) -> dict[str, Any]:
        first = None
        if self.first_turn_diff is not None:
            ta, tb = self.first_turn_diff
            first = {
                "turn": self.differing_turns[0] + 1,
                "a": ta.to_json() if ta else None,
                "b": tb.to_json() if tb else None,
            }
        return {
            "shared_prefix": self.shared_prefix,
            "identical": self.identical,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "messages": {
                "paired_turns": max(len(self.a.turns), len(self.b.turns)),
                "differing_turns": [i + 1 for i in self.differing_turns],
                "first_difference": first,
            },
            "files": (
                None
                if self.files is None
                else [{"status": c.status, **name_json(c.raw)} for c in self.files]
            ),
        }

    def to_markdown(self) -> str:
        a, b = self.a, self.b
        out = [f"# Tape comparison: {a.label} vs {b.label}", ""]
        out += _table(
            ["", f"A: {a.label}", f"B: {b.label}"],
            [
                ["tape", f"`{a.path}`", f"`{b.path}`"],
                ["frames", a.frames, b.frames],
                ["status", a.status, b.status],
                ["exit code", _opt(a.exit_code), _opt(b.exit_code)],
                ["models", _cell(a.models_text()), _cell(b.models_text())],
                ["LLM calls", a.llm_calls, b.llm_calls],
                ["agent turns", a.agent_turns, b.agent_turns],
                ["tool calls", len(a.tool_calls), len(b.tool_calls)],
                ["checkpoints", a.checkpoints, b.checkpoints],
                ["tokens (in / out / cached)", _tokens(a.tokens), _tokens(b.tokens)],
                ["cost", money(a.cost_usd), money(b.cost_usd)],
            ],
        )
        out += ["", "## Shared prefix", ""]
        if self.shared_prefix:
            out.append(
                f"Frames 0..{self.shared_prefix - 1} ({self.shared_prefix} frame(s)) are "
                "identical byte for byte; the tapes part at frame "
                f"{self.shared_prefix}."
            )
        else:
            out.append("None: the tapes differ from frame 0 (two separate runs).")
        out += self._fork_markdown()
        out += ["", "## Models", ""]
        if a.models == b.models and a.models_text() == b.models_text():
            out.append(f"Same: {', '.join(a.models) or 'no model calls'}.")
        else:
            out.append(f"- A: {a.models_text()}")
            out.append(f"- B: {b.models_text()}")
        out += ["", "## Messages", ""]
        out += self._messages_markdown()
        out += ["", "## Tool calls", ""]
        out += _tool_calls_markdown(a, b)
        out += ["", "## Files", ""]
        out += self._files_markdown()
        out += ["", "## Tokens and cost", ""]
        out += _table(
            ["", "A", "B", "B - A"],
            [
                [key, a.tokens.get(key, 0), b.tokens.get(key, 0),
                 _signed(b.tokens.get(key, 0) - a.tokens.get(key, 0))]
                for key in ("input", "output", "cached")
            ]
            + [["cost (USD)", money(a.cost_usd), money(b.cost_usd),
                _signedmoney(b.cost_usd - a.cost_usd)]],
        )  # fmt: skip
        # Prompts, replies and names come from the tapes: nothing in them may drive a terminal.
        return "\n".join(printable(line) for line in out) + "\n"

    def _fork_markdown(self) -> list[str]:
        out: list[str] = []
        for name, side in (("A", self.a), ("B", self.b)):
            if side.fork is None:
                continue
            overrides = side.fork.get("overrides") or {}
            at = side.fork["at"]
            out += ["", f"## Fork ({name})", ""]
            out.append(f"{name} forks `{side.fork.get('from')}` at frame {at}.")
            for key, value in overrides.items():
                shown = describe_model_override(value)
                out.append(f"- {key.replace('_', ' ')} override: {_cell(_show(shown))}")
            if overrides:
                calls = sum(1 for t in side.turns if t.kind == "llm_turn" and t.seq > at)
                turns = sum(1 for t in side.turns if t.kind == "agent_turn" and t.seq > at)
                out += [
                    "",
                    f"The overrides apply to model calls after frame {at}: {name} made {calls} "
                    f"(`llm_turn`). Its {turns} agent turn(s) after the fork (`agent_turn`, "
                    "recorded by the agent itself) are not model calls: they carry "
                    "`model_override` and show the override as their model, but no API call "
                    "was made for them.",
                ]
        return out

    def _messages_markdown(self) -> list[str]:
        paired = max(len(self.a.turns), len(self.b.turns))
        if not paired:
            return ["No model calls on either tape."]
        if not self.differing_turns:
            return [f"All {paired} turn(s) match: same models, prompts, replies and tool calls."]
        out = [
            f"{len(self.differing_turns)} of {paired} turn(s) differ (turns paired by order): "
            + ", ".join(f"#{i + 1}" for i in self.differing_turns[:20])
            + (" ..." if len(self.differing_turns) > 20 else ""),
            "",
        ]
        assert self.first_turn_diff is not None
        ta, tb = self.first_turn_diff
        n = self.differing_turns[0] + 1
        where = ", ".join(
            f"{side} frame {t.seq}" for side, t in (("A", ta), ("B", tb)) if t is not None
        )
        out.append(f"First difference, turn #{n} ({where}):")
        out.append("")
        rows = []
        for name, get in (
            ("endpoint", _where),
            ("model", _model_text),
            ("prompt", lambda t: _show(t.prompt)),
            ("reply", lambda t: _show(t.reply)),
            ("tool calls", lambda t: _calls_text(t.tool_calls) or "-"),
        ):
            va = get(ta) if ta is not None else "(no such turn)"
            vb = get(tb) if tb is not None else "(no such turn)"
            mark = "" if va == vb else " *"
            rows.append([name + mark, _cell(va), _cell(vb)])
        out += _table(["", "A", "B"], rows)
        out.append("")
        out.append("`*` marks what differs.")
        return out

    def _files_markdown(self) -> list[str]:
        if self.files is None:
            return ["Not compared: no store holds the tapes' trees."]
        if not self.files:
            return ["The final file states are the same (mtimes aside)."]
        out = [f"{len(self.files)} path(s) differ between A's final tree and B's:", ""]
        for change in self.files[:SHOW_FILES]:
            out.append(f"- `{CHANGE_LETTERS.get(change.status, '?')}` {change.path}")
        if len(self.files) > SHOW_FILES:
            out.append(f"- ... and {len(self.files) - SHOW_FILES} more")
        return out


# --------------------------------------------------------------------------- building


def compare_tapes(
    tape_a: Any,
    tape_b: Any,
    store: ObjectReader | None = None,
    *,
    label_a: str | None = None,
    label_b: str | None = None,
) -> Comparison:
    """Compares two loaded `jukebox.tape.tape.Tape`s; `store` holds their spilled payloads and trees
    (default: tape_a's, else tape_b's)."""
    store = store if store is not None else (tape_a.store or tape_b.store)
    # Each tape's payloads come from its own store (two tape dirs, two stores); the trees are
    # compared in `store`.
    a = read_side(tape_a, tape_a.store or store, label_a)
    b = read_side(tape_b, tape_b.store or store, label_b)
    prefix = 0
    for fa, fb in zip(tape_a.frames, tape_b.frames, strict=False):
        if fa.id != fb.id:
            break
        prefix += 1
    differing: list[int] = []
    for i in range(max(len(a.turns), len(b.turns))):
        ta = a.turns[i] if i < len(a.turns) else None
        tb = b.turns[i] if i < len(b.turns) else None
        if ta is None or tb is None or ta.key() != tb.key():
            differing.append(i)
    first = None
    if differing:
        i = differing[0]
        first = (a.turns[i] if i < len(a.turns) else None, b.turns[i] if i < len(b.turns) else None)
    files: list[FileChange] | None = None
    if a.final_tree == b.final_tree:
        files = []
    elif store is not None:
        from shadowfs.errors import ShadowfsError
        from shadowfs.tree import diff_trees

        try:
            files = [
                FileChange(c.status, visible(c.path), c.path)
                for c in diff_trees(store, a.final_tree, b.final_tree)
            ]
        except ShadowfsError:
            files = None  # one side's trees live in another tape dir's store
    return Comparison(a, b, prefix, differing, first, files)


def read_side(tape: Any, store: ObjectReader, label: str | None = None) -> Side:
    tape.check_chain()  # a damaged tape is refused, not compared
    summary = tape.summary()
    turns: list[Turn] = []
    models: list[str] = []
    kinds: dict[str, int] = {}
    tokens = {"input": 0, "output": 0, "cached": 0}
    cost = 0.0
    checkpoints = 0
    exit_code: int | None = None
    final_tree: ObjectId | None = None
    fork: dict[str, Any] | None = None
    for frame in tape.frames:
        kinds[frame.kind] = kinds.get(frame.kind, 0) + 1
        if frame.tree is not None:
            final_tree = frame.tree
        if frame.kind == "fork":
            origin = frame.payload.get("forked_from")
            if isinstance(origin, dict):
                overrides = frame.payload.get("overrides")
                fork = {
                    "at": frame.seq,
                    "from": origin.get("tape"),
                    "overrides": overrides if isinstance(overrides, dict) else {},
                }
        elif frame.kind == "checkpoint":
            checkpoints += 1
        elif frame.kind == "exit":
            code = frame.payload.get("code")
            exit_code = code if isinstance(code, int) else None
        elif frame.kind in ("llm_turn", "agent_turn"):
            turn = read_turn(frame, store) if frame.kind == "llm_turn" else read_agent_turn(frame)
            turns.append(turn)
            if turn.model and turn.model not in models:
                models.append(turn.model)
            for key in tokens:
                tokens[key] += int(turn.usage.get(key) or 0)
            cost += turn.cost_usd
    tape_id = tape.tape_id
    return Side(
        label=label or tape_id or os.path.basename(os.fspath(tape.path)),
        tape_id=tape_id,
        path=os.fspath(tape.path),
        frames=len(tape.frames),
        status=summary["status"],
        exit_code=exit_code,
        models=models,
        turns=turns,
        checkpoints=checkpoints,
        final_tree=final_tree,
        tokens=tokens,
        cost_usd=cost,
        kinds=kinds,
        fork=fork,
    )


def read_agent_turn(frame: Any) -> Turn:
    """An agent_turn frame as a Turn: what the agent said it did, with the fork's model
    override (if one was in force) as its model and the agent's own name kept beside it."""
    p = frame.payload
    recorded = p.get("model") if isinstance(p.get("model"), str) else None
    override = p.get("model_override") if isinstance(p.get("model_override"), str) else None
    tokens = p.get("tokens")
    usage = {}
    if isinstance(tokens, dict):
        usage = {k: v for k, v in tokens.items() if k in _TOKEN_KEYS and isinstance(v, int)}
    cost = p.get("cost_usd")
    if isinstance(cost, bool) or not isinstance(cost, int | float):
        cost = 0.0
    calls = p.get("tool_calls")
    return Turn(
        seq=frame.seq,
        provider="agent",
        endpoint="agent_turn",
        model=override or recorded,
        prompt="",
        reply=p.get("text") if isinstance(p.get("text"), str) else "",
        tool_calls=list(calls) if isinstance(calls, list) else [],
        usage=usage,
        cost_usd=float(cost),
        status=None,
        replayed=False,
        kind="agent_turn",
        agent=p.get("agent") if isinstance(p.get("agent"), str) else None,
        recorded_model=recorded if override else None,
    )


def read_turn(frame: Any, store: ObjectReader) -> Turn:
    """An llm_turn frame as a Turn; the reply text is re-read from the recorded response."""
    from jukebox.llm.providers import summarize

    p = frame.resolve_payload(store) if store is not None else frame.payload
    request, response = p.get("request"), p.get("response")
    provider, endpoint = str(p.get("provider")), str(p.get("endpoint"))
    if p.get("stream") and isinstance(response, list):
        datas = [e.get("data") for e in response if isinstance(e, dict)]
        summary = summarize(provider, endpoint, request, events=datas)
    else:
        ok = isinstance(p.get("status"), int) and 200 <= p["status"] < 300
        summary = summarize(provider, endpoint, request, response if ok else None)
    cost = p.get("cost_usd")
    usage = p.get("usage") if isinstance(p.get("usage"), dict) else {}
    return Turn(
        seq=frame.seq,
        provider=provider,
        endpoint=endpoint,
        model=p.get("model") if isinstance(p.get("model"), str) else summary.model,
        prompt=prompt_text(request),
        reply=summary.text or (str(p["error"]) if p.get("error") else ""),
        tool_calls=list(p.get("tool_calls") or []),
        usage={k: v for k, v in usage.items() if isinstance(v, int)},
        cost_usd=float(cost) if isinstance(cost, int | float) else 0.0,
        status=p.get("status") if isinstance(p.get("status"), int) else None,
        replayed=p.get("replayed_from") is not None,
    )


def prompt_text(request: Any) -> str:
    """The text that asked for this turn: the last message of Chat or Anthropic Messages, or
    the Responses API's input."""
    if not isinstance(request, dict):
        return ""
    if isinstance(request.get("messages"), list) and request["messages"]:
        return _text(request["messages"][-1])
    if "input" in request:
        value = request["input"]
        return _text(value[-1] if isinstance(value, list) and value else value)
    return ""


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(t for t in (_text(v) for v in value) if t)
    if isinstance(value, dict):
        for key in ("content", "text", "output"):
            if key in value:
                return _text(value[key])
    return ""


# --------------------------------------------------------------------------- formatting


def _tool_calls_markdown(a: Side, b: Side) -> list[str]:
    ca, cb = a.tool_calls, b.tool_calls
    if not ca and not cb:
        return ["None on either tape."]
    if _calls_text(ca) == _calls_text(cb):
        return [f"The same {len(ca)} call(s) on both: {_calls_text(ca[:SHOW_TOOL_CALLS])}."]
    out = []
    for side, calls in (("A", ca), ("B", cb)):
        shown = _calls_text(calls[:SHOW_TOOL_CALLS]) or "none"
        more = (
            f" ... and {len(calls) - SHOW_TOOL_CALLS} more" if len(calls) > SHOW_TOOL_CALLS else ""
        )
        out.append(f"- {side} ({len(calls)}): {shown}{more}")
    return out


def _where(turn: Turn) -> str:
    if turn.kind == "agent_turn":
        return f"agent turn ({turn.agent or '?'}), not a model call"
    return f"{turn.provider} {turn.endpoint}"


def _model_text(turn: Turn) -> str:
    if turn.recorded_model is not None:
        return f"{turn.model} (fork override; the agent recorded {turn.recorded_model})"
    return turn.model or "-"


def _calls_text(calls: list[dict[str, Any]]) -> str:
    parts = []
    for call in calls:
        args = call.get("arguments")
        text = args if isinstance(args, str) else json.dumps(args, sort_keys=True, default=str)
        parts.append(f"{call.get('name')}({_show(text, 60)})")
    return ", ".join(parts)


def _show(text: str, limit: int = SHOW_CHARS) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _cell(value: Any) -> str:
    # Pipes would split a markdown table cell.
    return str(value).replace("|", "\\|") if value != "" else '""'


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _tokens(tokens: dict[str, int]) -> str:
    return f"{tokens.get('input', 0)} / {tokens.get('output', 0)} / {tokens.get('cached', 0)}"


def _signed(value: int) -> str:
    return f"{value:+d}"


def _signedmoney(value: float) -> str:
    value = round(value, 10)  # a float sum's last-bit noise is no loss
    return ("+" if value >= 0 else "-") + f"${abs(value):.4f}"


def _opt(value: Any) -> str:
    return "-" if value is None else str(value)
