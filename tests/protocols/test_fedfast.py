"""FedFast: ActvAGG against per-client loops, the changed set I_k (notes A3), ActvSAMP's
stratification, k-means edge cases, FedAvg equivalence of the baseline preset, resume, and the
secure variant against the plaintext one."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.fedavg import ClientUpdate, FedAvgConfig, FedAvgGMF
from protocols.fedfast import (
    FedFastConfig,
    FedFastGMF,
    actvagg_sums,
    assign_clusters,
    cluster_sums,
    propagate_to_subordinates,
    round_robin_sample,
    update_centroids,
)
from protocols.transport import SERVER, InProcessTransport, Transcript
from recmodels.synthetic import generate_synthetic


def data(users: int = 40, items: int = 60, seed: int = 0):
    return generate_synthetic(n_users=users, n_items=items, dim=6, mean_interactions=8, seed=seed)


def small(**kw) -> FedFastConfig:
    base = dict(dim=6, clients_per_round=8, clusters=3, local_batch_size=16)
    base.update(kw)
    return FedFastConfig(**base)


def model_of(m) -> dict[str, torch.Tensor]:
    return {"user": m.user.clone(), "item": m.item.clone(), "h": m.h.clone(), "b": m.b.clone()}


# -- the ActvAGG item rule ----------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(1, 3), st.integers(0, 10**6),
       st.sampled_from(["component", "row"]))
def test_actvagg_equals_a_per_client_per_component_loop(clients, items, dim, seed, weighting):
    rng = np.random.default_rng(seed)
    touched = rng.random((clients, items)) < 0.5
    delta = rng.normal(size=(clients, items, dim)) * touched[..., None]
    delta[rng.random(delta.shape) < 0.2] = 0.0  # untouched components inside touched rows too
    w0 = rng.normal(size=(items, dim))
    slot, item = np.nonzero(touched)
    num, den = actvagg_sums(item, torch.as_tensor(delta[slot, item]), items, weighting)
    got = w0 + torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num)).numpy()
    want = w0.copy()
    for i in range(items):  # the paper's Alg. 3, literally: w = sum_k q^k w^k / sum_k q^k over I_k
        for j in range(dim):
            q = [abs(delta[k, i, j]) if weighting == "component" else np.abs(delta[k, i]).sum() for k in range(clients)]
            changed = [k for k in range(clients) if touched[k, i] and q[k] > 0]
            if changed:
                want[i, j] = sum(q[k] * (w0[i, j] + delta[k, i, j]) for k in changed) / sum(q[k] for k in changed)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_actvagg_toy_cases_notes_f10():
    d = torch.tensor([[0.3, -0.2], [-0.3, 0.0], [0.1, 0.5]], dtype=torch.float64)
    num, den = actvagg_sums(np.array([0, 0, 1]), d, 3)
    change = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))
    # item 0, component 0: equal and opposite -> unchanged; component 1: a single changer -> copied
    assert change[0, 0] == 0 and math.isclose(change[0, 1], -0.2)
    assert torch.allclose(change[1], d[2], rtol=1e-15, atol=0)  # one delegate: its value is copied, no dilution
    assert torch.equal(change[2], torch.zeros(2))  # nobody touched item 2
    num, den = actvagg_sums(np.array([0, 0]), torch.tensor([[0.2], [0.4]], dtype=torch.float64), 1)
    assert math.isclose(float(num / den), (0.2**2 + 0.4**2) / 0.6)


def test_a_round_applies_actvagg_to_what_the_server_received():
    train = data()
    m = FedFastGMF(train, small(), seed=3, transport=InProcessTransport(Transcript(keep_payloads=True)))
    m.run_round()
    before = model_of(m)
    m.run_round()
    ups = [r.payload for r in m.transport.transcript.view(SERVER, round=1, kind="update")]
    assert len(ups) == 8 and all(isinstance(u, ClientUpdate) and u.user_embedding is not None for u in ups)
    want = before["item"].double().numpy().copy()
    num, den = np.zeros_like(want), np.zeros_like(want)
    for u in ups:  # per-client loop over the uploads
        for r, row in zip(u.rows, u.item_delta):
            num[r] += np.abs(row) * row
            den[r] += np.abs(row)
    want += np.divide(num, den, out=np.zeros_like(num), where=den > 0)
    np.testing.assert_allclose(m.item.numpy(), want, atol=1e-6)
    w = np.array([u.weight for u in ups])
    np.testing.assert_allclose(m.h.numpy(), before["h"].numpy() + sum(u.weight * u.h_delta for u in ups) / w.sum(), atol=1e-6)
    for u in ups:  # delegates keep their own new user embedding
        np.testing.assert_allclose(m.user[u.user].numpy(), u.user_embedding, atol=0)


def test_changed_set_is_exactly_the_items_in_the_clients_batches_notes_a3():
    train = data(seed=1)
    m = FedFastGMF(train, small(local_epochs=2, train_negatives=3), seed=5,
                   transport=InProcessTransport(Transcript(keep_payloads=True)))
    seen = {}
    original = m._local_data

    def spy(sampled):
        counts, epochs = original(sampled)
        for slots, items, _ in epochs:
            for c, u in enumerate(sampled):
                seen.setdefault(int(u), set()).update(items[slots == c].tolist())
        return counts, epochs

    m._local_data = spy
    m.run_round()
    ups = m.transport.transcript.view(SERVER, round=0, kind="update")
    assert len(ups) == 8
    for r in ups:
        u = r.payload
        changed = set(u.rows[np.abs(u.item_delta).sum(1) > 0].tolist())
        assert changed == seen[u.user]  # I_k = positives and sampled negatives, nothing else
        assert (np.abs(u.item_delta) > 0).all()  # lazy Adam moves every component of a touched row


# -- subordinate propagation and k-means --------------------------------------------------------------
def test_subordinates_move_by_the_discounted_cluster_mean_notes_f11():
    user = torch.zeros(5, 2)
    assign = np.array([0, 0, 0, 1, -1])  # 0, 1 delegates of cluster 0; 2 subordinate; 3 alone; 4 no client
    a, b = np.array([1.0, 2.0]), np.array([3.0, -2.0])
    sums = np.array([a + b, [0.0, 0.0]])
    out = propagate_to_subordinates(user, assign, np.array([0, 1]), sums, np.array([2.0, 0.0]), 1.0)
    np.testing.assert_allclose(out[2].numpy(), (a + b) / 2)
    assert torch.equal(out[:2], user[:2])  # delegates untouched here
    assert torch.equal(out[3], user[3]) and torch.equal(out[4], user[4])  # no delegate in cluster 1: skipped
    out = propagate_to_subordinates(user, assign, np.array([0, 1]), sums, np.array([2.0, 0.0]), math.exp(-1))
    np.testing.assert_allclose(out[2].numpy(), 0.36787944 * (a + b) / 2, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.integers(1, 3), st.integers(0, 10**6))
def test_kmeans_pieces_against_loops_and_empty_clusters(n, p, f, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, f))
    assign = rng.integers(p, size=n)
    sums, counts = cluster_sums(x, assign, p)
    for c in range(p):
        np.testing.assert_allclose(sums[c], x[assign == c].sum(0), atol=1e-12)
        assert counts[c] == (assign == c).sum()
    prev = rng.normal(size=(p, f))
    cent = update_centroids(sums, counts, prev)
    for c in range(p):  # an empty cluster keeps its previous centroid
        np.testing.assert_allclose(cent[c], x[assign == c].mean(0) if counts[c] else prev[c])
    fresh = update_centroids(sums, counts, None)  # no previous centroid in this space: NaN, never chosen
    assert np.isnan(fresh[counts == 0]).all()
    new = assign_clusters(x, fresh)
    assert set(new.tolist()) <= set(np.flatnonzero(counts).tolist())
    dist = ((x[:, None] - cent[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(assign_clusters(x, cent), dist.argmin(1))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.integers(1, 40), st.integers(0, 10**6))
def test_round_robin_sampling_is_stratified_notes_f12(n, p, m, seed):
    rng = np.random.default_rng(seed)
    assign = rng.integers(p, size=n)
    m = min(m, n)
    pick = round_robin_sample(assign, m, rng)
    assert len(pick) == m == len(np.unique(pick))
    sizes = np.bincount(assign, minlength=p)
    got = np.bincount(assign[pick], minlength=p)
    # round-robin: a cluster that still has undrawn members is never two draws behind another one
    for c in np.flatnonzero(got < sizes):
        assert (got <= got[c] + 1).all(), (got, sizes)


def test_without_replacement_spreads_the_load_evenly():
    assign = np.repeat(np.arange(3), 6)
    rng, load = np.random.default_rng(0), np.zeros(18, np.int64)
    for _ in range(6):  # 6 rounds x 6 clients = every client exactly twice
        load[round_robin_sample(assign, 6, rng, load)] += 1
    assert (load == 2).all()


# -- the protocol ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("agg", ["mean", "touched", "sum"])
def test_the_fedavg_preset_is_fedavg_with_the_same_clients(agg):
    """sampling = uniform, aggregation = fedavg, user_update = copy: exactly FedAvgGMF."""
    train = data(seed=2)
    ff = FedFastGMF(train, small(sampling="uniform", aggregation="fedavg", item_aggregation=agg), seed=7)
    fa_cfg = FedAvgConfig(**{f.name: getattr(ff.config, f.name) for f in dataclasses.fields(FedAvgConfig)})
    fa = FedAvgGMF(train, fa_cfg, seed=7)
    for _ in range(3):
        ff.run_round(), fa.run_round()
    for k, v in model_of(fa).items():
        assert torch.equal(model_of(ff)[k], v), k


def test_literal_average_dilutes_the_delegates_user_embedding_notes_a6():
    train = data(seed=2)
    copy = FedFastGMF(train, small(sampling="uniform", aggregation="fedavg"), seed=7)
    avg = FedFastGMF(train, small(sampling="uniform", aggregation="fedavg", user_update="average"), seed=7)
    u0 = copy.user.clone()
    copy.run_round(), avg.run_round()
    moved = (copy.user - u0).abs().sum(1) > 0
    assert moved.sum() == 8
    ratio = ((avg.user - u0)[moved] / (copy.user - u0)[moved]).numpy()
    assert (ratio > 0).all() and (ratio < 1).all()  # n_k / n_sigma of the change


@pytest.mark.parametrize("kw", [{}, {"sampling": "uniform"}, {"aggregation": "fedavg"},
                                {"item_weighting": "row", "without_replacement": True, "initial_features": "random"}])
def test_same_seed_same_model_and_resume_from_state(kw):
    train = data(seed=4)
    full = FedFastGMF(train, small(**kw), seed=11)
    for _ in range(4):
        full.run_round()
    part = FedFastGMF(train, small(**kw), seed=11)
    part.run_round()
    state = part.state_dict()
    resumed = FedFastGMF(train, small(**kw), seed=999)
    resumed.load_state_dict(state)
    for _ in range(3):
        resumed.run_round()
    for k, v in model_of(full).items():
        assert torch.equal(model_of(resumed)[k], v), k
    np.testing.assert_array_equal(resumed.assign, full.assign)
    with pytest.raises(ValueError, match="different fedfast configuration"):
        FedFastGMF(train, small(clusters=2), seed=1).load_state_dict(state)


def test_active_sampling_draws_evenly_from_the_clusters():
    train = data(users=60, seed=5)
    m = FedFastGMF(train, small(clusters=4, clients_per_round=8), seed=2,
                   transport=InProcessTransport(Transcript(keep_payloads=True)))
    m.run_round()  # round 0 clusters on the profile statistics first
    for t in range(1, 4):
        before = m.assign.copy()
        m.run_round()
        drawn = np.array([r.payload.user for r in m.transport.transcript.view(SERVER, round=t, kind="update")])
        sizes = np.bincount(before[m._clients], minlength=4)
        got = np.bincount(before[drawn], minlength=4)
        assert (got[sizes >= 2] == 2).all(), (got, sizes)


@pytest.mark.parametrize("kwargs, message", [
    ({"clusters": 0}, "fedfast.clusters"),
    ({"sampling": "greedy"}, "fedfast.sampling"),
    ({"item_weighting": "l2"}, "fedfast.item_weighting"),
    ({"gamma_rate": -1.0}, "fedfast.gamma_rate"),
    ({"lr": 0.0}, "fedfast.lr"),
    ({"kmeans_iters": -1}, "fedfast.kmeans_iters"),
    ({"kmeans_every": 0}, "fedfast.kmeans_every"),
])
def test_bad_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FedFastConfig(**kwargs)


# -- the secure variant -----------------------------------------------------------------------------------
@settings(max_examples=3, deadline=None)
@given(st.integers(0, 10**4), st.sampled_from(["component", "row"]), st.sampled_from(["secagg", "secagg+"]))
def test_secure_variant_gives_the_plaintext_model(seed, weighting, protocol):
    train = data(users=24, items=30, seed=seed % 7)
    cfg = dict(clients_per_round=6, clusters=3, item_weighting=weighting, kmeans_init_iters=1)
    plain = FedFastGMF(train, small(**cfg), seed=seed)
    secure = FedFastGMF(train, small(secure_aggregation=protocol, **cfg), seed=seed)
    for _ in range(2):
        plain.run_round(), secure.run_round()
        np.testing.assert_array_equal(secure.assign, plain.assign)
    for k, v in model_of(plain).items():
        np.testing.assert_allclose(model_of(secure)[k].numpy(), v.numpy(), atol=2e-5, err_msg=k)


def test_secure_server_sees_no_embedding_no_statistic_and_no_single_update():
    train = data(users=24, items=30)
    m = FedFastGMF(train, small(secure_aggregation="secagg+", clients_per_round=6, clusters=3),
                   seed=1, transport=InProcessTransport(Transcript(keep_payloads=True)))
    m.run_round()
    view = m.transport.transcript.view(SERVER)
    kinds = {r.kind for r in view if r.receiver == SERVER}
    assert {"update", "fedfast:kmeans", "fedfast:kmeans-profile", "fedfast:delegate-change",
            "fedfast:popularity"} <= kinds
    assert "fedfast:profile" not in kinds
    for r in view:
        if r.receiver == SERVER and r.payload is not None:  # only masked ring elements reach the server
            assert isinstance(r.payload, np.ndarray) and r.payload.dtype == np.uint64, r.kind
    plain = FedFastGMF(train, small(clients_per_round=6, clusters=3), seed=1,
                       transport=InProcessTransport(Transcript(keep_payloads=True)))
    plain.run_round()
    kinds = {r.kind for r in plain.transport.transcript.view(SERVER) if r.receiver == SERVER}
    assert "fedfast:profile" in kinds and "fedfast:kmeans" not in kinds  # the plaintext server clusters itself


def test_secure_budget_counts_every_client_of_the_kmeans_sums():
    with pytest.raises(ValueError, match="frac_bits|clip|budget"):
        FedFastGMF(data(), small(secure_aggregation="secagg", value_clip=2.0**30), seed=0)


# -- the initial clustering: one sum fewer, a convergence stop, fewer re-clusterings ------------------
def _standardised_profile(m: FedFastGMF) -> np.ndarray:
    """Oracle: the clients' profile statistics standardised by their population mean and std (numpy)."""
    x = m._profile_features(0)
    return (x - x.mean(0)) / x.std(0)


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 10**4))
def test_initial_kmeans_reaches_a_lloyd_fixed_point_of_the_standardised_statistics(seed):
    m = FedFastGMF(data(users=50, seed=seed % 5), small(clusters=4, kmeans_init_iters=200), seed=seed)
    m._initial_clusters(0)
    assert 1 <= m.kmeans_steps < 200  # converged and stopped early
    x, a = _standardised_profile(m), m.assign[m._clients]
    means = np.stack([x[a == c].mean(0) if (a == c).any() else np.full(x.shape[1], np.inf) for c in range(4)])
    d = ((x[:, None, :] - means[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(a, np.argmin(d, 1))  # every client is in its nearest cluster mean's cluster


def test_the_convergence_stop_changes_nothing_but_the_number_of_sums():
    train = data(users=30, seed=3)
    runs = {}
    for iters in (40, 80):
        m = FedFastGMF(train, small(clusters=3, kmeans_init_iters=iters), seed=5)
        runs[iters] = (m, m.run_round())
    (a, sa), (b, sb) = runs[40], runs[80]
    assert sa.extra["kmeans_steps"] == sb.extra["kmeans_steps"] < 40
    np.testing.assert_array_equal(a.assign, b.assign)
    for k, v in model_of(a).items():
        assert torch.equal(model_of(b)[k], v), k


def test_secure_round_zero_runs_one_sum_per_start_cluster_for_the_first_step_and_the_moments():
    """Round 0 under secure aggregation: the popularity (one all-client sum) and one Lloyd step on
    the profile statistics, one sum per start cluster that carries the moments too (no separate
    moments sum); then the round's step on the embeddings, one sum per cluster."""
    m = FedFastGMF(data(users=16, seed=3), small(clusters=2, secure_aggregation="secagg+"), seed=5)
    stats = m.run_round()
    assert stats.extra["kmeans_steps"] == 1 + 1  # the profile step (one per instance), the embedding step
    kinds = [r.kind for r in m.transport.transcript.view(SERVER, round=0) if r.receiver == SERVER]
    n = len(m._clients)
    assert kinds.count("fedfast:popularity") == n and "fedfast:moments" not in kinds
    assert kinds.count("fedfast:kmeans-profile") == n and kinds.count("fedfast:kmeans") == n  # one upload each


@pytest.mark.parametrize("key", ["kmeans_iters", "kmeans_init_iters"])
def test_secure_aggregation_refuses_more_than_one_lloyd_step_per_sum_in_words(key):
    """Successive Lloyd steps over the same points would hand the server every point that switched
    cluster between them (and a client answers each secure step once per round)."""
    with pytest.raises(ValueError, match=f"fedfast.{key} = 2 with secure aggregation: set it to 1"):
        small(secure_aggregation="secagg+", **{key: 2})
    assert small(**{key: 2}).init_iters == (2 if key == "kmeans_init_iters" else 10)  # plaintext: as configured
    assert small(secure_aggregation="secagg").init_iters == 1  # the default under secure aggregation


def test_kmeans_every_skips_the_reclustering_rounds():
    m = FedFastGMF(data(users=30, seed=2), small(clusters=3, kmeans_init_iters=2, kmeans_every=3), seed=1)
    steps = [m.run_round().extra["kmeans_steps"] for _ in range(4)]
    assert steps[1:] == [0, 0, 1] and steps[0] >= 2  # round 0: initial steps + 1; then every third round


def test_round_robin_sampling_draws_clients_without_a_cluster_as_one_more_cluster():
    """Clients that never reported a cluster (-1) are drawn, as one group, instead of crashing the
    server (a round where every client refused the assigning step)."""
    rng = np.random.default_rng(0)
    pick = round_robin_sample(np.full(5, -1), 3, rng)
    assert len(pick) == 3 and len(set(pick.tolist())) == 3 and pick.max() < 5
    pick = round_robin_sample(np.array([0, 0, -1, -1, 1, 1]), 3, rng)
    groups = {int(np.array([0, 0, -1, -1, 1, 1])[i]) for i in pick}
    assert len(pick) == 3 and groups == {0, -1, 1}  # one from each of the three groups
