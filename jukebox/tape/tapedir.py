"""Where tapes live, and how a TAPE argument on the command line names one.

A tape dir holds `<tape id>.jbx` files and, hidden beside them, the object store and the records of
pending booths. One store per tape dir keeps dedup across runs and lets gc see every reference.

Commands reach a tape dir through `TapeDir.resolve` or `TapeRef.parse`, and both open it through
`TapeDir.opened`: commits a kill interrupted are recovered there first (jukebox.trees.realtree), so
no command ever reads or acts on a tape dir whose real trees are left half-committed.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from jukebox.errors import UsageError
from shadowfs.privacy import (
    is_loose,
    make_private_dirs,
    make_private_tree,
    tighten,
    tighten_tree,
)
from shadowfs.values import Value, setfield

TAPE_SUFFIX = ".jbx"
TAPE_DIR_ENV = "JUKEBOX_TAPE_DIR"
STATE_DIRNAME = ".jukebox"
COMMIT_JOURNALS = "commit-journals"
COMMIT_TRASH = "commit-trash"
KEPT_SCRATCH = "kept"  # pending booths' scratch dirs (jukebox.booth.scratchdir.keep_scratch)
# Tape dirs this process has recovered already: one look per command is enough.
_recovered: set[str] = set()
_TAPE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def default_tape_dir() -> Path:
    """$JUKEBOX_TAPE_DIR, else the config file's tape-dir (jukebox.config), else `jukebox/tapes`
    in the XDG data dir: outside any tree a booth runs over (`./tapes` was inside the tree of
    `cd repo && jukebox booth run -- CMD`)."""
    named = os.environ.get(TAPE_DIR_ENV)
    if named:
        return Path(named)
    configured = _configured_tape_dir()
    if configured is not None:
        return configured
    data = os.environ.get("XDG_DATA_HOME", "")
    # The XDG spec: a relative path is invalid and must be ignored.
    base = Path(data) if os.path.isabs(data) else Path.home() / ".local" / "share"
    return base / "jukebox" / "tapes"


def require_named_tape_dir(path: Path, named: str | os.PathLike[str] | None) -> None:
    """A tape dir the user named (--tape-dir, or $JUKEBOX_TAPE_DIR) must exist for a command
    that reads it: a typo would otherwise look like a dir with no tapes. The default may be
    missing: nothing has been recorded yet."""
    if path.is_dir():
        return
    if named is not None:
        where = f"the tape dir {path}"
    elif os.environ.get(TAPE_DIR_ENV):
        where = f"{TAPE_DIR_ENV}={path}"
    elif _configured_tape_dir() is not None:
        from jukebox.config import config_path

        where = f"the tape dir {path} (tape-dir in {config_path()[0]})"
    else:
        return
    kind = "is not a directory" if path.exists() else "does not exist"
    raise UsageError(f"{where} {kind}: check the path, or run a booth to create it")


def _configured_tape_dir() -> Path | None:
    from jukebox.config import load

    configured = load().get("tape-dir")
    return Path(configured) if configured else None


def make_tape_dir(path: Path) -> Path | None:
    """Creates the tape dir where missing. Returns the outermost directory this created (None
    when it was there), so that a run which fails before writing a tape can remove it again."""
    if path.is_dir():
        return None
    path = Path(os.path.abspath(path))
    outermost = path
    while not outermost.parent.exists() and outermost.parent != outermost:
        outermost = outermost.parent
    try:
        path.mkdir(parents=True)
    except OSError as error:
        if path.is_dir():  # made meanwhile by another run
            return None
        reason = "is not a directory" if path.exists() else f"cannot be made ({error.strerror})"
        raise UsageError(
            f"the tape dir {path} {reason}: pass --tape-dir a directory you can write "
            f"(or set {TAPE_DIR_ENV})"
        ) from None
    return outermost


def remove_unused_tape_dir(made: Path, tapes: TapeDir) -> None:
    """Undoes `make_tape_dir` after a run that wrote no tape: no empty tape dir is left."""
    if not tapes.tape_paths():
        # Imported here: shutil (with bz2 and lzma behind it) is 6 M instructions that a
        # replay, which reads the tape dir, would otherwise pay at every start.
        import shutil

        shutil.rmtree(made, ignore_errors=True)


def check_tape_id(tape_id: str) -> str:
    if not _TAPE_ID.match(tape_id) or tape_id.endswith(TAPE_SUFFIX):
        raise UsageError(
            f"bad tape id {tape_id!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return tape_id


class TapeDir(Value):
    """A tape dir. Its tapes are 0600 and its state dir 0700 (docs/booth.md, "Threat model");
    one opened that an older version left readable to others is tightened on the spot."""

    __slots__ = FIELDS = ("path",)
    path: Path

    def __init__(self, path: Path) -> None:
        setfield(self, "path", path)
        # One lstat per opening; the walk runs once, on a tape dir from before private state.
        if is_loose(self.state):
            self._tighten()

    def _tighten(self) -> None:
        # Two levels reach every file of ours (store/packs/*, booths/*, commits/<key>/*); in
        # scratch and mnt only one: scratch/<id>/upper holds a running overlay booth's files
        # with the agent's own modes, and mnt/<id> is a layer's mount point. kept/ holds only
        # finished booths' scratch dirs: all of it, however deep. The tape dir itself is the
        # user's: left as it is.
        # Through an fd opened without following: a received tape dir's `.jukebox` may be a
        # symlink to /etc, and whoever runs jukebox (root) must not chmod what it points to.
        try:
            state = os.open(self.state, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            tighten(".", dir_fd=state)
            with os.scandir(state) as entries:
                names = [entry.name for entry in entries if not entry.is_symlink()]
            for name in names:
                if name == KEPT_SCRATCH:
                    with contextlib.suppress(OSError):  # someone else's: theirs to tighten
                        make_private_tree(name, dir_fd=state)
                    continue
                tighten_tree(name, depth=1 if name in ("scratch", "mnt") else 2, dir_fd=state)
        finally:
            os.close(state)
        for tape in self.tape_paths():
            tighten(tape)

    def private_dir(self, *parts: str) -> Path:
        """``<state>/<parts...>``, made 0700 where missing (the state dir too)."""
        path = self.state.joinpath(*parts)
        make_private_dirs(path)
        return path

    @classmethod
    def resolve(cls, path: str | os.PathLike[str] | None) -> TapeDir:
        return cls.opened(Path(path) if path is not None else default_tape_dir())

    @classmethod
    def opened(cls, path: Path) -> TapeDir:
        """The tape dir at ``path``, its interrupted commits recovered (once per process; one
        listing of an empty directory when there are none)."""
        home = cls(path)
        try:
            interrupted = bool(os.listdir(home.journals_path))  # emptied by every finished commit
        except OSError:
            interrupted = False  # none yet, or not ours to read (recovery would say so)
        if interrupted:
            real = os.path.realpath(path)
            if real not in _recovered:
                _recovered.add(real)
                from jukebox.trees.realtree import recover_commits

                recover_commits(home)
        try:
            trash = os.listdir(home.trash_path)  # emptied by the process each commit starts
        except OSError:
            trash = []
        if trash:
            # That process died (or still runs: then it keeps the trash locked and this is a
            # no-op): whoever opens the tape dir next restarts it.
            from shadowfs.trash import empty_later

            for name in trash:
                empty_later(home.trash_path / name)
        try:
            kept = os.listdir(home.kept_path)  # pending booths' scratch: a few names
        except OSError:
            kept = []
        for name in kept:
            # A booth finished by a commit that was killed before it freed its kept scratch,
            # or by the recovery of such a commit.
            if not (home.booths_path / f"{name}.json").exists():
                home.retire_kept(name)
        try:
            prepared = bool(os.listdir(home.state / "sql"))  # jukebox.sql.ledger
        except OSError:
            prepared = False
        if prepared:
            from jukebox.sql.ledger import sweep

            sweep(home)
        return home

    @property
    def state(self) -> Path:
        return self.path / STATE_DIRNAME

    @property
    def store_path(self) -> Path:
        return self.state / "store"

    @property
    def booths_path(self) -> Path:
        return self.state / "booths"

    @property
    def journals_path(self) -> Path:
        """Where commits keep their redo journals while they run (jukebox.trees.realtree)."""
        return self.state / COMMIT_JOURNALS

    @property
    def trash_path(self) -> Path:
        """Where finished commits leave the files they replaced, freed by a background process
        (jukebox.trees.realtree, shadowfs.trash)."""
        return self.state / COMMIT_TRASH

    @property
    def kept_path(self) -> Path:
        """Where pending booths keep their scratch dirs until their commit or discard
        (jukebox.booth.scratchdir.keep_scratch)."""
        return self.state / KEPT_SCRATCH

    def retire_kept(self, booth_id: str) -> None:
        """Frees a finished booth's kept scratch in a detached process: it is moved into the
        commit trash, which whoever opens the tape dir next empties should that process die."""
        from shadowfs.trash import empty_later

        away = self.trash_path / f"kept-{booth_id}-{os.urandom(4).hex()}"
        try:
            make_private_dirs(self.trash_path)
            os.rename(self.kept_path / booth_id, away)
        except FileNotFoundError:
            return  # none, or retired by another process meanwhile
        except OSError:
            from shadowfs.removal import remove_quietly

            remove_quietly(self.kept_path / booth_id)  # however deep the agent nested it
            return
        empty_later(away)

    def tape_path(self, tape_id: str) -> Path:
        return self.path / f"{check_tape_id(tape_id)}{TAPE_SUFFIX}"

    def tape_paths(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        # A link is not a tape of this dir: in a received tape dir it would make `ls` and `gc`
        # read whatever file the sender pointed it at.
        return sorted(
            p
            for p in self.path.iterdir()
            if p.suffix == TAPE_SUFFIX and not p.is_symlink() and p.is_file()
        )


class TapeRef(Value):
    """A TAPE[@N] argument resolved to a file, its tape dir, and an optional frame."""

    __slots__ = FIELDS = ("path", "tape_dir", "frame")
    path: Path
    tape_dir: TapeDir
    frame: int | None

    def __init__(self, path: Path, tape_dir: TapeDir, frame: int | None) -> None:
        setfield(self, "path", path)
        setfield(self, "tape_dir", tape_dir)
        setfield(self, "frame", frame)

    @classmethod
    def parse(cls, text: str, tape_dir: str | os.PathLike[str] | None = None) -> TapeRef:
        name, frame = text, None
        at = text.rfind("@")
        if at > 0 and not Path(text).exists():
            name, frame_text = text[:at], text[at + 1 :]
            if not frame_text.isdigit():
                raise UsageError(
                    f"bad frame selector '@{frame_text}' in {text!r}: "
                    "write TAPE@N with N a frame number from 0"
                )
            frame = int(frame_text)
        candidate = Path(name)
        if candidate.suffix == TAPE_SUFFIX or os.sep in name or candidate.is_file():
            if not candidate.exists():
                raise UsageError(
                    f"no tape at {name}: check the path, or list tapes with `jukebox ls`"
                )
            if candidate.is_dir():
                raise UsageError(
                    f"{name} is a directory, not a tape: name a .jbx file or a tape id"
                )
            home = TapeDir.opened(Path(tape_dir) if tape_dir is not None else candidate.parent)
            return cls(candidate, home, frame)
        home = TapeDir.resolve(tape_dir)
        require_named_tape_dir(home.path, tape_dir)
        path = home.tape_path(name)
        if not path.exists():
            raise UsageError(
                f"no tape {name!r} in {home.path}: "
                f"list tapes with `jukebox ls --tape-dir {home.path}`"
            )
        return cls(path, home, frame)
