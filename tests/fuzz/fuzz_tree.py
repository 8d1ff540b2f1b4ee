"""Trees: `decode_tree` on any bytes, and a decoded tree walked, diffed and read through a store.

Allowed outcome: `TreeError` from decoding; any `ShadowfsError` once a store is involved (a
hostile tree names sub-trees the store does not hold). A tree that decodes must re-encode to the
very same bytes (the encoding is canonical: one directory state, one id).
"""

from __future__ import annotations

from functools import cache

from shadowfs import tree
from shadowfs.errors import ShadowfsError, TreeError
from shadowfs.oid import ObjectId
from shadowfs.store import Store
from tests.fuzz.common import Target
from tests.fuzz.scratch import scratch

_OID = ObjectId(bytes(range(32)))


@cache
def _store() -> Store:
    return Store.open(scratch() / "tree-store")


def _seeds() -> list[bytes]:
    store = _store()
    leaf = tree.encode_tree(
        [tree.Entry(b"f", tree.FILE, 0o644, 5, 1, store.put("blob", b"hello"), None)]
    )
    sub = store.put("tree", leaf)
    entries = [
        tree.Entry(b"a.txt", tree.FILE, 0o644, 3, 1_700_000_000_000_000_000, _OID, None),
        tree.Entry(b"dir", tree.DIR, 0o755, 0, -5, sub, None),
        tree.Entry(b"link", tree.SYMLINK, 0o777, 6, 0, None, b"../etc"),
        tree.Entry(b"new\nline \xff\xfe", tree.FILE, 0o4755, 0, 2, _OID, None),
        tree.Entry(b"x" * 255, tree.FILE, 0o600, 1 << 40, 3, _OID, None),
    ]
    # Version 2: fifos, sockets, devices and hard-linked files.
    specials = [
        tree.Entry(b"pipe", tree.FIFO, 0o640, 0, 4, None, None),
        tree.Entry(b"sock", tree.SOCKET, 0o755, 0, 5, None, None),
        tree.Entry(b"null", tree.CHARDEV, 0o666, 0, 6, None, None, (1 << 8) | 3),
        tree.Entry(b"loop0", tree.BLOCKDEV, 0o600, 0, 7, None, None, 7 << 8),
        tree.Entry(b"one", tree.FILE, 0o644, 3, 8, _OID, None, 0, 1 << 63),
        tree.Entry(b"two", tree.FILE, 0o644, 3, 8, _OID, None, 0, 1 << 63),
    ]
    return [tree.encode_tree(entries), leaf, tree.encode_tree([]), tree.encode_tree(specials)]


def tree_input(data: bytes) -> None:
    try:
        entries = tree.decode_tree(data)
    except TreeError:
        return
    again = tree.encode_tree(entries)
    if again != data:
        raise AssertionError(f"decoded tree re-encodes differently: {again[:80]!r}")
    store = _store()
    oid = store.put("tree", data)
    try:
        list(tree.walk(store, oid))
        tree.diff_trees(store, None, oid)
        tree.diff_trees(store, oid, None)
        tree.reachable(store, oid)
        for e in entries:
            tree.lookup(store, oid, e.name + b"/x")
    except ShadowfsError:
        pass


TARGETS = [Target("tree", tree_input, _seeds, "decode_tree round trip, walk, diff, lookup")]
