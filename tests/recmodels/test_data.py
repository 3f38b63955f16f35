"""Tests of recmodels.data (the Interactions type, filters, binarisation) and the synthetic generator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recmodels.data import (
    Interactions,
    binarize,
    deduplicate,
    filter_min_interactions,
    interaction_stats,
)
from recmodels.synthetic import generate_synthetic, true_logits


def make(users, items, ratings=None, ts=None, n_users=None, n_items=None, **kw):
    users = np.asarray(users)
    items = np.asarray(items)
    n_users = n_users if n_users is not None else int(users.max()) + 1
    n_items = n_items if n_items is not None else int(items.max()) + 1
    return Interactions(
        users=users,
        items=items,
        ratings=np.ones(len(users)) if ratings is None else np.asarray(ratings),
        timestamps=np.arange(len(users)) if ts is None else np.asarray(ts),
        user_ids=np.arange(100, 100 + n_users),
        item_ids=np.arange(200, 200 + n_items),
        source="fixture",
        **kw,
    )


def test_dtypes_sizes_and_describe():
    d = make([0, 0, 1], [0, 1, 1], ratings=[5, 3, 4])
    assert d.users.dtype == np.int64 and d.items.dtype == np.int64
    assert d.ratings.dtype == np.float32 and d.timestamps.dtype == np.int64
    assert (d.n_users, d.n_items, len(d)) == (2, 2, 3)
    assert d.describe() == "fixture: 2 users, 2 items, 3 interactions, density 75.0000%"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"users": [0, 1], "items": [0]}, "equal length"),
        ({"users": [0, 5], "items": [0, 1], "n_users": 2}, "0..1"),
        ({"users": [0, 1], "items": [0, -1], "n_items": 2}, "0..1"),
        ({"users": [0.0, 1.0], "items": [0, 1]}, "integers"),
        ({"users": [0, 1], "items": [0, 1], "ratings": [1.0, np.nan]}, "finite"),
        ({"users": [0, 0], "items": [1, 1]}, "deduplicate"),
    ],
)
def test_validation_errors(kwargs, fragment):
    users = kwargs.pop("users")
    items = kwargs.pop("items")
    if len(users) != len(items):
        with pytest.raises(ValueError, match=fragment):
            Interactions(
                users=np.asarray(users), items=np.asarray(items), ratings=np.ones(len(users)),
                timestamps=np.zeros(len(users), dtype=np.int64), user_ids=np.arange(2),
                item_ids=np.arange(2),
            )
        return
    with pytest.raises(ValueError, match=fragment):
        make(users, items, n_users=kwargs.pop("n_users", 2), n_items=kwargs.pop("n_items", 2), **kwargs)


def test_filter_iterates_to_fixpoint_and_reindexes():
    # user 0: items 0,1,2 ; user 1: items 0,3 ; user 2: item 3 only.
    d = make([0, 0, 0, 1, 1, 2], [0, 1, 2, 0, 3, 3])
    # min_item=2 removes items 1,2 (one user each); then user 0 has 1 item -> removed with min_user=2;
    # then item 0 has 1 user -> removed; then user 1 has 1 item -> removed ... down to nothing but item 3.
    with pytest.raises(ValueError, match="no interactions left"):
        filter_min_interactions(d, min_user=2, min_item=2)
    f = filter_min_interactions(d, min_user=2)
    assert f.n_users == 2 and list(f.user_ids) == [100, 101]
    assert f.n_items == 4 and len(f) == 5
    g = filter_min_interactions(d, min_user=1, min_item=2)
    assert list(g.item_ids) == [200, 203]
    assert np.all(np.bincount(g.items) >= 2)


def _k_core(pairs: set[tuple[int, int]], min_user: int, min_item: int) -> set[tuple[int, int]]:
    """Independent oracle: drop under-threshold users and items with Python sets until stable."""
    from collections import Counter

    core = set(pairs)
    while True:
        uc, ic = Counter(u for u, _ in core), Counter(i for _, i in core)
        kept = {(u, i) for u, i in core if uc[u] >= min_user and ic[i] >= min_item}
        if kept == core:
            return core
        core = kept


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.sets(st.tuples(st.integers(0, 7), st.integers(0, 9)), min_size=1, max_size=60),
    min_user=st.integers(0, 4),
    min_item=st.integers(0, 4),
)
def test_filter_property(pairs, min_user, min_item):
    users, items = map(np.array, zip(*sorted(pairs)))
    d = make(users, items, n_users=8, n_items=10)
    core = _k_core(pairs, min_user, min_item)
    if not core:  # asserted, not swallowed: it used to `return` on any ValueError
        with pytest.raises(ValueError, match="no interactions left"):
            filter_min_interactions(d, min_user=min_user, min_item=min_item)
        return
    f = filter_min_interactions(d, min_user=min_user, min_item=min_item)
    assert set(zip((f.user_ids[f.users] - 100).tolist(), (f.item_ids[f.items] - 200).tolist())) == core
    uc = np.bincount(f.users, minlength=f.n_users)
    ic = np.bincount(f.items, minlength=f.n_items)
    assert uc.min() >= max(min_user, 1) and ic.min() >= max(min_item, 1)
    # Every kept pair existed, mapped back through the raw ids.
    kept = set(zip(f.user_ids[f.users] - 100, f.item_ids[f.items] - 200))
    assert kept <= set(map(tuple, np.stack([users, items], 1).tolist()))
    # Maximality: the k-core is unique, and filtering it again changes nothing.
    g = filter_min_interactions(f, min_user=min_user, min_item=min_item)
    assert len(g) == len(f)


def test_binarize_default_and_threshold():
    d = make([0, 0, 1, 1], [0, 1, 0, 1], ratings=[5, 2, 4, 3.5])
    b = binarize(d)
    assert len(b) == 4 and np.all(b.ratings == 1.0)
    t = binarize(d, threshold=4)
    assert len(t) == 2 and np.all(t.ratings == 1.0)
    assert set(zip(t.users, t.items)) == {(0, 0), (1, 0)}
    assert t.n_items == 2  # id maps kept
    with pytest.raises(ValueError, match="threshold"):
        binarize(d, threshold=float("nan"))


def test_deduplicate_keeps_latest():
    d = make([0, 0, 1], [1, 1, 0], ratings=[1, 5, 3], ts=[10, 5, 1], check_duplicates=False)
    out, removed = deduplicate(d)
    assert removed == 1 and len(out) == 2
    assert out.ratings[out.users == 0][0] == 1  # timestamp 10 wins


def test_stats_are_json_serialisable():
    import json

    d = make([0, 0, 1], [0, 1, 1], ratings=[5, 3, 4])
    s = interaction_stats(d)
    json.dumps(s)
    assert s["n_interactions"] == 3 and s["interactions_per_user"]["max"] == 2


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_valid():
    a = generate_synthetic(n_users=200, n_items=100, seed=3)
    b = generate_synthetic(n_users=200, n_items=100, seed=3)
    c = generate_synthetic(n_users=200, n_items=100, seed=4)
    for name in ("users", "items", "ratings", "timestamps"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.items, c.items)
    assert set(np.unique(a.ratings)) <= {1, 2, 3, 4, 5}
    assert len(np.unique(a.ratings)) == 5
    assert np.bincount(a.users).min() >= 3
    # no duplicate pair (construction with the check on must succeed)
    Interactions(a.users, a.items, a.ratings, a.timestamps, a.user_ids, a.item_ids)
    # per user, timestamps strictly increase in row order
    same = a.users[1:] == a.users[:-1]
    assert np.all(np.diff(a.timestamps)[same] > 0)
    assert "seed=3" in a.source


def test_synthetic_popularity_skew_controls_concentration():
    flat = generate_synthetic(n_users=300, n_items=200, popularity_skew=0.0, seed=1)
    skew = generate_synthetic(n_users=300, n_items=200, popularity_skew=1.5, seed=1)

    def top_share(d):
        c = np.sort(np.bincount(d.items, minlength=d.n_items))[::-1]
        return c[:20].sum() / c.sum()

    assert top_share(skew) > top_share(flat) + 0.1


def test_synthetic_latent_signal_beats_popularity():
    """Ranking by the generator's true logits beats popularity on the held-out item."""
    from recmodels.metrics import evaluate_sampled
    from recmodels.sampling import sample_eval_candidates
    from recmodels.splits import leave_one_out

    kw = dict(n_users=600, n_items=400, seed=5)
    d = generate_synthetic(**kw)
    split = leave_one_out(d, seed=0)
    cands = sample_eval_candidates(split, rng=np.random.default_rng(0))
    logits = true_logits(**kw)
    pop = np.bincount(split.train.items, minlength=d.n_items).astype(float)
    oracle = evaluate_sampled(lambda u, i: logits[u[:, None], i], cands)
    popularity = evaluate_sampled(lambda u, i: pop[i], cands)
    assert oracle["HR@10"] > popularity["HR@10"] + 0.25
    assert oracle["NDCG@10"] > popularity["NDCG@10"] + 0.15


def test_synthetic_learnable_by_centralised_mf():
    """A quick numpy logistic MF (BCE, sampled negatives) beats popularity on held-out items."""
    from recmodels.metrics import evaluate_sampled
    from recmodels.sampling import sample_eval_candidates, sample_train_negatives
    from recmodels.splits import leave_one_out

    d = generate_synthetic(n_users=400, n_items=200, seed=2)
    split = leave_one_out(d, seed=0)
    train = split.train
    rng = np.random.default_rng(0)
    k = 16
    P = 0.1 * rng.standard_normal((d.n_users, k))
    Q = 0.1 * rng.standard_normal((d.n_items, k))
    bias = np.zeros(d.n_items)
    lr, reg = 0.1, 1e-4
    for _ in range(40):
        nu, ni = sample_train_negatives(train, n_neg=4, rng=rng)
        u = np.concatenate([train.users, nu])
        i = np.concatenate([train.items, ni])
        y = np.concatenate([np.ones(len(train)), np.zeros(nu.size)])
        for idx in np.array_split(rng.permutation(u.size), 20):
            uu, ii = u[idx], i[idx]
            pred = 1 / (1 + np.exp(-((P[uu] * Q[ii]).sum(1) + bias[ii])))
            g = pred - y[idx]
            gp = g[:, None] * Q[ii] + reg * P[uu]
            gq = g[:, None] * P[uu] + reg * Q[ii]
            np.add.at(P, uu, -lr * gp)
            np.add.at(Q, ii, -lr * gq)
            np.add.at(bias, ii, -lr * g)
    cands = sample_eval_candidates(split, rng=np.random.default_rng(1))
    pop = np.bincount(train.items, minlength=d.n_items).astype(float)
    mf = evaluate_sampled(lambda u, i: (P[u][:, None, :] * Q[i]).sum(-1) + bias[i], cands)
    popularity = evaluate_sampled(lambda u, i: pop[i], cands)
    assert mf["HR@10"] > popularity["HR@10"] + 0.1, (mf["HR@10"], popularity["HR@10"])


def test_synthetic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_items"):
        generate_synthetic(n_items=3)
    with pytest.raises(ValueError, match="popularity_skew"):
        generate_synthetic(popularity_skew=-1.0)
