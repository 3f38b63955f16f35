"""The open uniform behind float Laplace/Gaussian noise, driven by injected raw bits.

Issue 8, item 6: the old ``(k + 1/2) / 2^53`` with a 53-bit ``k`` rounded to exactly 1.0 for the
largest draws (and to 0.5 for ``k = 2^52``), so Laplace noise could be infinite (or exactly 0).
These tests feed the extreme 64-bit words directly instead of hoping a sampler hits them.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp import mechanisms, rng


class RawBits:
    """A test source that returns the given 64-bit words (little-endian), then repeats them."""

    def __init__(self, words: list[int]) -> None:
        self._buf = b"".join(int(w).to_bytes(8, "little") for w in words)

    def random_bytes(self, n: int) -> bytes:
        reps = -(-n // len(self._buf))
        return (self._buf * reps)[:n]


TOP = 2**64 - 1
EXTREMES = [0, 1, 2**11 - 1, 2**11, 2**12 - 1, 2**12, 2**63 - 1, 2**63, 2**63 + 2**11, 2**63 - 2**11,
            TOP - 2**12, TOP - 2**11, TOP - 1, TOP]


def _exact(word: int) -> Fraction:
    """The documented value: the top 52 bits k give (k + 1/2) / 2^52."""
    return Fraction(2 * (word >> 12) + 1, 2**53)


@pytest.mark.parametrize("word", EXTREMES)
def test_extreme_words_stay_strictly_inside_and_off_one_half(word: int) -> None:
    u = float(rng.uniform_open01(1, RawBits([word]))[0])
    assert 0.0 < u < 1.0, (word, u)
    assert u != 0.5
    assert Fraction(u) == _exact(word)  # exact: no rounding anywhere


def test_the_largest_and_smallest_draws_are_the_grid_ends() -> None:
    u = rng.uniform_open01(2, RawBits([TOP, 0]))
    assert u[0] == 1.0 - 2.0**-53 == np.nextafter(1.0, 0.0)
    assert u[1] == 2.0**-53


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, TOP), min_size=1, max_size=16))
def test_every_word_maps_exactly_onto_the_grid(words: list[int]) -> None:
    u = rng.uniform_open01(len(words), RawBits(words))
    assert [Fraction(float(x)) for x in u] == [_exact(w) for w in words]


@pytest.mark.parametrize("word", EXTREMES)
def test_laplace_and_gaussian_noise_are_finite_and_nonzero_at_extreme_draws(word: int) -> None:
    lap = mechanisms.laplace_noise(4, 2.0, _test_source=RawBits([word]))
    assert np.all(np.isfinite(lap)) and np.all(lap != 0.0), (word, lap)
    # the largest possible magnitude: b * log(2^52), about 36 b
    assert np.all(np.abs(lap) <= 2.0 * 52 * np.log(2) + 1e-9)
    gau = mechanisms.gaussian_noise(4, 1.0, _test_source=RawBits([word]))
    assert np.all(np.isfinite(gau)), (word, gau)


def test_laplace_is_exactly_antisymmetric_in_the_raw_bits() -> None:
    """Word w and its complement give uniforms u and 1 - u, hence noise x and -x exactly."""
    words = [0, 5, 2**40 + 17, 2**63 - 1, 2**63 + 12345 * 2**12]
    a = mechanisms.laplace_noise(len(words), 1.5, _test_source=RawBits(words))
    b = mechanisms.laplace_noise(len(words), 1.5, _test_source=RawBits([TOP ^ w for w in words]))
    np.testing.assert_array_equal(a, -b)
