"""STTFedRec: the promise (what RS and SAS receive), split == FL == plaintext, dropouts, bad input, resume."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.secure_sum import SecureSumAborted, secure_sum
from protocols.state import state_from_bytes, state_to_bytes
from protocols.sttfedrec import RS, SAS, ProtocolError, RequestError, STTFedRec
from protocols.transport import InProcessTransport, Transcript, client
from protocols.twotower_data import TwoTowerConfig, build_features, sample_requests, positive_lists
from recmodels.data import binarize
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic

SMALL = dict(hash_dim=64, clients_per_round=6, max_words=4, dim=16)


@pytest.fixture(scope="module")
def train():
    raw = generate_synthetic(n_users=40, n_items=80, seed=0, dim=8, mean_interactions=10)
    return leave_one_out(binarize(raw), seed=0).train


def _trainer(train, mode="split", keep=False, seed=3, **kw):
    cfg = TwoTowerConfig(**{**SMALL, **kw})
    return STTFedRec(train, cfg, seed=seed, mode=mode, transport=InProcessTransport(Transcript(keep_payloads=keep)))


def _params(tr):
    return {**{f"u.{k}": v for k, v in tr.user_params.items()}, **{f"v.{k}": v for k, v in tr.item_params.items()}}


def _close(a, b, atol):
    return all(torch.allclose(a[k], b[k], atol=atol) for k in a)


@pytest.mark.parametrize("tower,ids", [("dssm", False), ("clsm", False), ("dssm", True)])
def test_split_training_equals_fl_training_within_fixed_point(train, tower, ids):
    """Notes C6: the split protocol (chain + SecAgg+ sums) computes the FL (plaintext) update,
    also with the per-item-id vectors (RS trains them from the same per-id sums)."""
    split, fl = _trainer(train, "split", tower=tower, item_id_embedding=ids), _trainer(train, "fl", tower=tower, item_id_embedding=ids)
    for _ in range(2):
        a, b = split.run_round(), fl.run_round()
        assert abs(a.loss - b.loss) < 1e-5
    # FedAdam divides by sqrt(v): a 2^-24 quantisation can move a parameter by up to ~lr in a
    # step where its gradient is ~0, so compare at that scale and check most agree far closer.
    pa, pb = _params(split), _params(fl)
    assert _close(pa, pb, atol=2 * split.config.lr)
    diff = torch.cat([(pa[k] - pb[k]).abs().ravel() for k in pa])
    assert float((diff < 1e-5).float().mean()) > 0.99
    init = _params(_trainer(train, tower=tower, item_id_embedding=ids))
    moved = torch.cat([(pa[k] - init[k]).abs().ravel() for k in pa])
    assert float(moved.max()) > 10 * float(diff.max())  # the models did move
    if ids:  # the id vectors moved, identically in both
        assert float(pa["v.item_id"].abs().max()) > 10 * float((pa["v.item_id"] - pb["v.item_id"]).abs().max())


def test_more_fractional_bits_bring_the_split_update_closer_to_fl(train):
    """The preset's frac_bits = 32 (docs/sttfedrec.md, "fixed-point drift"): with the same seed the
    split model is closer to the FL model than at 24 bits, and the preset fits the bit budget."""
    from experiments.run.config import load_preset
    from secagg.encoding import check_budget

    fl = _trainer(train, "fl", item_id_embedding=True, lr=1e-2, tau=1e-6)
    gaps = {}
    for bits in (24, 32):
        split = _trainer(train, "split", item_id_embedding=True, lr=1e-2, tau=1e-6, frac_bits=bits)
        split.run_round()
        gaps[bits] = split
    fl.run_round()
    pb = _params(fl)
    dist = {bits: float(sum((_params(t)[k] - pb[k]).abs().sum() for k in pb)) for bits, t in gaps.items()}
    assert dist[32] < dist[24] / 4, dist  # 256x finer grid: far closer (not exact: float order differs too)
    for name in ("sttfedrec", "sttfedrec-clsm"):
        cfg = load_preset(name).sections["sttfedrec"]
        assert cfg.frac_bits == 32
        check_budget(n_summands=cfg.clients_per_round, clip=cfg.value_clip, frac_bits=cfg.frac_bits)


def test_item_tower_secure_path_equals_plaintext_rows(train):
    """The per-id gradient sum through SecAgg+ gives RS the plaintext sum (item_aggregation = none)."""
    a, b = _trainer(train, item_aggregation="secagg+"), _trainer(train, item_aggregation="none")
    c = _trainer(train, item_aggregation="chain")
    for _ in range(2):
        a.run_round(), b.run_round(), c.run_round()
    for other in (b, c):
        diff = torch.cat([(a.item_params[k] - other.item_params[k]).abs().ravel() for k in a.item_params])
        assert float((diff < 1e-5).float().mean()) > 0.99 and float(diff.max()) < 2 * a.config.lr


def test_rs_never_receives_the_user_tower_or_one_clients_gradient(train):
    tr = _trainer(train, keep=True)
    tr.run_round()
    records = tr.transport.transcript.records
    rs_kinds = {r.kind for r in records if r.receiver == RS}
    assert rs_kinds <= {"request", "item-gradient", "item-gradient-sum"} | {k for k in rs_kinds if k.startswith("secagg:")}
    assert not any(r.sender == SAS and r.receiver == RS for r in records)  # SAS sends RS nothing
    assert not any(r.kind in ("user-gradient", "user-tower") and r.receiver == RS for r in records)
    # What RS receives of the item gradients is masked: uniform-looking uint64 words, not float rows.
    uploads = [r.payload for r in records if r.receiver == RS and r.kind == "item-gradient"]
    assert len(uploads) == tr.clients_per_round and all(u.dtype == np.uint64 for u in uploads)
    high = np.concatenate([u >> np.uint64(63) for u in uploads]).astype(float)
    assert 0.4 < high.mean() < 0.6  # fixed-point encodings of small gradients would be ~all 0 or 1
    # SAS sees neither requests nor embeddings; clients get only T embeddings each
    assert not any(r.receiver == SAS and r.kind in ("request", "embeddings") for r in records)
    emb = [r.payload for r in records if r.kind == "embeddings"]
    assert all(e.shape == (tr.config.request_size, tr.config.dim) for e in emb)


def test_download_all_sends_rs_no_item_id_and_sums_over_every_id(train):
    """The request-intersection defense: RS's view holds no item id of any client, the per-id
    gradient sum covers all M ids (so no id has a single contributor), and training equals the
    plaintext (FL) update on the same locally chosen batches."""
    tr = _trainer(train, keep=True, decoys="download-all")
    fl = _trainer(train, "fl", decoys="download-all")
    a, b = tr.run_round(), fl.run_round()
    assert abs(a.loss - b.loss) < 1e-5
    view = tr.transport.transcript.view(RS)
    assert not any(r.kind == "request" for r in view)
    asks = [r for r in view if r.kind == "request-all"]
    assert len(asks) == tr.clients_per_round and all(r.payload is None and r.nbytes == 4 for r in asks)
    (summed,) = [r.payload for r in view if r.kind == "item-gradient-sum"]
    assert np.array_equal(summed[0], np.arange(tr.n_items))
    emb = [r for r in tr.transport.transcript.records if r.kind == "embeddings"]
    assert all(r.nbytes == 4 * tr.n_items * tr.config.dim for r in emb)
    # the client still trained on n_pos clicks + n_neg non-clicks chosen on the device
    users, ids, labels = tr.last_batches
    assert ids.shape == (tr.clients_per_round, tr.config.request_size) and (labels.sum(1) >= 1).all()
    diff = torch.cat([(_params(tr)[k] - _params(fl)[k]).abs().ravel() for k in _params(tr)])
    assert float((diff < 1e-5).float().mean()) > 0.99
    with pytest.raises(RequestError, match="download-all"):
        tr.check_request(tr.round, client(0), np.arange(10))
    with pytest.raises(RequestError, match="every embedding"):
        _trainer(train).check_request(0, client(0), None)


def test_history_feature_leaves_the_requests_clicks_out(train):
    """user_features = "history": the mean item vector of the user's other training clicks."""
    cfg = TwoTowerConfig(**SMALL, user_features="history")
    data = build_features(train, "synthetic", cfg)
    items, start = positive_lists(data.train)
    users = np.flatnonzero(np.diff(start) >= 1)[:8]
    ids, labels = sample_requests(users, items, start, cfg.n_pos, cfg.n_neg, data.never_negative,
                                  np.random.default_rng(0))
    x = data.item_x.toarray()
    got = data.request_user_x(users, labels, torch.as_tensor(x[ids])).numpy()
    for row, u, req, lab in zip(got, users, ids, labels):
        others = [i for i in items[start[u]:start[u + 1]] if i not in set(req[lab > 0].tolist())]
        want = x[others].mean(0) if others else np.zeros(x.shape[1])
        assert np.allclose(row, want, atol=1e-5)
    assert np.allclose(data.user_x[users].toarray(), [x[items[start[u]:start[u + 1]]].mean(0) for u in users], atol=1e-5)
    tr = _trainer(train, user_features="history", item_id_embedding=True)
    assert np.isfinite(tr.run_round().loss)
    with pytest.raises(ValueError, match="sttfedrec.user_features"):
        TwoTowerConfig(tower="clsm", user_features="history")


def test_requests_have_the_configured_composition(train):
    cfg = TwoTowerConfig(**SMALL, rho=0.8)
    data = build_features(train, "synthetic", cfg)
    items, start = positive_lists(data.train)
    users = np.flatnonzero(np.diff(start) >= 2)[:10]
    ids, labels = sample_requests(users, items, start, cfg.n_pos, cfg.n_neg, data.never_negative,
                                  np.random.default_rng(0))
    assert ids.shape == (10, 10) and (labels.sum(1) == 2).all()
    for u, row, lab in zip(users, ids, labels):
        hist = set(items[start[u]:start[u + 1]].tolist())
        assert set(row[lab == 1].tolist()) <= hist and not set(row[lab == 0].tolist()) & hist


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 7), st.integers(1, 20), st.integers(0, 2**32 - 1), st.integers(1, 2))
def test_chain_sum_equals_plaintext_sum(n, dim, seed, s):
    vals = np.random.default_rng(seed).uniform(-3, 3, (n, dim))
    res = secure_sum(vals, protocol="chain", frac_bits=24, value_clip=4.0, round=0,
                     transport=InProcessTransport(), senders=[client(i) for i in range(n)], receiver=SAS, k=s)
    assert np.allclose(res.total, vals.sum(0), atol=n * 2**-24)


def test_secure_sum_runs_the_chain_in_32_bits_when_the_public_budget_allows():
    """secure_sum picks the chain's ring from public parameters: 4 bytes a value when n x clip x 2^f
    fits 31 bits, 8 when it does not; the sum is exact either way."""
    n, dim = 6, 400
    vals = np.random.default_rng(0).uniform(-3, 3, (n, dim))
    per_value = {}
    for frac_bits in (24, 29):  # 6 x 4 x 2^24 < 2^31 (32-bit ring); 6 x 4 x 2^29 > 2^31 (64-bit ring)
        tr = InProcessTransport()
        res = secure_sum(vals, protocol="chain", frac_bits=frac_bits, value_clip=4.0, round=0, transport=tr,
                         senders=[client(i) for i in range(n)], receiver=SAS, k=1)
        assert np.allclose(res.total, vals.sum(0), atol=n * 2**-frac_bits)
        uploads = [r.nbytes for r in tr.transcript.records if r.kind == "update"]  # the masked upload
        assert uploads, sorted({r.kind for r in tr.transcript.records})
        per_value[frac_bits] = min(uploads)
    # the body is dim words of 4 bytes (Z_2^32) or 8 (Z_2^64); the 32-bit format adds its width byte
    assert per_value[29] - per_value[24] == 4 * dim - 1, per_value


def test_dropouts_give_the_survivors_mean_or_a_clean_abort(train):
    tr = _trainer(train)
    tr._dropouts = {"user": {"masked_input": frozenset({1})}, "item": {"masked_input": frozenset({2})}}
    stats = tr.run_round()
    assert stats.extra["survivors_user"] == tr.clients_per_round - 1
    assert stats.extra["survivors_item"] == tr.clients_per_round - 1
    before = {k: v.clone() for k, v in _params(tr).items()}
    round_before = tr.round
    tr._dropouts = {"user": {"advertise": frozenset(range(1, tr.clients_per_round))}}
    with pytest.raises(SecureSumAborted):
        tr.run_round()
    assert tr.round == round_before and _close(before, _params(tr), atol=0)
    tr._dropouts = {}
    tr.run_round()  # the round runs again once the clients are back
    assert tr.round == round_before + 1


def test_bad_messages_are_refused_before_any_state_changes(train):
    tr = _trainer(train)
    before = {k: v.clone() for k, v in _params(tr).items()}
    name = client(0)
    with pytest.raises(RequestError, match="expected 10"):
        tr.check_request(0, name, np.arange(3))
    with pytest.raises(RequestError, match="unknown item id 80"):
        tr.check_request(0, name, np.array([80] + [1] * 9))
    with pytest.raises(RequestError, match="round 5"):
        tr.check_request(5, name, np.arange(10))
    tr._served.add((0, name))
    with pytest.raises(RequestError, match="replayed"):
        tr.check_request(0, name, np.arange(10))
    with pytest.raises(ProtocolError, match="unknown user"):
        tr.user_embeddings(np.array([40]))
    with pytest.raises(ProtocolError, match="does not fit"):
        tr.apply_user_gradient(np.zeros(tr.n_user_params - 1), survivors=3)
    assert _close(before, _params(tr), atol=0)


def test_resume_from_a_checkpoint_reproduces_the_uninterrupted_run(train):
    # rho 0.5 with a fixed decoy pool: clients with fewer than n_pos = 5 clicks fill up from their pool
    whole = _trainer(train, decoys="fixed-pool", rho=0.5)
    for _ in range(3):
        whole.run_round()
    part = _trainer(train, decoys="fixed-pool", rho=0.5)
    part.run_round()
    state = state_from_bytes(state_to_bytes(part.state_dict()))
    resumed = _trainer(train, decoys="fixed-pool", rho=0.5)
    resumed.load_state_dict(state)
    for _ in range(2):
        resumed.run_round()
    assert resumed.round == 3
    # the chain and SecAgg+ masks are fresh CSPRNG draws, but they cancel exactly: same model
    assert _close(_params(whole), _params(resumed), atol=0)
    users = np.arange(5)
    assert np.array_equal(whole.score_all(users), resumed.score_all(users))
    with pytest.raises(ValueError, match="different"):
        _trainer(train, rho=0.7).load_state_dict(state)
    # a checkpoint written before a configuration key existed resumes when that key is at its default
    old = dict(state, config={k: v for k, v in state["config"].items() if not k.startswith("click_id")})
    again = _trainer(train, decoys="fixed-pool", rho=0.5)
    again.load_state_dict(old)
    assert again.round == 1
    with pytest.raises(ValueError, match="different"):
        _trainer(train, decoys="fixed-pool", rho=0.5, click_id_dim=64).load_state_dict(old)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="sttfedrec.rho"):
        TwoTowerConfig(rho=1.0)
    with pytest.raises(ValueError, match="sttfedrec.item_aggregation"):
        TwoTowerConfig(item_aggregation="paillier")
    with pytest.raises(ValueError, match="sttfedrec.tower"):
        TwoTowerConfig(tower="bert")


TINY = """
[run]
rounds = {rounds}
eval_every = 0
[data]
synthetic_users = 40
synthetic_items = 80
synthetic_mean_interactions = 10
[eval]
negatives = 20
[sttfedrec]
hash_dim = 64
dim = 16
clients_per_round = 6
max_words = 4
"""


def _cli(capsys, *argv):
    from experiments.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _tiny(tmp_path, rounds):
    path = tmp_path / f"tiny{rounds}.toml"
    path.write_text(TINY.format(rounds=rounds))
    return str(path)


def test_sttfedrec_preset_runs_and_resumes_through_secagg_run(tmp_path, capsys):
    whole = _cli(capsys, "run", "sttfedrec", "--config", _tiny(tmp_path, 2), "--out", str(tmp_path / "whole"),
                 "--json", "--quiet")
    _cli(capsys, "run", "sttfedrec", "--config", _tiny(tmp_path, 1), "--out", str(tmp_path / "part"), "--json", "--quiet")
    resumed = _cli(capsys, "run", "--resume", str(tmp_path / "part"), "--rounds", "2", "--json", "--quiet")
    assert resumed["metrics"] == whole["metrics"] and resumed["metrics_full"] == whole["metrics_full"]
    costs = whole["costs"]
    for key in ("train_bytes_per_client_per_round", "inference_bytes_per_client",
                "device_train_seconds_per_round", "device_inference_seconds"):
        assert costs[key] > 0, key
    assert whole["bytes_per_client_per_round"] > 0
    assert costs["inference_bytes_per_client"] == whole["public_info"]["n_items"] * 16 * 4  # M x k float32 (C8)


@pytest.mark.parametrize("preset", ["fl-dssm", "centralized-clsm"])
def test_baseline_presets_run(tmp_path, capsys, preset):
    out = _cli(capsys, "run", preset, "--config", _tiny(tmp_path, 1), "--out", str(tmp_path / preset), "--json", "--quiet")
    assert out["rounds"] == 1 and 0 <= out["metrics"]["HR@10"] <= 1
    if preset == "fl-dssm":  # FL downloads the raw item data to infer, not M x k embeddings
        assert 0 < out["costs"]["inference_bytes_per_client"] != out["public_info"]["n_items"] * 16 * 4


def test_ml_latest_small_features_and_one_round(ml_latest_small):
    from recmodels.loaders import load_interactions

    data = binarize(load_interactions(ml_latest_small))
    train = leave_one_out(data, seed=0).train
    cfg = TwoTowerConfig(hash_dim=256, dim=16, clients_per_round=5)
    feats = build_features(train, str(ml_latest_small), cfg)
    assert feats.user_rule == "clicks"  # ml-latest-small has no demographics
    assert len(feats.vocab.trigrams) == 255 and feats.item_x.shape == (train.n_items, 256)
    removed = set(map(tuple, feats.feature_pairs.tolist()))
    kept = set(zip(feats.train.users.tolist(), feats.train.items.tolist()))
    assert removed and not removed & kept and len(removed) + len(kept) == len(train)
    assert (np.bincount(feats.train.users, minlength=train.n_users) >= 1).all()
    tr = STTFedRec(train, cfg, seed=0, source=str(ml_latest_small), data=feats)
    stats = tr.run_round()
    assert np.isfinite(stats.loss) and stats.extra["survivors_user"] == 5


def _click_oracle(data, train, users, ids, labels, salt, dim, norm):
    """Plain loop: the scaled bucket counts of each user's training clicks minus the request's clicks."""
    bucket = {i: hashlib.blake2b(str(raw).encode(), digest_size=8, key=salt.encode()).digest()
              for i, raw in enumerate(train.item_ids.tolist())}
    out = []
    for u, req, lab in zip(users, ids, labels):
        mine = [int(i) for uu, i in zip(train.users, train.items) if uu == u]  # the feature clicks included
        for i in req[lab > 0].tolist():
            mine.remove(i)
        row = np.zeros(dim)
        for i in mine:
            row[int.from_bytes(bucket[i], "little") % dim] += 1
        n = max(len(mine), 1)
        out.append(row / (n if norm == "mean" else np.sqrt(n)))
    return np.array(out)


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(["clicks", "history"]), st.sampled_from(["mean", "sqrt"]), st.integers(2, 40),
       st.integers(0, 2**32 - 1))
def test_click_id_feature_leaves_the_requests_clicks_out(train, rule, norm, dim, seed):
    """click_id_dim = B: the user input gains the hashed bag of the user's *other* training clicks
    (oracle: a plain loop over the raw interactions and hashlib); the trigram part is unchanged."""
    cfg = TwoTowerConfig(**SMALL, user_features=rule, click_id_dim=dim, click_id_norm=norm)
    data = build_features(train, "synthetic", cfg)
    plain = build_features(train, "synthetic", TwoTowerConfig(**SMALL, user_features=rule))
    assert data.user_x.shape == (train.n_users, 64 + dim) and cfg.user_in_dim == 64 + dim
    items, start = positive_lists(data.train)
    users = np.flatnonzero(np.diff(start) >= 1)[:10]
    ids, labels = sample_requests(users, items, start, cfg.n_pos, cfg.n_neg, data.never_negative,
                                  np.random.default_rng(seed))
    x = data.item_x.toarray()
    got = data.request_user_x(users, labels, torch.as_tensor(x[ids]) if rule == "history" else None, ids).numpy()
    want = _click_oracle(data, train, users, ids, labels, cfg.click_id_salt, dim, norm)
    assert np.allclose(got[:, 64:], want, atol=1e-6)
    # the request's clicks are out: their bucket counts dropped by exactly the clicks in the request
    full = _click_oracle(data, train, users, ids, np.zeros_like(labels), cfg.click_id_salt, dim, norm)
    assert np.allclose(data.user_x[users].toarray()[:, 64:], full, atol=1e-6)  # evaluation: every training click
    words = plain.request_user_x(users, labels, torch.as_tensor(x[ids])).numpy() if rule == "history" \
        else plain.user_x[users].toarray()
    assert np.allclose(got[:, :64], words, atol=1e-5)
    with pytest.raises(ValueError, match="item ids"):
        data.request_user_x(users, labels, torch.as_tensor(x[ids]))


def test_click_ids_keep_split_equal_to_fl_and_grow_the_chain_upload(train):
    """With the click-id input the split update is still the FL update within fixed point, and the
    chain upload grows by the first layer's 256 x B extra values (8 bytes each) plus the download (4 bytes)."""
    split = _trainer(train, "split", click_id_dim=32, item_id_embedding=True)
    fl = _trainer(train, "fl", click_id_dim=32, item_id_embedding=True)
    first = []
    for _ in range(2):
        a, b = split.run_round(), fl.run_round()
        assert abs(a.loss - b.loss) < 1e-5
        first.append(a.bytes_per_client)
    pa, pb = _params(split), _params(fl)
    assert pa["u.layers.0.weight"].shape == (256, 64 + 32)
    diff = torch.cat([(pa[k] - pb[k]).abs().ravel() for k in pa])
    assert float((diff < 1e-5).float().mean()) > 0.99 and _close(pa, pb, atol=2 * split.config.lr)
    init = _params(_trainer(train, click_id_dim=32, item_id_embedding=True))
    clicked = (pa["u.layers.0.weight"] - init["u.layers.0.weight"])[:, 64:].abs()
    assert float(clicked.max()) > 10 * float(diff.max())  # the click-id columns did learn
    base = _trainer(train, "split", item_id_embedding=True)
    grown = first[0] - base.run_round().bytes_per_client  # the same requests in round 0
    assert split.n_user_params - base.n_user_params == 256 * 32
    assert grown == 256 * 32 * (4 + 8)  # tower download float32 + chain upload Z_2^64


def test_click_id_config_is_validated():
    for bad in (-1, 1, 2.5, True, 1 << 21):
        with pytest.raises(ValueError, match="sttfedrec.click_id_dim"):
            TwoTowerConfig(click_id_dim=bad)
    with pytest.raises(ValueError, match="sttfedrec.click_id_dim"):
        TwoTowerConfig(tower="clsm", click_id_dim=64)
    with pytest.raises(ValueError, match="sttfedrec.click_id_norm"):
        TwoTowerConfig(click_id_dim=64, click_id_norm="l1")
    with pytest.raises(ValueError, match="sttfedrec.click_id_salt"):
        TwoTowerConfig(click_id_dim=64, click_id_salt="")
    assert TwoTowerConfig(click_id_dim=0).user_in_dim == TwoTowerConfig().hash_dim


def test_hashed_ids_are_a_salted_public_hash():
    from recmodels.trigram import hashed_ids

    ids = np.arange(1, 2001)
    a, b = hashed_ids(ids, 64, "s1"), hashed_ids(ids, 64, "s2")
    assert a.min() >= 0 and a.max() < 64 and np.array_equal(a, hashed_ids(ids.tolist(), 64, "s1"))
    assert (a != b).mean() > 0.9  # the salt picks the collisions
    assert np.bincount(a, minlength=64).min() > 10  # spread over every bucket
    with pytest.raises(ValueError, match="dim"):
        hashed_ids(ids, 1, "s1")


def test_summed_first_layer_gradient_reveals_the_cohorts_union_of_click_buckets(train):
    """The stated limit of click_id_dim (docs/sttfedrec.md): the click-id columns of the summed
    user-tower gradient SAS decodes are non-zero exactly at the buckets some sampled client holds
    (after leaving out its request's clicks), and a bucket held by one client only is that
    client's own first-layer error vector (parallel to its other sole-held columns)."""
    from experiments.studies.sttfedrec_click_leak import cohort_exposure

    tr = _trainer(train, click_id_dim=48, clients_per_round=4)
    tr.record_chain_inputs = True
    tr.run_round()
    _, vec = tr.last_chain_inputs
    users, ids, labels = tr.last_batches
    w = vec[:, : 256 * (64 + 48)].reshape(len(users), 256, 64 + 48)[:, :, 64:]  # per client, click columns
    held = tr.data.request_user_x(users, labels, None, ids).numpy()[:, 64:] > 0
    summed = np.abs(w.sum(0)).max(0) > 0
    assert np.array_equal(summed, held.any(0))
    sole = np.flatnonzero(held.sum(0) == 1)
    assert len(sole) > 0
    for b in sole:
        (owner,) = np.flatnonzero(held[:, b])
        assert np.allclose(w.sum(0)[:, b], w[owner, :, b])
    # the exposure counter, on a hand-made example: u0 {0, 1}, u1 {1, 2}, u2 {3}; B = 8
    got = cohort_exposure(np.array([0, 0, 1, 1, 2]), np.array([0, 1, 1, 2, 3]), 3, 8, 3, 2)
    assert got == {"union_covers": 0.5, "sole_held_fraction": pytest.approx(2 / 3), "members_with_a_sole_bucket": 1.0}


@pytest.mark.parametrize("tower", ["dssm", "clsm"])
def test_paper_bytes_count_float32_tower_parameters_only(train, tower):
    """Issue 25 item 5: the paper's Table 3 count, recomputed here from the towers' parameter shapes
    (not from the trainer's own counters): STTFedRec = 4 B x user tower x 2 (down, gradient up);
    FL-DSSM = 4 B x both towers x 2; the id vectors are not tower parameters. The true bytes are
    larger than the paper's in split mode (the chain's 8-byte values, the request, the embeddings)."""
    def size(module):
        return sum(int(np.prod(p.shape)) for p in module.parameters())

    split = _trainer(train, "split", tower=tower, item_id_embedding=True)
    fl = _trainer(train, "fl", tower=tower, item_id_embedding=True)
    n_user, n_item = size(split.user_tower), size(split.item_tower)
    assert n_user > 0 and n_item > 0
    split.run_round()
    fl.run_round()
    a, b = split.cost_report(), fl.cost_report()
    assert a["paper_train_bytes_per_client_per_round"] == 8 * n_user
    assert b["paper_train_bytes_per_client_per_round"] == 8 * (n_user + n_item)
    for rep in (a, b):
        assert rep["paper_train_bytes_sttfedrec"] == 8 * n_user
        assert rep["paper_train_bytes_fl_dssm"] == 8 * (n_user + n_item)
        assert rep["paper_train_bytes_ratio_fl_over_sttfedrec"] == pytest.approx((n_user + n_item) / n_user)
    assert a["train_bytes_per_client_per_round"] > a["paper_train_bytes_per_client_per_round"]
    assert b["train_bytes_per_client_per_round"] > b["paper_train_bytes_per_client_per_round"]
    json.dumps(a, allow_nan=False)


def test_device_seconds_include_the_clients_chain_work(train):
    """Issue 25 item 5: the device's round = its own compute (timed alone) + its chain steps (mean
    over the round's clients, measured by the runner), each reported apart and in the cost report."""
    split = _trainer(train, "split")
    s = split.run_round().seconds
    assert s["client_secure"] > 0 and s["client_compute"] > 0
    assert s["client"] == pytest.approx(s["client_compute"] + s["client_secure"])
    rep = split.cost_report()
    assert rep["device_secure_seconds_per_round"] == pytest.approx(s["client_secure"])
    assert rep["device_train_seconds_per_round"] == pytest.approx(s["client"])
    fl = _trainer(train, "fl")
    assert "client_secure" not in fl.run_round().seconds and fl.cost_report()["device_secure_seconds_per_round"] == 0.0
    restored = _trainer(train, "split")
    restored.load_state_dict(state_from_bytes(state_to_bytes(split.state_dict())))
    assert restored.cost_report()["device_secure_seconds_per_round"] == rep["device_secure_seconds_per_round"]
