"""What one run adds to its image's view of the host: `--rw`, `--ro`, `--hide`, `--no-private-tmp`.

The image decides what the agent sees of the host (read-only, with hidden paths and a private
/tmp); these flags adjust it for one run without writing an image:

* ``--ro PATH`` shows PATH as the host has it, read-only (executable): a script or a tool under
  the private /tmp, a directory the image hides.
* ``--rw PATH`` lets the agent write PATH on the host directly: a virtualenv outside the tree
  that `pip install -e .` writes to, a cache. It is a hole in the booth: those writes are not
  staged, not recorded, not undone by a rollback or a discard (docs/booth.md, threat model).
  So it is refused where it would undo what the booth protects: the tree (written through the
  layer), the tape dir (hidden from the agent), the directory of this user's commit key (never
  reachable from a booth) — each in either direction, since write access to an ancestor lets
  the agent rename it away and put a directory of its own in its place — and the kernel's
  /proc, /sys and the booth's own /dev.
* ``--hide PATH`` covers PATH as the image's `hide` list does.
* ``--no-private-tmp`` shows the host's /tmp (read-only like the rest of the host).

The kept paths are bind mounts of the host's paths, taken before anything is covered and put
back on top of the covers, as the tree is (jukebox.booth.isolation.build_view); covers inside them
go on top again. Everything here is recorded in run_start under ``policy.paths``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable

from jukebox.errors import JukeboxError, UsageError
from shadowfs.fdwalk import DIR_OPEN, FdWalk
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

# The kernel's and the booth's own: never a host path to keep.
NOT_HOST = ("/proc", "/sys", "/dev")


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _overlap(a: str, b: str) -> bool:
    return _is_under(a, b) or _is_under(b, a)


def _resolved(flag: str, paths: Iterable[str]) -> tuple[str, ...]:
    out: list[str] = []
    for given in paths:
        path = os.path.realpath(os.path.abspath(os.path.expanduser(given)))
        if not os.path.lexists(path):
            raise UsageError(f"{flag} {given}: no such file or directory; give an existing path")
        if path not in out:
            out.append(path)
    return tuple(out)


class BoothPaths(Value):
    __slots__ = FIELDS = ("rw", "ro", "hide", "private_tmp")
    rw: tuple[str, ...]
    ro: tuple[str, ...]
    hide: tuple[str, ...]
    private_tmp: bool | None  # None: as the image says; False: --no-private-tmp

    def __init__(
        self, rw: tuple[str, ...] = (), ro: tuple[str, ...] = (), hide: tuple[str, ...] = (),
        private_tmp: bool | None = None,
    ) -> None:  # fmt: skip
        setfield(self, "rw", rw)
        setfield(self, "ro", ro)
        setfield(self, "hide", hide)
        setfield(self, "private_tmp", private_tmp)

    @classmethod
    def from_options(
        cls,
        rw: Iterable[str] = (),
        ro: Iterable[str] = (),
        hide: Iterable[str] = (),
        no_private_tmp: bool = False,
    ) -> BoothPaths:
        """The flags as given, each path resolved (symlinks too) and required to exist."""
        paths = cls(
            _resolved("--rw", rw),
            _resolved("--ro", ro),
            _resolved("--hide", hide),
            False if no_private_tmp else None,
        )
        both = sorted(set(paths.rw) & set(paths.ro))
        if both:
            raise UsageError(f"--rw and --ro both name {both[0]}: keep one")
        return paths

    def check(self, tree: str, tape_dir: str, key_dir: str) -> None:
        """Refuses (UsageError) a kept path the booth must not open up, and hiding the tree."""
        for flag, paths in (("--rw", self.rw), ("--ro", self.ro)):
            for path in paths:
                # A read-only view of an ancestor keeps the covers below it; write access to
                # one does not (rename it, put another in its place), hence `_overlap` for rw.
                clash = _overlap if flag == "--rw" else _is_under
                kernel = next((k for k in NOT_HOST if _is_under(path, k)), None)
                if kernel is not None:
                    raise UsageError(
                        f"{flag} {path}: {kernel} is the kernel's or the booth's own, not a host "
                        "path a booth can keep"
                    )
                if clash(path, tree):
                    raise UsageError(
                        f"{flag} {path} overlaps the tree {tree}: the agent works on the tree "
                        "through the booth's layer, which records and can undo every change; "
                        "drop the flag (or pick a path outside the tree)"
                    )
                if clash(path, tape_dir):
                    raise UsageError(
                        f"{flag} {path} overlaps the tape dir {tape_dir}, which every booth "
                        "hides from its agent; pick a path outside it"
                    )
                if clash(path, key_dir):
                    raise UsageError(
                        f"{flag} {path} overlaps {key_dir}, which holds your commit key: no "
                        "booth ever reaches it; pick a path outside it"
                    )
        for path in self.hide:
            if path == tree:
                raise UsageError(
                    f"--hide {path} is the tree itself: the booth shows the agent its tree "
                    "whatever is hidden; hide paths inside it or around it"
                )

    def policy(self) -> dict[str, Any]:
        """What run_start records (``policy.paths``)."""
        return {
            "rw": list(self.rw),
            "ro": list(self.ro),
            "hide": list(self.hide),
            "no_private_tmp": self.private_tmp is False,
        }


# Bounds the walk after a run: a --rw over a huge directory must not make every run slow.
SET_ID_WALK_LIMIT = 200_000


def strip_set_id(paths: Iterable[str], since_ns: int) -> tuple[list[str], bool]:
    """Takes the set-user-ID and set-group-ID bits off every regular file under `paths` whose
    status changed at or after `since_ns` (the run's start): what the agent left there. Inside
    the booth every mount is nosuid, but on the host a root agent's `chmod 4755` copy of a
    shell in a --rw directory would be a setuid-root program anyone could run, as a booth
    commit never lets through. Returns (the files changed, whether the walk stopped short: at
    SET_ID_WALK_LIMIT entries, out of file descriptors, or at a directory moved while it was
    walked). Never follows a symlink; call it once nothing of the booth runs any more.

    Every step is relative to an open directory (`shadowfs.fdwalk.FdWalk`): the agent chooses
    the depth, and a file past PATH_MAX (4,096 bytes of path) could not be stat'ed or opened by
    its path, and was skipped; one open directory per level ran out of file descriptors a few
    hundred levels down, where the walk holds a bounded number however deep."""
    stripped: list[str] = []
    walk = _SetIdStrip(since_ns, stripped)
    for top in paths:
        try:
            top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's
        except OSError:
            continue  # gone, or not a directory: nothing under it
        walk.top = top
        try:
            walk.walk(top_fd)
        except (_WalkStopped, OSError):  # OSError: a directory moved while walked (ESTALE)
            return stripped, True  # what lies further in was not looked at: the caller says so
        finally:
            os.close(top_fd)
    return stripped, False


class _WalkStopped(JukeboxError):
    """SET_ID_WALK_LIMIT entries seen, or no file descriptor left to go on with (never leaves
    `strip_set_id`)."""


_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


class _SetIdStrip(FdWalk):
    """Counts every entry against SET_ID_WALK_LIMIT (the paths together), and strips the set-id
    files the agent left; whatever it cannot open or stat is passed over, as the agent's."""

    def __init__(self, since_ns: int, stripped: list[str]) -> None:
        super().__init__()
        self.since_ns, self.stripped = since_ns, stripped
        self.top = ""  # the path walked, for the report
        self.seen = 0

    def _count(self) -> None:
        self.seen += 1
        if self.seen > SET_ID_WALK_LIMIT:
            raise _WalkStopped

    def enter(self, name: str, parent_fd: int) -> int | None:
        self._count()
        try:
            return os.open(name, DIR_OPEN, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in _OUT_OF_FDS:  # the rest would be skipped in silence: say so
                raise _WalkStopped from exc
            return None

    def unlisted(self, error: OSError, dir_fd: int) -> None:
        if error.errno in _OUT_OF_FDS:
            raise _WalkStopped from error

    def file(self, dir_fd: int, entry: os.DirEntry[str]) -> None:
        self._count()
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return
        if not (stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID)):
            return
        if st.st_ctime_ns < self.since_ns:
            return  # the user's own, from before the run
        if _drop_set_id(entry.name, dir_fd):
            self.stripped.append(os.path.join(self.top, *self.names(), entry.name))


def _drop_set_id(name: str, dir_fd: int) -> bool:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)  # fmt: skip
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
