"""LightFR's options for the authors' code's choices (notes §2.11): each changes the update as its formula says
on a hand-computed example, the fixed-point sweep ends at a code no single flip improves, the defaults keep the
old codes bit for bit, and the combinations that cannot work are refused in words."""

import copy
import hashlib

import numpy as np
import pytest

from protocols.lightfr import EarlyStop, LightFR, LightFRConfig
from recmodels import binary_codes as bc
from recmodels.data import Interactions
from recmodels.synthetic import generate_synthetic

# f = 2 codes for the hand-computed examples: the authors' code scales ratings as r' = 2f r - f = 4r - 2
D_TINY = np.array([[1, 1], [1, -1]], np.int8)


def _tiny(ratings, **kw):
    """One user rating items 0 and 1 (ratings on the public scale [0, 1]), codes f = 2."""
    data = Interactions(np.zeros(2, np.int64), np.arange(2), np.asarray(ratings, np.float32), np.zeros(2, np.int64),
                        np.array(["u"]), np.array(["i0", "i1"]))
    cfg = LightFRConfig(bits=2, rating_min=0.0, rating_max=1.0, client_fraction=1.0, **kw)
    m = LightFR(data, cfg, seed=0)
    m.d = D_TINY.copy()
    return m


# -- the user update: the code's stickiness lambda ------------------------------------------------------------------
# b = (+1, +1), r = (0.5, 0.45): r' = (0, -0.2). The code's b^_k = sum_i (r'_i - d_i.b) d_ik + 2 lambda |I_u| b_k:
#   bit 0: (0 - 2)(+1) + (-0.2 - 0)(+1) = -2.2, plus 2 lambda 2 (+1):
#          lambda 0.5 -> -0.2 (flip to -1);  lambda 0.6 -> +0.2 (keep +1)
#   bit 1, lambda 0.5, b = (-1, +1): (0 - 0)(+1) + (-0.2 + 2)(-1) + 2 = +0.2 (keep)  -> b = (-1, +1)
#   bit 1, lambda 0.6, b = (+1, +1): (0 - 2)(+1) + (-0.2 - 0)(-1) + 2.4 = +0.6 (keep) -> b = (+1, +1)
@pytest.mark.parametrize("lam, want", [(0.5, [-1, 1]), (0.6, [1, 1])])
def test_user_stickiness_follows_the_codes_formula(lam, want):
    res = bc.dcd_users(np.array([[1, 1]], np.int8), D_TINY, np.zeros(2, np.int64), np.arange(2), np.array([0.5, 0.45]),
                       lam=0.0, max_sweeps=1, stickiness=lam)
    assert res.codes[0].tolist() == want
    m = _tiny([0.5, 0.45], user_stickiness=lam)  # the same through the protocol's client step
    m.b[:] = 1
    m.device_step("train", 0, np.array([0]), {"d": bc.pack(D_TINY)}, {})
    assert m.b[0].tolist() == want


def test_stickiness_one_half_is_the_paper_dcd_exactly():
    data = generate_synthetic(n_users=10, n_items=15, dim=3, mean_interactions=6, seed=2)
    runs = []
    for kw in ({}, {"user_stickiness": 0.5}):
        m = LightFR(data, LightFRConfig(bits=8, **kw), seed=4)
        for _ in range(3):
            m.run_round()
        runs.append((m.b.copy(), m.d.copy()))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


# -- the item update: add-back |U_s| d_ik instead of once per rater -------------------------------------------------
# item d = (+1, +1), one rater b = (-1, +1) with r = 1 (r' = 2), |U_s| = 10 sampled clients:
#   the code: d^_i0 = (r' - b.d) b_0 + |U_s| d_0 = (2 - 0)(-1) + 10 = 8 (keep +1); bit 1: 2 + 10 > 0 (keep)
#   once per rater (the paper): (2 - 0)(-1) + 1 = -1 (flip to -1); then bit 1 (b.d = 2): (2 - 2)(+1) + 1 > 0 (keep)
@pytest.mark.parametrize("server", ["grad", "dcd"])
@pytest.mark.parametrize("add_back, want", [("raters", [-1, 1]), ("sampled", [1, 1])])
def test_item_add_back_follows_the_codes_formula(server, add_back, want):
    m = _tiny([1.0, 1.0], server=server, item_add_back=add_back)
    m.d = np.array([[1, 1], [1, 1]], np.int8)
    b = np.array([[-1, 1]], np.int8)
    users, items, r = np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1)
    if server == "grad":
        total = np.zeros((2, 2))
        total[0] = bc.item_gradients(b, m.d, users, items, r)[0]
    else:
        a_p, g_p = bc.pair_stats(b, users, r)
        total = np.zeros((2, 6))
        total[0] = np.concatenate([a_p[0], g_p[0]])
    new = m.server_update(total, np.array([1.0, 0.0]), sampled=10)
    assert new[0].tolist() == want
    assert new[1].tolist() == [1, 1]  # no rater: never moves


def test_item_add_back_sampled_counts_the_clients_the_sums_came_from():
    data = generate_synthetic(n_users=8, n_items=12, dim=3, mean_interactions=5, seed=1)
    m = LightFR(data, LightFRConfig(bits=8, item_add_back="sampled", client_fraction=0.5), seed=3)
    seen = []
    real = m.server_update
    m.server_update = lambda total, cnt, sampled=None: seen.append(sampled) or real(total, cnt, sampled=sampled)
    stats = m.run_round()
    assert seen == [stats.extra["clients_answered"]] and seen[0] == 4


# -- sweeps until no bit changes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("lam", [0.5, 0.6, 1.0])
def test_fixed_point_sweep_ends_where_no_single_flip_gains_more_than_the_stickiness(lam):
    rng = np.random.default_rng(7)
    n, m, f = 12, 30, 16
    users = np.repeat(np.arange(n), 8)
    items = np.concatenate([rng.choice(m, 8, replace=False) for _ in range(n)])
    r = rng.random(len(users))
    b0, d = bc.random_codes(n, f, rng), bc.random_codes(m, f, rng)
    res = bc.dcd_users(b0, d, users, items, r, lam=0.0, max_sweeps=10_000, stickiness=lam)
    assert res.converged.all() and res.sweeps.max() < 10_000
    base = bc.user_loss(res.codes, d, users, items, r, 0.0)
    margin = (2 * lam - 1) * 8 / f**2  # a flip must lower L_u by more than this
    for k in range(f):
        flipped = res.codes.copy()
        flipped[:, k] *= -1
        gain = base - bc.user_loss(flipped, d, users, items, r, 0.0)
        assert (gain <= margin + 1e-12).all()
    # and it is a true fixed point: one more sweep changes nothing
    again = bc.dcd_users(res.codes, d, users, items, r, lam=0.0, max_sweeps=1, stickiness=lam)
    np.testing.assert_array_equal(again.codes, res.codes)


def test_fixed_point_sweeps_run_past_user_sweeps_and_report_the_count():
    data = generate_synthetic(n_users=10, n_items=15, dim=3, mean_interactions=8, seed=5)
    m = LightFR(data, LightFRConfig(bits=16, user_sweeps=1, sweeps="fixed-point", server="dcd",
                                    item_add_back="sampled"), seed=1)
    d_before = m.d.copy()
    state = copy.deepcopy(m.rng.bit_generator.state)
    sel = np.unique(m.sample_clients())
    m.rng.bit_generator.state = state
    stats = m.run_round()
    assert stats.extra["users_converged"] == 1.0 and stats.extra["user_sweeps_mean"] >= 1
    assert "item_sweeps_max" in stats.extra
    pidx = m._pairs(sel)  # every sampled user's code is a fixed point against the codes it received
    again = bc.dcd_users(m.b, d_before, m.users[pidx], m.items[pidx], m.r[pidx], lam=0.0, max_sweeps=1)
    np.testing.assert_array_equal(again.codes[sel], m.b[sel])


# -- sampling with replacement ---------------------------------------------------------------------------------------
def test_sampling_with_replacement_counts_a_repeated_client_as_often_as_drawn():
    data = generate_synthetic(n_users=9, n_items=14, dim=3, mean_interactions=5, seed=0)
    cfg = LightFRConfig(bits=8, client_fraction=0.7, client_sampling="with-replacement", item_add_back="sampled")
    for seed in range(20):
        m = LightFR(data, cfg, seed=seed)
        state = copy.deepcopy(m.rng.bit_generator.state)
        draw = m.sample_clients()
        if len(np.unique(draw)) < len(draw):
            break
    assert len(draw) == int(0.7 * 9) and len(np.unique(draw)) < len(draw)
    oracle = copy.deepcopy(m)
    m.rng.bit_generator.state = state
    stats = m.run_round()
    assert stats.clients == len(draw) and stats.extra["clients_repeated"] >= 1
    # the oracle: each distinct client once, its upload weighted by how often it was drawn
    sel, mult = np.unique(draw, return_counts=True)
    ups = oracle._local_round(sel, 0, oracle.d.copy())
    total = np.zeros((oracle.n_items, 8))
    cnt = np.zeros(oracle.n_items)
    for u, c in zip(sel.tolist(), mult.tolist()):
        if u in ups:
            total[ups[u].items] += c * ups[u].body
            cnt[ups[u].items] += c
    want = oracle.server_update(total, cnt, sampled=sum(c for u, c in zip(sel, mult) if u in ups))
    np.testing.assert_array_equal(m.d, want)
    np.testing.assert_array_equal(m.b, oracle.b)


def test_sampling_without_replacement_is_the_default_draw():
    data = generate_synthetic(n_users=9, n_items=14, dim=3, mean_interactions=5, seed=0)
    draw = LightFR(data, LightFRConfig(bits=8, client_fraction=0.7), seed=3).sample_clients()
    assert len(draw) == round(0.7 * 9) and len(np.unique(draw)) == len(draw)


# -- early stop --------------------------------------------------------------------------------------------------------
def test_early_stop_rules():
    e = EarlyStop(1e-4)
    assert not e.observe(0, 0.5, False)  # no previous loss
    assert not e.observe(1, 0.4, False)
    assert e.observe(2, 0.39995, False) and "< 0.0001" in e.stopped
    e = EarlyStop(1e-4)
    for t, loss in enumerate([0.5, 0.375, 0.25]):  # |delta| 0.125 twice (exact in binary)
        stop = e.observe(t, loss, False)
    assert stop and "equals the previous" in e.stopped
    e = EarlyStop(1e-4)
    assert e.observe(0, 0.5, True) and "no bit changed" in e.stopped


def test_early_stop_freezes_training_and_survives_a_checkpoint():
    data = generate_synthetic(n_users=8, n_items=12, dim=3, mean_interactions=5, seed=1)
    m = LightFR(data, LightFRConfig(bits=8, early_stop="authors", early_stop_threshold=10.0), seed=0)
    first, second = m.run_round(), m.run_round()  # the second |delta loss| < 10
    assert "early_stopped" not in first.extra and "< 10" in second.extra["early_stopped"]
    frozen = (m.b.copy(), m.d.copy(), copy.deepcopy(m.rng.bit_generator.state))
    third = m.run_round()
    assert third.clients == 0 and third.extra["trained"] is False and third.loss == second.loss
    np.testing.assert_array_equal(m.b, frozen[0])
    np.testing.assert_array_equal(m.d, frozen[1])
    assert m.rng.bit_generator.state == frozen[2] and m.round == 3
    resumed = LightFR(data, m.config, seed=0)
    resumed.load_state_dict(m.state_dict())
    assert resumed.run_round().extra["trained"] is False


def test_early_stop_off_trains_every_round():
    data = generate_synthetic(n_users=8, n_items=12, dim=3, mean_interactions=5, seed=1)
    m = LightFR(data, LightFRConfig(bits=8, early_stop_threshold=10.0), seed=0)
    assert all(m.run_round().clients > 0 for _ in range(3))


# -- the defaults keep the old codes; secure sums still equal the plaintext ones ---------------------------------------
# digests of (b, d) after 3 rounds, computed with the protocol before these options existed
GOLDEN = {("grad", "none"): "d12732ad92679461", ("para", "none"): "4585f40802b5cfcf",
          ("dcd", "none"): "3ce1cf54c0ec07d7", ("grad", "secagg+"): "d12732ad92679461",
          ("dcd", "secagg"): "3ce1cf54c0ec07d7"}


@pytest.mark.parametrize("server, secure", list(GOLDEN))
def test_defaults_give_the_codes_of_the_protocol_before_the_options(server, secure):
    data = generate_synthetic(n_users=12, n_items=20, dim=3, mean_interactions=6, seed=3)
    m = LightFR(data, LightFRConfig(bits=8, server=server, secure_aggregation=secure, lambda_item=0.05,
                                    lambda_user=0.05), seed=5)
    for _ in range(3):
        m.run_round()
    assert hashlib.sha256(m.b.tobytes() + m.d.tobytes()).hexdigest()[:16] == GOLDEN[server, secure]


@pytest.mark.parametrize("server, secure", [("grad", "secagg+"), ("dcd", "secagg"), ("grad", "dpf")])
def test_secure_sums_give_the_plaintext_codes_with_the_authors_options(server, secure):
    data = generate_synthetic(n_users=8, n_items=12, dim=3, mean_interactions=5, seed=6)
    opts = {"bits": 8, "server": server, "user_stickiness": 0.6, "item_add_back": "sampled", "sweeps": "fixed-point",
            "early_stop": "authors", "client_fraction": 0.75}
    plain = LightFR(data, LightFRConfig(**opts), seed=2)
    sec = LightFR(data, LightFRConfig(secure_aggregation=secure, **opts), seed=2)
    for _ in range(3):
        a, b = plain.run_round(), sec.run_round()
        assert a.extra.get("early_stopped") == b.extra.get("early_stopped")
    np.testing.assert_array_equal(plain.d, sec.d)
    np.testing.assert_array_equal(plain.b, sec.b)


# -- configuration errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, words", [
    ({"client_sampling": "with-replacement", "secure_aggregation": "secagg+"}, "cannot run with secure_aggregation"),
    ({"client_sampling": "with-replacement", "secure_aggregation": "dpf"}, "without-replacement"),
    ({"item_add_back": "sampled", "server": "para"}, "Agg_para"),
    ({"user_stickiness": -0.1}, "user_stickiness must be a finite number >= 0"),
    ({"user_stickiness": float("nan")}, "user_stickiness"),
    ({"sweep_cap": 0}, "sweep_cap must be an int >= 1"),
    ({"sweeps": "forever"}, "lightfr.sweeps must be one of"),
    ({"client_sampling": "bootstrap"}, "lightfr.client_sampling must be one of"),
    ({"early_stop": "yes"}, "lightfr.early_stop must be one of"),
    ({"early_stop_threshold": -1.0}, "early_stop_threshold"),
])
def test_config_errors_are_clear(kw, words):
    with pytest.raises(ValueError, match=words):
        LightFRConfig(**kw)


def test_item_add_back_sampled_needs_the_client_count():
    m = _tiny([1.0, 1.0], item_add_back="sampled")
    with pytest.raises(ValueError, match="number of clients"):
        m.server_update(np.zeros((2, 2)), np.ones(2))


def test_the_lightfr_authors_preset_sets_every_option_and_raw_scores():
    from experiments.run import config as cfgmod

    cfg = cfgmod.load_preset("lightfr-authors").section("lightfr")
    assert (cfg.user_stickiness, cfg.item_add_back, cfg.sweeps, cfg.client_sampling, cfg.early_stop, cfg.ties) == (
        0.6, "sampled", "fixed-point", "with-replacement", "authors", "pessimistic")
    raw = cfgmod.load_preset("lightfr-paper-raw").section("lightfr")
    paper = cfgmod.load_preset("lightfr-paper").section("lightfr")
    assert raw.ties == "pessimistic" and paper.ties == "random"
    assert {k: v for k, v in vars(raw).items() if k != "ties"} == {k: v for k, v in vars(paper).items() if k != "ties"}
