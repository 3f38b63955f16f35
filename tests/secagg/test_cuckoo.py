"""Cuckoo layouts (secagg/cuckoo.py): every element in three distinct buckets, placements one per
bucket, the failure bound checked against simulation and exact enumeration, the domain mapping."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg.cuckoo import CHOICES, CuckooError, CuckooLayout, buckets_for, failure_bound_log2


def test_every_element_sits_in_three_distinct_buckets_and_the_sizes_add_up_to_three_n():
    lay = CuckooLayout(1000, 17, seed=b"s" * 32)
    h = lay.choices(np.arange(1000))
    assert h.shape == (1000, 3) and h.min() >= 0 and h.max() < 17
    assert np.all((h[:, 0] != h[:, 1]) & (h[:, 0] != h[:, 2]) & (h[:, 1] != h[:, 2]))
    assert lay.sizes.sum() == 3000 == lay.leaves
    assert 2**lay.depth >= lay.sizes.max() > 2 ** (lay.depth - 1)
    # the buckets are balanced: every bucket near 3N/m (binomial spread)
    assert np.all(np.abs(lay.sizes - 3000 / 17) < 6 * math.sqrt(3000 / 17))
    # a different public seed gives a different table; the same seed the same one
    assert not np.array_equal(CuckooLayout(1000, 17, seed=b"t" * 32).choices(np.arange(1000)), h)
    assert np.array_equal(CuckooLayout(1000, 17, seed=b"s" * 32).choices(np.arange(1000)), h)


def test_a_placement_puts_each_point_in_one_of_its_buckets_at_its_position():
    lay = CuckooLayout(500, 30, seed=b"p" * 32)
    rng = np.random.default_rng(1)
    for _ in range(20):
        xs = rng.choice(500, 20, replace=False)
        bucket, position = lay.assign(xs)
        assert len(set(bucket.tolist())) == 20
        h = lay.choices(xs)
        assert np.all((h == bucket[:, None]).any(axis=1))
        # position = rank of (x, bucket) among the bucket's elements in increasing x order
        for x, b, p in zip(xs, bucket, position):
            members = np.flatnonzero((lay.choices(np.arange(500)) == b).any(axis=1))
            assert members[p] == x


def test_to_domain_and_from_domain_are_the_public_linear_maps():
    lay = CuckooLayout(50, 7, seed=b"d" * 32)
    table = np.arange(100, dtype=np.uint64).reshape(50, 2)
    flat = lay.from_domain(table)
    assert np.array_equal(lay.to_domain(flat), 3 * table)  # every element comes back from its 3 copies
    one = np.zeros((lay.leaves, 2), np.uint64)
    bucket, position = lay.assign(np.array([13]))
    one[lay.offsets[bucket[0]] + position[0]] = [5, 6]
    out = lay.to_domain(one)
    assert out[13].tolist() == [5, 6] and int(out.sum()) == 11


def test_spread_fills_every_bucket_and_puts_zero_values_in_the_empty_ones():
    lay = CuckooLayout(200, 12, seed=b"z" * 32)
    xs = np.array([3, 77, 150])
    vals = np.array([[1], [2], [3]], np.uint64)
    alpha, beta = lay.spread(xs, vals)
    assert alpha.shape == (12,) and np.all((alpha >= 0) & (alpha < lay.sizes))
    bucket, position = lay.assign(xs)
    assert np.array_equal(alpha[bucket], position) and np.array_equal(beta[bucket], vals)
    assert int((beta != 0).sum()) == 3


def test_impossible_placements_raise_cuckoo_error():
    lay = CuckooLayout(100, 3)
    with pytest.raises(CuckooError, match="cannot be placed"):
        lay.assign(np.arange(4))  # four points, three buckets
    with pytest.raises(ValueError, match="distinct"):
        lay.assign(np.array([1, 1]))
    with pytest.raises(ValueError, match="elements of"):
        lay.assign(np.array([100]))
    # four points whose three choices coincide can never be placed, whatever the algorithm
    lay = CuckooLayout(3000, 5, seed=b"c" * 32)
    h = np.sort(lay.choices(np.arange(3000)), axis=1)
    groups: dict[tuple, list[int]] = {}
    for x, row in enumerate(map(tuple, h)):
        groups.setdefault(row, []).append(x)
    same = next(v for v in groups.values() if len(v) >= 4)
    with pytest.raises(CuckooError, match="no free bucket"):
        lay.assign(np.array(same[:4]))


def _exact_failure(points: int, buckets: int) -> float:
    """Exact probability that ``points`` uniform triples of distinct buckets admit no system of
    distinct representatives (Hall), by enumeration (tiny sizes only)."""
    triples = list(itertools.combinations(range(buckets), CHOICES))
    fail = 0
    for combo in itertools.product(range(len(triples)), repeat=points):
        sets = [triples[c] for c in combo]
        ok = any(len(set(choice)) == points for choice in itertools.product(*sets))
        fail += not ok
    return fail / len(triples) ** points


@pytest.mark.parametrize(("points", "buckets"), [(4, 4), (4, 5), (4, 6)])
def test_the_failure_bound_is_above_the_exact_probability(points, buckets):
    exact = _exact_failure(points, buckets)
    assert exact > 0
    assert 2.0 ** failure_bound_log2(points, buckets) * (1 + 1e-9) >= exact  # tight here: one violating shape


def test_the_failure_bound_is_above_simulated_failures_and_falls_with_more_buckets():
    rng = np.random.default_rng(7)
    points = 20
    buckets = buckets_for(points, failure_bits=5)  # bound <= 1/32
    lay = CuckooLayout(20000, buckets, seed=b"f" * 32)
    trials, fails = 3000, 0
    for _ in range(trials):
        try:
            lay.assign(rng.choice(20000, points, replace=False))
        except CuckooError:
            fails += 1
    assert fails / trials <= 2.0**-5 + 3 * math.sqrt(2.0**-5 / trials)
    assert failure_bound_log2(100, 150) > failure_bound_log2(100, 230)
    assert buckets_for(100) == 230 and buckets_for(1) == 3 and buckets_for(3) == 3
    assert failure_bound_log2(100, 230) <= -40 < failure_bound_log2(100, 229)


def test_layout_parameters_are_checked():
    with pytest.raises(ValueError, match="buckets"):
        CuckooLayout(10, 2)
    with pytest.raises(ValueError, match="domain"):
        CuckooLayout(0, 5)
    with pytest.raises(ValueError, match="seed"):
        CuckooLayout(10, 5, seed=b"short")
    with pytest.raises(ValueError, match="points"):
        buckets_for(0)


@settings(max_examples=60, deadline=None)
@given(domain=st.integers(5, 400), buckets=st.integers(3, 60), fill=st.floats(0.1, 1.0), seed=st.integers(0, 2**31))
def test_cuckoo_insertion_places_validly_and_fails_exactly_when_the_matching_does(domain, buckets, fill, seed):
    """The compiled insertion (secagg/cuckoo_fused.py) returns only valid placements, and assign, which
    falls back to the exact matching when it gives up, refuses exactly the point sets the matching
    refuses (a client sits out only when no placement exists)."""
    from secagg import cuckoo, cuckoo_fused

    lay = CuckooLayout(domain, buckets, seed=seed.to_bytes(4, "big") * 8)
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test points only
    xs = rng.choice(domain, min(domain, max(1, int(fill * buckets))), replace=False)
    h = lay.choices(xs)
    out = np.empty(xs.size, np.int64)
    if cuckoo_fused.place(h, buckets, 64 + 16 * xs.size, out):
        assert len(set(out.tolist())) == xs.size and np.all((h == out[:, None]).any(axis=1))
    try:
        exact = lay._match(xs, h)
    except CuckooError:
        exact = None
    try:
        bucket, position = lay.assign(xs)
    except CuckooError:
        assert exact is None
        return
    assert exact is not None
    assert len(set(bucket.tolist())) == xs.size and np.all((h == bucket[:, None]).any(axis=1))
    alpha, _ = lay.spread(xs, np.ones((xs.size, 1), np.uint64))
    assert np.array_equal(alpha[bucket], position)
    # with the insertion giving up at once, assign takes the matching and places the same points
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuckoo, "_fused", lambda: _GivesUp)
        b2, p2 = lay.assign(xs)
        alpha2, _ = lay.spread(xs, np.ones((xs.size, 1), np.uint64), checked=True)  # the one pass gives up too
    assert len(set(b2.tolist())) == xs.size and np.all((h == b2[:, None]).any(axis=1))
    assert np.array_equal(alpha2[b2], p2)


class _GivesUp:
    """A compiled module whose insertion always gives up (the callers must take the exact matching)."""

    @staticmethod
    def place(h, m, steps, out):  # noqa: ANN001, ANN205, ARG004
        return False

    @staticmethod
    def spread(*args):  # noqa: ANN002, ANN205, ARG004
        return 1


def _urandom_from(seed: int):  # noqa: ANN202 - a deterministic stand-in for os.urandom (test only)
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test stand-in, compared between two paths
    return lambda n: rng.integers(0, 256, n, dtype=np.uint8).tobytes()


@settings(max_examples=60, deadline=None)
@given(domain=st.integers(5, 300), buckets=st.integers(3, 50), fill=st.floats(0.0, 1.0), width=st.integers(1, 5),
       seed=st.integers(0, 2**31))
def test_the_one_pass_spread_equals_the_general_path_on_the_same_draws(domain, buckets, fill, width, seed):
    """spread(checked=True) runs decoys, insertion, positions and values as one compiled pass
    (secagg.cuckoo_fused.spread); given the same CSPRNG bytes it returns exactly what the general path
    (decoys, assign, scatter) returns, and it refuses exactly the same point sets."""
    from secagg import cuckoo

    lay = CuckooLayout(domain, buckets, seed=seed.to_bytes(4, "big") * 8)
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test points only
    xs = np.sort(rng.choice(domain, min(domain, buckets, int(fill * buckets)), replace=False)).astype(np.int64)
    values = rng.integers(0, 2**64, (xs.size, width), dtype=np.uint64)
    got = want = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuckoo.os, "urandom", _urandom_from(seed))
        try:
            got = lay.spread(xs, values, checked=True)
        except CuckooError:
            pass
        mp.setattr(cuckoo.os, "urandom", _urandom_from(seed))
        try:
            want = lay.spread(xs, values)
        except CuckooError:
            pass
    assert (got is None) == (want is None)
    if got is not None:
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_a_rejected_decoy_draw_is_drawn_again_not_biased():
    """A decoy draw above the largest multiple of its bucket's size is rejected (exact uniformity): the
    one pass hands the client to the general path, which draws fresh bytes; no position is out of its
    bucket."""
    from secagg import cuckoo

    lay = CuckooLayout(40, 7)
    sizes = lay.sizes
    assert any(int(s) & (int(s) - 1) for s in sizes if s)  # some size is not a power of two: all-ones is rejected
    calls = []

    def urandom(n):  # noqa: ANN001, ANN202
        calls.append(n)
        return b"\xff" * n if len(calls) == 1 else bytes(n)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuckoo.os, "urandom", urandom)
        alpha, beta = lay.spread(np.array([3], np.int64), np.ones((1, 2), np.uint64), checked=True)
    assert len(calls) >= 2
    assert np.all((alpha >= 0) & (alpha < np.maximum(sizes, 1))) and int(beta.sum()) == 2


def test_the_one_pass_never_reads_outside_its_tables_for_points_outside_the_domain():
    """spread(checked=True) trusts its caller's check, but its compiled pass still refuses a point outside
    the domain (status 3: nothing read out of bounds) and hands it to the general path."""
    from secagg import cuckoo_fused

    lay = CuckooLayout(40, 7)
    todo, span, top = lay._decoy_tables()
    _, offsets, slot = lay._slots()
    for bad in (-1, 40, 10**9):
        alpha, beta = np.zeros(7, np.int64), np.zeros((7, 1), np.uint64)
        status = cuckoo_fused.spread(np.array([3, bad], np.int64), np.ones((2, 1), np.uint64), lay._hash_table(), slot,
                                     offsets, 100, np.zeros(todo.size, np.uint64), todo, span, top, alpha, beta)
        assert status == 3
