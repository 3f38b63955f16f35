"""Exact discrete Laplace and discrete Gaussian samplers on an integer grid.

Canonne, Kamath and Steinke 2020, "The Discrete Gaussian for Differential Privacy", Algorithms
1-3, vectorised over samples. Every probability is an exact rational: Bernoulli(n/d) is decided
by an exactly uniform integer (or, for huge denominators, by comparing an infinite uniform binary
expansion bit-block by bit-block), Bernoulli(exp(-gamma)) by the alternating-series algorithm.
No floating point touches the sampled values, so the output distribution is exactly the target
(no Mironov-2012 style holes), up to the quality of the CSPRNG.

Grid convention: reals are represented as integers ``round(x * 2^frac_bits)`` (the same convention
as ``secagg``'s fixed-point encoding, which this package does not import). Noise for a real
standard deviation ``sigma`` is therefore a discrete Gaussian with grid parameter
``sigma * 2^frac_bits`` (see :func:`discrete_gaussian_noise`), and it can be added to encoded
integers before masking (distributed DP).

Privacy (CKS 2020): with integer L2 sensitivity ``Delta`` on the grid, the discrete Gaussian with
parameter ``sigma`` satisfies ``(alpha, alpha Delta^2 / (2 sigma^2))``-RDP, i.e. it is never worse
than the continuous Gaussian with the same ``sigma``; :mod:`dp.accountant` accounts it as a
``Gaussian`` event with ``noise_multiplier = sigma / Delta``. The discrete Laplace with scale
``t`` and integer L1 sensitivity ``Delta`` is ``Delta / t``-DP (pure).

Timing: the rejection loops take data-dependent time; the samplers are not constant-time
(CKS discuss timing side channels). Do not run them where an adversary can time one sample.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from dp.rng import RandomSource, resolve_source, uint64s, uniform_below

__all__ = [
    "bernoulli_exp_neg",
    "bernoulli_rational",
    "discrete_gaussian",
    "discrete_gaussian_noise",
    "discrete_laplace",
    "discrete_laplace_noise",
    "grid_value",
]

_INT64_SAFE = 1 << 62
_INT64_MAX = (1 << 63) - 1


def _as_object(a: np.ndarray) -> np.ndarray:
    return np.array([int(x) for x in np.asarray(a).reshape(-1)], dtype=object)


def bernoulli_rational(num: np.ndarray, den: np.ndarray, source: RandomSource) -> np.ndarray:
    """Exact Bernoulli(num_i / den_i) draws, ``0 <= num_i``, ``den_i >= 1`` (num >= den gives 1).

    Small denominators use one exactly uniform integer below ``den``; large ones (Python ints of
    any size, object arrays) compare a uniform 64-bit block with the first 64 bits of the binary
    expansion of ``num/den`` and recurse on the remainder only on a tie (probability 2^-64).
    """
    num = np.asarray(num).reshape(-1)
    den = np.asarray(den).reshape(-1)
    out = np.zeros(num.shape, dtype=bool)
    if num.size == 0:
        return out
    if num.dtype != object and den.dtype != object and int(den.max()) < _INT64_SAFE:
        num64 = num.astype(np.int64)
        den64 = den.astype(np.int64)
        return uniform_below(den64, source) < num64
    num_o, den_o = _as_object(num), _as_object(den)
    full = np.array([n >= d for n, d in zip(num_o, den_o)], dtype=bool)
    out[full] = True
    idx = np.flatnonzero(~full)
    if idx.size == 0:
        return out
    shifted = num_o[idx] << 64
    p64 = shifted // den_o[idx]
    rem = shifted - p64 * den_o[idx]
    hi = (p64 >> 32).astype(np.uint64)
    lo = (p64 & 0xFFFFFFFF).astype(np.uint64)
    p64u = (hi << np.uint64(32)) | lo
    u = uint64s(idx.size, source)
    res = u < p64u
    tie = u == p64u
    if np.any(tie):  # pragma: no cover - probability 2^-64 per draw
        res[tie] = bernoulli_rational(rem[tie], den_o[idx][tie], source)
    out[idx] = res
    return out


def _bernoulli_exp_neg_unit(num: np.ndarray, den: np.ndarray, source: RandomSource) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for ``0 <= num/den <= 1`` (CKS Algorithm 1, first case)."""
    n = num.size
    k = np.ones(n, dtype=np.int64)
    active = np.arange(n)
    while active.size:
        if den.dtype != object and int(den[active].max()) * int(k[active].max()) < _INT64_SAFE:
            d = den[active].astype(np.int64) * k[active]
        else:  # exact big-integer products (never a silent int64 wrap-around)
            d = _as_object(den[active]) * k[active].astype(object)
        a = bernoulli_rational(num[active], d, source)
        active = active[a]
        k[active] += 1
    return (k % 2) == 1


def bernoulli_exp_neg(num: np.ndarray, den: np.ndarray, source: RandomSource) -> np.ndarray:
    """Exact Bernoulli(exp(-num_i/den_i)) for rational ``num_i/den_i >= 0`` (CKS Algorithm 1).

    ``gamma = g + r/den`` with integer ``g``: the result is Bernoulli(exp(-r/den)) AND ``g``
    independent Bernoulli(exp(-1)) draws, stopping at the first failure.
    """
    num = np.asarray(num).reshape(-1)
    den = np.asarray(den).reshape(-1)
    g = num // den
    r = num - g * den
    out = _bernoulli_exp_neg_unit(r, den, source)
    g = np.asarray(g)
    remaining = g.astype(object) if g.dtype == object else g.astype(np.int64)
    alive = np.flatnonzero(out & (remaining > 0))
    one = np.ones(1, dtype=np.int64)
    while alive.size:
        a = _bernoulli_exp_neg_unit(np.repeat(one, alive.size), np.repeat(one, alive.size), source)
        out[alive[~a]] = False
        remaining[alive] = remaining[alive] - 1
        alive = alive[a]
        alive = alive[remaining[alive] > 0]
    return out


def _to_fraction(value: int | float | Fraction, name: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)):
        raise TypeError(f"{name} must be an int, float or Fraction. Found {type(value).__name__}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite. Found {value}.")
    frac = Fraction(value)
    if frac <= 0:
        raise ValueError(f"{name} must be positive. Found {value}.")
    return frac


def _dlap_core(n: int, t: int, s: int, source: RandomSource) -> np.ndarray:
    """``n`` draws of the discrete Laplace with scale t/s: P(y) ∝ exp(-|y| s / t) (CKS Alg. 2)."""
    out = np.empty(n, dtype=np.int64)
    todo = np.arange(n)
    t_arr = np.int64(t)
    while todo.size:
        m = todo.size
        u = uniform_below(np.full(m, t_arr), source)
        keep = bernoulli_exp_neg(u, np.full(m, t_arr), source)
        idx = np.flatnonzero(keep)
        v = np.zeros(idx.size, dtype=np.int64)
        alive = np.arange(idx.size)
        one = np.ones(1, dtype=np.int64)
        while alive.size:
            a = _bernoulli_exp_neg_unit(np.repeat(one, alive.size), np.repeat(one, alive.size), source)
            alive = alive[a]
            v[alive] += 1
        # u + t*v must not wrap around int64: such a draw (|y| near 2^63, probability about
        # exp(-2^63 / t)) is rejected and redrawn, so the output is conditioned on fitting int64.
        fits = v <= (_INT64_MAX - (t - 1)) // t
        x = u[idx] + t * np.where(fits, v, 0)
        y = x // s
        b = (uint64s(idx.size, source) & np.uint64(1)).astype(bool)
        ok = fits & ~(b & (y == 0))
        accepted = idx[ok]
        out[todo[accepted]] = np.where(b[ok], -y[ok], y[ok])
        rejected = np.ones(m, dtype=bool)
        rejected[accepted] = False
        todo = todo[rejected]
    return out


def discrete_laplace(
    shape: int | tuple[int, ...],
    scale: int | float | Fraction,
    *,
    _test_source: RandomSource | None = None,
) -> np.ndarray:
    """Exact discrete Laplace noise on the integers: ``P(y) ∝ exp(-|y| / scale)``.

    Args:
        shape: output shape.
        scale: the scale ``b`` in grid units; floats are used exactly (as binary fractions).
        _test_source: TEST-ONLY deterministic source; default is the OS CSPRNG.

    Returns:
        ``int64`` array. With integer L1 sensitivity ``Delta`` this is ``Delta/scale``-DP. A draw
        that would not fit int64 is redrawn (the output is conditioned on fitting; the excluded
        mass, about ``exp(-2^63 / scale_numerator)``, is negligible below ``2^56``).
    """
    b = _to_fraction(scale, "scale")
    if b.numerator >= _INT64_SAFE:
        raise ValueError(f"scale numerator must be below 2^62. Found {b}; use a coarser grid.")
    source = resolve_source(_test_source)
    n = int(np.prod(shape))
    return _dlap_core(n, b.numerator, b.denominator, source).reshape(shape)


def discrete_gaussian(
    shape: int | tuple[int, ...],
    sigma: int | float | Fraction,
    *,
    _test_source: RandomSource | None = None,
) -> np.ndarray:
    """Exact discrete Gaussian noise on the integers: ``P(y) ∝ exp(-y^2 / (2 sigma^2))`` (CKS Alg. 3).

    Args:
        shape: output shape.
        sigma: the parameter ``sigma`` in grid units (``sigma^2`` is used as an exact rational).
        _test_source: TEST-ONLY deterministic source; default is the OS CSPRNG.

    Returns:
        ``int64`` array.
    """
    s = _to_fraction(sigma, "sigma")
    s2 = s * s
    a, b = s2.numerator, s2.denominator
    t = math.isqrt(a // b) + 1
    if t >= _INT64_SAFE:
        raise ValueError(f"sigma must be below 2^62 grid units. Found {float(s)}.")
    source = resolve_source(_test_source)
    n = int(np.prod(shape))
    out = np.empty(n, dtype=np.int64)
    todo = np.arange(n)
    den_int = 2 * a * b * t * t
    small = den_int < _INT64_SAFE and (t * b + a) < (1 << 31)
    while todo.size:
        y = _dlap_core(todo.size, t, 1, source)
        ay = np.abs(y)
        # int64 only when |Y| t b + a < 2^31, so the square stays below 2^62 (no wrap-around).
        small_now = small and int(ay.max()) * t * b + a < (1 << 31)
        if small_now:
            num = (ay * (t * b) - a) ** 2
            den = np.full(ay.size, den_int, dtype=np.int64)
        else:
            ay_o = _as_object(ay)
            num = (ay_o * (t * b) - a) ** 2
            den = np.full(ay.size, den_int, dtype=object)
        c = bernoulli_exp_neg(num, den, source)
        out[todo[c]] = y[c]
        todo = todo[~c]
    return out.reshape(shape)


def grid_value(value: float | Fraction, frac_bits: int) -> Fraction:
    """``value * 2^frac_bits`` as an exact rational (the grid units of a real quantity)."""
    if isinstance(frac_bits, bool) or not isinstance(frac_bits, int) or not 0 <= frac_bits <= 52:
        raise ValueError(f"frac_bits must be an int in [0, 52]. Found {frac_bits!r}.")
    return _to_fraction(value, "value") * (1 << frac_bits)


def discrete_gaussian_noise(
    shape: int | tuple[int, ...],
    sigma: float,
    frac_bits: int,
    *,
    _test_source: RandomSource | None = None,
) -> np.ndarray:
    """Discrete Gaussian noise for a real standard deviation ``sigma`` on the 2^-frac_bits grid.

    Returns integers in grid units (add them to fixed-point encodings, e.g. before masking).
    """
    return discrete_gaussian(shape, grid_value(sigma, frac_bits), _test_source=_test_source)


def discrete_laplace_noise(
    shape: int | tuple[int, ...],
    scale: float,
    frac_bits: int,
    *,
    _test_source: RandomSource | None = None,
) -> np.ndarray:
    """Discrete Laplace noise for a real scale ``scale`` on the 2^-frac_bits grid (grid units)."""
    return discrete_laplace(shape, grid_value(scale, frac_bits), _test_source=_test_source)
