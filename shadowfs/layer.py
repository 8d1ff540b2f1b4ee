"""The copy-on-write layer over a base directory: an inode table, snapshots and restores.

The base is the real tree; the layer never writes it. It reaches the base only through a directory
fd opened when the layer is created (``O_PATH|O_DIRECTORY``) and ``*at`` calls relative to it, so
the layer can be mounted over the base's own path afterwards.

Model
-----
Every file, directory and symlink the layer has seen is a `Node` in an inode table (``ino ->
Node``). Inode numbers are the layer's own, never reused, and do not change on copy-up. Lookup
counts and ``forget`` follow the FUSE protocol: an unlinked node stays in the table while the kernel
knows it or a handle is open, and is dropped (with its scratch file) when both reach zero.

A directory is *unloaded* until something looks inside it; its state is then just a tree id
(``Node.oid``). Loading decodes that tree into child nodes, after which the directory's ``children``
map is authoritative. This covers what an overlay calls whiteouts and opaque directories: a base
entry removed from a loaded directory is simply absent from its map (a whiteout), and a directory
created in the layer starts loaded and empty and never consults the base (opaque). The base itself
is never listed: the root starts as the base's tree (``tree.build_tree`` at creation unless given),
so listings, snapshots and restores all speak the same Merkle trees.

A file's content lives in one of three places (``Node.src``):

- ``SRC_BASE``: the base file at ``base_path``, read through the base dir fd;
- ``SRC_STORE``: a blob or chunks object ``oid`` not materialised yet (after a restore). Opening it
  streams it into a scratch file first, as a cache that does not count as a change;
- ``SRC_SCRATCH``: ``scratch_dir/<ino>``, a staged file of the layer's own.

Copy-up happens on write intent only (open for writing, truncate, setattr size), never on a
read-only open. It streams (``copy_file_range``, falling back to ``sendfile``) into
``scratch_dir/<ino>.tmp`` which is then renamed to ``scratch_dir/<ino>``; a truncation copies only
the bytes it keeps. The copy is split into `CopyJob.run` (pure I/O, safe on a worker thread) and
`Layer.finish_copy` (state), so the FUSE server keeps its event loop free during big copies.

Base nodes take mode, size and mtime from the base tree and uid, gid, atime and ctime from one
lazy ``lstat`` of the base, on first need. Nodes made from snapshot trees take the layer root's
owner. Extended attributes of base nodes are read through to the base until the first change,
which copies them into the node; xattrs are not part of snapshots (trees do not carry them).

Snapshots: O(what changed)
--------------------------
Each directory keeps ``dirty_names``: the names whose entry may differ from the directory's tree
``oid``. Any change marks the name in its parent and the parent's name in the grandparent, up to
the root, stopping at the first already-marked name. A file whose content changed is ``dirty``.
`Layer.snapshot` walks only marked names from the root: dirty files go to the store
(``put_file``, or ``put(..., delta_base=previous)`` for files up to `DELTA_MAX`), marked directories
are re-encoded from their previous tree plus the marked names (path copying: every unmarked entry,
including whole sub-trees, keeps its id). Tree entries keep the bytes they were decoded from or
packed into (`shadowfs.tree.Entry.record`), so a re-encoding packs only the entries of marked
names and joins the rest as bytes: path copying at the byte level too, on a directory's first
build as after a restore brought it back to a tree built earlier. The journal since the previous
snapshot goes to the store as a ``journal`` object (see `shadowfs.journal`). The store is then
flushed (one fsync, one index commit), or with ``snapshot(durable=False)`` left to its group
commit on a background thread within ``FLUSH_DELAY`` (`Store.flush_soon`); a tape frame naming
the snapshot flushes the store before it is written, so no durable frame outruns its objects.

Restore: O(difference)
----------------------
`Layer.restore` first folds unsnapshotted changes into a tree (without taking the journal), then
reconciles the node tree with the target: directories with equal ids are skipped, unloaded
directories just take the target's sub-tree id, and within a differing loaded directory each
differing name is fixed. Which names differ comes without reading either tree when the layer
has seen the step: each directory a snapshot re-encodes remembers its marked names with their old
and new entries (`Layer._remember_step`), so rolling back to the previous snapshot, or forward
again, costs what changed, not the size of the directories on the way; other pairs of trees are
compared once (an identity test per entry) and remembered too.

A file whose content or mtime differs gets a new inode number at that path, the old one behaving
like an unlinked file: processes holding it open keep reading what they opened, the next open or
stat sees the restored content. This is forced by the kernel's writeback cache, which trusts its
own cached size and mtime of a regular file over the server's, even after invalidation; a fresh
inode is the only way to make it take the restored ones. A node the kernel has looked up or a
handle holds is replaced by a new node; one that nobody knows (always so in process) is rewritten
in place under its new number (`Layer._renew`), which is the same state for less work.
Directories, symlinks and mode-only changes keep their inode numbers. The kernel caches to drop
are queued as invalidations (`Layer.take_invalidations`) for the FUSE side to send from outside
its request handlers.

Threading: a Layer is not thread-safe. While mounted, the FUSE request handlers touch it only
under the mount's layer lock (`shadowfs.fuse.Operations.lock`), and other threads go through the
mount handle (`shadowfs.mountctl.Mount.call`), which runs the call on the calling thread under that
lock and then sends the kernel invalidations it queued. In-process mutation while mounted should
go through the mount so the kernel sees it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import os
import queue
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from shadowfs import tree as trees
from shadowfs.bounded import BoundedMap
from shadowfs.errors import ShadowfsError, TreeError
from shadowfs.journal import Journal
from shadowfs.oid import ObjectId
from shadowfs.privacy import make_private_dirs
from shadowfs.tree import (
    DIR,
    FILE,
    FMT_SPECIAL,
    MAX_DEPTH,
    SPECIAL_FMT,
    SYMLINK,
    Entry,
    check_entry,
    clamp_time_ns,
    entry_record,
    make_entry,
    pack_records,
)
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

    from shadowfs.objects import ObjectReader, ObjectStore

    _F = Any

SRC_BASE = 0
SRC_STORE = 1
SRC_SCRATCH = 2

S_IFREG = stat.S_IFREG
S_IFDIR = stat.S_IFDIR
S_IFLNK = stat.S_IFLNK
# FIFOs, unix sockets and device nodes: nodes with no content of the layer's (the kernel carries
# a fifo's or socket's data; the mount is nodev), recorded by trees as what they are.
_SPECIAL_FMTS = frozenset(SPECIAL_FMT.values())
_KIND_FMT = {FILE: S_IFREG, DIR: S_IFDIR, SYMLINK: S_IFLNK, **SPECIAL_FMT}

ROOT_INO = 1
NAME_MAX = 255
TARGET_MAX = 4095
DIR_SIZE = 4096
# Rewritten files up to this size are read whole and offered to the store as a delta against
# their previous version; larger ones stream through put_file.
DELTA_MAX = 1024 * 1024
# Below this a delta saves next to nothing and its zstd dictionary set-up costs more than it saves.
DELTA_MIN = 4096
# A file whose last write covered all of it, up to this size, keeps those bytes until the next
# snapshot (`Node.image`), which then need not read them back: through the mount the pread of a
# just-written file costs several µs, a good part of a small file's share of a checkpoint.
IMAGE_MAX = 64 * 1024
# What all kept images may hold at once; past it, files are read back as before.
IMAGES_MAX = 16 * 1024 * 1024
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
XATTR_CREATE = 1
XATTR_REPLACE = 2
# How directory trees differ, remembered for restores (`Layer._remember_step`): a snapshot adds
# one step per directory it re-encodes. Bounded by steps and by differing names in all (a step
# holds a tuple per name: ~100 bytes), oldest first.
STEPS_KEPT = 4096
STEP_NAMES_KEPT = 16384
# Backing fds kept open for node-addressed I/O (a mount with zero-message opens has no handles
# to say when a file is done with): the most recently used stay open, older ones are closed.
IDLE_BACKINGS = 256

_BASE_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_COPY_STEP = 64 * 1024 * 1024


class ScratchLimitReached(ShadowfsError, OSError):
    """ENOSPC from the layer's scratch limit (`Layer(scratch_limit=...)`), not from the disk."""


def _limit_reached() -> ScratchLimitReached:
    return ScratchLimitReached(errno.ENOSPC, "the layer's scratch limit would be passed")


def _err(code: int, what: str = "") -> OSError:
    return OSError(code, os.strerror(code), what) if what else OSError(code, os.strerror(code))


_NO_NAMES: frozenset[bytes] = frozenset()
_RAISE = object()  # Layer.lookup's default: a missing name raises ENOENT

# One name's entries in two directory trees (None where the name is absent).
_Diff = tuple[bytes, Entry | None, Entry | None]
# A directory's tree as its node holds it: id, entries by name, and once built by this layer
# its bytes (see Node.tree_entries).
HeldTree = tuple[ObjectId, dict[bytes, Entry], bytes | None]


def _entries(store: ObjectReader, oid: ObjectId | None) -> dict[bytes, Entry]:
    """A tree's entries by name (cached and shared by shadowfs.tree: never mutate the result)."""
    if oid is None:
        return {}
    return trees.entries(store, oid)


class Node:
    """One inode. Fields are public to the FUSE module; change them only through the Layer."""

    __slots__ = (
        "atime_ns",
        "backing",
        "base_oid",
        "base_path",
        "children",
        "ctime_ns",
        "dirty",
        "dirty_names",
        "fmt",
        "gid",
        "image",
        "ino",
        "last_pid",
        "link_key",
        "links",
        "lookups",
        "mode",
        "mtime_ns",
        "oid",
        "opens",
        "rdev",
        "size",
        "src",
        "stat_base",
        "subdirs",
        "target",
        "tree_entries",
        "uid",
        "xattrs",
    )

    def __init__(self, ino: int, fmt: int, mode: int, uid: int, gid: int, mtime_ns: int) -> None:
        self.ino = ino
        self.fmt = fmt
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.size = 0
        self.mtime_ns = mtime_ns
        self.atime_ns = mtime_ns
        self.ctime_ns = mtime_ns
        # file: content id at the last snapshot (still the previous id while dirty); dir: the tree
        # its state derives from (None: a new, empty directory).
        self.oid: ObjectId | None = None
        self.src = SRC_SCRATCH
        self.dirty = False
        # A dirty file's whole content, when its last write covered all of it (IMAGE_MAX).
        self.image: bytes | None = None
        # Where in the base this node comes from: files only while their content equals it, dirs
        # whenever a base directory of that name exists (its tree id is base_oid).
        self.base_path: bytes | None = None
        self.base_oid: ObjectId | None = None
        self.stat_base = False
        self.target: bytes | None = None
        self.children: dict[bytes, Node] | None = None
        # A directory's decoded tree (its id, its entries), held while the directory is loaded:
        # the next build starts from it even after the shared tree cache let it go, which
        # would cost a decode (a few µs per entry) on the snapshot's path. Once built here, also
        # its bytes, so the next build swaps records in place (`trees.splice_records`) instead
        # of joining them all again.
        self.tree_entries: HeldTree | None = None
        # Only directories have names to mark; the rest share one empty set (216 bytes saved per
        # file, which adds up on a 100,000-file tree).
        # the shared frozenset is never added to: only directories (real sets) get names
        self.dirty_names: set[bytes] = set() if fmt == S_IFDIR else _NO_NAMES  # type: ignore[assignment]
        self.links: list[tuple[Node, bytes]] = []
        # A regular file's hard-link group key in trees (`shadowfs.tree.Entry.link`), 0 until
        # it has had a second name; kept once set, so removing names never rewrites the others.
        self.link_key = 0
        # A device node's number.
        self.rdev = 0
        self.lookups = 0
        # The last process seen using the node through a mount: writes the kernel writes back
        # on its own carry no process, and the journal names this one for them.
        self.last_pid = 0
        self.opens = 0
        self.backing: Backing | None = None
        self.xattrs: dict[bytes, bytes] | None = None
        # A directory's number of sub-directories (its link count less 2), kept up to date by
        # every change of its entries once known; -1 until asked for (`Layer.nlink`).
        self.subdirs = -1

    @property
    def is_dir(self) -> bool:
        return self.fmt == S_IFDIR

    def __repr__(self) -> str:
        return f"<Node {self.ino} {oct(self.fmt | self.mode)}>"


class Backing:
    """An fd holding a node's current content, shared by all its handles.

    ``refs`` counts the node's use of it plus in-flight I/O on worker threads, so a copy-up or
    restore never closes an fd under a running pread.
    """

    __slots__ = ("fd", "refs", "writable")

    def __init__(self, fd: int, writable: bool) -> None:
        self.fd = fd
        self.writable = writable
        self.refs = 1

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            os.close(self.fd)
            self.fd = -1


class Handle:
    __slots__ = ("fh", "node", "path", "pid", "writable")

    def __init__(self, fh: int, node: Node, writable: bool, path: bytes, pid: int) -> None:
        self.fh = fh
        self.node = node
        self.writable = writable
        self.path = path
        self.pid = pid


class CopyJob:
    """The I/O half of a copy-up: fills ``tmp_fd`` from the base file or the store."""

    __slots__ = ("keep", "node", "src_fd", "src_oid", "store", "tmp_fd", "tmp_path", "write")

    def __init__(self, node: Node, write: bool, keep: int, tmp_path: str, tmp_fd: int) -> None:
        self.node = node
        self.write = write
        self.keep = keep
        self.tmp_path = tmp_path
        self.tmp_fd = tmp_fd
        self.src_fd = -1
        self.src_oid: ObjectId | None = None
        self.store: Any = None

    def run(self) -> None:
        """Copy; safe to call on a worker thread (touches no layer state)."""
        if self.src_oid is not None and self.keep > 0:
            with open(self.tmp_fd, "wb", closefd=False) as f:
                self.store.read_file_into(self.src_oid, f)
            if self.keep < self.node.size:
                os.ftruncate(self.tmp_fd, self.keep)
        elif self.src_fd >= 0 and self.keep > 0:
            _copy_fd(self.src_fd, self.tmp_fd, self.keep)


def _copy_fd(src: int, dst: int, length: int) -> None:
    off = 0
    try:
        while off < length:
            n = os.copy_file_range(src, dst, min(_COPY_STEP, length - off), off, off)
            if n == 0:
                break
            off += n
        return
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    os.lseek(dst, off, os.SEEK_SET)
    while off < length:
        n = os.sendfile(dst, src, off, min(_COPY_STEP, length - off))
        if n == 0:
            break
        off += n


class Scratch:
    """Creates and removes staged files on a worker thread, off the FUSE request path.

    Creating or unlinking a file costs a metadata update on the scratch file system (hundreds of
    microseconds on a busy ext4); the layer asks for a batch of empty files named by inode numbers
    it has reserved and takes them as `create` needs them, and hands the files of dropped nodes
    over for removal. Only file system calls run on the worker; layer state never leaves the
    owner's thread. A forked child (a process mount) starts over with its own worker.
    """

    LOW = 16
    BATCH = 64
    # Removals wait for the worker's next wake-up (a create's batch, or close), up to these
    # bounds: waking a sleeping thread cost 16-21 µs, a sixth of a 10-file rollback, and a
    # wake-up per FORGET was a tenth of the daemon's time in `rm -rf` of 1,000 new files. The
    # byte bound is small because the mount's statfs is the scratch file system's: an agent
    # that deletes files to free space sees all but the last few MiB of it freed at once.
    LATER_FILES = 256
    LATER_BYTES = 4 * 1024 * 1024

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._pid = -1
        self._reset()

    def _reset(self) -> None:
        self._ready: deque[tuple[int, int]] = deque()
        self._jobs: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._outstanding = 0
        self._failed = 0  # pre-creates that failed; only the worker adds to it
        self._held = False
        self._later: list[str] = []
        self._later_bytes = 0
        self._pid = os.getpid()

    def _own(self) -> None:
        if self._pid != os.getpid():
            # Fork: the parent's worker, fds and waiting removals are not ours; its files are
            # cleaned by its close().
            self._reset()

    def _start(self) -> None:
        self._own()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="shadowfs-scratch", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        while (job := self._jobs.get()) is not None:
            kind, arg = job
            try:
                if kind == "create":
                    ino = arg
                    self._ready.append((ino, os.open(f"{self.directory}/{ino}", flags, 0o600)))
                elif kind == "settle":
                    arg.set()
                else:
                    for path in arg:
                        with contextlib.suppress(OSError):
                            os.unlink(path)
            except OSError:
                # A failed pre-create only means create() makes that file itself (but it will
                # never be taken, so it must stop counting as outstanding); a failed unlink
                # leaves a file that close() removes.
                if kind == "create":
                    self._failed += 1

    def take(self) -> tuple[int, int] | None:
        """A reserved inode number and an fd of its empty staged file, if one is ready."""
        if self._pid != os.getpid():
            return None
        try:
            got = self._ready.popleft()
        except IndexError:
            return None
        self._outstanding -= 1
        return got

    def low(self) -> bool:
        return self._pid != os.getpid() or self._outstanding - self._failed < self.LOW

    def prepare(self, inos: range) -> None:
        """Create empty staged files for ``inos`` (reserved by the caller) in the background."""
        self._start()
        self._hand_over_later()
        self._outstanding += len(inos)
        for ino in inos:
            self._jobs.put(("create", ino))

    def remove(self, path: str, size: int = 0) -> None:
        """Remove the staged file at ``path`` (``size`` bytes) in the background: at the
        worker's next wake-up (the next batch of creates, or close), or at once when more than
        LATER_FILES files or LATER_BYTES bytes wait. The file is unreachable (inode numbers are
        never reused), so only its disk space waits."""
        self._own()
        self._later.append(path)
        self._later_bytes += size
        if not self._held:
            self._hand_over_if_due()

    def hold(self) -> None:
        """Keep removals waiting, past the bounds too, until `unhold` (a restore, which may
        drop many files at once, checks the bounds once at its end)."""
        self._held = True

    def unhold(self) -> None:
        self._held = False
        self._hand_over_if_due()

    def _hand_over_if_due(self) -> None:
        if len(self._later) > self.LATER_FILES or self._later_bytes > self.LATER_BYTES:
            self._start()
            self._hand_over_later()

    def _hand_over_later(self) -> None:
        if self._later:
            self._jobs.put(("unlink-all", self._later))
            self._later = []
            self._later_bytes = 0

    def settle(self) -> None:
        """Return once the worker has done every job handed to it so far (jobs run in order).
        A sync point for tests: a removal still waiting for a later wake-up is not one of them,
        which a test sees without sleeping and hoping the worker would have run by then."""
        self._own()
        if self._thread is not None:
            done = threading.Event()
            self._jobs.put(("settle", done))
            done.wait()

    def close(self) -> None:
        """Stop the worker once its queue is done; close the fds of files never taken."""
        if self._pid == os.getpid():
            if self._later:
                self._start()
                self._hand_over_later()
            if self._thread is not None:
                self._jobs.put(None)
                self._thread.join()
                while self._ready:
                    os.close(self._ready.popleft()[1])
        self._reset()


class NodeStat(Value):
    __slots__ = FIELDS = (
        "st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns",
        "st_mtime_ns", "st_ctime_ns", "st_blocks",
    )  # fmt: skip
    st_mode: int
    st_ino: int
    st_nlink: int
    st_uid: int
    st_gid: int
    st_size: int
    st_atime_ns: int
    st_mtime_ns: int
    st_ctime_ns: int
    st_blocks: int

    def __init__(
        self, st_mode: int, st_ino: int, st_nlink: int, st_uid: int, st_gid: int, st_size: int,
        st_atime_ns: int, st_mtime_ns: int, st_ctime_ns: int, st_blocks: int,
    ) -> None:  # fmt: skip
        setfield(self, "st_mode", st_mode)
        setfield(self, "st_ino", st_ino)
        setfield(self, "st_nlink", st_nlink)
        setfield(self, "st_uid", st_uid)
        setfield(self, "st_gid", st_gid)
        setfield(self, "st_size", st_size)
        setfield(self, "st_atime_ns", st_atime_ns)
        setfield(self, "st_mtime_ns", st_mtime_ns)
        setfield(self, "st_ctime_ns", st_ctime_ns)
        setfield(self, "st_blocks", st_blocks)


PathLike = str | bytes | os.PathLike[str]
# `Layer.snapshot`'s early reply: (tree id, journal id or None).
Answer = Callable[[ObjectId, "ObjectId | None"], None]


def _routed(sync: bool = False, stores: bool = False) -> Callable[[_F], _F]:
    """While mounted, run the method under the mount's layer lock (shadowfs.mountctl.Mount.call).

    ``stores``: the method takes ``durable=`` and its objects must be flushed before it returns
    when the layer lives in a child process (``Mount(process=True)``), whose store is another
    `Store` than the caller's: the caller can read only what reached the index."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def method(self: Layer, *args: Any, **kwargs: Any) -> Any:
            m = self._mount
            if m is not None and not m.on_loop():
                if stores and getattr(m, "process", False):
                    kwargs["durable"] = True
                return m.call_layer(fn, *args, sync=sync, **kwargs)
            return fn(self, *args, **kwargs)

        return method

    return wrap


class _CollectorPaused:
    """Keeps CPython's cyclic collector out of a checkpoint or a rollback. On a 100,000-file
    tree a pass over the young generation took about 0.5 ms and fell in one snapshot in five,
    and a pass over the old one took 0.3 s. What would have been collected is collected at the
    next allocation after the section, once the caller has its answer: hence a class, whose exit
    allocates nothing after turning the collector back on (a generator's exit would, and pay
    for the collection there). A collector that something else turned off stays off."""

    __slots__ = ("_was_on",)

    def __enter__(self) -> None:
        self._was_on = gc.isenabled()
        if self._was_on:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was_on:
            gc.enable()


def _pread(b: Backing, size: int, off: int) -> bytes:
    try:
        return os.pread(b.fd, size, off)
    finally:
        b.release()


def _pwrite(b: Backing, data: bytes | memoryview, off: int) -> int:
    try:
        return os.pwrite(b.fd, data, off)
    finally:
        b.release()


def _check_xattr(name: bytes) -> None:
    # system.* holds POSIX ACLs and the like, which the layer does not implement: storing them
    # as plain bytes would make tools (cp -a, tar) believe an ACL set the mode and skip chmod.
    if name.startswith(b"system."):
        raise _err(errno.EOPNOTSUPP)


def _split(path: PathLike) -> list[bytes]:
    raw = os.fsencode(path)
    parts = [p for p in raw.split(b"/") if p and p != b"."]
    if b".." in parts:
        raise ValueError(
            f"layer paths must not contain '..': {raw!r}; pass a path inside the layer"
        )
    return parts


class Layer:
    """Copy-on-write state over ``base``; see the module docstring.

    ``store`` is a `shadowfs.store.Store`; ``scratch_dir`` holds staged files (created if missing,
    emptied of the layer's files by `close`). ``base_tree`` is the base's tree id when known;
    otherwise it is built now, which reads the whole base once.
    """

    def __init__(
        self,
        base: PathLike,
        store: ObjectStore,
        scratch_dir: PathLike,
        *,
        base_tree: ObjectId | None = None,
        scratch_limit: int | None = None,
    ) -> None:
        if scratch_limit is not None and scratch_limit < 0:
            raise ValueError(f"scratch_limit is {scratch_limit}: give a size in bytes, or None")
        self.store = store
        self.base = os.fsdecode(base)
        self.scratch_dir = os.fsdecode(scratch_dir)
        self._made_scratch = not os.path.isdir(self.scratch_dir)
        make_private_dirs(self.scratch_dir)  # it will hold the agent's files
        self.base_fd = os.open(self.base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.stat(self.base_fd)
            if base_tree is None:
                # Through /proc/self/fd: the same directory even if something is mounted over it.
                base_tree = trees.build_tree(store, f"/proc/self/fd/{self.base_fd}")
                store.flush()
        except BaseException:
            os.close(self.base_fd)
            raise
        self.base_tree: ObjectId = base_tree
        self._proc_base = f"/proc/self/fd/{self.base_fd}"
        self.uid = st.st_uid
        self.gid = st.st_gid
        self.journal = Journal()
        self._next_ino = ROOT_INO
        self._next_fh = 1
        self.inodes: dict[int, Node] = {}
        # Hard-link groups met in trees: key -> the node of its names (`_from_entry`), and
        # whether every group's names in the tree are loaded (`_gather_links`).
        self._groups: dict[int, Node] = {}
        self._links_gathered = False
        self._links_pending = False
        # Tree id -> whether a hard-linked file lies beneath (ids fix content: never stale).
        self._link_trees: dict[bytes, bool] = {}
        self.handles: dict[int, Handle] = {}
        self._inval: list[tuple[Any, ...]] = []
        # (tree a, tree b) -> how two directory trees differ (`_remember_step`).
        self._steps: BoundedMap[tuple[ObjectId, ObjectId], list[_Diff]] = BoundedMap(
            STEPS_KEPT, STEP_NAMES_KEPT
        )
        self._empty_tree: ObjectId | None = None
        self._image_bytes = 0  # held by all nodes' images (IMAGES_MAX)
        self._imaged: set[Node] = set()
        # Nodes whose backing fd node-addressed I/O opened, least recently used first.
        self._idle: dict[int, Node] = {}
        self._files = Scratch(self.scratch_dir)
        # The apparent size of every staged file (sparse ones at their full length, which is
        # also what a snapshot would hash), and the most it may reach: past it writes, copy-ups
        # and growing truncates fail with ENOSPC, as on a full disk.
        self.scratch_bytes = 0
        self.scratch_limit = scratch_limit
        # Called by a mount, with the error, when it refuses a write the kernel had already
        # accepted into its page cache (ENOSPC: the limit, or a full scratch disk). The writer
        # learns only at fsync or close, and the kernel's cached copy of that file may go on
        # showing the refused bytes: whoever runs the writer should stop it. Runs on the
        # mount's worker, under the layer lock: it must not block.
        self.on_write_refused: Callable[[OSError], None] | None = None
        # Called when the root gets its first change since the last snapshot or fold
        # (`shadowfs.quiet_fold`); on a worker, under the layer lock: it must not block.
        self.on_dirty: Callable[[], None] | None = None
        root = self._new(S_IFDIR, stat.S_IMODE(st.st_mode), clamp_time_ns(st.st_mtime_ns))
        root.uid, root.gid = st.st_uid, st.st_gid
        root.atime_ns, root.ctime_ns = st.st_atime_ns, st.st_ctime_ns
        root.oid = root.base_oid = base_tree
        root.base_path = b""
        root.lookups = 1 << 62  # the kernel never forgets the root
        self.root = root
        self.last_tree: ObjectId = base_tree
        # The journal as `fold` stored it: (its `changes` then, its id).
        self._folded_journal: tuple[int, ObjectId] | None = None
        self._mount: Any = None
        self._closed = False

    def attach(self, mount: Any) -> None:
        """Called by a mount serving this layer: calls from other threads now go through it."""
        self._mount = mount

    def detach(self, mount: Any) -> None:
        if self._mount is mount:
            self._mount = None

    # ------------------------------------------------------------------ life cycle

    def close(self, *, keep_files: bool = False) -> None:
        """Close fds and remove the layer's scratch files (the base is untouched). Idempotent.
        With ``keep_files`` the staged files stay in the scratch dir for the caller to free
        later (files of dropped nodes waiting for the worker are still removed)."""
        if self._closed:
            return
        self._closed = True
        for node in self.inodes.values():
            if node.backing is not None:
                node.backing.release()
                node.backing = None
        self.handles.clear()
        os.close(self.base_fd)
        self._files.close()
        if keep_files:
            return
        with os.scandir(self.scratch_dir) as it:
            names = [e.name for e in it]
        for name in names:
            stem = name.removesuffix(".tmp")
            if stem.isdigit():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.scratch_dir, name))
        if self._made_scratch:
            with contextlib.suppress(OSError):
                os.rmdir(self.scratch_dir)

    def __enter__(self) -> Layer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ nodes

    def _new(self, fmt: int, mode: int, mtime_ns: int, ino: int = 0) -> Node:
        if not ino:
            ino = self._next_ino
            self._next_ino += 1
        node = Node(ino, fmt, mode, self.uid, self.gid, mtime_ns)
        self.inodes[ino] = node
        if fmt == S_IFDIR:
            node.size = DIR_SIZE
        return node

    def _from_entry(self, e: Entry, be: Entry | None, base_path: bytes | None) -> Node:
        """A node for tree entry ``e``; ``be`` is the base's entry of the same name, if any.

        A hard-linked file's entry gets its group's node when that node still is the file the
        entry describes: the caller then adds a name to it."""
        link = e.link
        if link:
            node = self._groups.get(link)
            if (
                node is not None and node.links and not node.dirty and node.oid == e.oid
                and node.mode == e.mode and node.mtime_ns == e.mtime_ns and node.size == e.size
            ):
                return node
        node = self._new(_KIND_FMT[e.kind], e.mode, e.mtime_ns)
        node.oid = e.oid
        if e.kind == FILE:
            node.size = e.size
            if be is not None and be.kind == FILE and be.oid == e.oid:
                node.src = SRC_BASE
                node.base_path = base_path
            else:
                node.src = SRC_STORE
        elif e.kind == DIR:
            if be is not None and be.kind == DIR:
                node.base_path = base_path
                node.base_oid = be.oid
        elif e.kind == SYMLINK:
            node.target = e.target
            node.size = e.size
            if be is not None and be.kind == SYMLINK and be.target == e.target:
                node.base_path = base_path
        else:
            node.rdev = e.rdev
            if be is not None and be == e:
                node.base_path = base_path  # its owner and times are the base's
        if link:
            node.link_key = link
            self._groups[link] = node
            if not self._links_gathered:
                self._links_pending = True
        # A directory loaded from the base tree holds the base's very entries: no comparison.
        node.stat_base = be is not None and (be is e or be == e) and base_path is not None
        return node

    def _load(self, d: Node) -> dict[bytes, Node]:
        children = d.children
        if children is not None:
            return children
        children = {}
        entries = _entries(self.store, d.oid)
        if d.oid is not None:
            d.tree_entries = (d.oid, entries, None)
        base: dict[bytes, Entry] = {}
        if d.base_path is not None and d.base_oid is not None:
            base = entries if d.base_oid == d.oid else _entries(self.store, d.base_oid)
        prefix = d.base_path + b"/" if d.base_path else b""
        for name, e in entries.items():
            child = self._from_entry(e, base.get(name), prefix + name)
            child.links.append((d, name))
            children[name] = child
        d.children = children
        if self._links_pending:
            self._gather_links()
        return children

    def _gather_links(self) -> None:
        """Load every directory whose tree holds a hard-linked file, once a group's first name
        is met: each group is then one node with all its names before any of them changes, so
        a write through one name shows through the others and every name's entry is rebuilt.

        Paid once per layer (again after a restore) by trees with hard links: a walk of the
        trees not loaded yet, each tree's answer kept (`_tree_has_links`)."""
        self._links_pending = False
        self._links_gathered = True
        stack = [self.root]
        while stack:
            d = stack.pop()
            kids = d.children
            if kids is None:
                if d.oid is None or not self._tree_has_links(d.oid):
                    continue
                kids = self._load(d)
            stack.extend(c for c in kids.values() if c.fmt == S_IFDIR)

    def _tree_has_links(self, oid: ObjectId) -> bool:
        """Whether a hard-linked file lies under tree ``oid``; each tree's answer is kept, so
        later calls visit only trees not seen yet (depth first, without recursion: trees nest
        up to MAX_DEPTH)."""
        memo = self._link_trees
        known = memo.get(oid)
        if known is not None:
            return known
        store = self.store
        stack = [(oid, iter(_entries(store, oid).values()))]
        while stack:
            top, it = stack[-1]
            for e in it:
                # a file or directory entry has an oid (only a symlink's is None)
                sub = e.link != 0 or (e.kind == DIR and memo.get(e.oid))  # type: ignore[arg-type]
                if sub:
                    for t, _ in stack:  # a tree holding this one holds a link too
                        memo[t] = True
                    return True
                if sub is None:
                    # a file or directory entry has an oid (only a symlink's is None)
                    stack.append((e.oid, iter(_entries(store, e.oid).values())))  # type: ignore[arg-type]
                    break
            else:
                memo[top] = False
                stack.pop()
        return False

    def _fill(self, node: Node) -> None:
        """Take uid, gid, atime and ctime from the base file this node mirrors."""
        node.stat_base = False
        try:
            if node.base_path:
                st = os.stat(node.base_path, dir_fd=self.base_fd, follow_symlinks=False)
            else:
                st = os.stat(self.base_fd)
        except OSError:
            return
        node.uid, node.gid = st.st_uid, st.st_gid
        node.atime_ns, node.ctime_ns = st.st_atime_ns, st.st_ctime_ns
        # A directory not yet loaded holds the base's entries, so the base's own count of
        # sub-directories holds for it, for free (a file system that does not count says 1).
        if node.fmt == S_IFDIR and node.children is None and st.st_nlink >= 2:
            node.subdirs = st.st_nlink - 2

    def node(self, ino: int) -> Node:
        node = self.inodes.get(ino)
        if node is None:
            raise _err(errno.ENOENT)
        return node

    def _dir(self, ino: int) -> tuple[Node, dict[bytes, Node]]:
        """The directory ``ino`` and its entries, loaded."""
        d = self.node(ino)
        if d.fmt != S_IFDIR:
            raise _err(errno.ENOTDIR)
        return d, self._load(d)

    def attrs(self, node: Node) -> Node:
        """The node with every attribute resolved (call before reading its fields)."""
        if node.stat_base:
            self._fill(node)
        return node

    def nlink(self, node: Node) -> int:
        """The node's link count: its names, or for a directory 2 and one per sub-directory
        (ext4's count, which `find` and `ls` rely on); counted once, then kept up to date."""
        if node.fmt != S_IFDIR:
            return len(node.links)
        if node.subdirs < 0:
            self.attrs(node)
        if node.subdirs < 0:
            if node.children is not None:
                node.subdirs = sum(c.fmt == S_IFDIR for c in node.children.values())
            else:
                entries = _entries(self.store, node.oid).values()
                node.subdirs = sum(e.kind == DIR for e in entries)
        return 2 + node.subdirs

    @staticmethod
    def _count_subdir(d: Node, child: Node, change: int) -> None:
        if child.fmt == S_IFDIR and d.subdirs >= 0:
            d.subdirs += change

    def blocks(self, node: Node) -> int:
        if node.fmt == S_IFREG and node.src == SRC_SCRATCH:
            try:
                if node.backing is not None:
                    return os.fstat(node.backing.fd).st_blocks
                return os.stat(self._scratch(node)).st_blocks
            except OSError:
                pass
        return (node.size + 511) // 512

    def lookup(self, parent: int, name: bytes, missing: Any = _RAISE) -> Node:
        """The node at ``name`` in directory ``parent``; if there is none, ``missing`` when
        given, else ENOENT."""
        d, kids = self._dir(parent)
        # Not a missing name, which the kernel would cache as one (see shadowfs.fuse).
        self._check_length(name)
        if name == b".":
            return d
        if name == b"..":
            return d.links[0][0] if d.links else d
        child = kids.get(name)
        if child is None:
            if missing is _RAISE:
                raise _err(errno.ENOENT)
            # missing is the caller's default (Any), returned as given
            return missing  # type: ignore[no-any-return]
        return child

    def children(self, ino: int) -> list[tuple[bytes, Node]]:
        return list(self._dir(ino)[1].items())

    def alive(self, node: Node) -> bool:
        return self.inodes.get(node.ino) is node

    def forget(self, ino: int, n: int) -> None:
        node = self.inodes.get(ino)
        if node is not None:
            node.lookups = max(0, node.lookups - n)
            self._maybe_drop(node)

    def _maybe_drop(self, node: Node) -> None:
        if node.links or node.lookups or node.opens or node is self.root:
            return
        del self.inodes[node.ino]
        self._idle.pop(node.ino, None)
        if node.link_key and self._groups.get(node.link_key) is node:
            del self._groups[node.link_key]
        if node.backing is not None:
            node.backing.release()
            node.backing = None
        if node.fmt == S_IFREG and node.src == SRC_SCRATCH:
            # Inode numbers are never reused, so nothing can reach this name again.
            self._unstage(node)
        if node.children:
            # Only a restore detaches a non-empty directory; let its sub-tree go too.
            kids = node.children
            node.children = {}
            for name, child in kids.items():
                self._unlink_child(node, name, child)

    def _scratch(self, node: Node) -> str:
        return f"{self.scratch_dir}/{node.ino}"

    def _unstage(self, node: Node) -> None:
        self._files.remove(self._scratch(node), node.size)
        self.scratch_bytes -= node.size

    def reserve(self, node: Node, end: int) -> None:
        """Refuse (ENOSPC) a write or truncate that would make staged ``node`` ``end`` bytes
        long, past the scratch limit. The caller has copied ``node`` up already; its growth is
        counted when the write is accounted for (`wrote_node`)."""
        limit = self.scratch_limit
        if limit is not None and end > node.size and self.scratch_bytes + end - node.size > limit:
            raise _limit_reached()

    # ------------------------------------------------------------------ paths and dirtiness

    def path_of(self, d: Node, name: bytes = b"") -> bytes:
        """The node's path relative to the root (its first link), with ``name`` appended."""
        parts = [name] if name else []
        while d.links:
            d, n = d.links[0]
            parts.append(n)
        return b"/".join(reversed(parts))

    def _touch(self, d: Node, name: bytes) -> None:
        """Mark ``name`` in ``d`` as possibly differing from the last snapshot, up to the root."""
        marks = d.dirty_names
        if name in marks:
            return
        marks.add(name)
        while d.links:
            p, pname = d.links[0]
            if pname in p.dirty_names:
                return
            p.dirty_names.add(pname)
            d = p
        # The root's first mark: the layer has changes to fold again.
        if self.on_dirty is not None and len(d.dirty_names) == 1 and d is self.root:
            self.on_dirty()

    def _touch_node(self, node: Node) -> None:
        for d, name in node.links:
            self._touch(d, name)

    def _changed_dir(self, d: Node, now: int) -> None:
        if d.stat_base:
            self._fill(d)
        d.mtime_ns = d.ctime_ns = now
        self._touch_node(d)

    @property
    def dirty(self) -> bool:
        """Whether anything changed since the last snapshot."""
        return bool(self.root.dirty_names)

    # ------------------------------------------------------------------ content

    def _open_backing(self, node: Node) -> Backing:
        b = node.backing
        if b is not None:
            return b
        if node.src == SRC_BASE:
            # A node from the base (SRC_BASE) has its path there.
            fd = os.open(node.base_path, _BASE_READ, dir_fd=self.base_fd)  # type: ignore[arg-type]
            b = Backing(fd, False)
        elif node.src == SRC_SCRATCH:
            b = Backing(os.open(self._scratch(node), os.O_RDWR | os.O_CLOEXEC), True)
        else:
            raise AssertionError("store content is materialised before it is opened")
        node.backing = b
        return b

    def needs_copy(self, node: Node, write: bool) -> bool:
        """Whether opening ``node`` (for writing if ``write``) must copy its content first."""
        return node.src == SRC_STORE or (write and node.src != SRC_SCRATCH)

    def start_copy(self, node: Node, write: bool, keep: int | None = None) -> CopyJob:
        """Begin a copy-up (write) or a materialisation from the store (read): the I/O is
        `CopyJob.run`, then `finish_copy`. ``keep`` limits the bytes copied (truncation).

        With nothing to keep, the staged file is made at its own name: there is no partial
        copy to hide, and the rename would cost as much as the create (a metadata update on
        the scratch file system). The name is free: inode numbers are never reused, and a
        node gets a staged file only here, once."""
        keep = node.size if keep is None else min(keep, node.size)
        limit = self.scratch_limit
        # A read materialising a file from the store is never refused: it only counts.
        if write and limit is not None and self.scratch_bytes + keep > limit:
            raise _limit_reached()
        final = self._scratch(node)
        fd = -1
        if not keep:
            with contextlib.suppress(FileExistsError):  # not expected; then the usual way
                fd = os.open(final, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        if fd >= 0:
            tmp = final
        else:
            tmp = final + ".tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        job = CopyJob(node, write, keep, tmp, fd)
        try:
            if node.src == SRC_STORE:
                job.src_oid = node.oid
                job.store = self.store
            elif node.src == SRC_BASE and keep > 0:
                if node.backing is not None:
                    job.src_fd = os.dup(node.backing.fd)
                else:
                    # A node from the base (SRC_BASE) has its path there.
                    job.src_fd = os.open(node.base_path, _BASE_READ, dir_fd=self.base_fd)  # type: ignore[arg-type]
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return job

    def finish_copy(self, job: CopyJob) -> None:
        node = job.node
        if job.src_fd >= 0:
            os.close(job.src_fd)
        final = self._scratch(node)
        if node.src == SRC_SCRATCH:
            # Someone else finished a copy of this node first; theirs stands.
            os.close(job.tmp_fd)
            if job.tmp_path != final:
                os.unlink(job.tmp_path)
        else:
            if job.tmp_path != final:
                os.rename(job.tmp_path, final)
            old = node.backing
            node.backing = None
            if old is not None:
                node.backing = Backing(job.tmp_fd, True)
                old.release()
            else:
                os.close(job.tmp_fd)
            node.src = SRC_SCRATCH
            if job.keep != node.size:
                node.size = job.keep
                job.write = True
            self.scratch_bytes += job.keep
        if job.write and not node.dirty:
            node.dirty = True
            self._touch_node(node)

    def abort_copy(self, job: CopyJob) -> None:
        os.close(job.tmp_fd)
        if job.src_fd >= 0:
            os.close(job.src_fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(job.tmp_path)

    def copy_up(self, node: Node, write: bool = True, keep: int | None = None) -> None:
        job = self.start_copy(node, write, keep)
        try:
            job.run()
        except BaseException:
            self.abort_copy(job)
            raise
        self.finish_copy(job)

    def _keep_image(self, node: Node, data: bytes | memoryview) -> None:
        """``data`` is all of ``node``'s content now, just written (any older image was dropped
        by the write's accounting)."""
        n = len(data)
        if n <= IMAGE_MAX and n == node.size and self._image_bytes + n <= IMAGES_MAX:
            node.image = data if type(data) is bytes else bytes(data)
            self._image_bytes += n
            self._imaged.add(node)

    def _drop_image(self, node: Node) -> None:
        # called only for a node holding an image
        self._image_bytes -= len(node.image)  # type: ignore[arg-type]
        node.image = None
        self._imaged.discard(node)

    def _drop_images(self) -> None:
        """Drop the images no snapshot took: of files deleted or replaced since they were
        written, which the fold never reached."""
        for node in self._imaged:
            node.image = None
        self._imaged.clear()
        self._image_bytes = 0

    def _content_changed(self, node: Node, now: int) -> None:
        if node.image is not None:
            self._drop_image(node)
        node.mtime_ns = node.ctime_ns = now
        if not node.dirty:
            node.dirty = True
            self._touch_node(node)

    # ------------------------------------------------------------------ handles

    def open(self, ino: int, flags: int, pid: int = 0) -> Handle:
        node = self.node(ino)
        if node.fmt == S_IFDIR:
            raise _err(errno.EISDIR)
        if node.fmt != S_IFREG:
            raise _err(errno.ELOOP)
        write = flags & os.O_ACCMODE != os.O_RDONLY
        trunc = bool(flags & os.O_TRUNC)
        if self.needs_copy(node, write or trunc):
            self.copy_up(node, write or trunc, 0 if trunc else None)
        return self.open_copied(node, flags, pid)

    def open_copied(self, node: Node, flags: int, pid: int = 0) -> Handle:
        """The second half of `open`, once any copy `needs_copy` asked for is done."""
        if flags & os.O_TRUNC:
            if node.size:
                self._truncate(node, 0, pid)
            self.journal.record("truncate", (self._path_of_node(node),), pid)
        return self._handle(node, flags & os.O_ACCMODE != os.O_RDONLY, pid)

    def _handle(self, node: Node, write: bool, pid: int) -> Handle:
        self._open_backing(node)
        node.opens += 1
        fh = self._next_fh
        self._next_fh += 1
        path = self.path_of(node.links[0][0], node.links[0][1]) if node.links else b""
        h = Handle(fh, node, write, path, pid)
        self.handles[fh] = h
        return h

    def handle(self, fh: int) -> Handle:
        h = self.handles.get(fh)
        if h is None:
            raise _err(errno.EBADF)
        return h

    def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        node = h.node
        node.opens -= 1
        if node.opens == 0 and node.backing is not None:
            node.backing.release()
            node.backing = None
        self._maybe_drop(node)

    def _pin(self, node: Node, write: bool) -> Backing:
        if write and node.src != SRC_SCRATCH:
            self.copy_up(node)
        b = self._open_backing(node)
        b.refs += 1
        return b

    def pin(self, h: Handle, write: bool) -> Backing:
        """The fd to do I/O on for handle ``h``, kept open until `Backing.release`."""
        return self._pin(h.node, write)

    def read(self, h: Handle, off: int, size: int) -> bytes:
        return _pread(self.pin(h, False), size, off)

    def write(self, h: Handle, off: int, data: bytes | memoryview) -> int:
        n = _pwrite(self._reserved(self.pin(h, True), h.node, off + len(data)), data, off)
        self.wrote(h, off, n)
        return n

    def wrote(self, h: Handle, off: int, n: int) -> None:
        """Account for ``n`` bytes written at ``off`` through ``h`` (also after threaded I/O)."""
        self._wrote(h.node, off + n, True)
        self.journal.write(h.fh, h.path, h.pid, off, n)

    def _reserved(self, b: Backing, node: Node, end: int) -> Backing:
        """``b``, once `reserve` let ``node`` grow to ``end`` bytes (released if not)."""
        if self.scratch_limit is not None:
            try:
                self.reserve(node, end)
            except OSError:
                b.release()
                raise
        return b

    def _wrote(self, node: Node, end: int, times: bool) -> None:
        if node.image is not None:
            self._drop_image(node)
        if end > node.size:
            self.scratch_bytes += end - node.size
            node.size = end
        if times:
            self._content_changed(node, time.time_ns())
        elif not node.dirty:
            node.dirty = True
            self._touch_node(node)

    # ------------------------------------------------------------------ I/O by node

    def pin_node(self, node: Node, write: bool) -> Backing:
        """The fd for I/O on ``node`` without a handle (copied up first if ``write``), kept
        open until `Backing.release`. The node keeps it open afterwards among the
        `IDLE_BACKINGS` most recently used."""
        b = self._pin(node, write)
        idle = self._idle
        ino = node.ino
        if ino in idle:
            del idle[ino]
        idle[ino] = node
        if len(idle) > IDLE_BACKINGS:
            old_ino = next(iter(idle))
            old = idle.pop(old_ino)
            ob = old.backing
            if ob is not None and old.opens == 0 and old is not node:
                old.backing = None
                ob.release()
        return b

    def read_node(self, node: Node, off: int, size: int) -> bytes:
        return _pread(self.pin_node(node, False), size, off)

    def write_node(
        self, node: Node, off: int, data: bytes | memoryview, pid: int, *, times: bool = True
    ) -> int:
        n = _pwrite(self._reserved(self.pin_node(node, True), node, off + len(data)), data, off)
        self.wrote_node(node, off, n, pid, times=times)
        if off == 0 and n == node.size:
            self._keep_image(node, data)
        return n

    def wrote_node(self, node: Node, off: int, n: int, pid: int, *, times: bool = True) -> None:
        """Account for ``n`` bytes written at ``off`` to ``node`` (also after threaded I/O).
        ``times=False`` leaves mtime and ctime alone: a kernel with a writeback cache keeps
        them itself and sends them with a setattr, which may be served before this write."""
        self._wrote(node, off + n, times)
        # Keyed by the negated inode number: never equal to a handle's fh.
        key = -node.ino
        journal = self.journal
        if not journal.extend(key, off, n):
            journal.write(key, self._path_of_node(node), pid, off, n)

    # ------------------------------------------------------------------ creating

    @staticmethod
    def _check_length(name: bytes) -> None:
        """Every request naming an entry answers a name over NAME_MAX as the kernel's file
        systems do, before anything else about it (existence included)."""
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG)

    def _check_name(self, name: bytes) -> None:
        self._check_length(name)
        if not name or b"/" in name or name in (b".", b".."):
            raise _err(errno.EINVAL)

    def _link(self, d: Node, name: bytes, node: Node, now: int) -> None:
        # children is None only until _load; a directory reached here is loaded (callers' _dir)
        d.children[name] = node  # type: ignore[index]
        node.links.append((d, name))
        self._changed_dir(d, now)
        self._touch(d, name)
        self._count_subdir(d, node, 1)

    def _add(
        self, parent: int, name: bytes, fmt: int, mode: int, uid: int, gid: int, ino: int = 0
    ) -> tuple[Node, Node]:
        d, kids = self._dir(parent)
        self._check_name(name)
        if name in kids:
            raise _err(errno.EEXIST)
        now = time.time_ns()
        node = self._new(fmt, stat.S_IMODE(mode), now, ino)
        node.uid, node.gid = uid, gid
        if d.mode & stat.S_ISGID:
            node.gid = d.gid
            if fmt == S_IFDIR:
                node.mode |= stat.S_ISGID
        return d, node

    def create(
        self,
        parent: int,
        name: bytes,
        mode: int,
        flags: int,
        uid: int | None = None,
        gid: int | None = None,
        pid: int = 0,
    ) -> tuple[Handle, Node]:
        d, kids = self._dir(parent)
        self._check_name(name)
        if name in kids:
            raise _err(errno.EEXIST)
        files = self._files
        if files.low():
            start = self._next_ino
            self._next_ino += files.BATCH
            files.prepare(range(start, start + files.BATCH))
        got = files.take()
        if got is None:
            d, node = self._add(parent, name, S_IFREG, mode, self._u(uid), self._g(gid))
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            fd = os.open(self._scratch(node), flags, 0o600)
        else:
            ino, fd = got
            d, node = self._add(parent, name, S_IFREG, mode, self._u(uid), self._g(gid), ino)
        node.backing = Backing(fd, True)
        node.dirty = True
        self._link(d, name, node, node.mtime_ns)
        self.journal.record("create", (self.path_of(d, name),), pid, arg=node.mode)
        h = self._handle(node, flags & os.O_ACCMODE != os.O_RDONLY, pid)
        return h, node

    def mknod(
        self,
        parent: int,
        name: bytes,
        mode: int,
        uid: int | None = None,
        gid: int | None = None,
        pid: int = 0,
        *,
        rdev: int = 0,
    ) -> Node:
        """A regular file, fifo, unix socket or device node. Through a mount the kernel has
        checked CAP_MKNOD for a device already; the mount is nodev, so it opens nothing."""
        fmt = stat.S_IFMT(mode)
        if fmt in _SPECIAL_FMTS:
            d, node = self._add(parent, name, fmt, mode, self._u(uid), self._g(gid))
            if fmt in (stat.S_IFCHR, stat.S_IFBLK):
                node.rdev = rdev
            self._link(d, name, node, node.mtime_ns)
            self.journal.record("create", (self.path_of(d, name),), pid, arg=fmt | node.mode)
            return node
        self._check_length(name)
        if fmt not in (0, S_IFREG):
            raise _err(errno.EINVAL)
        h, node = self.create(parent, name, mode, os.O_RDWR, uid, gid, pid)
        # The new scratch fd stays open (among the idle ones) for the writes that usually
        # follow; no handle holds it.
        self.handles.pop(h.fh)
        node.opens -= 1
        self._idle[node.ino] = node
        return node

    def mkdir_in(
        self,
        parent: int,
        name: bytes,
        mode: int,
        uid: int | None = None,
        gid: int | None = None,
        pid: int = 0,
    ) -> Node:
        self._check_depth(self._dir(parent)[0], 1)
        d, node = self._add(parent, name, S_IFDIR, mode, self._u(uid), self._g(gid))
        node.children = {}
        node.subdirs = 0
        self._link(d, name, node, node.mtime_ns)
        self.journal.record("mkdir", (self.path_of(d, name),), pid, arg=node.mode)
        return node

    def symlink(
        self,
        parent: int,
        name: bytes,
        target: bytes,
        uid: int | None = None,
        gid: int | None = None,
        pid: int = 0,
    ) -> Node:
        if not target:
            raise _err(errno.ENOENT)
        if len(target) > TARGET_MAX or b"\0" in target:
            raise _err(errno.ENAMETOOLONG)
        d, node = self._add(parent, name, S_IFLNK, 0o777, self._u(uid), self._g(gid))
        node.target = target
        node.size = len(target)
        self._link(d, name, node, node.mtime_ns)
        self.journal.record("symlink", (self.path_of(d, name),), pid, extra=target)
        return node

    def link(self, ino: int, parent: int, name: bytes, pid: int = 0) -> Node:
        node = self.node(ino)
        if node.fmt == S_IFDIR:
            raise _err(errno.EPERM)
        d, kids = self._dir(parent)
        self._check_name(name)
        if name in kids:
            raise _err(errno.EEXIST)
        if not node.links:
            raise _err(errno.ENOENT)
        self.attrs(node)
        now = time.time_ns()
        old = self.path_of(node.links[0][0], node.links[0][1])
        if node.fmt != S_IFLNK and not node.link_key:
            # Its entries now name a group (trees keep no hard links of symlinks).
            node.link_key = trees.new_link_key()
            self._groups[node.link_key] = node
            self._touch_node(node)
        self._link(d, name, node, now)
        node.ctime_ns = now
        self.journal.record("link", (old, self.path_of(d, name)), pid)
        return node

    def readlink(self, ino: int) -> bytes:
        node = self.node(ino)
        if node.fmt != S_IFLNK:
            raise _err(errno.EINVAL)
        # a symlink always has a target (Entry.target is None for the other kinds)
        return node.target  # type: ignore[return-value]

    def _u(self, uid: int | None) -> int:
        return self.uid if uid is None else uid

    def _g(self, gid: int | None) -> int:
        return self.gid if gid is None else gid

    # ------------------------------------------------------------------ removing and renaming

    def _unlink_child(self, d: Node, name: bytes, child: Node) -> None:
        with contextlib.suppress(ValueError):
            child.links.remove((d, name))
        self._maybe_drop(child)

    def unlink(self, parent: int, name: bytes, pid: int = 0) -> Node:
        d, kids = self._dir(parent)
        self._check_length(name)
        child = kids.get(name)
        if child is None:
            raise _err(errno.ENOENT)
        if child.fmt == S_IFDIR:
            raise _err(errno.EISDIR)
        self.journal.record("unlink", (self.path_of(d, name),), pid)
        return self._remove(d, name, child)

    def rmdir(self, parent: int, name: bytes, pid: int = 0) -> Node:
        d, kids = self._dir(parent)
        self._check_length(name)
        child = kids.get(name)
        if child is None:
            raise _err(errno.ENOENT)
        if child.fmt != S_IFDIR:
            raise _err(errno.ENOTDIR)
        if self._load(child):
            raise _err(errno.ENOTEMPTY)
        self.journal.record("rmdir", (self.path_of(d, name),), pid)
        return self._remove(d, name, child)

    def _remove(self, d: Node, name: bytes, child: Node) -> Node:
        now = time.time_ns()
        # children is None only until _load; a directory reached here is loaded (callers' _dir)
        del d.children[name]  # type: ignore[union-attr]
        self._touch(d, name)
        self._changed_dir(d, now)
        self._count_subdir(d, child, -1)
        if child.stat_base:
            self._fill(child)
        child.ctime_ns = now
        self._unlink_child(d, name, child)
        return child

    def rename(
        self,
        old_parent: int,
        old_name: bytes,
        new_parent: int,
        new_name: bytes,
        flags: int = 0,
        pid: int = 0,
    ) -> None:
        od, okids = self._dir(old_parent)
        nd, nkids = self._dir(new_parent)
        self._check_length(old_name)
        self._check_name(new_name)
        src = okids.get(old_name)
        if src is None:
            raise _err(errno.ENOENT)
        dst = nkids.get(new_name)
        paths = (self.path_of(od, old_name), self.path_of(nd, new_name))
        if flags & RENAME_EXCHANGE:
            if dst is None:
                raise _err(errno.ENOENT)
            if src.fmt == S_IFDIR:
                self._check_not_inside(nd, src)
                self._check_depth(nd, self._height(src))
            if dst.fmt == S_IFDIR:
                self._check_not_inside(od, dst)
                self._check_depth(od, self._height(dst))
            self.journal.record("rename", paths, pid, arg=flags)
            now = time.time_ns()
            src.links.remove((od, old_name))
            dst.links.remove((nd, new_name))
            okids[old_name] = dst
            nkids[new_name] = src
            dst.links.append((od, old_name))
            src.links.append((nd, new_name))
            for d, n in ((od, old_name), (nd, new_name)):
                self._touch(d, n)
                self._changed_dir(d, now)
            for d, gone, came in ((od, src, dst), (nd, dst, src)):
                self._count_subdir(d, gone, -1)
                self._count_subdir(d, came, 1)
            return
        if dst is not None:
            if flags & RENAME_NOREPLACE:
                raise _err(errno.EEXIST)
            if dst is src:
                return
            if src.fmt == S_IFDIR:
                if dst.fmt != S_IFDIR:
                    raise _err(errno.ENOTDIR)
                if self._load(dst):
                    raise _err(errno.ENOTEMPTY)
            elif dst.fmt == S_IFDIR:
                raise _err(errno.EISDIR)
        if src.fmt == S_IFDIR:
            self._check_not_inside(nd, src)
            if nd is not od:
                self._check_depth(nd, self._height(src))
        self.journal.record("rename", paths, pid, arg=flags)
        now = time.time_ns()
        del okids[old_name]
        src.links.remove((od, old_name))
        self._touch(od, old_name)
        self._changed_dir(od, now)
        self._count_subdir(od, src, -1)
        if dst is not None:
            del nkids[new_name]
            self._count_subdir(nd, dst, -1)
            dst.ctime_ns = now
            self._unlink_child(nd, new_name, dst)
        if src.stat_base:
            self._fill(src)
        src.ctime_ns = now
        self._link(nd, new_name, src, now)

    def _check_depth(self, d: Node, levels: int) -> None:
        """Refuse ``levels`` of directories under ``d`` past tree.MAX_DEPTH from the root.

        A tree deeper than that cannot be snapshotted or read back, so the first write that
        would make one fails, with ENAMETOOLONG: what the kernel answers a path past its limits
        (`mkdir -p` says "File name too long")."""
        depth = levels
        while d.links:
            d = d.links[0][0]
            depth += 1
        if depth > MAX_DEPTH:
            raise _err(errno.ENAMETOOLONG)

    def _height(self, d: Node) -> int:
        """How many levels of directories ``d`` holds, itself included (a leaf directory is 1);
        counted up to MAX_DEPTH + 1 only."""
        height = 0
        level: list[Node | ObjectId] = [d]
        while level and height <= MAX_DEPTH:
            height += 1
            below: list[Node | ObjectId] = []
            for item in level:
                if isinstance(item, Node) and item.children is not None:
                    below += [c for c in item.children.values() if c.fmt == S_IFDIR]
                else:
                    oid = item.oid if isinstance(item, Node) else item
                    entries = _entries(self.store, oid).values()
                    # a file or directory entry has an oid (only a symlink's is None)
                    below += [e.oid for e in entries if e.kind == DIR]  # type: ignore[misc]
            level = below
        return height

    def _check_not_inside(self, d: Node, moved: Node) -> None:
        """Refuse to move a directory into itself or its own sub-tree."""
        p: Node | None = d
        while p is not None:
            if p is moved:
                raise _err(errno.EINVAL)
            p = p.links[0][0] if p.links else None

    # ------------------------------------------------------------------ attributes

    def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        pid: int = 0,
    ) -> Node:
        node = self.attrs(self.node(ino))
        now = time.time_ns()
        # Clamped to what a tree records, as a file system clamps to its range: a time beyond
        # it would otherwise make every later snapshot fail.
        if atime_ns is not None:
            atime_ns = clamp_time_ns(atime_ns)
            if atime_ns == node.atime_ns:
                atime_ns = None
        if mtime_ns is not None:
            mtime_ns = clamp_time_ns(mtime_ns)
            if mtime_ns == node.mtime_ns:
                # With a writeback cache the kernel sends back the mtime it has, unchanged,
                # after every unlink and rename of a file (with the new ctime): no op for the
                # journal, and nothing for the next snapshot to rebuild.
                mtime_ns = None
        if (size, mode, uid, gid, atime_ns, mtime_ns) == (None,) * 6:
            node.ctime_ns = now
            return node
        path = self.path_of(node.links[0][0], node.links[0][1]) if node.links else b""
        if size is not None:
            if node.fmt == S_IFDIR:
                raise _err(errno.EISDIR)
            if node.fmt != S_IFREG:
                raise _err(errno.EINVAL)
            if node.src != SRC_SCRATCH and size != node.size:
                self.copy_up(node, True, size)  # a shrinking copy-up copies only what it keeps
            if size != node.size:
                self._truncate(node, size, pid)
            self.journal.record("truncate", (path,), pid, length=size)
        changed = False
        if mode is not None:
            node.mode = stat.S_IMODE(mode)
            changed = True
            self.journal.record("chmod", (path,), pid, arg=node.mode)
        if uid is not None or gid is not None:
            if uid is not None:
                node.uid = uid
            if gid is not None:
                node.gid = gid
            self.journal.record("chown", (path,), pid, arg=(node.uid << 32) | node.gid)
        if atime_ns is not None or mtime_ns is not None:
            if atime_ns is not None:
                node.atime_ns = atime_ns
            if mtime_ns is not None:
                node.mtime_ns = mtime_ns
                changed = True
            self.journal.record("utimens", (path,), pid, offset=max(node.mtime_ns, 0))
        node.ctime_ns = now
        if changed:
            self._touch_node(node)
        return node

    def _truncate(self, node: Node, size: int, pid: int) -> None:
        self.reserve(node, size)
        b = self._open_backing(node)
        try:
            os.ftruncate(b.fd, size)
        finally:
            if node.opens == 0:
                b.release()
                node.backing = None
        self.scratch_bytes += size - node.size
        node.size = size
        self._content_changed(node, time.time_ns())

    # ------------------------------------------------------------------ xattrs

    def _base_xattr_path(self, node: Node) -> str | None:
        if node.base_path is None:
            return None
        rel = os.fsdecode(node.base_path)
        return f"{self._proc_base}/{rel}" if rel else self._proc_base

    def _own_xattrs(self, node: Node) -> dict[bytes, bytes]:
        if node.xattrs is None:
            node.xattrs = {}
            path = self._base_xattr_path(node)
            if path is not None:
                with contextlib.suppress(OSError):
                    for name in os.listxattr(path, follow_symlinks=False):
                        if name.startswith("system."):
                            continue
                        with contextlib.suppress(OSError):
                            node.xattrs[os.fsencode(name)] = os.getxattr(
                                path, name, follow_symlinks=False
                            )
        return node.xattrs

    def getxattr(self, ino: int, name: bytes) -> bytes:
        node = self.node(ino)
        _check_xattr(name)
        xattrs = node.xattrs
        if xattrs is None:
            if node.base_path is None:
                raise _err(errno.ENODATA)
            # Listed once, then answered from memory: the kernel asks for security.capability
            # before every first write to a file and every truncate or chown.
            xattrs = self._own_xattrs(node)
        value = xattrs.get(name)
        if value is None:
            raise _err(errno.ENODATA)
        return value

    def listxattr(self, ino: int) -> list[bytes]:
        node = self.node(ino)
        if node.xattrs is None:
            path = self._base_xattr_path(node)
            if path is None:
                return []
            try:
                names = [os.fsencode(n) for n in os.listxattr(path, follow_symlinks=False)]
            except OSError:
                return []
            return [n for n in names if not n.startswith(b"system.")]
        return list(node.xattrs)

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0, pid: int = 0) -> None:
        node = self.node(ino)
        _check_xattr(name)
        xattrs = self._own_xattrs(node)
        if flags & XATTR_CREATE and name in xattrs:
            raise _err(errno.EEXIST)
        if flags & XATTR_REPLACE and name not in xattrs:
            raise _err(errno.ENODATA)
        xattrs[name] = bytes(value)
        node.ctime_ns = time.time_ns()
        self.journal.record("setxattr", (self._path_of_node(node),), pid, extra=name)

    def removexattr(self, ino: int, name: bytes, pid: int = 0) -> None:
        node = self.node(ino)
        _check_xattr(name)
        xattrs = self._own_xattrs(node)
        if xattrs.pop(name, None) is None:
            raise _err(errno.ENODATA)
        node.ctime_ns = time.time_ns()
        self.journal.record("removexattr", (self._path_of_node(node),), pid, extra=name)

    def _path_of_node(self, node: Node) -> bytes:
        return self.path_of(node.links[0][0], node.links[0][1]) if node.links else b""

    @_routed()
    def staged_bytes(self, recount: bool = False) -> int:
        """What the scratch limit counts: the apparent size of every staged file. ``recount``
        sums it over the nodes instead of reading the running total (an audit: O(nodes))."""
        if not recount:
            return self.scratch_bytes
        return sum(
            n.size for n in self.inodes.values() if n.fmt == S_IFREG and n.src == SRC_SCRATCH
        )

    def statfs(self) -> os.statvfs_result:
        """The scratch file system's figures; under a scratch limit, as if the limit were its
        size and the staged files all its used space (less where the disk has less left)."""
        s = os.statvfs(self.scratch_dir)
        limit = self.scratch_limit
        if limit is None:
            return s
        unit = s.f_frsize or s.f_bsize
        left = max(0, limit - self.scratch_bytes) // unit
        return os.statvfs_result((
            s.f_bsize, s.f_frsize, limit // unit, min(s.f_bfree, left), min(s.f_bavail, left),
            s.f_files, s.f_ffree, s.f_favail, s.f_flag, s.f_namemax,
        ))

    # ------------------------------------------------------------------ snapshot

    def _empty(self) -> ObjectId:
        if self._empty_tree is None:
            self._empty_tree = self.store.put("tree", trees.encode_tree([]))
        return self._empty_tree

    def _store_content(self, node: Node) -> ObjectId:
        prev = node.oid
        data = node.image
        if data is not None:
            self._drop_image(node)
            if len(data) == node.size:
                base = prev if prev is not None and len(data) >= DELTA_MIN else None
                put: ObjectId = self.store.put("blob", data, delta_base=base)
                return put
        if node.size <= DELTA_MAX:
            # Small content is read whole, through the fd the node may keep open already: a
            # snapshot of a few small files is mostly these reads.
            # One byte more than the size says: a longer file is caught, not cut.
            want = node.size + 1
            b = node.backing
            if b is not None and b.fd >= 0:
                data = os.pread(b.fd, want, 0)
            else:
                fd = os.open(self._scratch(node), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    data = os.pread(fd, want, 0)
                finally:
                    os.close(fd)
            if len(data) <= node.size:
                base = prev if prev is not None and len(data) >= DELTA_MIN else None
                put = self.store.put("blob", data, delta_base=base)
                return put
        oid: ObjectId = self.store.put_file(self._scratch(node))
        return oid

    def _entry(self, node: Node, name: bytes) -> Entry:
        fmt = node.fmt
        if fmt == S_IFDIR:
            if node.dirty_names:
                self._build(node)
            oid = node.oid
            if oid is None:
                oid = node.oid = self._empty()
            return make_entry(name, DIR, node.mode, 0, node.mtime_ns, oid, None)
        if fmt == S_IFREG:
            if node.dirty:
                node.oid = self._store_content(node)
                node.dirty = False
            return make_entry(
                name, FILE, node.mode, node.size, node.mtime_ns, node.oid, None,
                link=node.link_key,
            )
        if fmt in _SPECIAL_FMTS:
            return make_entry(
                name, FMT_SPECIAL[fmt], node.mode, 0, node.mtime_ns, None, None,
                rdev=node.rdev, link=node.link_key,
            )
        t = node.target
        # a symlink node always has a target
        return make_entry(name, SYMLINK, node.mode, len(t), node.mtime_ns, None, t)  # type: ignore[arg-type]

    def _build(self, d: Node) -> None:
        held = d.tree_entries
        if held is not None and held[0] == d.oid:
            old, packed = held[1], held[2]
        else:
            old, packed = _entries(self.store, d.oid), None
        if packed is None and d.oid is not None:
            packed = trees.packed_bytes(d.oid)
        new = dict(old)
        children = d.children
        assert children is not None
        reshaped = False  # a name added or removed: every record after it moves
        swaps: list[tuple[bytes, bytes]] = []
        for name in d.dirty_names:
            child = children.get(name)
            if child is None:
                if new.pop(name, None) is not None:
                    reshaped = True
                continue
            e = self._entry(child, name)
            prev = new.get(name)
            if prev is None:
                # Only new names need checking: the rest come from a decoded (so validated)
                # tree, and re-validating a big directory cost most of a snapshot. A name
                # already there passed when it came in, and a node's other fields are in range
                # by construction (modes masked, times clamped where they enter).
                bad = check_entry(e)
                if bad:
                    raise TreeError(f"cannot encode a tree entry with {bad}; fix the entry")
                reshaped = True
                entry_record(e)
                new[name] = e
                continue
            rec = entry_record(e)
            old_rec = prev.record or entry_record(prev)
            if rec == old_rec:
                continue
            swaps.append((old_rec, rec))
            new[name] = e
        marks, d.dirty_names = d.dirty_names, set()
        data = None
        if reshaped:
            new = dict(sorted(new.items()))
        elif packed is not None:
            data = trees.splice_records(packed, swaps)
        if data is None:
            # Unchanged entries carry the bytes they were decoded from or packed into: only the
            # changed ones were encoded, above.
            # A new directory's previous tree is the empty one, of version 1.
            previous = packed if d.oid is not None else b"\x01"
            changed = [new[n].record for n in marks if n in new]
            # every entry of `new` carries its record (decoded, or encoded just above)
            version = trees.records_version(changed, previous)  # type: ignore[arg-type]
            # every entry of `new` carries its record (decoded, or encoded just above)
            data = pack_records([e.record for e in new.values()], version)  # type: ignore[misc]
        oid = self.store.put("tree", data)
        # The next snapshot or restore starts from this tree: keep it decoded. The trees it
        # pushes out of the shared cache are let go by the next read that decodes one, off the
        # checkpoint's path: freeing a cold tree's entries cost 4-5 µs per tree built.
        trees.remember(oid, new, evict=False)
        # Every name whose entry differs between the two trees was marked: a restore between
        # them looks at just these names (`_reconcile`), without reading either tree.
        if d.oid is not None:
            old_get = old.get
            new_get = new.get
            self._remember_step(
                d.oid,
                oid,
                [(n, was, now) for n in marks if (was := old_get(n)) is not (now := new_get(n))],
            )
        d.oid = oid
        d.tree_entries = (oid, new, data)

    def _fold(self) -> ObjectId:
        """Turn the changes since the last snapshot into a tree (without taking the journal)."""
        root = self.root
        if root.dirty_names:
            self._build(root)
            # _build just gave the root its tree id
            self.last_tree = root.oid  # type: ignore[assignment]
        if self._imaged:
            self._drop_images()
        return self.last_tree

    @_routed(sync=True)
    def fold(self) -> None:
        """Store now what the next snapshot would: the trees of what changed since the last
        one, and the journal as it stands, which stays to be taken (`shadowfs.quiet_fold`). A
        snapshot with nothing changed since finds them stored; their objects are made durable
        with its own."""
        journal = self.journal
        with _CollectorPaused(), self._foreground():
            self._fold()
            folded = self._folded_journal
            if len(journal) and (folded is None or folded[0] != journal.changes):
                oid = self.store.put("journal", journal.encoded())
                self._folded_journal = (journal.changes, oid)

    @_routed(sync=True, stores=True)
    def snapshot(
        self, durable: bool = True, answer: Answer | None = None
    ) -> tuple[ObjectId, ObjectId | None]:
        """Store what changed since the last snapshot; return (tree id, journal id or None).

        ``durable=True``: the objects are on disk and indexed when this returns (one fsync, one
        index commit). ``durable=False`` (a group commit, what a booth's checkpoints use): they
        are in the store at once, readable through it, and made durable by its background flush
        within FLUSH_DELAY (`Store.flush_soon`); whoever then records these ids durably (a tape
        frame, a commit claim) must `store.flush()` first, as `TapeWriter.append` does.

        ``answer(tree id, journal id or None)`` is called as soon as both are known, still under
        the layer lock (no write lands in between), before the flush and the journal's own
        bookkeeping: a caller replies to whoever asked from there, and what follows runs while
        that reply travels. With ``durable=True`` the objects are not durable yet when it runs.
        Not through a mount served from a child process, which cannot carry a function."""
        journal = self.journal
        folded, self._folded_journal = self._folded_journal, None
        if (
            folded is not None
            and folded[0] == journal.changes
            and len(journal)
            and not self.root.dirty_names
        ):
            # `fold` stored it all and nothing was recorded since: the snapshot is only a
            # marker, and its answer needs nothing more than the ids the fold left.
            tree_id = self._fold()
            if answer is not None:
                answer(tree_id, folded[1])
            journal.clear()
            self._flush(durable)
            return tree_id, folded[1]
        with _CollectorPaused():
            with self._foreground():
                tree_id = self._fold()
                journal_id = None
                if len(journal):
                    journal_id = self.store.put("journal", journal.take_encoded())
            if answer is not None:
                answer(tree_id, journal_id)
            self._flush(durable)
        return tree_id, journal_id

    def took_fold(self, durable: bool = True) -> None:
        """What `snapshot` does after its answer when `fold` had stored everything, for a
        caller that took the fold's ids itself (`_folded_journal`, `last_tree`, with
        `journal.changes` as the fold left it) under the layer lock, which it still holds."""
        self._folded_journal = None
        self._fold()
        self.journal.clear()
        self._flush(durable)

    def _foreground(self) -> contextlib.AbstractContextManager[None]:
        """The store's foreground section (`Store.foreground`), if it has one: its background
        flush stands aside meanwhile."""
        section = getattr(self.store, "foreground", None)
        return section() if section is not None else contextlib.nullcontext()

    def _flush(self, durable: bool) -> None:
        soon = None if durable else getattr(self.store, "flush_soon", None)
        if soon is None:
            self.store.flush()
        else:
            soon()

    # ------------------------------------------------------------------ restore

    @_routed(sync=True, stores=True)
    def restore(self, tree_id: ObjectId, pid: int = 0, durable: bool = True) -> None:
        """Bring the layer to the state of tree ``tree_id`` (any snapshot of this layer, or any
        tree in the store). Unsnapshotted changes are stored first, so nothing is lost from the
        store; their journal stays pending for the next snapshot, followed by a ``restore`` op.
        ``durable`` is as for `snapshot`, for what the restore stored (nothing when there were
        no unsnapshotted changes). Kernel invalidations are queued (see `take_invalidations`)."""
        # What a fold stored since the last snapshot is made durable with what this stores.
        stores = bool(self.root.dirty_names) or self._folded_journal is not None
        with _CollectorPaused():
            with self._foreground():
                if stores:
                    self._fold()
                if tree_id != self.root.oid:
                    files = self._files
                    files.hold()
                    # Groups met from here on may have names where nothing is loaded yet.
                    self._links_gathered = False
                    try:
                        self._reconcile(self.root, tree_id, time.time_ns())
                    finally:
                        files.unhold()
            self.root.oid = self.last_tree = tree_id
            # A group's names may now lie in directories nothing has loaded yet, while the node
            # of another name is loaded: load them before that node is written. A layer that
            # never met a group has no such node (and pays no walk).
            if self._links_pending or (self._groups and self._tree_has_links(tree_id)):
                self._gather_links()
            self.journal.record("restore", (b"",), pid, extra=bytes(tree_id))
            if stores:
                self._flush(durable)

    def _remember_step(self, a: ObjectId, b: ObjectId, diffs: list[_Diff]) -> None:
        """Remember how directory trees ``a`` and ``b`` differ: (name, entry in a, entry in b)
        for every name whose entry is not the same object (None where absent).

        Tree ids fix their content, so this never goes stale."""
        if a != b and len(diffs) <= STEP_NAMES_KEPT:
            self._steps.put((a, b), diffs, len(diffs))

    def _scan(self, cur: ObjectId, target: ObjectId) -> list[_Diff]:
        """How directory tree ``cur`` differs from ``target``, found by reading both."""
        store = self.store
        old = _entries(store, cur)
        new = _entries(store, target)
        # Trees built from one another share their unchanged Entry objects, so one identity
        # test per entry, in a comprehension, skips a large directory's unchanged names at C
        # speed.
        new_get = new.get
        diffs: list[tuple[bytes, Entry | None, Entry | None]] = [
            (n, o, e) for n, o in old.items() if (e := new_get(n)) is not o
        ]
        diffs += [(n, None, new[n]) for n in new.keys() - old.keys()]
        self._remember_step(cur, target, diffs)
        return diffs

    def _reconcile(self, d: Node, target: ObjectId, now: int) -> None:
        if d.stat_base:
            # Its base attributes now, while its entries are still the base's: `_fill` would
            # take the base's count of sub-directories, not the target's.
            self._fill(d)
        d.subdirs = -1
        children = d.children
        if children is None:
            d.oid = target
            return
        # None (a directory made since the last build) works too: _steps has no entry for it
        # and _scan reads None as the empty tree, as _entries does
        cur: ObjectId = d.oid  # type: ignore[assignment]
        steps = self._steps
        # The usual rollback undoes the last snapshot's build of this directory.
        diffs = steps.get((target, cur))
        back = diffs is not None
        if not back:
            diffs = steps.get((cur, target))
            if diffs is None:
                diffs = self._scan(cur, target)
        inval = self._inval
        base: dict[bytes, Entry] | None = None
        changed = False
        # diffs is None only when not found, and then _scan's list replaced it
        for name, a, b in diffs:  # type: ignore[union-attr]
            oe, ne = (b, a) if back else (a, b)
            if oe is None:
                changed = True
                if base is None:
                    base = self._base_entries(d)
                # oe is None, so the name is new: ne is its entry
                self._attach(d, name, ne, base)  # type: ignore[arg-type]
                if d.lookups:
                    # The kernel may hold the name as missing (see shadowfs.fuse).
                    inval.append(("entry", d.ino, name))
                continue
            child = children[name]
            kind = oe.kind
            if ne is not None and ne.kind == kind:
                # Field by field rather than Entry.__eq__, which builds two tuples per call.
                if kind == DIR:
                    if oe.oid != ne.oid:
                        # a file or directory entry has an oid (only a symlink's is None)
                        self._reconcile(child, ne.oid, now)  # type: ignore[arg-type]
                    elif oe.mode == ne.mode and oe.mtime_ns == ne.mtime_ns:
                        continue
                    child.mode, child.mtime_ns, child.ctime_ns = ne.mode, ne.mtime_ns, now
                    if child.lookups:
                        inval.append(("inode", child.ino, True))
                    continue
                if (
                    oe.oid == ne.oid and oe.target == ne.target and oe.mtime_ns == ne.mtime_ns
                    and oe.rdev == ne.rdev and oe.link == ne.link
                ):
                    if oe.mode != ne.mode:
                        child.mode, child.ctime_ns = ne.mode, now
                        if child.lookups:
                            inval.append(("inode", child.ino, True))
                    continue
                if (
                    kind == FILE and not (child.lookups or child.opens or ne.link)
                    and len(child.links) == 1 and not child.link_key
                ):
                    changed = True
                    if base is None:
                        base = self._base_entries(d)
                    self._renew(child, ne, base.get(name), d, name)
                    continue
            changed = True
            del children[name]
            if child.lookups:
                inval.append(("entry", d.ino, name))
            self._unlink_child(d, name, child)
            if ne is not None:
                if base is None:
                    base = self._base_entries(d)
                self._attach(d, name, ne, base)
        d.oid = target
        if changed and d.lookups:
            # Not attributes only: the kernel keeps the directory's listing in its page cache.
            inval.append(("inode", d.ino, False))

    def _renew(self, node: Node, e: Entry, be: Entry | None, d: Node, name: bytes) -> None:
        """Make file ``node`` (at ``name`` in ``d``, its only link) the file of tree entry
        ``e``, under a new inode number: what `_unlink_child` and `_attach` would leave, for
        a node neither the kernel nor a handle knows, without replacing the node object.

        A new number all the same: the contract is that changed content gets one, and the old
        number's staged file is then removed in the background with nothing able to reach it."""
        inodes = self.inodes
        del inodes[node.ino]
        if node.src == SRC_SCRATCH:
            self._unstage(node)
        if node.backing is not None:  # not expected without handles; released like a drop
            node.backing.release()
            node.backing = None
        ino = node.ino = self._next_ino
        self._next_ino += 1
        inodes[ino] = node
        t = e.mtime_ns
        node.mode = e.mode
        node.uid = self.uid
        node.gid = self.gid
        node.size = e.size
        node.mtime_ns = node.atime_ns = node.ctime_ns = t
        node.oid = e.oid
        node.dirty = False
        if node.image is not None:
            self._drop_image(node)
        node.xattrs = None
        node.base_oid = None
        if be is None:
            node.src = SRC_STORE
            node.base_path = None
            node.stat_base = False
            return
        bp = d.base_path
        path = None if bp is None else bp + b"/" + name if bp else name
        # Trees built from the base share its Entry objects, so a file rolled back to its base
        # version usually has the very entry of the base: no field comparisons.
        same = be is e
        if same or (be.kind == FILE and be.oid == e.oid):
            node.src = SRC_BASE
            node.base_path = path
        else:
            node.src = SRC_STORE
            node.base_path = None
        node.stat_base = path is not None and (same or be == e)

    def _base_entries(self, d: Node) -> dict[bytes, Entry]:
        if d.base_path is None or d.base_oid is None:
            return {}
        return _entries(self.store, d.base_oid)

    def _attach(self, d: Node, name: bytes, e: Entry, base: dict[bytes, Entry]) -> None:
        prefix = d.base_path + b"/" if d.base_path else b""
        child = self._from_entry(
            e, base.get(name), prefix + name if d.base_path is not None else None
        )
        # children is None only until _load; a directory reached here is loaded (callers' _load)
        d.children[name] = child  # type: ignore[index]
        child.links.append((d, name))

    def take_invalidations(self) -> list[tuple[Any, ...]]:
        """Kernel cache entries made stale by a restore: ``("entry", parent_ino, name)`` and
        ``("inode", ino, attr_only)``. The FUSE side sends them outside its request handlers."""
        out = self._inval
        self._inval = []
        return out

    # ------------------------------------------------------------------ path-level API

    def resolve(self, path: PathLike) -> Node:
        """The node at ``path`` (relative to the layer root; symlinks are not followed)."""
        node = self.root
        for part in _split(path):
            if node.fmt != S_IFDIR:
                raise _err(errno.ENOTDIR, os.fsdecode(path))
            child = self._load(node).get(part)
            if child is None:
                raise _err(errno.ENOENT, os.fsdecode(path))
            node = child
        return node

    def _parent(self, path: PathLike) -> tuple[Node, dict[bytes, Node], bytes]:
        """The directory holding ``path``, its entries (loaded), and the name in it."""
        parts = _split(path)
        if not parts:
            raise _err(errno.EINVAL, os.fsdecode(path))
        d = self.resolve(b"/".join(parts[:-1]))
        if d.fmt != S_IFDIR:
            raise _err(errno.ENOTDIR, os.fsdecode(path))
        return d, self._load(d), parts[-1]

    @_routed()
    def exists(self, path: PathLike) -> bool:
        try:
            self.resolve(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    @_routed()
    def stat(self, path: PathLike) -> NodeStat:
        node = self.attrs(self.resolve(path))
        return NodeStat(
            node.fmt | node.mode,
            node.ino,
            self.nlink(node),
            node.uid,
            node.gid,
            node.size,
            node.atime_ns,
            node.mtime_ns,
            node.ctime_ns,
            self.blocks(node),
        )

    @_routed()
    def listdir(self, path: PathLike = b"") -> list[Any]:
        d = self.resolve(path)
        if d.fmt != S_IFDIR:
            raise _err(errno.ENOTDIR, os.fsdecode(path))
        names = sorted(self._load(d))
        return names if isinstance(path, bytes) else [os.fsdecode(n) for n in names]

    @_routed()
    def read_file(self, path: PathLike) -> bytes:
        node = self.resolve(path)
        if node.fmt != S_IFREG:
            raise _err(errno.EISDIR if node.fmt == S_IFDIR else errno.EINVAL, os.fsdecode(path))
        h = self.open(node.ino, os.O_RDONLY)
        try:
            chunks: list[bytes] = []
            off = 0
            while True:
                piece = self.read(h, off, 1 << 20)
                if not piece:
                    return b"".join(chunks)
                chunks.append(piece)
                off += len(piece)
        finally:
            self.release(h.fh)

    @_routed()
    def write_file(self, path: PathLike, data: bytes, mode: int = 0o644) -> None:
        """Create or replace the file at ``path`` (its directory must exist)."""
        d, kids, name = self._parent(path)
        pid = os.getpid()
        node = kids.get(name)
        limit = self.scratch_limit
        if limit is not None:
            # Checked before anything changes, so a refused write leaves the file as it was.
            freed = node.size if node is not None and node.fmt == S_IFREG and (
                node.src == SRC_SCRATCH) else 0
            if self.scratch_bytes - freed + len(data) > limit:
                raise _limit_reached()
        if node is not None and node.lookups and node.fmt == S_IFREG and self._mount is not None:
            # A mount's kernel trusts the size it cached for a file over ours (writeback
            # cache), so a file it knows is replaced by a new inode, as a restore does.
            mode = node.mode
            self.unlink(d.ino, name, pid)
            self._inval.append(("entry", d.ino, name))
            node = None
        if node is None:
            h, node = self.create(d.ino, name, mode, os.O_WRONLY, pid=pid)
            self._added_behind_kernel(d, name)
        else:
            h = self.open(node.ino, os.O_WRONLY | os.O_TRUNC, pid)
            self._changed_behind_kernel(node)
        try:
            off = 0
            view = memoryview(data)
            while off < len(view):
                off += self.write(h, off, view[off : off + (1 << 20)])
            self._keep_image(node, data)
        finally:
            self.release(h.fh)

    @_routed()
    def mkdir(
        self, path: PathLike, mode: int = 0o755, *, parents: bool = False, exist_ok: bool = False
    ) -> None:
        parts = _split(path)
        node = self.root
        pid = os.getpid()
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            child = self._load(node).get(part)
            if child is None:
                if not (last or parents):
                    raise _err(errno.ENOENT, os.fsdecode(path))
                child = self.mkdir_in(node.ino, part, mode, pid=pid)
                self._added_behind_kernel(node, part)
            elif last and not exist_ok:
                raise _err(errno.EEXIST, os.fsdecode(path))
            elif child.fmt != S_IFDIR:
                raise _err(errno.ENOTDIR, os.fsdecode(path))
            node = child

    @_routed()
    def delete(self, path: PathLike, *, recursive: bool = False) -> None:
        d, kids, name = self._parent(path)
        node = kids.get(name)
        if node is None:
            raise _err(errno.ENOENT, os.fsdecode(path))
        pid = os.getpid()
        if d.lookups:
            self._inval.append(("entry", d.ino, name))
        self._changed_behind_kernel(d)
        if node.fmt != S_IFDIR:
            self.unlink(d.ino, name, pid)
            return
        if recursive:
            for child_name in list(self._load(node)):
                self.delete(os.fsencode(path) + b"/" + child_name, recursive=True)
        self.rmdir(d.ino, name, pid)

    def _added_behind_kernel(self, d: Node, name: bytes) -> None:
        """As `_changed_behind_kernel` for directory ``d``, which gained ``name``: the kernel
        may also hold that name as missing (see shadowfs.fuse)."""
        if d.lookups and self._mount is not None:
            self._inval.append(("entry", d.ino, name))
        self._changed_behind_kernel(d)

    def _changed_behind_kernel(self, node: Node) -> None:
        """Queue dropping the kernel's cached attributes and pages (a directory's: its
        listing) of ``node``, changed by a path-level call rather than through the mount."""
        if node.lookups and self._mount is not None:
            self._inval.append(("inode", node.ino, False))

    def walk(self) -> Iterator[tuple[bytes, Node]]:
        """Every (path, node) in the layer, depth first (loads every directory)."""
        stack = [(b"", self.root)]
        while stack:
            prefix, d = stack.pop()
            for name, child in sorted(self._load(d).items()):
                path = prefix + b"/" + name if prefix else name
                yield path, child
                if child.fmt == S_IFDIR:
                    stack.append((path, child))
