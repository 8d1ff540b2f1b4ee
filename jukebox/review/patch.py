"""Line diffs of the text files a tree change touches, for a person to review.

`jukebox diff -p` (between frames) and `jukebox booth diff -p` (what a commit would do) both
print them under each change line. Names and the files' own lines are escaped visibly
(jukebox.display.names): a review must show an escape sequence, never let the terminal act on it.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from jukebox.display.names import printable, visible

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

# Beyond this a line diff is unreadable and slow to compute; the change line says it changed.
PATCH_MAX_BYTES = 1 << 20
# git's test: a NUL in the first 8 KiB makes a file binary.
BINARY_PROBE = 8192
INDENT = "     "


def _side(store: ObjectReader, entry: Any) -> bytes | None:
    """The file's bytes, b"" for no file on this side, None for something that is no file."""
    if entry is None:
        return b""
    if entry.kind != "file":
        return None
    return store.read_bytes(entry.oid) if entry.oid is not None else b""


def text_patch(store: ObjectReader, change: Any, indent: str = INDENT) -> str:
    """The unified diff of ``change`` (a shadowfs.tree.Change), each line after ``indent``; one
    note for a binary or large file; "" when neither side is a regular file."""
    sizes = [e.size for e in (change.old, change.new) if e is not None and e.kind == "file"]
    if not sizes or change.status == "mode":
        return ""
    if max(sizes) > PATCH_MAX_BYTES:
        return f"{indent}(large file: no line diff)\n"
    old, new = _side(store, change.old), _side(store, change.new)
    if old is None or new is None:  # a type change: the file side is listed on its own line
        return ""
    if b"\0" in old[:BINARY_PROBE] or b"\0" in new[:BINARY_PROBE]:
        return f"{indent}(binary file)\n"
    name = visible(change.path)
    lines = difflib.unified_diff(
        old.decode("utf-8", "replace").splitlines(keepends=True),
        new.decode("utf-8", "replace").splitlines(keepends=True),
        f"a/{name}" if change.old is not None else "/dev/null",
        f"b/{name}" if change.new is not None else "/dev/null",
    )
    # The file's own lines may hold escape sequences too: shown, not acted on.
    return "".join(indent + printable(line.rstrip("\n")) + "\n" for line in lines)
