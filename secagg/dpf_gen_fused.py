"""A client's DPF key generation with its per-tree passes fused into compiled loops (numba).

:func:`secagg.dpf_keys._gen` makes one key set level by level: per level one ``cryptography`` AES-128
call over both parties' children (AES stays there, AES-NI through OpenSSL), then a dozen numpy passes
over ``[m, 2]`` arrays to pick the kept and lost children, the correction words and the next seeds;
at the leaves, per value block two AES calls and four passes. Here each of those steps is one loop
over the trees (:func:`tree_input`, :func:`tree_level`, :func:`check_input` and :func:`check_cw`,
:func:`value_cw`): the same words, bit for bit
(``tests/secagg/test_dpf_batch.py`` runs both paths on the same roots). The loops are compiled on
first use and cached on disk; this module imports nothing from :mod:`secagg.dpf_keys` (which imports
it lazily, so that a client that never generates a large key set does not load numba).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["check_cw", "check_input", "tree_input", "tree_level", "value_cw"]

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_LOW = np.uint64(1)
_CLEAR = np.uint64(0xFFFFFFFFFFFFFFFE)
_ZERO = np.uint64(0)


@_jit
def tree_input(s, right, inp):  # noqa: ANN001, ANN202
    """The level's AES input from both parties' seeds ``s [2, m, 2]``: per party and tree ``sigma(s)``
    (the left child's) and ``sigma(s) XOR (right, 0)`` (the right child's), ``inp [2, m, 2, 2]``."""
    for b in range(2):
        for j in range(s.shape[1]):
            x0 = s[b, j, 0]
            sig0 = x0 ^ s[b, j, 1]
            inp[b, j, 0, 0] = sig0
            inp[b, j, 0, 1] = x0
            inp[b, j, 1, 0] = sig0 ^ right
            inp[b, j, 1, 1] = x0


@_jit
def tree_level(out, inp, alphas, shift, s, t, seed_cw, t_cw, level):  # noqa: ANN001, ANN202, PLR0913
    """One level of every tree after its AES call (``out = AES(inp)``, ``[2, m, 2, 2]``): each child
    is ``out XOR inp`` with its control bit in word 0's low bit (then cleared); the lost side's seeds
    XOR-ed give the seed correction, the control-bit corrections follow ``alpha``'s bit (``alphas >>
    shift``), and each party keeps the child on ``alpha``'s side, corrected where its control bit
    ``t [2, m]`` was 1. Writes ``seed_cw [m, D, 2]`` and ``t_cw [m, D, 2]`` at ``level`` and updates
    ``s`` and ``t`` in place."""
    for j in range(s.shape[1]):
        bit = np.uint8((alphas[j] >> shift) & 1)
        keep = np.int64(bit)
        lose = 1 - keep
        tl0 = np.uint8((out[0, j, 0, 0] ^ inp[0, j, 0, 0]) & _LOW)
        tr0 = np.uint8((out[0, j, 1, 0] ^ inp[0, j, 1, 0]) & _LOW)
        tl1 = np.uint8((out[1, j, 0, 0] ^ inp[1, j, 0, 0]) & _LOW)
        tr1 = np.uint8((out[1, j, 1, 0] ^ inp[1, j, 1, 0]) & _LOW)
        cw0 = ((out[0, j, lose, 0] ^ inp[0, j, lose, 0]) ^ (out[1, j, lose, 0] ^ inp[1, j, lose, 0])) & _CLEAR
        cw1 = (out[0, j, lose, 1] ^ inp[0, j, lose, 1]) ^ (out[1, j, lose, 1] ^ inp[1, j, lose, 1])
        seed_cw[j, level, 0] = cw0
        seed_cw[j, level, 1] = cw1
        tcl = tl0 ^ tl1 ^ bit ^ np.uint8(1)
        tcr = tr0 ^ tr1 ^ bit
        t_cw[j, level, 0] = tcl
        t_cw[j, level, 1] = tcr
        tkeep_cw = tcr if bit else tcl
        for b in range(2):
            k0 = (out[b, j, keep, 0] ^ inp[b, j, keep, 0])
            tk = np.uint8(k0 & _LOW)
            k0 &= _CLEAR
            k1 = out[b, j, keep, 1] ^ inp[b, j, keep, 1]
            mask = _ZERO - np.uint64(t[b, j])
            s[b, j, 0] = k0 ^ (cw0 & mask)
            s[b, j, 1] = k1 ^ (cw1 & mask)
            t[b, j] = tk ^ (t[b, j] & tkeep_cw)


@_jit
def value_cw(y, sig, t1, betas, out):  # noqa: ANN001, ANN202
    """``out[j] = (-1)^t1[j] (betas[j] - G(s0_j) + G(s1_j))`` with ``G`` block ``i`` of a leaf seed its
    MMO ``y[i, b, j] XOR sig[b, j]`` (``y``: the value keys' AES outputs ``[blocks, 2, m, 2]`` of
    ``sig [2, m, 2]``, both parties' ``sigma`` of their leaf seeds); ``betas``, ``out``: ``[m, d]``."""
    d = betas.shape[1]
    for j in range(betas.shape[0]):
        neg = _ZERO - np.uint64(t1[j])
        for col in range(d):
            i = col // 2
            h = col % 2
            v = betas[j, col] - (y[i, 0, j, h] ^ sig[0, j, h]) + (y[i, 1, j, h] ^ sig[1, j, h])
            out[j, col] = (v ^ neg) - neg


@_jit
def check_input(s, tweaks, inp):  # noqa: ANN001, ANN202
    """The check hash's AES input: ``inp[c, b, j] = sigma(s[b, j]) XOR tweaks[c, j]`` for both parties'
    leaf seeds ``s [2, m, 2]`` and the public tweaks ``[C, m, 2]``; ``inp``: ``[C, 2, m, 2]``."""
    for c in range(tweaks.shape[0]):
        for b in range(2):
            for j in range(s.shape[1]):
                x0 = s[b, j, 0]
                inp[c, b, j, 0] = (x0 ^ s[b, j, 1]) ^ tweaks[c, j, 0]
                inp[c, b, j, 1] = x0 ^ tweaks[c, j, 1]


@_jit
def check_cw(y, inp, out):  # noqa: ANN001, ANN202
    """``out[j, c] = H'_c(s0_j) XOR H'_c(s1_j)``, each the MMO ``y XOR inp`` of :func:`check_input`'s
    block (``y = AES_c(inp)``, ``[C, 2, m, 2]``); ``out``: ``[m, C, 2]``."""
    for j in range(out.shape[0]):
        for c in range(out.shape[1]):
            for w in range(2):
                out[j, c, w] = (y[c, 0, j, w] ^ inp[c, 0, j, w]) ^ (y[c, 1, j, w] ^ inp[c, 1, j, w])
