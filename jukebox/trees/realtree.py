"""The real tree a booth commits into: its identity, the commit job, and the recovery of commits a
kill interrupted.

**Identity.** A booth opens its tree once, from / one component at a time with O_NOFOLLOW, and
records the directory's device and inode (`tree_dev`, `tree_ino`) in `run_start` and in the booth
record. A commit opens the recorded path the same way and refuses (CheckFailed, exit 1, nothing
written) unless it reaches that very directory: whoever owns the tree's parent may swap the tree
for a symlink or another directory between the booth and the commit, and root's commit must not
follow. Every write then goes through that fd (`shadowfs.commit` works relative to it).

**Commit job.** `.jukebox/commit-journals/<booth id>/` holds shadowfs's redo journal and an
*intent* (the tree, its identity, the base and final trees, who committed), flocked by the
committing process from before the intent is written until the verdict frame is on the tape and
the booth record retired. A process killed anywhere in between leaves the directory behind
(``SHADOWFS_CRASH_AT=retire`` kills it after the verdict, before the directory goes).

**Recovery.** Every command that opens a tape dir (`TapeDir.resolve`) first recovers such
directories whose lock nobody holds: shadowfs's journal is redone (exactly the new tree) or its
staging undone (exactly the old tree); with no journal left, the touched paths tell a finished
commit from one that never began. It says so in one line on stderr and writes the verdict on the
booth's tape: a `commit` frame, or a `note` (`commit_interrupted`) when the booth stays pending.

**Trust.** A tape dir may come from someone else. Journals and intents are sealed with a key
only this user holds (`$XDG_STATE_HOME/jukebox/commit.key`, 0600), so a planted journal is never
run: it is reported and left alone. A user with no writable home has no key, and their journals
are sealed without one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from blake3 import blake3

from jukebox.errors import CheckFailed, JukeboxError, UsageError
from jukebox.tape.tapedir import TapeDir, check_tape_id
from shadowfs.oid import ObjectId
from shadowfs.privacy import make_private_dirs

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

    from shadowfs.objects import ObjectReader, ObjectStore

INTENT_NAME = "intent.json"
LOCK_TIMEOUT_ENV = "JUKEBOX_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 30.0
KEY_SIZE = 32


class Interrupted(JukeboxError):
    """A signal stopped a commit: undone before its commit point, finished after it."""

    exit_code = 130


# --------------------------------------------------------------------------- identity


def open_tree(path: str) -> tuple[int, int, int]:
    """(fd, st_dev, st_ino) of the booth's tree at the canonical ``path``, opened with no
    symlink followed anywhere on the way."""
    from shadowfs.nofollow import dir_identity, open_dir_nofollow

    try:
        fd = open_dir_nofollow(path)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"cannot open the tree {path} without following a symlink ({error}); pass --tree "
            "with the real directory"
        ) from None
    dev, ino = dir_identity(fd)
    return fd, dev, ino


def open_recorded_tree(booth_id: str, path: str, dev: int | None, ino: int | None) -> int:
    """An fd of the tree booth ``booth_id`` ran over, reached at ``path`` with no symlink
    followed; CheckFailed (nothing opened) when the path now leads anywhere else."""
    from shadowfs.nofollow import dir_identity, open_dir_nofollow

    if not isinstance(dev, int) or not isinstance(ino, int):
        raise CheckFailed(
            f"booth {booth_id} does not record its tree's identity (device and inode), so a "
            f"commit cannot tell {path} is still that tree; refusing to write — discard the "
            "booth and run it again"
        )
    try:
        fd = open_dir_nofollow(path)
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise CheckFailed(
            f"the real tree {path} of booth {booth_id} cannot be reached without following a "
            f"symlink ({reason}): refusing to commit, nothing was written — put the original "
            "directory back at that path"
        ) from None
    if dir_identity(fd) != (dev, ino):
        os.close(fd)
        raise CheckFailed(
            f"{path} is no longer the directory booth {booth_id} ran over (it was swapped for "
            "another since): refusing to commit, nothing was written — put the original "
            "directory back at that path"
        )
    return fd


# --------------------------------------------------------------------------- settings


def parse_duration(text: str) -> float:
    """Seconds from "30", "30s", "500ms", "2m"; ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*", text)
    if match is None:
        raise ValueError(text)
    value = float(match.group(1))
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[match.group(2)]


def lock_timeout(given: float | None = None) -> float:
    """How long a commit waits for a lock on the real tree: the flag, else $JUKEBOX_LOCK_TIMEOUT,
    else 30 s."""
    if given is not None:
        return given
    text = os.environ.get(LOCK_TIMEOUT_ENV)
    if not text:
        return DEFAULT_LOCK_TIMEOUT
    try:
        return parse_duration(text)
    except ValueError:
        raise UsageError(
            f"bad ${LOCK_TIMEOUT_ENV} {text!r}: write seconds, like 30s, 500ms or 2m"
        ) from None


def _key_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME")
    if not state:
        state = os.path.join(pwd.getpwuid(os.geteuid()).pw_dir, ".local", "state")
    return Path(state) / "jukebox" / "commit.key"


def commit_key_dir() -> Path:
    """Where this user's key lives. Every booth hides it: an agent that read it could seal a
    forged booth record that this user's `booth commit` would then accept."""
    return _key_path().parent


def commit_key(*, create: bool = True) -> bytes | None:
    """This user's key for sealing commit journals, made on first use; None when it cannot be
    kept (no writable home), in which case journals are sealed without a key."""
    path = _key_path()
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            return None
    except (OSError, KeyError):
        return None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # os.urandom as secrets does it, without importing secrets (hmac, random) at the start.
        tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, os.urandom(KEY_SIZE))
            os.fsync(fd)
        finally:
            os.close(fd)
        # A link never replaces: two first commits at once agree on whichever landed first.
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        os.unlink(tmp)
        return _read_key(path)
    except OSError:
        return None


def _read_key(path: Path) -> bytes | None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None  # someone else's, or readable by others: no key is better than theirs
        key = os.read(fd, KEY_SIZE + 1)
    finally:
        os.close(fd)
    return key if len(key) == KEY_SIZE else None


# --------------------------------------------------------------------------- interrupts


@contextlib.contextmanager
def interrupt_guard() -> Iterator[Callable[[], bool]]:
    """SIGINT, SIGTERM and SIGHUP only mark the commit interrupted while it runs, so that it
    stops cleanly where it can (before its commit point) and finishes where it must (after)."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda signo, _frame: caught.append(signo))
                for sig in signals}
    try:
        yield lambda: bool(caught)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------- the commit job


def journal_path(tapes: TapeDir, booth_id: str) -> Path:
    return tapes.journals_path / check_tape_id(booth_id)


def _lock_dir(path: Path, *, wait: bool) -> int | None:
    """The journal directory's fd, flocked; None when ``wait`` is false and someone holds it.
    A directory removed while we waited for it is made again (its remover was done with it)."""
    while True:
        if wait:
            make_private_dirs(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if not wait:
                return None
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            st = os.fstat(fd)
            now = os.stat(path, follow_symlinks=False)
        except BlockingIOError:
            os.close(fd)
            return None
        except FileNotFoundError:
            now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            return fd
        os.close(fd)
        if not wait:
            return None


def _seal_intent(intent: dict[str, Any], key: bytes | None) -> bytes:
    body = json.dumps(intent, sort_keys=True, separators=(",", ":"))
    mac = blake3(body.encode(), key=key).hexdigest() if key is not None else None
    return json.dumps({"intent": intent, "mac": mac}, indent=1).encode()


def _open_intent(data: bytes, key: bytes | None) -> dict[str, Any] | None:
    """The intent when ``key`` vouches for it (or both have none); None otherwise."""
    try:
        sealed = json.loads(data)
        intent = sealed["intent"]
        mac = sealed["mac"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(intent, dict):
        return None
    body = json.dumps(intent, sort_keys=True, separators=(",", ":"))
    if key is None:
        return intent if mac is None else None
    if not isinstance(mac, str) or blake3(body.encode(), key=key).hexdigest() != mac:
        return None
    return intent


class CommitJob:
    """One commit of a booth into its real tree, from the intent to the retired journal."""

    def __init__(self, tapes: TapeDir, booth_id: str) -> None:
        self.tapes = tapes
        self.booth_id = booth_id
        self.path = journal_path(tapes, booth_id)
        self.key = commit_key()
        self.fd = -1

    def __enter__(self) -> CommitJob:
        fd = _lock_dir(self.path, wait=True)
        assert fd is not None
        self.fd = fd
        return self

    def begin(self, intent: dict[str, Any]) -> None:
        """Record what is about to be committed, durably, before anything touches the tree."""
        _write_durably(self.fd, INTENT_NAME, _seal_intent(intent, self.key))

    def apply(
        self,
        store: ObjectReader,
        target_fd: int,
        base: ObjectId,
        final: ObjectId,
        *,
        timeout: float,
        interrupted: Callable[[], bool],
        known: Mapping[bytes, tuple[int, int, int]] | None = None,
    ) -> Any:
        from jukebox.display.progress import step
        from shadowfs.commit import apply

        # The agent's setuid/setgid bits never reach the real tree (see docs/reliability.md).
        # The files the commit replaced stay in its trash, freed in the background on retiring.
        with step("committing", "paths", done="committed") as tick:
            return apply(
                store, target_fd, base, final, journal_dir=self.fd, drop_setid=True, key=self.key,
                lock_timeout=timeout, interrupted=interrupted, progress=tick.phased, known=known,
                free_trash=False,
            )

    def __exit__(self, *exc: object) -> None:
        from shadowfs.commit import CRASH_ENV, pending

        try:
            # A journal past its commit point stays for recovery, and with it the intent.
            if not pending(self.path):
                if os.environ.get(CRASH_ENV) == "retire":  # fault injection: past the verdict
                    os.kill(os.getpid(), signal.SIGKILL)
                _retire(self.path, self.tapes)
        finally:
            os.close(self.fd)


def _write_durably(dir_fd: int, name: str, data: bytes) -> None:
    tmp = name + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def _retire(path: Path, tapes: TapeDir) -> None:
    from shadowfs.commit import TRASH_NAME
    from shadowfs.trash import empty_later

    # The replaced files (tens of thousands after a big commit, each slow to free on some file
    # systems) are moved out whole and freed by a process of their own: the command returns.
    trash = path / TRASH_NAME
    with contextlib.suppress(OSError):
        if os.listdir(trash):
            away = tapes.trash_path / f"{path.name}-{os.urandom(4).hex()}"
            make_private_dirs(away.parent)
            os.rename(trash, away)
            empty_later(away)
    from shadowfs.removal import remove_quietly

    remove_quietly(path)  # the trash itself, should it not have moved: however deep
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- recovery


# What recovery did in this process, by (tape dir, booth id): a command that opened the tape dir
# and then acts on one booth tells the user its commit was just finished, not "no such booth".
_outcomes: dict[tuple[str, str], str] = {}


def recovered(tapes: TapeDir, booth_id: str) -> str | None:
    """"finished", "partial" (a partial commit finished: the booth is still pending) or
    "undone" when this process recovered booth ``booth_id``'s commit."""
    return _outcomes.get((os.path.realpath(tapes.path), booth_id))


def has_interrupted_commit(tapes: TapeDir, booth_id: str) -> bool:
    from shadowfs.commit import pending

    return pending(journal_path(tapes, booth_id))


def recover_commits(
    tapes: TapeDir, only: str | None = None, *, wait: bool = False
) -> dict[str, str]:
    """Recover every interrupted commit in the tape dir (or only booth ``only``'s) that no
    live process holds (``wait``: wait for the one that does): {booth id: "finished" | "partial" |
    "undone"}. Problems are reported in one line each and never stop the command that opened
    the tape dir."""
    root = tapes.journals_path
    try:
        if only is None:
            names = sorted(os.listdir(root))
        else:
            names = [only] if journal_path(tapes, only).is_dir() else []
    except FileNotFoundError:
        return {}
    except OSError as error:
        _say(f"cannot look for interrupted commits in {root} ({error.strerror})")
        return {}
    outcomes: dict[str, str] = {}
    key: bytes | None = None
    keyed = False
    for name in names:
        try:
            check_tape_id(name)
        except UsageError:
            continue
        path = root / name
        try:
            fd = _lock_dir(path, wait=wait)
        except OSError as error:
            _say(f"could not recover the interrupted commit of booth {name}: {error}")
            continue
        if fd is None:
            continue  # a commit or a recovery in progress: its process finishes it
        try:
            if not keyed:
                key, keyed = commit_key(create=False), True
            outcome = _recover_one(tapes, name, path, fd, key)
        except Exception as error:  # shadowfs and store errors too: reported, never fatal
            _say(f"could not recover the interrupted commit of booth {name}: {error}")
            continue
        finally:
            os.close(fd)
        if outcome is not None:
            outcomes[name] = outcome
            _outcomes[(os.path.realpath(tapes.path), name)] = outcome
    return outcomes


def _recover_one(
    tapes: TapeDir, booth_id: str, path: Path, fd: int, key: bytes | None
) -> str | None:
    from jukebox.booth import supervisor as booths
    from shadowfs.commit import holds_tree, pending, recover

    journal_left = pending(path)
    try:
        with open(path / INTENT_NAME, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raw = None
    intent = _open_intent(raw, key) if raw is not None else None
    if raw is not None and intent is None:
        raise CheckFailed(
            f"its journal in {path} is not sealed with this user's key (it came with the tape "
            "dir, or the key was lost): left alone, nothing run — remove that directory once "
            "the tree is checked"
        )
    try:
        record: booths.BoothRecord | None = booths.load_record(tapes, booth_id)
    except (UsageError, CheckFailed):
        # No pending record: never recorded, not a record, or already retired with its verdict
        # on the tape (killed after the verdict, before the journal went); the intent decides.
        record = None
    if intent is None:
        if not journal_left:
            _retire(path, tapes)  # killed before its intent: nothing was staged
            return None
        if record is None or record.final_tree is None:
            raise CheckFailed(f"neither its intent nor its booth record names its tree ({path})")
        intent = {
            "tree": record.tree, "tree_dev": record.tree_dev, "tree_ino": record.tree_ino,
            "base": record.base_tree, "final": record.final_tree, "by": "booth commit",
        }
    tree = str(intent["tree"])
    base, final = ObjectId.from_hex(intent["base"]), ObjectId.from_hex(intent["final"])
    target = open_recorded_tree(booth_id, tree, intent.get("tree_dev"), intent.get("tree_ino"))
    timeout = lock_timeout()
    try:
        with booths._open_store(tapes) as store:
            if journal_left:
                finished = recover(target, fd, key=key, lock_timeout=timeout)
            else:
                finished = holds_tree(
                    store, target, base, final, drop_setid=True, lock_timeout=timeout
                )
            _verdict(store, tapes, booth_id, intent, record, finished)
    finally:
        os.close(target)
    _retire(path, tapes)
    if finished and intent.get("partial") is not None:
        _say(
            f"recovered the interrupted partial commit of booth {booth_id}: finished, {tree} "
            "holds the changes it selected (a `partial_commit` note is on its tape); the rest "
            "stays pending"
        )
    elif finished:
        _say(
            f"recovered the interrupted commit of booth {booth_id}: finished, {tree} holds the "
            "booth's changes (a `commit` frame is on its tape)"
        )
    else:
        pending_note = "; the booth stays pending" if record is not None else ""
        _say(
            f"recovered the interrupted commit of booth {booth_id}: undone, {tree} is exactly "
            f"as it was{pending_note}"
        )
    if finished and intent.get("partial") is not None:
        return "partial"  # the booth is still pending: what the caller asked for goes on
    return "finished" if finished else "undone"


def _verdict(
    store: ObjectStore,
    tapes: TapeDir,
    booth_id: str,
    intent: dict[str, Any],
    record: Any,
    finished: bool,
) -> None:
    """The frame that says how the interrupted commit ended, and the booth record to match."""
    from jukebox.booth import supervisor as booths

    tape = tapes.tape_path(booth_id)
    final = ObjectId.from_hex(intent["final"])
    if finished and intent.get("partial") is not None:
        # A partial commit (jukebox.booth.partial): its note, and the booth stays pending.
        from jukebox.booth.partial import partial_note

        done = {"ok": True, "changes": intent.get("changes"), "by": intent.get("by"),
                "recovered": True}  # fmt: skip
        if tape.exists() and not _ends_with_commit(tape, store, final):
            note = partial_note(done, list(intent["partial"]), final)
            booths._append_to_tape(store, str(tape), "note", note, refs=[final])
        return
    if finished:
        payload: dict[str, Any] = {
            "ok": True, "changes": intent.get("changes"), "by": intent.get("by", "booth commit"),
            "recovered": True,
        }
        if intent.get("checkpoint") is not None:
            payload["checkpoint"] = intent["checkpoint"]
        if tape.exists() and not _ends_with_commit(tape, store, final):
            booths._append_to_tape(store, str(tape), "commit", payload, tree=final)
        booths._finish(tapes, booth_id)
        return
    if tape.exists():
        booths._append_to_tape(
            store, str(tape), "note",
            {"event": "commit_interrupted", "outcome": "undone", "by": "recovery"},
        )
    if record is not None and record.final_tree is not None and record.status == "running":
        record.status, record.pid = "pending", None
        record.note = "its commit was interrupted and undone"
        booths.save_record(tapes, record)


def _ends_with_commit(tape: Path, store: ObjectStore, final: ObjectId) -> bool:
    """Whether the verdict is already there (the kill came after the frame, before cleanup)."""
    from jukebox.tape.tape import Tape

    frames = Tape.load(tape, store).frames
    if not frames:
        return False
    last = frames[-1]
    if last.kind == "note":  # a partial commit's, naming the tree it committed
        return last.payload.get("committed_tree") == final.hex()
    return last.kind == "commit" and last.tree == final


def _say(message: str) -> None:
    sys.stderr.write(f"jukebox: {message}\n")
    sys.stderr.flush()
