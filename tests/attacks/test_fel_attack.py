"""Label inference on FEL's leaf releases: it succeeds without DP, respects the DP bound with DP (the
promise of protocols/fel.py attacked), and the bound and advantage arithmetic are checked independently."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats

from attacks.fel import (
    advantage, dp_advantage_bound, gdp_advantage_bound, label_change_epsilon, label_inference, leaf_updates,
    server_view,
)
from attacks.registry import get_attack
from dp.accountant import RdpAccountant
from dp.events import Gaussian, NonPrivate, PoissonSampled
from experiments.studies.attack_fel import canary_worlds, run_attack
from experiments.cli import main
from protocols.fel import FelConfig, FelTrainer
from protocols.fel_leaf import LEAF_MODEL_KIND, LeafModel
from protocols.transport import InProcessTransport, Transcript
from recmodels.synthetic import generate_synthetic


def _args(**kw) -> argparse.Namespace:
    base = dict(defense="none", epsilon=4.0, delta=1e-5, noise="central", clip=0.5, trials=30, rounds=2,
                canary_items=5, clusters=2, dim=8, data=None, users=16, items=200, seed=0, json=False)
    return argparse.Namespace(**{**base, **kw})


def _data(users: int = 16, items: int = 200):
    return generate_synthetic(n_users=users, n_items=items, dim=8, seed=0, mean_interactions=8)


# -- the bound and the advantage, against independent computations ------------------------------------------
@settings(max_examples=40, deadline=None)
@given(eps=st.floats(0.0, 8.0), delta=st.floats(0.0, 0.1))
def test_dp_bound_is_the_largest_tpr_minus_fpr_the_dp_inequalities_allow(eps, delta):
    # maximise TPR - FPR over a fine FPR grid subject to TPR <= e^eps FPR + delta, 1 - FPR <= e^eps (1 - TPR) + delta
    fpr = np.linspace(0, 1, 200001)
    tpr = np.minimum.reduce([np.exp(eps) * fpr + delta, 1 - (1 - fpr - delta) / np.exp(eps), np.ones_like(fpr)])
    assert dp_advantage_bound(eps, delta) == pytest.approx(float(np.max(tpr - fpr)), abs=2e-5)


def test_bound_edges_and_bad_input():
    assert dp_advantage_bound(0.0, 0.0) == 0.0 and dp_advantage_bound(math.inf, 1e-5) == 1.0
    assert dp_advantage_bound(1.0, 0.0) == pytest.approx((math.e - 1) / (math.e + 1))
    with pytest.raises(ValueError, match="epsilon"):
        dp_advantage_bound(-1.0, 0.0)


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
def test_gdp_bound_is_the_total_variation_of_two_unit_gaussians(mu):
    tv, _ = integrate.quad(lambda x: abs(stats.norm.pdf(x) - stats.norm.pdf(x, mu)) / 2, -20, 20 + mu)
    assert gdp_advantage_bound(mu) == pytest.approx(tv, abs=1e-7)
    assert gdp_advantage_bound(math.inf) == 1.0


def test_label_change_epsilon_halves_the_noise_multiplier():
    events = [Gaussian(3.0)] * 4
    eps, mu = label_change_epsilon(events, 1e-5)
    direct = RdpAccountant().compose(Gaussian(1.5), 4).get_epsilon(1e-5)
    accounted = RdpAccountant().compose(Gaussian(3.0), 4).get_epsilon(1e-5)
    assert eps == pytest.approx(direct) and eps > accounted and mu == pytest.approx(2 * math.sqrt(4) / 3.0)
    assert label_change_epsilon([NonPrivate()], 1e-5) == (math.inf, math.inf)
    with pytest.raises(ValueError, match="fixed"):
        label_change_epsilon([PoissonSampled(0.1, Gaussian(1.0))], 1e-5)


def test_advantage_on_known_score_distributions():
    rng = np.random.default_rng(0)
    worlds = np.arange(400) % 2
    cal = np.arange(400) < 200
    perfect = advantage(worlds + 0.1 * rng.random(400), worlds, calibration=cal)
    assert perfect.advantage == 1.0 and perfect.advantage_low > 0.9 and perfect.f1 == 1.0
    blind = advantage(rng.normal(size=400), worlds, calibration=cal)
    assert blind.advantage_low < 0 < blind.advantage_high and abs(blind.advantage) < 0.2
    assert blind.random_f1 == pytest.approx(0.5)
    # a unit shift of two unit Gaussians: the best test's advantage is 2 Phi(1/2) - 1 = 0.383
    shift = advantage(rng.normal(size=4000) + (np.arange(4000) % 2), np.arange(4000) % 2,
                      calibration=np.arange(4000) < 2000)
    assert shift.advantage_low < gdp_advantage_bound(1.0) < shift.advantage_high
    with pytest.raises(ValueError, match="both worlds"):
        advantage([0.0, 1.0], [1, 1], calibration=[True, False])


# -- the protocol's leaf releases as the attack reads them ---------------------------------------------------
def test_leaf_model_records_are_the_released_change_and_cost_nothing():
    cfg = FelConfig(dim=4, n_clusters=2, min_clients=2, combiner="mean", opt_in_fraction=0.0)
    fel = FelTrainer(_data(), cfg, seed=1,
                     transport=InProcessTransport(Transcript(keep_payloads=lambda r: r.kind == LEAF_MODEL_KIND)))
    before = [leaf.flat_model() for leaf in fel.leaves]
    fel.run_round()
    recs = [r for r in fel.transport.transcript if r.kind == LEAF_MODEL_KIND]
    assert [r.receiver for r in recs] == ["leaf:0", "leaf:1"] and all(r.nbytes == 0 for r in recs)
    for c, leaf in enumerate(fel.leaves):
        assert isinstance(recs[c].payload, LeafModel)
        np.testing.assert_array_equal(leaf_updates(recs, c)[0], leaf.flat_model().astype(np.float64) - before[c])
    plain = FelTrainer(_data(), cfg, seed=1, transport=InProcessTransport())
    plain.run_round()
    with pytest.raises(ValueError, match="keep"):
        leaf_updates(server_view(plain.transport.transcript), 0)


def test_canary_worlds_differ_only_in_the_target_positives():
    w0, w1, target, s0, s1 = canary_worlds(_data(), 3)
    assert w0.n_items == w1.n_items == 206 and target == 16 and len(set(s0) | set(s1)) == 6
    assert sorted(w0.items[w0.users == target]) == list(s0) and sorted(w1.items[w1.users == target]) == list(s1)
    assert not np.isin(w0.items[w0.users != target], np.concatenate([s0, s1])).any()
    np.testing.assert_array_equal(w0.items[w0.users != target], w1.items[w1.users != target])


def test_registered_and_reads_only_the_view():
    spec = get_attack("fel", "fel-label")
    assert spec.view == "server" and spec.run is label_inference
    with pytest.raises(ValueError, match="same size"):
        label_inference([], {"assignment": [0]}, target=0, hypotheses=([1, 2], [3]))


# -- the promise attacked: without DP the test succeeds, with DP it stays under the bound -------------------
def test_without_dp_the_label_is_inferred_and_would_break_a_claimed_epsilon():
    out = run_attack(_args(), _data())
    assert out["advantage"] >= 0.9 and out["advantage_ci"][0] > 0.4, out["attack"]
    assert out["epsilon"] is None and out["bound"] == 1.0 and out["respects_bound"]
    # a leaf that claimed epsilon 0.25 but added no noise would be caught: the measured advantage's
    # lower limit is above the bound that epsilon imposes (the audit is not vacuous at 30 + 30 runs)
    claimed, _ = label_change_epsilon([Gaussian(_dp_z(0.25))] * 2, 1e-5)
    assert out["advantage_ci"][0] > dp_advantage_bound(claimed, 1e-5)


def _dp_z(eps: float) -> float:
    from dp.calibration import calibrate_gaussian_noise_multiplier

    return calibrate_gaussian_noise_multiplier(target_epsilon=eps, delta=1e-5, q=1.0, steps=2, sampling="poisson",
                                               use_pld=False)


def test_with_dp_the_advantage_respects_the_bound():
    out = run_attack(_args(defense="dp", epsilon=2.0), _data())
    assert out["epsilon"] <= 2.0 + 1e-9 and out["epsilon_label"] > out["epsilon"]
    assert out["respects_bound"] and out["advantage_ci"][0] <= out["bound"]
    assert out["advantage_ci"][0] <= out["gdp_bound"]  # the Gaussian's own, tighter bound holds too
    assert out["noise_multiplier"] == pytest.approx(_dp_z(2.0))


def test_cli_json_shape_and_bad_input(capsys):
    assert main(["attack", "fel", "--trials", "4", "--rounds", "1", "--users", "16", "--items", "60", "--json"]) == 0
    out = json.loads(capsys.readouterr()[0].splitlines()[-1])
    for key in ("f1", "precision", "recall", "random_f1", "status"):
        assert key in out["attack"]
    assert {"advantage", "epsilon", "bound", "respects_bound"} <= set(out) and out["attack_name"] == "fel-label"
    assert main(["attack", "fel", "--trials", "1"]) == 2
    assert "--trials" in capsys.readouterr()[1]


@pytest.mark.slow
@pytest.mark.parametrize("eps", [1.5, 4.0])
def test_dp_bound_holds_with_many_trials_central_and_distributed(eps):
    for noise in ("central", "distributed"):
        out = run_attack(_args(defense="dp", epsilon=eps, noise=noise, trials=150), _data())
        assert out["respects_bound"], out


def test_dp_snr_diagnostic_on_synthetic_data():
    from experiments.studies.fel_dp_snr import leaf_snr

    rows = [r for c, m in ((1, 0), (2, 5)) for r in leaf_snr(_data(), None, clusters=c, dim=4, clients=m, clip=0.5,
                                                             epsilons=(4.0,), rounds=5)]
    assert [r["clusters"] for r in rows] == [1, 2] and rows[0]["clients"] >= 12 and rows[1]["clients"] == 5
    for r in rows:  # a sum of m clipped updates is at most m clip; the noise is z clip sqrt(width)
        assert 0 < r["clipped_sum_norm"] <= r["clients"] * r["clip"] + 1e-9
        assert r["noise_norm"] == pytest.approx(r["z"] * r["clip"] * math.sqrt(r["width"]))
        assert r["snr"] == pytest.approx(r["clipped_sum_norm"] / r["noise_norm"])
