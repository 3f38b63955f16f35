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

Speed: the discrete Gaussian and discrete Laplace draw each Bernoulli(exp(-gamma)) with ONE uniform
64-bit block compared against a float64 value of ``exp(-gamma)`` whose error is below 2^-45; only
blocks within 2^-40 of it (probability about 2^-39 per draw) take the exact path, which extends the
uniform bit by bit-block and compares it with interval bounds on ``exp(-gamma)`` from ``decimal``
(correctly rounded ``exp``) at rising precision. The decision is therefore exactly
``W < exp(-gamma)`` for a uniform real ``W`` -- the same distribution as CKS's alternating-series
Bernoulli, at vectorised-numpy speed (about 100x faster on the 2^-16 grid, where the old path
needed Python big integers).

Timing: the rejection loops take data-dependent time; the samplers are not constant-time
(CKS discuss timing side channels). Do not run them where an adversary can time one sample.
"""

from __future__ import annotations

import decimal
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
# The hot passes run as the compiled loops of dp.discrete_fused (the same samples word for word,
# tests/dp/test_discrete_fused.py); False runs the numpy reference path those tests compare against.
_FUSED = True


def _loops():  # noqa: ANN202
    """dp.discrete_fused, imported on the first fused draw: importing numba costs about 0.2 s, which
    ``import dp`` (the accountant, the ledger) should not pay."""
    import dp.discrete_fused as loops

    return loops


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


_MARGIN = 2.0**-40  # ambiguity band around the float64 value of exp(-gamma) (its error is < 2^-45)


def _exp_neg_bounds(gamma: Fraction, digits: int) -> tuple[Fraction, Fraction]:
    """Rigorous rational bounds ``lo <= exp(-gamma) <= hi`` from ``decimal`` at ``digits`` digits."""
    ctx = decimal.Context(prec=digits, rounding=decimal.ROUND_HALF_EVEN)
    g = ctx.divide(decimal.Decimal(gamma.numerator), decimal.Decimal(gamma.denominator))
    e = ctx.exp(-g)  # correctly rounded (half an ulp) for the rounded argument
    # |g - gamma| <= ulp(g) => relative error of exp <= (gamma + 1) * 10^(2 - digits); add the exp ulp.
    rel = Fraction(int(gamma) + 2) * Fraction(1, 10 ** (digits - 2))
    ef = Fraction(e)
    return ef * (1 - rel), ef * (1 + rel)


class _LazyUniform:
    """A uniform real ``W`` in [0, 1) revealed 64 bits at a time (exact comparisons with exp)."""

    def __init__(self, block: int, source: RandomSource) -> None:
        self.k, self.nbits, self.source = int(block), 64, source

    def below_exp(self, gamma: Fraction) -> bool:
        """Exactly ``W < exp(-gamma)``, revealing more bits of ``W`` while undecided."""
        digits = 40 + self.nbits // 3
        while True:
            lo, hi = _exp_neg_bounds(gamma, digits)
            if Fraction(self.k + 1, 1 << self.nbits) <= lo:
                return True
            if Fraction(self.k, 1 << self.nbits) >= hi:
                return False
            self.k = (self.k << 64) | int(uint64s(1, self.source)[0])
            self.nbits += 64
            digits += 20


def _exact_uniform_below_exp(block: int, gamma: Fraction, source: RandomSource) -> bool:
    """Exactly decide ``W < exp(-gamma)`` for a uniform real ``W`` whose first 64 bits are ``block``."""
    return _LazyUniform(block, source).below_exp(gamma)


def _exact_floor_neg_log(block: int, t: int, guess: int, source: RandomSource) -> int:
    """Exactly ``max{x >= 0 : W < exp(-x/t)}`` (= floor(-t ln W)) for ``W`` starting with ``block``."""
    w = _LazyUniform(block, source)
    x = max(int(guess), 0)
    while x > 0 and not w.below_exp(Fraction(x, t)):
        x -= 1
    while w.below_exp(Fraction(x + 1, t)):
        x += 1
    return x


def _geometric_fast(m: int, t: int, source: RandomSource) -> np.ndarray:
    """``m`` draws of ``X`` with ``P(X >= x) = exp(-x/t)``, as ``floor(-t ln W)`` for uniform ``W``.

    ``X >= x`` iff ``W < exp(-x/t)``, so this is exact given an exact comparison; the float64
    value of ``-t ln W`` is used when an error bound far above its rounding error keeps it inside
    one integer interval, otherwise :func:`_exact_floor_neg_log` settles it with the same leading
    bits of ``W`` (probability about ``t 2^-39`` per draw; callers keep ``t < 2^24``).
    """
    u = uint64s(m, source)
    tf = float(t)
    if _FUSED:
        out = np.empty(m, dtype=np.int64)
        bad = np.empty(m, dtype=np.bool_)
        if _loops().geometric(u, tf, out, bad):
            idx = np.flatnonzero(bad)
            with np.errstate(divide="ignore"):
                r = -tf * np.log((u[idx] >> np.uint64(11)).astype(np.float64) * 2.0**-53)
            _settle_geometric(out, u, idx, r, t, source)
        return out
    w = (u >> np.uint64(11)).astype(np.float64) * 2.0**-53  # exact; W is within 2^-53 of it
    with np.errstate(divide="ignore", invalid="ignore"):  # W = 0: r = inf, undecided below
        r = -tf * np.log(w)
        # Error bound on r = -t ln W: the block (2^-53 / w relative) plus float rounding (|r| 2^-50).
        err = tf * 2.0**-40 / np.maximum(w, 2.0**-60) + r * 2.0**-48 + 2.0**-40
        x = np.floor(r)
        ok = np.isfinite(r) & (r - err >= x) & (r + err < x + 1.0) & (x < 2.0**62)
    x = np.where(ok, x, 0.0)
    out = x.astype(np.int64)
    idx = np.flatnonzero(~ok)
    _settle_geometric(out, u, idx, r[idx], t, source)
    return out


def _settle_geometric(out: np.ndarray, u: np.ndarray, idx: np.ndarray, r: np.ndarray, t: int,
                      source: RandomSource) -> None:
    """The exact path of :func:`_geometric_fast` for its undecided blocks ``u[idx]`` (``r`` their
    float ``-t ln W``, only a starting guess), in index order."""
    for i, ri in zip(idx.tolist(), r.tolist()):  # pragma: no cover - rare (tested through small t)
        guess = int(ri) if math.isfinite(ri) and ri < 2.0**62 else int(t * 53 * math.log(2))
        out[i] = _exact_floor_neg_log(int(u[i]), t, guess, source)


def _bernoulli_exp_neg_fast(gamma_f: np.ndarray, gamma_exact, source: RandomSource) -> np.ndarray:  # noqa: ANN001
    """Vectorised exact Bernoulli(exp(-gamma_i)).

    ``gamma_f`` is a float64 approximation with ``|exp(-gamma_f) - exp(-gamma)| < 2^-45`` (callers
    guarantee it); ``gamma_exact(i)`` returns the exact rational ``gamma_i`` for the rare ambiguous
    draws, which are settled by :func:`_exact_uniform_below_exp` with the same leading 64 bits.
    """
    n = gamma_f.size
    u = uint64s(n, source)
    p = np.exp(-gamma_f)
    # u * 2^-64 as float: relative error 2^-53, i.e. absolute < 2^-52 << _MARGIN.
    w = u.astype(np.float64) * 2.0**-64
    out = w < p
    amb = np.flatnonzero(np.abs(w - p) <= _MARGIN)
    for i in amb:  # pragma: no cover - probability ~2^-39 per draw (tested directly)
        out[i] = _exact_uniform_below_exp(int(u[i]), gamma_exact(int(i)), source)
    return out


def _uniform_below_scalar(t: int, m: int, source: RandomSource) -> np.ndarray:
    """``m`` exactly uniform integers in ``[0, t)`` (one bit mask; oversampled rejection)."""
    if t == 1:
        return np.zeros(m, dtype=np.int64)
    mask = np.uint64((1 << (t - 1).bit_length()) - 1)
    out = np.empty(0, dtype=np.int64)
    while out.size < m:
        need = m - out.size
        r = (uint64s(2 * need + 16, source) & mask).astype(np.int64)
        out = np.concatenate([out, r[r < t][:need]])
    return out


def _dlap_attempts(m: int, t: int, s: int, source: RandomSource) -> np.ndarray:
    """``m`` attempts of CKS Algorithm 2; returns the accepted draws, in attempt order.

    For ``t < 2^24`` the magnitude ``U + t V`` (U uniform below t accepted w.p. exp(-U/t), V
    geometric) is drawn in one step as ``X = floor(-t ln W)``, which has the same law
    ``P(X >= x) = exp(-x/t)``; larger ``t`` use CKS's two-step form.
    """
    if t < 1 << 24:
        x = _geometric_fast(m, t, source)
        if _FUSED:
            out = np.empty(m, dtype=np.int64)
            return out[: _loops().signs(x, uint64s(m, source), s, out)]
        y = x // s
        b = (uint64s(m, source) & np.uint64(1)).astype(bool)
        ok = ~(b & (y == 0))
        return np.where(b[ok], -y[ok], y[ok])
    u = _uniform_below_scalar(t, m, source)
    # gamma = u / t in [0, 1): float quotient has relative error 2^-52.
    keep = _bernoulli_exp_neg_fast(u.astype(np.float64) / float(t), lambda i: Fraction(int(u[i]), t), source)
    idx = np.flatnonzero(keep)
    v = np.zeros(idx.size, dtype=np.int64)
    alive = np.arange(idx.size)
    one = Fraction(1)
    while alive.size:
        a = _bernoulli_exp_neg_fast(np.ones(alive.size), lambda i: one, source)
        alive = alive[a]
        v[alive] += 1
    # u + t*v must not wrap around int64: such a draw (|y| near 2^63, probability about
    # exp(-2^63 / t)) is rejected and redrawn, so the output is conditioned on fitting int64.
    fits = v <= (_INT64_MAX - (t - 1)) // t
    x = u[idx] + t * np.where(fits, v, 0)
    y = x // s
    b = (uint64s(idx.size, source) & np.uint64(1)).astype(bool)
    ok = fits & ~(b & (y == 0))
    return np.where(b[ok], -y[ok], y[ok])


def _dlap_core(n: int, t: int, s: int, source: RandomSource) -> np.ndarray:
    """``n`` draws of the discrete Laplace with scale t/s: P(y) ∝ exp(-|y| s / t) (CKS Alg. 2).

    Rejection sampling yields i.i.d. accepted draws, so taking the first ``n`` accepted ones of an
    oversampled batch (acceptance is about 1 - e^-1 for large ``t``) is exact.
    """
    parts: list[np.ndarray] = []
    have = 0
    while have < n:
        # Attempts per wanted draw: one-step attempts are rejected only as a negative zero, with
        # probability (1 - e^(-s/t)) / 2 (X < s); CKS's two-step form also rejects U, about e^-1.
        # Oversampling by 0.2% (+32) makes a second pass rare; every attempt beyond it is wasted work.
        factor = 1.002 / (1 - (1 - math.exp(-s / t)) / 2) if t < 1 << 24 else 1.7
        got = _dlap_attempts(int((n - have) * factor) + 32, t, s, source)[: n - have]
        parts.append(got)
        have += got.size
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


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
    s2 = Fraction(a, b)
    c_f = float(s2 / t)  # sigma^2 / t, rounded once
    two_s2_f = 2.0 * float(s2)
    # Draws per wanted sample: the acceptance below is about 0.76 for large sigma (0.58 at sigma 0.6);
    # 1.33 makes a second pass rare there, and a short pass only draws the rest.
    oversample = 1.33 if t > 4 else 1.8
    out = np.empty(n, dtype=np.int64)
    have = 0
    while have < n:
        y = _dlap_core(int((n - have) * oversample) + 32, t, 1, source)
        # gamma = (|y| - sigma^2/t)^2 / (2 sigma^2). In float64 its absolute error is about
        # |d| sigma^-1 2^-51, so exp(-gamma) is off by < 2^-50 (u e^{-u^2/2} <= 0.61); exact
        # fallback for draws within 2^-40 of the threshold. Accepted draws are i.i.d.: the first
        # ``n`` of them are exact.
        exact = lambda i, y=y: (abs(int(y[i])) - s2 / t) ** 2 / (2 * s2)  # noqa: E731
        if _FUSED:
            u = uint64s(y.size, source)
            c = np.empty(y.size, dtype=np.bool_)
            amb = np.empty(y.size, dtype=np.bool_)
            if _loops().gauss_accept(y, c_f, two_s2_f, u, _MARGIN, c, amb):
                for i in np.flatnonzero(amb).tolist():  # pragma: no cover - probability ~2^-39 per draw
                    c[i] = _exact_uniform_below_exp(int(u[i]), exact(i), source)
            have = _loops().take(y, c, out, have)
        else:
            d = np.abs(y).astype(np.float64) - c_f
            got = y[_bernoulli_exp_neg_fast(d * d / two_s2_f, exact, source)][: n - have]
            out[have : have + got.size] = got
            have += got.size
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
