"""The copy-on-write layer on kernel OverlayFS: the fast path for heavy workloads.

The kernel does the copy-on-write; this module only reads and rewrites the upper directory:

- ``snapshot()`` harvests the upper directory (copied-up files and symlinks, whiteouts, opaque
  directories) and combines it with the base tree by path copying: only directories present in
  the upper directory get new tree objects, every other sub-tree keeps its base id. A stat cache
  (inode, size, mtime, ctime) from the previous snapshot spares re-hashing unchanged upper files.
- ``restore(tree_id)`` freezes the mount's users, rewrites the upper directory to represent
  diff(base, target) and makes the kernel forget what it cached (see docs/overlay-backend.md for
  exactly what a process that keeps running observes).

The mount uses ``redirect_dir=off`` and ``metacopy=off`` so every change is spelled out in the
upper directory itself (renaming a lower directory then fails with EXDEV and tools fall back to
copying, as on fuse-overlayfs), and ``index=off`` so a remount over the same upper is allowed.

It also uses ``volatile``: the kernel skips every sync to the upper directory, the fsync after
each copy-up included (half the cost of copying up a big file). The upper directory is scratch,
never the durability point: snapshots are (the store's flush), and commit and pending booths
work from the snapshot's tree, never from the upper directory, just as the FUSE backend answers
``fsync`` without writing. After a machine crash the kernel refuses to remount such an upper
directory, and nothing needs it to: the booth dir is thrown away.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import signal
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

from shadowfs.errors import ShadowfsError, TreeError
from shadowfs.libc import libc as _libc
from shadowfs.oid import ObjectId
from shadowfs.privacy import make_private_dirs
from shadowfs.removal import remove_tree
from shadowfs.tree import (
    DIR,
    FILE,
    FMT_SPECIAL,
    MAX_DEPTH,
    MODE_MASK,
    SPECIALS,
    SYMLINK,
    Entry,
    build_tree,
    entry_record,
    make_special,
    records_version,
    stat_entry,
)

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader, ObjectStore
from shadowfs.tree import entries as _tree_entries
from shadowfs.tree import pack_entries as _pack_sorted_entries
from shadowfs.tree import packed_bytes as _packed_bytes
from shadowfs.tree import remember as _remember_tree

_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
# Like the FUSE layer: an agent's setuid copy or device node is inert through the mount, even
# through an fd it hands to a process outside the booth. A remount must repeat them (a remount
# without them clears them).
_MOUNT_FLAGS = _MS_NOSUID | _MS_NODEV
_MS_BIND = 4096
_MS_PRIVATE = 1 << 18
_MNT_DETACH = 2
# Not exported by the time module; the coarse clock is the one the kernel stamps ctimes with.
_CLOCK_REALTIME_COARSE = 5

_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_FREEZE_WAIT_S = 5.0


class OverlayError(ShadowfsError):
    pass


class _Stat(NamedTuple):
    """What proves an upper file unchanged since it was hashed."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    oid: ObjectId
    entry: Entry  # the file's tree entry, its record encoded: the same while the stat is


@dataclass
class SnapshotStats:
    """What the last snapshot did: hashed files were read, cache hits were trusted by stat."""

    hashed: int = 0
    cache_hits: int = 0
    upper_dirs: int = 0
    trees_written: int = 0


@dataclass
class RestoreStats:
    """What the last restore did, and how the kernel was made to forget its caches."""

    written: int = 0
    removed: int = 0
    whiteouts: int = 0
    frozen: int = 0
    # "offline" (not mounted) or "in-place" (the upper rewritten under the live mount, then an
    # MS_REMOUNT to shrink the mount's dentry cache).
    method: str = ""


def _coarse_now() -> int:
    return time.clock_gettime_ns(_CLOCK_REALTIME_COARSE)


def _mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int,
           data: bytes | None) -> None:
    if _libc.mount(source, target, fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(target))


def _umount(target: bytes, flags: int = 0) -> None:
    if _libc.umount2(target, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(target))


def _join(prefix: bytes, name: bytes) -> bytes:
    return prefix + b"/" + name if prefix else name


def _entries(store: ObjectReader, oid: ObjectId | None) -> dict[bytes, Entry]:
    """A tree's entries by name: the tree cache's own dict, so read only (a snapshot visits
    every upper directory, and a copy of its base listing cost most of a visit)."""
    if oid is None:
        return {}
    return _tree_entries(store, oid)


class OverlayLayer:
    """A kernel overlay mount of ``base`` whose changes live under ``booth_dir``.

    ``base`` is read, never written. ``booth_dir`` (created; it must be absent or empty, on a file
    system with nanosecond timestamps such as ext4, xfs, btrfs or tmpfs, and outside ``base``)
    holds ``upper/``, ``work/``, a ``tmp/`` for staging restores and, when needed, ``lower/``, a
    private bind of the base. ``base_tree`` is the tree id of ``base``; when omitted it is built
    now. With ``userxattr`` the mount uses ``user.overlay.*`` xattrs (a user namespace); with
    ``cgroup`` (a cgroup v2 directory holding every user of the mount) restore freezes that cgroup
    instead of stopping processes one by one.
    """

    def __init__(
        self,
        base: str | os.PathLike[str],
        store: ObjectStore,
        booth_dir: str | os.PathLike[str],
        base_tree: ObjectId | None = None,
        *,
        userxattr: bool = False,
        cgroup: str | os.PathLike[str] | None = None,
    ) -> None:
        self.base = os.fsencode(os.path.realpath(base))
        self.store = store
        self.booth_dir = os.fsencode(os.path.abspath(booth_dir))
        self.userxattr = userxattr
        self.cgroup = os.fsencode(cgroup) if cgroup is not None else None
        self._xattr = b"user.overlay." if userxattr else b"trusted.overlay."
        if not os.path.isdir(self.base):
            raise OverlayError(f"base {os.fsdecode(self.base)!r} is not a directory; pass the "
                               "working tree to layer over")
        real_booth = os.fsencode(os.path.realpath(booth_dir))
        if real_booth == self.base or real_booth.startswith(self.base + b"/"):
            raise OverlayError(f"booth dir {os.fsdecode(real_booth)!r} lies inside the base "
                               f"{os.fsdecode(self.base)!r}; overlayfs refuses overlapping "
                               "layers, so put the booth dir elsewhere")
        for bad in (b",", b":", b"\\"):
            if bad in self.booth_dir:
                raise OverlayError(f"booth dir {os.fsdecode(self.booth_dir)!r} contains "
                                   f"{bad.decode()!r}, which overlay mount options cannot carry; "
                                   "choose a plainer path")
        make_private_dirs(os.fsdecode(self.booth_dir))  # it will hold the agent's files
        if os.listdir(self.booth_dir):
            raise OverlayError(f"booth dir {os.fsdecode(self.booth_dir)!r} is not empty; pass an "
                               "absent or empty directory")
        self.upper = self.booth_dir + b"/upper"
        self.work = self.booth_dir + b"/work"
        self.tmp = self.booth_dir + b"/tmp"
        self._lower_bind = self.booth_dir + b"/lower"
        for d in (self.upper, self.work, self.tmp):
            os.mkdir(d, 0o700)
        # The merged root takes its attributes from the upper root.
        st = os.stat(self.base)
        os.chmod(self.upper, stat.S_IMODE(st.st_mode))
        if os.geteuid() == 0:
            os.chown(self.upper, st.st_uid, st.st_gid)
        os.utime(self.upper, ns=(st.st_atime_ns, st.st_mtime_ns))
        self.base_tree: ObjectId = (
            base_tree if base_tree is not None else build_tree(store, self.base)
        )
        self.mountpoint: bytes | None = None
        self._lowerdir = self.base
        self._bound = False
        self._staged = 0
        # Hard-link key -> the upper path a restore wrote the group's first name at; and the
        # upper inodes restores made for groups -> their keys, which snapshots then keep.
        self._restore_links: dict[int, bytes] = {}
        self._link_keys: dict[tuple[int, int], int] = {}
        self._cache: dict[bytes, _Stat] = {}
        self._dir_cache: dict[bytes, tuple[tuple[object, ...], ObjectId]] = {}
        # Upper directories' opacity by path: (inode, ctime, opaque), as of the last snapshot.
        self._opaque_cache: dict[bytes, tuple[int, int, bool]] = {}
        self._new_opaque: dict[bytes, tuple[int, int, bool]] = {}
        self.last_tree: ObjectId = self.base_tree
        self.snapshot_stats = SnapshotStats()
        self.restore_stats = RestoreStats()

    # --- mounting -----------------------------------------------------------------------------

    def _options(self) -> bytes:
        opts = [b"lowerdir=" + self._lowerdir, b"upperdir=" + self.upper, b"workdir=" + self.work,
                b"volatile"]
        if self.userxattr:
            opts.append(b"userxattr")
        else:
            opts += [b"redirect_dir=off", b"metacopy=off", b"index=off"]
        return b",".join(opts)

    def mount(self, mountpoint: str | os.PathLike[str]) -> None:
        """Mount the overlay at ``mountpoint`` (which may be the base path itself)."""
        if self.mountpoint is not None:
            raise OverlayError(f"the layer is already mounted at {os.fsdecode(self.mountpoint)!r}; "
                               "unmount it first")
        mp = os.fsencode(os.path.realpath(mountpoint))
        needs_bind = mp == self.base or any(c in self.base for c in (b",", b":", b"\\"))
        if needs_bind and not self._bound:
            # Once the overlay covers the base's own path the base must stay reachable for
            # remounts and commit: a private bind under the booth dir keeps it so.
            os.mkdir(self._lower_bind, 0o700)
            _mount(self.base, self._lower_bind, None, _MS_BIND, None)
            _mount(None, self._lower_bind, None, _MS_PRIVATE, None)
            self._bound = True
            self._lowerdir = self._lower_bind
        try:
            _mount(b"overlay", mp, b"overlay", _MOUNT_FLAGS, self._options())
        except OSError as exc:
            raise OverlayError(f"cannot mount overlay at {os.fsdecode(mp)!r} ({exc.strerror}); "
                               "it needs root (or userxattr in a user namespace) and an existing "
                               "directory as mount point") from None
        self.mountpoint = mp

    @property
    def lower_path(self) -> bytes:
        """Where the untouched base is reachable while the overlay covers it."""
        return self._lowerdir

    def unmount(self, lazy: bool = False) -> None:
        """Unmount the overlay; the layer's state stays in the booth dir for snapshot/commit."""
        if self.mountpoint is None:
            return
        try:
            _umount(self.mountpoint, _MNT_DETACH if lazy else 0)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            raise OverlayError(f"cannot unmount {os.fsdecode(self.mountpoint)!r}: processes still "
                               "use it; stop them first or unmount lazily") from None
        self.mountpoint = None

    def _unbind(self) -> None:
        if self._bound:
            with contextlib.suppress(OSError):
                _umount(self._lower_bind, _MNT_DETACH)
            self._bound = False
            self._lowerdir = self.base

    @contextlib.contextmanager
    def mounted(self, mountpoint: str | os.PathLike[str]) -> Iterator[OverlayLayer]:
        """``with layer.mounted(path):`` mounted inside, discarded on the way out (zero
        residue, whatever happened inside)."""
        self.mount(mountpoint)
        try:
            yield self
        finally:
            self.discard()

    def discard(self, *, keep_files: bool = False) -> None:
        """Throw the layer away: unmount, remove the booth dir entirely (with ``keep_files``,
        leave it for the caller to free later); the base is untouched."""
        if self.mountpoint is not None:
            try:
                self.unmount()
            except OverlayError:
                self.unmount(lazy=True)
        self._unbind()
        if not keep_files and os.path.lexists(self.booth_dir):
            remove_tree(self.booth_dir)  # however deep the agent nested its files
        self._cache.clear()
        self._dir_cache.clear()
        self._opaque_cache.clear()

    def commit(self, journal_dir: str | os.PathLike[str]) -> ObjectId:
        """Snapshot, unmount and apply the layer to the base crash-safely; return the new tree."""
        from shadowfs.commit import apply  # the commit module is optional for mount-only users

        tree = self.snapshot()
        self.unmount()
        self._unbind()
        apply(self.store, os.fsdecode(self.base), self.base_tree, tree, journal_dir=journal_dir)
        return tree

    # --- snapshot -----------------------------------------------------------------------------

    def snapshot(self) -> ObjectId:
        """The tree id of base + layer now.

        Cost follows the upper dir: one stat per upper entry; a file is read only when its stat
        changed since the previous snapshot, and a directory whose upper entries all kept their
        stat keeps its tree id without re-encoding the merged listing. Processes may keep
        writing meanwhile; a file changing during the harvest is captured as of its read and
        read again at the next snapshot (its ctime moved)."""
        self.snapshot_stats = SnapshotStats()
        cutoff = _coarse_now()
        new_cache: dict[bytes, _Stat] = {}
        new_dirs: dict[bytes, tuple[tuple[object, ...], ObjectId]] = {}
        self._new_opaque = {}
        tree = self._harvest(self.upper, b"", self.base_tree, False, cutoff, new_cache, new_dirs)
        self._cache = new_cache
        self._dir_cache = new_dirs
        self._opaque_cache, self._new_opaque = self._new_opaque, {}
        self.last_tree = tree
        return tree

    def _opaque(self, path: bytes) -> bool:
        try:
            return os.getxattr(path, self._xattr + b"opaque", follow_symlinks=False) == b"y"
        except OSError:
            return False

    def _opaque_known(self, path: bytes, rel: bytes, st: os.stat_result, cutoff: int) -> bool:
        """`_opaque`, without asking again while the directory keeps its inode and ctime
        (setting the xattr moves the ctime). Not trusted for a ctime in the current coarse
        tick, as for files: a directory removed and made again within it could repeat both."""
        known = self._opaque_cache.get(rel)
        if known is not None and known[0] == st.st_ino and known[1] == st.st_ctime_ns:
            opaque = known[2]
        else:
            opaque = self._opaque(path)
        if st.st_ctime_ns < cutoff:
            self._new_opaque[rel] = (st.st_ino, st.st_ctime_ns, opaque)
        return opaque

    def _harvest(
        self,
        upath: bytes,
        rel: bytes,
        base_oid: ObjectId | None,
        opaque: bool,
        cutoff: int,
        new_cache: dict[bytes, _Stat],
        new_dirs: dict[bytes, tuple[tuple[object, ...], ObjectId]],
    ) -> ObjectId:
        stats = self.snapshot_stats
        stats.upper_dirs += 1
        if rel and rel.count(b"/") >= MAX_DEPTH:
            # The kernel let the agent nest this deep; a tree cannot hold it (tree.MAX_DEPTH).
            raise TreeError(
                f"the booth nests directories deeper than {MAX_DEPTH} levels (at "
                f"{os.fsdecode(rel[:80])!r}...), more than a tree records: flatten them"
            )
        # The base listing only when needed (a subdirectory, or a rebuild): most upper
        # directories hold files only and keep their tree.
        base: dict[bytes, Entry] | None = {} if opaque or base_oid is None else None
        # First the upper entries' stats (and sub-trees): together with the lower tree they
        # decide this directory's tree, so an unchanged signature means an unchanged id.
        children: list[tuple[bytes, os.stat_result, ObjectId | None]] = []
        sig: list[object] = [base_oid, opaque]
        with os.scandir(upath) as it:
            for de in it:
                name = de.name  # bytes, as upath is
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                sub = None
                if stat.S_ISDIR(st.st_mode):
                    path = upath + b"/" + name
                    sub_rel = _join(rel, name)
                    sub_opaque = self._opaque_known(path, sub_rel, st, cutoff)
                    if base is None:
                        base = _entries(self.store, base_oid)
                    below = base.get(name)
                    sub_base = below.oid if below is not None and below.kind == DIR else None
                    sub = self._harvest(
                        path,
                        sub_rel,
                        None if sub_opaque else sub_base,
                        sub_opaque,
                        cutoff,
                        new_cache,
                        new_dirs,
                    )
                children.append((name, st, sub))
                sig.append(
                    (name, st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sub)
                )
        signature = tuple(sig)
        cached = self._dir_cache.get(rel)
        if cached is not None and cached[0] == signature:
            prefix = _join(rel, b"")
            files = [prefix + name for name, st, _sub in children if stat.S_ISREG(st.st_mode)]
            if all(r in self._cache for r in files):
                for r in files:
                    new_cache[r] = self._cache[r]
                stats.cache_hits += len(files)
                new_dirs[rel] = cached
                return cached[1]
        if base is None:
            base = _entries(self.store, base_oid)
        entries = dict(base)
        trusted = True
        added = False  # a name the base lacks: the base's name order no longer holds
        for name, st, sub in children:
            if not added and name not in base:
                added = True
            fmt = stat.S_IFMT(st.st_mode)
            if fmt == stat.S_IFREG:
                r = _join(rel, name)
                e = self._file(upath + b"/" + name, r, name, st, cutoff, new_cache)
                if e is None:
                    entries.pop(name, None)
                else:
                    entries[name] = e
                trusted = trusted and r in new_cache
            elif fmt == stat.S_IFDIR:
                entries[name] = stat_entry(name, DIR, st, sub)
            elif fmt == stat.S_IFLNK:
                try:
                    target = os.readlink(upath + b"/" + name)
                except FileNotFoundError:
                    entries.pop(name, None)
                    trusted = False
                    continue
                entries[name] = stat_entry(name, SYMLINK, st, None, target)
            elif _is_whiteout(st):
                entries.pop(name, None)  # deletes the lower entry
            elif fmt in FMT_SPECIAL:
                entries[name] = self._linked(stat_entry(name, FMT_SPECIAL[fmt], st, None), st)
            else:
                entries.pop(name, None)
        # Every entry is valid by construction (decoded lower entries, names and stats from the
        # upper file system), so encode_tree's per-entry checks -- half the cost of a large
        # directory -- are skipped; only the order must be restored.
        if added:
            ordered = sorted(entries.values(), key=attrgetter("name"))
            entries = {e.name: e for e in ordered}
        else:
            ordered = list(entries.values())  # the base's order: replaced and removed names only
        # The base's version holds unless an upper entry changes it: no pass over the rest.
        previous = b"\x01" if base_oid is None or opaque else _packed_bytes(base_oid)
        upper = [entry_record(e) for name, _st, _sub in children if (e := entries.get(name))]
        version = records_version(upper, previous)
        oid = self.store.put("tree", _pack_sorted_entries(ordered, version))
        # Kept decoded, sharing the base's Entry objects for unchanged names: a restore to this
        # tree then tells them apart from the base by identity, without decoding it.
        _remember_tree(oid, entries)
        stats.trees_written += 1
        if trusted:
            # The signature stands for the contents only when no file in it was racily clean.
            new_dirs[rel] = (signature, oid)
        return oid

    def _file(self, path: bytes, rel: bytes, name: bytes, st: os.stat_result, cutoff: int,
              new_cache: dict[bytes, _Stat]) -> Entry | None:
        c = self._cache.get(rel)
        if (c is not None and c.ino == st.st_ino and c.size == st.st_size
                and c.mtime_ns == st.st_mtime_ns and c.ctime_ns == st.st_ctime_ns):
            self.snapshot_stats.cache_hits += 1
            new_cache[rel] = c
            return c.entry
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return None
        listed = st
        try:
            if _may_have_writers(fd):
                _write_protect(fd)
            # The stat taken before reading goes into the entry and the cache, so a write racing
            # the read leaves a newer ctime behind and the next snapshot reads the file again.
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            oid = self.store.put_file(fd)
        finally:
            os.close(fd)
        self.snapshot_stats.hashed += 1
        e = self._linked(stat_entry(name, FILE, st, oid), st)
        # Trusted next time only if nothing happened to the file between the listing's stat and
        # this one: a write fault in between could have left a writable mapping behind whose
        # later writes move no ctime (see `_write_protect`); it is read again next time.
        # A ctime in the current coarse tick could repeat for a write still to come in the same
        # tick ("racily clean"); such files are hashed again next time too.
        if (st.st_ctime_ns < cutoff and st.st_ino == listed.st_ino
                and st.st_ctime_ns == listed.st_ctime_ns):
            new_cache[rel] = _Stat(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, oid, e)
        return e

    def _linked(self, e: Entry, st: os.stat_result) -> Entry:
        """``e`` with the key a restore gave its upper inode's group, if it made that inode."""
        if e.link and (st.st_dev, st.st_ino) in self._link_keys:
            return e.replace(link=self._link_keys[st.st_dev, st.st_ino])
        return e

    # --- restore ------------------------------------------------------------------------------

    def restore(self, tree_id: ObjectId) -> None:
        """Bring the mount to the state of ``tree_id`` (any tree; normally an earlier snapshot).

        The mount's users are frozen meanwhile; the upper dir is rewritten under the live mount
        and an MS_REMOUNT makes the kernel drop the mount's unused cached dentries, so the next
        open or stat by any process sees the restored state. Unmounting instead would sync the
        upper file system (milliseconds) and, while unmounted, show whatever lies beneath the
        mount point -- the real tree, when the overlay covers the base's own path."""
        self.restore_stats = RestoreStats()
        if self.mountpoint is None:
            self.restore_stats.method = "offline"
            self._rewrite(tree_id, None)
        else:
            with self._frozen():
                self.restore_stats.method = "in-place"
                mp = self.mountpoint
                try:
                    self._rewrite(tree_id, mp)
                finally:
                    _mount(None, mp, None, _MS_REMOUNT | _MOUNT_FLAGS, None)
        self.last_tree = tree_id

    def _rewrite(self, tree_id: ObjectId, live: bytes | None) -> None:
        if live is not None:
            # A directory that exists only in the lower layer gets its upper twin through the
            # mount itself, so the kernel's (possibly pinned: a cwd) dentry learns of it; a
            # directory created behind the kernel's back would stay invisible through it.
            for rel in self._plan_copy_ups(self.upper, b"", self.base_tree, tree_id):
                path = live + b"/" + rel
                st = os.lstat(path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
        self._dir_cache.clear()
        self._opaque_cache.clear()
        self._restore_links = {}
        self._sync_dir(self.upper, b"", self.base_tree, tree_id, False)
        for key, path in self._restore_links.items():
            st = os.lstat(path)
            self._link_keys[st.st_dev, st.st_ino] = key

    def _plan_copy_ups(self, upath: bytes, rel: bytes, base_oid: ObjectId | None,
                       target_oid: ObjectId) -> Iterator[bytes]:
        if base_oid == target_oid:
            return
        base = _entries(self.store, base_oid)
        target = _entries(self.store, target_oid)
        for name in _changed_names(base, target):
            b, t = base.get(name), target[name]
            if t.kind != DIR or b is None or b.kind != DIR or b == t:
                continue
            path = upath + b"/" + name
            r = _join(rel, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                yield r
                # a file or directory entry has an oid (only a symlink's is None)
                yield from self._plan_copy_ups(path, r, b.oid, t.oid)  # type: ignore[arg-type]
                continue
            if stat.S_ISDIR(st.st_mode) and not self._opaque(path):
                # a file or directory entry has an oid (only a symlink's is None)
                yield from self._plan_copy_ups(path, r, b.oid, t.oid)  # type: ignore[arg-type]

    def _sync_dir(self, upath: bytes, rel: bytes, base_oid: ObjectId | None,
                  target_oid: ObjectId, opaque: bool) -> None:
        """Make the upper dir ``upath`` say "target" on top of lower ``base_oid``."""
        base = {} if opaque else _entries(self.store, base_oid)
        target = _entries(self.store, target_oid)
        existing: dict[bytes, os.stat_result] = {}
        with os.scandir(upath) as it:
            for de in it:
                existing[de.name] = de.stat(follow_symlinks=False)  # bytes, as upath is
        # A name with no upper entry whose target entry is the base's needs nothing, and those
        # are most of a directory: visit the upper entries and the names the target changes.
        names = existing.keys() | _changed_names(base, target) | (base.keys() - target.keys())
        for name in names:
            b, t, x = base.get(name), target.get(name), existing.get(name)
            if x is None and b is not None and b == t:
                continue
            self._sync_entry(upath, _join(rel, name), name, b, t, x)

    def _sync_entry(self, upath: bytes, rel: bytes, name: bytes, b: Entry | None,
                    t: Entry | None, x: os.stat_result | None) -> None:
        path = upath + b"/" + name
        if t is None:
            if b is None:
                if x is not None:
                    self._remove(path, rel, x)
            elif x is None or not _is_whiteout(x):
                if x is not None:
                    self._remove(path, rel, x)
                os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))
                self.restore_stats.whiteouts += 1
            return
        if t.kind == DIR:
            if x is not None and stat.S_ISDIR(x.st_mode):
                # An existing upper dir is kept (a frozen process may sit in it), and so is its
                # opacity: an opaque dir is simply filled with the whole target sub-tree.
                opaque = self._opaque(path)
            elif b is not None and b == t:
                if x is not None:
                    self._remove(path, rel, x)
                return
            else:
                if x is not None:
                    self._remove(path, rel, x)
                os.mkdir(path, 0o700)
                self._own(path, rel)
                opaque = False
            lower = b.oid if b is not None and b.kind == DIR and not opaque else None
            # a file or directory entry has an oid (only a symlink's is None)
            self._sync_dir(path, rel, lower, t.oid, opaque)  # type: ignore[arg-type]
            os.chmod(path, t.mode)
            os.utime(path, ns=(t.mtime_ns, t.mtime_ns))
            return
        if b is not None and b == t:
            if x is not None:
                self._remove(path, rel, x)
            return
        if t.link:
            # A hard link: the group's first name written by this restore is its inode.
            first = self._restore_links.setdefault(t.link, path)
            if first != path:
                if x is None or x.st_ino != os.lstat(first).st_ino:
                    staged = self._staging_name()
                    os.link(first, staged, follow_symlinks=False)
                    self._replace(staged, path, rel, x)
                return
        if t.kind == FILE:
            c = self._cache.get(rel)
            if (x is not None and stat.S_ISREG(x.st_mode) and c is not None and c.oid == t.oid
                    and c.ino == x.st_ino and c.size == x.st_size
                    and c.mtime_ns == x.st_mtime_ns and c.ctime_ns == x.st_ctime_ns):
                if x.st_mode & MODE_MASK != t.mode:
                    os.chmod(path, t.mode)
                if x.st_mtime_ns != t.mtime_ns:
                    os.utime(path, ns=(t.mtime_ns, t.mtime_ns))
                self._cache.pop(rel, None)
                return
            self._write_file(path, rel, t, x)
            return
        if t.kind in SPECIALS:
            staged = self._staging_name()
            tmp_dir, _, tmp_name = staged.rpartition(b"/")
            fd = os.open(tmp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                make_special(t, tmp_name, fd)
                os.utime(tmp_name, ns=(t.mtime_ns, t.mtime_ns), dir_fd=fd, follow_symlinks=False)
            finally:
                os.close(fd)
            self._own(staged, rel)
            self._replace(staged, path, rel, x)
            return
        # A symlink.
        if x is not None and stat.S_ISLNK(x.st_mode) and os.readlink(path) == t.target:
            if x.st_mtime_ns != t.mtime_ns:
                os.utime(path, ns=(t.mtime_ns, t.mtime_ns), follow_symlinks=False)
            return
        staged = self._staging_name()
        # a symlink always has a target (Entry.target is None for the other kinds)
        os.symlink(t.target, staged)  # type: ignore[arg-type]
        os.utime(staged, ns=(t.mtime_ns, t.mtime_ns), follow_symlinks=False)
        self._replace(staged, path, rel, x)

    def _write_file(self, path: bytes, rel: bytes, t: Entry, x: os.stat_result | None) -> None:
        staged = self._staging_name()
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as f:
            # a file or directory entry has an oid (only a symlink's is None)
            self.store.read_file_into(t.oid, f)  # type: ignore[arg-type]
            f.flush()
            self._own(staged, rel, fd=fd)
            os.fchmod(fd, t.mode)
            os.utime(fd, ns=(t.mtime_ns, t.mtime_ns))
        self._replace(staged, path, rel, x)
        self.restore_stats.written += 1

    def _replace(self, staged: bytes, path: bytes, rel: bytes, x: os.stat_result | None) -> None:
        if x is not None and stat.S_ISDIR(x.st_mode):
            self._remove(path, rel, x)
        os.rename(staged, path)
        # Written now, so its ctime is in this tick: the next snapshot reads it again.
        self._cache.pop(rel, None)

    def _staging_name(self) -> bytes:
        self._staged += 1
        return b"%s/r%d" % (self.tmp, self._staged)

    def _remove(self, path: bytes, rel: bytes, x: os.stat_result) -> None:
        if stat.S_ISDIR(x.st_mode):
            remove_tree(path)
            prefix = rel + b"/"
            for k in [k for k in self._cache if k.startswith(prefix)]:
                del self._cache[k]
        else:
            os.unlink(path)
        self._cache.pop(rel, None)
        self.restore_stats.removed += 1

    def _own(self, path: bytes, rel: bytes, fd: int | None = None) -> None:
        """Give a restored entry the owner of the lower entry it shadows (else of its parent):
        trees keep no owners, and files created by root would otherwise surprise the agent."""
        if os.geteuid() != 0:
            return
        try:
            st = os.lstat(self._lowerdir + b"/" + rel)
        except OSError:
            parent = rel.rpartition(b"/")[0]
            st = os.lstat(self.upper + b"/" + parent if parent else self.upper)
        if fd is not None:
            os.fchown(fd, st.st_uid, st.st_gid)
        else:
            os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)

    # --- freezing the mount's users -----------------------------------------------------------

    @contextlib.contextmanager
    def _frozen(self) -> Iterator[None]:
        if self.cgroup is not None and os.path.exists(self.cgroup + b"/cgroup.freeze"):
            with _cgroup_frozen(self.cgroup):
                with open(self.cgroup + b"/cgroup.procs", "rb") as f:
                    self.restore_stats.frozen = len(f.read().split())
                yield
            return
        assert self.mountpoint is not None
        stopped: list[int] = []
        try:
            _stop_users(self.mountpoint, stopped)
            self.restore_stats.frozen = len(stopped)
            yield
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def _cgroup_frozen(cgroup: bytes) -> Iterator[None]:
    with open(cgroup + b"/cgroup.freeze", "w") as f:
        f.write("1")
    try:
        deadline = time.monotonic() + _FREEZE_WAIT_S
        while time.monotonic() < deadline:
            with open(cgroup + b"/cgroup.events") as ev:
                if "frozen 1" in ev.read():
                    break
            time.sleep(0.001)
        else:
            raise OverlayError(f"cgroup {os.fsdecode(cgroup)!r} did not freeze within "
                               f"{_FREEZE_WAIT_S:.0f} s; a task is stuck in the kernel, retry "
                               "later")
        yield
    finally:
        with open(cgroup + b"/cgroup.freeze", "w") as f:
            f.write("0")


def _changed_names(base: dict[bytes, Entry], target: dict[bytes, Entry]) -> set[bytes]:
    """Names whose entry in ``target`` is not the very entry of ``base`` (new ones included).

    Trees built from one another share their unchanged Entry objects (a snapshot remembers its
    trees decoded), so one identity test per name settles most of a directory at C speed; an
    entry equal but not shared is returned too, for the caller to compare."""
    base_get = base.get
    return {n for n, t in target.items() if base_get(n) is not t}


def _may_have_writers(fd: int) -> bool:
    """Whether the file may be open for writing, or mapped from such an open, by anyone.

    A read lease is refused (EAGAIN) exactly when the file is open for writing somewhere, and a
    mapping keeps its open file alive after its descriptor is closed. Without writers no
    mapping can write, so there is nothing to write-protect (`_write_protect`, ten times the
    cost). The lease is dropped at once; a process opening the file for writing meanwhile
    waits those microseconds, and the break is signalled with SIGURG, which is ignored unless
    handled, instead of SIGIO, which would end this process. Any other refusal (no lease
    support, not the file's owner) counts as "may have writers"."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:
        return True
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return False


def _write_protect(fd: int) -> None:
    """Start writeback of the file's dirty pages, which write-protects every mapping of them.

    A write through a shared mapping updates the file's ctime only when it faults, on the first
    write to a clean page; later writes to the same dirty page leave no trace a stat could see.
    A file with writers is read by a snapshot only after this, so its next write through any
    mapping faults and moves the ctime, and the stat cache cannot trust stale content. Pages
    already under writeback are waited for first (they could have been dirtied again without a
    fault since). The writes themselves go on in the background."""
    if _libc.sync_file_range(
        fd, 0, 0, _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE
    ) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ESPIPE):  # not a file with pages: nothing mapped
            raise OSError(err, os.strerror(err))


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _uses(pid: str, prefix: str, root: str) -> bool:
    """Whether process ``pid`` has its cwd, root, executable, an open fd or a mapping (a shared
    library, say) under the mount. Reading every process's maps is most of the scan's cost;
    a cgroup makes freezing O(1) instead."""
    base = f"/proc/{pid}/"
    for link in ("cwd", "root", "exe"):
        with contextlib.suppress(OSError):
            t = os.readlink(base + link)
            if t == root or t.startswith(prefix):
                return True
    with contextlib.suppress(OSError):
        for fd in os.listdir(base + "fd"):
            with contextlib.suppress(OSError):
                t = os.readlink(base + "fd/" + fd)
                if t == root or t.startswith(prefix):
                    return True
    # A mapping's path follows the columns, after spaces: enough to spot the mount's prefix.
    with contextlib.suppress(OSError), open(base + "maps", "rb") as f:
        return b" " + os.fsencode(prefix) in f.read()
    return False


def _stopped(pid: str) -> bool:
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
            if state not in (b"T", b"t", b"Z", b"X"):
                return False
    except (FileNotFoundError, ProcessLookupError):
        return True
    return True


def _stop_users(mountpoint: bytes, stopped: list[int]) -> None:
    """SIGSTOP every process using the mount, until a scan finds no new one (a process may fork
    between scans), and wait until each is really stopped."""
    root = os.fsdecode(mountpoint)
    prefix = root.rstrip("/") + "/"
    me = os.getpid()
    seen: set[int] = set()
    while True:
        found = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            pid = int(d)
            if pid == me or pid in seen:
                continue
            if _uses(d, prefix, root):
                seen.add(pid)
                if _stopped(d):
                    continue  # stopped by someone else: leave it for them to continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                    found.append(d)
        deadline = time.monotonic() + _FREEZE_WAIT_S
        for d in found:
            while not _stopped(d):
                if time.monotonic() > deadline:
                    raise OverlayError(f"process {d} using {root!r} did not stop within "
                                       f"{_FREEZE_WAIT_S:.0f} s; it is stuck in the kernel, "
                                       "retry later")
                time.sleep(0.0005)
        if not found:
            return


__all__ = ["OverlayError", "OverlayLayer", "RestoreStats", "SnapshotStats"]
