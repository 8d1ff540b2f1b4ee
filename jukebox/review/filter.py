"""Which changed paths a review leaves out: `booth diff --exclude GLOB` and the default list.

An agent that installs packages or runs Python leaves thousands of changes nobody reads
(`.venv`, `__pycache__`, `node_modules`, git's object files); the review hides them by default
and says how many it hid. The patterns are gitignore-like, matched with fnmatch on the path's
`/`-separated components:

* a pattern without `/` (`__pycache__`, `*.pyc`) matches a path any of whose components matches
  it: the file of that name and everything under a directory of that name;
* a pattern with `/` (`.git/objects`, `build/*.o`) is anchored at the tree's root and matches the
  path or any directory above it.

Hiding is for reading only: `booth commit` still applies every change unless given `--only`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

DEFAULT_EXCLUDES: tuple[str, ...] = (".git/objects", ".venv", "__pycache__", "node_modules")


@dataclass
class ReviewFilter:
    patterns: tuple[str, ...]
    defaults: bool = False  # the default list is among the patterns
    hidden: int = 0  # changes left out so far
    # Patterns are matched on text: a name that is not valid UTF-8 keeps its bytes escaped.
    _split: list[tuple[bool, list[str]]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        for pattern in self.patterns:
            parts = [p for p in pattern.split("/") if p]
            self._split.append((len(parts) > 1 or pattern.startswith("/"), parts))

    @classmethod
    def from_options(cls, excludes: Sequence[str], defaults: bool) -> ReviewFilter:
        from jukebox.errors import UsageError

        for pattern in excludes:
            if not pattern.strip("/"):
                raise UsageError(f"--exclude {pattern!r} matches nothing: give a name or a glob")
        chosen = (DEFAULT_EXCLUDES if defaults else ()) + tuple(excludes)
        return cls(tuple(dict.fromkeys(chosen)), defaults=defaults)

    def excludes(self, path: bytes | str) -> bool:
        text = path.decode("utf-8", "surrogateescape") if isinstance(path, bytes) else path
        parts = text.split("/")
        for anchored, pattern in self._split:
            if anchored:
                depth = len(pattern)
                if len(parts) >= depth and all(
                    fnmatchcase(part, glob) for part, glob in zip(parts, pattern, strict=False)
                ):
                    return True
            elif any(fnmatchcase(part, pattern[0]) for part in parts):
                return True
        return False

    def keep(self, changes: Iterable[Any]) -> list[Any]:
        """The changes (anything with a `.path`) not excluded; counts the others in `hidden`."""
        kept = []
        for change in changes:
            if self.excludes(change.path):
                self.hidden += 1
            else:
                kept.append(change)
        return kept

    def hidden_note(self, command: str) -> str | None:
        """One line saying what was left out and how to see it, or None when nothing was."""
        if not self.hidden:
            return None
        how = "--no-default-excludes" if self.defaults else ""
        if len(self.patterns) > (len(DEFAULT_EXCLUDES) if self.defaults else 0):
            how = (how + " and no --exclude").strip()
        return (
            f"{self.hidden} change(s) hidden ({', '.join(self.patterns)}): "
            f"`{command}` with {how} shows them"
        )
