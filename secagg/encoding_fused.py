"""The nearest-rounding fixed-point encoder as one compiled loop (numba).

:meth:`secagg.encoding.FixedPoint.encode` calls :func:`encode_nearest` for arrays of 4,096 values or
more (every in-process secure sum encodes its clients' vectors this way): the range check, the scaling
and the round-half-to-even in one pass with one output, instead of numpy's six passes and four
temporaries. Its own module, so that importing :mod:`secagg.encoding` does not import numba.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["encode_nearest"]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def encode_nearest(x, scale, clip, out):  # noqa: ANN001, ANN202
    """``out[i] = rint(x[i] * scale)`` (round half to even, as ``numpy.rint``) for every ``|x[i]| <=
    clip``; returns the index of the first value that is NaN, infinite or beyond ``clip`` (the caller
    raises), or -1. One pass and one output instead of numpy's six passes and four temporaries; the
    words are numpy's bit for bit (tests/secagg/test_encoding.py)."""
    for i in range(x.shape[0]):
        v = x[i]
        if not abs(v) <= clip:  # also NaN
            return i
        out[i] = np.int64(np.rint(v * scale))
    return -1
