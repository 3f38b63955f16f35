"""Tests of recmodels.metrics: closed-form fixtures, properties, sampled and full protocols."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from recmodels.metrics import (
    METRIC_INFO,
    evaluate_full,
    evaluate_sampled,
    metrics_from_ranks,
    rank_of_target,
)
from recmodels.sampling import EvalCandidates, sample_eval_candidates
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic

NAMES = {"HR@10", "NDCG@10", "Precision@10", "Recall@10", "MRR", "AUC"}


def test_rank_fixture_and_ties_against_target():
    scores = np.array(
        [
            [0.9, 0.1, 0.5, 0.3],  # target best -> 1
            [0.2, 0.9, 0.5, 0.3],  # three above -> 4
            [0.5, 0.5, 0.5, 0.5],  # all tied -> worst (4)
            [0.5, 0.6, 0.5, 0.1],  # one above, one tied -> 3
        ]
    )
    assert rank_of_target(scores).tolist() == [1, 4, 4, 3]
    assert rank_of_target(scores, target_col=np.array([1, 1, 2, 3])).tolist() == [4, 1, 4, 4]
    mask = np.array([[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=bool)
    assert rank_of_target(scores, 0, mask).tolist() == [1, 3, 2, 3]


def test_rank_errors():
    with pytest.raises(ValueError, match="NaN"):
        rank_of_target(np.array([[np.nan, 1.0]]))
    # NaN in a masked-out entry is ignored; NaN on the target is not.
    assert rank_of_target(np.array([[1.0, np.nan]]), 0, np.array([[True, False]])).tolist() == [1]
    with pytest.raises(ValueError, match="NaN"):
        rank_of_target(np.array([[np.nan, 1.0]]), 0, np.array([[False, True]]))
    with pytest.raises(ValueError, match="2-D"):
        rank_of_target(np.zeros(3))
    with pytest.raises(ValueError, match="target_col"):
        rank_of_target(np.zeros((2, 3)), 3)


def test_metrics_closed_form():
    ranks = np.array([1, 2, 11, 100])
    m = metrics_from_ranks(ranks, 100, ks=(10,))
    assert set(m) == NAMES
    assert m["HR@10"] == pytest.approx(0.5)
    assert m["NDCG@10"] == pytest.approx((1 + 1 / math.log2(3)) / 4)
    assert m["Precision@10"] == pytest.approx(0.05)
    assert m["Recall@10"] == pytest.approx(0.5)
    assert m["MRR"] == pytest.approx((1 + 1 / 2 + 1 / 11 + 1 / 100) / 4)
    assert m["AUC"] == pytest.approx((99 / 99 + 98 / 99 + 89 / 99 + 0) / 4)
    per_user = metrics_from_ranks(np.array([2, 2]), np.array([3, 5]), ks=(1,))
    assert per_user["AUC"] == pytest.approx((0.5 + 0.75) / 2)
    assert set(metrics_from_ranks(ranks, 100)) >= {"HR@5", "NDCG@20", "Precision@5"}
    assert all(math.isnan(v) for v in metrics_from_ranks(np.array([], dtype=int), 10).values())
    with pytest.raises(ValueError, match="1..n_candidates"):
        metrics_from_ranks(np.array([0]), 10)
    with pytest.raises(ValueError, match="1..n_candidates"):
        metrics_from_ranks(np.array([11]), 10)
    with pytest.raises(ValueError, match="K"):
        metrics_from_ranks(np.array([1]), 10, ks=(0,))
    assert set(METRIC_INFO) == {"HR@K", "NDCG@K", "Precision@K", "Recall@K", "MRR", "AUC"}


@settings(max_examples=60, deadline=None)
@given(
    scores=arrays(np.float64, st.tuples(st.integers(1, 8), st.integers(2, 12)),
                  elements=st.sampled_from([0.0, 0.25, 0.5, 1.0, -1.0, 3.0])),
    k=st.integers(1, 12),
    seed=st.integers(0, 10_000),
)
def test_metric_properties(scores, k, seed):
    b, m = scores.shape
    ranks = rank_of_target(scores)
    out = metrics_from_ranks(ranks, m, ks=(k,))
    assert 0 <= out[f"NDCG@{k}"] <= out[f"HR@{k}"] <= 1
    assert 0 < out["MRR"] <= 1 and 0 <= out["AUC"] <= 1
    # Brute-force oracle of the rank rule.
    brute = [1 + sum(scores[r, j] >= scores[r, 0] for j in range(1, m)) for r in range(b)]
    assert ranks.tolist() == brute
    # Invariance under relabelling items / permuting candidate columns (target moves with them).
    perm = np.random.default_rng(seed).permutation(m)
    target = np.argsort(perm)[0]  # new column of the old column 0
    assert np.array_equal(rank_of_target(scores[:, perm], target), ranks)
    # Perfect scorer: the target strictly above everything else -> every metric 1.0.
    perfect = scores.copy()
    perfect[:, 0] = scores.max() + 1
    best = metrics_from_ranks(rank_of_target(perfect), m, ks=(k,))
    assert best[f"HR@{k}"] == best[f"NDCG@{k}"] == best["MRR"] == best["AUC"] == 1.0
    # Constant scorer: worst rank m for everyone.
    const = rank_of_target(np.full_like(scores, 0.7))
    assert np.all(const == m)
    assert metrics_from_ranks(const, m, ks=(k,))["AUC"] == 0.0


def test_evaluate_sampled_matches_manual_and_batches():
    rng = np.random.default_rng(0)
    users = np.arange(50)
    items = np.stack([rng.permutation(30)[:11] for _ in users])
    cands = EvalCandidates(users=users, items=items)
    table = rng.standard_normal((50, 30))

    def score(u, i):
        return table[u[:, None], i]

    full = evaluate_sampled(score, cands, ks=(10,), batch_users=7)
    manual = metrics_from_ranks(rank_of_target(table[users[:, None], items]), 11, ks=(10,))
    assert full == pytest.approx(manual)
    with pytest.raises(ValueError, match="shape"):
        evaluate_sampled(lambda u, i: np.zeros((len(u), 3)), cands)
    const = evaluate_sampled(lambda u, i: np.ones(i.shape), cands, ks=(10,))
    assert const["HR@10"] == 0.0 and const["MRR"] == pytest.approx(1 / 11)


def test_evaluate_full_against_brute_force():
    d = generate_synthetic(n_users=60, n_items=50, seed=4)
    split = leave_one_out(d, seed=1, validation=True)
    rng = np.random.default_rng(2)
    table = rng.integers(0, 5, size=(d.n_users, d.n_items)).astype(float)  # many ties
    got = evaluate_full(lambda u: table[u], split, ks=(5, 10), batch_users=16)
    train_sets = [set(split.train.items[split.train.users == u].tolist()) for u in range(d.n_users)]
    ranks, n_cand = [], []
    for u in range(d.n_users):
        t, v = split.test_items[u], split.valid_items[u]
        cand = [i for i in range(d.n_items) if i not in train_sets[u] and i != v]
        assert t in cand
        ranks.append(1 + sum(table[u, i] >= table[u, t] for i in cand if i != t))
        n_cand.append(len(cand))
    assert got == pytest.approx(metrics_from_ranks(np.array(ranks), np.array(n_cand), ks=(5, 10)))


def test_evaluate_full_perfect_and_constant():
    d = generate_synthetic(n_users=40, n_items=60, seed=6)
    split = leave_one_out(d, seed=0)
    onehot = np.zeros((d.n_users, d.n_items))
    onehot[np.arange(d.n_users), split.test_items] = 1.0
    assert evaluate_full(lambda u: onehot[u], split)["NDCG@10"] == 1.0
    worst = evaluate_full(lambda u: np.zeros((len(u), d.n_items)), split)
    assert worst["HR@20"] == 0.0 and worst["AUC"] == 0.0


def test_sampled_and_full_agree_for_oracle_on_synthetic():
    d = generate_synthetic(n_users=200, n_items=150, seed=8)
    split = leave_one_out(d, seed=0)
    cands = sample_eval_candidates(split, n_negatives=49, rng=np.random.default_rng(0))
    onehot = np.zeros((d.n_users, d.n_items))
    onehot[np.arange(d.n_users), split.test_items] = 1.0
    assert evaluate_sampled(lambda u, i: onehot[u[:, None], i], cands)["HR@5"] == 1.0


def test_a_user_with_only_the_held_out_candidate_counts_except_in_auc():
    """Issue 9, item 9: a user who interacted with every other item has one candidate under full
    ranking; it is a hit at every K, and AUC (undefined for it) averages over the others."""
    from recmodels.metrics import metrics_from_ranks

    m = metrics_from_ranks(np.array([1, 2]), np.array([1, 3]), ks=(1,))
    assert m["HR@1"] == 0.5 and m["MRR"] == 0.75 and m["AUC"] == 0.5
    only = metrics_from_ranks(np.array([1]), np.array([1]), ks=(1,))
    assert only["HR@1"] == 1.0 and np.isnan(only["AUC"])
    with pytest.raises(ValueError, match="at least its held-out item"):
        metrics_from_ranks(np.array([1]), np.array([0]), ks=(1,))
