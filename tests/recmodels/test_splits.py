"""Tests of recmodels.splits: leave-one-out and the per-user ratio split."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recmodels.data import Interactions, filter_min_interactions
from recmodels.splits import leave_one_out, ratio_split
from recmodels.synthetic import generate_synthetic


def make(users, items, ts, n_users=None, n_items=None):
    users = np.asarray(users)
    items = np.asarray(items)
    return Interactions(
        users=users, items=items, ratings=np.ones(len(users)), timestamps=np.asarray(ts),
        user_ids=np.arange(n_users or users.max() + 1), item_ids=np.arange(n_items or items.max() + 1),
        source="fixture",
    )


def test_loo_holds_out_latest_fixture():
    d = make([0, 0, 0, 1, 1], [0, 1, 2, 2, 3], [30, 10, 20, 5, 1])
    s = leave_one_out(d, seed=0)
    assert list(s.test_items) == [0, 2]
    assert s.valid_items is None
    assert set(zip(s.train.users, s.train.items)) == {(0, 1), (0, 2), (1, 3)}
    assert (s.train.n_users, s.train.n_items) == (d.n_users, d.n_items)
    v = leave_one_out(make([0, 0, 0], [0, 1, 2], [3, 1, 2]), seed=0, validation=True)
    assert list(v.test_items) == [0] and list(v.valid_items) == [2] and list(v.train.items) == [1]
    json.dumps(s.protocol)
    assert s.protocol["kind"] == "leave-one-out" and s.protocol["tie_break"] == "seeded shuffle"


def test_loo_too_few_interactions_names_the_filter():
    d = make([0, 0, 1], [0, 1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="filter_min_interactions"):
        leave_one_out(d, seed=0)
    with pytest.raises(ValueError, match="min_user=3"):
        leave_one_out(make([0, 0], [0, 1], [1, 2]), seed=0, validation=True)
    with pytest.raises(ValueError, match="seed"):
        leave_one_out(make([0, 0], [0, 1], [1, 2]), seed=-1)


def test_users_without_interactions_get_minus_one():
    d = make([0, 0], [0, 1], [1, 2], n_users=3)
    assert list(leave_one_out(d, seed=0).test_items) == [1, -1, -1]


def test_tie_break_is_seeded_and_varies():
    # One user, 6 interactions all at the same time: the held-out item depends on the seed only.
    d = make([0] * 6, list(range(6)), [7] * 6)
    picks = [int(leave_one_out(d, seed=s).test_items[0]) for s in range(40)]
    assert picks == [int(leave_one_out(d, seed=s).test_items[0]) for s in range(40)]
    assert len(set(picks)) >= 4  # the shuffle really breaks ties (not file order)


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 11), st.integers(0, 4)), min_size=1, max_size=50,
        unique_by=lambda t: (t[0], t[1]),
    ),
    seed=st.integers(0, 2**32 - 1),
    validation=st.booleans(),
)
def test_loo_properties(data, seed, validation):
    users, items, ts = map(np.array, zip(*data))
    d = make(users, items, ts, n_users=6, n_items=12)
    need = 3 if validation else 2
    if np.bincount(users, minlength=6).max() < need:  # asserted, not swallowed (was: any ValueError -> return)
        with pytest.raises(ValueError, match="no interactions left"):
            filter_min_interactions(d, min_user=need)
        return
    d = filter_min_interactions(d, min_user=need)
    s = leave_one_out(d, seed=seed, validation=validation)
    train_pairs = set(zip(s.train.users.tolist(), s.train.items.tolist()))
    held = 2 if validation else 1
    assert len(s.train) == len(d) - held * d.n_users
    for u in range(d.n_users):
        mine = d.users == u
        t = s.test_items[u]
        assert t >= 0 and (u, int(t)) not in train_pairs
        latest = d.timestamps[mine].max()
        assert d.timestamps[mine & (d.items == t)][0] == latest
        if validation:
            v = s.valid_items[u]
            assert v != t and (u, int(v)) not in train_pairs
            # no training interaction is later than the validation one
            assert d.timestamps[mine & (d.items == v)][0] >= s.train.timestamps[s.train.users == u].max()
    assert np.array_equal(s.test_items, leave_one_out(d, seed=seed, validation=validation).test_items)


def test_ratio_split():
    d = generate_synthetic(n_users=80, n_items=60, seed=1)
    r = ratio_split(d, test_ratio=0.25, seed=3)
    assert len(r.train) + len(r.test) == len(d)
    counts = np.bincount(d.users, minlength=d.n_users)
    tc = np.bincount(r.test.users, minlength=d.n_users)
    assert np.array_equal(tc, np.clip(np.floor(0.25 * counts + 0.5), 1, counts - 1))
    for u in range(d.n_users):  # every test interaction is no earlier than every train one
        assert r.test.timestamps[r.test.users == u].min() >= r.train.timestamps[r.train.users == u].max()
    json.dumps(r.protocol)
    with pytest.raises(ValueError, match="test_ratio"):
        ratio_split(d, test_ratio=1.0, seed=0)
    with pytest.raises(ValueError, match="filter_min_interactions"):
        ratio_split(make([0, 1, 1], [0, 0, 1], [1, 2, 3]), seed=0)


@pytest.mark.realdata
def test_loo_on_ml_latest_small(ml_latest_small):
    from recmodels.data import binarize
    from recmodels.loaders import load_interactions

    d = filter_min_interactions(binarize(load_interactions(ml_latest_small)))
    s = leave_one_out(d, seed=0)
    assert (s.test_items >= 0).sum() == 610 and len(s.train) == len(d) - 610
