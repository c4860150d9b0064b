"""The zero cover's book and plans (``kvvmm/driver/zerocover.py``), on a CPU.

A reservation is played as the driver plays it with ``zero_page`` on: a map of ``[lo, hi)``
unmaps the pieces :meth:`ZeroCover.uncover` names and maps the ones it plans, an unmap maps
:meth:`ZeroCover.cover`'s pieces back. After every step the zero pieces and the real maps
tile the reservation exactly, every piece has one of the sizes and is aligned to its size
from the reservation's start, and no plan touches VA it need not.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvvmm.driver.zerocover import ZeroCover, runs

G = 2 << 20
BASE = 1 << 40


def test_piece_sizes_halve_from_the_block_to_the_granularity() -> None:
    assert ZeroCover(G, 32 * G).sizes == (G, 2 * G, 4 * G, 8 * G, 16 * G, 32 * G)
    assert ZeroCover(G, G).sizes == (G,)
    for bad in (0, -G, 3 * G, G + 4096, 6 * G):
        with pytest.raises(ValueError):
            ZeroCover(G, bad)


def test_a_reservation_is_covered_by_blocks_and_halving_edges() -> None:
    z = ZeroCover(G, 8 * G)
    z.add_reservation(BASE, 27 * G)
    plan = z.cover(BASE, BASE + 27 * G)
    assert plan == [(BASE, 8 * G), (BASE + 8 * G, 8 * G), (BASE + 16 * G, 8 * G),
                    (BASE + 24 * G, 2 * G), (BASE + 26 * G, G)]
    z.add(plan)
    assert z.covered_bytes == 27 * G and len(z) == 5
    # A map of one granule in the middle of the second block: that block goes, and its
    # remainders come back as halving pieces (two on the left, one on the right).
    old, new = z.uncover(BASE + 11 * G, BASE + 12 * G)
    assert old == [(BASE + 8 * G, 8 * G)]
    assert new == [(BASE + 8 * G, 2 * G), (BASE + 10 * G, G),
                   (BASE + 12 * G, 4 * G)]
    # Granule-only: the same map leaves 7 granules.
    g1 = ZeroCover(G, G)
    g1.add_reservation(BASE, 16 * G)
    g1.add(g1.cover(BASE, BASE + 16 * G))
    assert len(g1) == 16
    assert g1.uncover(BASE + 3 * G, BASE + 4 * G) == ([(BASE + 3 * G, G)], [])


def test_alignment_is_relative_to_the_reservation_start() -> None:
    z = ZeroCover(G, 4 * G)
    base = BASE + G  # not block-aligned in absolute terms
    z.add_reservation(base, 8 * G)
    assert z.cover(base, base + 8 * G) == [(base, 4 * G), (base + 4 * G, 4 * G)]


def test_records_refuse_what_breaks_the_invariants() -> None:
    z = ZeroCover(G, 4 * G)
    z.add_reservation(BASE, 16 * G)
    z.add([(BASE, 4 * G)])
    with pytest.raises(ValueError):
        z.add([(BASE + 2 * G, 2 * G)])  # overlaps
    with pytest.raises(ValueError):
        z.add([(BASE + 6 * G, 4 * G)])  # misaligned for its size
    with pytest.raises(ValueError):
        z.add([(BASE + 8 * G, 3 * G)])  # not a piece size
    with pytest.raises(ValueError):
        z.add([(BASE + 16 * G, G)])  # outside the reservation
    with pytest.raises(ValueError):
        z.cover(BASE, BASE + 8 * G)  # partly covered already
    with pytest.raises(ValueError):
        z.remove([(BASE, 2 * G)])  # not recorded so
    with pytest.raises(ValueError):
        z.drop_reservation(BASE)  # still has pieces
    with pytest.raises(ValueError):
        z.add_reservation(BASE + 8 * G, 16 * G)  # overlaps the reservation
    z.remove([(BASE, 4 * G)])
    z.drop_reservation(BASE)
    assert len(z) == 0 and z.covered_bytes == 0


def test_gaps_and_runs() -> None:
    z = ZeroCover(G, 4 * G)
    z.add_reservation(BASE, 16 * G)
    z.add([(BASE, 4 * G), (BASE + 8 * G, G)])
    assert z.gaps(BASE, BASE + 10 * G) == [(BASE + 4 * G, BASE + 8 * G),
                                           (BASE + 9 * G, BASE + 10 * G)]
    assert z.gaps(BASE + G, BASE + 3 * G) == []
    assert runs([(0, 2), (2, 2), (6, 1)]) == [(0, 4), (6, 7)]


def _levels(z: ZeroCover) -> int:
    return len(z.sizes) - 1


def _check(z: ZeroCover, base: int, size: int, real: dict[int, int]) -> None:
    pieces = list(z)
    for s, n in pieces:
        assert n in z.sizes and (s - base) % n == 0, (s - base, n)
    spans = sorted(pieces + list(real.items()))
    pos = base
    for s, n in spans:
        assert s == pos, f"hole or overlap at {(s - base) // G}"
        pos = s + n
    assert pos == base + size
    assert z.covered_bytes == sum(n for _, n in pieces)


@settings(max_examples=300, deadline=None)
@given(
    block_log=st.integers(0, 5),
    granules=st.integers(1, 200),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6), st.integers(1, 40)),
                 max_size=60),
)
def test_random_maps_and_unmaps_keep_the_tiling(
    block_log: int, granules: int, ops: list[tuple[bool, int, int]]
) -> None:
    z = ZeroCover(G, G << block_log)
    size = granules * G
    z.add_reservation(BASE, size)
    first = z.cover(BASE, BASE + size)
    assert all(s >= BASE and s + n <= BASE + size for s, n in first)
    # Whole blocks, plus at most log2(Z/g) pieces at the unaligned tail.
    assert len(first) <= granules // (1 << block_log) + _levels(z)
    z.add(first)
    real: dict[int, int] = {}
    _check(z, BASE, size, real)
    for is_map, where, n in ops:
        if is_map:
            lo_g = where % granules
            n = min(n, granules - lo_g)
            lo, hi = BASE + lo_g * G, BASE + (lo_g + n) * G
            if any(s < hi and lo < s + m for s, m in real.items()):
                continue  # the driver refuses a map over a real mapping before planning
            old, new = z.uncover(lo, hi)
            # Only pieces that overlap [lo, hi); only VA they covered outside it.
            assert old and all(s < hi and lo < s + m for s, m in old)
            outside = [(s, s + m) for s, m in old]
            for s, m in new:
                assert s + m <= lo or s >= hi
                assert any(a <= s and s + m <= b for a, b in outside)
            assert len(new) <= 2 * _levels(z)
            # Every byte of old outside [lo, hi) comes back, once.
            assert sum(m for _, m in old) == sum(m for _, m in new) + (hi - lo)
            z.remove(old)
            z.add(new)
            real[lo] = hi - lo
        elif real:
            starts = sorted(real)
            lo = starts[where % len(starts)]
            # Sometimes a run of adjacent real maps at once, as the arena unmaps.
            hi = lo + real.pop(lo)
            while n % 2 and hi in real:
                hi += real.pop(hi)
                n //= 2
            plan = z.cover(lo, hi)
            assert plan[0][0] == lo and plan[-1][0] + plan[-1][1] == hi
            assert len(plan) <= (hi - lo) // z.block + 2 * _levels(z)
            z.add(plan)
        _check(z, BASE, size, real)
    # Free: every real map goes, then the cover; the book ends empty.
    for lo, m in sorted(real.items()):
        z.add(z.cover(lo, lo + m))
    z.remove(list(z))
    z.drop_reservation(BASE)
    assert len(z) == 0 and z.covered_bytes == 0


@settings(max_examples=100, deadline=None)
@given(block_log=st.integers(0, 6), lo=st.integers(0, 300), n=st.integers(1, 300))
def test_a_cover_is_the_fewest_aligned_pieces(block_log: int, lo: int, n: int) -> None:
    """The greedy tiling is the canonical dyadic one: no two pieces could merge into one
    aligned piece of a size the cover has."""
    z = ZeroCover(G, G << block_log)
    z.add_reservation(BASE, 1024 * G)
    lo = min(lo, 1023)
    hi = min(lo + n, 1024)
    plan = z.cover(BASE + lo * G, BASE + hi * G)
    for (a, m), (b, k) in itertools.pairwise(plan):
        assert a + m == b
        if m == k and m < z.block:
            assert (a - BASE) % (2 * m) != 0  # else these two would be one piece of 2m
