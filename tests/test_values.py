"""shadowfs.values.Value keeps what the frozen dataclasses it replaced gave their users: equality
and hashing by the value's fields (a cache slot left out), the same repr, no assignment after
construction, copies and pickles that come back equal; Entry.replace drops the cached record."""

from __future__ import annotations

import copy
import pickle

import pytest

from jukebox.config import Config
from jukebox.tape.tape import Head, VerifyReport
from shadowfs.oid import hash_object
from shadowfs.pack import Found, RecordHeader
from shadowfs.store_index import IndexEntry
from shadowfs.tree import Entry, decode_tree, encode_tree

OID = hash_object("blob", b"x")
OTHER = hash_object("blob", b"y")


def _entry(**changes: object) -> Entry:
    base: dict[str, object] = {"name": b"a.txt", "kind": "file", "mode": 0o644, "size": 1,
                               "mtime_ns": 5, "oid": OID, "target": None}  # fmt: skip
    return Entry(**{**base, **changes})  # type: ignore[arg-type]  # the test's own values


def test_equal_by_fields_hashable_and_shown_like_a_dataclass() -> None:
    a, b = _entry(), _entry()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != _entry(mode=0o600) and a != _entry(link=3)
    assert repr(a) == (
        f"Entry(name=b'a.txt', kind='file', mode=420, size=1, mtime_ns=5, oid={OID!r}, "
        "target=None, rdev=0, link=0)"
    )
    header = RecordHeader(OID, "blob", 0, 7, 1, 1, None)
    assert Found(3, header) == Found(3, RecordHeader(OID, "blob", 0, 7, 1, 1, None))
    assert Found(3, header) != Found(4, header)
    # Another class with the same fields is not equal (a dataclass compares its own class only).
    assert Head(1, None, OID) != (1, None, OID)
    with pytest.raises(TypeError):
        hash(Config(None, {"a": 1}))  # a dict field: unhashable, as the dataclass was


def test_the_cached_record_is_not_part_of_the_value() -> None:
    (decoded,) = decode_tree(encode_tree([_entry()]))
    entry = _entry()  # a fresh one: encoding fills the record of what it encodes
    assert decoded.record is not None and entry.record is None
    assert decoded == entry and hash(decoded) == hash(entry)
    changed = decoded.replace(oid=OTHER)
    assert changed.oid == OTHER and changed.name == entry.name
    assert changed.record is None  # the old bytes would encode the old oid
    with pytest.raises(TypeError):
        entry.replace(colour="red")


def test_no_assignment_after_construction() -> None:
    entry = _entry()
    with pytest.raises(AttributeError, match="cannot assign to field 'mode'"):
        entry.mode = 0o600  # type: ignore[misc]  # what the test checks is refused
    with pytest.raises(AttributeError):
        del entry.name
    with pytest.raises(AttributeError):
        Head(1, None, OID).count = 2  # type: ignore[misc]  # what the test checks is refused
    assert entry.mode == 0o644


def test_copies_and_pickles_come_back_equal() -> None:
    moved = IndexEntry(OID, "blob", "pack-a.pack", 10, 5, 5, 5, None, 0, 1)
    (entry,) = decode_tree(encode_tree([_entry()]))
    for value in (moved, entry, Config(None, {"image": "minimal"}), Head(2, OTHER, OID)):
        assert copy.copy(value) == value
        assert copy.deepcopy(value) == value
        assert pickle.loads(pickle.dumps(value)) == value
    assert copy.copy(entry).record == entry.record
    assert moved.moved("pack-b.pack", 20) == IndexEntry(
        OID, "blob", "pack-b.pack", 20, 5, 5, 5, None, 0, 1
    )


def test_a_verify_report_stays_mutable_and_unhashable() -> None:
    report = VerifyReport(True, Head(0, None, OID))
    assert report.problems == [] and report == VerifyReport(True, Head(0, None, OID))
    report.ok = False
    assert report != VerifyReport(True, Head(0, None, OID))
    with pytest.raises(TypeError):
        hash(report)
