"""RDP numeric core against Opacus, dp-accounting, mpmath integrals and published vectors."""

from __future__ import annotations

import math
import warnings

# Oracles. opacus is in the [dev] extra that CI installs: a missing oracle must fail the run, not
# silently skip every comparison with it (importorskip did).
import dp_accounting.rdp.rdp_privacy_accountant as dpa_rdp
import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants.analysis import rdp as opacus_rdp

from dp import rdp
from dp.rdp import OrderRangeWarning, default_orders

OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def _mp_sgm_rdp(q: float, z: float, alpha: float) -> float:
    """Independent oracle: 40-digit integral of E_mu0[(mu/mu0)^alpha]."""
    with mpmath.workdps(40):
        q_, z_, a_ = mpmath.mpf(q), mpmath.mpf(z), mpmath.mpf(alpha)

        def f(t):
            return mpmath.npdf(t, 0, z_) * (1 - q_ + q_ * mpmath.exp((2 * t - 1) / (2 * z_ * z_))) ** a_

        z0 = z_ * z_ * mpmath.log(1 / q_ - 1) + mpmath.mpf(1) / 2 if q_ < 1 else mpmath.mpf(0)
        pts = sorted({-mpmath.inf, mpmath.mpf(0), mpmath.mpf(z0), a_, mpmath.inf})
        return float(mpmath.log(mpmath.quad(f, pts)) / (a_ - 1))


def test_default_orders_cover_the_documented_ranges() -> None:
    o = default_orders()
    assert set(range(2, 257)) <= set(o.tolist())
    frac = o[o != np.round(o)]
    assert frac.min() <= 1.1 and frac.max() >= 9.9 and np.all((frac > 1) & (frac < 10))
    assert o.max() == 1024 and np.all(o > 1) and len(set(o.tolist())) == o.size


# ------------------------------------------------------------------ published vectors
def test_dp_accounting_published_poisson_gaussian_vector() -> None:
    """dp-accounting rdp_privacy_accountant_test.test_compute_rdp_poisson_sampled_gaussian."""
    orders = [1.5, 2.5, 5, 50, 100]
    got = 50 * rdp.rdp_sampled_gaussian(q=0.01, noise_multiplier=2.5, orders=orders)
    expected = np.array([6.70579741e-04, 1.08548710e-03, 2.18075656e-03, 2.38460375e-02, 1.67416308e02])
    # integer orders: the closed form, same value
    np.testing.assert_allclose(got[2:], expected[2:], rtol=1e-4)
    # fractional orders: dp-accounting's published values are over-estimates; ours are the exact
    # integral (mpmath), hence smaller - never larger.
    assert np.all(got[:2] <= expected[:2])
    for i, a in enumerate(orders[:2]):
        assert got[i] == pytest.approx(50 * _mp_sgm_rdp(0.01, 2.5, a), rel=1e-8)


def test_dp_accounting_published_pure_dp_conversion() -> None:
    """Constant RDP 1.1 over orders 2..32 at delta 1e-5 -> epsilon 1.32783806176 at order 32."""
    orders = np.arange(2, 33, dtype=float)
    with pytest.warns(OrderRangeWarning, match="largest"):
        eps, order = rdp.epsilon_from_rdp(orders=orders, rdp=np.full(orders.size, 1.1), delta=1e-5)
    assert eps == pytest.approx(1.32783806176, abs=1e-9) and order == 32
    with pytest.warns(OrderRangeWarning):
        delta, order = rdp.delta_from_rdp(orders=orders, rdp=np.full(orders.size, 1.1), epsilon=1.32783806176)
    assert delta == pytest.approx(1e-5, rel=1e-8) and order == 32


def test_dp_accounting_published_gaussian_one_one_e6() -> None:
    """Gaussian with z = 4.530877117 is exactly (1, 1e-6)-DP; RDP over a dense order grid gives ~1."""
    orders = [0.001 * i for i in range(1001, 100000, 7)]
    r = rdp.rdp_gaussian(noise_multiplier=4.530877117, orders=orders)
    eps, _ = rdp.epsilon_from_rdp(orders=orders, rdp=r, delta=1e-6)
    assert eps == pytest.approx(1.0, abs=1e-3)
    delta, _ = rdp.delta_from_rdp(orders=orders, rdp=r, epsilon=1.0)
    assert delta == pytest.approx(1e-6, rel=1e-2)


def test_opacus_published_epsilon() -> None:
    """Opacus accountants_test: z=1.5, q=0.04, 2250 steps, delta 1e-5 -> 7.32911117143."""
    r = 2250 * rdp.rdp_sampled_gaussian(q=0.04, noise_multiplier=1.5, orders=OPACUS_ORDERS)
    eps, _ = rdp.epsilon_from_rdp(orders=OPACUS_ORDERS, rdp=r, delta=1e-5)
    assert eps == pytest.approx(7.32911117143, rel=1e-7)
    # our default orders can only be tighter
    r2 = 2250 * rdp.rdp_sampled_gaussian(q=0.04, noise_multiplier=1.5, orders=default_orders())
    assert rdp.epsilon_from_rdp(orders=default_orders(), rdp=r2, delta=1e-5)[0] <= eps


def test_peers_fractional_value_is_exact_not_dp_accounting_overestimate() -> None:
    """PEERS.md: at alpha=1.1, q=0.04, z=1.5 the exact value is 4.82e-4 (dp-accounting 5.69e-4)."""
    ours = float(rdp.rdp_sampled_gaussian(q=0.04, noise_multiplier=1.5, orders=[1.1])[0])
    assert ours == pytest.approx(_mp_sgm_rdp(0.04, 1.5, 1.1), rel=1e-8)
    assert ours == pytest.approx(4.82e-4, rel=1e-2)


# ------------------------------------------------------------------ property tests
q_st = st.floats(1e-3, 0.99)
z_st = st.floats(0.5, 10.0)
steps_st = st.integers(1, 100000)
delta_st = st.floats(1e-10, 1e-3)


@settings(max_examples=25, deadline=None)
@given(q=q_st, z=z_st, steps=steps_st, delta=delta_st)
def test_matches_opacus_within_1e6(q: float, z: float, steps: int, delta: float) -> None:
    ours = steps * rdp.rdp_sampled_gaussian(q=q, noise_multiplier=z, orders=OPACUS_ORDERS)
    theirs = np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=OPACUS_ORDERS))
    finite = np.isfinite(theirs) & (theirs > 1e-300)
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=1e-6, atol=1e-13 * steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e1, _ = rdp.epsilon_from_rdp(orders=OPACUS_ORDERS, rdp=ours, delta=delta)
        e2, _ = opacus_rdp.get_privacy_spent(orders=OPACUS_ORDERS, rdp=theirs, delta=delta)
    if math.isfinite(e2) and e2 > 0:
        assert e1 <= e2 * (1 + 1e-6) + 1e-12


@settings(max_examples=25, deadline=None)
@given(q=q_st, z=z_st, steps=steps_st)
def test_never_above_dp_accounting(q: float, z: float, steps: int) -> None:
    orders = [1.25, 1.5, 2.0, 3.5, 7.0, 9.9, 32.0, 256.0]
    ours = steps * rdp.rdp_sampled_gaussian(q=q, noise_multiplier=z, orders=orders)
    theirs = steps * np.asarray(dpa_rdp._compute_rdp_poisson_subsampled_gaussian(q, z, orders))
    ints = np.array([o == round(o) for o in orders])
    # fractional: dp-accounting over-estimates; ours must never be above (up to our 1e-10 nudge)
    assert np.all(ours[~ints] <= theirs[~ints] * (1 + 1e-9) + 1e-300)
    np.testing.assert_allclose(ours[ints], theirs[ints], rtol=1e-6, atol=1e-13 * steps)


@settings(max_examples=12, deadline=None)
@given(q=st.floats(1e-4, 0.99), z=st.floats(0.4, 20.0), alpha=st.sampled_from([1.1, 1.5, 2.3, 4.7, 7.5, 9.9]))
def test_fractional_orders_sound_and_tight_vs_mpmath(q: float, z: float, alpha: float) -> None:
    ours = float(rdp.rdp_sampled_gaussian(q=q, noise_multiplier=z, orders=[alpha])[0])
    exact = _mp_sgm_rdp(q, z, alpha)
    assert ours >= exact  # sound
    assert ours <= exact * (1 + 1e-6)  # tight


@pytest.mark.parametrize("alpha", [2.0, 5.0, 64.0])
def test_integer_orders_vs_mpmath(alpha: float) -> None:
    for q, z in [(0.01, 1.0), (0.3, 0.7), (1e-5, 5.0)]:
        exact = _mp_sgm_rdp(q, z, alpha)
        ours = float(rdp.rdp_sampled_gaussian(q=q, noise_multiplier=z, orders=[alpha])[0])
        assert exact <= ours <= exact * (1 + 1e-6)


# ------------------------------------------------------------------ Laplace
@pytest.mark.parametrize("b", [0.3, 1.0, 5.0])
@pytest.mark.parametrize("alpha", [1.5, 2.0, 7.3, 40.0])
def test_laplace_rdp_vs_numerical_integration(b: float, alpha: float) -> None:
    with mpmath.workdps(30):
        b_, a_ = mpmath.mpf(b), mpmath.mpf(alpha)

        def p(x, mu):
            return mpmath.exp(-abs(x - mu) / b_) / (2 * b_)

        integral = mpmath.quad(lambda x: p(x, 1) ** a_ * p(x, 0) ** (1 - a_), [-mpmath.inf, 0, 1, mpmath.inf])
        exact = float(mpmath.log(integral) / (a_ - 1))
    ours = float(rdp.rdp_laplace(noise_multiplier=b, orders=[alpha])[0])
    assert exact <= ours <= exact * (1 + 1e-8)
    assert ours <= 1 / b  # never above pure epsilon


def test_laplace_matches_dp_accounting_and_pure_limit() -> None:
    orders = [1.5, 2.0, 10.0, 100.0]
    for eps0 in (0.01, 1.0, 10.0):
        theirs = [dpa_rdp._laplace_rdp(eps0, o) for o in orders]
        np.testing.assert_allclose(rdp.rdp_laplace(noise_multiplier=1 / eps0, orders=orders), theirs, rtol=1e-7)
    assert float(rdp.rdp_laplace(noise_multiplier=0.5, orders=[math.inf])[0]) == pytest.approx(2.0)


# ------------------------------------------------------------------ conversion
def test_conversion_round_trip_and_kl_regime() -> None:
    orders = default_orders()
    r = 100 * rdp.rdp_sampled_gaussian(q=0.05, noise_multiplier=1.0, orders=orders)
    eps, order = rdp.epsilon_from_rdp(orders=orders, rdp=r, delta=1e-6)
    delta, _ = rdp.delta_from_rdp(orders=orders, rdp=r, epsilon=eps)
    assert delta == pytest.approx(1e-6, rel=1e-6) and 1 < order < 1024
    # tiny RDP: the KL bound gives epsilon 0 at a large delta
    assert rdp.epsilon_from_rdp(orders=[2.0, 3.0], rdp=[1e-8, 2e-8], delta=0.5)[0] == 0.0


def test_edge_warning_and_delta_zero() -> None:
    with pytest.warns(OrderRangeWarning, match="smallest"):
        rdp.epsilon_from_rdp(orders=[2.0, 3.0, 4.0], rdp=[1.0, 50.0, 200.0], delta=1e-5)
    assert rdp.epsilon_from_rdp(orders=[2.0], rdp=[0.0], delta=0.0)[0] == 0.0
    assert rdp.epsilon_from_rdp(orders=[2.0], rdp=[0.1], delta=0.0)[0] == math.inf


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"q": 1.5, "noise_multiplier": 1.0, "orders": [2.0]}, "q must be"),
        ({"q": 0.1, "noise_multiplier": -1.0, "orders": [2.0]}, "noise_multiplier"),
        ({"q": 0.1, "noise_multiplier": 1.0, "orders": [1.0]}, "order"),
    ],
)
def test_rdp_input_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rdp.rdp_sampled_gaussian(**kwargs)


def test_special_cases() -> None:
    o = [2.0, 2.5]
    assert np.all(rdp.rdp_sampled_gaussian(q=0.0, noise_multiplier=1.0, orders=o) == 0)
    assert np.all(np.isinf(rdp.rdp_sampled_gaussian(q=0.1, noise_multiplier=0.0, orders=o)))
    np.testing.assert_allclose(rdp.rdp_sampled_gaussian(q=1.0, noise_multiplier=2.0, orders=o), [0.25, 0.3125])
    # sampling never hurts: never above the full Gaussian
    assert np.all(
        rdp.rdp_sampled_gaussian(q=0.9, noise_multiplier=0.3, orders=default_orders())
        <= rdp.rdp_gaussian(noise_multiplier=0.3, orders=default_orders())
    )
