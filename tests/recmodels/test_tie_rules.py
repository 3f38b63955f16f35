"""Tests of the explicit tie rules of recmodels.metrics (pessimistic / optimistic / random) and of
candidate masks (EvalCandidates.valid), which a paper's candidate files need."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recmodels.metrics import (
    TIE_RULES,
    evaluate_full,
    evaluate_full_by_rule,
    evaluate_sampled,
    evaluate_sampled_by_rule,
    metrics_from_rank_range,
    metrics_from_ranks,
    rank_of_target,
    rank_range,
)
from recmodels.sampling import EvalCandidates, sample_eval_candidates
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic


def test_rank_range_fixture():
    scores = np.array([[0.5, 0.5, 0.5, 0.5], [0.5, 0.6, 0.5, 0.1], [0.9, 0.1, 0.2, 0.3]])
    best, worst = rank_range(scores)
    assert best.tolist() == [1, 2, 1]
    assert worst.tolist() == [4, 3, 1]
    assert worst.tolist() == rank_of_target(scores).tolist()
    mask = np.array([[1, 0, 0, 1], [1, 1, 0, 1], [1, 1, 1, 1]], dtype=bool)
    best, worst = rank_range(scores, 0, mask)
    assert best.tolist() == [1, 2, 1] and worst.tolist() == [2, 2, 1]


def test_all_tied_scores_show_the_three_rules_apart():
    # collapsed scores (LightFR's collapsed codes): the optimistic rule gives HR 1, the random one 10/50.
    cands = EvalCandidates(users=np.arange(3), items=np.arange(150).reshape(3, 50))
    by = evaluate_sampled_by_rule(lambda u, i: np.zeros(i.shape), cands, ks=(10,))
    assert set(by) == set(TIE_RULES)
    assert by["optimistic"]["HR@10"] == 1.0
    assert by["pessimistic"]["HR@10"] == 0.0
    assert by["random"]["HR@10"] == pytest.approx(10 / 50)
    assert by["random"]["AUC"] == pytest.approx(0.5)
    assert by["random"]["MRR"] == pytest.approx(sum(1 / r for r in range(1, 51)) / 50)
    assert evaluate_sampled(lambda u, i: np.zeros(i.shape), cands, ks=(10,)) == by["pessimistic"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=8), st.integers(1, 15))
def test_random_rule_is_the_mean_over_every_order_of_the_tied(pairs, k):
    # brute force: the mean of metrics_from_ranks over every rank in best..worst, user by user
    n_cand = 20
    best = np.array([b for b, _ in pairs])
    worst = np.minimum(best + np.array([t for _, t in pairs]), n_cand)
    got = metrics_from_rank_range(best, worst, n_cand, ks=(k,))
    per_user = []
    for b, w in zip(best, worst):
        rows = [metrics_from_ranks(np.array([r]), n_cand, ks=(k,)) for r in range(b, w + 1)]
        per_user.append({name: np.mean([row[name] for row in rows]) for name in rows[0]})
    for name, value in got.items():
        assert value == pytest.approx(np.mean([p[name] for p in per_user]), abs=1e-12), name


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=10))
def test_random_rule_without_ties_equals_the_plain_metrics(ranks):
    r = np.array(ranks)
    a, b = metrics_from_rank_range(r, r, 30), metrics_from_ranks(r, 30)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == pytest.approx(b[name], abs=1e-12)


def test_rank_range_errors():
    with pytest.raises(ValueError, match="best <= worst"):
        metrics_from_rank_range(np.array([3]), np.array([2]), 10)
    with pytest.raises(ValueError, match="1..n_candidates"):
        metrics_from_rank_range(np.array([1]), np.array([11]), 10)
    with pytest.raises(ValueError, match="1..n_candidates"):
        metrics_from_rank_range(np.array([0]), np.array([1]), 10)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 9), st.integers(1, 5))
def test_order_of_rules_on_random_integer_scores(seed, m, levels):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, levels, size=(6, m)).astype(float)
    cands = EvalCandidates(users=np.arange(6), items=np.arange(6 * m).reshape(6, m))
    by = evaluate_sampled_by_rule(lambda u, i: scores[u], cands, ks=(1, 3))
    for name in by["random"]:
        assert by["pessimistic"][name] <= by["random"][name] + 1e-12 <= by["optimistic"][name] + 2e-12, name
    # the random rule, estimated by shuffling ties many times, agrees with the exact expectation
    draws = []
    for _ in range(200):
        jitter = rng.random(scores.shape) * 1e-3
        draws.append(evaluate_sampled(lambda u, i: scores[u] + jitter[u], cands, ks=(1, 3))["HR@3"])
    assert np.mean(draws) == pytest.approx(by["random"]["HR@3"], abs=0.06)


def test_masked_candidates_do_not_compete():
    items = np.array([[5, 6, 7, 5], [8, 9, 9, 8]])
    valid = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=bool)
    cands = EvalCandidates(users=np.array([0, 1]), items=items, valid=valid, source="file")
    assert cands.n_candidates().tolist() == [3, 3]
    # the masked copies of the target would tie with it; masked, the target is first under every rule
    by = evaluate_sampled_by_rule(lambda u, i: (i == i[:, :1]).astype(float), cands, ks=(1,))
    for rule in TIE_RULES:
        assert by[rule]["HR@1"] == 1.0, rule
        assert by[rule]["AUC"] == 1.0, rule
    sub = cands.take(np.array([1]))
    assert sub.items.tolist() == [[8, 9, 9, 8]] and sub.valid.tolist() == [[True, True, True, False]]
    assert sub.source == "file"


def test_eval_candidates_checks_its_shape_and_mask():
    with pytest.raises(ValueError, match="one row per user"):
        EvalCandidates(users=np.arange(2), items=np.zeros((3, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="shape"):
        EvalCandidates(users=np.arange(2), items=np.zeros((2, 4), dtype=np.int64), valid=np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="column 0"):
        EvalCandidates(users=np.arange(1), items=np.zeros((1, 2), dtype=np.int64), valid=np.array([[False, True]]))


def test_full_ranking_by_rule_and_validation_target():
    data = generate_synthetic(n_users=30, n_items=40, mean_interactions=8, seed=3)
    split = leave_one_out(data, seed=0, validation=True)
    zero = lambda users: np.zeros((len(users), data.n_items))  # noqa: E731
    by = evaluate_full_by_rule(zero, split, ks=(10,))
    assert by["pessimistic"] == evaluate_full(zero, split, ks=(10,))
    assert by["optimistic"]["HR@10"] == 1.0 and by["pessimistic"]["HR@10"] == 0.0
    # an oracle of the validation items ranks them first; their test items are not candidates
    oracle = np.zeros((data.n_users, data.n_items))
    vu = np.flatnonzero(split.valid_items >= 0)
    oracle[vu, split.valid_items[vu]] = 1.0
    oracle[split.test_users, split.test_items[split.test_users]] = 2.0  # would beat them if it competed
    val = evaluate_full_by_rule(lambda users: oracle[users], split, ks=(1,), target="valid")
    assert val["pessimistic"]["HR@1"] == 1.0
    with pytest.raises(ValueError, match="target"):
        evaluate_full_by_rule(zero, split, target="train")
    no_valid = leave_one_out(data, seed=0)
    with pytest.raises(ValueError, match="validation"):
        evaluate_full_by_rule(zero, no_valid, target="valid")


def test_sampled_validation_candidates_avoid_every_held_out_item():
    data = generate_synthetic(n_users=40, n_items=60, mean_interactions=9, seed=5)
    split = leave_one_out(data, seed=0, validation=True)
    cands = sample_eval_candidates(split, n_negatives=10, rng=np.random.default_rng(0), target="valid")
    vu = np.flatnonzero(split.valid_items >= 0)
    assert cands.users.tolist() == vu.tolist()
    assert cands.items[:, 0].tolist() == split.valid_items[vu].tolist()
    seen = {(int(u), int(i)) for u, i in zip(split.train.users, split.train.items)}
    for u, row in zip(cands.users, cands.items):
        for i in row[1:]:
            assert (int(u), int(i)) not in seen
            assert i != split.test_items[u] and i != split.valid_items[u]
    with pytest.raises(ValueError, match="target"):
        sample_eval_candidates(split, n_negatives=3, rng=np.random.default_rng(0), target="x")
    with pytest.raises(ValueError, match="validation"):
        sample_eval_candidates(leave_one_out(data, seed=0), n_negatives=3, rng=np.random.default_rng(0), target="valid")


def test_every_permutation_of_a_small_tie_averages_to_the_random_rule():
    # target tied with two rivals, one rival above: ranks 2, 3, 4 equally likely
    scores = np.array([[1.0, 2.0, 1.0, 1.0, 0.0]])
    best, worst = rank_range(scores)
    assert (best[0], worst[0]) == (2, 4)
    got = metrics_from_rank_range(best, worst, 5, ks=(3,))
    expect = np.mean([metrics_from_ranks(np.array([r]), 5, ks=(3,))["NDCG@3"] for r in (2, 3, 4)])
    assert got["NDCG@3"] == pytest.approx(expect)
    assert got["HR@3"] == pytest.approx(2 / 3)
    assert math.isclose(got["MRR"], (1 / 2 + 1 / 3 + 1 / 4) / 3)
    assert list(itertools.islice(TIE_RULES, 1)) == ["pessimistic"]
