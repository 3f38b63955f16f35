"""FEL's distributed DP noise against a server that lets clients drop and clients that collude (issue 23, items 5, 6).

Each client of a DP leaf adds a discrete Gaussian share sized so that the survivors' shares sum to the
target noise ``z * Delta``. Two ways to get a release with less noise than the ledger says:

* **Item 5** (dropouts): clients drop before their masked input, fewer survive than the shares were
  sized for. The leaf used to unmask and decode that sum, then count the survivors and refuse, with
  nothing in the ledger: the server held an under-noised sum that no privacy report mentions. Now
  each client's own floor is enforced inside the secure aggregation (it does not sign a survivor set
  below it, so the sum is never unmasked) and the round is refused in its stats.
* **Item 6** (collusion): the SecAgg threat model lets ``floor(secagg_corrupt * m)`` clients of a
  cohort collude with the server; they know their own shares and subtract them. The shares used to
  be sized, and the release accounted, counting the colluders' shares too.

The attacks are played in process (the server's view is captured where the leaf's secure sum returns
its decoded total); ``tests/fedflower/test_apps_fel_dp.py`` plays them over the Flower loopback grid.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scipy import stats

import protocols.fel_leaf as fel_leaf_mod
import protocols.fel_overarch as fel_overarch_mod
from dp.ledger import PrivacyLedger
from protocols.fel import FelConfig, FelTrainer, fel_privacy_report
from protocols.transport import InProcessTransport

from .test_fel import make_train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: A one-leaf DP-FedAvg under distributed noise through SecAgg (the leaf's width: 30 items x 4 + 4 + 1).
LEAF = dict(dim=4, n_clusters=1, min_clients=3, combiner="mean", opt_in_fraction=0.0, dp="distributed",
            noise_multiplier=1.0, clip=0.5, secure_aggregation="secagg", frac_bits=12, value_clip=256.0)


def build(seed: int = 0, train=None, **kw) -> FelTrainer:  # noqa: ANN001
    return FelTrainer(train or make_train(), FelConfig(**{**LEAF, **kw}), seed=seed, transport=InProcessTransport())


def spy_decoded_sums(monkeypatch, module, floor: int | None = None) -> list[tuple]:  # noqa: ANN001
    """The server's view: every sum ``module``'s secure sum decoded, as ``(survivors, noisy inputs, total)``.

    ``floor``: the survivors the noise shares were sized for; a decoded sum over fewer is the attack
    (the server holds a sum with fewer noise shares than the target needs) and fails the test there.
    """
    seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    real = module.secure_sum

    def spy(values, **kw):  # noqa: ANN001, ANN202
        res = real(values, **kw)
        inputs = np.asarray(values, dtype=np.float64)
        seen.append((res.survivors.copy(), inputs.copy(), res.total.copy()))
        if floor is not None and len(res.survivors) < floor:
            # (what it decoded is exactly the survivors' noisy inputs: their clipped updates plus only
            # their own noise shares)
            exact = np.allclose(res.total, inputs[res.survivors].sum(0), atol=len(inputs) * 2.0**-kw["frac_bits"])
            raise AssertionError(f"the server decoded a sum over {len(res.survivors)} of {len(inputs)} clients (the "
                                 f"survivors' noisy inputs: {exact}), whose noise shares were sized for {floor}")
        return res

    monkeypatch.setattr(module, "secure_sum", spy)
    return seen


def spy_noise(monkeypatch, module) -> list[tuple[float, np.ndarray]]:  # noqa: ANN001
    """Every noise draw of ``module``: ``(the standard deviation asked for, the shares drawn)``."""
    drawn: list[tuple[float, np.ndarray]] = []
    real = module.discrete_gaussian_noise

    def spy(shape, real_scale, frac_bits, **kw):  # noqa: ANN001, ANN202
        out = real(shape, real_scale, frac_bits, **kw)
        drawn.append((float(real_scale), np.asarray(out).copy()))
        return out

    monkeypatch.setattr(module, "discrete_gaussian_noise", spy)
    return drawn


def run_and_record(fel: FelTrainer, ledger: PrivacyLedger):  # noqa: ANN201
    """One round as ``secagg run`` does it: the round, then its releases into the ledger."""
    st_ = fel.run_round()
    with ledger.round(ledger.next_round()) as h:
        for rel in st_.releases:
            h.record(rel.event, who=rel.who, what=rel.what, params=rel.params, cohort=rel.cohort)
    return st_


# -- item 5: excess dropouts are refused inside the secure aggregation -------------------------------
def test_a_leaf_never_decodes_a_sum_with_fewer_noise_shares_than_it_was_sized_for(monkeypatch, tmp_path) -> None:
    """3 of 12 clients drop before their masked input (secure aggregation plans for 30% dropouts), 9 survive;
    the shares were sized for 11 (``dropout_margin = 0.1``). Before the fix the leaf unmasked the 9 clients'
    sum, decoded it and only then raised ``ExcessDropoutError``, so the server held an under-noised sum
    (9 shares of the 11 the target needs) while the ledger recorded nothing for that round. Now the 9
    survivors refuse to sign a survivor set below their own floor of 11, nothing is unmasked, and the round
    is refused: the leaf's model is unchanged, the round's stats say why, and the ledger holds nothing."""
    seen = spy_decoded_sums(monkeypatch, fel_leaf_mod, floor=11)
    fel = build(seed=7, dropout_margin=0.1, simulate_dropout=0.25, clients_per_round=12, secagg_dropout=0.3,
                secagg_corrupt=0.0)
    leaf = fel.leaves[0]
    assert leaf.min_survivors == 11
    before = leaf.flat_model()
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite")
    st_ = run_and_record(fel, ledger)
    assert seen == []  # nothing was decoded
    np.testing.assert_array_equal(leaf.flat_model(), before)
    assert st_.releases == () and ledger.entries() == []
    (why,) = st_.extra["refused"]
    assert why.startswith("leaf 0 round 0:") and "9 of 12" in why and "11" in why
    masked = [r for r in fel.transport.transcript.records if r.kind == "update"]
    assert len(masked) == 9  # the survivors' masked inputs reached the server, and stay masked
    assert fel.round == 1 and leaf.round == 1  # the run goes on


def test_a_sum_unmasked_by_clients_ignoring_their_floor_is_accounted_and_not_applied(monkeypatch, tmp_path) -> None:
    """Defence in depth on the server: if the clients did not enforce their floor (devices running another
    client), the server holds the 9 survivors' decoded sum; it is then recorded with the noise it holds
    (9 shares, z below the target) and not applied, never dropped from the ledger."""
    from protocols.fel_leaf import FelLeaf

    monkeypatch.setattr(FelLeaf, "survivor_floor", lambda self: 2)
    fel = build(seed=7, dropout_margin=0.1, simulate_dropout=0.25, clients_per_round=12, secagg_dropout=0.3,
                secagg_corrupt=0.0)
    leaf = fel.leaves[0]
    before = leaf.flat_model()
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite")
    st_ = run_and_record(fel, ledger)
    np.testing.assert_array_equal(leaf.flat_model(), before)
    (why,) = st_.extra["refused"]
    assert "did not enforce their floor" in why
    (entry,) = ledger.entries()
    assert entry.params["survivors"] == 9 and "not applied" in entry.what
    z = math.sqrt(9) * leaf.sigma_client * 2.0**12 / leaf.sens_grid
    assert entry.event.noise_multiplier == pytest.approx(z, rel=1e-12) and z < 1.0


def test_reaccount_records_the_surviving_noise_before_the_model_is_published(monkeypatch, tmp_path) -> None:
    """``on_excess_dropout = "reaccount"``: the same 9 of 12 survivors' sum is decoded and applied, accounted
    with the noise that survived (its honest part, item 6), and the ledger commits that release before
    anything of the round is published: the evaluation that scores the new model, the checkpoint, and the
    next round's model download to the clients (``secagg run``'s order)."""
    from dp import ledger as ledger_mod
    from experiments.cli import main
    from protocols import transport as transport_mod

    order: list[tuple[str, int]] = []
    real_round = ledger_mod.PrivacyLedger.round

    class Committing:
        def __init__(self, handle, r):  # noqa: ANN001
            self.handle, self.r = handle, r

        def __enter__(self):  # noqa: ANN204
            return self.handle.__enter__()

        def __exit__(self, *exc):  # noqa: ANN002, ANN204
            out = self.handle.__exit__(*exc)
            order.append(("commit", self.r))
            return out

    monkeypatch.setattr(ledger_mod.PrivacyLedger, "round",
                        lambda self, r, **kw: Committing(real_round(self, r, **kw), r))
    real_send = transport_mod.InProcessTransport.send

    def send(self, sender, receiver, round_, kind, payload, nbytes):  # noqa: ANN001, ANN202
        if kind == "model" and ("download", round_) not in order:
            order.append(("download", round_))
        return real_send(self, sender, receiver, round_, kind, payload, nbytes)

    monkeypatch.setattr(transport_mod.InProcessTransport, "send", send)
    real_score = FelTrainer.score
    monkeypatch.setattr(FelTrainer, "score", lambda self, u, i: (order.append(("evaluate", self.round)),
                                                                  real_score(self, u, i))[1])
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\nrounds = 2\neval_every = 1\n[data]\nsynthetic_users = 60\nsynthetic_items = 40\n"
                   "[eval]\nnegatives = 10\nfull_ranking = false\n[fel]\ndim = 4\nn_clusters = 1\nmin_clients = 3\n"
                   "combiner = \"mean\"\nclients_per_round = 12\nclip = 0.5\ncalibration = \"noise\"\n"
                   "noise_multiplier = 1.0\nsimulate_dropout = 0.25\nsecagg_dropout = 0.3\nsecure_aggregation = "
                   "\"secagg\"\nsecagg_corrupt = 0.1\non_excess_dropout = \"reaccount\"\nfrac_bits = 12\n"
                   "value_clip = 256.0\n")
    assert main(["run", "fel-dp", "--config", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    for r in range(2):  # ledger round r holds protocol round r
        first_after = next(i for i, (what, rr) in enumerate(order)
                           if (what == "download" and rr == r + 1) or (what == "evaluate" and rr == r + 1))
        assert order.index(("commit", r)) < first_after, order
    ledger = PrivacyLedger(tmp_path / "run" / "privacy_ledger.sqlite")
    (first, *_) = ledger.entries()
    p = first.params
    assert p["survivors"] == 9 and p["dropped"] == 3 and p["colluders"] == 1  # (floor(0.1 x 12))
    sens = 0.5 + math.sqrt(40 * 4 + 4 + 1) * 2.0**-12 / 2  # Delta: the clip plus nearest rounding on the grid
    z_honest = math.sqrt(9 - p["colluders"]) * p["sigma_client"] / sens
    assert first.event.noise_multiplier == pytest.approx(z_honest, rel=1e-9) and z_honest < 1.0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(4, 14), drop_frac=st.floats(0, 0.3), margin=st.sampled_from([0.0, 0.1, 0.2, 0.3]),
       corrupt=st.sampled_from([0.0, 0.05, 0.1, 0.2]), policy=st.sampled_from(["refuse", "reaccount"]),
       seed=st.integers(0, 1000))
def test_every_decoded_sum_is_accounted_with_its_honest_noise(monkeypatch, tmp_path_factory, m, drop_frac, margin,
                                                              corrupt, policy, seed) -> None:
    """Whatever the cohort size, dropouts, margin, collusion bound and policy: a sum the server decodes is in
    the ledger with the noise of its honest survivors (the survivors minus the ``floor(corrupt m)``
    colluders, who subtract their own shares), computed here from the standard deviation every client
    actually drew with, and the privacy report's epsilon is dp-accounting's for that noise. Under
    ``"refuse"`` that noise reaches the target ``z``; a round the clients refuse releases nothing, leaves
    the model unchanged and says so."""
    import dp_accounting
    from dp_accounting import dp_event as de
    from dp_accounting.rdp import RdpAccountant as DpaRdp

    n_drop = math.floor(drop_frac * m)  # (at most the 30% secure aggregation plans for)
    floor_s = max(1, math.ceil((1 - margin) * m))  # the survivors the noise is sized for
    colluders = math.floor(corrupt * m + 1e-9)
    kw = dict(clients_per_round=m, dropout_margin=margin, simulate_dropout=n_drop / m, secagg_dropout=0.34,
              secagg_corrupt=corrupt, on_excess_dropout=policy)
    if floor_s - colluders < 1:
        with pytest.raises(ValueError, match="secagg_corrupt"):
            build(seed=seed, **kw)
        return
    seen = spy_decoded_sums(monkeypatch, fel_leaf_mod)
    drawn = spy_noise(monkeypatch, fel_leaf_mod)
    fel = build(seed=seed, **kw)
    leaf = fel.leaves[0]
    before = leaf.flat_model()
    ledger = PrivacyLedger(tmp_path_factory.mktemp("l") / "ledger.sqlite")
    st_ = run_and_record(fel, ledger)
    survivors = m - n_drop
    need = floor_s if policy == "refuse" else max(2, colluders + 1)
    event("refused" if not seen else f"decoded, colluders={colluders}, policy={policy}")
    if not seen:  # refused: nothing decoded, nothing released, the model unchanged, the stats say so
        assert st_.releases == () and ledger.entries() == [] and len(st_.extra["refused"]) == 1
        np.testing.assert_array_equal(leaf.flat_model(), before)
        return
    assert survivors >= need  # (fewer survivors are never unmasked)
    ((surv, _, _),) = seen
    ((sigma, shares),) = drawn
    assert len(surv) == survivors and shares.shape[0] == m and st_.extra["refused"] == []
    width = 30 * 4 + 4 + 1
    sens = 0.5 + math.sqrt(width) * 2.0**-12 / 2
    z_honest = math.sqrt((survivors - colluders) * sigma**2) / sens
    (rel,) = st_.releases
    assert rel.event.noise_multiplier == pytest.approx(z_honest, rel=1e-9)
    if policy == "refuse":
        assert z_honest >= 1.0 * (1 - 1e-12)
    orders = list(np.concatenate([np.linspace(1.1, 10.9, 99), np.arange(11, 513)]))
    acc = DpaRdp(orders)
    acc.compose(de.GaussianDpEvent(z_honest))
    assert fel_privacy_report(ledger, 1e-5)["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=2e-2)
    assert dp_accounting is not None


# -- item 6: the colluders' shares ----------------------------------------------------------------
def test_colluders_removing_their_shares_leave_the_accounted_noise(monkeypatch) -> None:
    """The attack of item 6: 2 of 10 clients (``secagg_corrupt = 0.2``) collude with the server and subtract
    their own noise shares from the sum. What is left, the 8 honest shares, must still have the variance
    the ledger accounts, ``(z_eff * Delta)^2``. Before the fix each share was sized for 10 shares and the
    release accounted with all 10: the honest noise had 8/10 of the accounted variance (z 0.89 where the
    ledger said 1.0). Chi-square on 2,409 coordinates."""
    drawn = spy_noise(monkeypatch, fel_leaf_mod)
    fel = build(seed=3, train=make_train(n_users=40, n_items=300), dim=8, clients_per_round=10, dropout_margin=0.0,
                secagg_corrupt=0.2, value_clip=64.0)
    (rel,) = fel.run_round().releases
    ((_, shares),) = drawn
    assert shares.shape == (10, 300 * 8 + 8 + 1) and rel.params["survivors"] == 10
    colluders = [0, 1]  # (any two: the shares are exchangeable)
    honest = np.delete(shares, colluders, axis=0).sum(0).astype(np.float64) * 2.0**-12
    sens = 0.5 + math.sqrt(shares.shape[1]) * 2.0**-12 / 2
    target = (rel.event.noise_multiplier * sens) ** 2
    dof = honest.size
    ratio = float(np.mean(honest**2)) / target  # (the noise has mean 0)
    assert ratio > 1 - 5 * math.sqrt(2 / dof), f"the honest noise has {ratio:.3f} of the accounted variance"
    assert stats.chi2(dof).sf(dof * ratio) > 1e-6 and stats.chi2(dof).cdf(dof * ratio) > 1e-6


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 200), margin=st.floats(0, 0.99), corrupt=st.floats(0, 0.5, exclude_max=True))
def test_a_configuration_guaranteeing_no_honest_survivor_is_refused(m, margin, corrupt) -> None:
    """The noise is sized for ``ceil((1 - margin) m) - floor(corrupt m)`` honest survivors (the collusion
    bound): a configuration where that is below 1 cannot reach its target and is refused before training,
    naming both keys; otherwise each share is ``z Delta / sqrt(honest)``."""
    from protocols.fel import _leaf_dp
    from protocols.fel_leaf import FelLeaf

    cfg = FelConfig(**{**LEAF, "clients_per_round": m, "dropout_margin": margin, "secagg_corrupt": corrupt})
    bound = math.floor(corrupt * m + 1e-9)  # (as secagg.params counts floor(corrupt n))
    honest = max(1, math.ceil((1 - margin) * m)) - bound
    train = make_train(n_users=max(m, 3))
    args = dict(index=0, dp=_leaf_dp(cfg, max(m, 3)), seed=0, transport=InProcessTransport(), exclude=None,
                clients=np.arange(max(m, 3)))
    if honest < 1:
        with pytest.raises(ValueError, match="fel.secagg_corrupt.*fel.dropout_margin"):
            FelLeaf(train, cfg.leaf_config(), **args)
        return
    leaf = FelLeaf(train, cfg.leaf_config(), **args)
    assert (leaf.min_survivors, leaf.colluders, leaf.honest_survivors) == (honest + bound, bound, honest)
    assert leaf.sigma_client == pytest.approx(leaf.sens_grid * 2.0**-12 / math.sqrt(honest), rel=1e-12)


# -- the FL over-arch's DP-FedSGD step: the same two rules -----------------------------------------
OVER = dict(LEAF, n_clusters=2, combiner="over-arch", over_arch_training="fl", clients_per_round=6,
            over_arch_clients=10, over_arch_steps=1, over_arch_noise_multiplier=1.0, over_arch_clip=1.0)


def test_an_over_arch_step_never_decodes_a_sum_with_fewer_noise_shares_than_sized_for(monkeypatch, tmp_path) -> None:
    """3 of the over-arch step's 10 clients drop before their masked input, 7 survive; the shares were sized
    for 9 (margin 0.1): the survivors refuse to unmask, the server's Adam does not step, no over-arch
    release is recorded, and the round's stats say so (the two leaves, with the same dropouts, refuse too)."""
    seen = spy_decoded_sums(monkeypatch, fel_overarch_mod, floor=9)
    fel = FelTrainer(make_train(n_users=60), FelConfig(**{**OVER, "dropout_margin": 0.1, "simulate_dropout": 0.3,
                                                          "secagg_dropout": 0.34, "secagg_corrupt": 0.0,
                                                          "clients_per_round": 10}),
                     seed=5, transport=InProcessTransport())
    assert fel._oa_dp.min_survivors == 9
    weights = [p.detach().clone() for p in fel.over_arch.parameters()]
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite")
    st_ = run_and_record(fel, ledger)
    assert seen == []
    assert all(np.array_equal(a.numpy(), b.detach().numpy()) for a, b in zip(weights, fel.over_arch.parameters()))
    assert not any(e.params.get("over_arch") == "fl" for e in ledger.entries())
    assert len(st_.extra["refused"]) == 3 and ledger.entries() == []
    assert any(w.startswith("over-arch round 0 step 0:") and "7 of 10" in w for w in st_.extra["refused"])


def test_an_over_arch_guaranteeing_no_honest_survivor_is_refused() -> None:
    """The over-arch's cohort of 10 with margin 0.6 keeps 4 survivors, and 4 of 10 may collude: no honest
    survivor is guaranteed, refused before training (the leaves' cohort of 3 keeps 2 survivors, 1 colluder)."""
    cfg = FelConfig(**{**OVER, "clients_per_round": 3, "dropout_margin": 0.6, "secagg_corrupt": 0.4})
    with pytest.raises(ValueError, match="fel.secagg_corrupt.*fel.dropout_margin.*over-arch"):
        FelTrainer(make_train(n_users=60), cfg, seed=0, transport=InProcessTransport())
    FelTrainer(make_train(n_users=60), FelConfig(**{**OVER, "clients_per_round": 3, "dropout_margin": 0.5,
                                                    "secagg_corrupt": 0.4}), seed=0, transport=InProcessTransport())


def test_the_privacy_report_states_the_collusion_bound_and_flags_ledgers_without_it(tmp_path) -> None:
    """FEL's report states the assumption its distributed-noise epsilon rests on (per leaf: ``colluders``);
    a ledger whose distributed releases were recorded before the collusion bound (no ``colluders``) is
    said to overstate the honest noise, never described as accounted for the honest survivors."""
    from dp.events import Gaussian

    for name, extra, says in (("new", {"colluders": 1}, "honest survivors only"),
                              ("old", {}, "smaller than accounted")):
        ledger = PrivacyLedger(tmp_path / f"{name}.sqlite")
        with ledger.round(0) as h:
            h.record(Gaussian(2.0), who="clients", what="leaf 0", cohort="leaf:0",
                     params={"noise": "distributed", "clients": 12, "population": 40, **extra})
        rep = fel_privacy_report(ledger, 1e-5)
        assert says in rep["noise_assumption"]
        assert [p.get("colluders") for p in rep["per_leaf"]] == [extra.get("colluders")]
    central = PrivacyLedger(tmp_path / "central.sqlite")
    with central.round(0) as h:
        h.record(Gaussian(2.0), who="clients", what="leaf 0", cohort="leaf:0", params={"noise": "central"})
    assert "noise_assumption" not in fel_privacy_report(central, 1e-5)
