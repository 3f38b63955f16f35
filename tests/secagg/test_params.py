"""SecAgg+ parameter choice (issue 8, item 9): exact bounds, monotonicity, refusals, no aborts."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg import params
from secagg.graph import random_regular_graph
from secagg.params import choose, choose_t, dropout_quantile, evaluate, min_safe_threshold
from secagg.runner import INPUT_STAGE, RunSpec, run


def _hg_sf(pop: int, succ: int, draws: int, x: int) -> Fraction:
    """Exact P[X >= x], X ~ Hypergeometric(pop, succ, draws), by integer arithmetic."""
    if x <= 0:
        return Fraction(1)
    num = sum(math.comb(succ, i) * math.comb(pop - succ, draws - i) for i in range(x, draws + 1))
    return Fraction(num, math.comb(pop, draws))


def _exact(n: int, k: int, t: int, dropout: float, corrupt: float) -> dict[str, float]:
    d, c = math.ceil(dropout * n - 1e-9), math.floor(corrupt * n + 1e-9)
    abort = (n - d) * _hg_sf(n - 1, d, k, k - t + 2) + (d * _hg_sf(n - 1, d - 1, k, k - t + 1) if d else 0)
    collusion = (n - c) * _hg_sf(n - 1, c, k, t)
    equivocation = (n - c) * _hg_sf(n - 1, c, k, 2 * t - k - 1)
    bad = c + d
    partition = Fraction(0) if k >= n - 1 or bad < k else Fraction(n * n, 2) * Fraction(
        math.comb(bad, k), math.comb(n, k))
    return {name: float(min(Fraction(1), v)) for name, v in (
        ("abort", abort), ("collusion", collusion), ("equivocation", equivocation), ("partition", partition))}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_bounds_match_exact_integer_arithmetic(data):
    n = data.draw(st.integers(3, 400), label="n")
    k = data.draw(st.sampled_from([*range(2, n - 1, 2), n - 1]), label="k")
    t = data.draw(st.integers(1, k + 1), label="t")
    dropout = data.draw(st.floats(0, 0.6), label="dropout")
    corrupt = data.draw(st.floats(0, 0.3), label="corrupt")
    got = evaluate(n, k, t, dropout=dropout, corrupt=corrupt)
    want = _exact(n, k, t, dropout, corrupt)
    for name, value in want.items():
        assert getattr(got, name) == pytest.approx(value, rel=1e-9, abs=1e-300), name


@pytest.mark.parametrize("n", [100, 1000, 10000])
@pytest.mark.parametrize("dropout", [0.1, 0.3])
def test_chosen_parameters_meet_both_targets(n, dropout):
    g = choose(n, dropout=dropout)
    assert g.abort <= 2.0**-20 and g.security <= 2.0**-40
    assert 2 * g.t > g.k + 1 and g.t <= g.k + 1 and (g.k % 2 == 0 or g.k == n - 1)
    # k is the smallest that works: k - 2 has no admissible t
    if g.k > 2 and g.k != n - 1:
        with pytest.raises(ValueError, match="no threshold t"):
            choose_t(n, g.k - 2, dropout=dropout)


# the table in docs/secagg.md (default corrupt fraction 0.05, targets 2^-20 and 2^-40)
TABLE = {
    (100, 0.1): (26, 17), (100, 0.3): (66, 37),
    (1000, 0.1): (74, 50), (1000, 0.3): (310, 177),
    (10000, 0.1): (94, 63), (10000, 0.3): (518, 297),
}


@pytest.mark.parametrize(("n", "dropout"), sorted(TABLE))
def test_documented_defaults(n, dropout):
    g = choose(n, dropout=dropout)
    assert (g.k, g.t) == TABLE[n, dropout]


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 600),
    d1=st.floats(0, 0.45), d2=st.floats(0, 0.45),
    c1=st.floats(0, 0.2), c2=st.floats(0, 0.2),
)
def test_k_grows_with_dropout_and_corruption(n, d1, d2, c1, c2):
    (d1, d2), (c1, c2) = sorted((d1, d2)), sorted((c1, c2))

    def k_of(d, c):
        try:
            g = choose(n, dropout=d, corrupt=c)
        except ValueError:
            return math.inf
        assert g.abort <= 2.0**-20 and g.security <= 2.0**-40 and 2 * g.t > g.k + 1
        return g.k

    assert k_of(d1, c1) <= k_of(d2, c1) <= k_of(d2, c2)
    assert k_of(d1, c1) <= k_of(d1, c2)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(10, 2000), d=st.floats(0.01, 0.35), e1=st.integers(5, 30), e2=st.integers(5, 30))
def test_stricter_targets_never_give_a_smaller_k(n, d, e1, e2):
    lo, hi = sorted((e1, e2))

    def k_of(**kw):
        try:
            return choose(n, dropout=d, **kw).k
        except ValueError:
            return math.inf

    assert k_of(abort_exponent=lo) <= k_of(abort_exponent=hi)
    assert k_of(security_exponent=lo) <= k_of(security_exponent=hi)


def test_impossible_combinations_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="Lower the planned dropout"):
        choose(2, dropout=0.1)  # t must be 2 of 2: one dropout always aborts
    with pytest.raises(ValueError, match="no SecAgg\\+ parameters for n = 1000"):
        choose(1000, dropout=0.55)  # more than half drop: no t above half the holders survives
    with pytest.raises(ValueError, match="corrupt must be a fraction in"):
        choose(100, corrupt=0.5)
    with pytest.raises(ValueError, match="dropout must be a fraction"):
        choose(100, dropout=1.0)
    with pytest.raises(ValueError, match="abort_exponent"):
        choose(100, abort_exponent=0)
    assert min_safe_threshold(5) == 3 and min_safe_threshold(6) == 4


def test_abort_bound_is_an_upper_bound_on_simulated_aborts():
    """A deliberately loose configuration, so that aborts happen: the simulated rate over random
    graphs and random dropout sets of the planned size stays under the bound."""
    n, k, t, dropout = 60, 16, 9, 0.25
    bound = evaluate(n, k, t, dropout=dropout, corrupt=0.0).abort
    assert 0.05 < bound < 1
    rng = np.random.default_rng(3)  # CSPRNG-OK: simulated dropout sets
    dropped_count = math.ceil(dropout * n)
    aborts, trials = 0, 300
    for _ in range(trials):
        graph = random_regular_graph(n, k)
        gone = set(rng.choice(n, dropped_count, replace=False).tolist())
        alive = [sum(v not in gone for v in graph[u]) for u in range(n)]
        aborts += any(alive[u] < (t if u in gone else t - 1) for u in range(n))
    assert aborts / trials <= bound + 3 * math.sqrt(bound * (1 - bound) / trials)


def test_dropout_quantile_covers_independent_dropouts():
    from scipy.stats import binom

    for n, rate in ((100, 0.1), (1000, 0.3), (50, 0.0)):
        q = dropout_quantile(n, rate)
        dropped = round(q * n)
        assert binom.sf(dropped, n, rate) <= 2.0**-21
        assert rate == 0 or binom.sf(dropped - 1, n, rate) > 2.0**-21  # the smallest such count


def test_runner_plans_for_the_dropouts_it_simulates():
    """``RunSpec.dropout`` defaults to the simulated fraction, so a run at its configured dropout
    rate gets parameters chosen for that rate (and does not abort)."""
    n = 40
    x = np.zeros((n, 3), dtype=np.uint64)
    drop = frozenset(range(0, n, 4))  # 25%
    res = run("secagg+", x, RunSpec(dropouts={INPUT_STAGE: drop}))
    want = choose(n, dropout=0.25)
    assert res.ok and (res.k, res.t) == (want.k, want.t)
    assert RunSpec(dropout=0.1, dropouts={INPUT_STAGE: drop}).planned_dropout(n) == 0.1
    assert params.DEFAULT_CORRUPT == RunSpec().corrupt
