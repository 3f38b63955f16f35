"""Regression tests for bugs found in review (each failed before its fix)."""

from __future__ import annotations

import math

import numpy as np

from dp.discrete import discrete_laplace
from dp.rng import DeterministicTestSource


def test_discrete_laplace_never_wraps_around_int64() -> None:
    # scale 2^61: a geometric part v >= 4 makes u + t*v >= 2^63. It used to wrap silently, so
    # such draws came back with a wrong magnitude (|y|/b in (3, 4] got 0.043 of the mass instead
    # of 0.032). Now they are redrawn: the output is Laplace conditioned on |y| < 4b (fits int64).
    y = discrete_laplace(40000, 2**61, _test_source=DeterministicTestSource(1)).astype(float) / 2**61
    expected = (math.exp(-3) - math.exp(-4)) / (1 - math.exp(-4))  # P(|Y| > 3b | |Y| < 4b)
    assert abs(float(np.mean(np.abs(y) > 3)) - expected) < 0.005


def test_laplace_calibration_refuses_a_bad_delta():
    import math

    import pytest

    from dp.calibration import calibrate_laplace_epsilon0

    for bad in (-1e-5, 1.0, math.nan):
        with pytest.raises(ValueError, match="delta"):
            calibrate_laplace_epsilon0(target_epsilon=1.0, count=10, delta=bad)
