"""Noise calibration: the smallest noise that meets a target (epsilon, delta).

The target is met under the accountant whose epsilon is reported: by default the tightest of
RDP, pure DP and dp-accounting's PLD (:func:`dp.accountant.best_epsilon`, what ``secagg privacy
account`` prints and what the ledger reports); with ``use_pld=False`` RDP and pure DP only. (Until
issue 9 the calibration used RDP alone, so the reported PLD epsilon came out below the target:
1.747 for a target of 2 at q = 0.01, 1000 steps; the noise was larger than needed.)

Epsilon is non-increasing in the noise, so the smallest noise is found by root finding on a
bracket ``[lo, hi]`` with ``eps(lo) > target >= eps(hi)``: first on RDP alone (cheap), whose answer
is an upper end for the tightest accountant (``min(RDP, PLD) <= RDP``); then, with PLD, by
regula falsi (Illinois) with a bisection fallback, about 6-10 PLD evaluations. The returned value is
the *upper* end of the final bracket, evaluated by the very function that reports it, so the
calibrated noise never overshoots the target; the bracket is narrowed to a relative width of
``rtol``, so ``(1 - rtol)`` times less noise already overshoots (both checked by hypothesis tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from dp.accountant import RdpAccountant, best_epsilon
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


def _solve(eps_of: Callable[[float], float], target: float, lo: float, hi: float, rtol: float,
           f_lo: float = math.inf) -> float:
    """Smallest x (within ``rtol``) with ``eps_of(x) <= target``, given ``eps_of(lo) > target >= eps_of(hi)``.

    Regula falsi with the Illinois modification; every third step bisects, so the bracket at least
    halves every three evaluations whatever the shape of ``eps_of``. ``f_lo`` is
    ``eps_of(lo) - target`` when known (inf: unknown, e.g. ``lo = 0``).
    """
    f_hi = eps_of(hi) - target
    if f_hi > 0:
        raise ValueError(f"internal: the upper end {hi} of the bracket does not meet the target.")
    side = 0
    for step in range(10_000):
        if hi - lo <= rtol * hi:
            return hi
        if math.isfinite(f_lo) and f_lo != f_hi and step % 3 != 2:
            x = hi - f_hi * (hi - lo) / (f_hi - f_lo)
            x = min(max(x, lo + 0.25 * rtol * hi), hi - 0.25 * rtol * hi)  # strictly inside the bracket
        else:
            x = 0.5 * (lo + hi)
        f = eps_of(x) - target
        if f > 0:
            lo, f_lo = x, f
            if side == -1:
                f_hi *= 0.5  # Illinois: halve the value at the end that stayed put
            side = -1
        else:
            hi, f_hi = x, f
            if side == 1:
                f_lo *= 0.5
            side = 1
    return hi  # pragma: no cover - the bracket halves every three steps


def _tighten(eps_of: Callable[[float], float], target: float, hi: float, rtol: float) -> float:
    """Given ``eps_of(hi) <= target``, the smallest such noise for ``eps_of`` (which is below RDP's)."""
    lo = hi
    for _ in range(60):  # step down by 10% until the target is missed
        lo *= 0.9
        f = eps_of(lo) - target
        if f > 0:
            return _solve(eps_of, target, lo, hi, rtol, f)
        hi = lo
    return hi  # pragma: no cover - 0.9^60 of the RDP noise still meeting the target


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
    use_pld: bool = True,
) -> float:
    """Smallest noise multiplier (within ``rtol``) whose reported epsilon is ``<= target_epsilon``.

    Args:
        target_epsilon: the epsilon to meet.
        delta: the delta it refers to, in (0, 1).
        q: sampling rate per step.
        steps: number of steps (rounds).
        sampling: ``"poisson"`` (add/remove neighbours) or ``"fixed"`` (replace-one, needs
            ``population``).
        population: population size for ``sampling="fixed"``.
        orders: RDP orders (default :func:`dp.rdp.default_orders`).
        rtol: relative width of the final bracket: ``z * (1 - rtol)`` no longer meets the target.
        use_pld: meet the target under the tightest of RDP and PLD, i.e. the epsilon
            :func:`~dp.accountant.best_epsilon` reports (default); ``False``: under RDP alone (faster,
            more noise than needed when PLD is tighter).

    Example:
        >>> z = calibrate_gaussian_noise_multiplier(target_epsilon=1.0, delta=1e-5, q=0.01, steps=1000, use_pld=False)
        >>> 1.5 < z < 1.8
        True
    """
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be positive and finite. Found {target_epsilon!r}.")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1) for Gaussian noise. Found {delta!r}.")
    relation = "add_remove" if sampling == "poisson" else "replace_one"

    def event(z: float) -> DpEvent:
        return gaussian_training_event(noise_multiplier=z, q=q, steps=steps, sampling=sampling, population=population)

    def rdp_eps(z: float) -> float:
        acc = RdpAccountant(orders, neighboring_relation=relation)
        acc.compose(event(z))
        return acc.get_epsilon_and_order(delta, warn=False)[0]

    z_rdp = _bisect(rdp_eps, target_epsilon, 0.0, 1.0, rtol)
    if not use_pld:
        return z_rdp

    def reported(z: float) -> float:
        return best_epsilon(event(z), delta, orders=orders, neighboring_relation=relation).epsilon

    return _tighten(reported, target_epsilon, z_rdp, rtol)


def calibrate_laplace_epsilon0(
    *,
    target_epsilon: float,
    count: int,
    delta: float = 0.0,
    orders: object = None,
    rtol: float = 1e-6,
    use_pld: bool = True,
) -> float:
    """Largest per-release epsilon0 such that ``count`` Laplace releases stay within
    ``(target_epsilon, delta)`` under the reported accountant.

    The reported accountant is the tightest of RDP, basic (pure) composition and, with
    ``use_pld`` and ``delta > 0``, PLD (:func:`~dp.accountant.best_epsilon` with replace-one
    neighbours, as ``secagg privacy`` reports LDP uploads). With ``delta = 0`` this is
    ``target_epsilon / count`` (lowered by an ulp if rounding would overshoot).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int. Found {count!r}.")
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be positive and finite. Found {target_epsilon!r}.")
    if not (isinstance(delta, (int, float)) and 0 <= delta < 1):
        raise ValueError(f"delta must be in [0, 1). Found {delta!r}.")

    def reported(x: float) -> float:  # x = 1 / epsilon0, the noise multiplier; the event is built as callers build it
        ev = SelfComposed(Laplace.from_epsilon(1.0 / x), count)
        return best_epsilon(ev, delta, orders=orders, use_pld=use_pld, neighboring_relation="replace_one").epsilon

    basic = target_epsilon / count
    x = 1.0 / basic
    if delta > 0:
        def rdp_or_pure(b: float) -> float:
            acc = RdpAccountant(orders).compose(SelfComposed(Laplace(b), count))
            return min(acc.get_epsilon_and_order(delta, warn=False)[0], count / b)

        x = min(x, _bisect(rdp_or_pure, target_epsilon, 0.0, 1.0 / basic, rtol))
        if use_pld:
            x = _tighten(reported, target_epsilon, x, rtol)
    while reported(x) > target_epsilon:  # float rounding of 1/x: step to the next larger noise
        x = math.nextafter(x, math.inf)
    return 1.0 / x
