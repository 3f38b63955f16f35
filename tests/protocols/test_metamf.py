"""MetaMF: the client's gradient is the numerical gradient of its loss (hypernetwork included), generating
only the scored rows equals generating the whole item matrix, a round is the stated Adam step on the mean
gradient, training learns structure, secure sums agree, checkpoints continue exactly, bad configs are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments.run import config as cfgmod
from protocols.metamf import MetaMF, MetaMFConfig, MetaMFUpload, client_gradient
from protocols.registry import all_protocols
from protocols.state import state_from_bytes, state_to_bytes
from protocols.transport import InProcessTransport, Transcript
from recmodels.data import Interactions
from recmodels.metamf import SPARSE, collaborative_vector, init_params, item_rows, predict

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(user_dim=3, memory_slots=4, memory_dim=3, gen_hidden=3, item_dim=4, item_rank=2, rp_hidden=3,
            rp_layers=2)


def _data(n_users: int, n_items: int, per_user: int, seed: int = 0) -> Interactions:
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(n_users), per_user)
    items = np.concatenate([rng.choice(n_items, per_user, replace=False) for _ in range(n_users)])
    ratings = rng.integers(1, 6, len(users)).astype(np.float32)
    return Interactions(users, items, ratings, np.arange(len(users)), np.arange(n_users), np.arange(n_items))


def _loss(params: dict[str, torch.Tensor], e: torch.Tensor, items: np.ndarray, ratings: np.ndarray) -> float:
    lw, lb = item_rows(params, torch.as_tensor(items))
    pred = predict(params, e.reshape(1, -1), lw, lb, torch.zeros(len(items), dtype=torch.int64))
    return float(((pred - torch.as_tensor(ratings)) ** 2).mean())


@pytest.mark.parametrize("rp_layers", [1, 2, 3])
def test_client_gradient_is_the_finite_difference_gradient_of_its_loss(rp_layers: int) -> None:
    """Every coordinate of every meta parameter and of e_u, central differences (float64): the hypernetworks,
    the memory attention and the low-rank item generator; the unrated items' slices have zero gradient."""
    cfg = MetaMFConfig(**{**TINY, "rp_layers": rp_layers})
    gen = torch.Generator().manual_seed(3)
    params = init_params(cfg.shapes(6), init_bias=3.0, generator=gen)
    params = {k: v + 0.3 * torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()}
    e = torch.randn(3, generator=gen, dtype=torch.float64)
    items, ratings = np.array([4, 1, 2]), np.array([5.0, 1.0, 3.5])
    dense, lw, lb, ge, sse = client_gradient(params, e, items, ratings)
    assert sse == pytest.approx(3 * _loss(params, e, items, ratings))
    full = {**dense, SPARSE[0]: torch.zeros_like(params[SPARSE[0]]), SPARSE[1]: torch.zeros_like(params[SPARSE[1]])}
    full[SPARSE[0]][items], full[SPARSE[1]][items] = lw, lb
    h = 1e-6
    for name, p in [*params.items(), ("e", e)]:
        want = ge if name == "e" else full[name]
        num = torch.zeros_like(p).reshape(-1)
        for j in range(p.numel()):
            plus, minus = p.clone().reshape(-1), p.clone().reshape(-1)
            plus[j] += h
            minus[j] -= h
            if name == "e":
                hi, lo = _loss(params, plus, items, ratings), _loss(params, minus, items, ratings)
            else:
                hi = _loss({**params, name: plus.reshape(p.shape)}, e, items, ratings)
                lo = _loss({**params, name: minus.reshape(p.shape)}, e, items, ratings)
            num[j] = (hi - lo) / (2 * h)
        np.testing.assert_allclose(want.reshape(-1).numpy(), num.numpy(), atol=1e-7, rtol=1e-5, err_msg=name)
    assert not full[SPARSE[0]][[0, 3, 5]].any() and not full[SPARSE[1]][[0, 3, 5]].any()


def test_generating_only_the_scored_rows_equals_generating_the_whole_item_matrix() -> None:
    """``E_u = P Q`` over all items, then the rating network on rows ``items``: the paper's order of work."""
    cfg = MetaMFConfig(**TINY)
    params = init_params(cfg.shapes(7), init_bias=3.0, generator=torch.Generator().manual_seed(0))
    e = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    items = torch.tensor([[6, 0, 3], [2, 2, 5]])
    c = collaborative_vector(params, e)
    g = torch.relu(c @ params["item.hidden_w"].T + params["item.hidden_b"])
    p_all = torch.einsum("nrg,bg->bnr", params["item.left_w"], g) + params["item.left_b"]
    q = (g @ params["item.right_w"].T + params["item.right_b"]).view(2, cfg.item_rank, cfg.item_dim)
    e_all = p_all @ q  # [b, n_items, item_dim]
    x = torch.stack([e_all[b, items[b]] for b in range(2)])
    for l in range(cfg.rp_layers):
        h = torch.relu(c @ params[f"rp{l}.hidden_w"].T + params[f"rp{l}.hidden_b"])
        w = (h @ params[f"rp{l}.weight_w"].T + params[f"rp{l}.weight_b"]).view(2, x.shape[-1], -1)
        x = x @ w + (h @ params[f"rp{l}.bias_w"].T + params[f"rp{l}.bias_b"])[:, None, :]
        x = torch.relu(x) if l < cfg.rp_layers - 1 else x
    lw, lb = item_rows(params, items.reshape(-1))
    owner = torch.tensor([0, 0, 0, 1, 1, 1])
    torch.testing.assert_close(predict(params, e, lw, lb, owner), x[..., 0].reshape(-1), rtol=1e-12, atol=1e-12)


def test_a_round_is_one_adam_step_on_the_mean_client_gradient_and_uploads_only_rated_slices() -> None:
    train = _data(3, 10, 4)
    tr = InProcessTransport(Transcript(keep_payloads=True))
    cfg = MetaMFConfig(**TINY, lr=0.01, user_lr=0.02, reg=0.1)
    mm = MetaMF(train, cfg, seed=1, transport=tr)
    p0, e0 = {k: v.clone() for k, v in mm.params.items()}, mm.e.clone()
    grads = {k: torch.zeros_like(v) for k, v in p0.items()}
    ups = {r.payload.user: r.payload for r in tr.transcript.records if r.kind == "update"}
    stats = mm.run_round()
    ups = {r.payload.user: r.payload for r in tr.transcript.records if r.kind == "update"}
    sse = 0.0
    for u in range(3):
        items, ratings = mm.rated(u)
        dense, lw, lb, ge, s = client_gradient(p0, e0[u], items, ratings)
        sse += s
        for k, g in dense.items():
            grads[k] += g / 3
        grads[SPARSE[0]][items] += lw / 3
        grads[SPARSE[1]][items] += lb / 3
        # first Adam step: m^ = g, v^ = g^2, so the move is lr g / (|g| + eps)
        torch.testing.assert_close(mm.e[u], e0[u] - 0.02 * ge / (ge.abs() + 1e-8))
        up = ups[u]
        assert isinstance(up, MetaMFUpload)
        np.testing.assert_array_equal(up.items, np.sort(train.items[train.users == u]))
        assert up.item_rows.shape == (4, cfg.item_rank * (cfg.gen_hidden + 1))
        assert up.nbytes == 4 * (4 + up.item_rows.size + up.dense.size + 1)
    for k, p in p0.items():
        g = grads[k] + 0.1 * p
        torch.testing.assert_close(mm.params[k], p - 0.01 * g / (g.abs() + 1e-8))
    assert stats.loss == pytest.approx(sse / 12)
    assert stats.bytes_per_client == pytest.approx(mm.model_bytes + np.mean([u.nbytes for u in ups.values()]))


def test_the_one_pass_sum_equals_the_clients_computed_one_by_one() -> None:
    """Without kept payloads the round sums the clients' gradients in one pass; with them each client's
    upload is computed alone: the two give the same model."""
    train = _data(5, 9, 4, seed=2)
    cfg = MetaMFConfig(**TINY, client_fraction=0.6)
    alone = MetaMF(train, cfg, seed=3, transport=InProcessTransport(Transcript(keep_payloads=True)))
    together = MetaMF(train, cfg, seed=3)
    for _ in range(2):
        a, b = alone.run_round(), together.run_round()
        assert a.loss == pytest.approx(b.loss, rel=1e-12) and a.bytes_per_client == b.bytes_per_client
    for k in alone.params:
        torch.testing.assert_close(alone.params[k], together.params[k], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(alone.e, together.e, rtol=1e-9, atol=1e-12)


def _train_loss(mm: MetaMF, train: Interactions) -> float:
    return float(np.mean((mm.predict(train.users, train.items) - train.ratings) ** 2))


def test_one_round_lowers_the_training_loss() -> None:
    train = _data(12, 20, 6, seed=4)
    mm = MetaMF(train, MetaMFConfig(**TINY, lr=0.003), seed=0)
    before = _train_loss(mm, train)
    mm.run_round()
    assert _train_loss(mm, train) < before


def test_training_learns_structure_the_means_cannot() -> None:
    """Ratings from rank-2 user and item factors plus item effects (60% observed): after 80 rounds the held-out
    RMSE is well below predicting the training mean or each item's mean."""
    rng = np.random.default_rng(0)
    n_users, n_items = 40, 24
    u, v = rng.standard_normal((n_users, 2)), rng.standard_normal((n_items, 2))
    full = np.clip(3.0 + u @ v.T + 0.5 * rng.standard_normal(n_items) + 0.1 * rng.standard_normal((n_users, n_items)),
                   0.5, 5.5)
    users, items = np.nonzero(rng.random((n_users, n_items)) < 0.6)
    held = rng.random(len(users)) < 0.2
    mk = lambda s: Interactions(users[s], items[s], full[users[s], items[s]].astype(np.float32),  # noqa: E731
                                np.arange(int(s.sum())), np.arange(n_users), np.arange(n_items))
    train, test = mk(~held), mk(held)
    mm = MetaMF(train, MetaMFConfig(**TINY, lr=0.03, user_lr=0.05, reg=0.0), seed=0)
    for _ in range(80):
        mm.run_round()
    rmse = mm.evaluate(test)["rmse"]
    mean = float(np.sqrt(np.mean((test.ratings - train.ratings.mean()) ** 2)))
    item_mean = np.bincount(train.items, train.ratings, n_items) / np.maximum(np.bincount(train.items,
                                                                                          minlength=n_items), 1)
    item = float(np.sqrt(np.mean((test.ratings - item_mean[test.items]) ** 2)))
    assert rmse < 0.8 * min(mean, item), (rmse, mean, item)


def test_secure_aggregation_gives_the_plaintext_step() -> None:
    train = _data(4, 6, 3)
    plain = MetaMF(train, MetaMFConfig(**TINY), seed=2)
    tr = InProcessTransport(Transcript(keep_payloads=True))
    masked = MetaMF(train, MetaMFConfig(**TINY, secure_aggregation="secagg"), seed=2, transport=tr)
    a, b = plain.run_round(), masked.run_round()
    for k in plain.params:  # the first Adam step is lr g / (|g| + 1e-8): the 2^-24 fixed point moves it little
        torch.testing.assert_close(masked.params[k], plain.params[k], atol=1e-5, rtol=0)
    assert b.loss == pytest.approx(a.loss, abs=1e-5)
    ups = [r.payload for r in tr.transcript.records if r.kind == "update"]
    assert len(ups) == 4 and all(u.dtype == np.uint64 and u.size == masked.model_bytes // 4 + 2 for u in ups)


def test_checkpoints_are_tensors_and_json_and_continue_exactly() -> None:
    train = _data(6, 12, 4)
    cfg = MetaMFConfig(**TINY, client_fraction=0.5)
    mm = MetaMF(train, cfg, seed=0)
    mm.run_round()
    other = MetaMF(train, cfg, seed=5)
    other.load_state_dict(state_from_bytes(state_to_bytes(mm.state_dict())))
    mm.run_round()
    other.run_round()
    for k in mm.params:
        torch.testing.assert_close(mm.params[k], other.params[k], rtol=0, atol=0)
    torch.testing.assert_close(mm.e, other.e, rtol=0, atol=0)
    with pytest.raises(ValueError, match="different metamf configuration"):
        MetaMF(train, MetaMFConfig(**TINY, lr=0.5), seed=0).load_state_dict(mm.state_dict())


@pytest.mark.parametrize("field, value", [("user_dim", 0), ("item_rank", 2.0), ("rp_layers", True), ("lr", 0.0),
                                          ("lr", float("nan")), ("user_lr", -1.0), ("reg", -0.1),
                                          ("init_bias", "3.5"), ("secure_aggregation", "dpf")])
def test_a_bad_config_is_refused_naming_the_key(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"metamf.{field}"):
        MetaMFConfig(**{field: value})


def test_it_is_registered_with_a_rating_and_a_ranking_preset() -> None:
    specs = all_protocols()
    assert specs["metamf"].task == "rating" and specs["metamf-rank"].task == "ranking"
    assert specs["metamf"].config_cls is MetaMFConfig and specs["metamf-rank"].keeps_ratings
    assert {"metamf", "metamf-rank"} <= set(cfgmod.PRESETS)
    assert cfgmod.load_preset("metamf-rank").spec.name == "metamf-rank"
    assert "MetaMF" in cfgmod.preset_descriptions()["metamf"]
