"""FEL: disjoint leaves, secure = plaintext, DP-FedAvg noise, dropouts, accounting vs dp-accounting, resume."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from scipy import stats

from dp.events import NonPrivate
from dp.ledger import PrivacyLedger
from experiments.cli import main
from protocols.fel import FelConfig, FelTrainer, fel_privacy_report
from protocols.transport import InProcessTransport
from recmodels.data import Interactions


def make_train(n_users: int = 48, n_items: int = 30, k: int = 6, seed: int = 0) -> Interactions:
    rng = np.random.default_rng(seed)
    users, items = [], []
    for u in range(n_users):
        chosen = rng.choice(n_items, size=k, replace=False)
        users += [u] * k
        items += list(chosen)
    n = len(users)
    return Interactions(users=np.array(users, np.int64), items=np.array(items, np.int64),
                        ratings=np.ones(n, np.float32), timestamps=np.arange(n, dtype=np.int64),
                        user_ids=np.arange(n_users), item_ids=np.arange(n_items))


BASE = dict(dim=4, n_clusters=3, min_clients=3, combiner="mean", opt_in_fraction=0.0, clients_per_round=6)


def build(seed: int = 0, train: Interactions | None = None, **kw) -> FelTrainer:
    cfg = FelConfig(**{**BASE, **kw})
    return FelTrainer(train or make_train(), cfg, seed=seed, transport=InProcessTransport())


def test_leaves_train_on_disjoint_clusters_only() -> None:
    fel = build()
    pools = [set(leaf._clients.tolist()) for leaf in fel.leaves]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not pools[a] & pools[b]
        assert all(fel.assignment[u] == a for u in pools[a])
    stats_ = fel.run_round()
    senders = {}
    for msg in fel.transport.transcript:
        if msg.kind == "update":
            senders.setdefault(msg.round, set()).add(int(msg.sender.split(":")[1]))
    trained = set().union(*pools)
    assert senders[0] <= trained and len(senders[0]) == stats_.clients == 18
    assert {r.cohort for r in stats_.releases} == {"leaf:0", "leaf:1", "leaf:2"}
    assert all(isinstance(r.event, NonPrivate) for r in stats_.releases)


def test_opt_in_users_never_train_a_leaf() -> None:
    fel = build(opt_in_fraction=0.25, combiner="over-arch")
    assert len(fel.opt_in) == 12
    for leaf in fel.leaves:
        assert not set(leaf._clients.tolist()) & set(fel.opt_in.tolist())
    fel.run_round()
    s = fel.score(np.arange(5), np.tile(np.arange(4), (5, 1)))
    assert s.shape == (5, 4) and np.isfinite(s).all()


def test_combiner_scores_equal_direct_leaf_computation() -> None:
    fel = build(combiner="median")
    fel.run_round()
    users, items = np.arange(48), np.tile(np.arange(30), (48, 1))
    got = fel.score(users, items)
    probs = []
    for leaf, p in zip(fel.leaves, fel._ensemble()["users"]):
        logits = (p[torch.as_tensor(users)].unsqueeze(1) * leaf.item[torch.as_tensor(items)] * leaf.h).sum(-1) + leaf.b
        probs.append(torch.sigmoid(logits).numpy())
    np.testing.assert_allclose(got, np.median(np.stack(probs), axis=0), rtol=1e-6)
    np.testing.assert_allclose(fel.score_all(users), got, rtol=1e-6)


def test_secure_leaf_aggregation_equals_plaintext() -> None:
    plain = build(seed=3)
    secure = build(seed=3, secure_aggregation="secagg+", frac_bits=24)
    plain.run_round()
    secure.run_round()
    for a, b in zip(plain.leaves, secure.leaves):
        np.testing.assert_allclose(b.item.numpy(), a.item.numpy(), atol=1e-5)
        np.testing.assert_allclose(b.h.numpy(), a.h.numpy(), atol=1e-5)


def test_dp_without_noise_distributed_equals_central_plaintext() -> None:
    """Clipping + fixed denominator, noise off: the SecAgg+ distributed path equals the plaintext one."""
    kw = dict(dp="central", noise_multiplier=0.0, clip=0.05, server_lr=6.0)
    central = build(seed=4, **kw)
    dist = build(seed=4, **{**kw, "dp": "distributed"}, secure_aggregation="secagg+", frac_bits=20)
    rc, rd = central.run_round(), dist.run_round()
    for a, b in zip(central.leaves, dist.leaves):
        np.testing.assert_allclose(b.item.numpy(), a.item.numpy(), atol=1e-5)
    assert all(isinstance(r.event, NonPrivate) for r in rc.releases + rd.releases)  # no noise: not private


def test_clipping_bounds_each_contribution() -> None:
    fel = build(seed=5, dp="central", noise_multiplier=0.0, clip=0.01, server_lr=1.0)
    before = [leaf.item.clone() for leaf in fel.leaves]
    fel.run_round()
    for leaf, b in zip(fel.leaves, before):
        # the change is server_lr * (sum of <= m clipped updates) / m: its norm is at most clip
        assert float(torch.linalg.norm(leaf.item - b)) <= 0.01 * (1 + 1e-5)


def test_distributed_noise_sum_has_target_variance() -> None:
    fel = build(seed=6, dp="distributed", noise_multiplier=1.0, clip=0.5, secure_aggregation="secagg",
                frac_bits=12, value_clip=64.0, dropout_margin=0.0)
    leaf = fel.leaves[0]
    m = leaf.expected
    zeros = np.zeros((m, leaf.width))
    total, _, z_eff, extra = leaf._noisy_sum(0, leaf._clients[:m], zeros)
    target = (1.0 * leaf.sens_grid / 2**12) ** 2  # (z * clip on the grid)^2, every client survived
    var = total.var()
    dof = total.size - 1
    assert stats.chi2(dof).sf(dof * var / target) > 1e-4 and stats.chi2(dof).cdf(dof * var / target) > 1e-4
    assert z_eff == pytest.approx(1.0) and extra["survivors"] == m


def test_dropouts_beyond_the_margin_are_refused_or_reaccounted() -> None:
    kw = dict(dp="distributed", noise_multiplier=1.0, clip=0.5, secure_aggregation="secagg+", frac_bits=12,
              value_clip=256.0, dropout_margin=0.1, simulate_dropout=0.25, clients_per_round=12,
              secagg_dropout=0.3)
    fel = build(seed=7, **kw)
    before = [leaf.flat_model() for leaf in fel.leaves]
    refused = fel.run_round()  # the clients refuse to unmask (tests/protocols/test_fel_distributed_dp.py)
    assert refused.releases == () and len(refused.extra["refused"]) == 3
    assert all("dropout_margin" in why for why in refused.extra["refused"])
    assert all(np.array_equal(leaf.flat_model(), b) for leaf, b in zip(fel.leaves, before))
    fel = build(seed=7, **kw, on_excess_dropout="reaccount")
    st_ = fel.run_round()
    zs = [r.event.noise_multiplier for r in st_.releases]
    assert all(z < 1.0 for z in zs)  # accounted with the noise that survived: weaker, never hidden
    within = build(seed=7, **{**kw, "simulate_dropout": 0.0}).run_round()
    assert all(r.event.noise_multiplier >= 1.0 for r in within.releases)


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_privacy_report_matches_dp_accounting(tmp_path, sampling: str) -> None:
    import dp_accounting
    from dp_accounting import dp_event as de
    from dp_accounting.rdp import RdpAccountant as DpaRdp

    fel = build(seed=8, dp="central", noise_multiplier=1.3, clip=0.5, sampling=sampling)
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite")
    for r in range(3):
        st_ = fel.run_round()
        with ledger.round(r) as h:
            for rel in st_.releases:
                h.record(rel.event, who=rel.who, what=rel.what, params=rel.params, cohort=rel.cohort)
    rep = fel_privacy_report(ledger, 1e-5)
    orders = list(np.concatenate([np.linspace(1.1, 10.9, 99), np.arange(11, 513)]))
    per = []
    for leaf in fel.leaves:
        acc = DpaRdp(orders)
        ev = de.GaussianDpEvent(1.3)
        if sampling == "poisson":
            ev = de.PoissonSampledDpEvent(leaf.q, ev)
        acc.compose(de.SelfComposedDpEvent(ev, 3))
        per.append(acc.get_epsilon(1e-5))
    got = [p["epsilon"] for p in rep["per_leaf"]]
    np.testing.assert_allclose(got, per, rtol=2e-2)
    assert rep["epsilon"] == pytest.approx(max(got), rel=1e-9)  # parallel composition: the max
    assert rep["composition"] == "parallel" and rep["over_arch"] == {"mode": "opt-in", "epsilon": 0.0}
    assert [p["clients"] for p in rep["per_leaf"]] == [len(leaf._clients) for leaf in fel.leaves]
    assert dp_accounting is not None


def test_fixed_epsilon_calibration_meets_target(tmp_path) -> None:
    fel = build(seed=9, dp="central", calibration="epsilon", target_epsilon=3.0, dp_rounds=4, clip=0.5)
    ledger = PrivacyLedger(tmp_path / "l.sqlite")
    for r in range(4):
        st_ = fel.run_round()
        with ledger.round(r) as h:
            for rel in st_.releases:
                h.record(rel.event, who=rel.who, what=rel.what, params=rel.params, cohort=rel.cohort)
    eps = fel_privacy_report(ledger, 1e-5)["epsilon"]
    assert 2.9 < eps <= 3.0 + 1e-6
    with pytest.raises(ValueError, match="fel.dp_rounds"):
        fel.run_round()


@pytest.mark.parametrize("kw,match", [
    (dict(n_clusters=3, min_clients=20), "below fel.min_clients=20"),
    (dict(dp="central", calibration="epsilon", target_epsilon=0.01, max_noise_multiplier=5.0), "max_noise_multiplier"),
    (dict(dp="distributed"), "secure_aggregation"),
    (dict(combiner="over-arch", opt_in_fraction=0.0), "opt_in_fraction"),
    (dict(dp="distributed", secure_aggregation="secagg", value_clip=1.0, frac_bits=16), "fel.value_clip"),
    (dict(lr=-1.0), "fel.lr"),
])
def test_bad_input_refused_before_training(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        build(**kw)


def test_overlapping_assignment_refused() -> None:
    cfg = FelConfig(**BASE)
    with pytest.raises(ValueError, match="cluster assignment"):
        FelTrainer(make_train(), cfg, seed=0, transport=InProcessTransport(), assignment=np.full(48, 7))


TINY = """
[run]
rounds = {rounds}
eval_every = 1
[data]
synthetic_users = 60
synthetic_items = 80
synthetic_mean_interactions = 10
[eval]
negatives = 20
[fel]
dim = 4
n_clusters = 3
min_clients = 3
over_arch_epochs = 1
"""


def _run(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr()[0].splitlines()[-1])


def test_resume_equals_uninterrupted_run(tmp_path, capsys) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text(TINY.format(rounds=3))
    full = _run(capsys, "run", "fel", "--config", str(cfg), "--out", str(tmp_path / "full"), "--json", "--quiet")
    _run(capsys, "run", "fel", "--config", str(cfg), "--rounds", "1", "--out", str(tmp_path / "part"), "--json", "--quiet")
    resumed = _run(capsys, "run", "--resume", str(tmp_path / "part"), "--rounds", "3", "--json", "--quiet")
    assert resumed["metrics"] == full["metrics"] and "AUC" in full["metrics"]


def test_fel_dp_preset_report_shape(tmp_path, capsys) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text(TINY.format(rounds=2) + "clients_per_round = 6\n")
    _run(capsys, "run", "fel-dp", "--config", str(cfg), "--out", str(tmp_path / "dp"), "--json", "--quiet")
    rep = _run(capsys, "privacy", "report", str(tmp_path / "dp"), "--json")
    assert rep["composition"] == "parallel" and len(rep["per_leaf"]) == 3
    assert rep["epsilon"] == pytest.approx(max(p["epsilon"] for p in rep["per_leaf"]), rel=1e-6)
    assert 0 < rep["epsilon"] < 4.0 and rep["over_arch"]["mode"] == "opt-in"
    # the distributed noise's collusion bound, per leaf (floor(0.05 x 6) = 0) and in words
    assert [p["colluders"] for p in rep["per_leaf"]] == [0, 0, 0] and "honest survivors" in rep["noise_assumption"]
    assert main(["privacy", "report", str(tmp_path / "dp")]) == 0
    assert "assumes: distributed noise is accounted for the honest survivors only" in capsys.readouterr()[0]


# -- the over-arch trained by FL (FedSGD over the leaves' clients) ------------------------------------------
def test_fl_over_arch_step_is_the_sum_of_client_gradients_and_only_leaf_clients_upload() -> None:
    from recmodels.ensemble import over_arch_gradient

    fel = build(combiner="over-arch", over_arch_training="fl", opt_in_fraction=0.1, over_arch_clients=8)
    fel.run_round()
    ups = [r for r in fel.transport.transcript if r.kind == "over-arch-update"]
    senders = {int(r.sender.split(":")[1]) for r in ups}
    assert len(ups) == 8 and senders <= set(fel.fl_clients.tolist()) and not senders & set(fel.opt_in.tolist())
    # the server's input is the sum of every client's own gradient (oracle: one client at a time)
    vecs = [fel._leaf_users(leaf) for leaf in fel.leaves]
    cohort = np.sort(np.random.default_rng(0).choice(fel.fl_clients, size=5, replace=False))
    users, items, labels = fel._examples(cohort, np.random.default_rng(1))
    _, z = fel._features(vecs, torch.as_tensor(users), torch.as_tensor(items))
    y = torch.as_tensor(labels, dtype=torch.float32)
    together = over_arch_gradient(fel.over_arch, z, y)
    apart = [over_arch_gradient(fel.over_arch, z[torch.as_tensor(users == u)], y[torch.as_tensor(users == u)])
             for u in cohort]
    for k, g in enumerate(together):
        torch.testing.assert_close(g, sum(a[k] for a in apart), rtol=1e-4, atol=1e-5)


def test_fl_over_arch_learns_and_is_reported_sequential(tmp_path, capsys) -> None:
    fel = build(combiner="over-arch", over_arch_training="fl", over_arch_clients=20, over_arch_steps=10,
                over_arch_lr=0.05)
    first = fel.run_round().extra["over_arch_loss"]
    for _ in range(3):
        last = fel.run_round().extra["over_arch_loss"]
    assert last < first
    cfg = tmp_path / "t.toml"
    cfg.write_text(TINY.format(rounds=2) + "combiner = \"over-arch\"\nover_arch_training = \"fl\"\nopt_in_fraction = 0.0\n")
    _run(capsys, "run", "fel", "--config", str(cfg), "--out", str(tmp_path / "fl"), "--json", "--quiet")
    rep = _run(capsys, "privacy", "report", str(tmp_path / "fl"), "--json")
    # strict JSON (experiments/jsonio.py): an infinite epsilon is written as null
    assert rep["over_arch"]["mode"] == "sequential" and rep["over_arch"]["epsilon"] is None


def test_fl_over_arch_resume_equals_uninterrupted_run(tmp_path, capsys) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text(TINY.format(rounds=3) + "over_arch_training = \"fl\"\nover_arch_clients = 10\nover_arch_steps = 2\n")
    full = _run(capsys, "run", "fel", "--config", str(cfg), "--out", str(tmp_path / "full"), "--json", "--quiet")
    _run(capsys, "run", "fel", "--config", str(cfg), "--rounds", "1", "--out", str(tmp_path / "part"), "--json", "--quiet")
    resumed = _run(capsys, "run", "--resume", str(tmp_path / "part"), "--rounds", "3", "--json", "--quiet")
    assert resumed["metrics"] == full["metrics"] and "AUC" in full["metrics"]


@pytest.mark.parametrize("kw, match", [
    (dict(over_arch_training="fl", combiner="mean"), "fel.combiner"),
    (dict(over_arch_training="federated"), "fel.over_arch_training"),
    (dict(over_arch_training="fl", combiner="over-arch", over_arch_clients=0), "fel.over_arch_clients"),
])
def test_fl_over_arch_bad_config_refused(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        FelConfig(**{**BASE, **kw})


def test_a_bag_trains_every_leaf_on_every_user_and_combines_them_as_fel() -> None:
    """fel.leaves = "bag" (issue 25's unclustered control): every leaf's pool is every training user, each leaf
    samples its own cohort from all of them, and the ensemble is the same mean of the leaves' probabilities."""
    fel = build(leaves="bag", opt_in_fraction=0.25, combiner="mean")
    everyone = np.setdiff1d(np.arange(48), fel.opt_in)
    for leaf in fel.leaves:
        np.testing.assert_array_equal(leaf._clients, everyone)
    cohorts: list[np.ndarray] = []
    for leaf in fel.leaves:  # record each leaf's cohort
        leaf._sample_clients = (lambda draw: lambda: cohorts.append(draw()) or cohorts[-1])(leaf._sample_clients)
    stats_ = fel.run_round()
    assert stats_.extra["leaf_clients"] == [6, 6, 6] and stats_.clients == 18 and len(cohorts) == 3
    # each leaf's cohort is drawn from all users, not from one cluster: it holds users of several hash clusters
    for cohort in cohorts:
        assert len(np.unique(fel.assignment[cohort])) > 1 and not set(cohort.tolist()) & set(fel.opt_in.tolist())
    # different seeds: the leaves differ; the score is the mean of their probabilities
    assert not torch.equal(fel.leaves[0].item, fel.leaves[1].item)
    users, items = np.array([0, 1, 2]), np.array([3, 4, 5])
    want = np.mean([torch.sigmoid(leaf.forward_hidden(leaf.user[torch.as_tensor(users)], torch.as_tensor(items))[1])
                    .numpy() for leaf in fel.leaves], axis=0)
    np.testing.assert_allclose(fel.score(users, items), want, rtol=1e-6)


def test_a_cluster_leaf_and_a_bag_differ_only_in_the_pools() -> None:
    clustered, bag = build(), build(leaves="bag")
    assert sum(len(leaf._clients) for leaf in clustered.leaves) == 48
    assert [len(leaf._clients) for leaf in bag.leaves] == [48, 48, 48]
    for a, b in zip(clustered.leaves, bag.leaves):  # same seeds: the same initial models
        assert torch.equal(a.item, b.item)


@pytest.mark.parametrize("kw, words", [({"dp": "central"}, "compose sequentially"),
                                       ({"leaves": "forest"}, "fel.leaves must be one of")])
def test_bag_configuration_errors(kw, words) -> None:
    with pytest.raises(ValueError, match=words):
        FelConfig(**{**BASE, "leaves": "bag", **kw})


def test_a_bag_does_not_run_on_devices() -> None:
    from protocols.fel import check_device_split

    with pytest.raises(ValueError, match="run the bag in process"):
        check_device_split(FelConfig(**{**BASE, "leaves": "bag"}))


@pytest.mark.parametrize("bag, ensemble", [("fel-paper-bag", "fel-paper-mean"), ("fel-paper-bag-nn", "fel-paper")])
def test_the_bag_presets_are_their_ensembles_but_for_the_pools(bag, ensemble) -> None:
    from experiments.run import config as cfgmod

    a, b = cfgmod.load_preset(bag), cfgmod.load_preset(ensemble)
    assert a.section("fel").leaves == "bag" and b.section("fel").leaves == "clusters"
    assert dataclasses.replace(a.section("fel"), leaves="clusters") == b.section("fel")
    assert a.run.rounds == b.run.rounds
