"""A tape as the viewer's data: plain JSON, built from what `jukebox log`, `show`, `verify` and
`diff TAPE_A TAPE_B` already compute (jukebox.display.render, jukebox.tape.frame_view, Tape.verify,
jukebox.tape.compare), so the page never re-derives what a frame means.

* `index` is every frame in a few columns (kind, time, cost, one line, markers): small enough
  to send whole for 10,000 frames, so the timeline paints at once and a frame's full view is
  fetched (or, in a shared file, unpacked) only when a person opens it.
* `detail(n)` is `frame_view` (messages, the reply, tool calls, the files with their diffs).
* `facts` is the run at a glance: verdict, breaker trips, checkpoints and rollbacks, exit,
  totals, and the Merkle verification of the whole tape (the project's own `Tape.verify`).
* `comparison` pairs a tape with a second one (a fork): the shared prefix and the turns that
  differ, from jukebox.tape.compare.

A damaged tape is shown up to the damage, as `jukebox log` does, with the verification saying
where it breaks: the frames past it are not vouched for and are not shown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The one line of a frame in the timeline: long enough to tell frames apart.
LINE_CHARS = 140

# Frame kinds drawn as markers on the timeline, and the verdict kinds.
MARKED = ("checkpoint", "rollback", "breaker", "verify", "commit", "discard", "exit", "fork")
VERDICTS = ("commit", "discard")


def _cost(payload: dict[str, Any]) -> float:
    cost = payload.get("cost_usd")
    if isinstance(cost, bool) or not isinstance(cost, int | float):
        return 0.0
    return float(cost)


def _read(frame: Any) -> tuple[str, dict[str, Any]]:
    """A frame's kind and payload; one whose record does not decode (the chain vouches for its
    bytes, a hostile writer chose them) is shown as such instead of failing the page."""
    from jukebox.tape.errors import TamperedTape

    try:
        return frame.kind, frame.payload
    except TamperedTape as error:
        return "undecodable", {"problem": str(error)}


def _short(text: str) -> str:
    from jukebox.display.render import short

    return short(text, LINE_CHARS)


@dataclass
class TapeView:
    """One loaded tape (a jukebox.tape.tape.Tape) and what the viewer shows of it."""

    tape: Any
    label: str
    _verified: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def frames(self) -> list[Any]:
        return self.tape.intact_frames

    def index(self) -> dict[str, Any]:
        """Every frame the chain vouches for, column by column: `kind` indexes `kinds`, `t` is
        milliseconds from the first frame, `cost` dollars, `what` the line `jukebox log`
        prints, `tree` 1 where the frame holds a file state."""
        from jukebox.display.render import describe

        frames = self.frames
        start = frames[0].time_ns if frames else 0
        kinds: list[str] = []
        kind_at: dict[str, int] = {}
        cols: dict[str, list[Any]] = {"kind": [], "t": [], "cost": [], "what": [], "tree": []}
        for frame in frames:
            kind, payload = _read(frame)
            if kind not in kind_at:
                kind_at[kind] = len(kinds)
                kinds.append(kind)
            cols["kind"].append(kind_at[kind])
            time_ns = frame.time_ns if kind != "undecodable" else start
            cols["t"].append(round((time_ns - start) / 1e6, 3))
            cost = _cost(payload)
            cols["cost"].append(round(cost, 8) if cost else 0)
            cols["what"].append(_short(describe(kind, payload)))
            cols["tree"].append(1 if kind != "undecodable" and frame.tree is not None else 0)
        return {"count": len(frames), "kinds": kinds, **cols}

    def facts(self) -> dict[str, Any]:
        """The run at a glance, and the markers the timeline draws."""
        from jukebox.display.render import describe

        summary = self.tape.summary()
        marks: list[dict[str, Any]] = []
        verdict: dict[str, Any] | None = None
        breaker: list[dict[str, Any]] = []
        tokens = {"input": 0, "output": 0}
        llm_calls = 0
        run: dict[str, Any] = {}
        for frame in self.frames:
            kind, payload = _read(frame)
            if kind == "run_start":
                argv = payload.get("argv")
                run = {
                    "name": payload.get("name") if isinstance(payload.get("name"), str) else None,
                    "argv": [str(a) for a in argv] if isinstance(argv, list) else None,
                    "function": payload.get("function")
                    if isinstance(payload.get("function"), str)
                    else None,
                }
            elif kind == "llm_turn":
                llm_calls += 1
                usage = payload.get("usage")
                if isinstance(usage, dict):
                    for key in tokens:
                        value = usage.get(key)
                        if isinstance(value, int) and not isinstance(value, bool):
                            tokens[key] += value
            if kind in MARKED:
                mark = {"seq": frame.seq, "kind": kind, "what": _short(describe(kind, payload))}
                if kind == "checkpoint":
                    mark["id"] = payload.get("id") if isinstance(payload.get("id"), int) else None
                    mark["label"] = _label(payload.get("label"))
                elif kind == "rollback":
                    mark["to"] = payload.get("to") if isinstance(payload.get("to"), int) else None
                    mark["label"] = _label(payload.get("label"))
                    mark["final"] = payload.get("final") is True
                elif kind == "verify":
                    mark["ok"] = payload.get("ok") is True
                elif kind == "breaker":
                    breaker.append(mark)
                marks.append(mark)
            if kind in VERDICTS or (kind == "rollback" and payload.get("final") is True):
                verdict = {"seq": frame.seq, "kind": kind, "what": _short(describe(kind, payload))}
        damage = self.tape.damage
        return {
            "label": self.label,
            "path": str(self.tape.path),
            "summary": summary,
            "run": run,
            "status": summary["status"],
            "verdict": verdict,
            "breaker": breaker,
            "marks": marks,
            "llm_calls": llm_calls,
            "tokens": tokens,
            "damage": str(damage) if damage is not None else None,
            "verified": self.verified(),
        }

    def verified(self) -> dict[str, Any]:
        """`jukebox verify`'s check (chain, Merkle root, every referenced object), done once."""
        if self._verified is None:
            report = self.tape.verify(check_objects=self.tape.store is not None, deep=True)
            self._verified = {
                "ok": report.ok,
                "frames": report.head.count,
                "merkle_root": report.head.merkle_root.hex(),
                "head": report.head.last_frame_id.hex() if report.head.last_frame_id else None,
                "problems": [str(p) for p in report.problems[:20]],
                "more_problems": max(0, len(report.problems) - 20),
                "objects_checked": self.tape.store is not None,
            }
        return self._verified

    def detail(self, n: int) -> dict[str, Any]:
        """Frame ``n`` in full: `jukebox show`'s view, files as `booth diff` filters them."""
        from jukebox.review.filter import ReviewFilter
        from jukebox.tape.frame_view import frame_view

        if not 0 <= n < len(self.frames):
            raise IndexError(n)
        try:
            view = frame_view(self.tape, n, ReviewFilter.from_options((), True))
        except Exception as error:  # a missing or corrupt object, a payload of a shape no
            # reader expects (a tape is someone else's): the frame's own fields, and why.
            from jukebox.tape.frame_view import _no_headers

            frame = self.frames[n]
            kind, payload = _read(frame)
            decoded = kind != "undecodable"
            view = {
                "seq": n,
                "kind": kind,
                "time_ns": frame.time_ns if decoded else None,
                "id": frame.id.hex(),
                "tree": frame.tree.hex() if decoded and frame.tree else None,
                "payload": _no_headers(payload),
                "error": f"{type(error).__name__}: {error}",
            }
        view.pop("tape", None)
        return view


def _label(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def comparison(a: TapeView, b: TapeView) -> dict[str, Any]:
    """The report of `jukebox diff A B` as data, with the frames the page highlights: the first
    frame after the shared prefix on each side and the frames of the turns that differ."""
    from jukebox.tape.compare import compare_tapes

    result = compare_tapes(a.tape, b.tape, label_a=a.label, label_b=b.label)
    data = result.to_json()
    turns_a, turns_b = result.a.turns, result.b.turns
    data["differing_frames"] = {
        "a": [turns_a[i].seq for i in result.differing_turns if i < len(turns_a)],
        "b": [turns_b[i].seq for i in result.differing_turns if i < len(turns_b)],
    }
    # The sides' turn lists repeat every prompt and reply: the page shows frames instead.
    for side in ("a", "b"):
        data[side].pop("turns", None)
    return data


def dumps(value: Any) -> str:
    """JSON for the page; non-ASCII kept (smaller), nothing a tape holds is interpreted."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
