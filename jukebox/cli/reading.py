"""What `replay`, `verify`, `log` and the commands that show a tape share, without click: the
fast path of `jukebox replay TAPE` (jukebox.cli.fast) runs `replay_offline` with none of click
imported, the click command (jukebox.cli.tapes) the same function."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jukebox.cli import echo, skip_teardown

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any


def emit_json(value: Any) -> None:
    echo(json.dumps(value, indent=2, sort_keys=True))


def open_store(tape_dir, *, create: bool = False):
    """The tape dir's store, or None when there is none yet (a tape with no objects needs none)."""
    from shadowfs.store import Store

    if not create and not tape_dir.store_path.is_dir():
        return None
    return Store.open(tape_dir.store_path, create=create)


def load(ref):
    from jukebox.tape.tape import Tape

    return Tape.load(ref.path, open_store(ref.tape_dir))


def load_intact(ref):
    """The tape, refused (exit 1, one line) when its hash chain breaks anywhere: what a command
    acts on or shows as the files of a frame must come from a tape the chain vouches for."""
    tape = load(ref)
    tape.check_chain()
    return tape


def whole_tape(ref, command: str, instead: str) -> None:
    """Refuse TAPE@N where ``command`` works on a whole tape: the frame would be ignored.
    ``instead`` says what to do, with ``{n}`` for the frame given."""
    n = ref.frame
    if n is not None:
        from jukebox.errors import UsageError

        raise UsageError(
            f"`jukebox {command}` takes a whole tape, not frame @{n}: " + instead.format(n=n)
        )


def check_frame(tape, ref) -> int:
    n = ref.frame if ref.frame is not None else len(tape.frames) - 1
    if not 0 <= n < len(tape.frames):
        from jukebox.errors import UsageError

        raise UsageError(
            f"{ref.path} has {len(tape.frames)} frame(s), numbered 0 to {len(tape.frames) - 1}: "
            f"there is no frame {n}"
        )
    return n


def frame_rows(tape) -> list[dict[str, Any]]:
    """The frames the hash chain vouches for (all of them, on an intact tape)."""
    start = tape.frames[0].time_ns if tape.frames else 0
    return [
        {
            "seq": f.seq,
            "kind": f.kind,
            "time_ns": f.time_ns,
            "offset_ns": f.time_ns - start,
            "id": f.id.hex(),
            "tree": f.tree.hex() if f.tree else None,
            "payload": f.payload,
        }
        for f in tape.intact_frames
    ]


def timeline(tape) -> str:
    from jukebox.display.render import describe, seconds, table

    rows = []
    for row in frame_rows(tape):
        tree = row["tree"][:12] if row["tree"] else ""
        rows.append(
            [
                f"@{row['seq']}",
                "+" + seconds(row["offset_ns"]),
                row["kind"],
                tree,
                describe(row["kind"], row["payload"]),
            ]
        )
    return table(["FRAME", "AT", "KIND", "TREE", "WHAT"], rows, right=(1,))


def verify_report(tape, progress=None) -> dict[str, Any]:
    report = tape.verify(check_objects=tape.store is not None, deep=True, progress=progress)
    return {
        "ok": report.ok,
        "head": report.head.to_json(),
        "problems": [str(p) for p in report.problems],
        "objects_checked": tape.store is not None,
        "_report": report,
    }


def reconstruct_states(tape, progress=None) -> int:
    """Walks every file state the tape names and checks each object it needs is in the store.

    Shared subtrees are walked once, so a long tape of small steps costs what changed.
    """
    from jukebox.tape.errors import MissingObject
    from shadowfs import tree

    store = tape.store
    seen: set[bytes] = set()
    states = 0
    for frame in tape.frames:
        if frame.tree is None:
            continue
        states += 1
        if store is None:
            raise MissingObject(tape.path, frame.seq, frame.tree)
        pending = [frame.tree]
        while pending:
            oid = pending.pop()
            if oid in seen:
                continue
            seen.add(oid)
            if not store.has(oid):
                raise MissingObject(tape.path, frame.seq, oid)
            for entry in tree.read_tree(store, oid):
                if entry.kind == "dir":
                    pending.append(entry.oid)
                elif entry.oid is not None and entry.oid not in seen:
                    seen.add(entry.oid)
                    if not store.has(entry.oid):
                        raise MissingObject(tape.path, frame.seq, entry.oid)
        if progress:
            progress(frame.seq + 1, len(tape.frames))
    return states


def replay_offline(tape: str, tape_dir: Path | None, as_json: bool) -> None:
    """`jukebox replay TAPE` without --exec: verify the tape, then walk every frame's files."""
    from jukebox.tape.tapedir import TapeRef

    ref = TapeRef.parse(tape, tape_dir)
    whole_tape(
        ref, "replay", "drop the @{n} (--exec --until {n} serves frames 0..{n}, then goes live)"
    )
    # It only reads (the tape, the store): nothing to close that the process's end does not.
    skip_teardown()
    loaded = load(ref)
    from jukebox.cli.fast import resume_gc
    from jukebox.display.progress import step

    resume_gc()  # paused by jukebox.cli.fast while the command started and read the tape

    with step("verifying the tape", "frames", done="verified the tape") as tick:
        result = verify_report(loaded, tick)
    report = result.pop("_report")
    if not report.ok:
        if as_json:
            emit_json(result)
            sys.exit(1)
        report.raise_for_problems()
    with step("rebuilding file states", "frames", done="rebuilt the file states") as tick:
        states = reconstruct_states(loaded, progress=tick)
    summary = loaded.summary()
    if as_json:
        emit_json(
            {**result, "summary": summary, "file_states": states, "frames": frame_rows(loaded)}
        )
        return
    from jukebox.display.names import printable
    from jukebox.display.render import money, seconds

    echo(timeline(loaded))
    head = report.head
    echo(
        f"replayed {head.count} frame(s) of {printable(summary['tape_id'])} offline: "
        f"{states} file state(s) "
        f"rebuilt, {money(summary['cost_usd'])} recorded, "
        f"{seconds(summary['duration_ns'])} of run time, "
        f"status {summary['status']}"
    )
    echo(f"verified: hash chain and merkle root {head.merkle_root.hex()}")
