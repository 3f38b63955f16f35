"""Keyed per-party streams: a party's draws do not depend on who else is in the batch."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from recmodels.data import pair_keys
from recmodels.sampling import sample_negatives_keyed
from recmodels.streams import integers, stream_keys, uniform_u64


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), users=st.lists(st.integers(0, 10_000), min_size=1, max_size=20, unique=True),
       n=st.integers(1, 50))
def test_a_party_draws_the_same_alone_or_batched(seed, users, n):
    users = np.array(users)
    keys = stream_keys(seed, 3, users)
    batched = uniform_u64(np.repeat(keys, n), np.tile(np.arange(n), len(users)))
    for c, u in enumerate(users):
        alone = uniform_u64(stream_keys(seed, 3, np.array([u]))[0], np.arange(n))
        np.testing.assert_array_equal(batched[c * n : (c + 1) * n], alone)


def test_streams_differ_by_every_part_of_the_path():
    base = stream_keys(1, 2, np.arange(1000))
    assert len(np.unique(base)) == 1000
    for other in (stream_keys(2, 2, np.arange(1000)), stream_keys(1, 3, np.arange(1000)), stream_keys(1, 2, np.arange(1, 1001))):
        assert not np.any(other == base)


def test_integers_are_uniform():
    draws = integers(stream_keys(7, np.arange(200)).repeat(500), np.tile(np.arange(500), 200), 10)
    counts = np.bincount(draws, minlength=10)
    assert stats.chisquare(counts).pvalue > 1e-4


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), n_items=st.integers(3, 30), data=st.data())
def test_keyed_negatives_avoid_the_forbidden_pairs(seed, n_items, data):
    users = np.array(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=40)))
    forbid_items = data.draw(st.lists(st.integers(0, n_items - 2), min_size=0, max_size=n_items - 1, unique=True))
    forbidden = np.unique(pair_keys(np.repeat(np.arange(6), len(forbid_items)), np.tile(forbid_items, 6), n_items))
    keys = stream_keys(seed, users)
    items = sample_negatives_keyed(users, keys, np.arange(len(users)), n_items=n_items, forbidden=forbidden)
    assert not np.isin(items, forbid_items).any()
    assert ((items >= 0) & (items < n_items)).all()
