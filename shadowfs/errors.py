"""Errors raised by shadowfs. Each message names what is wrong and what to do about it."""

from __future__ import annotations


class ShadowfsError(Exception):
    """Base of every error shadowfs raises on purpose."""


class StoreError(ShadowfsError):
    pass


class ObjectMissing(StoreError):
    def __init__(
        self, oid: object, hint: str = "the store is incomplete; restore it from a copy"
    ) -> None:
        super().__init__(f"object {oid} is missing from the store: {hint}")
        self.oid = oid


class ObjectCorrupt(StoreError):
    def __init__(self, oid: object, where: str) -> None:
        super().__init__(
            f"object {oid} is corrupt ({where}): its bytes no longer hash to its id; "
            "run `jukebox verify` on the store and restore the pack from a copy"
        )
        self.oid = oid
        self.where = where


class TreeError(ShadowfsError):
    pass


class ConflictError(ShadowfsError):
    """A commit found the real tree changed underneath the layer; nothing was applied."""

    def __init__(self, conflicts: list[str]) -> None:
        shown = ", ".join(conflicts[:5]) + (
            f" and {len(conflicts) - 5} more" if len(conflicts) > 5 else ""
        )
        super().__init__(
            f"commit refused: {len(conflicts)} path(s) changed in the real tree since the layer "
            f"started ({shown}); nothing was applied — rebase the work or discard it"
        )
        self.conflicts = conflicts


class StoreBusy(StoreError):
    """gc needs the store to itself while another process is writing to it."""


class CommitInterrupted(ShadowfsError):
    """A signal asked a commit to stop before its commit point; the staging was undone."""


class TargetBusy(ShadowfsError):
    """Another process held a lock on the commit target past the lock timeout."""

    def __init__(self, message: str, holders: list[str]) -> None:
        super().__init__(message)
        self.holders = holders


class CommitBusy(ShadowfsError):
    """Another process is committing into, or recovering, the same journal directory."""
