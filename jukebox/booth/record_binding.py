"""A pending booth's record, bound to its tape: what `booth commit`, `diff` and `discard` trust.

`.jukebox/booths/<id>.json` is a plain file beside the tapes, outside the hash chain: whoever
hands over a tape dir can edit it. Its fields are a cache of what the tape says, never an
authority: before a record is acted on, `bound_tape` checks that

* its tape is `<tape dir>/<id>.jbx`, whatever its `tape` field says (a record cannot point
  at another tape; a tape dir moved or copied elsewhere still finds its own),
* that tape's hash chain holds (every record id, parent link, seq and Merkle root),
* every record field that run_start also carries (the tree's path, the base tree, the name,
  and whatever later fields both carry, such as the tree's identity) has the same value there,
  and run_start names the booth and the tape by the record's id,
* the final tree is the one the tape's exit `fs` frame recorded.

A mismatch is tampering (exit 1), reported in one line naming the field; nothing is written.
The chain makes an edit of the record or of one frame evident; it is no signature: a tape dir
forged whole, tape and record, passes it. So a commit also asks for the record's *seal*: a
BLAKE3 keyed hash of the fields it acts on (`SEALED`), made when the booth saved its record with
the key only this user holds (`jukebox.trees.realtree.commit_key`). A booth from a received tape dir
carries its sender's seal, or none, and is never committed; `diff` and `discard` do not need it.
A user with no writable home has no key: their seals are plain hashes, which bind nothing.
"""

from __future__ import annotations

import os

from jukebox.errors import CheckFailed

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from jukebox.booth.supervisor import BoothRecord
    from jukebox.tape.tape import Tape
    from jukebox.tape.tapedir import TapeDir
    from shadowfs.objects import ObjectStore

# Record fields that are the record's own bookkeeping, whatever run_start holds under the name.
_OWN = frozenset({"id", "tape", "created", "status", "final_tree", "pid", "agent_status",
                  "verify", "note", "seal", "mcp_staged", "mcp_servers"})  # fmt: skip
# What the seal covers: where a commit writes and what it writes there.
SEALED = ("id", "tree", "tree_dev", "tree_ino", "base_tree", "final_tree")


class RecordMismatch(CheckFailed):
    def __init__(self, booth_id: str, where: str, field: str, detail: str) -> None:
        super().__init__(
            f"booth {booth_id}: its record {where} does not match its tape: field {field!r} "
            f"{detail}; the record was altered, so nothing was done (remove it by hand if it "
            "is not yours)"
        )
        self.field = field


def record_seal(record: BoothRecord) -> str:
    """This user's seal of the record's `SEALED` fields (see the module docstring)."""
    from blake3 import blake3

    from jukebox.tape.frame import canonical_json
    from jukebox.trees.realtree import commit_key

    sealed = {key: getattr(record, key, None) for key in SEALED}
    # Staged MCP calls run on the host at the commit, against the servers named here: sealed
    # too, when there are any (records without them keep the seals they had).
    for key in ("mcp_staged", "mcp_servers"):
        if getattr(record, key, None):
            sealed[key] = getattr(record, key)
    body = canonical_json(sealed)
    seal_key = commit_key()  # made now if this user has none yet: never compare against no key
    return (blake3(body, key=seal_key) if seal_key is not None else blake3(body)).hexdigest()


class NotSealed(CheckFailed):
    def __init__(self, booth_id: str) -> None:
        super().__init__(
            f"booth {booth_id} was not run by this user here: its record carries no seal of "
            "yours (a booth from a received tape dir, or recorded before seals), so it is never "
            f"committed; review it with `jukebox booth diff {booth_id}`, re-run it with "
            "`jukebox replay --exec`, or drop it with `jukebox booth discard`"
        )


def bound_tape(
    tape_dir: TapeDir, booth_id: str, record: BoothRecord, store: ObjectStore | None = None, *,
    sealed: bool = False,
) -> Tape:  # fmt: skip
    """The record's tape, loaded and checked against the record (see the module docstring);
    with ``sealed`` (a commit) the record must also carry this user's seal."""
    from jukebox.tape.tape import Tape

    where = os.fspath(tape_dir.booths_path / f"{booth_id}.json")

    def mismatch(field: str, detail: str) -> RecordMismatch:
        return RecordMismatch(booth_id, where, field, detail)

    if record.id != booth_id:
        raise mismatch("id", f"is {record.id!r}, not the booth id {booth_id!r} it is filed under")
    expected = tape_dir.tape_path(booth_id)
    record.tape = os.fspath(expected)  # what commit and discard append their frame to
    if not expected.is_file():
        raise mismatch("tape", f"names {expected}, which is missing")
    tape = Tape.load(expected, store)
    tape.check_chain()
    if not tape.frames or tape.frames[0].kind != "run_start":
        raise mismatch("tape", f"names {expected}, which has no run_start frame")
    first = tape.frames[0]
    start = first.resolve_payload(store) if store is not None else first.payload
    for key in ("booth", "tape_id"):
        if start.get(key) != booth_id:
            raise mismatch("id", f"is {booth_id!r} but the tape's run_start {key} is "
                           f"{start.get(key)!r}")  # fmt: skip
    fields = record.to_json()
    for key in sorted(set(fields) - _OWN):
        if key in start and fields[key] != start[key]:
            raise mismatch(key, f"is {fields[key]!r} but the tape's run_start says {start[key]!r}")
        if key not in start and fields[key] is not None and key != "name":
            raise mismatch(key, "is not recorded in the tape's run_start")
    if first.tree is None or first.tree.hex() != record.base_tree:
        raise mismatch("base_tree", "is not the tree the tape's run_start frame carries")
    if record.final_tree is not None:
        final = next(
            (f for f in reversed(tape.frames)
             if f.kind == "fs" and f.payload.get("reason") == "exit" and f.tree is not None),
            None,
        )  # fmt: skip
        # final.tree is not None: the search above takes only frames with a tree
        if final is None or final.tree.hex() != record.final_tree:  # type: ignore[union-attr]
            raise mismatch("final_tree", "is not the tree the tape's exit fs frame recorded")
    if sealed and record.seal != record_seal(record):
        raise NotSealed(booth_id)
    return tape
