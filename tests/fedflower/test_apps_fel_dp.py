"""FEL's DP-FedAvg leaves through secure aggregation on Flower (over the protobuf loopback grid).

The promise: each client clips its own update and, under distributed noise, adds its own discrete
Gaussian share on the fixed-point grid *on its device, before masking*, with the leaf's own code
(:meth:`protocols.fel_leaf.FelLeaf.device_inputs`); the server runs the in-process leaf's
aggregation on the survivors' sum (fixed denominator, survivors' noise accounting, refuse or
re-account on excess dropouts, releases labelled ``leaf:<c>``). The noise comes from the CSPRNG
on the devices and cannot be replayed from the seed, so: with ``noise_multiplier = 0`` the Flower
leaves are the in-process leaves (and the central plaintext DP leaves) within FedAvg's tolerances;
with noise, the step's deviation from the noise-free in-process step has the target variance, and
the releases and the privacy report are the in-process run's.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from dp.ledger import PrivacyLedger
from protocols.fel import FelConfig, fel_privacy_report

from .test_apps_fel import BASE, fel_grid, in_process, releases
from .conftest import run_in_process_and_simulated
from .test_apps_loopback import make_data

logging.getLogger("flwr").setLevel(logging.ERROR)

DP = dict(clip=0.5, server_lr=2.0, frac_bits=12, value_clip=64.0)


def assert_leaves_close(a_leaves, b_leaves, *, atol: float) -> None:  # noqa: ANN001
    for a, b in zip(a_leaves, b_leaves):
        for name in ("item", "h", "b"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=atol)


def no_server_noise(gt) -> None:  # noqa: ANN001
    """The server's leaves must never draw a client's noise share (the devices do)."""
    def boom(clipped):  # noqa: ANN001, ANN202
        raise AssertionError("the server drew a client's noise share")

    for leaf in gt.server.leaves:
        leaf.noise_share = boom


@pytest.mark.parametrize("seed, dp, secure", [
    (21, "distributed", "secagg+"),
    (22, "distributed", "secagg"),
    (23, "central", "secagg+"),
])
def test_noise_free_dp_leaves_on_flower_equal_in_process_and_central_plaintext(tmp_path, seed, dp, secure):
    train, exclude = make_data(24, 30, seed, low_ratings=True)
    cfg = FelConfig(**{**BASE, **DP, "n_clusters": 2, "dp": dp, "secure_aggregation": secure, "noise_multiplier": 0.0,
                       "frac_bits": 20})
    ref = in_process(train, exclude, cfg, seed)
    plain = in_process(train, exclude, replace(cfg, dp="central", secure_aggregation="none"), seed)
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, seed)
    no_server_noise(gt)
    for _ in range(3):
        want, got = ref.run_round(), gt.run_round()
        plain.run_round()
        assert got.extra["dropped"] == 0 and got.extra["leaf_clients"] == want.extra["leaf_clients"]
        assert releases(got) == releases(want)  # per leaf, labelled leaf:<c>, same parameters
        assert all(r.cohort == f"leaf:{c}" for c, r in enumerate(got.releases))
        assert math.isnan(got.loss) and not math.isnan(want.loss)  # no unnoised loss sum is released
    assert gt.server.round == ref.round == 3
    # Every client clipped its own update (clip 0.5 binds: the clip changed the model).
    assert_leaves_close(gt.server.leaves, ref.leaves, atol=1e-6)
    # The central plaintext DP leaf (the server clips in plaintext): equal up to the fixed-point encoding
    # (each round moves a coordinate by at most server_lr * 2^-21 from it).
    assert_leaves_close(gt.server.leaves, plain.leaves, atol=2e-5)
    unclipped = in_process(train, exclude, replace(cfg, dp="none", secure_aggregation="none"), seed)
    for _ in range(3):
        unclipped.run_round()
    assert not torch.allclose(gt.server.leaves[0].item, unclipped.leaves[0].item, atol=1e-3)
    users = np.array(gt.meta.users)
    np.testing.assert_allclose(gt.score_all(users), ref.score_all(users), rtol=1e-5, atol=1e-5)


def test_the_devices_distributed_noise_sums_to_the_target_variance(tmp_path):
    """One round with z = 1 on Flower against the noise-free in-process round (same cohorts, same clipped
    sum): the difference is ``server_lr / m`` times the survivors' summed noise, whose per-coordinate
    variance must be ``(z * sensitivity on the grid)^2`` (every client survived, margin 0)."""
    train, exclude = make_data(24, 60, 24)
    cfg = FelConfig(**{**BASE, **DP, "dim": 8, "dp": "distributed", "secure_aggregation": "secagg",
                       "noise_multiplier": 1.0, "dropout_margin": 0.0})
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, 24)
    no_server_noise(gt)
    ref = in_process(train, exclude, replace(cfg, noise_multiplier=0.0), 24)
    got, want = gt.run_round(), ref.run_round()
    assert [r.params["survivors"] for r in got.releases] == [r.params["clients"] for r in want.releases]
    normalised = []
    for a, b in zip(gt.server.leaves, ref.leaves):
        noise = (a.flat_model().astype(np.float64) - b.flat_model()) * a.expected / cfg.server_lr
        target = (1.0 * a.sens_grid / 2**cfg.frac_bits) ** 2  # = survivors * sigma_client^2
        assert a.sigma_client**2 * a.expected == pytest.approx(target)
        normalised.append(noise / math.sqrt(target))
    x = np.concatenate(normalised)
    dof = x.size - 1
    var = x.var()
    assert stats.chi2(dof).sf(dof * var) > 1e-4 and stats.chi2(dof).cdf(dof * var) > 1e-4
    assert abs(x.mean()) < 5 / math.sqrt(x.size)
    assert all(r.params["noise_multiplier"] == pytest.approx(1.0) for r in got.releases)


@pytest.mark.parametrize("margin, policy, outcome", [
    (0.1, "refuse", "refused"),
    (0.1, "reaccount", "weaker"),
    (0.3, "refuse", "within"),
])
def test_dropouts_on_flower_beyond_the_margin_are_refused_or_reaccounted(tmp_path, margin, policy, outcome):
    """Two of a leaf's eight clients go silent before their masked input (a real Flower dropout): the
    nodes refuse to unmask the round, or the leaf accounts it with the noise that survived, as the in-process leaf
    does when the same two of eight drop (``simulate_dropout = 0.25``). Secure aggregation plans for
    those two (``secagg_dropout``, and each node's own ``max-dropout``): nodes planning for one of
    eight would refuse to sign the six survivors, and the round would abort in secure aggregation
    before the leaf's DP margin is ever consulted."""
    train, exclude = make_data(24, 30, 25)
    cfg = FelConfig(**{**BASE, **DP, "n_clusters": 1, "clients_per_round": 8, "dp": "distributed",
                       "secure_aggregation": "secagg", "noise_multiplier": 1.0, "dropout_margin": margin,
                       "on_excess_dropout": policy, "secagg_dropout": 0.25})
    gone: set[int] = set()
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, 25, drop=lambda stage, nid: stage == 3 and nid in gone,
                     node_config={"max-dropout": 0.25})
    no_server_noise(gt)
    leaf = gt.server.leaves[0]
    state = leaf.rng.bit_generator.state
    cohort = gt._bound[0].sample()  # (the leaf's own seeded choice; restored below)
    leaf.rng.bit_generator.state = state
    gone.update(gt.node_of[int(u)] for u in cohort[[1, 5]])
    before = leaf.flat_model()
    ref = in_process(train, exclude, replace(cfg, simulate_dropout=0.25), 25)
    if outcome == "refused":  # the nodes refuse to unmask six (their floor: eight), as the simulated clients do
        got, want = gt.run_round(), ref.run_round()
        assert got.releases == want.releases == ()
        assert [w.split(";")[0] for w in got.extra["refused"]] == [w.split(";")[0] for w in want.extra["refused"]] \
            == ["leaf 0 round 0: 6 of 8 clients stayed until their masked input"]
        np.testing.assert_array_equal(leaf.flat_model(), before)  # not applied
        return
    got, want = gt.run_round(), ref.run_round()
    assert got.extra["dropped"] == 2
    assert releases(got) == releases(want)
    (rel,) = got.releases
    assert rel.params["survivors"] == 6 and rel.params["dropped"] == 2 and rel.params["clients"] == 8
    z_eff = math.sqrt(6 - leaf.colluders) * leaf.sigma_client * 2**cfg.frac_bits / leaf.sens_grid  # (honest survivors)
    assert rel.event.noise_multiplier == pytest.approx(z_eff)
    assert (rel.event.noise_multiplier < 1.0) == (outcome == "weaker")  # never silently under-noised
    assert not np.array_equal(leaf.flat_model(), before)


def spy_secure_exchanges(gt, floor: int) -> list:  # noqa: ANN001
    """The server's view on Flower: every secure aggregation's report (``rep.total`` is what it decoded);
    a decoded sum over fewer than ``floor`` survivors (the noise shares were sized for ``floor``) is the attack."""
    seen: list = []
    real = gt._secure_exchange

    def spy(unit, t, sampled, **record):  # noqa: ANN001, ANN202
        out = real(unit, t, sampled, **record)
        rep = out[0]
        seen.append(rep)
        if rep.total is not None and len(rep.survivors) < floor:
            raise AssertionError(f"the server decoded the sum of {len(rep.survivors)} of {len(sampled)} nodes' noisy "
                                 f"inputs, whose noise shares were sized for {floor}")
        return out

    gt._secure_exchange = spy
    return seen


def test_on_flower_the_nodes_never_unmask_a_sum_with_fewer_noise_shares_than_sized_for(tmp_path):
    """Item 5's attack through the real ``secagg_mod`` over the loopback grid: two of a leaf's eight nodes go
    silent before their masked input, six survive where each node's share was sized for eight
    (``dropout_margin = 0.1``). Before the fix the server unmasked and decoded the six nodes' sum and
    only then raised ``ExcessDropoutError`` (the ledger recorded nothing). Now each node puts its own floor,
    computed from its own configuration and its leaf's public size, beside its vector (``min_survivors``):
    every survivor refuses to sign six, nothing is unmasked, and the leaf's round is refused in its stats,
    its model unchanged and no release recorded."""
    train, exclude = make_data(24, 30, 25)
    cfg = FelConfig(**{**BASE, **DP, "n_clusters": 1, "clients_per_round": 8, "dp": "distributed",
                       "secure_aggregation": "secagg", "noise_multiplier": 1.0, "dropout_margin": 0.1,
                       "secagg_dropout": 0.25})
    gone: set[int] = set()
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, 25, drop=lambda stage, nid: stage == 3 and nid in gone,
                     node_config={"max-dropout": 0.25})
    no_server_noise(gt)
    seen = spy_secure_exchanges(gt, floor=8)
    leaf = gt.server.leaves[0]
    state = leaf.rng.bit_generator.state
    cohort = gt._bound[0].sample()
    leaf.rng.bit_generator.state = state
    gone.update(gt.node_of[int(u)] for u in cohort[[1, 5]])
    before = leaf.flat_model()
    got = gt.run_round()
    (rep,) = seen
    assert rep.total is None and rep.survivors == []
    refused = {nid for nid, (stage, why) in rep.dropped.items()
               if stage == "consistency" and "6 survivors, below this client's min_survivors = 8" in why}
    assert refused == {gt.node_of[int(u)] for u in cohort} - gone
    np.testing.assert_array_equal(leaf.flat_model(), before)
    assert got.releases == ()
    (why,) = got.extra["refused"]
    assert why.startswith("leaf 0 round 0:")
    ref = in_process(train, exclude, replace(cfg, simulate_dropout=0.25), 25)  # the same refusal in process
    want = ref.run_round()
    assert want.releases == () and len(want.extra["refused"]) == 1


def test_the_privacy_report_of_a_flower_run_is_the_in_process_one(tmp_path):
    """Calibrated distributed DP (epsilon 4 over 3 rounds per leaf), noise on: the same releases and the
    same epsilon, per leaf and in total."""
    train, exclude = make_data(24, 30, 26)
    cfg = FelConfig(**{**BASE, **DP, "value_clip": 256.0, "dp": "distributed", "secure_aggregation": "secagg+",
                       "calibration": "epsilon", "target_epsilon": 4.0, "dp_rounds": 3})
    ref = in_process(train, exclude, cfg, 26)
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, 26)
    no_server_noise(gt)
    assert gt.server.noise_multipliers == ref.noise_multipliers and min(ref.noise_multipliers) > 1
    reports = []
    for name, trainer in (("flower", gt), ("inproc", ref)):
        ledger = PrivacyLedger(tmp_path / f"{name}.sqlite")
        rels = []
        for r in range(3):
            st_ = trainer.run_round()
            rels.append(releases(st_))
            with ledger.round(r) as h:
                for rel in st_.releases:
                    h.record(rel.event, who=rel.who, what=rel.what, params=rel.params, cohort=rel.cohort)
        rep = fel_privacy_report(ledger, cfg.delta)
        reports.append((rels, json.dumps({k: rep[k] for k in ("epsilon", "per_leaf", "composition", "over_arch")},
                                         sort_keys=True)))
    assert reports[0] == reports[1]
    eps = json.loads(reports[0][1])["epsilon"]
    assert 3.0 < eps <= 4.0  # the calibration's target, met
    with pytest.raises(ValueError, match="dp_rounds"):  # a fourth round would exceed it, on Flower too
        gt.run_round()


RAY_DP_CONFIG = """[data]
synthetic_users = 40
synthetic_items = 150
synthetic_mean_interactions = 10
[eval]
negatives = 20
[fel]
combiner = "mean"
dim = 4
n_clusters = 2
min_clients = 3
clients_per_round = 5
frac_bits = 20
[run]
seed = 3
rounds = 2
eval_every = 0
"""


@pytest.mark.slow
@pytest.mark.parametrize("noise", ["off", "calibrated"])
def test_fel_dp_simulation_through_ray_gives_the_in_process_run(tmp_path, noise):
    """`secagg flower simulate fel-dp` (its distributed noise through SecAgg+, a fixed combiner) through Ray
    against `secagg run fel-dp`: noise off, the same leaves and metrics; the preset's calibrated noise, the
    same privacy report (releases, epsilon)."""
    from experiments.run.rundir import RunDir

    extra = '\ncalibration = "noise"\nnoise_multiplier = 0.0\n' if noise == "off" else "\n"
    run_in_process_and_simulated(tmp_path, "fel-dp", RAY_DP_CONFIG.replace("frac_bits = 20\n", "frac_bits = 20" + extra))
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("sim", "inproc"))
    assert sa["runtime"]["engine"] == "flower simulation (ray)"
    assert sa["privacy"] == sb["privacy"] and sa["bytes_per_client_per_round"] == sb["bytes_per_client_per_round"]
    if noise == "off":
        a = RunDir.open_existing(tmp_path / "sim").load_checkpoint()["trainer"]
        b = RunDir.open_existing(tmp_path / "inproc").load_checkpoint()["trainer"]
        for la, lb in zip(a["leaves"], b["leaves"]):
            for name in ("item", "h", "b"):
                torch.testing.assert_close(la[name], lb[name], rtol=1e-5, atol=1e-6)
        for k, v in sb["metrics"].items():
            assert sa["metrics"][k] == pytest.approx(v, abs=1e-6), k
        return
    reports: list = []
    ledgers = [PrivacyLedger(tmp_path / d / "privacy_ledger.sqlite") for d in ("sim", "inproc")]
    for ledger in ledgers:
        rep = fel_privacy_report(ledger, 1e-5)
        reports.append(json.dumps({k: rep[k] for k in ("epsilon", "per_leaf", "composition", "over_arch")},
                                  sort_keys=True))
        reports.append([(e.cohort, type(e.event).__name__, json.dumps(e.params, sort_keys=True, default=str))
                        for e in ledger.entries()])
    assert reports[:2] == reports[2:] and 0 < json.loads(reports[0])["epsilon"] < 4.0


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), dp=st.sampled_from(["central", "distributed"]),
       secure=st.sampled_from(["secagg", "secagg+"]), clip=st.sampled_from([0.05, 0.5, 5.0]),
       n_clusters=st.integers(1, 2), per_round=st.integers(3, 5), aggregation=st.sampled_from(["sum", "mean"]))
def test_noise_free_dp_leaves_on_flower_match_in_process_for_any_config(tmp_path_factory, seed, dp, secure, clip,
                                                                          n_clusters, per_round, aggregation):
    train, exclude = make_data(24, 30, seed, low_ratings=True)
    cfg = FelConfig(**{**BASE, **DP, "frac_bits": 20, "dp": dp, "secure_aggregation": secure, "clip": clip,
                       "noise_multiplier": 0.0, "n_clusters": n_clusters, "clients_per_round": per_round,
                       "item_aggregation": aggregation})
    try:
        ref = in_process(train, exclude, cfg, seed)
    except ValueError as exc:  # a cluster below min_clients, or SecAgg+ impossible for the cohort: refused alike
        with pytest.raises(ValueError, match=re.escape(str(exc)[:40])):
            fel_grid(tmp_path_factory.mktemp("run"), train, exclude, cfg, seed)
        return
    gt, _ = fel_grid(tmp_path_factory.mktemp("run"), train, exclude, cfg, seed)
    no_server_noise(gt)
    for _ in range(2):
        want, got = ref.run_round(), gt.run_round()
        assert releases(got) == releases(want)
    assert_leaves_close(gt.server.leaves, ref.leaves, atol=1e-6)
