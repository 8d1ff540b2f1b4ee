"""Why a tape could not be read or did not verify: one class per failure, one line each.

A file that is not a tape, or a tape from a newer format, is an input error (exit 2). Everything
else means the tape, or the store behind it, failed the check (exit 1).
"""

from __future__ import annotations

import os

from jukebox.errors import CheckFailed, JukeboxError


def _name(path: str | os.PathLike[str] | None) -> str:
    return os.fspath(path) if path is not None else "the tape"


class NotATape(JukeboxError):
    def __init__(self, path: str | os.PathLike[str] | None, found: bytes = b"") -> None:
        super().__init__(
            f"{_name(path)} is not a Jukebox tape (it does not start with the JBX tape magic, "
            f"found {found[:8]!r}); pass a .jbx file written by jukebox"
        )
        self.path = path


class UnsupportedVersion(JukeboxError):
    def __init__(self, path: str | os.PathLike[str] | None, detail: str) -> None:
        super().__init__(
            f"{_name(path)} {detail}; this jukebox reads tape format version 1 — "
            "upgrade jukebox to read it"
        )
        self.path = path


class TapeProblem(CheckFailed):
    """Base of every way a tape can fail verification."""


class TornTape(TapeProblem):
    def __init__(
        self, path: str | os.PathLike[str] | None, offset: int, reason: str, intact: int
    ) -> None:
        super().__init__(
            f"{_name(path)} ends in a torn record at byte {offset} ({reason}); the {intact} "
            "frame(s) before it are intact — the writer was interrupted: reopen the tape for "
            "appending to cut the tail off, or keep only the intact prefix"
        )
        self.path = path
        self.offset = offset
        self.reason = reason
        self.intact = intact


class TamperedTape(TapeProblem):
    def __init__(self, path: str | os.PathLike[str] | None, seq: int, what: str) -> None:
        super().__init__(
            f"{_name(path)} was altered at frame {seq}: {what}; nothing from frame {seq} on "
            "can be trusted — restore the tape from a copy"
        )
        self.path = path
        self.seq = seq
        self.what = what


class MissingObject(TapeProblem):
    def __init__(self, path: str | os.PathLike[str] | None, seq: int, oid: object) -> None:
        super().__init__(
            f"{_name(path)} frame {seq} references object {oid}, which is missing from the "
            "store; point jukebox at the store this tape was recorded with, or restore it"
        )
        self.path = path
        self.seq = seq
        self.oid = oid


class CorruptObject(TapeProblem):
    def __init__(
        self, path: str | os.PathLike[str] | None, seq: int, oid: object, detail: str
    ) -> None:
        super().__init__(
            f"{_name(path)} frame {seq} references object {oid}, which is corrupt in the store "
            f"({detail}); restore the store's damaged pack from a copy"
        )
        self.path = path
        self.seq = seq
        self.oid = oid
        self.detail = detail
