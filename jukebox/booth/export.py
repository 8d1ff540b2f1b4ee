"""`jukebox booth export ID`: a pending booth's changes as one git-format patch.

The output is what `git format-patch` writes for one commit (an mbox message: From, Date,
Subject, a body, then `diff --git` sections), so `git am change.patch` makes a commit of it and
`git apply change.patch` applies it to a checkout of the booth's base tree. Text files get
unified diffs byte for byte (any encoding, `\\ No newline at end of file` included); a file git
would call binary (a NUL in its first 8000 bytes) gets a `GIT binary patch` (both directions,
so `git apply -R` works too); symlinks are mode 120000 with their target as content; the
executable bit is the only mode git carries. Directories and special files (fifos, sockets,
devices) are not in a git patch: an empty directory the booth made, and every special file it
changed, is named in the message body and left out.

Every `index` line carries the full git blob ids of both sides, which `git apply` checks a
binary patch against and `git am -3` uses to fall back to a three-way merge.
"""

from __future__ import annotations

import base64
import difflib
import email.utils
import hashlib
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jukebox import __version__

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

ZERO_ID = "0" * 40
# git's binary test: a NUL within the first 8000 bytes (xdiff's FIRST_FEW_BYTES).
BINARY_PROBE = 8000
_GIT_MODES = {"symlink": "120000", "exec": "100755", "file": "100644"}
# How git quotes a path (quote_c_style, core.quotePath on): these named, other controls, DEL and
# non-ASCII bytes as octal.
_NAMED = {7: b"\\a", 8: b"\\b", 9: b"\\t", 10: b"\\n", 11: b"\\v", 12: b"\\f", 13: b"\\r",
          34: b'\\"', 92: b"\\\\"}  # fmt: skip
_LINES = re.compile(rb"[^\n]*\n|[^\n]+\Z")


@dataclass(frozen=True)
class Side:
    """One side of a file in a git patch: its git mode and bytes."""

    mode: str
    data: bytes

    @property
    def blob_id(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()


@dataclass
class Export:
    patch: bytes
    files: int  # diff --git sections written
    binary: int  # of which binary patches
    dirs_left_out: list[bytes]  # directories the booth added empty: no git patch holds them
    specials_left_out: list[bytes]  # fifos, sockets, devices: no git patch holds them either


def _side(store: ObjectReader, entry: Any) -> Side | None:
    if entry is None or entry.kind not in ("file", "symlink"):
        return None  # a directory, or a special file (fifo, socket, device): not in git
    if entry.kind == "symlink":
        return Side(_GIT_MODES["symlink"], entry.target or b"")
    data = store.read_bytes(entry.oid) if entry.oid is not None else b""
    return Side(_GIT_MODES["exec" if entry.mode & 0o111 else "file"], data)


def git_quote(path: bytes) -> bytes:
    """``path`` as git writes it in a patch: bare when plain, else C-quoted."""
    if all(0x20 <= b < 0x7F and b not in (34, 92) for b in path):
        return path
    out = bytearray(b'"')
    for b in path:
        if b in _NAMED:
            out += _NAMED[b]
        elif b < 0x20 or b >= 0x7F:
            out += b"\\%03o" % b
        else:
            out.append(b)
    return bytes(out + b'"')


def _prefixed(prefix: bytes, path: bytes) -> bytes:
    quoted = git_quote(path)
    return b'"' + prefix + quoted[1:] if quoted.startswith(b'"') else prefix + quoted


def _binary_literal(data: bytes) -> bytes:
    """One `literal` hunk of a git binary patch: zlib, then base85 in lines of 52 bytes, each
    led by its length (A-Z for 1-26, a-z for 27-52). Python's b85 alphabet is git's."""
    packed = zlib.compress(data, 9)
    out = [b"literal %d\n" % len(data)]
    for start in range(0, len(packed), 52):
        chunk = packed[start : start + 52]
        n = len(chunk)
        out.append(bytes([ord("A") + n - 1 if n <= 26 else ord("a") + n - 27]))
        out.append(base64.b85encode(chunk, pad=True) + b"\n")
    return b"".join(out) + b"\n"


def _hunks(old: bytes, new: bytes) -> Iterator[bytes]:
    """Unified diff hunks of two texts, byte-exact: lines are compared as latin-1 text (one
    character per byte, any encoding round-trips) with their endings kept."""
    a = [m.decode("latin-1") for m in _LINES.findall(old)]
    b = [m.decode("latin-1") for m in _LINES.findall(new)]
    for i, line in enumerate(difflib.unified_diff(a, b, lineterm="")):
        if i < 2:  # difflib's own ---/+++ lines: ours carry git's names
            continue
        raw = line.encode("latin-1")
        if raw.startswith(b"@@"):
            yield raw + b"\n"
        elif raw.endswith(b"\n"):
            yield raw
        else:
            yield raw + b"\n\\ No newline at end of file\n"


def is_binary(side: Side | None) -> bool:
    return side is not None and b"\0" in side.data[:BINARY_PROBE]


def file_patch(path: bytes, old: Side | None, new: Side | None) -> tuple[bytes, bool]:
    """The `diff --git` section turning ``old`` into ``new`` at ``path`` (None: no file there),
    and whether it is a binary patch."""
    a, b = _prefixed(b"a/", path), _prefixed(b"b/", path)
    out = [b"diff --git %s %s\n" % (a, b)]
    old_id = old.blob_id if old else ZERO_ID
    new_id = new.blob_id if new else ZERO_ID
    index = b"index %s..%s" % (old_id.encode(), new_id.encode())
    if old is None and new is not None:
        out += [b"new file mode %s\n" % new.mode.encode(), index + b"\n"]
    elif new is None and old is not None:
        out += [b"deleted file mode %s\n" % old.mode.encode(), index + b"\n"]
    elif old is not None and new is not None:
        if old.mode != new.mode:
            out += [b"old mode %s\n" % old.mode.encode(), b"new mode %s\n" % new.mode.encode()]
            if old.data == new.data:
                return b"".join(out), False
            out.append(index + b"\n")
        else:
            out.append(index + b" %s\n" % new.mode.encode())
    old_data = old.data if old else b""
    new_data = new.data if new else b""
    if is_binary(old) or is_binary(new):
        out += [b"GIT binary patch\n", _binary_literal(new_data), _binary_literal(old_data)]
        return b"".join(out), True
    if old_data == new_data:  # an empty file added or deleted: the header says it all
        return b"".join(out), False
    out.append(b"--- %s\n" % (a if old is not None else b"/dev/null"))
    out.append(b"+++ %s\n" % (b if new is not None else b"/dev/null"))
    out.extend(_hunks(old_data, new_data))
    return b"".join(out), False


def _sections(store: ObjectReader, change: Any) -> list[tuple[Side | None, Side | None]]:
    """The (old, new) file pairs one tree change makes in a git patch: none for a directory,
    a delete and an add where git cannot change a file's type in place."""
    old, new = _side(store, change.old), _side(store, change.new)
    if old is None and new is None:
        return []
    if change.status == "type" and old is not None and new is not None:
        return [(old, None), (None, new)]
    if old is not None and new is not None and old == new:
        return []  # a mode git does not carry (0644 to 0600): nothing to say
    return [(old, new)]


def added_empty_dirs(changes: Sequence[Any]) -> list[bytes]:
    """The directories ``changes`` (all of a booth's, sorted by path) add with nothing in them."""
    added = [c.path for c in changes if c.status in ("added", "type") and c.new is not None
             and c.new.kind == "dir"]  # fmt: skip
    below = {p.rsplit(b"/", 1)[0] for p in (c.path for c in changes) if b"/" in p}
    return [p for p in added if p not in below]


def _header_text(text: str) -> str:
    """One line of a mail header: controls and newlines out, RFC 2047 for non-ASCII."""
    from email.header import Header

    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    return flat if flat.isascii() else Header(flat, "utf-8").encode()


def export_patch(
    store: ObjectReader,
    changes: Sequence[Any],
    *,
    subject: str,
    body: str,
    date: float,
    empty_dirs: Sequence[bytes] = (),
) -> Export:
    """The mbox message of ``changes`` (shadowfs.tree.Change, sorted by path); the body names
    ``empty_dirs``."""
    sections: list[bytes] = []
    binary = 0
    dirs_left_out = list(empty_dirs)
    specials = [
        c.path for c in changes
        if any(e is not None and e.kind not in ("file", "symlink", "dir") for e in (c.old, c.new))
    ]  # fmt: skip
    for change in changes:
        for old, new in _sections(store, change):
            text, is_bin = file_patch(change.path, old, new)
            sections.append(text)
            binary += is_bin
    from jukebox.display.names import visible

    if dirs_left_out:
        body += "\n\nEmpty directories added by the booth, which a git patch cannot hold:\n"
        body += "".join(f"  {visible(p)}\n" for p in dirs_left_out)
    if specials:
        body += "\n\nSpecial files (fifos, sockets, devices) changed, which git cannot hold:\n"
        body += "".join(f"  {visible(p)}\n" for p in specials)
    header = (
        f"From {ZERO_ID} Mon Sep 17 00:00:00 2001\n"
        f"From: Jukebox <jukebox@localhost>\n"
        f"Date: {email.utils.formatdate(date, localtime=True)}\n"
        f"Subject: [PATCH] {_header_text(subject)}\n"
        "MIME-Version: 1.0\n"
        "Content-Type: text/plain; charset=UTF-8\n"
        "Content-Transfer-Encoding: 8bit\n\n"
    )
    # A body line `---` or `diff ` would end the message early for `git am`: indent them.
    body_lines = [" " + ln if ln.startswith(("---", "diff ")) else ln for ln in body.splitlines()]
    message = header + "\n".join(body_lines).rstrip() + "\n---\n\n"
    trailer = f"-- \njukebox {__version__}\n\n"
    return Export(
        message.encode() + b"".join(sections) + trailer.encode(),
        len(sections),
        binary,
        dirs_left_out,
        specials,
    )
