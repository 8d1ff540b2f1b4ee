"""Crash-safe, all-or-nothing apply of a tree change set onto a real directory, and its recovery.

A commit runs in four steps, so a crash at any instant leaves the target recoverable to exactly
the old or exactly the new state:

1. **Check.** Every touched path must still hold what the base tree says (kind, mode, size and
   content for files, target for symlinks, absence for added paths, no extra entries in a
   directory about to be removed). Any mismatch raises ConflictError having written nothing.
   A commit of ``SYNCFS_FROM`` staged files or more runs the check beside the staging instead
   (in a thread: the staging waits on the kernel creating files, the check on lstats and
   reads, and one after the other they left a core idle); a mismatch then undoes the
   staging, as the re-check's does, and the tree is exactly the old one again.
2. **Stage.** New files and symlinks are written next to their targets under hidden names
   (``.jbx-stage-<token>-<n>``) with their final mode and mtime, and fsynced. A *prepare* record
   in the journal directory names the token and the staging directories first, so a crash while
   staging leaves residue that recovery can find without walking the whole tree.
3. **Journal.** A redo journal (every operation, in a safe order) is written, fsynced, renamed
   into place and the journal directory fsynced. Its presence is the commit point. It carries a
   BLAKE3 checksum (keyed, when the caller passes a key), so a torn journal counts as absent (the
   commit did not happen), and so does one the key does not vouch for.
4. **Re-check.** Every touched path is stat'ed again and must be the very file the check saw
   (device, inode, mode, size, mtime, ctime): an edit on the host while the commit staged (seconds
   for big files) withdraws the journal, undoes the staging and raises ConflictError.
5. **Apply.** The operations run (each idempotent: a redo after a crash runs them all again),
   every touched directory is fsynced, then the journal and the prepare record are removed.
   A file that an operation replaces or removes is not freed there: it goes to
   ``<journal_dir>/trash/`` (when that is on the target's file system), which frees nothing,
   where freeing its blocks can cost milliseconds (a synchronous discard on a file system
   mounted with ``discard``). A file a rename replaces is hard-linked into the trash first, so
   the rename drops one of its links and frees nothing; a link is harmless whatever the path
   holds (at worst a second name of the new file, freed with the trash), so neither the first
   run nor a redo checks anything before it. A removed file is renamed into the trash.
6. **Free.** The trash is emptied (shadowfs.trash) once the journal is gone, or left for the
   caller to free later (``free_trash=False``). It holds only garbage: recovery empties it.

``recover`` runs on the next open: a valid journal is redone to the new state; otherwise staged
residue is removed and the tree is exactly the old one.

Every operation on the target goes through directory fds opened with O_NOFOLLOW, one component
at a time, so a symlink planted in a path can never redirect a write outside the target.

The target's fd is flocked exclusively for the whole commit; ``lock_timeout`` bounds the wait
for it, and TargetBusy names the processes holding it (from /proc/locks). ``interrupted``, polled
while staging, stops a commit before its commit point (CommitInterrupted, nothing applied); past
the commit point it is no longer asked, and the commit finishes.

Fault injection for crash tests: ``SHADOWFS_CRASH_AT`` names a point where the process SIGKILLs
itself; ``SHADOWFS_PAUSE_AT`` names one where it stops itself (SIGSTOP) until a SIGCONT, so a
test can change the target at exactly that moment. In ``apply``, in order: ``prepare``,
``stage:K``, ``checked`` (only where the check runs beside the staging: both ended),
``staged``, ``journal``, ``op:K``, ``applied``, ``prepare-deleted`` (``torn-journal`` instead
leaves half a journal and dies), or an integer step index into that sequence, then
``freeing`` (the journal is gone, the trash not yet emptied). By name only (no step index):
``aside:K``, inside op K once the file it replaces is linked into the trash and before the
staged file takes its place; ``check:K``, in the check's thread at its K-th path. In
``recover``: ``recover-op:K``, ``recover-applied``, ``recover-prepare-deleted``. The booth's
database verdict reads the same variable for ``sql-prepare`` and ``sql-prepared`` (PREPARE
TRANSACTION sent; answered: jukebox.sql.booth_link).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gc
import json
import os
import resource
import secrets
import signal
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from blake3 import blake3

from shadowfs.errors import (
    CommitBusy,
    CommitInterrupted,
    ConflictError,
    ShadowfsError,
    TargetBusy,
    TreeError,
)
from shadowfs.oid import ObjectHasher, ObjectId, hash_object

# progress(phase, done, total) with phase "check" | "stage" | "apply" (counts of paths/ops).
from shadowfs.progress import PhasedProgress as Progress
from shadowfs.steptimes import lap
from shadowfs.syncfs import syncfs
from shadowfs.trash import empty as empty_trash
from shadowfs.tree import (
    DEVICES,
    DIR,
    FILE,
    SPECIAL_FMT,
    SPECIALS,
    SYMLINK,
    Change,
    Entry,
    lookup,
    make_special,
    walk,
)
from shadowfs.tree import entries as tree_entries
from shadowfs.values import Record, Value, setfield

if TYPE_CHECKING:
    from types import ModuleType

    from shadowfs.objects import ObjectReader

_batchio: ModuleType | None
try:
    # A big commit's per-file calls, a batch per call with the interpreter lock released once
    # (_batchio.c), built by the install; where it is not, the same calls are made from Python.
    from shadowfs import _batchio
except ImportError:
    _batchio = None
# `SHADOWFS_BATCHIO=off`: the Python calls, the compiled ones' reference.
BATCHIO_ENV = "SHADOWFS_BATCHIO"
if os.environ.get(BATCHIO_ENV) == "off":
    _batchio = None

__all__ = [
    "CRASH_ENV",
    "PAUSE_ENV",
    "STAGE_PREFIX",
    "TRASH_NAME",
    "CommitReport",
    "Progress",
    "apply",
    "clean_residue",
    "collector_paused",
    "holds_tree",
    "lock_holders",
    "pending",
    "recover",
]

CRASH_ENV = "SHADOWFS_CRASH_AT"
PAUSE_ENV = "SHADOWFS_PAUSE_AT"
STAGE_PREFIX = b".jbx-stage-"

JOURNAL_NAME = "commit.journal"
TRASH_NAME = "trash"
PREPARE_NAME = "commit.prepare"
_MAGIC = b"JBXCOMMIT1"
_MAGIC_KEYED = b"JBXCOMMIT1K"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Bits a commit of untrusted work drops from the files it writes (see `apply`'s drop_setid).
_SETID = stat.S_ISUID | stat.S_ISGID
# O_NONBLOCK: should a file be swapped for a fifo underneath us, never hang on open.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_JOURNAL_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_SIZE = 1 << 20
# Directory fds kept open at once; LRU beyond that so a commit touching many directories stays
# well inside the default 1024-fd limit.
_MAX_DIR_FDS = 256
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
# From this many staged files (or directories to fsync) on, one syncfs replaces the fsyncs.
SYNCFS_FROM = 256
# Big commits run their independent operations (renames, unlinks, small staged files) in
# threads: each waits on the file system, not the CPU (a rename over a file or an unlink frees
# the old file's blocks, 2.5 ms each on a VM's ext4 mounted with discard), and concurrent ones
# overlap (15 times faster there with 8 threads). In chunks of at most this many operations,
# this many distinct directories and this many bytes of staged content in memory.
_THREADS = 16
_THREADED_FROM = 64  # fewer files than this to read for the conflict check: read here
_CHUNK_OPS = 1024
_CHUNK_DIRS = 128
_CHUNK_BYTES = 32 << 20
# Staged files up to this size are read from the store whole and written by a thread; bigger
# ones stream in the main thread, chunk by chunk (holes, interrupts).
_SMALL_FILE = 1 << 20

Interrupted = Callable[[], bool]
Target = int | str | bytes | os.PathLike[str] | os.PathLike[bytes]


class CommitReport(Value):
    __slots__ = FIELDS = ("changed", "bytes_written")
    changed: int  # paths that differed between the two trees (metadata-only changes included)
    bytes_written: int  # file content bytes staged and renamed into place

    def __init__(self, changed: int, bytes_written: int) -> None:
        setfield(self, "changed", changed)
        setfield(self, "bytes_written", bytes_written)


# --- paths ------------------------------------------------------------------------------------


def _check_path(path: bytes) -> bytes:
    """Refuse any path that could leave the target; trees validate names, journals may not."""
    parts = path.split(b"/")
    if b"\0" in path or any(part in (b"", b".", b"..") for part in parts):
        raise TreeError(f"refusing hostile path {path!r} in a commit; the change set is corrupt")
    return path


def _parent(path: bytes) -> bytes:
    return path.rpartition(b"/")[0]


def _name(path: bytes) -> bytes:
    return path.rpartition(b"/")[2]


def _depth(path: bytes) -> int:
    return path.count(b"/")


def _show(path: bytes) -> str:
    return path.decode("utf-8", "backslashreplace")


def _enc(path: bytes) -> str:
    # surrogateescape round-trips any bytes through JSON, independent of the locale.
    return path.decode("utf-8", "surrogateescape")


def _dec(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


class _Dirs:
    """Directory fds under the target, opened one component at a time with O_NOFOLLOW."""

    def __init__(self, root_fd: int) -> None:
        self.root = root_fd
        self.cache: OrderedDict[bytes, int] = OrderedDict()

    def get(self, path: bytes) -> int:
        """An fd for the directory at ``path`` (b"" is the target); raises OSError if it is not
        a real directory there (missing, a file, or a symlink: ELOOP/ENOTDIR)."""
        if not path:
            return self.root
        fd = self.cache.get(path)
        if fd is not None:
            self.cache.move_to_end(path)
            return fd
        parent = self.get(_parent(path))
        fd = os.open(_name(path), _DIR_FLAGS, dir_fd=parent)
        self.cache[path] = fd
        if len(self.cache) > _MAX_DIR_FDS:
            os.close(self.cache.popitem(last=False)[1])
        return fd

    def forget(self, path: bytes) -> None:
        """Drop a removed directory and everything cached beneath it."""
        prefix = path + b"/"
        for key in [k for k in self.cache if k == path or k.startswith(prefix)]:
            os.close(self.cache.pop(key))

    def close(self) -> None:
        for fd in self.cache.values():
            os.close(fd)
        self.cache.clear()


class _ChunkDirs:
    """Duplicates of the directory fds one chunk of threaded operations uses. The chunk owns
    them, so `_Dirs` closing its least recently used fd never pulls one from under a thread."""

    def __init__(self, dirs: _Dirs) -> None:
        self.dirs = dirs
        self.fds: dict[bytes, int] = {}

    def get(self, path: bytes) -> int:
        fd = self.fds.get(path)
        if fd is None:
            fd = self.fds[path] = os.dup(self.dirs.get(path))
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class _Threads:
    """The threads independent operations run in (see ``_THREADS``), started on first use.
    The main thread and `_Checker`'s may both hand them work."""

    def __init__(self) -> None:
        # Made here, not at the first call, so two threads calling never make two; it starts
        # no thread before its first task.
        self.pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            _THREADS, thread_name_prefix="jbx-commit"
        )

    def run(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        """``fn(*args)`` for every ``args`` of ``calls``, concurrently: their results, or the
        first exception one raised. Returns or raises only once every call has ended, so a
        caller undoing the work never races a thread still doing it."""
        if len(calls) < 2:
            return [fn(*args) for args in calls]
        return self.finish(self.start(fn, calls))

    def start(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Future[Any]]:
        """One batch of consecutive calls per thread, not one task per call: a task costs the
        pool tens of µs of Python (a future, its lock), more than the system call it runs. A
        batch stops at its first exception."""
        return self.start_slices(functools.partial(_batch, fn), calls)

    def start_slices(
        self, fn: Callable[[list[tuple[Any, ...]]], Iterable[Any]], calls: list[tuple[Any, ...]]
    ) -> list[Future[Any]]:
        """As `start`, for an ``fn`` taking a whole slice of ``calls`` (a compiled batch,
        _batchio) and returning the slice's results."""
        return self.start_parts(lambda _, part: fn(part), calls)

    def start_parts(
        self,
        fn: Callable[[int, list[tuple[Any, ...]]], Iterable[Any]],
        calls: list[tuple[Any, ...]],
    ) -> list[Future[Any]]:
        """As `start_slices`, ``fn(start, slice)`` given the index of the slice's first call."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="jbx-commit")
        size = -(-len(calls) // _THREADS) if calls else 1
        return [self.pool.submit(fn, i, calls[i : i + size]) for i in range(0, len(calls), size)]

    @staticmethod
    def finish(futures: list[Future[Any]]) -> list[Any]:
        """The results of `start`'s calls once every one has ended (see `run`)."""
        try:
            wait(futures)
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)
            raise
        return [r for f in futures for r in f.result()]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


def _batch(fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
    return [fn(*args) for args in calls]


def _lstat(dirs: _Dirs, path: bytes) -> os.stat_result | None:
    """lstat through O_NOFOLLOW parents; None when nothing (reachable) is there."""
    try:
        return os.stat(_name(path), dir_fd=dirs.get(_parent(path)), follow_symlinks=False)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise


def _open_target(
    target: Target, lock_timeout: float | None = None, interrupted: Interrupted | None = None
) -> int:
    """The target's fd, exclusively flocked until closed. The journal dir's lock serialises one
    booth's commits only; two booths committing onto one tree journal apart, and without this
    both could pass the conflict check before either wrote: a lost update.

    ``target`` is a path or an open directory fd; an fd is reopened through "." so the lock is
    this commit's own and no path is resolved again."""
    try:
        if isinstance(target, int):
            fd = os.open(".", _DIR_FLAGS, dir_fd=target)
        else:
            fd = os.open(os.fsencode(target), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        shown = f"fd {target}" if isinstance(target, int) else repr(os.fsdecode(target))
        raise ShadowfsError(
            f"cannot open commit target {shown} ({exc.strerror}); "
            "pass the existing real directory the layer sits on"
        ) from None
    try:
        _flock(fd, lock_timeout, interrupted)
    except BaseException:
        os.close(fd)
        raise
    return fd


_LOCK_POLL = 0.05


def _flock(fd: int, timeout: float | None, interrupted: Interrupted | None = None) -> None:
    """flock(LOCK_EX), waiting at most ``timeout`` seconds (None: forever) and giving up when
    ``interrupted()`` turns true."""
    if timeout is None and interrupted is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + max(0.0, timeout) if timeout is not None else None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            _check_interrupt(interrupted)
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(_LOCK_POLL)
    holders = lock_holders(fd)
    who = "; ".join(holders) if holders else "a process this user cannot see"
    raise TargetBusy(
        f"the commit target is locked by {who}, still after {timeout:g} s; "
        "end that process (or wait for it) and commit again, or raise the lock timeout",
        holders,
    )


def lock_holders(fd: int) -> list[str]:
    """"pid N (command)" for every process /proc/locks lists as holding a lock on ``fd``'s
    inode (waiters excluded); an open file description shared across a fork shows its taker."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: list[int] = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue  # a process waiting for the lock, not holding it
        if fields[5] == want and fields[4].lstrip("-").isdigit():
            pid = int(fields[4])
            if pid > 0 and pid != os.getpid() and pid not in pids:
                pids.append(pid)
    return [f"pid {pid} ({_command(pid)})" for pid in pids]


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().rstrip(b"\0").split(b"\0")
    except OSError:
        return "gone"
    text = " ".join(a.decode("utf-8", "backslashreplace") for a in argv)[:120]
    # The holder's own command line may hold anything: keep the message one printable line.
    return "".join(c if c.isprintable() else "?" for c in text) or "?"


# --- fault injection --------------------------------------------------------------------------


class _Crash:
    """Kills the process at a named point; read once per apply so the check costs a compare."""

    __slots__ = ("pause", "point", "step")

    def __init__(self, *, steps: bool = True) -> None:
        self.point = os.environ.get(CRASH_ENV) or None
        self.pause = os.environ.get(PAUSE_ENV) or None
        # Step indices count apply's points only; recovery is addressed by name.
        self.step = 0 if steps else -(1 << 62)

    def at(self, name: str) -> None:
        if self.point is None and self.pause is None:
            return
        step = self.step
        self.step += 1
        if self.point == name or self.point == str(step):
            _die()
        if self.pause == name:
            os.kill(os.getpid(), signal.SIGSTOP)

    def named(self, name: str) -> None:
        """A point addressed by name only (no step index): safe from any thread."""
        if self.point == name:
            _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# --- the diff a commit needs ------------------------------------------------------------------


def _changes(store: ObjectReader, a: ObjectId, b: ObjectId) -> list[Change]:
    """Every path whose entry differs between two trees, mtime-only differences included.

    tree.diff_trees deliberately ignores mtime-only differences; a commit must carry them, or the
    real tree would not equal the new tree (a directory's mtime moves with every entry change).
    Status ``mtime`` marks an mtime-only change; everything else matches diff_trees.
    """
    out: list[Change] = []
    stack: list[tuple[bytes, ObjectId, ObjectId]] = [(b"", a, b)]
    while stack:
        prefix, ta, tb = stack.pop()
        if ta == tb:
            continue
        # The cached dicts themselves (name -> entry, read only): not copied per tree.
        olds = tree_entries(store, ta)
        news = tree_entries(store, tb)
        for name, old in olds.items():
            path = prefix + b"/" + name if prefix else name
            new = news.get(name)
            if new is None:
                out.append(Change(path, "deleted", old, None))
                _below(store, old, path, out, added=False)
            elif old.kind != new.kind:
                out.append(Change(path, "type", old, new))
                _below(store, old, path, out, added=False)
                _below(store, new, path, out, added=True)
            elif (
                # Decoded entries carry their canonical bytes: equal bytes, equal entries.
                old.record != new.record
                if old.record is not None and new.record is not None
                else old != new
            ):
                if old.kind == DIR:
                    status = "mode" if old.mode != new.mode else "mtime"
                    if old.mode != new.mode or old.mtime_ns != new.mtime_ns:
                        out.append(Change(path, status, old, new))
                    # both are directories here, and a directory entry has an oid
                    stack.append((path, old.oid, new.oid))  # type: ignore[arg-type]
                elif old.oid != new.oid or old.target != new.target or old.rdev != new.rdev:
                    out.append(Change(path, "modified", old, new))
                elif old.link != new.link:
                    out.append(Change(path, "link", old, new))
                else:
                    status = "mode" if old.mode != new.mode else "mtime"
                    out.append(Change(path, status, old, new))
        for name, new in news.items():
            if name not in olds:
                path = prefix + b"/" + name if prefix else name
                out.append(Change(path, "added", None, new))
                _below(store, new, path, out, added=True)
    return out


def _below(store: ObjectReader, e: Entry, path: bytes, out: list[Change], *, added: bool) -> None:
    if e.kind != DIR:
        return
    # a file or directory entry has an oid (only a symlink's is None)
    for p, sub in walk(store, e.oid, path):  # type: ignore[arg-type]
        out.append(Change(p, "added", None, sub) if added else Change(p, "deleted", sub, None))


# --- planning ---------------------------------------------------------------------------------


class _Stage(Record):
    __slots__ = FIELDS = ("path", "dir", "name", "entry", "link_to")
    path: bytes  # final place
    dir: bytes  # existing directory the staged entry is written in
    name: bytes  # staged name inside dir
    entry: Entry
    # For a hard link: the stage of its group made first, which this one is a link to.
    link_to: _Stage | None

    def __init__(
        self,
        path: bytes,
        dir: bytes,
        name: bytes,
        entry: Entry,
        link_to: _Stage | None = None,
    ) -> None:
        self.path = path
        self.dir = dir
        self.name = name
        self.entry = entry
        self.link_to = link_to


class _Plan(Record):
    __slots__ = FIELDS = ("changes", "stages", "ops", "fsync", "removed_dirs")
    changes: list[Change]
    stages: list[_Stage]
    ops: list[list[Any]]  # journal operations, paths still bytes
    fsync: list[bytes]
    removed_dirs: dict[bytes, set[bytes]]  # dir -> names base says it holds

    def __init__(
        self,
        changes: list[Change],
        stages: list[_Stage],
        ops: list[list[Any]],
        fsync: list[bytes],
        removed_dirs: dict[bytes, set[bytes]],
    ) -> None:
        self.changes = changes
        self.stages = stages
        self.ops = ops
        self.fsync = fsync
        self.removed_dirs = removed_dirs


def _plan(
    store: ObjectReader,
    new_tree: ObjectId,
    changes: list[Change],
    token: str,
    drop_setid: bool = False,
) -> _Plan:
    created: set[bytes] = set()  # directories this commit makes
    removed: dict[bytes, set[bytes]] = {}  # directories this commit removes -> expected names
    new_dirs: dict[bytes, Entry] = {}  # directories present afterwards whose entry we know
    for c in changes:
        _check_path(c.path)
        o, n = c.old, c.new
        if o is not None and o.kind == DIR and (n is None or n.kind != DIR):
            removed[c.path] = set()
        if n is not None and n.kind == DIR:
            new_dirs[c.path] = n
            if o is None or o.kind != DIR:
                created.add(c.path)
    for c in changes:
        if c.old is not None and _parent(c.path) in removed:
            removed[_parent(c.path)].add(_name(c.path))

    changes, restaged = _with_whole_link_groups(store, new_tree, changes)
    removals: list[list[Any]] = []
    mkdirs: list[list[Any]] = []
    renames: list[list[Any]] = []
    inplace: list[list[Any]] = []
    stages: list[_Stage] = []
    group_stage: dict[int, _Stage] = {}  # hard-link key -> the stage its other names link to
    touched: set[bytes] = set()  # directories whose entries change: their mtime and fsync
    prefix = STAGE_PREFIX + token.encode() + b"-"
    for c in changes:
        p, o, n = c.path, c.old, c.new
        parent = _parent(p)
        if parent not in removed:
            touched.add(parent)
        if o is not None and (n is None or (o.kind != n.kind and DIR in (o.kind, n.kind))):
            removals.append(["rmdir" if o.kind == DIR else "unlink", p])
        if n is None:
            continue
        if n.kind == DIR:
            if p in created:
                mkdirs.append(["mkdir", p])
            continue
        if drop_setid and n.mode & _SETID:
            n = n.replace(mode=n.mode & ~_SETID)
        if (
            o is None or o.kind != n.kind or o.oid != n.oid or o.target != n.target
            or o.rdev != n.rdev or n.link in restaged
        ):
            # Stage in the nearest directory that exists both before and after, so the staged
            # entry is on the target's file system and inside the tree from the start.
            sdir = parent
            while sdir in created:
                sdir = _parent(sdir)
            touched.add(sdir)
            s = _Stage(p, sdir, prefix + str(len(stages)).encode(), n)
            if n.link:
                s.link_to = group_stage.setdefault(n.link, s)
                if s.link_to is s:
                    s.link_to = None
            stages.append(s)
            renames.append(["rename", s.dir, s.name, p])
        else:
            if o.mode != n.mode:
                inplace.append(["chmod", p, n.mode])
            if o.mtime_ns != n.mtime_ns:
                inplace.append(["utime", p, n.mtime_ns])

    # Directory modes and mtimes go last, deepest first: creating entries would bump an mtime
    # set earlier, and a read-only mode would forbid creating them.
    touched.discard(b"")
    by_path = {c.path: c for c in changes}
    dirmeta: list[list[Any]] = []
    for d in sorted(touched | new_dirs.keys(), key=_depth, reverse=True):
        if d in removed:
            continue
        n = new_dirs.get(d) or lookup(store, new_tree, d)
        if n is None or n.kind != DIR:
            raise TreeError(f"directory {_show(d)!r} is missing from the new tree; it is corrupt")
        old = by_path[d].old if d in new_dirs else n
        if d in created or (old is not None and old.mode != n.mode):
            dirmeta.append(["chmod", d, n.mode])
        dirmeta.append(["utime", d, n.mtime_ns])

    removals.sort(key=lambda op: (-_depth(op[1]), op[1]))
    mkdirs.sort(key=lambda op: (_depth(op[1]), op[1]))
    ops = removals + mkdirs + renames + inplace + dirmeta
    fsync = sorted(({b""} | touched | new_dirs.keys()) - removed.keys(), key=_depth, reverse=True)
    return _Plan(changes, stages, ops, fsync, removed)


def _with_whole_link_groups(
    store: ObjectReader, new_tree: ObjectId, changes: list[Change]
) -> tuple[list[Change], set[int]]:
    """``changes`` plus, for each hard-link group a change writes anew, its other names in the
    new tree: a group is staged as one new inode with all its names linked to it, so a name
    linked to an unchanged file, or a changed member of a base group, splits nothing. Those
    names are checked like any change (their old entry must still be there). Also returns the
    keys of those groups.

    Finding them walks the new tree, paid only by commits that write a linked file."""
    keys: set[int] = set()
    for c in changes:
        n, o = c.new, c.old
        if n is not None and n.link and (o is None or o.oid != n.oid or o.link != n.link):
            keys.add(n.link)
    if not keys:
        return changes, keys
    listed = {c.path for c in changes}
    extra = [
        Change(path, "link", e, e)
        for path, e in walk(store, new_tree)
        if e.link in keys and path not in listed
    ]
    return (sorted(changes + extra, key=lambda c: c.path) if extra else changes), keys


# --- conflict check ---------------------------------------------------------------------------


class _Mismatch(ShadowfsError):
    pass


class _CompareSink:
    """A write-only file object that compares what the store streams with a real file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data)
        while view:
            got = os.read(self.fd, min(len(view), _READ_SIZE))
            if not got or got != view[: len(got)]:
                raise _Mismatch
            view = view[len(got) :]
        return len(data)

    def skip(self, n: int) -> None:
        """A chunk of zeros: a hole in the real file holds it, unread; else compare bytes."""
        pos = os.lseek(self.fd, 0, os.SEEK_CUR)
        try:
            data = os.lseek(self.fd, pos, os.SEEK_DATA)
        except OSError:
            data = os.fstat(self.fd).st_size  # ENXIO: no data from pos on
        os.lseek(self.fd, pos, os.SEEK_SET)
        if data >= pos + n and os.fstat(self.fd).st_size >= pos + n:
            os.lseek(self.fd, pos + n, os.SEEK_SET)
        else:
            self.write(bytes(n))


def _same_content(store: ObjectReader, fd: int, size: int, oid: ObjectId) -> bool:
    if store.kind(oid) == "blob":
        hasher = ObjectHasher("blob", size)
        left = size
        while left:
            chunk = os.read(fd, min(left, _READ_SIZE))
            if not chunk:
                return False
            hasher.update(chunk)
            left -= len(chunk)
        return hasher.oid() == oid and not os.read(fd, 1)
    # A chunked object's id is over its chunk list, not the bytes: compare the streams instead.
    try:
        store.read_file_into(oid, _CompareSink(fd))
    except _Mismatch:
        return False
    return not os.read(fd, 1)


def _holds(
    store: ObjectReader,
    dirs: _Dirs,
    path: bytes,
    e: Entry,
    st: os.stat_result | None = None,
    known: Known | None = None,
) -> bool:
    """Does the real tree still hold exactly ``e`` at ``path``? ``st``: its lstat, if taken;
    ``known``: see `apply`."""
    st = _lstat(dirs, path) if st is None else st
    if st is None:
        return False
    if e.kind != FILE:
        return _holds_unread(dirs, path, e, st)
    if (
        not stat.S_ISREG(st.st_mode)
        or stat.S_IMODE(st.st_mode) != e.mode
        or st.st_size != e.size
    ):
        return False
    if known is not None and known.get(path) == (st.st_dev, st.st_ino, st.st_ctime_ns):
        return True  # the very file the caller hashed into the base, unwritten since
    try:
        fd = os.open(_name(path), _READ_FLAGS, dir_fd=dirs.get(_parent(path)))
    except OSError as exc:
        if exc.errno in (*_GONE, errno.ENXIO):
            return False
        raise
    try:
        # a file or directory entry has an oid (only a symlink's is None)
        return stat.S_ISREG(os.fstat(fd).st_mode) and _same_content(store, fd, e.size, e.oid)  # type: ignore[arg-type]
    finally:
        os.close(fd)


Known = Mapping[bytes, tuple[int, int, int]]
"""Paths of files the caller read whole into the base tree -> their (st_dev, st_ino,
st_ctime_ns) then (see `apply`'s ``known``)."""

Seen = tuple[int, ...] | None
"""What the check saw at a path: None (nothing), or its stat identity (see `_seen`)."""


def _seen(st: os.stat_result | None) -> Seen:
    """A path's stat identity. Any write or rename changes a file's ctime; a directory's own
    times move as the commit stages into it, so only its inode and mode are compared."""
    if st is None:
        return None
    if stat.S_ISDIR(st.st_mode):
        return (st.st_dev, st.st_ino, st.st_mode)
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _same_blob_at(dfd: int, name: bytes, size: int, oid: ObjectId) -> bool:
    """Does the file ``name`` in ``dfd`` hold exactly the blob ``oid`` of ``size`` bytes?
    `_holds`'s content check, in a thread: blake3 lets go of the GIL on big reads, and the
    reads themselves wait on the disk."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (*_GONE, errno.ENXIO):
            return False
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        if size <= _READ_SIZE:
            data = os.read(fd, size + 1)  # one byte more: a file grown since is no match
            return len(data) == size and hash_object("blob", data) == oid
        hasher = ObjectHasher("blob", size)
        left = size
        while left:
            chunk = os.read(fd, min(left, _READ_SIZE))
            if not chunk:
                return False
            hasher.update(chunk)
            left -= len(chunk)
        return hasher.oid() == oid and not os.read(fd, 1)
    finally:
        os.close(fd)


def _conflicts(
    store: ObjectReader,
    dirs: _Dirs,
    plan: _Plan,
    progress: Progress | None,
    seen: dict[bytes, Seen] | None = None,
    known: Known | None = None,
    threads: _Threads | None = None,
) -> list[str]:
    """The touched paths that no longer hold what the base says. ``seen`` collects each checked
    path's stat identity, taken before its content is compared, for `_changed_since`.

    The reading and hashing of files ``known`` does not vouch for runs in ``threads``
    (lstats stay here: with the directories cached, a thread costs more than the call);
    anything unusual (a chunked file, a symlink, a special file) is checked here
    by `_holds`."""
    threads = threads if threads is not None else _Threads()
    total = len(plan.changes)
    bad, reads = _scan(dirs, plan, seen, known, progress)
    blobs: list[tuple[bytes, int, ObjectId]] = []
    for path, e, oid in reads:
        if store.kind(oid) == "blob":
            blobs.append((path, e.size, oid))
        elif not _holds(store, dirs, path, e, None, known):
            bad.append(path)
    bad += _unlike_blobs(dirs, blobs, threads, progress, total)
    bad.extend(_extra_names(dirs, plan, set(bad)))
    if progress is not None:
        progress("check", total, total)
    return [_show(p) for p in sorted(set(bad))]


def _unlike_blobs(
    dirs: _Dirs,
    blobs: list[tuple[bytes, int, ObjectId]],
    threads: _Threads,
    progress: Progress | None = None,
    total: int = 0,
    stopped: Callable[[], bool] | None = None,
) -> list[bytes]:
    """The paths of ``blobs`` (path, size, blob id) whose file does not hash to that blob,
    read and hashed in ``threads`` a chunk at a time (`_same_blob_at`); ``stopped()`` true
    ends it early (what it returns then means nothing)."""
    unlike: list[bytes] = []
    i = 0
    while i < len(blobs) and not (stopped is not None and stopped()):
        own = _ChunkDirs(dirs)
        try:
            calls: list[tuple[Any, ...]] = []
            paths: list[bytes] = []
            while i < len(blobs) and len(calls) < _CHUNK_OPS:
                path, size, oid = blobs[i]
                parent = _parent(path)
                if parent not in own.fds and len(own.fds) >= _CHUNK_DIRS:
                    break
                i += 1
                try:
                    dfd = own.get(parent)
                except OSError as exc:
                    if exc.errno not in _GONE:
                        raise
                    unlike.append(path)
                    continue
                calls.append((dfd, _name(path), size, oid))
                paths.append(path)
            # A few files are read here: starting the threads would cost more.
            many = len(calls) >= _THREADED_FROM
            fine = threads.run(_same_blob_at, calls) if many else _batch(_same_blob_at, calls)
        finally:
            own.close()
        unlike.extend(path for path, ok in zip(paths, fine, strict=True) if not ok)
        if progress is not None:
            progress("check", total - len(blobs) + i, total)
    return unlike


Read = tuple[bytes, Entry, ObjectId]
"""A regular file whose content the conflict check must compare: path, base entry, its oid."""


def _scan(
    dirs: _Dirs,
    plan: _Plan,
    seen: dict[bytes, Seen] | None,
    known: Known | None,
    progress: Progress | None = None,
    crash: _Crash | None = None,
) -> tuple[list[bytes], list[Read]]:
    """The conflict check's stat pass, which needs no store (the threaded staging runs it in
    a thread of its own, see `_Checker`): the touched paths whose kind, mode, size, symlink
    target or absence already differ from the base, and the regular files whose content is
    still to compare. ``seen`` as in `_conflicts`; ``crash``: the point ``check:K`` at the
    K-th path, for the crash tests."""
    created = {op[1] for op in plan.ops if op[0] == "mkdir"}
    checked = [c for c in plan.changes if _parent(c.path) not in created]
    # Beneath a directory this commit creates: the directory's check covers it.
    total = len(plan.changes)
    faults = crash is not None and crash.point is not None
    bad: list[bytes] = []
    reads: list[Read] = []
    # A big commit's regular files are lstat'ed by compiled calls, a chunk per call (the rest,
    # and every path of a small commit, one by one below).
    files = (
        _seen_files(dirs, checked)
        if _batchio is not None and len(checked) >= SYNCFS_FROM
        else {}
    )
    for k, c in enumerate(checked):
        if progress is not None and k % 256 == 0:
            progress("check", k - len(reads), total)  # the files still to read count later
        if faults:
            crash.named(f"check:{k}")  # type: ignore[union-attr]  # faults: crash is set
        e = c.old
        if e is not None and c.path in files:
            was = files[c.path]  # `_seen` of a regular file: dev, ino, mode, size, mtime, ctime
            if seen is not None:
                seen[c.path] = was
            if was is None:
                bad.append(c.path)
            elif (
                len(was) == 6
                and stat.S_ISREG(was[2])
                and stat.S_IMODE(was[2]) == e.mode
                and was[3] == e.size
            ):
                if known is None or known.get(c.path) != (was[0], was[1], was[5]):
                    if e.oid is None:
                        bad.append(c.path)  # as below
                    else:
                        reads.append((c.path, e, e.oid))
            else:
                bad.append(c.path)  # a file whose kind, mode or size differ
            continue
        st = _lstat(dirs, c.path)
        if seen is not None:
            seen[c.path] = _seen(st)
        e = c.old
        if e is None:
            if st is not None or not _reachable_dir(dirs, _parent(c.path)):
                bad.append(c.path)
            continue
        if st is None:
            bad.append(c.path)
        elif (
            e.kind == FILE
            and stat.S_ISREG(st.st_mode)
            and stat.S_IMODE(st.st_mode) == e.mode
            and st.st_size == e.size
        ):
            if known is None or known.get(c.path) != (st.st_dev, st.st_ino, st.st_ctime_ns):
                if e.oid is None:
                    # No decoded tree holds such an entry (decoding gives every file its oid);
                    # one built by hand may: content not known is never taken as held.
                    bad.append(c.path)
                else:
                    reads.append((c.path, e, e.oid))
            # else: the very file the caller hashed into the base, unwritten since
        elif e.kind == FILE or not _holds_unread(dirs, c.path, e, st):
            bad.append(c.path)  # a file whose kind, mode or size differ, or another entry
    return bad, reads


def _seen_files(dirs: _Dirs, checked: list[Change]) -> dict[bytes, Seen]:
    """`_seen` of each path of ``checked`` whose base entry is a regular file, taken by
    _batchio.seen_many a chunk at a time in this thread, through duplicates of the chunk's
    directory fds (`_ChunkDirs`: ``dirs`` may close its least recently used ones)."""
    paths = [c.path for c in checked if c.old is not None and c.old.kind == FILE]
    return dict(zip(paths, _seen_batched(dirs, paths, None), strict=True))


def _seen_batched(dirs: _Dirs, paths: list[bytes], threads: _Threads | None) -> list[Seen]:
    """`_seen` of the lstat of each of ``paths`` (None where its parent is not a reachable
    directory, as `_lstat`), by compiled calls a chunk at a time: in ``threads``, a slice of
    the chunk each, or else in this thread."""
    out: list[Seen] = []
    i = 0
    while i < len(paths):
        own = _ChunkDirs(dirs)
        calls: list[tuple[Any, ...]] = []
        try:
            j = i
            while j < len(paths) and j - i < _CHUNK_OPS and len(own.fds) < _CHUNK_DIRS:
                path = paths[j]
                try:
                    fd = own.get(_parent(path))
                except OSError as exc:  # as `_lstat`: an unreachable parent, nothing there
                    if exc.errno not in _GONE:
                        raise
                    fd = -1
                calls.append((fd, _name(path)))
                j += 1
            if threads is not None:
                # called only where it is built
                out.extend(threads.finish(threads.start_slices(_batchio.seen_many, calls)))  # type: ignore[union-attr]
            else:
                # called only where it is built
                out.extend(_batchio.seen_many(calls))  # type: ignore[union-attr]
        finally:
            own.close()
        i = j
    return out


def _holds_unread(dirs: _Dirs, path: bytes, e: Entry, st: os.stat_result) -> bool:
    """`_holds` for an entry that is no regular file, whose ``st`` the caller took: decided
    without the store (`_scan` runs it in a thread)."""
    fmt = stat.S_IFMT(st.st_mode)
    if e.kind == DIR:
        return fmt == stat.S_IFDIR and stat.S_IMODE(st.st_mode) == e.mode
    if e.kind == SYMLINK:
        if fmt != stat.S_IFLNK:
            return False
        return os.readlink(_name(path), dir_fd=dirs.get(_parent(path))) == e.target
    return (
        e.kind in SPECIALS
        and fmt == SPECIAL_FMT[e.kind]
        and stat.S_IMODE(st.st_mode) == e.mode
        and (e.kind not in DEVICES or st.st_rdev == e.rdev)
    )


def _extra_names(dirs: _Dirs, plan: _Plan, skip: set[bytes]) -> list[bytes]:
    """The names in directories the commit removes that the base does not list (the commit
    would remove them too) but for directories in ``skip`` (already reported)."""
    extra: list[bytes] = []
    for d, names in plan.removed_dirs.items():
        if d in skip:
            continue
        try:
            real = {os.fsencode(n) for n in os.listdir(dirs.get(d))}
        except OSError as exc:
            if exc.errno in _GONE:
                continue  # already reported through the directory's own entry
            raise
        extra.extend(d + b"/" + name for name in sorted(real - names))
    return extra


class _Checker:
    """The conflict check of a threaded staging, run in a thread beside it: the staging's
    threads wait on the kernel creating files (about one core of two), and the check's
    50,000 lstats and its reads of the files not ``known`` would otherwise run before, alone.

    Its thread uses directory fds of its own and never the store (whose connection belongs
    to the main thread): a file it reads is held when its bytes hash to the base's blob id;
    any other file (a mismatch, a big file the store may keep in chunks) is checked again by
    `result`, in the main thread, with the store. The staging writes only names of its own
    (`STAGE_PREFIX`), never a checked path, and the check compares directories by inode and
    mode only (`_seen`), so neither sees the other."""

    def __init__(
        self,
        root: int,
        plan: _Plan,
        seen: dict[bytes, Seen],
        known: Known | None,
        threads: _Threads,
        crash: _Crash,
    ) -> None:
        self.dirs = _Dirs(root)
        self.plan = plan
        self.seen = seen
        self.known = known
        self.threads = threads
        self.crash = crash
        self.bad: list[bytes] = []
        self.again: list[Read] = []  # for `result`, with the store
        self.error: BaseException | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="jbx-check", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            bad, reads = _scan(self.dirs, self.plan, self.seen, self.known, crash=self.crash)
            # In the staging's threads, a chunk at a time: its chunks and these take turns.
            small = [(path, e.size, oid) for path, e, oid in reads if e.size <= _SMALL_FILE]
            unlike = set(_unlike_blobs(self.dirs, small, self.threads, stopped=self._stopped))
            self.again = [r for r in reads if r[1].size > _SMALL_FILE or r[0] in unlike]
            bad.extend(_extra_names(self.dirs, self.plan, set(bad)))
            self.bad = bad
        except BaseException as exc:  # handed to the main thread by `result`
            self.error = exc
        finally:
            self.dirs.close()

    def _stopped(self) -> bool:
        return self.stopped

    def stop(self) -> None:
        """Ends the thread early (the commit stops) and waits for it."""
        self.stopped = True
        self.thread.join()

    def result(self, store: ObjectReader, dirs: _Dirs) -> list[str]:
        """The conflicts, as `_conflicts` reports them, once the thread has ended."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        bad = self.bad + [
            path for path, e, _ in self.again if not _holds(store, dirs, path, e, None, self.known)
        ]
        return [_show(p) for p in sorted(set(bad))]


def _changed_since(
    dirs: _Dirs, plan: _Plan, seen: dict[bytes, Seen], threads: _Threads | None = None
) -> list[str]:
    """The touched paths that are no longer the very entries the conflict check saw, and the
    extra names that appeared in directories the commit removes. With ``threads`` and many
    paths, their lstats are made in those threads a slice at a time (_batchio.seen_many)."""
    if _batchio is not None and threads is not None and len(seen) >= SYNCFS_FROM:
        bad = _changed_batched(dirs, seen, threads)
    else:
        bad = [path for path, was in seen.items() if _seen(_lstat(dirs, path)) != was]
    bad.extend(_extra_names(dirs, plan, set()))
    lap("commit: re-check")
    return [_show(p) for p in sorted(set(bad))]


def _changed_batched(dirs: _Dirs, seen: dict[bytes, Seen], threads: _Threads) -> list[bytes]:
    """`_changed_since`'s paths that changed, each chunk's lstats made by compiled calls in
    ``threads`` (`_seen_batched`)."""
    paths = list(seen)
    now = _seen_batched(dirs, paths, threads)
    return [p for p, st in zip(paths, now, strict=True) if st != seen[p]]


def _reachable_dir(dirs: _Dirs, path: bytes) -> bool:
    try:
        dirs.get(path)
    except OSError as exc:
        if exc.errno in _GONE:
            return False
        raise
    return True


def _prefetched(
    store: ObjectReader, oids: Iterable[ObjectId], how: str = "prefetched"
) -> contextlib.AbstractContextManager[object]:
    """The store's bulk index lookup for ``oids`` (shadowfs.store.Store.prefetched, or
    ``how="prefetched_blobs"`` for `read_blobs`), when it has one: a commit reads every object
    it touches, one index query each otherwise."""
    bulk = getattr(store, how, None)
    return bulk(oids) if bulk is not None else contextlib.nullcontext()


# --- staging ----------------------------------------------------------------------------------


def _check_interrupt(interrupted: Interrupted | None) -> None:
    if interrupted is not None and interrupted():
        raise CommitInterrupted(
            "commit interrupted before its commit point: the staging was undone and nothing "
            "was applied"
        )


class _WriteSink:
    __slots__ = ("fd", "holes", "interrupted", "written")

    def __init__(self, fd: int, interrupted: Interrupted | None = None) -> None:
        self.fd = fd
        self.written = 0
        self.interrupted = interrupted
        self.holes = False

    def skip(self, n: int) -> None:
        """A chunk of zeros: seek past it, leaving a hole (`finish` sets the size)."""
        _check_interrupt(self.interrupted)
        os.lseek(self.fd, n, os.SEEK_CUR)
        self.written += n
        self.holes = True

    def finish(self) -> None:
        # A file that ends in a hole has its size only once something extends it there.
        if self.holes:
            os.ftruncate(self.fd, self.written)

    def write(self, data: bytes) -> int:
        _check_interrupt(self.interrupted)  # a big file stages for seconds: ask per chunk
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.written += len(data)
        return len(data)


class _Syncer:
    """fsyncs staged files in concurrent batches, or the whole file system once.

    One fsync at a time costs a journal commit each; the file system folds concurrent fsyncs into
    shared commits, which makes a 1,000-file commit several times faster. Only fds wait here, never
    data, so memory stays constant; the batch bound keeps the fd count low. Given ``whole_fs``
    (a directory fd on the target), files are closed at once and `close` runs one syncfs
    instead: past a few hundred files that is several times faster again, and it covers the
    staging directories' entries too.
    """

    BATCH = 512
    THREADS = 16

    def __init__(self, whole_fs: int | None = None) -> None:
        self.whole_fs = whole_fs
        self.fds: list[int] = []
        self.pool: ThreadPoolExecutor | None = None
        self.early: Future[None] | None = None
        self.early_pool: ThreadPoolExecutor | None = None
        # Bigger batches fold more fsyncs together; a quarter of the fd limit leaves the rest
        # of the process (directory fds, the store) room.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        unlimited = soft == resource.RLIM_INFINITY
        self.batch = self.BATCH if unlimited else max(1, min(self.BATCH, soft // 4))

    def add(self, fd: int) -> None:
        if self.whole_fs is not None:
            os.close(fd)
            return
        self.fds.append(fd)
        if len(self.fds) >= self.batch:
            self.flush()

    def flush(self) -> None:
        fds, self.fds = self.fds, []
        try:
            if len(fds) == 1:
                os.fsync(fds[0])
            elif fds:
                if self.pool is None:
                    self.pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="jbx-fsync")
                for _ in self.pool.map(os.fsync, fds):
                    pass
        finally:
            for fd in fds:
                os.close(fd)

    def kick(self) -> None:
        """With ``whole_fs``: start writing back what is staged so far, in the background, unless
        such a write-back still runs. The disk then writes one chunk while the threads create the
        next, and `close`'s syncfs finds little left to write (of 50,000 small files it waited
        1.3 s for all of them). Only `close`'s syncfs makes anything durable."""
        if self.whole_fs is None or (self.early is not None and not self.early.done()):
            return
        if self.early is not None:
            self.early.result()  # a write-back error, reported once per fd: never dropped
        if self.early_pool is None:
            self.early_pool = ThreadPoolExecutor(1, thread_name_prefix="jbx-syncfs")
        self.early = self.early_pool.submit(syncfs, self.whole_fs)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self.pool is not None:
                self.pool.shutdown()
            if self.early_pool is not None:
                self.early_pool.shutdown()
        if self.early is not None:
            self.early.result()
        if self.whole_fs is not None:
            syncfs(self.whole_fs)


def _umask() -> int | None:
    """The process's umask, read without setting it (os.umask sets it, for every thread at
    once); None where /proc does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _direct(mode: int, umask: int | None) -> bool:
    """Whether a file created with ``mode`` gets exactly that mode: no setuid, setgid or sticky
    bit (those are set after the data, see `_write_staged`) and no bit the umask clears. Then
    the fchmod is left out: 50,000 syscalls, each dirtying an inode, in a 50,000-file commit."""
    return umask is not None and not mode & ~0o777 and not mode & umask


def _stage_one(
    store: ObjectReader,
    dirs: _Dirs,
    s: _Stage,
    syncer: _Syncer,
    interrupted: Interrupted | None = None,
    umask: int | None = None,
) -> int:
    dfd = dirs.get(s.dir)
    e = s.entry
    times = (e.mtime_ns, e.mtime_ns)
    if s.link_to is not None:
        first = s.link_to
        os.link(first.name, s.name, src_dir_fd=dirs.get(first.dir), dst_dir_fd=dfd,
                follow_symlinks=False)
        return 0
    if e.kind == SYMLINK:
        # a symlink always has a target (Entry.target is None for the other kinds)
        os.symlink(e.target, s.name, dir_fd=dfd)  # type: ignore[arg-type]
        os.utime(s.name, ns=times, dir_fd=dfd, follow_symlinks=False)
        return 0
    if e.kind in SPECIALS:
        try:
            make_special(e, s.name, dfd)
        except PermissionError:
            raise ShadowfsError(
                f"cannot create the {e.kind} {_show(s.path)!r} in the tree: making device "
                "nodes needs CAP_MKNOD; commit as root, or remove it in the booth first"
            ) from None
        os.utime(s.name, ns=times, dir_fd=dfd, follow_symlinks=False)
        return 0
    direct = _direct(e.mode, umask)
    fd = os.open(s.name, _CREATE_FLAGS, e.mode if direct else 0o600, dir_fd=dfd)
    try:
        sink = _WriteSink(fd, interrupted)
        # a file or directory entry has an oid (only a symlink's is None)
        store.read_file_into(e.oid, sink)  # type: ignore[arg-type]
        sink.finish()
        if sink.written != e.size:
            raise ShadowfsError(
                f"the store gave {sink.written} bytes for {_show(s.path)!r}, whose tree entry "
                f"says {e.size}; run `jukebox verify` on the store"
            )
        if not direct:
            # After the data: a write by a non-root owner would clear setuid/setgid bits.
            os.fchmod(fd, e.mode)
        os.utime(fd, ns=times)
    except BaseException:
        os.close(fd)
        raise
    syncer.add(fd)
    return e.size


def _write_staged(
    dfd: int, name: bytes, data: bytes, mode: int, mtime_ns: int, direct: bool
) -> None:
    """A small staged file, whole, in a thread (its fsync is the commit's one syncfs); created
    with its ``mode`` when ``direct`` (see `_direct`)."""
    fd = os.open(name, _CREATE_FLAGS, mode if direct else 0o600, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if not direct:
            # After the data: a write by a non-root owner would clear setuid/setgid bits.
            os.fchmod(fd, mode)
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    finally:
        os.close(fd)


def _write_slice(calls: list[tuple[Any, ...]]) -> list[Any]:
    """`_write_staged` for each of ``calls``, in one compiled call (_batchio.write_files)."""
    _batchio.write_files(calls)  # type: ignore[union-attr]  # called only where it is built
    return []


class _Chunk(Record):
    """Stages written together: small files by threads, then the rest one by one."""

    __slots__ = FIELDS = ("start", "end", "own", "calls", "rest", "held", "futures")
    start: int
    end: int
    own: _ChunkDirs
    calls: list[tuple[Any, ...]]
    rest: list[_Stage]  # big files, symlinks, special files, further names of a link group
    held: int  # bytes of the small files' content
    futures: list[Future[Any]]

    def __init__(
        self,
        start: int,
        end: int,
        own: _ChunkDirs,
        calls: list[tuple[Any, ...]],
        rest: list[_Stage],
        held: int,
        futures: list[Future[Any]],
    ) -> None:
        self.start = start
        self.end = end
        self.own = own
        self.calls = calls
        self.rest = rest
        self.held = held
        self.futures = futures


def _small(s: _Stage) -> bool:
    """Whether `_stage_threaded` writes this stage from a bulk read, in a thread."""
    return s.link_to is None and s.entry.kind == FILE and s.entry.size <= _SMALL_FILE


def _split_reads(stages: list[_Stage], whole_fs: bool) -> tuple[list[ObjectId], list[ObjectId]]:
    """The object ids of the stages a threaded staging (``whole_fs``) reads in bulk (`_small`),
    and of the rest."""
    small: list[ObjectId] = []
    rest: list[ObjectId] = []
    for s in stages:
        oid = s.entry.oid
        if oid is not None:
            (small if whole_fs and _small(s) else rest).append(oid)
    return small, rest


def _read_chunk(
    store: ObjectReader, dirs: _Dirs, stages: list[_Stage], i: int, umask: int | None
) -> _Chunk:
    """The chunk from ``stages[i]`` on, its small files' content read from the store (here, in
    the main thread: the store is not shared with the threads), in one bulk read."""
    c = _Chunk(i, i, _ChunkDirs(dirs), [], [], 0, [])
    fds = c.own.fds
    get = c.own.get
    direct: dict[int, bool] = {}  # `_direct` of each mode met, asked once
    try:
        small: list[_Stage] = []
        fd_of: list[int] = []
        end = min(len(stages), i + _CHUNK_OPS)
        held = 0
        while c.end < end and held < _CHUNK_BYTES and len(fds) < _CHUNK_DIRS:
            s = stages[c.end]
            e = s.entry
            c.end += 1
            if s.link_to is not None or e.kind != FILE or e.size > _SMALL_FILE:  # not `_small`
                c.rest.append(s)
                continue
            small.append(s)
            fd_of.append(get(s.dir))
            held += e.size  # checked against what the store gives, below
        c.held = held
        # a file entry has an oid (only a symlink's is None)
        contents = store.read_blobs([s.entry.oid for s in small])  # type: ignore[misc]
        calls = c.calls
        for s, dfd, data in zip(small, fd_of, contents, strict=True):
            e = s.entry
            if len(data) != e.size:
                raise ShadowfsError(
                    f"the store gave {len(data)} bytes for {_show(s.path)!r}, whose tree entry "
                    f"says {e.size}; run `jukebox verify` on the store"
                )
            mode = e.mode
            d = direct.get(mode)
            if d is None:
                d = direct[mode] = _direct(mode, umask)
            calls.append((dfd, s.name, data, mode, e.mtime_ns, d))
    except BaseException:
        c.own.close()
        raise
    return c


def _stage_threaded(
    store: ObjectReader,
    dirs: _Dirs,
    stages: list[_Stage],
    syncer: _Syncer,
    threads: _Threads,
    interrupted: Interrupted | None,
    done: Callable[[int, int], None],
    umask: int | None = None,
) -> None:
    """Stage everything, for a commit synced as a whole (``syncer.whole_fs``): each chunk's
    small files are read while the threads write the previous chunk's, and the rest of a
    chunk is staged once its small files are written (a hard link's first name is then in
    place). ``done(k, nbytes)`` is told of each stage staged, in order. Returns or raises only
    once no thread writes any more."""
    lap("commit: prepare record, blob index prefetch")
    live: list[_Chunk] = []
    try:
        i = 0
        while i < len(stages) or live:
            if i < len(stages):
                _check_interrupt(interrupted)
                c = _read_chunk(store, dirs, stages, i, umask)
                live.append(c)
                if _batchio is not None:
                    c.futures = threads.start_slices(_write_slice, c.calls)
                else:
                    c.futures = threads.start(_write_staged, c.calls)
                i = c.end
            if len(live) > 1 or i >= len(stages):
                c = live[0]
                threads.finish(c.futures)
                syncer.kick()
                live.pop(0)
                c.own.close()
                done(c.start, c.held)
                for s in c.rest:
                    _check_interrupt(interrupted)
                    done(-1, _stage_one(store, dirs, s, syncer, interrupted, umask))
                for k in range(c.start + 1, c.end):
                    done(k, 0)
    finally:
        for c in live:
            with contextlib.suppress(BaseException):
                _Threads.finish(c.futures)
            c.own.close()
    lap("commit: staged (the check beside)")


def _mtime(dirs: _Dirs, d: bytes) -> int:
    return os.fstat(dirs.get(d)).st_mtime_ns


def _undo_staging(dirs: _Dirs, prepare: dict[str, Any]) -> None:
    """Remove everything staged under a prepare record and restore the staging directories'
    mtimes: the tree is then exactly what it was before the commit began."""
    prefix = STAGE_PREFIX + str(prepare["token"]).encode() + b"-"
    for enc, mtime_ns in prepare["dirs"]:
        d = _dec(enc)
        if d:
            _check_path(d)
        try:
            dfd = dirs.get(d)
        except OSError as exc:
            if exc.errno in _GONE:
                continue
            raise
        with os.scandir(dfd) as it:
            names = [os.fsencode(de.name) for de in it if os.fsencode(de.name).startswith(prefix)]
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
        os.utime(dfd, ns=(os.fstat(dfd).st_atime_ns, mtime_ns))
        os.fsync(dfd)


# --- journal files ----------------------------------------------------------------------------


def _digest(body: bytes, key: bytes | None) -> bytes:
    hasher = blake3(body, key=key) if key is not None else blake3(body)
    return hasher.hexdigest().encode("ascii")


def _seal(record: dict[str, Any], key: bytes | None = None) -> bytes:
    body = json.dumps(record, separators=(",", ":")).encode("ascii")
    magic = _MAGIC_KEYED if key is not None else _MAGIC
    return magic + b" " + _digest(body, key) + b"\n" + body


def _unseal(data: bytes, key: bytes | None = None) -> dict[str, Any] | None:
    """The record, or None when the bytes are torn or damaged (a commit that never happened).

    With a key, only a record sealed with that key counts: a journal planted in a tape dir
    received from someone else is no commit of ours, and is never run."""
    head, sep, body = data.partition(b"\n")
    parts = head.split(b" ")
    if not sep or len(parts) != 2:
        return None
    if parts[0] == _MAGIC_KEYED and key is None:
        raise ShadowfsError(
            "the commit journal is sealed with a key and none was given: recover it through "
            "the program that wrote it (jukebox recovers its own at every open of the tape dir)"
        )
    if parts[0] != (_MAGIC_KEYED if key is not None else _MAGIC):
        return None
    if _digest(body, key) != parts[1]:
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _write_sealed(jfd: int, name: str, data: bytes) -> None:
    """Write a file durably and atomically: temp, fsync, rename, fsync the directory."""
    tmp = name + ".tmp"
    fd = os.open(tmp, _JOURNAL_FLAGS, 0o600, dir_fd=jfd)
    try:
        _WriteSink(fd).write(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=jfd, dst_dir_fd=jfd)
    os.fsync(jfd)


def _read_sealed(
    jfd: int, name: str, key: bytes | None = None
) -> tuple[bool, dict[str, Any] | None]:
    """(file exists, its valid record or None)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=jfd)
    except FileNotFoundError:
        return False, None
    try:
        chunks = []
        while chunk := os.read(fd, _READ_SIZE):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return True, _unseal(b"".join(chunks), key)


def _remove(jfd: int, *names: str) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=jfd)


@contextlib.contextmanager
def _journal_dir(journal_dir: Target, *, wait: bool = True) -> Iterator[int]:
    """The journal directory's fd, exclusively flocked: one commit or recovery at a time. An
    fd is the caller's, locked by the caller. ``wait=False`` raises CommitBusy instead of
    waiting for another process's commit or recovery."""
    if isinstance(journal_dir, int):
        yield journal_dir
        return
    path = os.fsencode(journal_dir)
    os.makedirs(path, exist_ok=True)
    jfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(jfd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise CommitBusy(
                f"another process is committing or recovering through {os.fsdecode(path)!r}"
            ) from None
        yield jfd
    finally:
        os.close(jfd)


def _identity(fd: int) -> list[int]:
    st = os.fstat(fd)
    return [st.st_dev, st.st_ino]


# --- the trash --------------------------------------------------------------------------------


class _Trash:
    """``<journal_dir>/trash``, where operations put the files they replace or remove instead of
    freeing them. Names are ``<token>-<op index>``: fixed by the journal, so a redo puts a file
    at the same name. A big commit's trash is spread over ``shards`` sub-directories (op k in
    ``k % shards``): 16 threads adding 50,000 names to one directory would queue on its lock."""

    __slots__ = ("fd", "prefix", "shards")

    def __init__(self, fd: int, token: str, shards: int = 0) -> None:
        self.fd = fd
        self.prefix = token.encode() + b"-"
        self.shards: list[int] = []
        try:
            for i in range(shards):
                name = str(i).encode()
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
                self.shards.append(os.open(name, _DIR_FLAGS, dir_fd=fd))
        except BaseException:
            self.close()
            raise

    def place(self, k: int) -> tuple[int, bytes]:
        """The directory fd and name of op ``k``'s trash entry."""
        fd = self.shards[k % len(self.shards)] if self.shards else self.fd
        return fd, self.prefix + str(k).encode()

    def take(self, dfd: int, name: bytes, k: int) -> bool:
        """Move ``name`` (not a directory) from ``dfd`` into the trash; False when it is not
        there, or cannot be moved here (another file system): then the caller frees it."""
        tfd, tname = self.place(k)
        try:
            os.rename(name, tname, src_dir_fd=dfd, dst_dir_fd=tfd)
        except OSError:
            return False
        return True

    def keep(self, dfd: int, name: bytes, k: int) -> bool:
        """Link ``name`` in ``dfd`` (the file a rename is about to replace) into the trash, so
        that the rename drops a link and frees nothing. A link is harmless whatever the file
        (an extra name of garbage, freed with the trash), so a redo needs no check first, and
        unlike a rename into the trash it is no cross-directory rename (those queue on the file
        system's rename lock). False when nothing was linked (no file there, a directory, a
        link the kernel refuses): the rename then frees the file in place. An entry already
        at the name is a previous run's link of this op: kept."""
        tfd, tname = self.place(k)
        try:
            os.link(name, tname, src_dir_fd=dfd, dst_dir_fd=tfd, follow_symlinks=False)
        except FileExistsError:
            return True
        except OSError:
            return False
        return True

    def sync(self) -> None:
        for fd in (self.fd, *self.shards):
            os.fsync(fd)

    def close(self) -> None:
        for fd in self.shards:
            os.close(fd)
        self.shards = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@contextlib.contextmanager
def _trash(jfd: int, root: int, token: str, n_ops: int = 0) -> Iterator[_Trash | None]:
    """The trash for a (re)run of a journal of ``n_ops`` operations: None when the journal
    directory is not on the target's file system (a rename there would fail: files are freed in
    place, as before). Sharded when the operations run in threads."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(TRASH_NAME, 0o700, dir_fd=jfd)
    fd = os.open(TRASH_NAME, _DIR_FLAGS, dir_fd=jfd)
    if os.fstat(fd).st_dev != os.fstat(root).st_dev:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(TRASH_NAME, dir_fd=jfd)
        yield None
        return
    trash = _Trash(fd, token, _THREADS if n_ops >= SYNCFS_FROM else 0)
    try:
        yield trash
    finally:
        trash.close()


def _free_trash(jfd: int) -> None:
    """Free whatever an earlier commit left in the trash (all of it garbage)."""
    empty_trash(TRASH_NAME, dir_fd=jfd)


# --- running operations (apply and redo share this path) --------------------------------------


def _chmod(dirs: _Dirs, path: bytes, mode: int) -> None:
    pfd = dirs.get(_parent(path))
    try:
        fd = os.open(_name(path), _READ_FLAGS, dir_fd=pfd)
    except PermissionError:
        # An unreadable file cannot be opened to fchmod; O_PATH reaches it without following a
        # symlink, and /proc/self/fd resolves to exactly that inode.
        fd = os.open(_name(path), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                return
            os.chmod(f"/proc/self/fd/{fd}", mode)
        finally:
            os.close(fd)
        return
    try:
        os.fchmod(fd, mode)
        os.fsync(fd)  # inode metadata is not covered by the directory fsync
    finally:
        os.close(fd)


def _run_op(
    dirs: _Dirs,
    op: list[Any],
    trash: _Trash | None = None,
    k: int = -1,
    crash: _Crash | None = None,
) -> None:
    """One journal operation (op ``k``), idempotent: running it again after it took effect is
    a no-op. With a ``trash``, the file it replaces or removes is moved there, not freed."""
    kind = op[0]
    if kind == "rename":
        sdir, sname, path = op[1], op[2], op[3]
        try:
            dst = dirs.get(_parent(path))
            src = dirs.get(sdir)
            if trash is not None:
                # Only while the staged file is still there: once it has taken the path, what
                # is at the path is the new file.
                try:
                    os.stat(sname, dir_fd=src, follow_symlinks=False)
                    staged = True
                except FileNotFoundError:
                    staged = False
                old = _lstat(dirs, path) if staged else None
                if (
                    old is not None
                    and not stat.S_ISDIR(old.st_mode)
                    and trash.keep(dst, _name(path), k)
                    and crash is not None
                ):
                    crash.named(f"aside:{k}")
            os.rename(sname, _name(path), src_dir_fd=src, dst_dir_fd=dst)
        except OSError as exc:
            if exc.errno not in _GONE or _lstat(dirs, sdir + b"/" + sname if sdir else sname):
                raise
        return
    path = op[1]
    if kind in ("unlink", "rmdir"):
        st = _lstat(dirs, path)  # None also when a parent is already gone: nothing to remove
        if st is None or stat.S_ISDIR(st.st_mode) != (kind == "rmdir"):
            return  # already removed, or already replaced by the new entry
        pfd = dirs.get(_parent(path))
        if kind == "rmdir":
            dirs.forget(path)
            os.rmdir(_name(path), dir_fd=pfd)
        elif trash is None or not trash.take(pfd, _name(path), k):
            os.unlink(_name(path), dir_fd=pfd)
    elif kind == "mkdir":
        try:
            os.mkdir(_name(path), 0o700, dir_fd=dirs.get(_parent(path)))
        except FileExistsError:
            st = _lstat(dirs, path)
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise
    elif kind == "chmod":
        _chmod(dirs, path, op[2])
    elif kind == "utime":
        pfd = dirs.get(_parent(path))
        os.utime(_name(path), ns=(op[2], op[2]), dir_fd=pfd, follow_symlinks=False)
    else:
        raise ShadowfsError(f"unknown commit journal operation {kind!r}; the journal is corrupt")


# Operations that never depend on one another when consecutive in a journal: a rename moves a
# staged name (unique) onto its final path (unique), an unlink removes one name.
_THREADED_OPS = ("rename", "unlink")


def _op_dirs(op: list[Any]) -> tuple[bytes, ...]:
    return (op[1], _parent(op[3])) if op[0] == "rename" else (_parent(op[1]),)


def _chunk_end(ops: list[list[Any]], i: int) -> int:
    """The end of the chunk of same-kind operations from ``i`` that run in threads together."""
    kind = ops[i][0]
    dirs: set[bytes] = set()
    j = i
    end = min(len(ops), i + _CHUNK_OPS)
    while j < end and ops[j][0] == kind:
        op = ops[j]
        # A rename's directories (the staging one is the destination's or an ancestor of it),
        # else the parent of op[1]: added one by one, not as a new set per operation.
        if kind == "rename":
            a, b = op[1], _parent(op[3])
            grow = (a not in dirs) + (b != a and b not in dirs)
        else:
            a = b = _parent(op[1])
            grow = a not in dirs
        if grow and len(dirs) + grow > _CHUNK_DIRS and j > i:
            break
        dirs.add(a)
        dirs.add(b)
        j += 1
    return j


def _fast_op(
    kind: str,
    dfd: int,
    name: bytes,
    dst_fd: int,
    dst_name: bytes,
    trash: _Trash | None,
    k: int,
    crash: _Crash,
) -> bool:
    """The plain case of a rename or an unlink (op ``k``), in a thread. False (a directory where
    a file was, a name already gone, any error) leaves the operation to `_run_op`, which runs it
    again with all its checks."""
    try:
        if kind == "rename" and trash is not None:
            # No stat first: a link into the trash is harmless whatever is at the path (see
            # `_Trash.keep`), and a rename that finds no staged file (a redo) or a directory at
            # the path fails, leaving the op to `_run_op`.
            if trash.keep(dst_fd, dst_name, k):
                crash.named(f"aside:{k}")
            os.rename(name, dst_name, src_dir_fd=dfd, dst_dir_fd=dst_fd)
        elif kind == "rename":
            # The file renamed over is freed by whoever drops its last reference, and a rename
            # drops it still holding the directories' locks: there, the freeing (a synchronous
            # discard on a file system mounted with it) would make every thread renaming in the
            # same directory wait. Holding the file open moves the freeing to the close.
            try:
                held = os.open(dst_name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dst_fd)
            except FileNotFoundError:
                held = -1
            try:
                os.rename(name, dst_name, src_dir_fd=dfd, dst_dir_fd=dst_fd)
            finally:
                if held >= 0:
                    os.close(held)
        elif kind == "unlink":
            if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                return False
            if trash is None or not trash.take(dfd, name, k):
                os.unlink(name, dir_fd=dfd)
        else:
            return False
    except OSError:
        return False
    return True


def _run_ops_threaded(
    dirs: _Dirs,
    chunk: list[list[Any]],
    first: int,
    threads: _Threads,
    trash: _Trash | None,
    crash: _Crash,
) -> None:
    """Independent operations (see ``_THREADED_OPS``), ops ``first``.. of the journal, run in
    threads; those a thread left undone then run one by one, as `_redo` runs any operation."""
    if _batchio is not None and trash is not None and chunk[0][0] == "rename":
        r = _Renames(dirs, chunk, first, trash, crash)
        r.start(threads)
        r.finish(dirs, trash)
        return
    own = _ChunkDirs(dirs)
    calls: list[tuple[Any, ...]] = []
    try:
        for k, op in enumerate(chunk, first):
            try:
                if op[0] == "rename":
                    calls.append(("rename", own.get(op[1]), op[2], own.get(_parent(op[3])),
                                  _name(op[3]), trash, k, crash))  # fmt: skip
                else:
                    calls.append((op[0], own.get(_parent(op[1])), _name(op[1]), -1, b"", trash,
                                  k, crash))  # fmt: skip
            except OSError:  # a directory not there: `_run_op` decides
                calls.append(("", -1, b"", -1, b"", None, k, crash))
        done = threads.run(_fast_op, calls)
    finally:
        own.close()
    for k, (op, ok) in enumerate(zip(chunk, done, strict=True), first):
        if not ok:
            _run_op(dirs, op, trash, k, crash)


def _rename_slice(die_at: int, start: int, part: list[tuple[Any, ...]]) -> bytes:
    """_batchio.keep_and_rename of a slice of (trash fd, trash name, staged dir fd, staged name,
    dir fd, name) calls, the ``start``-th call of its chunk first; ``die_at``: the index in
    the chunk of the call where the crash tests die (`aside:K`), or -1."""
    at = die_at - start if start <= die_at < start + len(part) else -1
    # called only where it is built
    return _batchio.keep_and_rename(part, at)  # type: ignore[union-attr,no-any-return]


class _Renames:
    """A chunk of renames with a trash (`_run_ops_threaded`'s common case in a big commit),
    each thread's slice in one compiled call (_batchio.keep_and_rename: `_fast_op`'s link into
    the trash and rename, the same calls); those it left undone then run one by one, as `_redo`
    runs any operation.

    Made (`__init__`: the calls, the directory fds) while the previous chunk's threads still
    run, and `start`ed only once that chunk has `finish`ed: the chunks run one after another as
    before, and the main thread's Python for the next one no longer leaves the cores idle
    between them."""

    __slots__ = ("calls", "chunk", "crash", "die_at", "first", "futures", "keys", "own", "slow")

    def __init__(
        self, dirs: _Dirs, chunk: list[list[Any]], first: int, trash: _Trash, crash: _Crash
    ) -> None:
        self.chunk = chunk
        self.first = first
        self.crash = crash
        self.own = own = _ChunkDirs(dirs)
        self.calls: list[tuple[Any, ...]] = []
        self.keys: list[int] = []  # each call's op index
        self.slow: list[int] = []  # ops whose directories are not there: `_run_op` decides
        self.futures: list[Future[Any]] = []
        aside = -1
        if crash.point is not None and crash.point.startswith("aside:"):
            with contextlib.suppress(ValueError):
                aside = int(crash.point[6:])
        self.die_at = -1
        calls, keys = self.calls, self.keys
        get, place = own.get, trash.place
        try:
            for k, op in enumerate(chunk, first):
                try:
                    src, dst = get(op[1]), get(_parent(op[3]))
                except OSError:
                    self.slow.append(k)
                    continue
                if k == aside:
                    self.die_at = len(calls)
                # Where recovery and `_run_op` look for op k's kept file: `place` alone says.
                calls.append((*place(k), src, op[2], dst, _name(op[3])))
                keys.append(k)
        except BaseException:
            own.close()
            raise

    def start(self, threads: _Threads) -> None:
        try:
            self.futures = threads.start_parts(
                functools.partial(_rename_slice, self.die_at), self.calls
            )
        except BaseException:
            self.own.close()
            raise

    def finish(self, dirs: _Dirs, trash: _Trash) -> None:
        try:
            done = _Threads.finish(self.futures)
        finally:
            self.own.close()
        self.slow.extend(k for k, ok in zip(self.keys, done, strict=True) if not ok)
        for k in sorted(self.slow):
            _run_op(dirs, self.chunk[k - self.first], trash, k, self.crash)


def _encode_ops(ops: list[list[Any]]) -> list[list[Any]]:
    """The journal's form of ``ops``: their paths (``op[1]``, and a rename's two more) as text
    (see `_enc`); a commit of 50,000 files writes 150,000 of them. Decoded in one call over
    all of them joined by NUL, which no path holds (`_check_path`): a call per path was half a
    second of such a commit."""
    paths: list[bytes] = []
    add = paths.append
    for op in ops:
        add(op[1])
        if op[0] == "rename":
            add(op[2])
            add(op[3])
    texts = iter(_enc(b"\0".join(paths)).split("\0"))
    return [
        ["rename", next(texts), next(texts), next(texts)]
        if op[0] == "rename"
        else [op[0], next(texts), *op[2:]]
        for op in ops
    ]


def _decode_ops(record: dict[str, Any]) -> tuple[list[list[Any]], list[bytes]]:
    ops: list[list[Any]] = []
    for op in record["ops"]:
        if op[0] == "rename":
            sdir = _dec(op[1])
            if sdir:
                _check_path(sdir)
            sname = _dec(op[2])
            if not sname.startswith(STAGE_PREFIX) or b"/" in sname:
                raise TreeError(f"refusing staged name {sname!r}; the commit journal is corrupt")
            ops.append(["rename", sdir, sname, _check_path(_dec(op[3]))])
        else:
            ops.append([op[0], _check_path(_dec(op[1])), *op[2:]])
    fsync = [_dec(d) for d in record["fsync"]]
    for d in fsync:
        if d:
            _check_path(d)
    return ops, fsync


def _redo(
    dirs: _Dirs,
    ops: list[list[Any]],
    fsync: list[bytes],
    crash: _Crash,
    point: str,
    progress: Progress | None,
    trash: _Trash | None = None,
    threads: _Threads | None = None,
) -> None:
    """Run ``ops`` (from op 0: each is idempotent), then make them durable. ``threads``: the
    caller's, left open; else threads of its own, closed before it returns."""
    total = len(ops)
    threaded = total >= SYNCFS_FROM
    own = threads is None
    threads = _Threads() if threads is None else threads
    running: _Renames | None = None  # a chunk of renames started, not yet finished

    def ended(r: _Renames) -> None:
        r.finish(dirs, trash)  # type: ignore[arg-type]  # a _Renames has a trash
        for k in range(r.first, r.first + len(r.chunk)):
            crash.at(f"{point}op:{k}")
            if progress is not None and k % 256 == 0:
                progress("apply", k, total)

    try:
        i = 0
        while i < total:
            j = _chunk_end(ops, i) if threaded and ops[i][0] in _THREADED_OPS else i + 1
            if j - i > 1 and _batchio is not None and trash is not None and ops[i][0] == "rename":
                # Made while the previous chunk runs, started once it has ended.
                r = _Renames(dirs, ops[i:j], i, trash, crash)
                if running is not None:
                    done, running = running, None
                    try:
                        ended(done)
                    except BaseException:
                        r.own.close()
                        raise
                r.start(threads)
                running = r
                i = j
                continue
            if running is not None:
                done, running = running, None
                ended(done)
            if j - i > 1:
                _run_ops_threaded(dirs, ops[i:j], i, threads, trash, crash)
            else:
                _run_op(dirs, ops[i], trash, i, crash)
            for k in range(i, j):
                crash.at(f"{point}op:{k}")
                if progress is not None and k % 256 == 0:
                    progress("apply", k, total)
            i = j
        if running is not None:
            done, running = running, None
            ended(done)
    finally:
        if running is not None:
            with contextlib.suppress(BaseException):
                _Threads.finish(running.futures)
            running.own.close()
        if own:
            threads.close()
    lap("commit: ops run")
    if len(fsync) >= SYNCFS_FROM:
        syncfs(dirs.root)
    else:
        for d in fsync:
            try:
                os.fsync(dirs.get(d))
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
        if trash is not None:
            trash.sync()
    lap("commit: synced")
    if progress is not None:
        progress("apply", total, total)


# --- public API -------------------------------------------------------------------------------


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the length of a commit. A commit of 50,000
    files makes millions of objects (changes, entries, operations, journal text), none of them
    in cycles, and each of the collector's full passes walks them all: 1.3 of the 4 s of CPU
    such a commit took. Reference counting still frees everything as before. A caller that
    diffs the same trees before the commit (a review, a hook check) holds it off around those
    too; nested, the outermost one turns it back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def apply(
    store: ObjectReader,
    target: Target,
    base_tree: ObjectId,
    new_tree: ObjectId,
    *,
    journal_dir: Target,
    progress: Progress | None = None,
    drop_setid: bool = False,
    key: bytes | None = None,
    lock_timeout: float | None = None,
    interrupted: Interrupted | None = None,
    known: Known | None = None,
    free_trash: bool = True,
) -> CommitReport:
    """Make the real directory ``target`` go from ``base_tree`` to ``new_tree``, all or nothing.

    Raises ConflictError (writing nothing) when a touched path no longer holds what ``base_tree``
    says, or stops being the file the check saw before the commit point. An interrupted earlier
    commit in ``journal_dir`` is recovered first. If this process dies midway,
    ``recover(target, journal_dir)`` brings the tree to exactly the old or the new state.
    ``journal_dir`` should live on the target's file system and outside the target; as an fd,
    it is the caller's and already locked.

    ``target`` is a path or a directory fd (every write goes through it, never through a path
    resolved again). ``key`` (32 bytes) seals the journal so that recovery runs only journals
    sealed with it; ``lock_timeout`` bounds the wait for the target's lock (TargetBusy);
    ``interrupted()`` true before the commit point stops the commit (CommitInterrupted).

    ``drop_setid`` clears setuid/setgid on every file the commit writes or re-modes (files it
    does not touch keep theirs): committing a sandboxed agent's work as root must not mint a
    setuid-root program the sandbox never let the agent use itself.

    ``known`` spares the conflict check a read of every touched file: a regular file whose
    (st_dev, st_ino, st_ctime_ns) is the one listed for its path is taken to hold the content
    the caller hashed then (any write since changes the ctime). List only files read whole
    with a ctime older than the read by more than the clock's granularity (tree.RACY_NS), as
    `build_tree` trusts an unread file.

    The files the commit replaced or removed go to ``<journal_dir>/trash`` (see the module's
    doc). ``free_trash`` frees them before returning; with False they are left there for the
    caller to free when it likes (shadowfs.trash.empty, or moved elsewhere first): garbage that
    the next `apply` or `recover` with this journal directory frees if still there.
    """
    if base_tree == new_tree:
        return CommitReport(0, 0)
    crash = _Crash()
    with _journal_dir(journal_dir) as jfd, collector_paused():
        root = _open_target(target, lock_timeout, interrupted)
        dirs = _Dirs(root)
        try:
            _recover_locked(dirs, jfd, _Crash(steps=False), key)
            report = _apply_locked(
                store, dirs, jfd, base_tree, new_tree, crash, progress, drop_setid, key,
                interrupted, known,
            )
            if free_trash:
                crash.at("freeing")
                _free_trash(jfd)
            return report
        finally:
            dirs.close()
            os.close(root)


def _apply_locked(
    store: ObjectReader,
    dirs: _Dirs,
    jfd: int,
    base_tree: ObjectId,
    new_tree: ObjectId,
    crash: _Crash,
    progress: Progress | None,
    drop_setid: bool = False,
    key: bytes | None = None,
    interrupted: Interrupted | None = None,
    known: Known | None = None,
) -> CommitReport:
    lap("commit: opened, locked, recovered")
    changes = _changes(store, base_tree, new_tree)
    lap("commit: _changes")
    if not changes:
        return CommitReport(0, 0)
    token = secrets.token_hex(8)
    plan = _plan(store, new_tree, changes, token, drop_setid)
    lap("commit: _plan")
    seen: dict[bytes, Seen] = {}
    known_ = known or {}
    unknown = (
        oid for c in changes if c.old is not None and (oid := c.old.oid) and c.path not in known_
    )
    # One set of threads for the check's reads, the staging and the operations: each start of
    # 16 threads waits for every one of them to run, milliseconds each on a busy machine.
    threads = _Threads()
    try:
        return _staged_and_applied(
            store, dirs, jfd, plan, token, unknown, seen, threads, crash, progress, key,
            interrupted, known, len(changes),
        )
    finally:
        threads.close()


def _staged_and_applied(
    store: ObjectReader,
    dirs: _Dirs,
    jfd: int,
    plan: _Plan,
    token: str,
    unknown: Iterable[ObjectId],
    seen: dict[bytes, Seen],
    threads: _Threads,
    crash: _Crash,
    progress: Progress | None,
    key: bytes | None,
    interrupted: Interrupted | None,
    known: Known | None,
    n_changes: int,
) -> CommitReport:
    """`_apply_locked` from the conflict check on; ``threads``: the threads of its steps, each
    step's work in them ended before the next step begins.

    A commit staged in threads (``whole_fs``) runs its conflict check beside the staging
    (`_Checker`), and a conflict then undoes the staging like the re-check's; a smaller one
    checks first and writes nothing when it finds a conflict."""
    total = len(plan.stages)
    whole_fs = total >= SYNCFS_FROM

    def check_first() -> None:
        with _prefetched(store, unknown):
            conflicts = _conflicts(store, dirs, plan, progress, seen, known, threads)
        if conflicts:
            raise ConflictError(conflicts)

    if not whole_fs:
        check_first()
    identity = _identity(dirs.root)
    # Staging bumps these directories' mtimes; undoing it must put them back, or the tree would
    # not be exactly the old one.
    try:
        stage_dirs: list[list[Any]] = [
            [_enc(d), _mtime(dirs, d)] for d in sorted({s.dir for s in plan.stages})
        ]
    except OSError as exc:
        if not whole_fs or exc.errno not in _GONE:
            raise
        check_first()  # a staging directory is gone or swapped: the conflicts say which
        raise
    prepare = {"target": identity, "token": token, "dirs": stage_dirs}
    written = 0
    checker: _Checker | None = None
    try:
        _write_sealed(jfd, PREPARE_NAME, _seal(prepare, key))
        crash.at("prepare")
        syncer = _Syncer(dirs.root if whole_fs else None)
        umask = _umask()

        def staged(k: int, nbytes: int) -> None:
            """Count bytes staged; with k >= 0, stage k is staged whole."""
            nonlocal written
            written += nbytes
            if k >= 0:
                crash.at(f"stage:{k}")
                if progress is not None:
                    progress("stage", k + 1, total)

        try:
            # The small files of a threaded staging are located for the bulk reads, all of
            # them before any thread runs (see Store.prefetched_blobs); the rest prefetched.
            small, rest = _split_reads(plan.stages, whole_fs)
            with (
                _prefetched(store, small, "prefetched_blobs"),
                _prefetched(store, rest),
            ):
                if whole_fs:
                    # Started once the index rows are in: beside that query its lstats cost
                    # the main thread as much again (sqlite lets go of the GIL at each row).
                    checker = _Checker(dirs.root, plan, seen, known, threads, crash)
                    _stage_threaded(store, dirs, plan.stages, syncer, threads, interrupted,
                                    staged, umask)  # fmt: skip
                    conflicts = checker.result(store, dirs)
                    checker = None
                    if progress is not None:
                        progress("check", len(plan.changes), len(plan.changes))
                    crash.at("checked")
                    if conflicts:
                        raise ConflictError(conflicts)
                for i in range(0 if whole_fs else total):
                    _check_interrupt(interrupted)
                    staged(-1, _stage_one(store, dirs, plan.stages[i], syncer, interrupted,
                                          umask))  # fmt: skip
                    staged(i, 0)
            # The journal's bytes depend on the plan alone: made while the last write-back of
            # the staged files still runs (`_Syncer.kick`), not after `close` waited for it
            # (encoding and sealing 150,000 paths of a 50,000-file commit: about 0.1 s).
            sealed = _seal(
                {
                    "target": identity,
                    "token": token,
                    "ops": _encode_ops(plan.ops),
                    "fsync": [_enc(d) for d in plan.fsync],
                },
                key,
            )
        finally:
            syncer.close()
        if not whole_fs:
            for d, _ in stage_dirs:
                os.fsync(dirs.get(_dec(d)))
        crash.at("staged")
        _check_interrupt(interrupted)
        if crash.point == "torn-journal":
            _tear(jfd, sealed)
        _write_sealed(jfd, JOURNAL_NAME, sealed)
        crash.at("journal")
        # The host may have edited a touched file while we staged: the journal is withdrawn
        # (nothing was applied yet) rather than overwriting that edit.
        lap("commit: journal sealed, staging synced, journal written")
        changed = _changed_since(dirs, plan, seen, threads)
        if changed:
            _remove(jfd, JOURNAL_NAME)
            os.fsync(jfd)
            raise ConflictError(changed)
    except BaseException as exc:
        explained = _ended(checker, exc, store, dirs)
        if isinstance(exc, KeyboardInterrupt) and _read_sealed(jfd, JOURNAL_NAME, key)[1]:
            # Ctrl-C past the commit point (between the journal and its check): finish.
            with _trash(jfd, dirs.root, token, len(plan.ops)) as trash:
                _redo(dirs, plan.ops, plan.fsync, crash, "", None, trash)
            _finish(jfd, crash, "prepare-deleted")
            raise
        _undo_staging(dirs, prepare)
        _remove(jfd, JOURNAL_NAME, PREPARE_NAME, PREPARE_NAME + ".tmp", JOURNAL_NAME + ".tmp")
        os.fsync(jfd)
        if explained:
            raise ConflictError(explained) from None
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ShadowfsError(
                f"commit stopped before the commit point: {exc.strerror} while staging "
                f"{written} byte(s); nothing was applied — free space on the tree's file system "
                "and commit again"
            ) from None
        raise
    # Committed. A failure from here on leaves the journal for recover() to finish the job.
    try:
        with _trash(jfd, dirs.root, token, len(plan.ops)) as trash:
            _redo(dirs, plan.ops, plan.fsync, crash, "", progress, trash, threads)
    except OSError as exc:
        raise ShadowfsError(
            f"the commit into the target is recorded but could not be completed ({exc}); fix the "
            "cause and run recovery, which finishes it"
        ) from exc
    crash.at("applied")
    _finish(jfd, crash, "prepare-deleted")
    return CommitReport(n_changes, written)


def _ended(
    checker: _Checker | None, exc: BaseException, store: ObjectReader, dirs: _Dirs
) -> list[str]:
    """Ends a conflict check still running beside a staging that stopped with ``exc``. A
    staging that failed on the tree (a directory the host removed or swapped for a symlink
    meanwhile) is explained by the check's conflicts, returned to be raised instead; any
    other stop (an interrupt, a full disk) ends the check unread."""
    if checker is None:
        return []
    if not isinstance(exc, OSError) or exc.errno in (errno.ENOSPC, errno.EDQUOT):
        checker.stop()
        return []
    try:
        return checker.result(store, dirs)
    except Exception:  # the staging's own error is the one to report
        checker.stop()
        return []


def _tear(jfd: int, sealed: bytes) -> None:
    """Fault injection: leave a half-written journal at its final name, then die."""
    fd = os.open(JOURNAL_NAME, _JOURNAL_FLAGS, 0o600, dir_fd=jfd)
    os.write(fd, sealed[: len(sealed) // 2])
    os.fsync(fd)
    os.fsync(jfd)
    _die()


def pending(journal_dir: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> bool:
    """Whether ``journal_dir`` holds an interrupted commit (or its residue) to recover: one stat
    per name, cheap enough for every open of a tape dir."""
    path = os.fsencode(journal_dir)
    return any(
        os.path.lexists(os.path.join(path, name.encode()))
        for name in (JOURNAL_NAME, PREPARE_NAME, JOURNAL_NAME + ".tmp", PREPARE_NAME + ".tmp")
    )


def recover(
    target: Target,
    journal_dir: Target,
    *,
    key: bytes | None = None,
    wait: bool = True,
    lock_timeout: float | None = None,
) -> bool:
    """Finish or undo an interrupted commit. Returns True when a committed journal was redone
    (the target now holds the new tree), False when there was nothing to redo (any staged residue
    is removed and the target holds the old tree). Safe to call at every open, and again after a
    crash during recovery itself. ``wait=False`` raises CommitBusy when another process holds
    the journal directory (a commit in progress, or another recovery)."""
    if not isinstance(journal_dir, int) and not os.path.isdir(os.fsencode(journal_dir)):
        return False
    with _journal_dir(journal_dir, wait=wait) as jfd:
        root = _open_target(target, lock_timeout)
        dirs = _Dirs(root)
        try:
            return _recover_locked(dirs, jfd, _Crash(steps=False), key)
        finally:
            dirs.close()
            os.close(root)


def _recover_locked(dirs: _Dirs, jfd: int, crash: _Crash, key: bytes | None = None) -> bool:
    has_journal, journal = _read_sealed(jfd, JOURNAL_NAME, key)
    has_prepare, prepare = _read_sealed(jfd, PREPARE_NAME, key)
    if not has_journal and not has_prepare:
        # A crash while the prepare record was written leaves at most its temp file: no staging.
        _remove(jfd, PREPARE_NAME + ".tmp", JOURNAL_NAME + ".tmp")
        _free_trash(jfd)  # a finished commit's, left to free or killed while freeing
        return False
    identity = _identity(dirs.root)
    for record in (journal, prepare):
        if record is not None and record.get("target") != identity:
            raise ShadowfsError(
                "the commit journal in the journal directory belongs to another directory; "
                "recover it against the directory it was written for"
            )
    redone = False
    if journal is not None:
        ops, fsync = _decode_ops(journal)
        token = journal.get("token")
        if not isinstance(token, str) or not token.isalnum():
            raise TreeError("the commit journal's token is no plain name; the journal is corrupt")
        with _trash(jfd, dirs.root, token, len(ops)) as trash:
            _redo(dirs, ops, fsync, crash, "recover-", None, trash)
        crash.at("recover-applied")
        redone = True
    elif prepare is not None:
        # Died before the commit point: drop what was staged, and the tree is the old one.
        _undo_staging(dirs, prepare)
    _finish(jfd, crash, "recover-prepare-deleted")
    _free_trash(jfd)
    return redone


def holds_tree(
    store: ObjectReader,
    target: Target,
    base_tree: ObjectId,
    new_tree: ObjectId,
    *,
    drop_setid: bool = False,
    lock_timeout: float | None = None,
) -> bool:
    """Whether ``target`` holds ``new_tree`` at every path where it differs from ``base_tree``
    (kind, mode, content or target, and a file's mtime). With no journal left, this tells a
    commit that finished from one that never began: neither leaves anything half-done."""
    changes = _changes(store, base_tree, new_tree)
    root = _open_target(target, lock_timeout)
    dirs = _Dirs(root)
    try:
        for c in changes:
            n = c.new
            if n is None:
                if _lstat(dirs, c.path) is not None:
                    return False
                continue
            if drop_setid and n.kind != DIR and n.mode & _SETID:
                n = n.replace(mode=n.mode & ~_SETID)
            if not _holds(store, dirs, c.path, n):
                return False
            st = _lstat(dirs, c.path)
            if n.kind != DIR and (st is None or st.st_mtime_ns != n.mtime_ns):
                return False
        return True
    finally:
        dirs.close()
        os.close(root)


def _finish(jfd: int, crash: _Crash, point: str) -> None:
    """Retire the journal files. The prepare record goes first: a prepare without a journal
    means "undo the staging", which must never run over a tree the journal already changed."""
    _remove(jfd, PREPARE_NAME, PREPARE_NAME + ".tmp")
    os.fsync(jfd)
    crash.at(point)
    _remove(jfd, JOURNAL_NAME, JOURNAL_NAME + ".tmp")
    os.fsync(jfd)


def clean_residue(
    target: Target,
    *,
    dirs: Iterable[bytes] | None = None,
    prefix: bytes = STAGE_PREFIX,
) -> int:
    """Remove stray staged entries (names starting with ``prefix``) and return how many.

    ``target`` is a path or an open directory fd. With ``dirs`` (relative paths) only those
    directories are searched; without, the whole tree is, never following symlinks.
    """
    own = not isinstance(target, int)
    root = target if isinstance(target, int) else _open_target(target)
    walker = _Dirs(root)
    removed = 0
    try:
        pending = list(dirs) if dirs is not None else [b""]
        recurse = dirs is None
        while pending:
            d = pending.pop()
            if d:
                _check_path(d)
            try:
                dfd = walker.get(d)
            except OSError as exc:
                if exc.errno in _GONE:
                    continue
                raise
            touched = False
            with os.scandir(dfd) as it:
                entries = [(os.fsencode(de.name), de.is_dir(follow_symlinks=False)) for de in it]
            for name, is_dir in entries:
                if name.startswith(prefix) and not is_dir:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dfd)
                        removed += 1
                        touched = True
                elif is_dir and recurse:
                    pending.append(d + b"/" + name if d else name)
            if touched:
                os.fsync(dfd)
    finally:
        walker.close()
        if own:
            os.close(root)
    return removed
