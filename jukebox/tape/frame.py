"""Tape frames: the record of one thing that happened, and its canonical bytes.

A frame's bytes are canonical JSON (see docs/tape-format.md for the exact rules) so that the same
frame always hashes to the same id, a human can read a tape with a hex dump, and any language can
write one with its standard JSON library. The frame id is `hash_object("frame", bytes)`.

Frames parse lazily: a tape load only hashes the bytes, and a frame decodes its JSON the first
time one of its fields is read. A decoded frame is checked to be canonical, so every reader sees
the same values the id commits to.
"""

from __future__ import annotations

import functools
import json
import math
import re
from binascii import b2a_hex
from collections.abc import Iterable, Mapping

# The C encoder's private name: typeshed does not declare it (a fallback covers its absence).
from json.encoder import c_make_encoder  # type: ignore[attr-defined]

from blake3 import blake3

from jukebox.tape.errors import TamperedTape
from shadowfs.oid import ObjectId, unchecked_oid

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

    from shadowfs.objects import ObjectReader, ObjectWriter

FORMAT_VERSION = 1

KNOWN_KINDS = frozenset(
    {
        "run_start",
        "agent_turn",
        "llm_turn",
        "tool_call",
        "fs",
        "checkpoint",
        "rollback",
        "verify",
        "commit",
        "discard",
        "breaker",
        "exit",
        "fork",
        "note",
        "sql",
    }
)

# A top-level payload value whose canonical JSON is longer than this goes to the store.
SPILL_THRESHOLD = 4096
BLOB_KEY = "$blob"


# The patterns below are compiled at their first use, not at import: a booth writes its tape
# without reading a frame back, and compiling them cost its start about 0.6 ms.
@functools.cache
def kind_pattern() -> re.Pattern[str]:
    """Every kind, known or from a later version, is a short lowercase identifier: this keeps
    the fixed-position fast parse of `frame_pattern` valid for frames this version does not
    understand."""
    return re.compile(r"[a-z][a-z0-9_]{0,31}\Z")


@functools.cache
def frame_pattern() -> re.Pattern[bytes]:
    """The canonical encoding puts keys in sorted order, so the first three fields sit at the
    start of the bytes and the last four at the end, whatever the payload holds: verification
    reads them with one anchored regex instead of decoding the JSON (twice as fast as two
    regexes, measured). The greedy `.*` backtracks from the end to the last `,"seq":`, which is
    the top-level one: `,"` cannot occur inside a JSON string (the quote would be escaped) and
    nothing nested follows the top-level "seq". Hex fields are matched loosely here and checked
    by a2b_hex where they are used."""
    return re.compile(
        rb'\{"kind":"([a-z][a-z0-9_]{0,31})","mroot":"(.{64})","parent":(?:null|"(.{64})"),'
        rb'"payload":\{.*,"seq":(0|[1-9][0-9]{0,17}),"time_ns":(-?[0-9]{1,20}),'
        rb'"tree":(?:null|"(.{64})"),"v":([0-9]{1,5})\}\Z',
        re.DOTALL,
    )


@functools.cache
def seq_pattern() -> re.Pattern[bytes]:
    return re.compile(rb',"seq":(0|[1-9][0-9]{0,17}),"time_ns":')


_FRAME_HEADER = b"frame %d\x00"


def _default(value: object) -> object:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    raise TypeError(
        f"a frame payload cannot hold a {type(value).__name__}; use str, int, float, bool, None, "
        "bytes, lists and dicts with str keys"
    )


_ENCODER = json.JSONEncoder(
    ensure_ascii=False,
    allow_nan=False,
    sort_keys=True,
    separators=(",", ":"),
    default=_default,
)
# The C encoder `_ENCODER.encode` builds on every call (through two Python frames), built once
# and called directly: a tape append encodes a payload, and the set-up was most of a small
# one's encoding. It is the same C function with the same settings, so its bytes are the same
# (tests/test_tape.py compares them), except that it keeps no table of the containers it is in
# to detect a structure holding itself: a payload is built from JSON-able data, and one holding
# itself fails all the same, on the depth limit (a ValueError from `canonical_json`).
try:
    _C_ENCODE: Any = c_make_encoder(
        None, _default, json.encoder.encode_basestring, None, ":", ",", True, False, False
    )
except TypeError:  # no C accelerator (None), or another interpreter's private signature
    _C_ENCODE = None


# What the encoder above makes of a string (ensure_ascii=False), of an int and a finite
# float (their repr), and of the constants. A bare scalar is most of a payload's values, and
# the encoder sets itself up on every call: about 2.5 µs, where these take 0.2-0.6 µs.
_encode_str = json.encoder.encode_basestring
_CONSTANTS = {None: b"null", True: b"true", False: b"false"}


def _scalar_json(value: object) -> bytes | None:
    """`value`'s canonical JSON when it is a plain scalar the fast way encodes, else None."""
    # Exactly these types (`type(...) is`): a subclass may encode otherwise.
    if type(value) is str:
        try:
            return _encode_str(value).encode("utf-8")
        except UnicodeEncodeError:
            return None  # a lone surrogate: said by canonical_json, as for any value
    if type(value) is int:
        return int.__repr__(value).encode()
    if type(value) is float:
        return float.__repr__(value).encode() if math.isfinite(value) else None
    if value is None or type(value) is bool:
        return _CONSTANTS[value]
    return None


def canonical_json(value: object) -> bytes:
    """The canonical encoding of a JSON value (rules in docs/tape-format.md)."""
    fast = _scalar_json(value)
    if fast is not None:
        return fast
    try:
        if _C_ENCODE is None:
            return _ENCODER.encode(value).encode("utf-8")
        return "".join(_C_ENCODE(value, 0)).encode("utf-8")
    except RecursionError:
        raise ValueError(
            "a frame payload is nested too deeply (or holds itself); flatten it"
        ) from None
    except UnicodeEncodeError:
        raise ValueError(
            "a frame payload holds a string that is not valid Unicode (a lone surrogate); "
            "pass such data as bytes"
        ) from None
    except ValueError as e:
        if "float" in str(e).lower():
            raise ValueError("a frame payload cannot hold NaN or infinity; use null") from None
        raise


def frame_id(raw: bytes) -> ObjectId:
    """`shadowfs.oid.hash_object("frame", raw)`, inlined because tape loads do it per record."""
    return ObjectId(blake3((_FRAME_HEADER % len(raw)) + raw).digest())


def encode_frame(
    *,
    seq: int,
    kind: str,
    time_ns: int,
    parent: bytes | None,
    mroot: bytes,
    payload: Mapping[str, Any],
    refs: Iterable[bytes] = (),
    tree: bytes | None = None,
    payload_json: bytes | None = None,
) -> bytes:
    """The frame's canonical bytes. `payload_json`: `canonical_json(payload)` when the caller
    has it already (`spill_encoded`), spliced in rather than encoded again."""
    if payload_json is None:
        payload_json = canonical_json(payload)
    ref_hex = sorted({bytes(r).hex() for r in refs}) if refs else []
    if type(seq) is int and type(time_ns) is int and kind in KNOWN_KINDS:
        # Every other field is a known kind (an identifier), an int, a hex string, null or a
        # list of hex strings, which JSON writes as they are: the envelope is formatted
        # rather than encoded (the encoder's set-up and a dict of nine keys were a third of
        # a small frame's append). Sorted keys put them in this order; tests/test_tape.py
        # checks it makes the encoder's bytes.
        return _ENVELOPE % (
            kind.encode(),
            b2a_hex(mroot),
            b'"%s"' % b2a_hex(parent) if parent is not None else b"null",
            payload_json,
            ",".join(['"' + h + '"' for h in ref_hex]).encode() if ref_hex else b"",
            seq,
            time_ns,
            b'"%s"' % b2a_hex(tree) if tree is not None else b"null",
            FORMAT_VERSION,
        )
    obj = {
        "v": FORMAT_VERSION,
        "seq": seq,
        "kind": kind,
        "time_ns": time_ns,
        "parent": parent.hex() if parent is not None else None,
        "mroot": mroot.hex(),
        "payload": 0,
        "refs": ref_hex,
        "tree": tree.hex() if tree is not None else None,
    }
    # Keys sort as kind, mroot, parent, payload, ...: the marker's first occurrence is the
    # payload's own key (kind and the hex fields before it cannot hold a bare quote).
    head, tail = canonical_json(obj).split(_PAYLOAD_MARK, 1)
    return b"".join((head, b',"payload":', payload_json, b",", tail))


_PAYLOAD_MARK = b',"payload":0,'
_ENVELOPE = (
    b'{"kind":"%s","mroot":"%s","parent":%s,"payload":%s,"refs":[%s],"seq":%d,"time_ns":%d,'
    b'"tree":%s,"v":%d}'
)


class EncodedPayload(dict[str, "Any"]):
    """A payload with the canonical JSON of each value computed once (`encode_payload`): the
    tape writer then neither encodes it again to decide what spills nor to write the frame.
    Read-only, so the encoding cannot go stale."""

    encoded: dict[str, bytes]
    # len(canonical_json(self)), once known (`payload_size`): asked twice per frame (does it
    # spill, then by the writer).
    size: int | None = None

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("an EncodedPayload is read-only; build a new one")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only
    __ior__ = _read_only

    def __reduce__(self) -> Any:  # a copy (copy, deepcopy, pickle) is a plain dict
        return (dict, (dict(self),))


def encode_payload(
    payload: Mapping[str, Any], known: Mapping[str, bytes] | None = None
) -> EncodedPayload:
    """`payload` with its values encoded; a sink that is no tape writer sees a plain dict.
    `known`: values the caller encoded already (`canonical_json(payload[key])`, each)."""
    out = EncodedPayload(payload)
    known = known or {}
    out.encoded = {
        key: known[key] if key in known else canonical_json(value) for key, value in out.items()
    }
    return out


def payload_size(payload: EncodedPayload) -> int:
    """len(canonical_json(payload)), from its encoded values."""
    if payload.size is None:
        encoded = payload.encoded
        # {} around, "key": before each value, commas between the items
        keys = sum(map(len, map(_key, encoded))) + len(encoded)
        payload.size = 2 + keys + sum(map(len, encoded.values())) + max(len(encoded) - 1, 0)
    return payload.size


_KEYS: dict[str, bytes] = {}


def _key(key: str) -> bytes:
    """A payload key's canonical JSON: the same few keys, frame after frame."""
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = canonical_json(key)
        if len(_KEYS) < 1024:
            _KEYS[key] = encoded
    return encoded


def spills(payload: EncodedPayload) -> bool:
    """Whether the tape writer will move a value of `payload` to the store (`spill_payload`)."""
    return payload_size(payload) > SPILL_THRESHOLD and any(
        len(v) > SPILL_THRESHOLD for v in payload.encoded.values()
    )


def spill_payload(
    payload: Mapping[str, Any], store: ObjectWriter | None
) -> tuple[dict[str, Any], list[ObjectId]]:
    """Move large top-level payload values into the store as `json` objects.

    Returns the payload to record (large values replaced by {"$blob": hex}) and the new refs.
    """
    body, refs, _ = spill_encoded(payload, store)
    return body, refs


def spill_encoded(
    payload: Mapping[str, Any], store: ObjectWriter | None
) -> tuple[dict[str, Any], list[ObjectId], bytes]:
    """`spill_payload`, and the canonical JSON of the payload to record: an `EncodedPayload`'s
    is its values' encodings joined (a spilled one's reference in its place)."""
    out = dict(payload)
    encoded = payload.encoded if isinstance(payload, EncodedPayload) else None
    whole = b""
    if encoded is not None and all(isinstance(key, str) for key in encoded):
        _refuse_blob_keys(out)
        # an EncodedPayload is what payload_size measures; typed as the mapping it wraps
        if payload_size(payload) <= SPILL_THRESHOLD:  # type: ignore[arg-type]
            return out, [], _join(encoded)
    else:
        try:
            whole = canonical_json(out)
        except (TypeError, ValueError):
            _refuse_blob_keys(out)  # the reserved key is said first, whatever else is wrong
            raise
        # A dict holding the key anywhere in the payload puts it in the bytes, quoted as it
        # is: the values are looked into only then (a Python loop over every value was a
        # tenth of a small frame's append).
        if _BLOB_MARK in whole:
            _refuse_blob_keys(out)
        if len(whole) <= SPILL_THRESHOLD:
            return out, [], whole
        encoded = None
    refs: list[ObjectId] = []
    kept = dict(encoded) if encoded is not None else None
    for key, value in out.items():
        data = encoded[key] if encoded is not None else canonical_json(value)
        if len(data) > SPILL_THRESHOLD:
            if store is None:
                raise ValueError(
                    f"payload value {key!r} is {len(data)} bytes and must go to the store, "
                    "but the tape writer has no store; open the writer with one"
                )
            oid = store.put("json", data)
            out[key] = {BLOB_KEY: oid.hex()}
            refs.append(oid)
            if kept is not None:
                kept[key] = canonical_json(out[key])
    # Past the threshold in total, whether or not a value spilled: the values' encodings are
    # at hand, so the payload's is their join (encoding it again was most of a streamed
    # turn's write).
    if kept is not None:
        return out, refs, _join(kept)
    return out, refs, canonical_json(out) if refs else whole


_BLOB_MARK = canonical_json(BLOB_KEY)


def _refuse_blob_keys(payload: Mapping[str, Any]) -> None:
    for key, value in payload.items():
        if isinstance(value, dict) and BLOB_KEY in value:
            raise ValueError(
                f"payload key {key!r} holds a dict with the reserved key {BLOB_KEY!r}; "
                "rename that key"
            )


def _join(encoded: Mapping[str, bytes]) -> bytes:
    """The canonical JSON of an object from its values' encodings (keys sorted, as json sorts
    str keys)."""
    parts = [_key(key) + b":" + encoded[key] for key in sorted(encoded)]
    return b"{" + b",".join(parts) + b"}"


class Frame:
    """One frame of a tape. Immutable: fields are read-only views of `raw`.

    `payload` is a plain dict for convenience; changing it changes nothing on the tape.
    """

    __slots__ = (
        "_id",
        "_kind",
        "_mroot",
        "_parent",
        "_payload",
        "_raw",
        "_refs",
        "_resolved",
        "_seq",
        "_time_ns",
        "_tree",
        "_v",
    )

    def __init__(self, raw: bytes, digest: bytes) -> None:
        self._raw = raw
        self._id = digest
        self._kind: str | None = None
        self._resolved: dict[str, Any] | None = None

    @classmethod
    def _built(
        cls,
        raw: bytes,
        digest: bytes,
        seq: int,
        kind: str,
        time_ns: int,
        parent: bytes | None,
        mroot: bytes,
        payload: dict[str, Any],
        refs: tuple[ObjectId, ...],
        tree: ObjectId | None,
    ) -> Frame:
        """The frame a writer just encoded, its fields known (positional: once per append)."""
        f = cls.__new__(cls)
        f._raw = raw
        f._id = digest
        f._resolved = None
        f._seq = seq
        f._kind = kind
        f._time_ns = time_ns
        # both 32 bytes by construction: a frame id and a Merkle root
        f._parent = unchecked_oid(ObjectId, parent) if parent is not None else None
        f._mroot = unchecked_oid(ObjectId, mroot)
        f._payload = payload
        f._refs = refs
        f._tree = tree
        f._v = FORMAT_VERSION
        return f

    def _decode(self) -> None:
        what = "its bytes are not a canonical version 1 frame"
        try:
            obj = json.loads(self._raw)
            if not isinstance(obj, dict):
                raise ValueError(what)
            seq = obj["seq"]
            kind = obj["kind"]
            time_ns = obj["time_ns"]
            payload = obj["payload"]
            v = obj["v"]
            if not (
                type(seq) is int
                and type(time_ns) is int
                and type(v) is int
                and isinstance(kind, str)
                and kind_pattern().match(kind)
                and isinstance(payload, dict)
                and isinstance(obj["refs"], list)
            ):
                raise ValueError(what)
            parent = ObjectId.from_hex(obj["parent"]) if obj["parent"] is not None else None
            mroot = ObjectId.from_hex(obj["mroot"])
            refs = tuple(ObjectId.from_hex(r) for r in obj["refs"])
            tree = ObjectId.from_hex(obj["tree"]) if obj["tree"] is not None else None
            # Only the canonical bytes have one meaning (no duplicate keys, no reordered fields),
            # so a decoded frame must re-encode to exactly what was hashed.
            if len(obj) != 9 or canonical_json(obj) != self._raw:
                raise ValueError(what)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise TamperedTape(None, self._seq_hint(), what) from None
        self._seq = seq
        self._time_ns = time_ns
        self._parent = parent
        self._mroot = mroot
        self._payload = payload
        self._refs = refs
        self._tree = tree
        self._v = v
        self._kind = kind

    def _seq_hint(self) -> int:
        found = seq_pattern().findall(self._raw)
        return int(found[-1]) if found else -1

    def _ensure(self) -> None:
        if self._kind is None:
            self._decode()

    @property
    def raw(self) -> bytes:
        return self._raw

    @property
    def id(self) -> ObjectId:
        if type(self._id) is not ObjectId:
            self._id = ObjectId(self._id)
        return self._id

    @property
    def seq(self) -> int:
        self._ensure()
        return self._seq

    @property
    def kind(self) -> str:
        self._ensure()
        # _ensure() has read the frame, so _kind is set
        return self._kind  # type: ignore[return-value]

    @property
    def time_ns(self) -> int:
        self._ensure()
        return self._time_ns

    @property
    def parent(self) -> ObjectId | None:
        self._ensure()
        return self._parent

    @property
    def mroot(self) -> ObjectId:
        self._ensure()
        return self._mroot

    @property
    def payload(self) -> dict[str, Any]:
        self._ensure()
        return self._payload

    @property
    def refs(self) -> tuple[ObjectId, ...]:
        self._ensure()
        return self._refs

    @property
    def tree(self) -> ObjectId | None:
        self._ensure()
        return self._tree

    @property
    def version(self) -> int:
        self._ensure()
        return self._v

    @property
    def known_kind(self) -> bool:
        return self.kind in KNOWN_KINDS

    def resolve_payload(self, store: ObjectReader) -> dict[str, Any]:
        """The payload with every {"$blob": oid} value loaded back from the store."""
        if self._resolved is None:
            out = dict(self.payload)
            for key, value in out.items():
                if isinstance(value, dict) and len(value) == 1 and BLOB_KEY in value:
                    out[key] = self._load_spilled(store, key, value[BLOB_KEY])
            self._resolved = out
        return self._resolved

    def _load_spilled(self, store: ObjectReader, key: str, ref: object) -> Any:
        # A hostile tape can chain valid ids over any payload, so the reference and the bytes it
        # names are untrusted (fuzzing found a non-hex ref escaping as a bare ValueError).
        try:
            if not isinstance(ref, str):
                raise ValueError
            return json.loads(store.get(ObjectId.from_hex(ref)))
        except (ValueError, RecursionError):
            raise TamperedTape(
                None,
                self.seq,
                f"payload value {key!r} does not name a stored JSON value ({BLOB_KEY} {ref!r:.80})",
            ) from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Frame) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._id)

    def __repr__(self) -> str:
        try:
            return f"Frame(seq={self.seq}, kind={self.kind!r}, id={self.id.short})"
        except TamperedTape:
            return f"Frame(undecodable, id={self.id.short})"
