"""How a name from a tree or a tape is shown to a person, and carried in JSON.

A file name is any bytes but ``/`` and NUL, and an agent picks them: a directory named
``zz\\r\\x1b[3A\\x1b[J...`` printed raw moves the cursor up and erases the review it sits in, and a
bidi override makes ``gpj.exe`` read as ``exe.jpg``. Every place that prints a name prints
``visible(name)``: one escape per character that a terminal would act on or not show, and the
escapes cannot collide with one another or with a name's own characters:

- ``\\\\`` is a literal backslash (so a name spelled ``a\\xc3`` shows as ``a\\\\xc3``);
- ``\\t`` ``\\n`` ``\\r`` and ``\\xNN`` (NN below 0x80) are ASCII controls, DEL included;
- ``\\xNN`` with NN 0x80 or above is a byte that is not valid UTF-8, never a character;
- ``\\uXXXX`` / ``\\UXXXXXXXX`` is a character that is not shown as itself: C1 controls, format
  characters (bidi overrides and isolates, zero-width ones, the BOM), line and paragraph
  separators, spaces other than U+0020, private-use and unassigned code points.

Free text from a tape (an agent's message, a tool's arguments) goes through ``printable``: the
same escapes for what a terminal would act on, backslashes left as they are (text is not a name
to tell apart from another).

JSON carries a name as ``{"path": text}`` when it is valid UTF-8 (JSON's own escapes keep every
character), and as ``{"path": visible(name), "path_b64": base64 of the bytes}`` when it is not:
a reader takes ``path_b64`` when present. docs/reliability.md ("Names in reviews") says so.
"""

from __future__ import annotations

import binascii
import os
import re
import unicodedata

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

# Printable ASCII but the backslash: the common case, returned unchanged without a loop.
_PLAIN = re.compile(r"[\x20-\x5b\x5d-\x7e]*")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r", "\\": "\\\\"}
# Categories a terminal acts on or does not draw as a glyph of its own (see the module doc).
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})


def _escape(ch: str, backslash: bool) -> str:
    if ch == "\\":
        return "\\\\" if backslash else ch
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte surrogateescape kept: not valid UTF-8
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x80:
        return ch if 0x20 <= code < 0x7F else f"\\x{code:02x}"
    if ch == " " or unicodedata.category(ch) not in _HIDDEN:
        return ch
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def visible(name: bytes | str) -> str:
    """``name`` (bytes from a tree, or text) with every hidden or acting character escaped."""
    text = name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name
    if _PLAIN.fullmatch(text):
        return text
    return "".join(_escape(ch, True) for ch in text)


def printable(text: Any) -> str:
    """Free text for a terminal: what ``visible`` escapes, except that backslashes stay."""
    text = text.decode("utf-8", "surrogateescape") if isinstance(text, bytes) else str(text)
    if _PLAIN.fullmatch(text.replace("\\", "")):
        return text
    return "".join(_escape(ch, False) for ch in text)


def printable_lines(text: str) -> str:
    """Multi-line free text (a divergence report): each line escaped, the line breaks kept."""
    return "\n".join(printable(line) for line in text.split("\n"))


def name_json(name: bytes, key: str = "path") -> dict[str, str]:
    """``{key: text}``, plus ``{key}_b64`` with the exact bytes when they are not valid UTF-8."""
    try:
        return {key: name.decode("utf-8")}
    except UnicodeDecodeError:
        # base64.b64encode's output; the base64 module's import (3.6 M instructions) is more
        # than a short `jukebox replay` spends in its own work.
        b64 = binascii.b2a_base64(name, newline=False).decode("ascii")
        return {key: visible(name), f"{key}_b64": b64}


CHANGE_LETTERS = {
    "added": "A", "deleted": "D", "modified": "M", "mode": "m", "type": "T", "link": "L"
}
_SPECIAL_NAMES = {
    "fifo": "fifo", "socket": "unix socket", "chardev": "character device",
    "blockdev": "block device",
}


def entry_note(entry: Any) -> str:
    """What a review says of a tree entry beside its path: ``(12 bytes)``, ``(12 bytes, hard
    link)``, ``(fifo)``, ``(character device 1:3)``; "" for directories and symlinks."""
    if entry is None:
        return ""
    if entry.kind == "file":
        return f"  ({entry.size} bytes{', hard link' if entry.link else ''})"
    what = _SPECIAL_NAMES.get(entry.kind)
    if what is None:
        return ""
    if entry.kind in ("chardev", "blockdev"):
        what += f" {os.major(entry.rdev)}:{os.minor(entry.rdev)}"
    return f"  ({what})"


def change_line(status: str, path: bytes) -> str:
    """``A path``: a tree change as review lists show it."""
    return f"{CHANGE_LETTERS.get(status, '?')} {visible(path)}"
