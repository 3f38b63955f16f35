"""Noise calibration: the smallest noise that meets a target (epsilon, delta).

Bisection on the RDP accountant's epsilon, which is monotone (non-increasing) in the noise
multiplier. The returned value is the *upper* end of the final bracket, so the calibrated noise
never overshoots the target epsilon (checked by a hypothesis property test); the bracket is
narrowed to a relative width of ``rtol``.
"""

from __future__ import annotations

import math
from typing import Literal

from dp.accountant import RdpAccountant
from dp.events import DpEvent, Gaussian, Laplace, PoissonSampled, SampledWithoutReplacement, SelfComposed

__all__ = ["calibrate_gaussian_noise_multiplier", "calibrate_laplace_epsilon0", "gaussian_training_event"]


def gaussian_training_event(
    *,
    noise_multiplier: float,
    q: float,
    steps: int,
    sampling: Literal["poisson", "fixed"] = "poisson",
    population: int | None = None,
) -> DpEvent:
    """``steps`` rounds of a sampled Gaussian (DP-FedAvg / DP-SGD).

    ``sampling="fixed"`` samples ``round(q * population)`` users without replacement each round
    (replace-one neighbours) and needs ``population``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative int. Found {steps!r}.")
    inner = Gaussian(noise_multiplier)
    if sampling == "poisson":
        step: DpEvent = PoissonSampled(q, inner)
    elif sampling == "fixed":
        if population is None or population < 1:
            raise ValueError(f"sampling='fixed' needs population >= 1. Found {population!r}.")
        step = SampledWithoutReplacement(population, max(1, round(q * population)), inner)
    else:
        raise ValueError(f"sampling must be 'poisson' or 'fixed'. Found {sampling!r}.")
    return SelfComposed(step, steps)


def _bisect(eps_of, target: float, lo: float, hi: float, rtol: float) -> float:
    # find hi with eps(hi) <= target
    for _ in range(200):
        if eps_of(hi) <= target:
            break
        lo, hi = hi, hi * 2
    else:
        raise ValueError(f"no noise level up to {hi:g} reaches epsilon {target}.")
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        if eps_of(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def calibrate_gaussian_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    q: float,
    steps: int,
    sampling: Literal["poisson", "fixed"] = "poisson",
    population: int | None = None,
    orders: object = None,
    rtol: float = 1e-4,
) -> float:
    """Smallest noise multiplier (within ``rtol``) whose RDP epsilon is ``<= target_epsilon``.

    Example:
        >>> z = calibrate_gaussian_noise_multiplier(target_epsilon=1.0, delta=1e-5, q=0.01, steps=1000)
        >>> 1.5 < z < 1.8
        True
    """
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be positive and finite. Found {target_epsilon!r}.")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1) for Gaussian noise. Found {delta!r}.")
    relation = "add_remove" if sampling == "poisson" else "replace_one"

    def eps_of(z: float) -> float:
        acc = RdpAccountant(orders, neighboring_relation=relation)
        acc.compose(gaussian_training_event(noise_multiplier=z, q=q, steps=steps, sampling=sampling, population=population))
        return acc.get_epsilon_and_order(delta, warn=False)[0]

    return _bisect(eps_of, target_epsilon, 0.0, 1.0, rtol)


def calibrate_laplace_epsilon0(
    *, target_epsilon: float, count: int, delta: float = 0.0, orders: object = None, rtol: float = 1e-6
) -> float:
    """Largest per-release epsilon0 such that ``count`` Laplace releases stay within
    ``(target_epsilon, delta)`` under the RDP accountant (or basic composition when tighter).

    With ``delta = 0`` this is exactly ``target_epsilon / count``.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int. Found {count!r}.")
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be positive and finite. Found {target_epsilon!r}.")
    if not (isinstance(delta, (int, float)) and 0 <= delta < 1):
        raise ValueError(f"delta must be in [0, 1). Found {delta!r}.")
    basic = target_epsilon / count
    if delta == 0:
        return basic

    def eps_of(b: float) -> float:  # b = noise multiplier = 1/eps0
        acc = RdpAccountant(orders).compose(SelfComposed(Laplace(b), count))
        return min(acc.get_epsilon_and_order(delta, warn=False)[0], count / b)

    b = _bisect(eps_of, target_epsilon, 0.0, 1.0 / basic, rtol)
    return max(basic, 1.0 / b)
