"""Norm clipping: L1 and L2, for one vector or for every row of a matrix.

``clip(v, C) = v * min(1, C / ||v||)``, so ``||clip(v, C)|| <= C``; the functions also return the
scale ``min(1, C / ||v||)`` they applied (1.0 means untouched), which callers log or use to
debias. A zero vector is returned unchanged with scale 1.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["clip_l1", "clip_l2", "clip_rows_l1", "clip_rows_l2"]


def _check(values: np.ndarray, bound: float, ndim: int, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != ndim:
        raise ValueError(f"{name} expects a {ndim}-D array. Found shape {arr.shape}.")
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound) or bound <= 0:
        raise ValueError(f"clip bound must be a positive finite number. Found {bound!r}.")
    if not np.all(np.isfinite(arr)):
        from dp.errors import NonFiniteInputError

        raise NonFiniteInputError(f"{name}: input contains NaN or infinity; clip finite values only.")
    return arr


def _scales(norms: np.ndarray, bound: float) -> np.ndarray:
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(norms > bound, bound / np.where(norms > 0, norms, 1.0), 1.0)


def clip_l2(vector: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """Clip a vector to L2 norm ``bound``. Returns ``(clipped, scale)``."""
    v = _check(vector, bound, 1, "clip_l2")
    scale = float(_scales(np.array([np.linalg.norm(v)]), bound)[0])
    return v * scale, scale


def clip_l1(vector: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """Clip a vector to L1 norm ``bound``. Returns ``(clipped, scale)``."""
    v = _check(vector, bound, 1, "clip_l1")
    scale = float(_scales(np.array([np.abs(v).sum()]), bound)[0])
    return v * scale, scale


def clip_rows_l2(matrix: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """Clip every row of a matrix to L2 norm ``bound``. Returns ``(clipped, scales per row)``."""
    m = _check(matrix, bound, 2, "clip_rows_l2")
    scales = _scales(np.linalg.norm(m, axis=1), bound)
    return m * scales[:, None], scales


def clip_rows_l1(matrix: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """Clip every row of a matrix to L1 norm ``bound``. Returns ``(clipped, scales per row)``."""
    m = _check(matrix, bound, 2, "clip_rows_l1")
    scales = _scales(np.abs(m).sum(axis=1), bound)
    return m * scales[:, None], scales
