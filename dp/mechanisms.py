"""Floating-point Laplace and Gaussian noise drawn from the OS CSPRNG.

Floating-point caveat (Mironov 2012, "On significance of the least significant bits for
differential privacy"): a sampler that computes ``-b log(U)`` or Box-Muller in doubles does not
produce a true Laplace/Gaussian; the set of reachable doubles depends on the input, and an
adversary who sees ``x + noise`` exactly can sometimes tell inputs apart, breaking the DP
guarantee regardless of the CSPRNG. These float mechanisms are for simulation and for values
that are rounded afterwards (e.g. to a fixed-point grid much coarser than a double's ulp, which
is Mironov's "snapping" idea in spirit but not his exact construction). Where the noisy value is
released exactly, use :mod:`dp.discrete` on an integer grid instead.

Uniforms come from 52 CSPRNG bits on the grid ``(k + 1/2) / 2^52`` (never 0, 1 or 1/2, so Laplace
noise is always finite, at most ``b * 52 log 2`` in magnitude); Laplace is the inverse CDF, Gaussian
is Box-Muller.
"""

from __future__ import annotations

import math

import numpy as np

from dp.rng import RandomSource, resolve_source, uniform_open01

__all__ = ["gaussian_noise", "laplace_noise"]


def _check_scale(scale: float, name: str) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name} must be a positive finite number. Found {scale!r}.")
    return float(scale)


def laplace_noise(
    shape: int | tuple[int, ...],
    scale: float,
    *,
    _test_source: RandomSource | None = None,
) -> np.ndarray:
    """Float Laplace(0, scale) noise from the CSPRNG (see the module's floating-point caveat).

    Args:
        shape: output shape.
        scale: ``b``; the density is ``exp(-|x|/b) / (2b)``.
        _test_source: TEST-ONLY deterministic source; the default is the OS CSPRNG.
    """
    b = _check_scale(scale, "scale")
    source = resolve_source(_test_source)
    n = int(np.prod(shape))
    u = uniform_open01(n, source) - 0.5  # in (-1/2, 1/2), never 0 or +-1/2 exactly
    x = -b * np.sign(u) * np.log1p(-2.0 * np.abs(u))
    return x.reshape(shape)


def gaussian_noise(
    shape: int | tuple[int, ...],
    sigma: float,
    *,
    _test_source: RandomSource | None = None,
) -> np.ndarray:
    """Float N(0, sigma^2) noise from the CSPRNG via Box-Muller (see the floating-point caveat).

    Args:
        shape: output shape.
        sigma: standard deviation.
        _test_source: TEST-ONLY deterministic source; the default is the OS CSPRNG.
    """
    s = _check_scale(sigma, "sigma")
    source = resolve_source(_test_source)
    n = int(np.prod(shape))
    half = (n + 1) // 2
    u1 = uniform_open01(half, source)
    u2 = uniform_open01(half, source)
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)])[:n]
    return (s * z).reshape(shape)
