"""Which decision a tool call gets: allow (forward now), stage (hold until the verdict), deny or
ask (the operator decides).

Explicit rules (a policy file, then the command line's flags) name tools by `SERVER/TOOL` or
`TOOL`, with shell-style wildcards; the last matching rule wins, flags after the file. A tool no
rule names takes its default from the server's own annotations: `readOnlyHint` -> allow, anything
else (destructive, open-world or unannotated) -> stage. The mode caps the result: `deny` refuses
every call that is not read-only, `record` (the default outside a booth, where no verdict will
ever come) forwards what would be staged.

Annotations are hints from a server that may not deserve trust, so they only ever choose a
default; a rule or the mode always wins over them.
"""

from __future__ import annotations

import fnmatch
import json
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jukebox.errors import UsageError

DECISIONS = ("allow", "stage", "deny", "ask")
# staged_acid and deny are SandboxPolicy(mcp_mode=...)'s values (jukebox.api.api).
MODES = ("staged_acid", "deny", "record")


@dataclass(frozen=True)
class Rule:
    pattern: str
    decision: str

    def matches(self, server: str, tool: str) -> bool:
        if "/" in self.pattern:
            return fnmatch.fnmatchcase(f"{server}/{tool}", self.pattern)
        return fnmatch.fnmatchcase(tool, self.pattern)


@dataclass(frozen=True)
class Decision:
    decision: str
    why: str  # "rule SERVER/TOOL", "readOnlyHint", "unannotated", "mode deny", ...

    def as_dict(self) -> dict[str, str]:
        return {"decision": self.decision, "why": self.why}


@dataclass(frozen=True)
class Compensation:
    """A policy file's `[compensate]` entry: when a staged call of a tool matching `pattern`
    ran at the commit and a later one failed, `tool` is called on the same server with `args`,
    where a string `"$args.PATH"` stands for that part of the staged call's arguments (PATH:
    keys and list indexes joined by dots; `*` takes every item of a list)."""

    pattern: str
    tool: str
    args: dict[str, Any]

    def resolve(self, call_args: dict[str, Any]) -> dict[str, Any] | None:
        """The compensating call's arguments for one staged call; None when a path it names is
        missing from them (that call then has no compensation)."""
        try:
            resolved = _fill(self.args, call_args)
        except LookupError:
            return None
        assert isinstance(resolved, dict)
        return resolved

    def describe(self) -> list[Any]:
        return [self.pattern, self.tool, self.args]


def _fill(template: Any, call_args: dict[str, Any]) -> Any:
    if isinstance(template, dict):
        return {k: _fill(v, call_args) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill(v, call_args) for v in template]
    if isinstance(template, str) and (template == "$args" or template.startswith("$args.")):
        return _walk(call_args, template.split(".")[1:])
    return template


def _walk(value: Any, path: list[str]) -> Any:
    if not path:
        return value
    key, rest = path[0], path[1:]
    if key == "*":
        if not isinstance(value, list):
            raise LookupError(key)
        return [_walk(item, rest) for item in value]
    if isinstance(value, list) and key.isdigit() and int(key) < len(value):
        return _walk(value[int(key)], rest)
    if isinstance(value, dict) and key in value:
        return _walk(value[key], rest)
    raise LookupError(key)


@dataclass(frozen=True)
class Policy:
    mode: str = "staged_acid"
    rules: tuple[Rule, ...] = field(default_factory=tuple)
    compensations: tuple[Compensation, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"bad MCP mode {self.mode!r}: use one of {', '.join(MODES)}")

    def decide(self, server: str, tool: str, annotations: dict[str, Any] | None) -> Decision:
        read_only = bool(annotations and annotations.get("readOnlyHint") is True)
        chosen: Decision | None = None
        for rule in reversed(self.rules):
            if rule.matches(server, tool):
                chosen = Decision(rule.decision, f"rule {rule.pattern}")
                break
        if chosen is None:
            if read_only:
                chosen = Decision("allow", "readOnlyHint")
            elif annotations is None:
                chosen = Decision("stage", "unannotated")
            elif annotations.get("destructiveHint") is not False:
                chosen = Decision("stage", "destructiveHint")
            elif annotations.get("openWorldHint") is not False:
                chosen = Decision("stage", "openWorldHint")
            else:
                chosen = Decision("stage", "not readOnlyHint")
        if self.mode == "deny" and not read_only and chosen.decision != "deny":
            return Decision("deny", "mode deny: the tool is not read-only")
        if self.mode == "record" and chosen.decision == "stage":
            return Decision("allow", f"mode record (would stage: {chosen.why})")
        return chosen

    def compensation(self, server: str, tool: str, args: dict[str, Any]) -> dict[str, Any] | None:
        """The compensating call ({"tool", "args"}) the policy declares for a staged call, the
        last matching entry's; None when none matches or its arguments cannot be filled."""
        for entry in reversed(self.compensations):
            if Rule(entry.pattern, "stage").matches(server, tool):
                filled = entry.resolve(args)
                return None if filled is None else {"tool": entry.tool, "args": filled}
        return None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode,
                               "rules": [[r.pattern, r.decision] for r in self.rules]}  # fmt: skip
        if self.compensations:
            out["compensate"] = [c.describe() for c in self.compensations]
        return out


def _check_rule(pattern: object, decision: object, where: str) -> Rule:
    if not isinstance(pattern, str) or not pattern or not pattern.isprintable():
        raise UsageError(f"{where}: a tool pattern must be a non-empty printable string")
    if decision not in DECISIONS:
        raise UsageError(
            f"{where}: bad decision {decision!r} for {pattern!r}: use one of {', '.join(DECISIONS)}"
        )
    return Rule(pattern, str(decision))


def load_policy_file(path: str | Path) -> tuple[str | None, list[Rule]]:
    """A policy file: TOML (or JSON) with an optional `mode` and a `[tools]` table of
    `"PATTERN" = "DECISION"` (its `[compensate]` table: load_compensations)."""
    mode, rules, _ = _load(path)
    return mode, rules


def load_compensations(path: str | Path) -> list[Compensation]:
    """A policy file's `[compensate]` table: `"PATTERN" = {tool = "TOOL", args = {...}}`."""
    return _load(path)[2]


def _check_compensation(pattern: object, entry: object, where: str) -> Compensation:
    _check_rule(pattern, "stage", where)
    if (not isinstance(entry, dict) or set(entry) - {"tool", "args"}
            or not isinstance(entry.get("tool"), str) or not entry["tool"]
            or not isinstance(entry.get("args", {}), dict)):  # fmt: skip
        raise UsageError(
            f'{where}: [compensate] {pattern!r} must be {{tool = "TOOL", args = {{...}}}}'
        )
    return Compensation(str(pattern), entry["tool"], dict(entry.get("args", {})))


def parse_compensation(spec: str, where: str = "--mcp-compensate") -> Compensation:
    """One compensation as a flag gives it: `PATTERN=ENTRY`, ENTRY a policy file's
    `[compensate]` entry written as a TOML inline table (`{tool = "T", args = {...}}`) or as a
    JSON object (`{"tool": "T", "args": {...}}`)."""
    pattern, eq, entry = spec.partition("=")
    pattern, entry = pattern.strip(), entry.strip()
    if not eq or not pattern or not entry:
        raise UsageError(
            f"{where} {spec!r}: write SERVER/TOOL={{tool = \"TOOL\", args = {{...}}}}, as a "
            "policy file's [compensate] entry"
        )
    try:
        data = json.loads(entry) if entry.startswith('{"') else tomllib.loads(f"e = {entry}")["e"]
    except ValueError as error:  # tomllib.TOMLDecodeError is one
        raise UsageError(
            f"{where} {pattern}: {entry!r} is neither a TOML inline table nor a JSON object "
            f"({error})"
        ) from None
    return _check_compensation(pattern, data, where)


def _load(path: str | Path) -> tuple[str | None, list[Rule], list[Compensation]]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise UsageError(f"cannot read the MCP policy file {path}: {error.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as error:
        raise UsageError(f"the MCP policy file {path} is not valid: {error}") from None
    if not isinstance(data, dict):
        raise UsageError(f"the MCP policy file {path} must hold a table with `mode` and `tools`")
    unknown = sorted(set(data) - {"mode", "tools", "compensate"})
    if unknown:
        raise UsageError(
            f"the MCP policy file {path} has unknown key(s) {', '.join(unknown)}: "
            "only `mode`, `[tools]` and `[compensate]` are read"
        )
    mode = data.get("mode")
    if mode is not None and mode not in MODES:
        raise UsageError(f"{path}: bad mode {mode!r}: use one of {', '.join(MODES)}")
    tools = data.get("tools", {})
    if not isinstance(tools, dict):
        raise UsageError(f'{path}: `tools` must be a table of "PATTERN" = "DECISION"')
    compensate = data.get("compensate", {})
    if not isinstance(compensate, dict):
        raise UsageError(f'{path}: `compensate` must be a table of "PATTERN" = {{tool, args}}')
    return (mode, [_check_rule(p, d, str(path)) for p, d in tools.items()],
            [_check_compensation(p, e, str(path)) for p, e in compensate.items()])  # fmt: skip


def build_policy(
    mode: str | None,
    policy_file: str | None = None,
    flags: Iterable[tuple[str, str]] = (),
    default_mode: str = "staged_acid",
    compensate: Iterable[str] = (),
) -> Policy:
    """The policy from a file, then flags (decision, pattern), then the mode (flag over file).
    `compensate`: `--mcp-compensate` values (parse_compensation), after the file's entries, so
    that for a tool both name the flag's wins (the last matching entry)."""
    rules: list[Rule] = []
    compensations: list[Compensation] = []
    file_mode = None
    if policy_file:
        file_mode, rules, compensations = _load(policy_file)
    rules.extend(_check_rule(pattern, decision, "--" + decision) for decision, pattern in flags)
    compensations.extend(parse_compensation(spec) for spec in compensate)
    return Policy(mode or file_mode or default_mode, tuple(rules), tuple(compensations))


def flag_rules(allow: Sequence[str], stage: Sequence[str], deny: Sequence[str],
               ask: Sequence[str]) -> list[tuple[str, str]]:  # fmt: skip
    return [
        *(("allow", p) for p in allow),
        *(("stage", p) for p in stage),
        *(("deny", p) for p in deny),
        *(("ask", p) for p in ask),
    ]
