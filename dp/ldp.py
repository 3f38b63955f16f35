"""Local DP for vectors (FedCL section 2.3) and the composition of repeated uploads.

Parties: each client perturbs its own vector before it leaves the device; the server (and anyone
who sees the upload) is the adversary; nothing is trusted.

Neighbouring relation: *any two vectors* the client could hold (local DP, replace-one).
After clipping, every input lies in the ball ``{v : ||v|| <= Delta}``, so two inputs differ by at
most ``2 Delta`` in that norm: the sensitivity is ``2 Delta``.

* :func:`ldp_laplace` - FedCL's recipe: ``clip_L1(u, Delta) + Lap(2 Delta / epsilon)^d``. Promise:
  each upload is ``epsilon``-LDP (pure). Limit: ``k`` uploads of the same user compose; see
  :func:`ldp_repeated_uploads` (FedCL never composed them).
* :func:`ldp_gaussian` - ``clip_L2(u, Delta) + N(0, (2 Delta z)^2 I)``: one upload is the event
  ``Gaussian(z)`` (an (epsilon, delta) guarantee, never pure).

Noise is float noise from the CSPRNG (see :mod:`dp.mechanisms` for the floating-point caveat).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dp.accountant import PrivacyReport, best_epsilon
from dp.clipping import clip_l1, clip_l2
from dp.events import DpEvent, Gaussian, Laplace, SelfComposed
from dp.mechanisms import gaussian_noise, laplace_noise
from dp.rng import RandomSource

__all__ = ["LdpRelease", "ldp_gaussian", "ldp_laplace", "ldp_repeated_uploads"]


@dataclass(frozen=True)
class LdpRelease:
    """A perturbed vector and what it cost.

    Attributes:
        values: the released vector.
        clip_scale: the clipping scale applied (1.0 = not clipped).
        noise_scale: Laplace scale ``b`` or Gaussian std.
        event: the privacy event of this one upload (replace-one neighbours).
    """

    values: np.ndarray
    clip_scale: float
    noise_scale: float
    event: DpEvent


def _positive(name: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number. Found {v!r}.")


def ldp_laplace(
    vector: np.ndarray, *, clip_bound: float, epsilon: float, _test_source: RandomSource | None = None
) -> LdpRelease:
    """FedCL's LDP upload: ``clip_L1(vector, clip_bound) + Laplace(2 clip_bound / epsilon)`` per coordinate.

    Returns an :class:`LdpRelease` whose event is ``Laplace.from_epsilon(epsilon)``.
    """
    _positive("clip_bound", clip_bound)
    _positive("epsilon", epsilon)
    clipped, scale = clip_l1(vector, clip_bound)
    b = 2.0 * clip_bound / epsilon
    noisy = clipped + laplace_noise(clipped.shape, b, _test_source=_test_source)
    return LdpRelease(noisy, scale, b, Laplace.from_epsilon(epsilon))


def ldp_gaussian(
    vector: np.ndarray, *, clip_bound: float, noise_multiplier: float, _test_source: RandomSource | None = None
) -> LdpRelease:
    """Gaussian LDP upload: ``clip_L2(vector, clip_bound) + N(0, (2 clip_bound z)^2)`` per coordinate."""
    _positive("clip_bound", clip_bound)
    _positive("noise_multiplier", noise_multiplier)
    clipped, scale = clip_l2(vector, clip_bound)
    sigma = 2.0 * clip_bound * noise_multiplier
    noisy = clipped + gaussian_noise(clipped.shape, sigma, _test_source=_test_source)
    return LdpRelease(noisy, scale, sigma, Gaussian(noise_multiplier))


def ldp_repeated_uploads(upload: DpEvent, uploads: int, *, delta: float, use_pld: bool = True) -> PrivacyReport:
    """Privacy of ``uploads`` LDP uploads by the same user (sequential composition).

    The best of basic composition (pure), RDP and PLD, under the replace-one relation. E.g. FedCL's
    ``epsilon = 1`` per upload over 100 uploads at ``delta = 1e-5``: basic 100, RDP 70.78, PLD 68.25.
    """
    if isinstance(uploads, bool) or not isinstance(uploads, int) or uploads < 0:
        raise ValueError(f"uploads must be a non-negative int. Found {uploads!r}.")
    return best_epsilon(SelfComposed(upload, uploads), delta, use_pld=use_pld, neighboring_relation="replace_one")
