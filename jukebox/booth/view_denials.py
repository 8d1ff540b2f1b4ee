"""After a run: did the agent trip over what the booth hides or keeps read-only? Say so.

An agent that runs a script from the host's /tmp (the booth's is private and empty) fails with
"No such file or directory" and status 127; `pip install -e .` into a virtualenv outside the
tree fails with "Read-only file system". Both are the booth doing its job, and both look like
the agent's own bug. The kernel keeps no trace of a failed lookup under a cover or of an EROFS,
so the evidence is what the agent printed: the supervisor keeps the last TAIL_BYTES of the
agent's terminal output (or of its stderr, teed through a pipe, when that is not a terminal),
and reads the absolute paths on lines that carry one of those two errors. A path counts only if
the booth's view explains the error — hidden (a cover, the private /tmp) while the host has it,
or read-only (the host, a --ro path) — so a file that is missing everywhere, or one under the
tree, is never blamed on the booth. Each such path becomes one line on stderr naming the flag
that would let the agent at it, and a `note` frame (`event: view_denials`) on the tape, which
records only paths that exist on the host (never text the agent printed).

Cheap: one pipe and one thread, or nothing at all on a terminal (the relay copies the output
anyway), and a regex over 64 KiB once the agent is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading

from jukebox.booth.paths import NOT_HOST
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

    from jukebox.booth.isolation import ChildSpec

TAIL_BYTES = 64 << 10
MAX_HINTS = 5
# How long the tee waits, once the agent is gone, for whoever still holds its stderr (a
# descriptor passed out of the booth) before it stops waiting (it keeps copying meanwhile).
DRAIN_SECONDS = 1.0

_ENOENT = (
    r"No such file or directory|Directory nonexistent|\bnot found\b|[Cc]an't open|"
    r"cannot open|\[Errno 2\]"
)
_EROFS = r"Read-only file system|\[Errno 30\]"
_PATH = r"(?<![\w.~-])(/[^\s'\"`:,;()<>\[\]{}]+)"


class OutputTail:
    """The last `limit` bytes of a stream."""

    def __init__(self, limit: int = TAIL_BYTES) -> None:
        self.limit = limit
        self._data = bytearray()
        self._lock = threading.Lock()

    def add(self, data: bytes) -> None:
        with self._lock:
            self._data += data
            if len(self._data) > self.limit:
                del self._data[: len(self._data) - self.limit]

    def text(self) -> str:
        with self._lock:
            return self._data.decode(errors="replace")


class StderrTee:
    """The agent's stderr through a pipe to this process's fd 2, its tail kept in `tail`."""

    def __init__(self, tail: OutputTail, target: int = 2) -> None:
        self.tail = tail
        self._target = target
        # Close-on-exec: only the agent, given it as its stderr, holds the write end.
        self._read, self.write_fd = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._copy, name="jukebox-stderr", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Once the agent is gone: ours was the last write end but for a descriptor passed out
        of the booth, which is not waited for past DRAIN_SECONDS."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
        self._thread.join(DRAIN_SECONDS)

    def _copy(self) -> None:
        writing = True
        try:
            while data := os.read(self._read, 65536):
                self.tail.add(data)
                view = memoryview(data)
                while writing and view:
                    try:
                        view = view[os.write(self._target, view) :]
                    except OSError:
                        writing = False  # our stderr is gone: keep draining the agent's
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(self._read)


class Denial(Value):
    __slots__ = FIELDS = ("path", "error", "why", "under", "flag")
    path: str
    error: str  # ENOENT | EROFS
    why: str  # private_tmp | hidden | read-only
    under: str  # the cover, the kept path, or "/" (the host)
    flag: str  # what would let the agent at it

    def __init__(self, path: str, error: str, why: str, under: str, flag: str) -> None:
        setfield(self, "path", path)
        setfield(self, "error", error)
        setfield(self, "why", why)
        setfield(self, "under", under)
        setfield(self, "flag", flag)

    def message(self) -> str:
        if self.why == "private_tmp":
            return (
                f"the agent could not find {self.path}: the booth's /tmp is private and empty; "
                f"pass {self.flag} to show it read-only (--rw to let it write there; or "
                "--no-private-tmp)"
            )
        if self.why == "hidden":
            return (
                f"the agent could not find {self.path}: the booth hides {self.under} (the image "
                f"or --hide); pass {self.flag} to show it read-only (--rw to let it write there)"
            )
        return (
            f"the agent could not write in {self.path}: it is read-only in the booth; if it must "
            f"write there, pass {self.flag} (a hole in the booth: those writes are neither "
            "recorded nor undone; docs/booth.md)"
        )

    def to_json(self) -> dict[str, Any]:
        return self.fields_dict()  # every field a str: asdict's copy, one level deep


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _layout(spec: ChildSpec) -> list[tuple[str, str]]:
    """(path, what the agent finds there) for every path the view sets apart from the host."""
    real = os.path.realpath
    out = [(real(p), "writable") for p in spec.keep]
    out += [(real(p), "read-only") for p in (*spec.keep_tools, *spec.keep_readonly)]
    out += [(real(p), "hidden") for p in spec.hide]
    out.append(("/dev", "own"))
    if spec.private_tmp:
        out.append(("/tmp", "private_tmp"))
    return out


def _where(path: str, layout: list[tuple[str, str]], readonly_host: bool) -> tuple[str, str]:
    """What the agent finds at `path`: the deepest entry of the layout above it wins, as the
    view stacks them (a kept path inside a cover is on top of it, and the other way round)."""
    best = ("/", "read-only" if readonly_host else "writable")
    for prefix, kind in layout:
        if _is_under(path, prefix) and len(prefix) >= len(best[0]):
            best = (prefix, kind)
    return best


def _writable_suggestion(path: str, under: str) -> str:
    """What to name in --rw: the virtualenv the path is in, else the path when the host has it,
    else its nearest existing directory (a file to be created), never above `under` (the
    read-only kept path it is in, or / for the host)."""
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    probe = existing
    while probe != "/" and _is_under(probe, under):
        if os.path.isfile(os.path.join(probe, "pyvenv.cfg")):
            return probe
        probe = os.path.dirname(probe)
    return existing if _is_under(existing, under) else under


def view_denials(text: str, spec: ChildSpec, never: tuple[str, ...] = ()) -> list[Denial]:
    """The paths in the agent's output (`text`) whose error the booth's view explains; never
    one under `never` (the tape dir, the commit key's dir: no flag opens those)."""
    if "/" not in text:  # no path to name (most runs: the agent said nothing of the kind)
        return []
    # Compiled here, not at import: a booth's start, where the module is imported, need not.
    enoent, erofs, paths = re.compile(_ENOENT), re.compile(_EROFS), re.compile(_PATH)
    layout = _layout(spec)
    never = (*never, *NOT_HOST)  # no flag keeps those either
    found: dict[str, Denial] = {}
    for line in text.splitlines():
        error = "EROFS" if erofs.search(line) else "ENOENT" if enoent.search(line) else None
        if error is None:
            continue
        for match in paths.finditer(line):
            path = os.path.normpath(match.group(1).rstrip("."))
            if any(_is_under(path, n) for n in never):
                continue
            under, kind = _where(path, layout, spec.readonly_root)
            denial = _denial(path, error, under, kind)
            if denial is not None and denial.flag not in {d.flag for d in found.values()}:
                found[path] = denial
            if len(found) >= MAX_HINTS:
                return list(found.values())
    return list(found.values())


def _denial(path: str, error: str, under: str, kind: str) -> Denial | None:
    if error == "ENOENT" and kind in ("private_tmp", "hidden"):
        # Only what the host has: a file missing everywhere is not the booth's doing. A file
        # to be made in a hidden directory the host has names that directory (not the cover).
        if not os.path.lexists(path):
            path = os.path.dirname(path)
            if path == under or not _is_under(path, under) or not os.path.isdir(path):
                return None
        return Denial(path, error, kind, under, f"--ro {path}")
    if error == "EROFS" and kind == "read-only":
        target = _writable_suggestion(path, under)
        if target == "/":
            return None  # nothing to suggest: the whole host is never a hole
        return Denial(target, error, kind, under, f"--rw {target}")
    return None

