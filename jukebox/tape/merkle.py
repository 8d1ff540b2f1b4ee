"""RFC 6962 Merkle tree hashing over tape frame ids, with BLAKE3-256 as the hash.

The shapes follow RFC 6962 section 2.1 (and its successor RFC 9162 section 2.1): a leaf hashes as
H(0x00 || data), an interior node as H(0x01 || left || right), the empty tree as H(""), and a tree
of n > 1 leaves splits at the largest power of two below n. The 0x00/0x01 prefixes stop a leaf from
being passed off as a node (second-preimage attack on the tree).

The tape stores a root per frame, so roots are built incrementally: `Accumulator` keeps one root
per perfect subtree (the binary decomposition of the leaf count), which makes append O(1)
amortised and a root O(log n).
"""

from __future__ import annotations

from collections.abc import Sequence

from blake3 import blake3

HASH_SIZE = 32
EMPTY_ROOT = blake3(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    return blake3(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return blake3(b"\x01" + left + right).digest()


class Accumulator:
    """Merkle root of a growing list of leaves, O(log n) memory.

    `_stack` holds the roots of perfect subtrees, largest first; their sizes are the set bits of
    `count`, so appending merges one pair per trailing 1 bit, like a binary counter carrying.
    Each is kept behind its 0x01 node prefix, as it is hashed every time it is a left child
    (every root): one concatenation fewer per node hash, a tape append's most frequent.
    Folding the stack right to left gives exactly RFC 6962's MTH, because MTH splits off the
    largest power of two first.
    """

    __slots__ = ("_hasher", "_stack", "count")

    def __init__(self) -> None:
        self._stack: list[bytes] = []
        self.count = 0
        # Resetting one hasher is about three times cheaper than constructing one per node. It
        # makes an Accumulator unsafe to share between threads without a lock.
        self._hasher = blake3()

    def _h(self, data: bytes) -> bytes:
        hasher = self._hasher
        hasher.update(data)
        out = hasher.digest()
        hasher.reset()
        return out

    def append(self, data: bytes) -> None:
        self.append_leaf_hash(self._h(b"\x00" + data))

    def append_leaf_hash(self, h: bytes) -> None:
        stack = self._stack
        n = self.count
        if n & 1:
            hasher = self._hasher
            while n & 1:
                hasher.update(stack.pop() + h)
                h = hasher.digest()
                hasher.reset()
                n >>= 1
        stack.append(b"\x01" + h)
        self.count += 1

    def root(self) -> bytes:
        """The root of the leaves so far: log2(count) hashes, folded here rather than through
        `_h` (a tape append asks for one, and the calls were half of its cost)."""
        stack = self._stack
        if not stack:
            return EMPTY_ROOT
        h = stack[-1][1:]
        if len(stack) > 1:
            hasher = self._hasher
            update, digest, reset = hasher.update, hasher.digest, hasher.reset
            for i in range(len(stack) - 2, -1, -1):
                update(stack[i] + h)
                h = digest()
                reset()
        return h

    def copy(self) -> Accumulator:
        other = Accumulator()
        other._stack = list(self._stack)
        other.count = self.count
        return other


def _range_root(hashes: Sequence[bytes], lo: int, hi: int) -> bytes:
    acc = Accumulator()
    for i in range(lo, hi):
        acc.append_leaf_hash(hashes[i])
    return acc.root()


def _split(n: int) -> int:
    """Largest power of two strictly below n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root(leaves: Sequence[bytes]) -> bytes:
    """MTH over the leaf data (frame ids), RFC 6962 section 2.1."""
    acc = Accumulator()
    for leaf in leaves:
        acc.append(leaf)
    return acc.root()


def inclusion_proof(leaves: Sequence[bytes], index: int) -> list[bytes]:
    """Audit path PATH(index, D[n]) of RFC 6962 section 2.1.1, leaf-side sibling first."""
    n = len(leaves)
    if not 0 <= index < n:
        raise ValueError(f"leaf index {index} is outside a tree of {n} leaves")
    hashes = [leaf_hash(x) for x in leaves]
    path: list[bytes] = []
    lo, hi = 0, n
    # The RFC recursion appends each sibling after recursing, so walking down collects them root
    # first; reversing gives the RFC order.
    while hi - lo > 1:
        k = _split(hi - lo)
        if index < lo + k:
            path.append(_range_root(hashes, lo + k, hi))
            hi = lo + k
        else:
            path.append(_range_root(hashes, lo, lo + k))
            lo += k
    path.reverse()
    return path


def verify_inclusion(
    leaf: bytes, index: int, size: int, proof: Sequence[bytes], root_hash: bytes
) -> bool:
    """True when `leaf` (leaf data) is leaf `index` of the tree of `size` leaves with `root_hash`.

    The algorithm of RFC 9162 section 2.1.3.2.
    """
    if not 0 <= index < size:
        return False
    fn, sn = index, size - 1
    r = leaf_hash(leaf)
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root_hash


def consistency_proof(leaves: Sequence[bytes], m: int) -> list[bytes]:
    """PROOF(m, D[n]) of RFC 6962 section 2.1.2: the first m leaves are a prefix of all n."""
    n = len(leaves)
    if not 0 <= m <= n:
        raise ValueError(f"cannot prove a tree of {m} leaves consistent with one of {n}")
    if m == 0 or m == n:
        return []
    hashes = [leaf_hash(x) for x in leaves]
    path: list[bytes] = []
    lo, hi, mm, whole = 0, n, m, True
    while True:
        size = hi - lo
        if mm == size:
            if not whole:
                path.append(_range_root(hashes, lo, hi))
            break
        k = _split(size)
        if mm <= k:
            path.append(_range_root(hashes, lo + k, hi))
            hi = lo + k
        else:
            path.append(_range_root(hashes, lo, lo + k))
            lo += k
            mm -= k
            whole = False
    path.reverse()
    return path


def verify_consistency(
    m: int, n: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> bool:
    """True when the tree of m leaves with `old_root` is a prefix of the one of n with `new_root`.

    The algorithm of RFC 9162 section 2.1.4.2; m == 0 (the empty tree) is a prefix of everything.
    """
    if not 0 <= m <= n:
        return False
    if m == n:
        return not proof and old_root == new_root
    if m == 0:
        return not proof
    nodes = list(proof)
    if m & (m - 1) == 0:
        nodes.insert(0, old_root)
    if not nodes:
        return False
    fn, sn = m - 1, n - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = nodes[0]
    for c in nodes[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root
