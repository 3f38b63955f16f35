"""Regression tests for bugs found in review (each failed before its fix)."""

from __future__ import annotations

import pytest

from secagg import shamir


@pytest.mark.parametrize("t", [0, 2**40])
def test_split_many_validates_threshold_before_drawing_coefficients(t: int) -> None:
    # t = 2**40 used to try to draw 2**42 random bytes (MemoryError) before refusing t > n,
    # and t = 0 failed inside os.urandom with "negative argument" instead of naming t.
    with pytest.raises(ValueError, match="threshold t"):
        shamir.split_many([b"abc"], t=t, xs=[1, 2])
