"""FEL's FL over-arch under DP: batched per-client gradients, clipping, noise, held-out users, accounting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dp.events import NonPrivate
from dp.ledger import PrivacyLedger
from experiments.cli import main
from protocols.fel import FelConfig, FelTrainer, fel_privacy_report
from protocols.fel_overarch import OverArchDp, client_gradients
from protocols.transport import InProcessTransport
from recmodels.data import Interactions
from recmodels.ensemble import OverArch, over_arch_gradient


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_train(n_users: int = 60, n_items: int = 30, k: int = 6, seed: int = 0) -> Interactions:
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(n_users), k)
    items = np.concatenate([rng.choice(n_items, size=k, replace=False) for _ in range(n_users)])
    return Interactions(users=users.astype(np.int64), items=items.astype(np.int64), ratings=np.ones(len(users), np.float32),
                        timestamps=np.arange(len(users), dtype=np.int64), user_ids=np.arange(n_users),
                        item_ids=np.arange(n_items))


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
"""

BASE = dict(dim=4, n_clusters=3, min_clients=3, combiner="over-arch", over_arch_training="fl", opt_in_fraction=0.0,
            clients_per_round=6, over_arch_clients=8, over_arch_steps=2)


def build(seed: int = 0, **kw) -> FelTrainer:
    return FelTrainer(make_train(n_users=60), FelConfig(**{**BASE, **kw}), seed=seed, transport=InProcessTransport())


@settings(max_examples=25, deadline=None)
@given(n_in=st.integers(1, 6), hidden=st.integers(1, 5), n_clients=st.integers(1, 5), n=st.integers(1, 30),
       seed=st.integers(0, 2**16), reduction=st.sampled_from(["sum", "mean"]))
def test_client_gradients_equal_autograd_per_client(n_in, hidden, n_clients, n, seed, reduction) -> None:
    rng = np.random.default_rng(seed)
    model = OverArch(n_in, hidden, seed=seed)
    z = torch.as_tensor(rng.normal(size=(n, n_in)), dtype=torch.float32)
    y = torch.as_tensor(rng.integers(0, 2, n), dtype=torch.float32)
    owner = rng.integers(0, n_clients, n)
    got = client_gradients(model, z, y, owner, n_clients, reduction=reduction, chunk=7).numpy()
    for c in range(n_clients):  # oracle: torch autograd, one client at a time
        mine = torch.as_tensor(owner == c)
        if not mine.any():
            np.testing.assert_array_equal(got[c], 0)
            continue
        want = torch.cat([g.reshape(-1) for g in over_arch_gradient(model, z[mine], y[mine])]).double().numpy()
        if reduction == "mean":
            want = want / int(mine.sum())
        np.testing.assert_allclose(got[c], want, rtol=1e-4, atol=1e-5)


def _dp(mode: str = "central", z: float = 0.0, **kw) -> OverArchDp:
    base = dict(mode=mode, clip=0.5, z=z, sampling="fixed", population=40, expected=10, width=30, frac_bits=16,
                value_clip=1024.0, secure="secagg" if mode == "distributed" else "none", dropout_margin=0.0,
                on_excess_dropout="refuse", noise_tail=12.0, corrupt=0.05, cohort=None)
    return OverArchDp(**{**base, **kw})


def test_over_arch_clipping_bounds_each_contribution() -> None:
    dp = _dp()
    grads = np.random.default_rng(0).normal(scale=5.0, size=(10, 30))
    total, z_eff, extra = dp.noisy_sum(grads, np.arange(10), t=0, transport=InProcessTransport())
    scale = np.minimum(1, 0.5 / np.linalg.norm(grads, axis=1))
    np.testing.assert_allclose(total, (grads * scale[:, None]).sum(0), rtol=1e-12)
    assert extra["clipped_fraction"] == 1.0 and z_eff == 0.0
    # a client's whole influence on the (noise-free) sum is at most clip
    one = dp.noisy_sum(np.vstack([grads[:9], np.zeros((1, 30))]), np.arange(10), t=1, transport=InProcessTransport())[0]
    assert np.linalg.norm(total - one) <= 0.5 * (1 + 1e-9)


def test_over_arch_distributed_noise_has_target_variance() -> None:
    dp = _dp("distributed", z=1.0, frac_bits=12, width=4000)
    total, z_eff, extra = dp.noisy_sum(np.zeros((10, 4000)), np.arange(10), t=0, transport=InProcessTransport())
    target = dp.sensitivity**2  # (z * sensitivity)^2 with every client surviving
    dof = total.size - 1
    ratio = dof * total.var() / target
    assert stats.chi2(dof).sf(ratio) > 1e-4 and stats.chi2(dof).cdf(ratio) > 1e-4
    assert z_eff == pytest.approx(1.0) and extra["survivors"] == 10


def test_over_arch_distributed_noise_free_equals_central_plaintext() -> None:
    kw = dict(dp="central", noise_multiplier=0.0, over_arch_noise_multiplier=0.0, clip=0.5, over_arch_clip=0.05)
    central = build(seed=2, over_arch_steps=1, **kw)
    dist = build(seed=2, over_arch_steps=1, **{**kw, "dp": "distributed"}, secure_aggregation="secagg+", frac_bits=24)
    central_secagg = build(seed=2, over_arch_steps=1, **kw, secure_aggregation="secagg", frac_bits=24)
    seen = []
    for fel in (central, dist, central_secagg):  # the aggregate the server's Adam receives (Adam's sign-like first step
        step = fel._adam.step     # would magnify a 2^-24 rounding of a near-zero coordinate)
        fel._adam.step = lambda params, grads, step=step: (seen.append(torch.cat([g.reshape(-1) for g in grads])),
                                                           step(params, grads))
        fel.run_round()
    assert seen[0].abs().max() > 1e-3
    torch.testing.assert_close(seen[1], seen[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(seen[2], seen[0], rtol=0, atol=1e-5)
    kinds = {r.kind for r in dist.transport.transcript}
    assert "over-arch-update" in kinds  # the masked uploads went through SecAgg+


def test_parallel_over_arch_trains_only_on_held_out_users() -> None:
    fel = build(over_arch_composition="parallel", over_arch_holdout=0.25, dp="central", noise_multiplier=1.0,
                over_arch_noise_multiplier=1.0)
    held = set(fel.held_out.tolist())
    assert len(held) == 15
    for leaf in fel.leaves:
        assert not set(leaf._clients.tolist()) & held
    st_ = fel.run_round()
    ups = {int(r.sender.split(":")[1]) for r in fel.transport.transcript if r.kind == "over-arch-update"}
    leaf_ups = {int(r.sender.split(":")[1]) for r in fel.transport.transcript if r.kind == "update"}
    assert ups and ups <= held and not leaf_ups & held
    over = [r for r in st_.releases if r.params.get("over_arch") == "fl"]
    assert len(over) == 2 and all(r.cohort == "over-arch" for r in over)
    assert all(r.event.noise_multiplier == 1.0 for r in over)


def _ledger(fel: FelTrainer, rounds: int, path) -> PrivacyLedger:  # noqa: ANN001
    ledger = PrivacyLedger(path)
    for r in range(rounds):
        st_ = fel.run_round()
        with ledger.round(r) as h:
            for rel in st_.releases:
                h.record(rel.event, who=rel.who, what=rel.what, params=rel.params, cohort=rel.cohort)
    return ledger


@pytest.mark.parametrize("mode,sampling", [("sequential", "fixed"), ("parallel", "fixed"),
                                           pytest.param("sequential", "poisson", marks=pytest.mark.slow)])
def test_privacy_report_composition_matches_dp_accounting(tmp_path, mode: str, sampling: str) -> None:
    from dp_accounting import dp_event as de
    from dp_accounting.rdp import RdpAccountant as DpaRdp

    extra = dict(over_arch_composition="parallel", over_arch_holdout=0.25) if mode == "parallel" else {}
    fel = build(seed=3, dp="central", noise_multiplier=1.3, clip=0.5, over_arch_noise_multiplier=0.9,
                sampling=sampling, **extra)
    rounds, steps = 3, 2
    rep = fel_privacy_report(_ledger(fel, rounds, tmp_path / "l.sqlite"), 1e-5)
    orders = list(np.concatenate([np.linspace(1.1, 10.9, 99), np.arange(11, 513)]))

    def leaf_event(leaf):  # noqa: ANN001, ANN202
        ev = de.GaussianDpEvent(1.3)
        return de.SelfComposedDpEvent(de.PoissonSampledDpEvent(leaf.q, ev) if sampling == "poisson" else ev, rounds)

    oa = fel._oa_dp
    over_ev = de.GaussianDpEvent(0.9)
    over_ev = de.SelfComposedDpEvent(de.PoissonSampledDpEvent(oa.q, over_ev) if sampling == "poisson" else over_ev,
                                     rounds * steps)

    def eps(*events) -> float:  # noqa: ANN002
        acc = DpaRdp(orders)
        for e in events:
            acc.compose(e)
        return acc.get_epsilon(1e-5)

    leaves = [eps(leaf_event(leaf)) for leaf in fel.leaves]
    over = eps(over_ev)
    np.testing.assert_allclose([p["epsilon"] for p in rep["per_leaf"]], leaves, rtol=2e-2)
    assert rep["over_arch"]["mode"] == mode and rep["over_arch"]["epsilon"] == pytest.approx(over, rel=2e-2)
    if mode == "sequential":  # every user: its leaf, then the over-arch on the same users
        want = max(eps(leaf_event(leaf), over_ev) for leaf in fel.leaves)
        assert rep["epsilon"] > max(max(leaves), over)
    else:  # disjoint users: the worst of the parts
        want = max(max(leaves), over)
    assert rep["epsilon"] == pytest.approx(want, rel=2e-2)
    assert rep["composition"] == "parallel" and rep["over_arch"]["releases"] == rounds * steps


def test_calibrated_over_arch_meets_its_target(tmp_path) -> None:
    fel = build(seed=4, dp="central", calibration="epsilon", target_epsilon=3.0, over_arch_target_epsilon=1.0,
                dp_rounds=2, over_arch_composition="parallel", over_arch_holdout=0.25)
    rep = fel_privacy_report(_ledger(fel, 2, tmp_path / "l.sqlite"), 1e-5)
    assert 0.95 < rep["over_arch"]["epsilon"] <= 1.0 + 1e-6
    assert rep["epsilon"] == pytest.approx(max(p["epsilon"] for p in rep["per_leaf"]), rel=1e-9)  # parallel: max


def test_fl_over_arch_without_dp_is_reported_infinite() -> None:
    fel = build()
    st_ = fel.run_round()
    over = [r for r in st_.releases if r.params.get("over_arch") == "fl"]
    assert len(over) == 2 and all(isinstance(r.event, NonPrivate) and r.cohort is None for r in over)


@pytest.mark.parametrize("kw,match", [
    (dict(over_arch_composition="parallel"), "fel.over_arch_holdout > 0"),
    (dict(over_arch_holdout=0.2), "fel.over_arch_composition"),
    (dict(over_arch_training="opt-in", opt_in_fraction=0.1, over_arch_composition="parallel", over_arch_holdout=0.2),
     "over_arch_training"),
    (dict(over_arch_composition="parallel", over_arch_holdout=0.02), "below fel.min_clients"),
    (dict(dp="central", calibration="epsilon", dp_rounds=2, over_arch_target_epsilon=0.01, max_noise_multiplier=5.0),
     "fel.over_arch_target_epsilon"),
    (dict(dp="distributed", secure_aggregation="secagg+", clip=0.01, noise_multiplier=0.1, over_arch_clip=50.0,
          value_clip=60.0), "over-arch gradient"),
    (dict(over_arch_clip=0.0), "fel.over_arch_clip"),
    (dict(dp="central", secure_aggregation="secagg+", over_arch_clients=2), "no SecAgg\\+ parameters for n = 2"),
    (dict(over_arch_composition="both"), "fel.over_arch_composition"),
])
def test_bad_over_arch_input_refused_before_training(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        build(**kw)


def _run(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr()[0].splitlines()[-1])


def test_parallel_dp_over_arch_resume_equals_uninterrupted_run(tmp_path, capsys) -> None:
    """The DP code path without noise (z = 0: clipping, fixed denominator, held-out users) resumes exactly."""
    cfg = tmp_path / "t.toml"
    cfg.write_text(TINY.format(rounds=3) + "combiner = \"over-arch\"\nover_arch_training = \"fl\"\nopt_in_fraction = 0.0\n"
                   "over_arch_composition = \"parallel\"\nover_arch_holdout = 0.2\nover_arch_clients = 6\n"
                   "dp = \"central\"\nnoise_multiplier = 0.0\nover_arch_noise_multiplier = 0.0\n")
    full = _run(capsys, "run", "fel", "--config", str(cfg), "--out", str(tmp_path / "full"), "--json", "--quiet")
    _run(capsys, "run", "fel", "--config", str(cfg), "--rounds", "1", "--out", str(tmp_path / "part"), "--json", "--quiet")
    resumed = _run(capsys, "run", "--resume", str(tmp_path / "part"), "--rounds", "3", "--json", "--quiet")
    assert resumed["metrics"] == full["metrics"] and "AUC" in full["metrics"]
    rep = _run(capsys, "privacy", "report", str(tmp_path / "full"), "--json")
    assert rep["over_arch"]["mode"] == "parallel"
