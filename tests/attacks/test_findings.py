"""The one result schema of attacks on a run (attacks.findings): baselines, advantage, intervals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attacks.findings import (STATUS_PUBLIC, Truth, bootstrap_interval, clopper_pearson, normalised_advantage,
                              ratings_finding, set_finding)

unit = st.floats(0, 1, allow_nan=False)


@settings(deadline=None)
@given(random=unit, public=unit)
def test_the_stronger_baseline_is_zero_and_perfect_is_one(random, public):
    base = max(random, public)
    assert normalised_advantage(base, random, public, higher_is_better=True) == 0.0
    if base < 1 - 1e-9:
        assert normalised_advantage(1.0, random, public, higher_is_better=True) == pytest.approx(1.0)
        assert normalised_advantage(min(random, public), random, public, higher_is_better=True) <= 0.0
    low = min(random, public)  # an error metric: lower is better, perfect 0
    assert normalised_advantage(low, random, public, higher_is_better=False) == 0.0
    if low > 1e-9:
        assert normalised_advantage(0.0, random, public, higher_is_better=False) == pytest.approx(1.0)


@settings(deadline=None)
@given(a=unit, b=unit, random=unit, public=unit)
def test_advantage_is_monotone_in_the_value(a, b, random, public):
    lo, hi = sorted((a, b))
    assert normalised_advantage(lo, random, public, higher_is_better=True) <= \
        normalised_advantage(hi, random, public, higher_is_better=True)
    assert normalised_advantage(lo, random, public, higher_is_better=False) >= \
        normalised_advantage(hi, random, public, higher_is_better=False)


def _truth(seed: int, n_users: int, n_items: int) -> Truth:
    rng = np.random.default_rng(seed)
    users, items, ratings = [], [], []
    for u in range(n_users):
        chosen = rng.choice(n_items, size=int(rng.integers(1, n_items)), replace=False)
        users += [u] * len(chosen)
        items += list(chosen)
        ratings += list(rng.integers(1, 6, len(chosen)).astype(float))
    return Truth(np.array(users), np.array(items), np.array(ratings), n_users, n_items)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_users=st.integers(1, 12), n_items=st.integers(2, 30),
       prior=st.floats(1, 5, allow_nan=False))
def test_a_view_with_nothing_usable_scores_exactly_the_stronger_baseline(seed, n_users, n_items, prior):
    truth = _truth(seed, n_users, n_items)
    rng = np.random.default_rng(seed + 1)
    users = list(range(n_users))
    noise = {u: rng.choice(n_items, size=3 if n_items > 3 else 1, replace=False) for u in users}  # what masks "read"
    guess = {u: rng.choice(n_items, size=2 if n_items > 2 else 1, replace=False) for u in users}
    f = set_finding(attack="a", role="server", target="rated items", inferred=noise,
                    truth={u: truth.items_of(u) for u in users}, n_candidates=n_items, public_guess=guess,
                    rounds=[0], status=STATUS_PUBLIC)
    assert f.advantage == 0.0 and f.value == max(f.random, f.public)
    r = ratings_finding(attack="a", role="server", guesses={u: (truth.items_of(u), np.full(len(truth.items_of(u)), 5.0))
                                                             for u in users},
                        truth=truth, users=users, scale=[1, 2, 3, 4, 5], prior=prior, rounds=[0], status=STATUS_PUBLIC)
    assert r.advantage == 0.0 and r.value == min(r.random, r.public)  # exactly: not a rounding error below


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_users=st.integers(1, 12), n_items=st.integers(3, 30))
def test_a_perfect_inference_scores_one_and_its_interval_holds_the_value(seed, n_users, n_items):
    truth = _truth(seed, n_users, n_items)
    users = list(range(n_users))
    exact = {u: truth.items_of(u) for u in users}
    f = set_finding(attack="a", role="server", target="rated items", inferred=exact, truth=exact, n_candidates=n_items,
                    public_guess={u: np.array([0]) for u in users}, rounds=[0], status="ok")
    assert f.value == 1.0 and f.interval == (1.0, 1.0)
    if max(f.random, f.public) < 1:
        assert f.advantage == pytest.approx(1.0)
    r = ratings_finding(attack="a", role="server", guesses={u: (truth.items_of(u), truth.ratings_of(u)) for u in users},
                        truth=truth, users=users, scale=[1, 2, 3, 4, 5], prior=3.0, rounds=[0], status="ok")
    assert r.value == 0.0 and r.metric == "rmse" and not r.higher_is_better
    assert r.advantage == (pytest.approx(1.0) if min(r.random, r.public) > 0 else 0.0)  # every rating at the prior


@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 50), extra=st.integers(0, 50))
def test_clopper_pearson_holds_the_proportion(k, extra):
    n = k + extra
    lo, hi = clopper_pearson(k, n)
    assert 0 <= lo <= hi <= 1
    if n:
        assert lo <= k / n <= hi


@settings(max_examples=30, deadline=None)
@given(x=st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=40))
def test_bootstrap_interval_holds_the_sample_range(x):
    lo, hi = bootstrap_interval(x)
    assert min(x) - 1e-9 <= lo <= hi <= max(x) + 1e-9


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n_users=st.integers(1, 10), n_items=st.integers(3, 30))
def test_an_attack_that_infers_nothing_abstains_at_the_stronger_baseline(seed, n_users, n_items):
    truth = _truth(seed, n_users, n_items)
    users = list(range(n_users))
    f = set_finding(attack="a", role="rs", target="clicked items", metric="precision", inferred={u: [] for u in users},
                    truth={u: truth.items_of(u) for u in users}, n_candidates=n_items,
                    public_guess={u: np.array([0, 1]) for u in users}, rounds=[0], status="ok")
    assert f.extra["abstained"] == n_users and f.status.startswith(STATUS_PUBLIC)
    assert f.advantage == 0.0 and f.value == max(f.random, f.public)
