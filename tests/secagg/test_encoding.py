"""Fixed-point encoding and bit budgets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg.encoding import FixedPoint, check_budget
from secagg.errors import BudgetError


@settings(max_examples=50, deadline=None)
@given(
    st.integers(0, 40),
    st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=30),
    st.sampled_from(["stochastic", "nearest"]),
)
def test_roundtrip_within_one_grid_step(frac, values, rounding):
    fp = FixedPoint(frac, 100.0)
    x = np.array(values)
    err = np.abs(fp.decode(fp.encode(x, rounding=rounding)) - x)
    bound = 2.0**-frac if rounding == "stochastic" else 2.0**-frac / 2
    assert np.all(err <= bound * (1 + 1e-9) + 1e-12 * np.abs(x))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 50), st.integers(4, 30), st.data())
def test_sum_of_encodings_decodes_to_sum_within_quantisation(n, frac, data):
    fp = FixedPoint(frac, 10.0)
    check_budget(n_summands=n, clip=10.0, frac_bits=frac)
    xs = np.array(data.draw(st.lists(st.floats(-10, 10, allow_nan=False), min_size=n, max_size=n)))
    total = np.zeros(1, dtype=np.uint64)
    for x in xs:
        total = total + fp.encode(np.array([x]), rounding="nearest")
    assert abs(fp.decode(total)[0] - xs.sum()) <= n * 2.0**-frac / 2 + 1e-9


def test_negative_values_wrap_and_decode_signed():
    fp = FixedPoint(8, 4.0)
    enc = fp.encode(np.array([-1.0, 1.0, -4.0]), rounding="nearest")
    assert enc.tolist() == [2**64 - 256, 256, 2**64 - 1024]
    assert fp.decode(enc).tolist() == [-1.0, 1.0, -4.0]


def test_stochastic_rounding_known_answer_and_unbiased():
    fp = FixedPoint(0, 10.0)
    enc = fp._encode_with_uniform(np.array([0.25, 0.25, -0.25, 2.0]), np.array([0.1, 0.3, 0.8, 0.99]))
    assert fp.decode(enc).tolist() == [1.0, 0.0, -1.0, 2.0]
    x = np.full(200_000, 0.3)
    mean = fp.decode(fp.encode(x)).mean()
    assert abs(mean - 0.3) < 5 * np.sqrt(0.21 / x.size)  # Bernoulli(0.3) std / sqrt(N)


def test_out_of_range_and_nonfinite_values_rejected():
    fp = FixedPoint(16, 1.0)
    with pytest.raises(BudgetError, match=r"exceeds clip = 1.0; clip inputs first"):
        fp.encode(np.array([0.5, 1.5]))
    with pytest.raises(BudgetError, match="NaN or infinity"):
        fp.encode(np.array([np.nan]))
    with pytest.raises(ValueError, match="rounding"):
        fp.encode(np.array([0.1]), rounding="up")
    with pytest.raises(BudgetError, match="frac_bits"):
        FixedPoint(63, 1.0)
    with pytest.raises(BudgetError, match="clip"):
        FixedPoint(8, -1.0)
    with pytest.raises(ValueError, match="uint64"):
        fp.decode(np.array([1.0]))


def test_budget_boundary_and_named_fix():
    # 2^20 clients x clip 1 x 2^42 = 2^62 < 2^63: fits; 2^43 does not.
    check_budget(n_summands=2**20, clip=1.0, frac_bits=42)
    with pytest.raises(BudgetError, match="lower frac_bits to at most 42"):
        check_budget(n_summands=2**20, clip=1.0, frac_bits=43)
    with pytest.raises(BudgetError, match="lower frac_bits to at most 40"):
        check_budget(n_summands=2**20, clip=1.0, frac_bits=42, noise_headroom_bits=2)
    with pytest.raises(BudgetError, match="ring has 32"):
        check_budget(n_summands=10, clip=8.0, frac_bits=30, ring_bits=32)
    with pytest.raises(BudgetError, match="n_summands"):
        check_budget(n_summands=0, clip=1.0, frac_bits=1)


def test_budget_guarantees_exact_decoding_at_the_edge():
    n, frac, clip = 4, 59, 1.0  # 4 * 2^59 = 2^61 < 2^63
    check_budget(n_summands=n, clip=clip, frac_bits=frac)
    fp = FixedPoint(frac, clip)
    total = np.zeros(1, dtype=np.uint64)
    for _ in range(n):
        total += fp.encode(np.array([-1.0]))
    assert fp.decode(total)[0] == -4.0


def _numpy_nearest(fp: FixedPoint, x: np.ndarray) -> np.ndarray:
    """The reference: numpy's passes (what arrays below the fused size still take)."""
    fp._check_range(x)
    return np.rint(x * fp.scale).astype(np.int64).view(np.uint64)


@settings(max_examples=60, deadline=None)
@given(
    frac=st.integers(0, 40),
    clip=st.sampled_from([1.0, 3.5, 1e3]),
    n=st.integers(4096, 9000),
    seed=st.integers(0, 2**32 - 1),
    special=st.lists(st.sampled_from([0.5, -0.5, 1.5, -2.5, 0.0, -0.0, 1e-12, "clip", "-clip"]), max_size=20),
    shape2=st.booleans(),
)
def test_fused_nearest_encoding_is_numpys_word_for_word(frac, clip, n, seed, special, shape2):
    """The compiled one-pass encoder (arrays of 4,096 values and more) against numpy's rint path:
    halves round to even, the clip itself is accepted, any shape keeps its shape."""
    fp = FixedPoint(frac, clip)
    x = np.random.default_rng(seed).uniform(-clip, clip, size=n)
    for i, v in enumerate(special):
        val = clip if v == "clip" else -clip if v == "-clip" else float(v) / fp.scale
        x[i] = val if abs(val) <= clip else x[i]
    x = x[: n - n % 2].reshape(2, -1) if shape2 else x
    got = fp.encode(x, rounding="nearest")
    assert got.dtype == np.uint64 and got.shape == x.shape
    np.testing.assert_array_equal(got, _numpy_nearest(fp, x))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1.0000001, -7.0])
@pytest.mark.parametrize("where", [0, 5000, 8191])
def test_fused_nearest_encoding_refuses_as_numpy_does(bad, where):
    fp = FixedPoint(16, 1.0)
    x = np.zeros(8192)
    x[where] = bad
    msg = "NaN or infinity" if not np.isfinite(bad) else "exceeds clip = 1.0"
    with pytest.raises(BudgetError, match=msg):
        fp.encode(x, rounding="nearest")
    with pytest.raises(BudgetError, match=msg):
        _numpy_nearest(fp, x)


@pytest.mark.parametrize("n", [100, 512, 513, 200_000])
def test_csprng_uniform_is_fresh_and_uniform_on_both_paths(n):
    """Up to 512 values from os.urandom, beyond from a fresh AES-256-CTR seed per draw: every draw is
    new (a fixed or reused seed would repeat), inside [0, 1) on the 2^-53 grid, and uniform."""
    from scipy import stats

    from secagg.encoding import csprng_uniform

    a, b = csprng_uniform(n), csprng_uniform((n,))
    assert a.shape == (n,) and not np.array_equal(a, b)
    assert a.min() >= 0 and a.max() < 1 and np.all(a * 2.0**53 == np.floor(a * 2.0**53))
    assert stats.kstest(np.concatenate([a, b]), "uniform").pvalue > 1e-4
