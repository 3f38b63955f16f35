"""The discrete samplers' vectorised passes fused into compiled loops (numba).

:mod:`dp.discrete` draws the discrete Gaussian (CKS 2020, Algorithm 3) as discrete Laplace attempts
(a one-step geometric ``floor(-t ln W)`` and a sign, Algorithm 2) followed by a Bernoulli
``exp(-gamma)`` acceptance. In numpy each step is a dozen whole-array passes with their temporaries
(``log``, the error bound, ``floor``, the four-way acceptance test, ``where``, the float ``gamma``,
``exp``, the comparison and the ambiguity band), and on a cohort's noise (20 clients x 155,601 values
per FEL leaf, 4.8 million attempts) those passes, not the random bytes, were the sampler's time:
about 0.8 s per leaf. Here each step is one loop over its uniform blocks:

* :func:`geometric`: per 64-bit block ``u``, ``W = (u >> 11) 2^-53``, ``r = -t ln W``, the same
  rigorous error bound and the same decision (``floor(r)`` when ``r`` +/- its bound stays inside
  one integer interval) as :func:`dp.discrete._geometric_fast`, flagging the undecided blocks for its
  exact path;
* :func:`signs`: ``y = x // s``, the sign from one block's low bit, the rejection of ``-0`` and the
  compaction of the accepted draws, in attempt order;
* :func:`gauss_accept`: ``gamma = (|y| - sigma^2/t)^2 / (2 sigma^2)``, the block ``w = u 2^-64``
  against ``exp(-gamma)`` and the ``2^-40`` ambiguity band of
  :func:`dp.discrete._bernoulli_exp_neg_fast`, flagging the band's draws for its exact path;
* :func:`take`: the accepted draws appended to the output, no mask-indexed copy or concatenation.

Every float operation is the numpy path's, in the same order (no fast-math, no contraction), and
the blocks are drawn from the source in the same order and number, so the samples are the numpy
path's word for word (``tests/dp/test_discrete_fused.py``, against ``dp.discrete``'s reference
path). The only possible difference is a libm ``log``/``exp`` one ulp apart from numpy's, which
changes nothing: a value within an ulp of a decision boundary is inside the error bound (2^-40
against 2^-52) and goes to the exact path either way, whose answer depends only on the block.
The loops are compiled on first use and cached on disk (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["gauss_accept", "geometric", "signs", "take"]

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_ELEVEN = np.uint64(11)
_ONE = np.uint64(1)


@_jit
def geometric(u, tf, out, bad):  # noqa: ANN001, ANN201
    """``out[i] = floor(-t ln W_i)`` for ``W_i = (u[i] >> 11) 2^-53`` where the float64 value is
    provably right; elsewhere ``out[i] = 0`` and ``bad[i] = True`` (the caller's exact path).
    Returns the number of flagged blocks."""
    a = tf * 2.0**-40
    nbad = 0
    for i in range(u.shape[0]):
        w = np.float64(u[i] >> _ELEVEN) * 2.0**-53
        r = -tf * np.log(w) if w > 0.0 else np.inf
        err = a / max(w, 2.0**-60) + r * 2.0**-48 + 2.0**-40
        x = np.floor(r)
        if np.isfinite(r) and r - err >= x and r + err < x + 1.0 and x < 2.0**62:
            out[i] = np.int64(x)
            bad[i] = False
        else:
            out[i] = 0
            bad[i] = True
            nbad += 1
    return nbad


@_jit
def signs(x, u, s, out):  # noqa: ANN001, ANN201
    """The discrete Laplace draws of attempts ``x`` (magnitudes before the division by ``s``): ``y =
    x // s`` with the sign of ``u[i]``'s low bit, a negative zero rejected; the accepted draws are
    written to ``out`` in attempt order and their number is returned."""
    k = 0
    for i in range(x.shape[0]):  # branch-free: the sign bit is a coin flip, a branch on it mispredicts
        y = x[i] if s == 1 else x[i] // s  # the Gaussian's s = 1 skips the division
        neg = np.int64(u[i] & _ONE)
        out[k] = (y ^ -neg) + neg  # -y when neg (two's complement), y otherwise
        k += 1 - (neg & np.int64(y == 0))  # kept unless a negative zero
    return k


@_jit
def gauss_accept(y, c_f, two_s2_f, u, margin, keep, amb):  # noqa: ANN001, ANN201, PLR0913
    """The discrete Gaussian's acceptance of draws ``y``: ``keep[i] = w_i < exp(-gamma_i)`` for ``w_i =
    u[i] 2^-64`` and ``gamma_i = (|y_i| - c_f)^2 / two_s2_f``; ``amb[i]`` flags ``|w_i - exp(-gamma_i)|
    <= margin`` (the caller decides those exactly). Returns the number flagged."""
    n_amb = 0
    for i in range(y.shape[0]):
        d = np.float64(abs(y[i])) - c_f
        p = np.exp(-(d * d / two_s2_f))
        w = np.float64(u[i]) * 2.0**-64
        keep[i] = w < p
        if abs(w - p) <= margin:
            amb[i] = True
            n_amb += 1
        else:
            amb[i] = False
    return n_amb


@_jit
def take(y, keep, out, have):  # noqa: ANN001, ANN201
    """Append the kept draws ``y[keep]`` to ``out`` from position ``have`` until it is full; returns
    the new fill (the accepted draws in order, the first ``len(out)`` of them: i.i.d., so exact)."""
    n = out.shape[0]
    k = have
    for i in range(y.shape[0]):
        if k == n:
            break
        out[k] = y[i]  # branch-free: written always, kept by advancing
        k += np.int64(keep[i])
    return k
