"""Tapes: the append-only, tamper-evident `.jbx` log of everything a run did.

The byte layout is specified in docs/tape-format.md. In short: a 16-byte header, then records of
`u32le length | canonical frame bytes | 32-byte frame id`. Each frame names its parent frame (a
hash chain) and the RFC 6962 Merkle root of all frames before it, so the last frame commits to the
whole history and a fork shares its prefix byte for byte.

Loading is built for speed (a 50-frame tape loads and verifies in a fraction of a millisecond):
the file is read once, records are split and hashed, and frames decode their JSON only when a
field is read. Verification reads the few fields it needs from fixed positions in the canonical
bytes (see `jukebox.tape.frame.frame_pattern`).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from binascii import a2b_hex
from collections.abc import Callable, Iterable, Mapping

from blake3 import blake3

from jukebox.tape import merkle
from jukebox.tape.errors import (
    CorruptObject,
    MissingObject,
    NotATape,
    TamperedTape,
    TapeProblem,
    TornTape,
    UnsupportedVersion,
)
from jukebox.tape.frame import (
    FORMAT_VERSION,
    KNOWN_KINDS,
    Frame,
    encode_frame,
    frame_pattern,
    spill_encoded,
)
from shadowfs.errors import ObjectCorrupt, ObjectMissing
from shadowfs.oid import ObjectId
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

    from shadowfs.objects import ObjectReader, ObjectStore
    from shadowfs.progress import Progress

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "Head",
    "Tape",
    "TapeWriter",
    "TornTail",
    "VerifyReport",
]


MAGIC = b"JBX\x00TAPE"
HEADER = struct.Struct("<8sHHI")  # magic, format version, reserved (0), reserved (0)
HEADER_SIZE = HEADER.size
LENGTH = struct.Struct("<I")
ID_SIZE = 32
# A frame is small (large payload values live in the store); anything bigger is a damaged length.
MAX_FRAME_SIZE = 1 << 26

_FRAME_HEADER = b"frame %d\x00"


class TornTail(Value):
    """Where the intact prefix of a tape ends and why the bytes after it are not a record."""

    __slots__ = FIELDS = ("offset", "reason")
    offset: int
    reason: str

    def __init__(self, offset: int, reason: str) -> None:
        setfield(self, "offset", offset)
        setfield(self, "reason", reason)


class Head(Value):
    """What a tape's last frame commits to: frame count, last frame id, Merkle root of all ids."""

    __slots__ = FIELDS = ("count", "last_frame_id", "merkle_root")
    count: int
    last_frame_id: ObjectId | None
    merkle_root: ObjectId

    def __init__(self, count: int, last_frame_id: ObjectId | None, merkle_root: ObjectId) -> None:
        setfield(self, "count", count)
        setfield(self, "last_frame_id", last_frame_id)
        setfield(self, "merkle_root", merkle_root)

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "frame": self.last_frame_id.hex() if self.last_frame_id is not None else None,
            "root": self.merkle_root.hex(),
        }


class VerifyReport:
    __slots__ = ("head", "ok", "problems")

    def __init__(self, ok: bool, head: Head, problems: list[TapeProblem] | None = None) -> None:
        self.ok = ok
        self.head = head
        self.problems: list[TapeProblem] = [] if problems is None else problems

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            assert isinstance(other, VerifyReport)
            return (self.ok, self.head, self.problems) == (other.ok, other.head, other.problems)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value: unhashable

    def __repr__(self) -> str:
        return f"VerifyReport(ok={self.ok!r}, head={self.head!r}, problems={self.problems!r})"

    def raise_for_problems(self) -> None:
        """Raise the first problem found (the one to fix first), if any."""
        if self.problems:
            raise self.problems[0]


def header_bytes(version: int = FORMAT_VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, 0, 0)


def _check_header(path: str | os.PathLike[str], data: bytes) -> None:
    if len(data) < HEADER_SIZE or data[:8] != MAGIC:
        raise NotATape(path, data[:8])
    _, version, r1, r2 = HEADER.unpack_from(data)
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(path, f"is tape format version {version}")
    if r1 or r2:
        raise UnsupportedVersion(
            path, "sets reserved header bytes (written by a newer jukebox, or damaged)"
        )


class Tape:
    """A loaded tape. `frames` holds the intact records; `torn_tail` says where they stopped."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        frames: list[Frame],
        torn_tail: TornTail | None,
        split_problems: list[TapeProblem],
        store: ObjectStore | None,
    ) -> None:
        self.path = path
        self.frames = frames
        self.torn_tail = torn_tail
        self.store = store
        self._split_problems = split_problems
        self._head: Head | None = None
        self._damage: TamperedTape | bool | None = False  # False: not checked yet

    @classmethod
    def load(cls, path: str | os.PathLike[str], store: ObjectStore | None = None) -> Tape:
        with open(path, "rb") as f:
            data = f.read()
        _check_header(path, data)
        frames: list[Frame] = []
        problems: list[TapeProblem] = []
        torn: TornTail | None = None
        pos = HEADER_SIZE
        end_of_file = len(data)
        unpack = LENGTH.unpack_from
        header = _FRAME_HEADER
        # One hasher reset per record costs a third of constructing one (measured).
        hasher = blake3()
        update, digest_of, reset = hasher.update, hasher.digest, hasher.reset
        while pos < end_of_file:
            if end_of_file - pos < LENGTH.size:
                torn = TornTail(pos, "the length prefix is cut short")
                break
            (length,) = unpack(data, pos)
            start = pos + LENGTH.size
            end = start + length + ID_SIZE
            if end > end_of_file or length > MAX_FRAME_SIZE:
                reason = (
                    f"the record needs {end - pos} bytes but only {end_of_file - pos} remain"
                    if length <= MAX_FRAME_SIZE
                    else f"its length prefix claims {length} bytes, more than any frame holds"
                )
                torn = TornTail(pos, reason)
                break
            raw = data[start : start + length]
            update((header % length) + raw)
            digest = digest_of()
            reset()
            if digest != data[end - ID_SIZE : end]:
                # A crash can leave the last record's blocks unwritten (zeros) even when the
                # file size already covers it, so a bad final record counts as torn. Zeros
                # longer than a record parse as zero-length records and must count as torn too:
                # a record in flight left 4 KiB of zeros, and each 36 of them was once reported
                # as a tampered frame.
                if end == end_of_file or data.count(0, end) == end_of_file - end:
                    torn = TornTail(
                        pos,
                        "the last record's bytes do not hash to its frame id"
                        if end == end_of_file
                        else "the tape ends in zeros where a record was being written",
                    )
                    break
                problems.append(
                    TamperedTape(
                        path,
                        len(frames),
                        "the record's bytes do not hash to the frame id stored after them",
                    )
                )
            frames.append(Frame(raw, digest))
            pos = end
        return cls(path, frames, torn, problems, store)

    # -- reading ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def tape_id(self) -> str | None:
        """The run_start payload's tape_id, or the latest fork frame's for a forked tape."""
        tape_id = None
        for f in self.frames:
            try:
                if f.kind == "run_start" or f.kind == "fork":
                    value = f.payload.get("tape_id")
                    if isinstance(value, str):
                        tape_id = value
            except TamperedTape:
                continue  # verify() reports it; the id is still worth showing
        return tape_id

    @property
    def head(self) -> Head:
        if self._head is None:
            acc = merkle.Accumulator()
            for f in self.frames:
                acc.append(f._id)
            self._head = self._make_head(acc)
        return self._head

    def _make_head(self, acc: merkle.Accumulator) -> Head:
        last = self.frames[-1].id if self.frames else None
        return Head(len(self.frames), last, ObjectId(acc.root()))

    def tree_at(self, n: int) -> ObjectId | None:
        """The tree in effect at frame n: the latest frame <= n that set one, or None."""
        if not 0 <= n < len(self.frames):
            raise IndexError(
                f"{os.fspath(self.path)} has {len(self.frames)} frames, counted from 0; "
                f"there is no frame {n}"
            )
        for i in range(n, -1, -1):
            try:
                tree = self.frames[i].tree
            except TamperedTape as e:
                raise TamperedTape(self.path, i, e.what) from None
            if tree is not None:
                return tree
        return None

    def inclusion_proof(self, n: int) -> list[bytes]:
        return merkle.inclusion_proof([f._id for f in self.frames], n)

    def consistency_proof(self, m: int) -> list[bytes]:
        """Proof that this tape's first m frames are the whole of a tape whose head has count m."""
        return merkle.consistency_proof([f._id for f in self.frames], m)

    def summary(self) -> dict[str, Any]:
        """One row of `jukebox ls`. A tape whose chain breaks is `damaged`, status DAMAGED, and
        summed up to the damage only; frames that do not decode are skipped and flag it too."""
        name = None
        cost = 0.0
        status: str | None = None
        exited = False
        damage = self.damage
        damaged = damage is not None
        times: list[int] = []
        for f in self.intact_frames:
            try:
                kind = f.kind
                payload = f.payload
                times.append(f.time_ns)
            except TamperedTape:
                damaged = True
                continue
            c = payload.get("cost_usd")
            if isinstance(c, int | float) and not isinstance(c, bool):
                cost += c
            if kind == "run_start":
                n = payload.get("name")
                name = n if isinstance(n, str) else name
            elif kind == "commit":
                status = "COMMITTED"
            elif kind == "discard":
                status = "DISCARDED"
            elif kind == "rollback" and payload.get("final") is True:
                status = "ROLLED_BACK"
            elif kind == "exit":
                exited = True
            elif kind == "fork":
                # A fork continues from the middle of another run: its verdict is its own.
                status, exited = None, False
        if status is None:
            status = "EXITED" if exited else "RUNNING"
        if damaged:
            status = "DAMAGED"
        started = times[0] if times else None
        duration = times[-1] - times[0] if times else 0
        tape_id = self.tape_id
        return {
            "tape_id": tape_id,
            "track_id": tape_id,
            "name": name,
            "frames": len(self.frames),
            "cost_usd": round(cost, 10),
            "status": status,
            "started_ns": started,
            "duration_ns": duration,
            "torn": self.torn_tail is not None,
            "damaged": damaged,
            "damaged_at": damage.seq if damage is not None else None,
            "path": os.fspath(self.path),
        }

    # -- verification -------------------------------------------------------------------------

    @property
    def damage(self) -> TamperedTape | None:
        """The first frame that breaks the hash chain (its record id, seq or parent link), or
        None. Every command that reads a tape asks this: it decodes no frame and costs a fifth
        of the load (see bench/bench_tape.py). The per-frame Merkle roots are left to `verify`:
        folding them costs twice the load on a long tape, and they add nothing a reader relies
        on, since changing a frame changes its id and so breaks the next frame's parent link
        (or the last record's id). A torn tail is not damage: a crash leaves one."""
        if self._damage is False:
            problems, _ = self._check_chain(roots=False)
            found = [p for p in self._split_problems + problems if isinstance(p, TamperedTape)]
            self._damage = min(found, key=lambda p: p.seq) if found else None
        # assigned just above: no longer the False meaning unchecked
        return self._damage  # type: ignore[return-value]

    @property
    def intact_frames(self) -> list[Frame]:
        """The frames before the first damage: the ones the chain vouches for."""
        damage = self.damage
        return self.frames if damage is None else self.frames[: damage.seq]

    def check_chain(self) -> None:
        """Raise the first damage (TamperedTape, exit 1), if any."""
        damage = self.damage
        if damage is not None:
            raise damage

    def _check_chain(self, roots: bool = True) -> tuple[list[TapeProblem], merkle.Accumulator]:
        """Seq order, parent links and (with ``roots``) per-frame Merkle roots, read from fixed
        positions.

        This is the hot half of a load + verify, so the Merkle accumulator is inlined: the stack
        holds perfect-subtree roots whose sizes are the set bits of the frame count. Folding the
        stack into each frame's root costs log2(frames) hashes per frame, most of the check on
        a long tape: without ``roots`` the accumulator returned is empty.
        """
        problems: list[TapeProblem] = []
        stack: list[bytes] = []
        prev: bytes | None = None
        path = self.path
        match = frame_pattern().match
        hasher = blake3()
        update, digest_of, reset = hasher.update, hasher.digest, hasher.reset
        for i, f in enumerate(self.frames):
            m = match(f._raw)
            try:
                if m is None:
                    raise ValueError
                mroot = a2b_hex(m[2])
                parent = m[3]
                if parent is not None:
                    parent = a2b_hex(parent)
            except ValueError:
                problems.append(
                    TamperedTape(path, i, "its bytes are not a canonical version 1 frame")
                )
            else:
                seq = int(m[4])
                if seq != i:
                    problems.append(
                        TamperedTape(path, i, f"it carries seq {seq} (frames out of order)")
                    )
                if m[7] != b"1":
                    problems.append(
                        TamperedTape(path, i, f"it claims frame version {m[7].decode()}")
                    )
                if parent != prev:
                    problems.append(
                        TamperedTape(path, i, "its parent link does not name the frame before it")
                    )
                if not roots:
                    pass
                elif stack:
                    root = stack[-1][1:]
                    for k in range(len(stack) - 2, -1, -1):
                        update(stack[k] + root)
                        root = digest_of()
                        reset()
                else:
                    root = merkle.EMPTY_ROOT
                if roots and mroot != root:
                    problems.append(
                        TamperedTape(
                            path, i, "its Merkle root does not match the frames before it"
                        )
                    )
                if i == 0 and m[1] != b"run_start":
                    problems.append(TamperedTape(path, i, "a tape must start with run_start"))
            prev = f._id
            if not roots:
                continue
            update(b"\x00" + prev)
            h = digest_of()
            reset()
            n = i
            while n & 1:
                update(stack.pop() + h)
                h = digest_of()
                reset()
                n >>= 1
            stack.append(b"\x01" + h)  # as merkle.Accumulator keeps it
        acc = merkle.Accumulator()
        if roots:
            acc._stack = stack
            acc.count = len(self.frames)
        return problems, acc

    def verify(
        self, check_objects: bool = True, deep: bool = False, progress: Progress | None = None
    ) -> VerifyReport:
        """Check every frame; with a store (and check_objects) also every referenced object.

        The default checks record ids, seq order, parent links and Merkle roots. With a store or
        `deep=True` every frame is also decoded and checked to be canonical; ``progress`` is told
        of each frame checked so.
        """
        problems: list[TapeProblem] = list(self._split_problems)
        chain, acc = self._check_chain()
        problems += chain
        head = self._make_head(acc)
        self._head = head
        store = self.store if check_objects else None
        if deep or store is not None:
            problems += self._check_frames(store, progress)
        if self.torn_tail is not None:
            problems.append(
                TornTape(self.path, self.torn_tail.offset, self.torn_tail.reason, len(self.frames))
            )
        return VerifyReport(not problems, head, problems)

    def _check_frames(
        self, store: ObjectReader | None, progress: Progress | None = None
    ) -> list[TapeProblem]:
        problems: list[TapeProblem] = []
        seen: set[bytes] = set()
        for i, f in enumerate(self.frames):
            if progress is not None:
                progress(i, len(self.frames))
            try:
                refs = f.refs
                tree = f.tree
            except TamperedTape:
                problems.append(
                    TamperedTape(self.path, i, "its bytes are not a canonical version 1 frame")
                )
                continue
            if tree is not None and tree not in refs:
                problems.append(TamperedTape(self.path, i, "its tree id is missing from its refs"))
            if store is None:
                continue
            for oid in refs:
                if oid in seen:
                    continue
                seen.add(oid)
                try:
                    store.get(oid)
                except ObjectMissing:
                    problems.append(MissingObject(self.path, i, oid))
                except ObjectCorrupt as e:
                    problems.append(CorruptObject(self.path, i, oid, e.where))
        return problems


class TapeWriter:
    """Appends frames to a tape: one `write` and one fsync per frame.

    A frame that references store objects is written only after `store.flush()` returned, so a
    durable frame never points at objects that could still be lost.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fd: int,
        store: ObjectStore | None,
        tape_id: str,
        *,
        count: int = 0,
        last_id: bytes | None = None,
        acc: merkle.Accumulator | None = None,
        size: int = HEADER_SIZE,
        fsync: bool = True,
    ) -> None:
        self.path = path
        self.store = store
        self.tape_id = tape_id
        self.repaired: TornTail | None = None
        self._fd: int | None = fd
        self._count = count
        self._last = last_id
        self._acc = acc if acc is not None else merkle.Accumulator()
        self._size = size
        self._fsync = fsync
        self._lock = threading.Lock()
        # Resetting one hasher costs a third of constructing one (used under the lock).
        self._hasher = blake3()
        # Called with each frame written and the payload it was given (before spilling), after
        # the write: a live export (jukebox.export.otel_live) watches a booth's tape this way.
        self.listener: Callable[[Frame, Mapping[str, Any]], None] | None = None

    # -- opening ------------------------------------------------------------------------------

    @staticmethod
    def _create_file(path: str | os.PathLike[str], data: bytes) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
            # The new name must survive a crash too, not just the bytes behind it.
            dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return fd

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        store: ObjectStore | None,
        tape_id: str,
        *,
        fsync: bool = True,
    ) -> TapeWriter:
        """Create a new, empty tape; the first frame appended must be run_start.

        `fsync=False` skips the per-frame fsync: for benchmarks and throwaway tapes only.
        """
        fd = cls._create_file(path, header_bytes())
        return cls(path, fd, store, tape_id, fsync=fsync)

    @classmethod
    def open_append(
        cls,
        path: str | os.PathLike[str],
        store: ObjectStore | None,
        *,
        fsync: bool = True,
        tape_id: str | None = None,
    ) -> TapeWriter:
        """Reopen a tape to append to it, cutting off (and logging) a torn tail first.

        `tape_id` is needed only for a tape with no frames yet (its writer died before run_start).
        """
        tape = Tape.load(path)
        problems, acc = tape._check_chain()
        problems = tape._split_problems + problems
        if problems:
            raise problems[0]
        if tape.frames:
            found = tape.tape_id
            if found is None:
                raise TamperedTape(path, 0, "its run_start frame names no tape id")
            tape_id = found
        elif tape_id is None:
            raise ValueError(
                f"{os.fspath(path)} has no frames yet, so it names no tape id; "
                "pass tape_id= to open_append"
            )
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        torn = tape.torn_tail
        size = os.fstat(fd).st_size
        if torn is not None:
            # logging costs ~10 ms to import: only this rare path pays for it
            import logging

            logging.getLogger(__name__).warning(
                "%s",
                TornTape(path, torn.offset, torn.reason, len(tape.frames)),
            )
            os.ftruncate(fd, torn.offset)
            os.fsync(fd)
            size = torn.offset
        last = tape.frames[-1]._id if tape.frames else None
        w = cls(
            path, fd, store, tape_id, count=len(tape.frames), last_id=last, acc=acc, size=size,
            fsync=fsync,
        )
        w.repaired = torn
        return w

    @classmethod
    def fork_from(
        cls,
        tape: Tape,
        at_seq: int,
        new_path: str | os.PathLike[str],
        new_tape_id: str,
        *,
        store: ObjectStore | None = None,
        fsync: bool = True,
        time_ns: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> TapeWriter:
        """Start a new tape sharing frames 0..at_seq-1 of `tape` byte for byte.

        Frame at_seq of the new tape is a `fork` frame naming the new tape id and where it came
        from, plus the keys of `extra` (the overrides, say); the returned writer appends from
        at_seq + 1.
        """
        if not 1 <= at_seq <= len(tape.frames):
            raise ValueError(
                f"cannot fork {os.fspath(tape.path)} at frame {at_seq}: it has "
                f"{len(tape.frames)} frames, so fork at 1..{len(tape.frames)}"
            )
        problems, _ = tape._check_chain()
        problems = [
            p for p in tape._split_problems + problems
            if isinstance(p, TamperedTape) and p.seq < at_seq
        ]
        if problems:
            raise problems[0]
        origin_head = tape.head
        origin_id = tape.tape_id
        acc = merkle.Accumulator()
        parts = [header_bytes()]
        for f in tape.frames[:at_seq]:
            parts += (LENGTH.pack(len(f._raw)), f._raw, f._id)
            acc.append(f._id)
        data = b"".join(parts)
        fd = cls._create_file(new_path, data)
        w = cls(
            new_path,
            fd,
            store if store is not None else tape.store,
            new_tape_id,
            count=at_seq,
            last_id=tape.frames[at_seq - 1]._id,
            acc=acc,
            size=len(data),
            fsync=fsync,
        )
        w.append(
            "fork",
            {
                **(extra or {}),
                "tape_id": new_tape_id,
                "forked_from": {"tape": origin_id, "at": at_seq, "head": origin_head.to_json()},
            },
            time_ns=time_ns,
        )
        return w

    # -- writing ------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return self._count

    @property
    def head(self) -> Head:
        last = ObjectId(self._last) if self._last is not None else None
        return Head(self._count, last, ObjectId(self._acc.root()))

    def append(
        self,
        kind: str,
        payload: Mapping[str, Any],
        refs: Iterable[bytes] = (),
        tree: bytes | None = None,
        time_ns: int | None = None,
        *,
        refs_durable: bool = False,
    ) -> Frame:
        """Write one frame. Objects it references are made durable first (`Store.flush`),
        unless ``refs_durable``: the caller flushed the store after they were put (a group
        commit), and only objects this call spills from the payload need the flush."""
        if kind not in KNOWN_KINDS:
            raise ValueError(
                f"unknown frame kind {kind!r}; use one of {', '.join(sorted(KNOWN_KINDS))}"
            )
        if type(payload) is not dict and not isinstance(payload, Mapping):  # ABCs cost more
            raise TypeError(f"a frame payload is a dict, got {type(payload).__name__}")
        with self._lock:
            fd = self._fd
            if fd is None:
                raise ValueError(f"the tape writer for {os.fspath(self.path)} is closed")
            seq = self._count
            if (seq == 0) != (kind == "run_start"):
                raise ValueError(
                    "the first frame of a tape must be run_start, and only the first"
                    if seq == 0
                    else "run_start can only be the first frame of a tape"
                )
            if kind == "run_start":
                given = payload.get("tape_id", self.tape_id)
                if given != self.tape_id:
                    raise ValueError(
                        f"run_start names tape {given!r} but the writer records {self.tape_id!r}"
                    )
                payload = {**payload, "tape_id": self.tape_id}
            body, spilled, body_json = spill_encoded(payload, self.store)
            ref_set = {ObjectId(bytes(r)) for r in refs} if refs else set()
            ref_set.update(spilled)
            tree_id = ObjectId(bytes(tree)) if tree is not None else None
            if tree_id is not None:
                ref_set.add(tree_id)
            if time_ns is None:
                time_ns = time.time_ns()
            mroot = self._acc.root()
            parent = self._last
            raw = encode_frame(
                seq=seq,
                kind=kind,
                time_ns=time_ns,
                parent=parent,
                mroot=mroot,
                payload=body,
                refs=ref_set,
                tree=tree_id,
                payload_json=body_json,
            )
            hasher = self._hasher
            hasher.update((_FRAME_HEADER % len(raw)) + raw)
            digest = hasher.digest()
            hasher.reset()
            if ref_set:
                if self.store is None:
                    raise ValueError(
                        "this frame references store objects but the tape writer has no store; "
                        "open the writer with the store that holds them"
                    )
                if spilled or not refs_durable:
                    self.store.flush()
            record = LENGTH.pack(len(raw)) + raw + digest
            written = os.write(fd, record)
            if written != len(record):
                # Leave no torn record behind on a short write (disk full): cut back and fail.
                os.ftruncate(fd, self._size)
                raise OSError(
                    f"only {written} of {len(record)} bytes of frame {seq} reached "
                    f"{os.fspath(self.path)}; the frame was not recorded — free disk space"
                )
            if self._fsync:
                os.fdatasync(fd)
            self._size += len(record)
            self._count = seq + 1
            self._last = digest
            self._acc.append(digest)
        frame = Frame._built(
            raw, digest, seq, kind, time_ns, parent, mroot, body,
            tuple(sorted(ref_set)) if ref_set else (), tree_id,
        )
        if self.listener is not None:
            self.listener(frame, payload)
        return frame

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> TapeWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
