"""The one-run audit bound (dp/audit.py) against an independent exact computation."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp.audit import audit_guesses, epsilon_lower_bound, guess_grid, max_detectable, p_value


def _tail(r: int, q: float, v: int) -> float:
    """P[Binomial(r, q) >= v] by summing the exact terms (math.comb, no scipy)."""
    if v <= 0:
        return 1.0
    qf = Fraction(q)
    return float(sum(math.comb(r, j) * qf**j * (1 - qf) ** (r - j) for j in range(v, r + 1)))


def _oracle_p(eps: float, delta: float, m: int, r: int, v: int) -> float:
    """Theorem 5.2 term by term: f(v) + 2 m delta max_{i=1..m} (f(v-i) - f(v)) / i, every i up to m."""
    q = 1 / (1 + math.exp(-eps))
    f = _tail(r, q, v)
    worst = max((_tail(r, q, v - i) - f) / i for i in range(1, m + 1))
    return min(1.0, f + 2 * m * delta * worst)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(2, 40), data=st.data(), eps=st.floats(0, 6), delta=st.sampled_from([0.0, 1e-5, 1e-3]))
def test_p_value_matches_the_theorem_computed_term_by_term(m: int, data, eps: float, delta: float) -> None:
    r = data.draw(st.integers(0, m))
    v = data.draw(st.integers(0, r))
    assert p_value(eps, delta, m=m, r=r, v=v) == pytest.approx(_oracle_p(eps, delta, m, r, v), rel=1e-9, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(2, 60), data=st.data(), delta=st.sampled_from([0.0, 1e-5]),
       alpha=st.sampled_from([0.05, 0.01]))
def test_the_bound_is_the_largest_epsilon_the_test_rejects(m: int, data, delta: float, alpha: float) -> None:
    r = data.draw(st.integers(1, m))
    v = data.draw(st.integers(0, r))
    eps = epsilon_lower_bound(m=m, r=r, v=v, delta=delta, alpha=alpha)
    if eps == 0.0:
        assert _oracle_p(1e-6, delta, m, r, v) > alpha or _oracle_p(0.0, delta, m, r, v) > alpha
    else:
        assert _oracle_p(eps, delta, m, r, v) <= alpha * (1 + 1e-6)
        assert _oracle_p(eps * (1 + 1e-5) + 1e-7, delta, m, r, v) > alpha


def test_pure_dp_bound_against_a_closed_form() -> None:
    # every one of r guesses right: P[B >= r] = q^r, so the bound solves q^r = alpha
    for r in (10, 50, 200):
        q = 0.05 ** (1 / r)
        assert epsilon_lower_bound(m=r, r=r, v=r, alpha=0.05) == pytest.approx(math.log(q / (1 - q)), rel=1e-6)
    # half the guesses right is what eps = 0 gives: nothing is rejected
    assert epsilon_lower_bound(m=100, r=100, v=50) == 0.0


def test_guesses_follow_the_scores_and_never_the_bits() -> None:
    bits = np.array([True, False, False] * 20 + [True] * 4)
    signed = np.where(bits, 1.0, -1.0)
    perfect = audit_guesses(signed * np.linspace(1, 2, 64), bits)
    assert perfect.correct == perfect.guesses == 64 and perfect.epsilon == pytest.approx(max_detectable(64))
    flat = audit_guesses(np.zeros(64), bits)  # no information: every canary abstained on
    assert flat.epsilon == 0.0 and flat.scored == 0 and flat.guesses == 0
    wrong = audit_guesses(-signed, bits)
    assert wrong.epsilon == 0.0 and wrong.per_r[-1]["correct"] == 0
    half = audit_guesses(np.where(np.arange(64) < 32, signed, np.nan), bits)
    assert half.scored == 32 and half.guesses <= 32 and half.epsilon == pytest.approx(
        epsilon_lower_bound(m=64, r=32, v=32, alpha=0.05 / len(guess_grid(32))))
    # the most confident guesses come first: one wrong guess of tiny |score| is only in the r = 64 point
    noisy = signed.copy()
    noisy[0] = -1e-3
    rows = {r["guesses"]: r["correct"] for r in audit_guesses(noisy, bits).per_r}
    assert rows[32] == 32 and rows[64] == 63
    assert guess_grid(64) == [1, 2, 4, 8, 16, 32, 64] and guess_grid(5) == [1, 2, 4, 5]


@settings(max_examples=25, deadline=None)
@given(m=st.integers(4, 80), data=st.data())
def test_without_information_the_bound_is_rarely_positive(m: int, data) -> None:
    """Scores independent of the bits: the bound is > 0 with probability at most 1 - confidence (here a
    fixed pseudo-random draw per example: the test checks the guessing never reads the bits)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    bits = rng.random(m) < 0.5
    scores = rng.normal(size=m)
    a = audit_guesses(scores, bits)
    b = audit_guesses(scores, ~bits)  # the same guesses whatever the bits
    assert [r["guessed_in"] for r in a.per_r] == [r["guessed_in"] for r in b.per_r]
    assert all(ra["correct"] + rb["correct"] == ra["guesses"] for ra, rb in zip(a.per_r, b.per_r))


def test_more_canaries_detect_larger_epsilons() -> None:
    caps = [max_detectable(m) for m in (16, 64, 256, 1024)]
    assert caps == sorted(caps) and caps[0] < 1.5 < 2.5 < caps[1] < 3 < caps[2] < caps[3]
