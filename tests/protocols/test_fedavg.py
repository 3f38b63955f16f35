"""FedAvg-GMF: the batched simulation equals each client training alone (torch autograd with
torch's own SparseAdam/SGD as the oracle), the transcript shows what the server saw, and a
round is reproducible from its seed."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.fedavg import ClientUpdate, FedAvgConfig, FedAvgGMF
from protocols.transport import SERVER, InProcessTransport, Transcript, client
from recmodels.data import Interactions, pair_keys
from recmodels.sampling import sample_negatives_keyed
from recmodels.streams import stream_keys, uniform_u64


def make_train(n_users: int, n_items: int, per_user: list[int], seed: int = 0) -> Interactions:
    rng = np.random.default_rng(seed)
    users, items = [], []
    for u, k in enumerate(per_user):
        chosen = rng.choice(n_items, size=min(k, n_items - 1), replace=False)
        users += [u] * len(chosen)
        items += list(chosen)
    n = len(users)
    return Interactions(
        users=np.array(users, np.int64),
        items=np.array(items, np.int64),
        ratings=np.ones(n, np.float32),
        timestamps=np.arange(n, dtype=np.int64),
        user_ids=np.arange(n_users),
        item_ids=np.arange(n_items),
    )


def reference_round(fa: FedAvgGMF) -> dict[str, torch.Tensor]:
    """One FedAvg round computed client by client with autograd and torch optimisers.

    Samples the cohort with a copy of the server's generator, and draws each client's negatives
    and shuffles *alone*, from its own stream (``stream_keys(seed, round, epoch, purpose,
    user)``), so the batched simulation must see the same data as each client on its own.
    """
    cfg, train = fa.config, fa.train
    rng = copy.deepcopy(fa.rng)
    clients = np.flatnonzero(np.bincount(train.users, minlength=train.n_users) > 0)
    m = cfg.clients_in_round(len(clients))
    sampled = np.sort(rng.choice(clients, size=m, replace=False))
    order = np.argsort(train.users, kind="stable")
    pos = {int(u): train.items[order][train.users[order] == u] for u in sampled}
    n_neg = cfg.train_negatives
    epochs = []  # per client: per epoch (items, labels, batches)
    for u in sampled:
        mine = pos[int(u)].astype(np.int64)
        forbidden = np.unique(pair_keys(np.full(len(mine), u), mine, train.n_items))
        per_epoch = []
        for e in range(cfg.local_epochs):
            index = np.arange(len(mine) * n_neg, dtype=np.int64)
            key = np.full(len(index), stream_keys(fa.seed, fa.round, e, 0, np.array([u]))[0], dtype=np.uint64)
            neg = sample_negatives_keyed(np.full(len(index), u), key, index, n_items=train.n_items, forbidden=forbidden)
            items = np.concatenate([mine, neg])
            labels = np.concatenate([np.ones(len(mine)), np.zeros(len(neg))])
            shuffle = uniform_u64(stream_keys(fa.seed, fa.round, e, 1, np.array([u]))[0], np.arange(len(items)))
            perm = np.argsort(shuffle, kind="stable")
            per_epoch.append((items, labels, [perm[i : i + cfg.local_batch_size] for i in range(0, len(perm), cfg.local_batch_size)]))
        epochs.append(per_epoch)

    Q0, h0, b0 = fa.item.clone(), fa.h.clone(), fa.b.clone()
    dQ_sum = torch.zeros_like(Q0)
    dQ_w = torch.zeros_like(Q0)
    touched_w = torch.zeros(Q0.shape[0])
    dh_w, db_w, w_sum = torch.zeros_like(h0), torch.zeros(()), 0.0
    users_out = {}
    for c, u in enumerate(sampled):
        user = torch.nn.Embedding(1, Q0.shape[1], sparse=True)
        item = torch.nn.Embedding(Q0.shape[0], Q0.shape[1], sparse=True)
        with torch.no_grad():
            user.weight.copy_(fa.user[int(u)].unsqueeze(0))
            item.weight.copy_(Q0)
        h = torch.nn.Parameter(h0.clone())
        b = torch.nn.Parameter(b0.clone())
        if cfg.optimizer == "adam":
            opts = [torch.optim.SparseAdam(list(user.parameters()) + list(item.parameters()), lr=cfg.lr), torch.optim.Adam([h, b], lr=cfg.lr)]
        else:
            opts = [torch.optim.SGD(list(user.parameters()) + list(item.parameters()) + [h, b], lr=cfg.lr)]
        touched = set()
        for items, labels, batches in epochs[c]:
            for batch in batches:
                it = torch.as_tensor(items[batch])
                touched |= set(items[batch].tolist())
                logits = ((user(torch.zeros(len(batch), dtype=torch.long)) * item(it)) * h).sum(-1) + b
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.as_tensor(labels[batch], dtype=torch.float32))
                for o in opts:
                    o.zero_grad()
                loss.backward()
                for o in opts:
                    o.step()
        weight = float(len(pos[int(u)]) * (1 + cfg.train_negatives) * cfg.local_epochs)
        with torch.no_grad():
            dQ = item.weight - Q0
            dQ_sum += dQ
            dQ_w += weight * dQ
            for i in touched:
                touched_w[i] += weight
            dh_w += weight * (h - h0)
            db_w += weight * (b - b0)
            w_sum += weight
            users_out[int(u)] = user.weight[0].clone()
    if cfg.item_aggregation == "sum":
        item_new = Q0 + cfg.server_lr * dQ_sum
    elif cfg.item_aggregation == "mean":
        item_new = Q0 + cfg.server_lr * dQ_w / w_sum
    else:
        item_new = Q0 + cfg.server_lr * dQ_w / touched_w.clamp_min(1e-12).unsqueeze(1)
    return {"item": item_new, "h": h0 + cfg.server_lr * dh_w / w_sum, "b": b0 + cfg.server_lr * db_w / w_sum, "users": users_out}


@settings(max_examples=12, deadline=None)
@given(
    n_users=st.integers(2, 6),
    n_items=st.integers(6, 14),
    dim=st.integers(1, 5),
    batch=st.integers(1, 9),
    epochs=st.integers(1, 2),
    negatives=st.integers(0, 2),
    optimizer=st.sampled_from(["adam", "sgd"]),
    aggregation=st.sampled_from(["sum", "mean", "touched"]),
    fraction=st.sampled_from([1.0, 0.5]),
    seed=st.integers(0, 1000),
)
def test_batched_round_equals_clients_training_alone(n_users, n_items, dim, batch, epochs, negatives, optimizer, aggregation, fraction, seed):
    per_user = list(np.random.default_rng(seed).integers(1, 5, size=n_users))
    train = make_train(n_users, n_items, per_user, seed)
    cfg = FedAvgConfig(dim=dim, local_batch_size=batch, local_epochs=epochs, train_negatives=negatives, optimizer=optimizer,
                       item_aggregation=aggregation, client_fraction=fraction, lr=0.05, init_std=0.3)
    fa = FedAvgGMF(train, cfg, seed=seed)
    expected = reference_round(fa)
    fa.run_round()
    torch.testing.assert_close(fa.item, expected["item"], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fa.h, expected["h"], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fa.b, expected["b"], atol=2e-5, rtol=1e-4)
    for u, vec in expected["users"].items():
        torch.testing.assert_close(fa.user[u], vec, atol=2e-5, rtol=1e-4)


def test_transcript_records_what_the_server_saw():
    train = make_train(5, 20, [4, 3, 6, 2, 5])
    transcript = Transcript(keep_payloads=True)
    fa = FedAvgGMF(train, FedAvgConfig(dim=4, clients_per_round=3), seed=1, transport=InProcessTransport(transcript))
    before = fa.item.clone()
    fa.run_round()
    ups = transcript.view(SERVER, round=0, kind="update")
    downs = [r for r in transcript.records if r.sender == SERVER]
    assert len(ups) == 3 and len(downs) == 3
    assert {r.receiver for r in downs} == {r.sender for r in ups}
    assert all(r.nbytes == fa.model_bytes + 4 for r in ups)
    # The uploads carry no user embedding, and their sum is exactly the server's item change.
    total = np.zeros((20, 4), np.float32)
    for r in ups:
        assert isinstance(r.payload, ClientUpdate)
        assert not any(f.name.startswith("user_") for f in dataclasses.fields(r.payload))
        total += r.payload.dense_item_delta(20)
    np.testing.assert_allclose(fa.item.numpy() - before.numpy(), total, atol=1e-6)
    # Without payload retention only the sizes remain.
    t2 = Transcript()
    FedAvgGMF(train, FedAvgConfig(dim=4), seed=1, transport=InProcessTransport(t2)).run_round()
    assert t2.records and all(r.payload is None for r in t2.records)
    assert t2.round_summary(0)["bytes_per_client"] == pytest.approx(2 * (4 * (20 * 4 + 4 + 1)) + 4)


def test_untouched_items_are_exact_zeros_in_uploads():
    train = make_train(3, 30, [2, 2, 2])
    transcript = Transcript(keep_payloads=True)
    fa = FedAvgGMF(train, FedAvgConfig(dim=3, train_negatives=1), seed=3, transport=InProcessTransport(transcript))
    fa.run_round()
    uploads = transcript.view(SERVER, kind="update")
    assert len(uploads) == 3  # the loop below must not pass over an empty view
    for r in uploads:
        dense = r.payload.dense_item_delta(30)
        assert (np.abs(dense).sum(1) > 0).sum() <= 4  # 2 positives + 2 negatives at most
        u = r.payload.user
        assert set(train.items[train.users == u]) <= set(r.payload.rows.tolist())


def test_same_seed_same_model_and_resume_from_state():
    train = make_train(6, 25, [5, 4, 6, 3, 5, 4])
    cfg = FedAvgConfig(dim=4, client_fraction=0.5)
    a, b = FedAvgGMF(train, cfg, seed=7), FedAvgGMF(train, cfg, seed=7)
    for _ in range(3):
        a.run_round()
        b.run_round()
    state = copy.deepcopy(a.state_dict())
    a.run_round()
    c = FedAvgGMF(train, cfg, seed=999)
    c.load_state_dict(state)
    c.run_round()
    torch.testing.assert_close(a.item, c.item, rtol=0, atol=0)
    torch.testing.assert_close(b.item, copy.deepcopy(state["item"]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="different fedavg configuration"):
        FedAvgGMF(train, dataclasses.replace(cfg, lr=0.5), seed=7).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"client_fraction": 0.0}, "client_fraction"),
        ({"clients_per_round": -1}, "clients_per_round"),
        ({"lr": 0.0}, "lr"),
        ({"optimizer": "rmsprop"}, "optimizer"),
        ({"item_aggregation": "median"}, "item_aggregation"),
        ({"local_batch_size": 0}, "local_batch_size"),
    ],
)
def test_bad_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FedAvgConfig(**kwargs)


def test_client_party_names():
    assert client(3) == "client:3" and SERVER == "server"


@settings(max_examples=8, deadline=None)
@given(
    protocol=st.sampled_from(["secagg", "secagg+"]),
    aggregation=st.sampled_from(["sum", "mean", "touched"]),
    n_users=st.integers(3, 9),
    seed=st.integers(0, 10_000),
)
def test_secure_aggregation_gives_the_plaintext_model(protocol, aggregation, n_users, seed):
    """The server's view is masked, yet it computes the same aggregate (up to 2^-24 quantisation)."""
    per_user = list(np.random.default_rng(seed).integers(2, 6, size=n_users))
    train = make_train(n_users, 15, per_user, seed)
    base = dict(dim=3, item_aggregation=aggregation, lr=0.05, init_std=0.3)
    plain = FedAvgGMF(train, FedAvgConfig(**base), seed=seed)
    transcript = Transcript(keep_payloads=True)
    secure = FedAvgGMF(train, FedAvgConfig(**base, secure_aggregation=protocol), seed=seed, transport=InProcessTransport(transcript))
    for _ in range(2):
        plain.run_round()
        secure.run_round()
    torch.testing.assert_close(secure.item, plain.item, atol=1e-5, rtol=0)
    torch.testing.assert_close(secure.h, plain.h, atol=1e-5, rtol=0)
    torch.testing.assert_close(secure.user, plain.user, atol=1e-5, rtol=0)
    ups = transcript.view(SERVER, round=1, kind="update")
    assert len(ups) == n_users and all(r.payload.dtype == np.uint64 for r in ups)
    assert any(r.kind.startswith("secagg:") for r in transcript.records)


def test_masked_uploads_look_uniform_and_hide_the_update():
    train = make_train(6, 40, [8, 6, 7, 5, 9, 6], seed=5)
    transcript = Transcript(keep_payloads=True)
    fa = FedAvgGMF(train, FedAvgConfig(dim=4, secure_aggregation="secagg+"), seed=5, transport=InProcessTransport(transcript))
    fa.run_round()
    y = np.concatenate([r.payload for r in transcript.view(SERVER, kind="update")])
    # A plaintext update is mostly exact zeros (untouched rows); masked, the top bit is a fair coin.
    assert (y == 0).mean() < 0.01
    top = (y >> np.uint64(63)).astype(float)
    assert abs(top.mean() - 0.5) < 4 * 0.5 / np.sqrt(len(top))


def test_secure_aggregation_refuses_values_beyond_the_clip_and_the_budget():
    train = make_train(4, 12, [3, 3, 3, 3])
    fa = FedAvgGMF(train, FedAvgConfig(dim=2, secure_aggregation="secagg", value_clip=1e-6), seed=0)
    with pytest.raises(ValueError, match="fedavg.value_clip"):
        fa.run_round()
    with pytest.raises(ValueError, match="frac"):
        FedAvgGMF(train, FedAvgConfig(dim=2, secure_aggregation="secagg", value_clip=2.0**40, frac_bits=30), seed=0)
    with pytest.raises(ValueError, match="secure_aggregation"):
        FedAvgConfig(secure_aggregation="paillier")


def test_secagg_plus_parameters_follow_the_configured_dropout_and_corruption(monkeypatch):
    """Issue 8, item 9: ``secagg_dropout``/``secagg_corrupt`` choose SecAgg+'s k and t; an
    impossible combination is refused before training, naming the key to change."""
    import secagg.runner as runner_mod
    from secagg.params import choose

    seen = []
    real = runner_mod.PROTOCOLS["secagg+"]

    def spy(x, spec, **kw):
        res = real(x, spec, **kw)
        seen.append((spec.dropout, spec.corrupt, res.k, res.t))
        return res

    monkeypatch.setitem(runner_mod.PROTOCOLS, "secagg+", spy)
    train = make_train(8, 20, [3] * 8, seed=1)
    cfg = FedAvgConfig(dim=2, secure_aggregation="secagg+", secagg_dropout=0.25, secagg_corrupt=0.0)
    fa = FedAvgGMF(train, cfg, seed=1)
    fa.run_round()
    want = choose(8, dropout=0.25, corrupt=0.0)
    assert seen == [(0.25, 0.0, want.k, want.t)] and fa.secagg_guarantees == want
    with pytest.raises(ValueError, match="secagg_dropout"):
        FedAvgGMF(make_train(2, 10, [3, 3], seed=1), FedAvgConfig(dim=2, secure_aggregation="secagg+"), seed=1)
    with pytest.raises(ValueError, match="fedavg.secagg_corrupt"):
        FedAvgConfig(secagg_corrupt=0.5)


def test_round_reports_seconds_per_party():
    """costs.jsonl carries seconds per party: the client's share of the batched local training
    (plus its secure-aggregation work) and the server's aggregation, each within the round."""
    train = make_train(6, 20, [3] * 6, seed=2)
    for secure in ("none", "secagg"):
        stats = FedAvgGMF(train, FedAvgConfig(dim=2, secure_aggregation=secure), seed=1).run_round()
        s = stats.seconds
        assert set(s) == {"round", "client", "server"}, secure
        assert 0 < s["client"] <= s["round"] and 0 <= s["server"] <= s["round"], (secure, s)
