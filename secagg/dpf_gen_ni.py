"""A client's DPF key generation with AES inside its compiled loops (AES-NI, :mod:`secagg.aesni`).

:mod:`secagg.dpf_gen_fused` runs key generation's passes as compiled loops around ``cryptography``'s
AES calls. Here the value correction words, which dominate the AES work of a wide key set (both
parties' ``ceil(d / 2)`` value blocks per tree), run in one loop (:func:`value_cw`): per group of
:data:`~secagg.aesni_kernels.LANES` trees and value block, both parties' MMO blocks and the
combination ``(-1)^t1 (beta - G(s0) + G(s1))``, with no ``2 x trees x blocks`` buffer in memory.
The tree levels and the check blocks keep their loops, with their AES calls on AES-NI too
(:func:`ecb_into`). The same words as the other paths (``tests/secagg/test_dpf_batch.py``). Used
by :mod:`secagg.dpf_keys` wherever :func:`secagg.aesni.available`; import only there.
"""

from __future__ import annotations

import numba
import numpy as np

from secagg import aesni
from secagg.aesni_kernels import LANES, ecb, mmo8_c

__all__ = ["ecb_into", "value_cw"]

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_ZERO = np.uint64(0)
_KW = aesni.KEY_WORDS


def ecb_into(rk: np.ndarray, inp: np.ndarray, out: np.ndarray) -> None:
    """``out[:n] = AES(inp)`` for ``n`` blocks of ``inp`` (``out``: at least as many, e.g. the one row
    longer buffer ``cryptography``'s ``update_into`` wants) under round keys ``rk``."""
    flat = inp.reshape(-1)
    ecb(flat, rk, out.reshape(-1)[:flat.size], False)


@_jit
def value_cw(sig, rkv, t1, betas, out):  # noqa: ANN001, ANN202
    """``out[j] = (-1)^t1[j] (betas[j] - G(s0_j) + G(s1_j))``, block ``i`` of ``G(s)`` the MMO
    ``AES_value/i(sigma(s)) XOR sigma(s)`` (round keys ``rkv [blocks, 22]``) of ``sig [2, m, 2]``, both
    parties' ``sigma`` of their leaf seeds; ``betas``, ``out``: ``[m, d]``. ``LANES`` trees at a time
    (a last partial group through a padded copy): every block of both parties into a small buffer
    (``[blocks, 2, LANES, 2]`` words, in L1), then each tree's row of ``out`` in one contiguous pass."""
    m, d = betas.shape
    blocks = rkv.shape[0]
    none = np.zeros(LANES, np.int64)
    zero = np.zeros(2, np.uint64)
    y = np.empty(blocks * 4 * LANES, np.uint64)  # per block: party 0's outputs, then party 1's
    pad = np.zeros(4 * LANES, np.uint64)  # a partial group's inputs: party 0's, then party 1's
    flat = sig.reshape(-1)
    for g in range(0, m, LANES):
        n = min(LANES, m - g)
        if n == LANES:
            src, b0, b1 = flat, 2 * g, 2 * (m + g)
        else:
            pad[:] = 0
            pad[:2 * n] = flat[2 * g:2 * (g + n)]
            pad[2 * LANES:2 * (LANES + n)] = flat[2 * (m + g):2 * (m + g + n)]
            src, b0, b1 = pad, 0, 2 * LANES
        for i in range(blocks):
            mmo8_c(src, b0, none, zero, 0, none, rkv, _KW * i, zero, 0, none, zero, y, 4 * LANES * i, none)
            mmo8_c(src, b1, none, zero, 0, none, rkv, _KW * i, zero, 0, none, zero, y, 4 * LANES * i + 2 * LANES, none)
        for lane in range(n):
            j = g + lane
            neg = _ZERO - np.uint64(t1[j])
            for col in range(d):
                at = 4 * LANES * (col >> 1) + 2 * lane + (col & 1)
                v = betas[j, col] - y[at] + y[at + 2 * LANES]
                out[j, col] = (v ^ neg) - neg
