"""The compiled sampler loops (dp.discrete_fused) against dp.discrete's numpy reference path.

Both paths draw the same blocks from the source in the same order, so under one deterministic
source they must give the same samples word for word; the undecided blocks (a float value within
the error bound of a decision) are forced through crafted sources, since random ones reach them
with probability about 2^-39.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp import discrete, discrete_fused, rng


def _both(fn, seed: int):  # noqa: ANN001, ANN202
    """``fn(source)`` on the fused path and on the numpy path, each with a fresh source of ``seed``."""
    out = []
    for fused in (True, False):
        old = discrete._FUSED
        discrete._FUSED = fused
        try:
            out.append(fn(rng.DeterministicTestSource(seed)))
        finally:
            discrete._FUSED = old
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(0, 3000),
       sigma=st.one_of(st.floats(0.3, 50.0), st.floats(50.0, 1e6), st.sampled_from([0.05 * 2**16, 3.0e7])))
def test_fused_discrete_gaussian_equals_the_numpy_path(seed: int, n: int, sigma: float) -> None:
    fused, ref = _both(lambda s: discrete.discrete_gaussian(n, sigma, _test_source=s), seed)
    assert fused.dtype == ref.dtype == np.int64
    np.testing.assert_array_equal(fused, ref)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(0, 3000),
       scale=st.one_of(st.floats(0.2, 1e5), st.fractions(Fraction(1, 7), Fraction(10**4, 3), max_denominator=10**6)))
def test_fused_discrete_laplace_equals_the_numpy_path(seed: int, n: int, scale: float | Fraction) -> None:
    """Scales with a denominator (``s > 1``) take the fused sign loop's division."""
    fused, ref = _both(lambda s: discrete.discrete_laplace(n, scale, _test_source=s), seed)
    np.testing.assert_array_equal(fused, ref)


def test_fused_noise_for_distributed_dp_equals_the_numpy_path() -> None:
    """FEL's client shares: sigma 0.05 on the 2^-16 grid (t = 3,277), a cohort-sized draw."""
    fused, ref = _both(lambda s: discrete.discrete_gaussian_noise((20, 4001), 0.05, 16, _test_source=s), 7)
    np.testing.assert_array_equal(fused, ref)
    assert fused.shape == (20, 4001)
    assert abs(fused.std() / 2**16 / 0.05 - 1) < 0.02


class _Crafted:
    """The given 64-bit blocks first, then a ChaCha20 keystream (a test-only source)."""

    def __init__(self, blocks: list[int], seed: int) -> None:
        self.head = b"".join(int(b).to_bytes(8, "little") for b in blocks)
        self.tail = rng.DeterministicTestSource(seed)

    def random_bytes(self, n: int) -> bytes:
        take, self.head = self.head[:n], self.head[n:]
        return take + (self.tail.random_bytes(n - len(take)) if n > len(take) else b"")


def _block_near(p: float, delta: int = 0) -> int:
    """The 64-bit block whose ``u 2^-64`` is next to ``p`` (plus ``delta`` units)."""
    return int(Fraction(p) * 2**64) + delta


@pytest.mark.parametrize("t", [1, 3, 3277])
def test_fused_geometric_flags_and_settles_blocks_at_an_integer(t: int) -> None:
    """Blocks with ``-t ln W`` a hair from an integer are flagged by the loop, settled exactly, and
    both paths agree with the definition ``floor(-t ln W)`` (exact comparisons)."""
    blocks = [_block_near(math.exp(-k / t), d) for k in (1, 2, 5) for d in (-3, 0, 3)] + [0, 1, 2**64 - 1]
    u = np.array(blocks, dtype=np.uint64)
    out, bad = np.empty(u.size, np.int64), np.empty(u.size, np.bool_)
    assert discrete_fused.geometric(u, float(t), out, bad) >= 9  # the near-integer blocks and W = 0
    for fused in (True, False):
        old, discrete._FUSED = discrete._FUSED, fused
        try:
            x = discrete._geometric_fast(len(blocks), t, _Crafted(blocks, 5))
        finally:
            discrete._FUSED = old
        for b, xi in zip(blocks[:9], x[:9]):
            assert xi == discrete._exact_floor_neg_log(b, t, 0, rng.DeterministicTestSource(9))
        assert (x >= 0).all()
    fused_x, ref_x = _both(lambda s: discrete._geometric_fast(len(blocks), t, _Crafted(blocks, 5)), 0)
    np.testing.assert_array_equal(fused_x, ref_x)


def test_fused_gauss_accept_flags_the_ambiguity_band() -> None:
    """A block within 2^-40 of ``exp(-gamma)`` is flagged, and the path's exact decision agrees
    with the numpy path's."""
    y = np.array([0, 3, -7, 12], dtype=np.int64)
    c_f, two_s2_f = 2.5, 50.0
    p = np.exp(-((np.abs(y) - c_f) ** 2 / two_s2_f))
    u = np.array([_block_near(float(pi), d) for pi, d in zip(p, (0, -5, 5, 1 << 30))], dtype=np.uint64)
    keep, amb = np.empty(4, np.bool_), np.empty(4, np.bool_)
    assert discrete_fused.gauss_accept(y, c_f, two_s2_f, u, 2.0**-40, keep, amb) == 3
    assert amb.tolist() == [True, True, True, False] and not keep[3]  # 2^-34 above: rejected outright
    u[3] = 0  # far below: accepted, not flagged
    assert discrete_fused.gauss_accept(y, c_f, two_s2_f, u, 2.0**-40, keep, amb) == 3
    assert keep[3] and not amb[3]


def test_a_wide_band_sends_draws_to_the_exact_path_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the band widened to 2^-6 about one draw in 30 takes the exact decision (more uniform
    bits against interval bounds on exp(-gamma)); both paths must still agree draw for draw."""
    monkeypatch.setattr(discrete, "_MARGIN", 2.0**-6)
    fused, ref = _both(lambda s: discrete.discrete_gaussian(400, 2.5, _test_source=s), 12)
    np.testing.assert_array_equal(fused, ref)
    assert abs(fused.std() - 2.5) < 0.5


@settings(max_examples=30, deadline=None)
@given(x=st.lists(st.integers(0, 2**40), max_size=200), s=st.integers(1, 9), seed=st.integers(0, 2**20))
def test_fused_signs_is_the_numpy_where(x: list[int], s: int, seed: int) -> None:
    xs = np.array(x, dtype=np.int64)
    u = rng.uint64s(len(x), rng.DeterministicTestSource(seed))
    out = np.empty(len(x), np.int64)
    k = discrete_fused.signs(xs, u, s, out)
    y, b = xs // s, (u & np.uint64(1)).astype(bool)
    ok = ~(b & (y == 0))
    np.testing.assert_array_equal(out[:k], np.where(b[ok], -y[ok], y[ok]))


def test_fill_gives_the_random_bytes_stream_and_uint64s_takes_any_source() -> None:
    a, b = rng.DeterministicTestSource(3), rng.DeterministicTestSource(3)
    buf = bytearray(3 * (1 << 20) + 17)  # several chunks and a ragged end
    a.fill(memoryview(buf))
    assert bytes(buf) == b.random_bytes(len(buf))
    assert a.random_bytes(64) == b.random_bytes(64)  # the streams stay in step after a fill

    class Plain:  # a RandomSource without fill
        def random_bytes(self, n: int) -> bytes:
            return rng.DeterministicTestSource(4).random_bytes(n)

    np.testing.assert_array_equal(rng.uint64s(1000, Plain()), rng.uint64s(1000, rng.DeterministicTestSource(4)))
    sys_src = rng.SystemRandomSource()
    x, y = rng.uint64s(1 << 16, sys_src), rng.uint64s(1 << 16, sys_src)
    assert not np.array_equal(x, y)  # a fresh key per request
    bits = np.unpackbits(x.view(np.uint8))
    assert abs(bits.mean() - 0.5) < 0.005
    small = bytearray(100)
    sys_src.fill(memoryview(small))  # below the bulk size: os.urandom
    assert small != bytearray(100)
