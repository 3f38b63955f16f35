"""Tests of recmodels.sampling: training negatives and sampled evaluation candidates."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recmodels.data import Interactions
from recmodels.sampling import (
    EvalCandidates,
    sample_eval_candidates,
    sample_train_negatives,
    user_item_csr,
)
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic


def pairs_of(data):
    return set(zip(data.users.tolist(), data.items.tolist()))


def test_user_item_csr():
    d = generate_synthetic(n_users=30, n_items=20, seed=0)
    m = user_item_csr(d)
    assert m.shape == (30, 20) and m.dtype == bool and m.nnz == len(d)
    dense = m.toarray()
    assert dense[d.users, d.items].all()


def test_train_negatives_never_interacted_and_deterministic():
    d = generate_synthetic(n_users=100, n_items=40, seed=1, mean_interactions=15)
    users, items = sample_train_negatives(d, n_neg=4, rng=np.random.default_rng(7))
    assert users.dtype == np.int64 and items.dtype == np.int64
    assert users.size == items.size == 4 * len(d)
    assert np.array_equal(users, np.repeat(d.users, 4))
    dense = user_item_csr(d).toarray()
    assert not dense[users, items].any()
    u2, i2 = sample_train_negatives(d, n_neg=4, rng=np.random.default_rng(7))
    assert np.array_equal(items, i2)
    _, i3 = sample_train_negatives(d, n_neg=4, rng=np.random.default_rng(8))
    assert not np.array_equal(items, i3)


def test_train_negatives_are_uniform_over_allowed_items():
    # One user who interacted with items 0..4 of 10: negatives must be uniform over 5..9.
    d = Interactions(np.zeros(5, np.int64), np.arange(5), np.ones(5), np.arange(5), np.arange(1), np.arange(10))
    _, items = sample_train_negatives(d, n_neg=4000, rng=np.random.default_rng(0))
    counts = np.bincount(items, minlength=10)
    assert counts[:5].sum() == 0
    assert np.all(np.abs(counts[5:] / items.size - 0.2) < 0.02)


def test_train_negatives_errors():
    full = Interactions(np.zeros(3, np.int64), np.arange(3), np.ones(3), np.arange(3), np.arange(1), np.arange(3))
    with pytest.raises(ValueError, match="all 3 items"):
        sample_train_negatives(full, n_neg=1, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="Generator"):
        sample_train_negatives(full, n_neg=1, rng=np.random.RandomState(0))
    with pytest.raises(ValueError, match="n_neg"):
        sample_train_negatives(full, n_neg=-1, rng=np.random.default_rng(0))


def test_eval_candidates_invariants():
    d = generate_synthetic(n_users=150, n_items=200, seed=2)
    split = leave_one_out(d, seed=0, validation=True)
    c = sample_eval_candidates(split, n_negatives=99, rng=np.random.default_rng(3))
    assert isinstance(c, EvalCandidates) and c.n_negatives == 99
    assert c.items.shape == (150, 100) and c.items.dtype == np.int64
    assert np.array_equal(c.items[:, 0], split.test_items[c.users])
    seen = pairs_of(d)
    for row, u in enumerate(c.users):
        negs = c.items[row, 1:]
        assert len(set(negs.tolist())) == 99  # distinct
        assert all((int(u), int(i)) not in seen for i in negs)  # never interacted (train/test/valid)
    again = sample_eval_candidates(split, n_negatives=99, rng=np.random.default_rng(3))
    assert np.array_equal(c.items, again.items)


def test_eval_candidates_exclude_and_skip_users_without_test():
    d = Interactions(
        np.array([0, 0, 0, 2, 2]), np.array([0, 1, 2, 3, 4]), np.ones(5), np.arange(5),
        np.arange(3), np.arange(12),
    )
    split = leave_one_out(d, seed=0)
    extra = Interactions(np.array([0]), np.array([5]), np.ones(1), np.zeros(1, np.int64), np.arange(3), np.arange(12))
    c = sample_eval_candidates(split, n_negatives=8, rng=np.random.default_rng(0), exclude=extra)
    assert list(c.users) == [0, 2]
    # user 0 interacted with 0,1,2 and excluded 5: exactly the other 8 items remain.
    assert sorted(c.items[0, 1:].tolist()) == [3, 4, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="fewer than n_negatives=9"):
        sample_eval_candidates(split, n_negatives=9, rng=np.random.default_rng(0), exclude=extra)


@settings(max_examples=30, deadline=None)
@given(
    n_items=st.integers(6, 40),
    n_neg=st.integers(1, 30),
    seed=st.integers(0, 1000),
    density=st.floats(0.05, 0.8),
)
def test_eval_candidates_property(n_items, n_neg, seed, density):
    rng = np.random.default_rng(seed)
    n_users = 12
    mask = rng.random((n_users, n_items)) < density
    mask[:, :2] = True  # every user has >= 2 interactions
    users, items = np.nonzero(mask)
    d = Interactions(users, items, np.ones(users.size), rng.integers(0, 5, users.size),
                     np.arange(n_users), np.arange(n_items))
    split = leave_one_out(d, seed=seed)
    allowed = n_items - mask.sum(1)
    if allowed.min() < n_neg:
        with pytest.raises(ValueError, match="non-interacted"):
            sample_eval_candidates(split, n_negatives=n_neg, rng=np.random.default_rng(seed))
        return
    c = sample_eval_candidates(split, n_negatives=n_neg, rng=np.random.default_rng(seed))
    negs = c.items[:, 1:]
    assert not mask[c.users[:, None], negs].any()
    assert all(len(set(r)) == n_neg for r in negs.tolist())
