"""Accountants (contract shared by all), composition semantics, calibration, LDP."""

from __future__ import annotations

import dataclasses
import math
import warnings

import dp_accounting as dpa  # a hard dependency: a missing install must fail, not skip (was importorskip)
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp.accountant import PldAccountant, RdpAccountant, best_epsilon, pure_epsilon
from dp.calibration import calibrate_gaussian_noise_multiplier, calibrate_laplace_epsilon0, gaussian_training_event
from dp.errors import UnsupportedEventError
from dp.events import (
    Composed,
    DpEvent,
    FelTotal,
    Gaussian,
    Laplace,
    ParallelComposed,
    PoissonSampled,
    SampledWithoutReplacement,
    SelfComposed,
    event_from_dict,
    event_to_dict,
)
from dp.ldp import ldp_gaussian, ldp_laplace, ldp_repeated_uploads
from dp.rng import DeterministicTestSource


class _Unknown(DpEvent):
    __slots__ = ()


def _sgm(q: float, z: float, steps: int) -> DpEvent:
    return SelfComposed(PoissonSampled(q, Gaussian(z)), steps)


# ------------------------------------------------------------------ contract (every accountant)
@pytest.fixture(params=["rdp", "pld"])
def make(request):
    if request.param == "rdp":
        return lambda: RdpAccountant()
    return lambda: PldAccountant()


def test_contract_no_events_is_zero(make) -> None:
    acc = make()
    assert acc.get_epsilon(1e-6) == pytest.approx(0.0, abs=1e-9)


def test_contract_non_private_is_infinite(make) -> None:
    acc = make().compose(Gaussian(0.0))
    assert acc.get_epsilon(1e-3) == math.inf


def test_contract_unknown_nested_event_rejected_state_unchanged(make) -> None:
    acc = make().compose(_sgm(0.01, 1.0, 10))
    before = acc.get_epsilon(1e-5)
    with pytest.raises(UnsupportedEventError, match="_Unknown"):
        acc.compose(Composed((Gaussian(1.0), SelfComposed(_Unknown(), 2))))
    assert acc.get_epsilon(1e-5) == before


def test_contract_composition_is_additive(make) -> None:
    a = make().compose(_sgm(0.02, 1.2, 40))
    b = make().compose(_sgm(0.02, 1.2, 20)).compose(PoissonSampled(0.02, Gaussian(1.2)), count=20)
    assert a.get_epsilon(1e-5) == pytest.approx(b.get_epsilon(1e-5), rel=1e-6)


# ------------------------------------------------------------------ semantics
def test_parallel_is_max_and_fel_total_forms() -> None:
    leaf_a, leaf_b = _sgm(0.02, 1.0, 51), _sgm(0.01, 1.0, 100)
    acc = RdpAccountant()
    ra, rb = acc.rdp_of(leaf_a), acc.rdp_of(leaf_b)
    np.testing.assert_array_equal(acc.rdp_of(ParallelComposed((leaf_a, leaf_b))), np.maximum(ra, rb))
    oa = _sgm(0.05, 2.0, 10)
    ro = acc.rdp_of(oa)
    np.testing.assert_array_equal(acc.rdp_of(FelTotal((leaf_a, leaf_b))), np.maximum(ra, rb))
    np.testing.assert_allclose(acc.rdp_of(FelTotal((leaf_a, leaf_b), oa, "same")), np.maximum(ra, rb) + ro)
    np.testing.assert_array_equal(acc.rdp_of(FelTotal((leaf_a, leaf_b), oa, "disjoint")), np.maximum.reduce([ra, rb, ro]))
    # limit: parallel composition is only valid for disjoint cohorts; the same users twice is the sum
    assert RdpAccountant().compose(Composed((leaf_a, leaf_b))).get_epsilon(1e-6) > RdpAccountant().compose(
        ParallelComposed((leaf_a, leaf_b))
    ).get_epsilon(1e-6)


def test_pld_parallel_is_worst_cohort() -> None:
    a, b = _sgm(0.02, 1.0, 30), _sgm(0.05, 1.0, 30)
    par = PldAccountant().compose(ParallelComposed((a, b))).get_epsilon(1e-6)
    assert par == pytest.approx(PldAccountant().compose(b).get_epsilon(1e-6), rel=1e-9)


def test_sampling_relation_mismatch_rejected() -> None:
    with pytest.raises(UnsupportedEventError, match="replace_one"):
        RdpAccountant().compose(SampledWithoutReplacement(100, 10, Gaussian(1.0)))
    with pytest.raises(UnsupportedEventError, match="add_remove"):
        RdpAccountant(neighboring_relation="replace_one").compose(PoissonSampled(0.1, Gaussian(1.0)))


def test_fixed_size_sampling_delegates_to_dp_accounting() -> None:
    ev = SelfComposed(SampledWithoutReplacement(1000, 10, Gaussian(1.0)), 100)
    orders = [2.0, 4.0, 8.0, 16.0]
    ours = RdpAccountant(orders, neighboring_relation="replace_one").compose(ev).rdp
    ref = dpa.rdp.RdpAccountant(orders=orders, neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    ref.compose(dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(1000, 10, dpa.GaussianDpEvent(1.0)), 100))
    np.testing.assert_allclose(ours, ref.rdp, rtol=1e-12)


def test_pure_epsilon() -> None:
    assert pure_epsilon(SelfComposed(Laplace.from_epsilon(0.5), 4)) == pytest.approx(2.0)
    assert pure_epsilon(PoissonSampled(0.1, Laplace.from_epsilon(1.0))) == pytest.approx(math.log1p(0.1 * math.expm1(1)))
    assert pure_epsilon(ParallelComposed((Laplace(1.0), Laplace(0.5)))) == pytest.approx(2.0)
    assert pure_epsilon(Gaussian(3.0)) == math.inf
    rep = best_epsilon(SelfComposed(Laplace.from_epsilon(0.5), 4), 0.0)
    assert rep.epsilon == pytest.approx(2.0) and rep.accountant == "pure"


@pytest.mark.parametrize(
    "eps0,k,basic,rdp_eps,pld_eps",
    [(1.0, 100, 100.0, 70.78, 68.25), (0.1, 100, 10.0, 4.53, 4.22)],
)
def test_ldp_laplace_composition_matches_measured_peer_figures(eps0, k, basic, rdp_eps, pld_eps) -> None:
    """PEERS.md, measured with dp-accounting: LDP-Laplace composition at delta 1e-5."""
    rep = ldp_repeated_uploads(Laplace.from_epsilon(eps0), k, delta=1e-5)
    assert rep.epsilon_pure == pytest.approx(basic)
    assert rep.epsilon_rdp == pytest.approx(rdp_eps, abs=0.01)
    assert rep.epsilon_pld == pytest.approx(pld_eps, abs=0.01)
    assert rep.epsilon == min(rep.epsilon_pure, rep.epsilon_rdp, rep.epsilon_pld) and rep.accountant == "pld"


def test_best_epsilon_reports_the_tightest() -> None:
    rep = best_epsilon(_sgm(0.01, 1.0, 100), 1e-5)
    assert rep.epsilon == min(rep.epsilon_rdp, rep.epsilon_pld)
    assert rep.epsilon_pld <= rep.epsilon_rdp  # PLD is tighter here
    d = rep.to_dict()
    assert {"epsilon", "accountant", "epsilon_rdp", "order", "delta"} <= set(d)


def test_event_dict_round_trip_and_validation() -> None:
    ev = FelTotal((_sgm(0.1, 1.0, 3), SelfComposed(SampledWithoutReplacement(10, 2, Gaussian(2.0)), 2)), _sgm(0.2, 3.0, 1), "same")
    assert event_from_dict(event_to_dict(ev)) == ev
    with pytest.raises(ValueError, match="unknown event type"):
        event_from_dict({"type": "Evil"})
    with pytest.raises(ValueError, match="unknown fields"):
        event_from_dict({"type": "Gaussian", "noise_multiplier": 1.0, "x": 1})
    with pytest.raises(ValueError, match="sampling_probability"):
        PoissonSampled(1.5, Gaussian(1.0))
    with pytest.raises(ValueError, match="needs an over_arch"):
        FelTotal((Gaussian(1.0),), None, "same")
    with pytest.raises(ValueError):
        Laplace(0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Gaussian(1.0).noise_multiplier = 2.0  # type: ignore[misc]


# ------------------------------------------------------------------ calibration
@settings(max_examples=15, deadline=None)
@given(
    target=st.floats(0.3, 10.0),
    delta=st.floats(1e-9, 1e-4),
    q=st.floats(1e-3, 0.5),
    steps=st.integers(1, 5000),
)
def test_calibrated_noise_never_overshoots(target: float, delta: float, q: float, steps: int) -> None:
    """RDP-only calibration (``use_pld=False``) against the RDP accountant."""
    z = calibrate_gaussian_noise_multiplier(target_epsilon=target, delta=delta, q=q, steps=steps, rtol=1e-3,
                                            use_pld=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = RdpAccountant().compose(_sgm(q, z, steps)).get_epsilon(delta)
        assert eps <= target
        # and it is not wastefully large: 1% less noise overshoots (or hits the KL-regime floor)
        eps_less = RdpAccountant().compose(_sgm(q, z * 0.99, steps)).get_epsilon(delta)
    assert eps_less > target or eps_less == 0


def test_calibration_opacus_published_setting() -> None:
    """Opacus test_get_noise_multiplier: eps 8, delta 1e-5, q 0.04, 90 epochs -> 1.425307617 (tol 0.01 in eps)."""
    z = calibrate_gaussian_noise_multiplier(target_epsilon=8.0, delta=1e-5, q=0.04, steps=int(90 / 0.04),
                                            use_pld=False)
    assert 1.40 < z <= 1.4254


def test_calibrate_laplace_epsilon0() -> None:
    assert calibrate_laplace_epsilon0(target_epsilon=5.0, count=10) == pytest.approx(0.5)
    e0 = calibrate_laplace_epsilon0(target_epsilon=10.0, count=100, delta=1e-5, use_pld=False)
    assert e0 > 0.1
    assert RdpAccountant().compose(SelfComposed(Laplace.from_epsilon(e0), 100)).get_epsilon(1e-5) <= 10.0 + 1e-9


def test_gaussian_training_event_fixed_sampling() -> None:
    ev = gaussian_training_event(noise_multiplier=1.0, q=0.01, steps=5, sampling="fixed", population=1000)
    assert ev == SelfComposed(SampledWithoutReplacement(1000, 10, Gaussian(1.0)), 5)
    with pytest.raises(ValueError, match="population"):
        gaussian_training_event(noise_multiplier=1.0, q=0.01, steps=5, sampling="fixed")


# ------------------------------------------------------------------ LDP
def test_ldp_laplace_fedcl_recipe() -> None:
    u = np.array([3.0, -1.0, 0.0, 0.0])
    rel = ldp_laplace(u, clip_bound=1.0, epsilon=4.0, _test_source=DeterministicTestSource(1))
    assert rel.clip_scale == pytest.approx(0.25) and rel.noise_scale == pytest.approx(0.5)
    assert rel.event == Laplace(0.25) and rel.event.epsilon0 == pytest.approx(4.0)
    # the promise: likelihood ratio of any output under any two inputs in the L1 ball <= e^eps
    x, y = np.array([1.0, 0, 0, 0]), np.array([0, -1.0, 0, 0])  # worst case, ||x - y||_1 = 2 delta
    out = rel.values
    log_ratio = (np.abs(out - y).sum() - np.abs(out - x).sum()) / rel.noise_scale
    assert abs(log_ratio) <= 4.0 + 1e-12


def test_ldp_noise_statistics() -> None:
    n = 20000
    rel = ldp_laplace(np.zeros(n), clip_bound=1.0, epsilon=4.0)
    assert np.std(rel.values) == pytest.approx(math.sqrt(2) * 0.5, rel=0.05)
    g = ldp_gaussian(np.ones(n), clip_bound=1.0, noise_multiplier=1.0)
    assert g.event == Gaussian(1.0) and np.std(g.values) == pytest.approx(2.0, rel=0.05)
    assert g.clip_scale == pytest.approx(1 / math.sqrt(n))


def test_ldp_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        ldp_laplace(np.ones(3), clip_bound=1.0, epsilon=0.0)
    with pytest.raises(ValueError, match="clip_bound"):
        ldp_gaussian(np.ones(3), clip_bound=-1.0, noise_multiplier=1.0)


_leaf = st.builds(Gaussian, st.floats(0.1, 10)) | st.builds(Laplace, st.floats(0.1, 10))
_events = st.recursive(
    _leaf,
    lambda inner: st.builds(PoissonSampled, st.floats(0, 1), inner)
    | st.builds(SelfComposed, inner, st.integers(0, 5))
    | st.builds(Composed, st.lists(inner, max_size=3).map(tuple))
    | st.builds(ParallelComposed, st.lists(inner, min_size=1, max_size=3).map(tuple)),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(_events)
def test_event_serialisation_round_trip(ev: DpEvent) -> None:
    import json

    assert event_from_dict(json.loads(json.dumps(event_to_dict(ev)))) == ev


@settings(max_examples=30, deadline=None)
@given(q=st.floats(1e-3, 1.0), z=st.floats(0.5, 5.0), steps=st.integers(1, 2000), delta=st.floats(1e-10, 1e-2))
def test_epsilon_delta_conversions_are_consistent(q: float, z: float, steps: int, delta: float) -> None:
    acc = RdpAccountant().compose(_sgm(q, z, steps))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = acc.get_epsilon(delta)
        if eps > 0:
            assert acc.get_delta(eps) == pytest.approx(delta, rel=1e-6)
        assert acc.get_delta(eps) <= delta * (1 + 1e-6)
