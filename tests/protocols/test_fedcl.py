"""FedCL: the LDP upload (L1 clip, then Laplace(2 clip / eps) from the CSPRNG), clustering and the
top-R% semi-hard selection against direct oracles, the client's own-item filter, Eq. (1) against a
per-client loop, the per-user ledger, the upload policy, secure == plaintext, and resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dp.clipping import clip_rows_l1
from dp.events import Laplace, NonPrivate
from dp.ledger import PrivacyLedger
from dp.rng import DeterministicTestSource
from protocols.fedcl import CentralSeqRec, FedCL, FedCLConfig
from protocols.fedcl_server import cluster_centroids, hard_candidates, per_user_report, sample_semi_hard
from protocols.state import state_from_bytes, state_to_bytes
from protocols.transport import SERVER, InProcessTransport, Transcript
from recmodels.seqrec import PerRowTable, client_sequences, contrastive_loss
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic

SMALL = dict(dim=16, max_len=12, clients_per_round=8, clusters=4, semi_hard=6, local_pool=20, local_negatives=3)


def split(n_users: int = 60, n_items: int = 120, seed: int = 0):
    return leave_one_out(generate_synthetic(n_users=n_users, n_items=n_items, mean_interactions=12, seed=seed), seed=0)


def make(cfg: dict | None = None, *, n_users: int = 60, keep: bool = False, source: int | None = None, **kw) -> FedCL:
    c = FedCLConfig(**{**SMALL, "secure_aggregation": "none", **(cfg or {})})
    return FedCL(split(n_users).train, c, seed=kw.get("seed", 0), transport=InProcessTransport(Transcript(keep_payloads=keep)),
                 _test_source=None if source is None else DeterministicTestSource(source))


# -- the LDP upload ------------------------------------------------------------------------------
def test_uploads_are_l1_clipped_embeddings_plus_laplace_of_scale_2_clip_over_epsilon():
    fc = make({"dim": 32, "epsilon": 2.0, "clip": 0.5}, n_users=200, keep=True)
    with torch.no_grad():
        clean = fc.user_embeddings(np.arange(200)).double().numpy()
    fc.run_round()  # round 0: every client uploads before the model changes
    ups = {int(r.sender.split(":")[1]): r.payload for r in fc.transport.transcript.view(SERVER, kind="embedding")}
    assert sorted(ups) == list(range(200))
    noise = np.stack([ups[u] for u in range(200)]) - clip_rows_l1(clean, 0.5)[0]
    b = 2 * 0.5 / 2.0
    assert abs(np.abs(noise).mean() - b) < 0.05 * b  # 6400 draws: E|n| = b
    assert abs(noise.std() - np.sqrt(2) * b) < 0.06 * np.sqrt(2) * b
    assert abs(noise.mean()) < 0.05 * b


def test_clip_is_l1_on_the_whole_vector_never_per_coordinate():
    """With negligible noise the upload is clip_L1(u, delta): L1 norm delta, the direction of u."""
    fc = make({"epsilon": 1e9, "clip": 0.01}, keep=True)
    with torch.no_grad():
        clean = fc.user_embeddings(np.arange(60)).double().numpy()
    fc.run_round()
    ups = np.stack([r.payload for r in sorted(fc.transport.transcript.view(SERVER, kind="embedding"),
                                              key=lambda r: int(r.sender.split(":")[1]))])
    assert np.abs(clean).sum(1).min() > 0.01  # every raw embedding is clipped
    np.testing.assert_allclose(np.abs(ups).sum(1), 0.01, rtol=1e-6)
    np.testing.assert_allclose(ups, clean * (0.01 / np.abs(clean).sum(1, keepdims=True)), atol=1e-7)


def test_noise_comes_from_the_csprng_not_the_seed():
    a, b = make(keep=True), make(keep=True)
    a.run_round(), b.run_round()
    ua = [r.payload for r in a.transport.transcript.view(SERVER, kind="embedding")]
    ub = [r.payload for r in b.transport.transcript.view(SERVER, kind="embedding")]
    assert not np.allclose(ua[0], ub[0])  # same seed, fresh noise


# -- clustering and semi-hard selection ------------------------------------------------------------
def _ward_oracle(x: np.ndarray, k: int) -> list[frozenset]:
    """Naive Ward: merge the pair with the smallest increase in within-cluster SSE until k remain."""
    clusters = [[i] for i in range(len(x))]
    while len(clusters) > k:
        best = None
        for i in range(len(clusters)):
            for j in range(i + 1, len(clusters)):
                a, b = x[clusters[i]], x[clusters[j]]
                cost = len(a) * len(b) / (len(a) + len(b)) * np.sum((a.mean(0) - b.mean(0)) ** 2)
                if best is None or cost < best[0]:
                    best = (cost, i, j)
        _, i, j = best
        clusters[i] = clusters[i] + clusters[j]
        del clusters[j]
    return sorted(frozenset(c) for c in clusters)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(4, 14), k=st.integers(2, 4), d=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_ward_partition_and_centroids_match_a_direct_oracle(n, k, d, seed):
    x = np.random.default_rng(seed).normal(size=(n, d))
    cent, labels = cluster_centroids(x, k, "ward", np.random.default_rng(0))
    got = sorted(frozenset(np.flatnonzero(labels == c).tolist()) for c in np.unique(labels))
    assert got == sorted(_ward_oracle(x, k), key=lambda s: sorted(s)) or set(got) == set(_ward_oracle(x, k))
    for c in np.unique(labels):
        np.testing.assert_allclose(cent[labels == c], np.broadcast_to(x[labels == c].mean(0), cent[labels == c].shape))


def test_kmeans_and_none_options():
    x = np.concatenate([np.random.default_rng(0).normal(size=(20, 3)) + off for off in (0, 20, 40)])
    cent, labels = cluster_centroids(x, 3, "kmeans", np.random.default_rng(1))
    assert len(np.unique(labels)) == 3 and all(len(np.unique(labels[i * 20:(i + 1) * 20])) == 1 for i in range(3))
    np.testing.assert_array_equal(cluster_centroids(x, 3, "none", np.random.default_rng(1))[0], x)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 5), n_items=st.integers(1, 60), d=st.integers(1, 6), percent=st.floats(0.5, 100),
       t=st.integers(1, 25), seed=st.integers(0, 2**32 - 1))
def test_semi_hard_negatives_come_from_the_top_r_percent(m, n_items, d, percent, t, seed):
    rng = np.random.default_rng(seed)
    cent, item = rng.normal(size=(m, d)), rng.normal(size=(n_items, d))
    k = max(1, int(np.ceil(percent / 100 * n_items - 1e-9)))
    cands = hard_candidates(cent, item, percent)
    neg = sample_semi_hard(cands, t, "sample", rng)
    hardest = sample_semi_hard(cands, t, "hardest", rng)
    for c in range(m):
        scores = [float(np.dot(cent[c], item[i])) for i in range(n_items)]  # direct, item by item
        top = sorted(range(n_items), key=lambda i: (-scores[i], i))[:k]
        assert set(neg[c]) <= set(top) and len(set(neg[c])) == len(neg[c]) == min(t, k)
        assert list(hardest[c]) == top[: min(t, k)]


def test_semi_hard_sampling_is_independent_per_client():
    cands = np.tile(np.arange(50), (200, 1))
    neg = sample_semi_hard(cands, 5, "sample", np.random.default_rng(0))
    assert len({tuple(sorted(r)) for r in neg}) > 190


def test_client_drops_negatives_from_its_own_history():
    fc = make({"hard_percent": 100.0, "semi_hard": 60}, keep=True)  # negatives cover half the items
    stats = fc.run_round()
    train = fc.train
    sent = {int(r.receiver.split(":")[1]): r.payload for r in fc.transport.transcript.view(kind="negatives")}
    assert len(sent) == 8 and all(len(v) == 60 for v in sent.values())  # the server sent them; the client filters
    users = np.array(sorted(sent))
    neg, kept, dropped = fc._client_negatives(users, {u: {"negatives": sent[u]} for u in users})
    own = {u: set(train.items[train.users == u].tolist()) for u in users}
    expected = np.array([[int(i) not in own[u] for i in sent[u]] for u in users])
    np.testing.assert_array_equal(neg, np.stack([sent[u] for u in users]))
    np.testing.assert_array_equal(kept, expected)
    assert (~kept).any() and dropped.tolist() == (~expected).sum(1).tolist()
    assert stats.extra["semi_hard_dropped"] == int((~expected).sum())  # the clients' counts, summed


# -- Eq. (1) ---------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 3), p=st.integers(1, 5), k=st.integers(0, 3), t=st.integers(0, 4),
       in_batch=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_contrastive_loss_matches_a_per_positive_loop(m, p, k, t, in_batch, seed):
    rng = np.random.default_rng(seed)
    n_items, d = 8, 3
    item = torch.as_tensor(rng.normal(size=(n_items, d)))
    u = torch.as_tensor(rng.normal(size=(m, p, d)))
    pos = torch.as_tensor(rng.integers(0, n_items, (m, p)))
    mask = torch.as_tensor(rng.random((m, p)) < 0.8)
    local = torch.as_tensor(rng.integers(0, n_items, (m, p, k)))
    hard = torch.as_tensor(rng.integers(0, n_items, (m, t)))
    hmask = torch.as_tensor(rng.random((m, t)) < 0.7)
    got = contrastive_loss(u, pos, mask, item, local_neg=local, hard_neg=hard, hard_mask=hmask, in_batch=in_batch)
    for c in range(m):
        terms = []
        for j in range(p):
            if not mask[c, j]:
                continue
            negs = [int(x) for x in local[c, j]] + [int(hard[c, i]) for i in range(t) if hmask[c, i]]
            if in_batch:
                negs += [int(pos[c, i]) for i in range(p) if i != j and mask[c, i] and pos[c, i] != pos[c, j]]
            s = [float(u[c, j] @ item[pos[c, j]])] + [float(u[c, j] @ item[i]) for i in negs]
            terms.append(np.log(np.sum(np.exp(s))) - s[0])
        want = np.mean(terms) if terms else 0.0
        assert float(got[c]) == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_client_sequences_keep_the_latest_items_in_time_order():
    users = np.array([0, 0, 0, 1, 0, 1])
    items = np.array([5, 6, 7, 8, 9, 4])
    ts = np.array([3, 1, 2, 9, 4, 1])
    seqs, lengths = client_sequences(users, items, ts, 3, 3)
    np.testing.assert_array_equal(seqs, [[7, 5, 9], [4, 8, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(lengths, [3, 2, 0])


# -- accounting and the upload policy --------------------------------------------------------------
def _commit(tmp_path, fc: FedCL, rounds: int) -> PrivacyLedger:
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", neighboring_relation="replace_one")
    for _ in range(rounds):
        stats = fc.run_round()
        with ledger.round(stats.round) as rnd:
            for r in stats.releases:
                rnd.record(r.event, who=r.who, what=r.what, params=r.params, cohort=r.cohort)
    return ledger


def test_every_upload_is_one_ledger_entry_of_its_user(tmp_path):
    fc = make({"epsilon": 2.0})
    ledger = _commit(tmp_path, fc, 5)
    per = {}
    for e in ledger.entries():
        if e.cohort:
            assert isinstance(e.event, Laplace) and e.event.epsilon0 == pytest.approx(2.0) and e.who == f"client:{e.cohort[5:]}"
            per[int(e.cohort[5:])] = per.get(int(e.cohort[5:]), 0) + 1
        else:
            assert isinstance(e.event, NonPrivate)  # the model updates: no DP, said so
    np.testing.assert_array_equal([per.get(u, 0) for u in range(60)], fc.uploads)
    assert fc.uploads.sum() == 60 + 4 * 8  # round 0: everyone; then the sampled clients
    rep = per_user_report(ledger, 1e-5)["per_user"]
    assert rep["users"] == 60 and rep["uploads"]["max"] == fc.uploads.max()
    assert rep["epsilon_basic"]["max"] == pytest.approx(2.0 * fc.uploads.max())
    assert rep["epsilon"]["max"] <= rep["epsilon_basic"]["max"] + 1e-9


def test_upload_every_m_rounds_and_the_user_budget():
    fc = make({"upload_every": 3, "clients_per_round": 30, "encoder": "id"})  # the policy is the encoder's business
    seen: dict[int, list[int]] = {}
    for _ in range(7):
        before = fc.last_upload.copy()
        fc.run_round()
        for u in np.flatnonzero(fc.last_upload != before):
            seen.setdefault(int(u), []).append(int(fc.last_upload[u]))
    assert all(np.all(np.diff(r) >= 3) for r in seen.values())
    fb = make({"user_budget": 8.0, "epsilon": 4.0, "clients_per_round": 40, "encoder": "id"})
    for _ in range(6):
        fb.run_round()
    assert fb.uploads.max() == 2 and fb.has_cache.all()


def test_fed_baseline_uploads_nothing():
    fc = make({"semi_hard": 0, "in_batch": False}, keep=True)
    stats = fc.run_round()
    assert not fc.transport.transcript.view(SERVER, kind="embedding")
    assert all(r.cohort is None for r in stats.releases)


@pytest.mark.parametrize("kwargs, message", [
    ({"encoder": "bert"}, "fedcl.encoder"), ({"clustering": "dbscan"}, "fedcl.clustering"),
    ({"epsilon": 0}, "fedcl.epsilon"), ({"hard_percent": 0}, "fedcl.hard_percent"),
    ({"user_budget": 1.0}, "fedcl.user_budget"), ({"local_pool": 0}, "fedcl.local_pool"),
    ({"secure_aggregation": "he"}, "fedcl.secure_aggregation"),
    ({"heads": 3}, "fedcl.heads"), ({"dropout": 1.0}, "fedcl.dropout"), ({"logq": 1}, "fedcl.logq"), ({"logq_semihard": "no"}, "fedcl.logq_semihard"),
    ({"blocks": 0}, "fedcl.blocks"),
])
def test_bad_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FedCLConfig(**kwargs)


# -- secure aggregation and resume -----------------------------------------------------------------
@pytest.mark.parametrize("encoder", ["gru", "id", "sasrec"])
def test_secure_aggregate_equals_the_plaintext_one(encoder):
    extra = {"dropout": 0.2, "logq": True} if encoder == "sasrec" else {}
    plain = make({"encoder": encoder, **extra}, source=7)
    sec = make({"encoder": encoder, "secure_aggregation": "secagg+", **extra}, source=7)
    for _ in range(2):
        plain.run_round(), sec.run_round()
        tol = 8 * 2.0**-25 + 1e-12  # each of the 8 summands rounded to 2^-24, then divided by 8
        assert np.abs(plain.last_aggregate - sec.last_aggregate).max() <= tol
        assert np.abs(plain.last_aggregate).max() > 1e-3  # a real gradient, not zeros
    masked = [r for r in sec.transport.transcript.view(SERVER, kind="update")]
    assert len(masked) == 16 and all(r.payload is None for r in masked)


@pytest.mark.parametrize("encoder", ["gru", "id", "sasrec"])
@pytest.mark.parametrize("dense", [True, False])
def test_client_gradients_widen_in_place_as_cat_then_double(encoder, dense):
    """The per-client gradients are written straight into one float64 array (``extra`` zero columns
    left for the secure vector's loss and count): bit for bit the old ``torch.cat(...).double()``
    of the dense copies' gradients; with the sparse item table (PerRowTable), the other parameters'
    columns the same and the item columns each read row's float32 gradient widened and added
    (float64) at (client, item id), zeros elsewhere."""
    fc = make({"encoder": encoder, **({"dropout": 0.2} if encoder != "id" else {})})
    users = np.sort(np.asarray(fc._clients[:5], np.int64))
    m, names = len(users), fc._names()
    losses, rows, w = fc.client_losses(users, None, None, t=0, _dense_items=dense)
    assert isinstance(w["item"], PerRowTable) != dense
    table = None if dense else w["item"]
    leaves = [w[n] if n != "item" or dense else None for n in names]
    dense_leaves = [x for x in leaves if x is not None]
    extra_leaves = table.leaves() if table is not None else []
    grads = torch.autograd.grad(losses.sum(), dense_leaves + extra_leaves + ([rows] if rows is not None else []))
    it = iter(grads[: len(dense_leaves)])
    item_cols = fc.model.item.numel()
    parts = [next(it).reshape(m, -1) if x is not None else torch.zeros(m, item_cols) for x in leaves]
    want = torch.cat(parts, dim=1).double().numpy()
    if table is not None:  # the reads' gradients, added by (client, id) in float64 in the order read
        item = want[:, :item_cols].reshape(m, *fc.model.item.shape)
        for (owner, ids, _), g in zip(table.reads, grads[len(dense_leaves) : len(dense_leaves) + len(extra_leaves)]):
            np.add.at(item, (owner.numpy(), ids.numpy()), g.reshape(len(ids), -1).double().numpy())
        want[:, :item_cols] = item.reshape(m, -1)
        assert names[0] == "item" and np.count_nonzero(item.any(-1)) < item.shape[1] * m  # sparse: unread rows stay 0
    for extra in (0, 2):
        losses, rows, w = fc.client_losses(users, None, None, t=0, _dense_items=dense)
        got, got_rows = fc.client_gradients(losses, rows, w, extra=extra)
        assert got.dtype == np.float64 and got.shape == (m, want.shape[1] + extra)
        np.testing.assert_array_equal(got[:, : want.shape[1]], want)
        assert not got[:, want.shape[1]:].any()
        if rows is not None:
            torch.testing.assert_close(got_rows, grads[-1], rtol=0, atol=0)


@pytest.mark.parametrize("encoder", ["gru", "id", "sasrec"])
def test_resume_from_state_equals_the_uninterrupted_run(encoder):
    cfg = {"encoder": encoder, **({"dropout": 0.2} if encoder != "id" else {})}  # dropout masks come from the state
    whole = make(cfg, source=3)
    for _ in range(4):
        whole.run_round()
    part = make(cfg, source=3)
    part.run_round(), part.run_round()
    state = state_from_bytes(state_to_bytes(part.state_dict()))
    resumed = make(cfg)
    resumed._test_source = part._test_source  # the test noise stream continues (real noise never repeats)
    resumed.load_state_dict(state)
    resumed.run_round(), resumed.run_round()
    for a, b in zip(whole.state_dict()["model"].values(), resumed.state_dict()["model"].values()):
        assert torch.equal(a, b)
    np.testing.assert_array_equal(whole.cache, resumed.cache)
    np.testing.assert_array_equal(whole.score_all(np.arange(5)), resumed.score_all(np.arange(5)))


def test_training_improves_the_ranking_and_central_runs():
    data = split(80, 100, seed=1)
    # (TEST-ONLY reproducible LDP noise: with the OS CSPRNG's the margin varies from run to run)
    from dp.rng import DeterministicTestSource

    fc = FedCL(data.train, FedCLConfig(**{**SMALL, "secure_aggregation": "none", "lr": 0.03, "max_len": 8}), seed=0,
               _test_source=DeterministicTestSource(7))
    from recmodels.metrics import evaluate_full
    before = evaluate_full(fc.score_all, data, ks=(10,))["HR@10"]
    for _ in range(12):
        fc.run_round()
    assert evaluate_full(fc.score_all, data, ks=(10,))["HR@10"] > before
    central = CentralSeqRec(data.train, FedCLConfig(**{**SMALL, "lr": 0.02, "max_len": 8, "clients_per_round": 40}), seed=0)
    stats = central.run_round()
    assert central.transport is None and stats.extra["users"] == 80


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 4), length=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_batched_gru_equals_torch_gru_and_per_row_weights_give_each_rows_gradient(b, length, seed):
    from recmodels.seqrec import SeqEncoder

    rng = np.random.default_rng(seed)
    enc = SeqEncoder(9, 4, generator=torch.Generator().manual_seed(seed % 1000)).double()
    seqs = torch.as_tensor(rng.integers(0, 9, (b, length)))
    lengths = torch.as_tensor(rng.integers(1, length + 1, b))
    ours = enc.states(seqs, lengths)
    for r in range(b):
        ref, _ = enc.gru(enc.item[seqs[r, : lengths[r]]].unsqueeze(0))
        torch.testing.assert_close(ours[r, : lengths[r]], ref[0])
    w = enc.per_row_weights(b, ("item", "weight_hh"))
    (ours_sum := enc.states(seqs, lengths, w).sum(dim=(1, 2))).sum().backward()
    for r in range(b):
        enc.zero_grad()
        enc.states(seqs[r : r + 1], lengths[r : r + 1]).sum().backward()
        torch.testing.assert_close(w["item"].grad[r], enc.item.grad)
        torch.testing.assert_close(w["weight_hh"].grad[r], enc.gru.weight_hh_l0.grad)
    assert ours_sum.shape == (b,)


def test_per_row_table_slices_keep_their_row_numbers_and_the_full_softmax_refuses_it():
    """A slice ``table[c : c + 1]`` (the per-client dropout path) records its reads under row ``c``
    of the whole; gradients scatter to (row, id) with repeats added; the full softmax, which reads
    every row, refuses a PerRowTable rather than reading it wrongly."""
    from recmodels.seqrec import gather_rows

    base = torch.randn(7, 3)
    table = PerRowTable(base, 4)
    assert table.shape == (4, 7, 3) and table.dim() == 3
    a = gather_rows(table[2:3], torch.tensor([[5, 5, 1]]))  # row 2 reads item 5 twice
    b = gather_rows(table, torch.tensor([[0], [1], [2], [6]]))
    torch.testing.assert_close(a[0], base[[5, 5, 1]])
    ga, gb = torch.ones_like(a), torch.full_like(b, 2.0)
    out = torch.zeros(4, 7, 3, dtype=torch.float64)
    table.scatter_into(out, [ga, gb])
    want = torch.zeros(4, 7, 3, dtype=torch.float64)
    want[2, 5], want[2, 1] = 2.0, 1.0
    want[0, 0], want[1, 1], want[2, 2], want[3, 6] = 2.0, 2.0, 2.0, 2.0
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="indices of shape"):
        gather_rows(table, torch.tensor([[0], [1]]))
    with pytest.raises(TypeError):
        table[0]
    with pytest.raises(ValueError, match="full softmax"):
        contrastive_loss(torch.randn(4, 2, 3), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool),
                         table, full_softmax=True)


@settings(max_examples=40, deadline=None)
@given(encoder=st.sampled_from(["gru", "id", "sasrec"]), n_users=st.integers(12, 30), n_items=st.integers(40, 90),
       max_len=st.integers(2, 7), local=st.sampled_from([0, 3]), semi_hard=st.sampled_from([0, 5]),
       in_batch=st.booleans(), dropout=st.sampled_from([0.0, 0.3]), logq=st.booleans(),
       full_softmax=st.booleans(), m=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_sparse_item_gradients_equal_the_dense_copies(encoder, n_users, n_items, max_len, local, semi_hard, in_batch,
                                                      dropout, logq, full_softmax, m, seed):
    """Each client's gradient through the recorded item reads (PerRowTable) equals the one through its
    dense copy of the item table (``_dense_items``, the old path) to float32 rounding, the item rows it
    never read included (zeros); and the clients' gradients sum to the summed loss's (the plaintext fast
    path, ``per_client=False``)."""
    rng = np.random.default_rng(seed)
    data = leave_one_out(generate_synthetic(n_users=n_users, n_items=n_items, mean_interactions=8, seed=seed % 1000),
                         seed=0)
    cfg = FedCLConfig(**{**SMALL, "dim": 8, "max_len": max_len, "blocks": 1, "clients_per_round": m,
                         "local_pool": 15, "local_negatives": local, "semi_hard": semi_hard, "in_batch": in_batch,
                         "dropout": dropout, "logq": logq, "full_softmax": full_softmax,
                         "clustering": "kmeans", "secure_aggregation": "none"})
    fc = FedCL(data.train, cfg, seed=seed % 997)
    users = np.sort(rng.choice(fc._clients, size=min(m, len(fc._clients)), replace=False))
    neg = kept = None
    if semi_hard:
        neg = rng.integers(0, fc.train.n_items, (len(users), semi_hard))
        kept = rng.random((len(users), semi_hard)) < 0.7
    got_losses, rows, w = fc.client_losses(users, neg, kept, t=3)
    assert full_softmax or isinstance(w["item"], PerRowTable)
    got, got_rows = fc.client_gradients(got_losses, rows, w, extra=2)
    want_losses, rows, w = fc.client_losses(users, neg, kept, t=3, _dense_items=True)
    assert not isinstance(w["item"], PerRowTable)
    want, want_rows = fc.client_gradients(want_losses, rows, w, extra=2)
    torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=0)  # the same forward values
    assert np.abs(want).max() > 0 or not want_losses.any()  # (no negative at all: every loss and gradient is 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    n_item = fc.model.item.numel()
    read_nothing = want[:, :n_item] == 0  # rows a client never read: exact zeros both ways
    assert not got[:, :n_item][read_nothing].any()
    if want_rows is not None:
        torch.testing.assert_close(got_rows, want_rows, rtol=1e-5, atol=1e-7)
    summed, rows, _ = fc.client_losses(users, neg, kept, per_client=False, t=3)
    total = torch.autograd.grad(summed.sum(), fc.params)
    total = torch.cat([g.reshape(-1) for g in total]).double().numpy()
    np.testing.assert_allclose(got[:, :-2].sum(0), total, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("encoder", ["gru", "id", "sasrec"])
def test_plaintext_fast_path_equals_the_sum_of_per_client_gradients(encoder):
    """Plaintext aggregation without kept payloads takes the gradient of the summed losses; with kept
    payloads every client's own gradient is computed and sent. Same aggregate, same model after."""
    fast = make({"encoder": encoder}, source=5)
    slow = make({"encoder": encoder}, source=5, keep=True)
    for _ in range(3):
        fast.run_round(), slow.run_round()
        assert np.abs(fast.last_aggregate).max() > 1e-3
        np.testing.assert_allclose(fast.last_aggregate, slow.last_aggregate, rtol=1e-4, atol=1e-7)
    sent = slow.transport.transcript.view(SERVER, kind="update")
    assert len(sent) == 24 and all(r.payload is not None for r in sent)
    np.testing.assert_allclose(fast.score_all(np.arange(5)), slow.score_all(np.arange(5)), rtol=1e-3, atol=1e-5)


def test_ward_on_more_clients_than_fit_is_refused_at_build_time(monkeypatch):
    """Ward's condensed matrix grows as n^2: above WARD_MAX_POINTS clients the protocol refuses to start
    (before any upload) and names the k-means option; k-means and the Fed baseline start."""
    import protocols.fedcl as fedcl_mod

    monkeypatch.setattr(fedcl_mod, "WARD_MAX_POINTS", 30)
    with pytest.raises(ValueError, match='fedcl.clustering = "kmeans"'):
        make()
    assert make({"clustering": "kmeans"}).round == 0 and make({"semi_hard": 0}).round == 0


def test_logq_offsets_are_the_public_sampling_probabilities():
    """logQ subtracts log(K / n_items) from the local negatives and log(T / |top R%|) from the semi-hard
    ones (public numbers, no item counts); off, Eq. (1) is the paper's."""
    fc = make({"logq": True, "local_negatives": 3, "semi_hard": 6, "hard_percent": 25.0})
    n = fc.train.n_items
    got = fc._log_q()
    assert got["local_log_q"] == pytest.approx(np.log(3 / n))
    assert got["hard_log_q"] == pytest.approx(np.log(6 / np.ceil(0.25 * n)))
    assert make()._log_q() == {}
    assert make({"logq": True, "semi_hard": 0})._log_q().keys() == {"local_log_q"}


@pytest.mark.parametrize("logq_semihard", [True, False])
def test_logq_semihard_false_corrects_the_local_negatives_only(monkeypatch, logq_semihard):
    """``logq_semihard = false`` keeps the local negatives' correction and leaves the semi-hard logits as
    in Eq. (1). Oracle: the loss of each client computed directly (numpy, per positive) from the inputs the
    protocol used, with the corrections applied by hand where the setting says."""
    import protocols.fedcl as fedcl_mod

    seen = []

    def spy(*args, **kwargs):
        out = contrastive_loss(*args, **kwargs)
        seen.append(([a.detach().clone() for a in args], kwargs, out.detach()))  # copies: the step updates the table
        return out

    monkeypatch.setattr(fedcl_mod, "contrastive_loss", spy)
    fc = make({"logq": True, "logq_semihard": logq_semihard, "in_batch": False, "semi_hard": 6, "local_negatives": 3,
               "hard_percent": 25.0}, source=3)
    fc.run_round()
    (u, pos, mask, item), kw, got = seen[-1]
    n = fc.train.n_items
    local_off = np.log(3 / n)
    hard_off = np.log(6 / np.ceil(0.25 * n)) if logq_semihard else 0.0
    u, item = u.detach().double().numpy(), item.detach().double().numpy()
    pos, mask = pos.numpy(), mask.numpy()
    local, hard, hmask = kw["local_neg"].numpy(), kw["hard_neg"].numpy(), kw["hard_mask"].numpy()
    assert hmask.any() and local.size
    for c in range(u.shape[0]):
        terms = []
        for j in np.flatnonzero(mask[c]):
            s = [u[c, j] @ item[pos[c, j]]]
            s += [u[c, j] @ item[i] - local_off for i in local[c, j]]
            s += [u[c, j] @ item[i] - hard_off for i, k in zip(hard[c], hmask[c]) if k]
            terms.append(np.log(np.sum(np.exp(s))) - s[0])
        assert float(got[c]) == pytest.approx(np.mean(terms), rel=1e-5, abs=1e-6)
    # the semi-hard correction (log(6/30) < 0) raises every semi-hard logit, so the loss is larger with it
    other = make({"logq": True, "logq_semihard": not logq_semihard, "in_batch": False, "semi_hard": 6,
                  "local_negatives": 3, "hard_percent": 25.0}, source=3)
    other.run_round()
    assert (seen[-1][2] < got).all() if logq_semihard else (seen[-1][2] > got).all()
