"""recmodels.mf: the batched local updates equal a per-user, per-item loop (FedMF's user_update)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from recmodels.data import Interactions
from recmodels.mf import MFConfig, init_factors, local_updates, mae, rating_lists, rmse


def _data(seed: int, n_users: int, n_items: int) -> Interactions:
    rng = np.random.default_rng(seed)
    users, items = [], []
    for u in range(n_users):
        k = int(rng.integers(1, n_items + 1))
        chosen = rng.choice(n_items, size=k, replace=False)
        users += [u] * k
        items += list(chosen)
    n = len(users)
    return Interactions(np.array(users), np.array(items), rng.integers(1, 6, n).astype(np.float32),
                        np.arange(n), np.arange(n_users), np.arange(n_items))


def _oracle(p, q, data, cfg):
    """FedMF's reference user_update, one user and one item at a time."""
    p = p.copy()
    deltas = []
    for u in range(data.n_users):
        rows = np.flatnonzero(data.users == u)
        rows = rows[np.argsort(data.items[rows])]
        d = {}
        if cfg.user_update == "sequential":
            for r in rows:
                i, rating = data.items[r], float(data.ratings[r])
                e = rating - p[u] @ q[i]
                p[u] = p[u] - cfg.lr * (-2 * e * q[i] + 2 * cfg.reg_user * p[u])
                d[int(i)] = -cfg.lr * (-2 * e * p[u] + 2 * cfg.reg_item * q[i])
        else:
            step = 2 * cfg.reg_user * p[u]
            for r in rows:
                i, rating = data.items[r], float(data.ratings[r])
                e = rating - p[u] @ q[i]
                d[int(i)] = -cfg.lr * (-2 * e * p[u] + 2 * cfg.reg_item * q[i])
                step = step - 2 * e * q[i]
            p[u] = p[u] - cfg.lr * step
        deltas.append(d)
    return p, deltas


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n_users=st.integers(1, 6), n_items=st.integers(1, 8),
       mode=st.sampled_from(["sequential", "batch"]))
def test_batched_updates_equal_the_per_item_loop(seed, n_users, n_items, mode):
    data = _data(seed, n_users, n_items)
    cfg = MFConfig(dim=3, user_update=mode)
    p, q = init_factors(n_users, n_items, cfg, np.random.default_rng(seed))
    lists = rating_lists(data)
    p_new, delta = local_updates(p, q, lists, cfg)
    p_ref, d_ref = _oracle(p, q, data, cfg)
    np.testing.assert_allclose(p_new, p_ref, rtol=1e-12, atol=1e-12)
    for u in range(n_users):
        k = lists.counts[u]
        assert sorted(d_ref[u]) == list(lists.items[u, :k])
        np.testing.assert_allclose(delta[u, :k], np.stack([d_ref[u][int(i)] for i in lists.items[u, :k]]), atol=1e-12)
        assert not delta[u, k:].any()


def test_metrics_closed_form():
    assert rmse(np.array([1.0, 3.0]), np.array([2.0, 5.0])) == pytest.approx(np.sqrt(2.5))
    assert mae(np.array([1.0, 3.0]), np.array([2.0, 5.0])) == pytest.approx(1.5)


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="user_update"):
        MFConfig(user_update="adam")
    with pytest.raises(ValueError, match="lr"):
        MFConfig(lr=0.0)
