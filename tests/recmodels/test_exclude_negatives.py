"""Training negatives can exclude rated-but-not-positive items (issue 9, item 10).

With a positive threshold (e.g. ratings >= 4), an item a user rated 2 is not a positive, but it
is not "never interacted" either. ``sample_eval_candidates`` could already exclude such pairs;
``sample_train_negatives`` now can too, and :func:`recmodels.data.align_interactions` builds the
``exclude`` set from the raw file in the id space of the preprocessed data.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from recmodels.data import Interactions, align_interactions, binarize, filter_min_interactions
from recmodels.sampling import sample_eval_candidates, sample_train_negatives
from recmodels.splits import leave_one_out
from recmodels.train import CentralConfig, CentralTrainer


def _raw(users, items, ratings, user_ids=None, item_ids=None) -> Interactions:
    users, items = np.asarray(users), np.asarray(items)
    n_u, n_i = int(users.max()) + 1, int(items.max()) + 1
    return Interactions(users, items, np.asarray(ratings, dtype=float), np.arange(len(users)),
                        np.asarray(user_ids if user_ids is not None else np.arange(100, 100 + n_u)),
                        np.asarray(item_ids if item_ids is not None else np.arange(200, 200 + n_i)), source="raw")


def test_below_threshold_items_are_never_training_negatives() -> None:
    # user 0 likes items 0, 1 (5 stars) and rated items 2..5 with 1 star; user 1 likes 2..7, so
    # every item stays in the catalogue after the threshold and the filter.
    raw = _raw([0] * 6 + [1] * 6, [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7], [5, 5, 1, 1, 1, 1] + [5] * 6)
    data = filter_min_interactions(binarize(raw, threshold=4), min_user=2)
    assert data.n_items == 8
    exclude = align_interactions(raw, data)
    assert (exclude.n_users, exclude.n_items) == (data.n_users, data.n_items)
    users, items = sample_train_negatives(data, n_neg=2000, rng=np.random.default_rng(0), exclude=exclude)
    got = set(data.item_ids[items[users == 0]].tolist())
    assert got == {206, 207}, got  # never 200-205: liked, or rated below the threshold
    # Without exclude the low-rated items were sampled as negatives (the defect).
    _, old = sample_train_negatives(data, n_neg=2000, rng=np.random.default_rng(0))
    assert set(data.item_ids[old[np.repeat(data.users, 2000) == 0]].tolist()) >= {202, 203, 204, 205}


def test_exclude_changes_nothing_when_it_adds_no_pairs() -> None:
    """Seeded runs without below-threshold ratings draw exactly the same negatives as before."""
    raw = _raw([0, 0, 1, 1, 2], [0, 1, 1, 2, 3], [5, 5, 5, 5, 5])
    data = binarize(raw)
    a = sample_train_negatives(data, n_neg=5, rng=np.random.default_rng(3))
    b = sample_train_negatives(data, n_neg=5, rng=np.random.default_rng(3), exclude=align_interactions(raw, data))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_uniform_over_the_allowed_items() -> None:
    raw = _raw([0] * 4, [0, 1, 2, 9], [5, 1, 1, 5])
    data = binarize(raw, threshold=4)
    _, items = sample_train_negatives(data, n_neg=20000, rng=np.random.default_rng(1),
                                      exclude=align_interactions(raw, data))
    counts = np.bincount(items, minlength=10)
    assert counts[[0, 1, 2, 9]].sum() == 0
    assert stats.chisquare(counts[3:9]).pvalue > 1e-4


@settings(max_examples=30, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 11), st.integers(1, 5)), min_size=4, max_size=50,
                   unique_by=lambda t: (t[0], t[1])),
    threshold=st.sampled_from([None, 2, 3, 4]),
    seed=st.integers(0, 1000),
)
def test_property_negatives_avoid_every_rated_pair(pairs, threshold, seed) -> None:
    users, items, ratings = map(np.array, zip(*pairs))
    raw = _raw(users, items, ratings)
    try:
        data = filter_min_interactions(binarize(raw, threshold=threshold), min_user=1)
    except ValueError:
        assert threshold is not None and (ratings < threshold).all()  # nothing positive at all
        return
    exclude = align_interactions(raw, data)
    rated = set(zip(raw.user_ids[raw.users].tolist(), raw.item_ids[raw.items].tolist()))
    catalogue = set(data.item_ids.tolist())
    saturated = any(
        len({it for (uu, it) in rated if uu == uid} & catalogue) >= data.n_items
        for uid in set(data.user_ids[data.users].tolist())
    )
    if saturated:  # a user rated every item left in the catalogue: no negative exists, said so
        with pytest.raises(ValueError, match="no negative exists"):
            sample_train_negatives(data, n_neg=3, rng=np.random.default_rng(seed), exclude=exclude)
        return
    u, i = sample_train_negatives(data, n_neg=3, rng=np.random.default_rng(seed), exclude=exclude)
    drawn = set(zip(data.user_ids[u].tolist(), data.item_ids[i].tolist()))
    assert not drawn & rated


def test_align_interactions_drops_unknown_ids_and_maps_the_rest() -> None:
    raw = _raw([0, 1, 2], [0, 1, 2], [1, 2, 3], user_ids=["a", "b", "c"], item_ids=["x", "y", "z"])
    like = _raw([0, 1], [0, 1], [5, 5], user_ids=["c", "a"], item_ids=["z", "x"])
    out = align_interactions(raw, like)
    assert list(out.user_ids) == ["c", "a"] and len(out) == 2
    assert set(zip(out.user_ids[out.users].tolist(), out.item_ids[out.items].tolist())) == {("a", "x"), ("c", "z")}
    ints = _raw([0], [0], [1], user_ids=[1], item_ids=[2])
    assert len(align_interactions(ints, raw)) == 0  # integer ids never match string ids


def test_exclude_with_other_id_maps_is_refused() -> None:
    raw = _raw([0, 1], [0, 1], [5, 5])
    other = _raw([0, 2], [0, 3], [5, 5])
    with pytest.raises(ValueError, match="align_interactions"):
        sample_train_negatives(raw, n_neg=1, rng=np.random.default_rng(0), exclude=other)


def test_central_trainer_and_eval_candidates_take_the_same_exclude() -> None:
    rng = np.random.default_rng(5)  # test data
    users = np.repeat(np.arange(20), 6)
    items = np.concatenate([rng.choice(30, 6, replace=False) for _ in range(20)])
    ratings = rng.integers(1, 6, size=users.size)
    raw = _raw(users, items, ratings)
    data = filter_min_interactions(binarize(raw, threshold=3), min_user=2)
    exclude = align_interactions(raw, data)
    split = leave_one_out(data, seed=0)
    cands = sample_eval_candidates(split, n_negatives=5, rng=np.random.default_rng(0), exclude=exclude)
    rated = set(zip(exclude.users.tolist(), exclude.items.tolist()))
    assert not {(u, i) for u, row in zip(cands.users.tolist(), cands.items[:, 1:].tolist()) for i in row} & rated
    trainer = CentralTrainer(split.train, CentralConfig(dim=4, train_negatives=3), seed=0, exclude=exclude)
    assert trainer.exclude is exclude
    seen = []
    import recmodels.train as train_module

    original = train_module.sample_train_negatives

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append((kwargs.get("exclude"), out))
        return out

    train_module.sample_train_negatives = spy
    try:
        trainer.run_round()
    finally:
        train_module.sample_train_negatives = original
    (passed, (nu, ni)), = seen
    assert passed is exclude and not set(zip(nu.tolist(), ni.tolist())) & rated
