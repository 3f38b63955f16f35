"""Additive n-of-n secret sharing over the ring Z_(2^64).

``additive_shares(x, n)`` returns ``n`` ``uint64`` vectors whose wrap-around sum is ``x``; any
``n - 1`` of them are jointly uniform and independent of ``x``. The random shares are AES-CTR
expansions of fresh 32-byte seeds from ``os.urandom`` (a CSPRNG).
"""

from __future__ import annotations

import os

import numpy as np

from secagg.prg import expand

__all__ = ["additive_shares", "reconstruct"]


def additive_shares(x: np.ndarray, n: int) -> list[np.ndarray]:
    """Split ``uint64`` array ``x`` into ``n`` additive shares (CSPRNG)."""
    return _additive_shares_from_seeds(x, [os.urandom(32) for _ in range(max(int(n) - 1, 0))], n)


def _additive_shares_from_seeds(x: np.ndarray, seeds: list[bytes], n: int) -> list[np.ndarray]:
    """Deterministic core: shares 0..n-2 expanded from ``seeds``; the last one completes the sum."""
    arr = np.asarray(x)
    if arr.dtype != np.uint64:
        raise ValueError(f"additive_shares expects a uint64 array (encode it first); found {arr.dtype}.")
    if type(n) is not int or n < 1:
        raise ValueError(f"n must be an int >= 1; found {n!r}.")
    if len(seeds) != n - 1:
        raise ValueError(f"need n - 1 = {n - 1} seeds; found {len(seeds)}.")
    shares = [expand(s, arr.size, label=b"additive").reshape(arr.shape) for s in seeds]
    last = arr.copy()
    for s in shares:
        np.subtract(last, s, out=last)
    shares.append(last)
    return shares


def reconstruct(shares: list[np.ndarray]) -> np.ndarray:
    """Wrap-around sum of all shares."""
    if not shares:
        raise ValueError("reconstruct needs at least one share; found none.")
    out = np.array(shares[0], dtype=np.uint64, copy=True)
    for s in shares[1:]:
        np.add(out, s, out=out)
    return out
