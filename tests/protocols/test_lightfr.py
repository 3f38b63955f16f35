"""LightFR protocol: server updates against a plaintext oracle, secure == plaintext bit for bit,
bad uploads refused before any state changes, resume, tie rules and cold start."""

import copy
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from protocols.lightfr import STATS, LightFR, LightFRConfig, Upload, UpdateError, rank_metrics
from protocols.registry import get_protocol
from recmodels import binary_codes as bc
from recmodels.synthetic import generate_synthetic


def _data(seed=0, n=8, m=14):
    return generate_synthetic(n_users=n, n_items=m, dim=3, mean_interactions=5, seed=seed)


def _model(server="grad", secure="none", seed=0, data=None, **kw):
    cfg = LightFRConfig(bits=kw.pop("bits", 8), server=server, secure_aggregation=secure, **kw)
    return LightFR(data if data is not None else _data(seed), cfg, seed=seed)


def _oracle_next_d(m: LightFR) -> np.ndarray:
    """Independent plaintext oracle of one round, from unpacked codes and per-user loops."""
    state = copy.deepcopy(m.rng.bit_generator.state)
    sel = m.sample_clients()
    m.rng.bit_generator.state = state
    cfg, f = m.config, m.f
    b = m.b.copy()
    for u in sel:  # per-user DCD with an explicit loop over bits
        idx = np.flatnonzero(m.users == u)
        lam = cfg.lambda_user * len(idx) / f**2
        for _ in range(cfg.user_sweeps):
            changed = False
            for k in range(f):
                dd = m.d[m.items[idx]].astype(float)
                s = dd @ b[u].astype(float)
                star = ((m.r[idx] - 0.5 - (s - b[u, k] * dd[:, k]) / (2 * f)) * dd[:, k]).sum() / f \
                    - 2 * lam * (b[u].sum() - b[u, k])
                new = 1 if star > 0 else (-1 if star < 0 else b[u, k])
                changed |= new != b[u, k]
                b[u, k] = new
            if not changed:
                break
    tot = np.zeros((m.n_items, f))
    cnt = np.zeros(m.n_items)
    for u in sel:
        for j in np.flatnonzero(m.users == u):
            i = m.items[j]
            sim = 0.5 + b[u].astype(float) @ m.d[i] / (2 * f)
            tot[i] += (m.r[j] - sim) * b[u] + m.d[i] / (2 * f)
            cnt[i] += 1
    d = m.d.astype(float)
    lam_i = cfg.lambda_item * cnt / f**2
    star = tot / f - 2 * lam_i[:, None] * (d.sum(1, keepdims=True) - d)
    new = np.where(star > 0, 1, np.where(star < 0, -1, m.d))
    return np.where(cnt[:, None] > 0, new, m.d)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 500), lam=st.sampled_from([0.0, 0.1]), frac=st.sampled_from([0.5, 1.0]))
def test_agg_grad_round_matches_the_loop_oracle(seed, lam, frac):
    m = _model(seed=seed, lambda_user=lam, lambda_item=lam, client_fraction=frac)
    want = _oracle_next_d(m)
    m.run_round()
    # f a power of two: every upload is exactly on the 2^-24 grid, so even exact ties agree
    np.testing.assert_array_equal(m.d, want)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 500), server=st.sampled_from(["grad", "para", "dcd"]),
       protocol=st.sampled_from(["secagg+", "secagg"]), rows=st.sampled_from(["union", "all"]))
def test_secure_upload_gives_the_plaintext_codes_bit_for_bit(seed, server, protocol, rows):
    data = _data(seed, n=6, m=9)
    plain = _model(server, "none", seed=seed, data=data, bits=6, lambda_item=0.05)
    secure = _model(server, protocol, seed=seed, data=data, bits=6, lambda_item=0.05, secure_rows=rows)
    for _ in range(2):
        plain.run_round()
        secure.run_round()
        np.testing.assert_array_equal(secure.d, plain.d)
        np.testing.assert_array_equal(secure.b, plain.b)
    # and the server saw only masked uploads: no upload equals a client's dense plaintext vector
    ups = [r for r in secure.transport.transcript.view("server") if r.kind == "update"]
    assert ups and all(not isinstance(r.payload, Upload) for r in ups)


def test_dcd_server_reaches_an_item_coordinate_minimum():
    m = _model("dcd", seed=3, client_fraction=1.0, item_sweeps=500)
    m.run_round()
    b, d = m.b, m.d
    lam = m._lam(0.0, np.bincount(m.items, minlength=m.n_items))
    base = bc.item_loss(d, b, m.users, m.items, m.r, lam)
    for k in range(m.f):
        flip = d.copy()
        flip[:, k] *= -1
        assert np.all(bc.item_loss(flip, b, m.users, m.items, m.r, lam) >= base - 1e-12)


def test_only_items_with_a_rater_move():
    m = _model(seed=1, client_fraction=0.25)
    state = copy.deepcopy(m.rng.bit_generator.state)
    sel = m.sample_clients()
    m.rng.bit_generator.state = state
    rated = np.unique(m.items[np.isin(m.users, sel)])
    before = m.d.copy()
    m.run_round()
    untouched = np.setdiff1d(np.arange(m.n_items), rated)
    np.testing.assert_array_equal(m.d[untouched], before[untouched])


def _uploads(m):
    sel = m.sample_clients()
    ups = []
    for u in sel:
        idx = np.flatnonzero(m.users == u)
        body = m._client_bodies(m.b, m.users[idx], m.items[idx], m.r[idx])
        ups.append(Upload(int(u), m.round, m.items[idx], body))
    return ups


@pytest.mark.parametrize("server", ["grad", "para"])
@pytest.mark.parametrize("break_it, message", [
    (lambda up, m: dataclasses.replace(up, round=5), "round"),
    (lambda up, m: dataclasses.replace(up, user=999), "not sampled|client 999"),
    (lambda up, m: dataclasses.replace(up, items=up.items + m.n_items), "unknown item"),
    (lambda up, m: dataclasses.replace(up, items=up.items[::-1].copy()), "ascending"),
    (lambda up, m: dataclasses.replace(up, body=up.body[:, :-1]), "shape"),
    (lambda up, m: dataclasses.replace(up, body=np.zeros_like(up.body)), "only -1 and \\+1|never"),
])
def test_bad_uploads_are_refused_before_any_state_changes(server, break_it, message):
    m = _model(server, seed=2, client_fraction=1.0)
    ups = _uploads(m)
    bad = break_it(ups[-1], m)
    if server == "grad" and message.startswith("only"):
        bad = dataclasses.replace(ups[-1], body=np.full_like(ups[-1].body, 7.0))
        message = "exceeds"
    if len(bad.items) > 1 and message == "ascending" or message != "ascending":
        d0 = m.d.copy()
        with pytest.raises(UpdateError, match=message):
            m.aggregate(ups[:-1] + [bad])
        np.testing.assert_array_equal(m.d, d0)
    with pytest.raises(UpdateError, match="replay"):
        m.aggregate(ups + [ups[0]])


def test_resume_reproduces_the_uninterrupted_run():
    a, b = _model(seed=4, lambda_item=0.02), _model(seed=4, lambda_item=0.02)
    for _ in range(2):
        a.run_round()
        b.run_round()
    state = copy.deepcopy(a.state_dict())
    a.run_round()
    a.run_round()
    c = _model(seed=99, data=_data(4), lambda_item=0.02)
    c.load_state_dict(state)
    c.run_round()
    c.run_round()
    np.testing.assert_array_equal(a.d, c.d)
    np.testing.assert_array_equal(a.b, c.b)
    bad = dict(state, d=np.zeros_like(state["d"]))
    with pytest.raises(ValueError, match="only -1 and \\+1"):
        c.load_state_dict(bad)


def test_rank_metrics_tie_rules():
    s = np.array([[3.0, 3.0, 3.0, 1.0], [5.0, 1.0, 1.0, 1.0]])
    out = rank_metrics(s, k=1)
    assert out["HR@1_optimistic"] == 1.0 and out["HR@1_pessimistic"] == 0.5
    assert out["HR@1"] == pytest.approx((1 / 3 + 1) / 2)


def test_random_ties_score_is_order_preserving_and_breaks_ties():
    m = _model(seed=5)
    users = np.arange(m.n_users)
    items = np.tile(np.arange(m.n_items), (m.n_users, 1))
    raw, s = m.raw_scores(users, items), m.score(users, items)
    assert np.all((raw[:, :, None] > raw[:, None, :]) <= (s[:, :, None] > s[:, None, :]))
    np.testing.assert_array_equal(np.floor(s * 2) / 2, raw)
    np.testing.assert_allclose(m.score_all(users), s)


def test_cold_start_leaves_the_model_unchanged_and_fits_the_new_ratings():
    m = _model(seed=6, bits=16)
    for _ in range(2):
        m.run_round()
    b0, d0 = m.b.copy(), m.d.copy()
    items = np.array([0, 3, 5])
    code = m.cold_start_code(items, np.array([m.hi, m.lo, m.hi]), seed=1)
    np.testing.assert_array_equal(m.b, b0)
    np.testing.assert_array_equal(m.d, d0)
    dots = m.d[items].astype(int) @ code.astype(int)
    assert dots[0] > dots[1] and dots[2] > dots[1]
    with pytest.raises(UpdateError, match="known item"):
        m.cold_start_code(np.array([m.n_items]), np.array([1.0]))


def test_registered_ranking_protocol_keeping_ratings():
    spec = get_protocol("lightfr")
    assert spec.task == "ranking" and spec.keeps_ratings and spec.config_cls is LightFRConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"server": "median"}, "lightfr.server"), ({"bits": 0}, "lightfr.bits"),
    ({"client_fraction": 0.0}, "lightfr.client_fraction"), ({"lambda_item": -1.0}, "lightfr.lambda_item"),
    ({"secure_aggregation": "he"}, "lightfr.secure_aggregation"), ({"ties": "first"}, "lightfr.ties"),
])
def test_bad_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LightFRConfig(**kwargs)


TINY = """
[data]
synthetic_users = 40
synthetic_items = 150
synthetic_mean_interactions = 8
[lightfr]
bits = 16
"""


@pytest.mark.parametrize("preset", ["lightfr", "lightfr-para"])
def test_cli_run_and_resume_equal_the_uninterrupted_run(tmp_path, capsys, preset):
    import json

    from experiments.cli import main

    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    assert main(["run", preset, "--config", str(cfg), "--rounds", "3", "--out", str(tmp_path / "full"), "--json", "--quiet"]) == 0
    full = json.loads(capsys.readouterr()[0].splitlines()[-1])
    assert main(["run", preset, "--config", str(cfg), "--rounds", "1", "--out", str(tmp_path / "part"), "--quiet"]) == 0
    assert main(["run", "--resume", str(tmp_path / "part"), "--rounds", "3", "--json", "--quiet"]) == 0
    resumed = json.loads(capsys.readouterr()[0].splitlines()[-1])
    assert resumed["metrics"] == full["metrics"] and "HR@10" in full["metrics"]
    assert full["evaluation"]["sampled"].startswith("held-out item + 49")
    assert full["data"]["positives"] == "explicit ratings kept"
    assert full["privacy"]["unprotected"] is True


@pytest.mark.parametrize("rows", ["union", "all"])
def test_chunked_secure_sum_equals_one_instance(monkeypatch, rows):
    import protocols.exchange as ex

    data = _data(7, n=5, m=9)
    whole = _model("grad", "secagg+", seed=7, data=data, secure_rows=rows)
    whole.run_round()
    monkeypatch.setattr(ex, "SECURE_CHUNK", 30)  # several protocol instances per round (the exchange runtime chunks)
    chunked = _model("grad", "secagg+", seed=7, data=data, secure_rows=rows)
    chunked.run_round()
    np.testing.assert_array_equal(whole.d, chunked.d)
    ups = [r for r in chunked.transport.transcript.view("server") if r.kind == "update"]
    assert len(ups) > 3 * chunked.config.client_fraction * 5


def test_bench_lightfr_json(capsys):
    import json

    from experiments.cli import main

    assert main(["bench", "lightfr", "--items", "300", "--bits", "64", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr()[0].splitlines()[-1])
    s = out["storage_bytes"]
    assert s["packed"] == 301 * 8 and s["one_byte_per_bit"] == 301 * 64 and s["float32_equal_dim"] == 301 * 256
    assert out["top10_seconds"]["hamming_packed"] > 0
    assert main(["bench", "lightfr", "--items", "0"]) == 2


def test_union_rows_give_the_dense_forms_codes_and_send_only_the_unions_rows():
    data = _data(3, n=10, m=40)
    union = _model("grad", "secagg+", seed=3, data=data, secure_rows="union")
    dense = _model("grad", "secagg+", seed=3, data=data, secure_rows="all")
    union.run_round(), dense.run_round()
    np.testing.assert_array_equal(union.d, dense.d)
    view = union.transport.transcript.view("server")
    rated = [r for r in view if r.kind == "lightfr:rated"]
    ups = [r for r in view if r.kind == "update"]
    assert rated and len(rated) == len(ups)  # one phase-1 and one phase-2 upload per client (one chunk each)
    assert all(len(r.payload) == data.n_items for r in rated)
    u_rows = {len(r.payload) for r in ups}
    assert len(u_rows) == 1
    width, k = union._width() + 1, len(STATS)  # every vector starts with the round's report (STATS)
    (dim,) = u_rows
    assert (dim - k) % width == 0 and (dim - k) // width < data.n_items  # only the union's rows travel
    dense_dim = {len(r.payload) for r in dense.transport.transcript.view("server") if r.kind == "update"}
    assert dense_dim == {k + data.n_items * width}


@pytest.mark.slow
def test_bench_sweep_and_fedmf_comparison_small(tmp_path):
    from experiments.bench.lightfr import _plot_sweep, sweep, vs_fedmf

    rows = sweep("synthetic", 1, 0, [8], [0.5], {"synthetic_users": 60, "synthetic_items": 120})
    assert [(r["vary"], r["bits"], r["client_fraction"]) for r in rows] == [("bits", 8, 0.6), ("client_fraction", 64, 0.5)]
    assert all(0 <= r["HR@10"] <= r["HR@10_optimistic"] <= 1 for r in rows)
    _plot_sweep(rows, str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > 0
    cmp = {r["model"]: r for r in vs_fedmf(users=8, items=300, rounds=1, cost_rounds=1, seed=0)}
    assert cmp["LightFR Agg_grad, SecAgg+ (union rows)"]["same_codes_as_plaintext"] is True
    assert cmp["FedMF full, paillier"]["max_abs_item_diff_vs_plaintext"] < 1e-4
    assert cmp["FedMF full, paillier"]["bytes_per_client_per_round"] > cmp["FedMF full, plaintext"]["bytes_per_client_per_round"]


def test_the_rounds_two_secure_sums_share_one_key_setup():
    """SecAgg+: the rated union and the values over it are two instances of one key setup
    (secagg.reuse): one advert per client per round, the second sum pays no setup; a new round sets up anew."""
    from protocols.secure_sum import observe

    data = _data(3, n=10, m=40)
    m = _model("grad", "secagg+", seed=3, data=data, secure_rows="union")
    seen: list = []
    with observe(seen.append):
        m.run_round()
        m.run_round()
    assert [(i["reuse"], i["setup"]) for i in seen] == [(True, True), (True, False)] * 2
    view = m.transport.transcript.view("server")
    for rnd in (0, 1):
        adverts = [r for r in view if r.kind == "secagg:advertise" and r.round == rnd]
        assert len(adverts) == seen[2 * rnd]["n"]  # one per client per round, not one per sum
