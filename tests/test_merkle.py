"""jukebox.tape.merkle against a literal transcription of the RFC 6962 section 2.1 recursions."""

from __future__ import annotations

from blake3 import blake3

from jukebox.tape import merkle


def H(data: bytes) -> bytes:
    return blake3(data).digest()


def ref_mth(d: list[bytes]) -> bytes:
    n = len(d)
    if n == 0:
        return H(b"")
    if n == 1:
        return H(b"\x00" + d[0])
    k = 1
    while k * 2 < n:
        k *= 2
    return H(b"\x01" + ref_mth(d[:k]) + ref_mth(d[k:]))


def ref_split(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    n = len(d)
    if n == 1:
        return []
    k = ref_split(n)
    if m < k:
        return [*ref_path(m, d[:k]), ref_mth(d[k:])]
    return [*ref_path(m - k, d[k:]), ref_mth(d[:k])]


def ref_subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    n = len(d)
    if m == n:
        return [] if b else [ref_mth(d)]
    k = ref_split(n)
    if m <= k:
        return [*ref_subproof(m, d[:k], b), ref_mth(d[k:])]
    return [*ref_subproof(m - k, d[k:], False), ref_mth(d[:k])]


def ref_proof(m: int, d: list[bytes]) -> list[bytes]:
    return ref_subproof(m, d, True)


LEAVES = [H(b"frame %d" % i) for i in range(40)]


def test_empty_tree_root_is_hash_of_empty_string() -> None:
    assert merkle.root([]) == H(b"") == merkle.EMPTY_ROOT


def test_roots_match_reference_for_every_size() -> None:
    acc = merkle.Accumulator()
    for n in range(len(LEAVES) + 1):
        assert merkle.root(LEAVES[:n]) == ref_mth(LEAVES[:n])
        assert acc.root() == ref_mth(LEAVES[:n])
        assert acc.count == n
        if n < len(LEAVES):
            acc.append(LEAVES[n])


def test_accumulator_copy_is_independent() -> None:
    acc = merkle.Accumulator()
    for leaf in LEAVES[:5]:
        acc.append(leaf)
    snap = acc.copy()
    acc.append(LEAVES[5])
    assert snap.root() == ref_mth(LEAVES[:5])
    assert acc.root() == ref_mth(LEAVES[:6])


def test_inclusion_proofs_match_reference_and_verify() -> None:
    for n in range(1, 34):
        d = LEAVES[:n]
        r = ref_mth(d)
        for i in range(n):
            proof = merkle.inclusion_proof(d, i)
            assert proof == ref_path(i, d)
            assert merkle.verify_inclusion(d[i], i, n, proof, r)
            # The wrong leaf, index or root must fail. (A wrong size can pass when the proof
            # shape is the same: the size is authenticated by whoever vouches for the root.)
            assert not merkle.verify_inclusion(H(b"other"), i, n, proof, r)
            assert not merkle.verify_inclusion(d[i], i, n, proof, H(b"x"))
            if n > 1:
                assert not merkle.verify_inclusion(d[i], (i + 1) % n, n, proof, r)


def test_inclusion_proof_rejects_index_out_of_range() -> None:
    assert not merkle.verify_inclusion(LEAVES[0], 3, 3, [], ref_mth(LEAVES[:3]))
    try:
        merkle.inclusion_proof(LEAVES[:3], 3)
    except ValueError as e:
        assert "outside" in str(e)
    else:
        raise AssertionError("an out-of-range index must raise")


def test_consistency_proofs_match_reference_and_verify() -> None:
    for n in range(1, 34):
        d = LEAVES[:n]
        new = ref_mth(d)
        for m in range(0, n + 1):
            proof = merkle.consistency_proof(d, m)
            old = ref_mth(d[:m])
            if 0 < m < n:
                assert proof == ref_proof(m, d)
            else:
                assert proof == []
            assert merkle.verify_consistency(m, n, old, new, proof)
            if 0 < m < n:
                # A different old history must not pass as a prefix.
                forged = ref_mth([H(b"forged"), *d[1:m]])
                assert not merkle.verify_consistency(m, n, forged, new, proof)
                assert not merkle.verify_consistency(m, n, old, H(b"x"), proof)
                if proof:
                    bad = [*proof[:-1], H(b"tampered")]
                    assert not merkle.verify_consistency(m, n, old, new, bad)


def test_consistency_rejects_shrinking_tree() -> None:
    assert not merkle.verify_consistency(5, 4, ref_mth(LEAVES[:5]), ref_mth(LEAVES[:4]), [])
