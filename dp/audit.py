"""One-run privacy auditing: an empirical lower bound on epsilon from guessed canaries.

Steinke, Nasr and Jagielski 2023, *Privacy Auditing with One (1) Training Run* (NeurIPS 2023).
``m`` canaries are each included independently with probability 1/2; an auditor who sees the
mechanism's output guesses ``r`` of them (``in`` or ``out``) and abstains on the rest; ``v`` of the
guesses are right. Their Theorem 5.2 (stated for any (epsilon, delta)-DP mechanism in the inclusion
vector): with ``q = e^eps / (1 + e^eps)`` and ``f(v) = P[Binomial(r, q) >= v]``,

    P[W >= v]  <=  f(v) + 2 m delta * max_{i = 1..m} (f(v - i) - f(v)) / i.

For delta = 0 this is: the number of correct guesses is stochastically dominated by
``Binomial(r, q)`` (randomised response's accuracy). The right-hand side is the p-value of the
hypothesis "the mechanism is (eps, delta)-DP" given ``v`` correct guesses (:func:`p_value`); the
audit reports the largest epsilon that this test rejects at level ``1 - confidence``
(:func:`epsilon_lower_bound`): with that confidence the mechanism is *not* (eps', delta)-DP for
any eps' below it.

Which canaries to guess may depend on the scores but never on the bits: :func:`audit_guesses`
guesses the ``r`` canaries of largest ``|score|`` (in if the score is positive, out if negative:
the paper's top k+ / bottom k- with k+ and k- read off the scores). How many (``r``) is chosen
from a fixed grid, and the grid is paid for with a Bonferroni correction (each ``r`` tested at
level ``(1 - confidence) / len(grid)``), so the maximum over the grid is still a valid bound at
``confidence``: trying every ``r`` and keeping the best without the correction would not be.

Pure numerics (numpy, scipy): no randomness here; the canaries' inclusion bits are drawn by the
caller from the OS CSPRNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["AuditBound", "audit_guesses", "epsilon_lower_bound", "guess_grid", "max_detectable", "p_value"]


def _check(m: int, r: int, v: int) -> None:
    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= correct <= guesses <= canaries; found correct={v}, guesses={r}, canaries={m}")


def p_value(eps: float, delta: float, *, m: int, r: int, v: int) -> float:
    """The bound of Theorem 5.2 on ``P[W >= v]`` for an (eps, delta)-DP mechanism (at most 1).

    Args:
        eps, delta: the hypothesis tested.
        m: canaries randomised; r: guesses made (abstentions excluded); v: correct guesses.
    """
    _check(m, r, v)
    if eps < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need eps >= 0 and 0 <= delta <= 1; found eps={eps}, delta={delta}")
    q = 1.0 / (1.0 + math.exp(-eps)) if eps < 700 else 1.0
    f_v = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(1.0, f_v)
    # f(v - i) - f(v) = P[v - i <= B < v]; for i >= v it is 1 - f(v), largest over i at i = v.
    pmf = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[B = v-1], P[B = v-2], ..., P[B = 0]
    gaps = np.cumsum(pmf) / np.arange(1, v + 1)
    return min(1.0, f_v + 2 * m * delta * float(gaps.max()))


def epsilon_lower_bound(*, m: int, r: int, v: int, delta: float = 0.0, alpha: float = 0.05,
                        tol: float = 1e-9) -> float:
    """The largest eps whose p-value (:func:`p_value`) is at most ``alpha`` (0 if even eps = 0 is not
    rejected): the mechanism is not (eps, delta)-DP for any smaller eps, with confidence ``1 - alpha``."""
    _check(m, r, v)
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1); found {alpha}")
    if r == 0 or p_value(0.0, delta, m=m, r=r, v=v) > alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(hi, delta, m=m, r=r, v=v) <= alpha:
        lo, hi = hi, 2 * hi
        if hi > 1e4:  # only reached by delta = 0 with huge r; the bound is then beyond any use
            return lo
    while hi - lo > tol * max(1.0, hi):
        mid = (lo + hi) / 2
        if p_value(mid, delta, m=m, r=r, v=v) <= alpha:
            lo = mid
        else:
            hi = mid
    return lo


def guess_grid(n: int) -> list[int]:
    """The guess counts tried: 1, 2, 4, ... below ``n``, and ``n`` (the scored canaries)."""
    if n < 1:
        return []
    grid, r = [], 1
    while r < n:
        grid.append(r)
        r *= 2
    grid.append(n)
    return grid


@dataclass(frozen=True)
class AuditBound:
    """The audit's result (``audit.json``'s ``bound``)."""

    epsilon: float          # the empirical lower bound
    confidence: float
    delta: float
    canaries: int           # m: randomised canaries
    scored: int             # canaries with a non-zero finite score (the others are abstained on)
    guesses: int            # r of the best grid point
    guessed_in: int         # of them guessed "included" (positive score)
    correct: int            # v
    grid: tuple[int, ...]   # the r tried (Bonferroni over their number)
    per_r: tuple[dict, ...]  # {guesses, correct, epsilon} for every r tried

    def to_dict(self) -> dict:
        return {"epsilon": self.epsilon, "confidence": self.confidence, "delta": self.delta,
                "canaries": self.canaries, "scored": self.scored, "guesses": self.guesses,
                "guessed_in": self.guessed_in, "guessed_out": self.guesses - self.guessed_in,
                "correct": self.correct, "grid": list(self.grid), "per_guesses": [dict(x) for x in self.per_r],
                "rule": "the r canaries of largest |score| are guessed: in if the score is positive, out if negative "
                        "(top k+ in and bottom k- out, with k+ and k- read off the scores, never the bits)",
                "correction": f"Bonferroni over {len(self.grid)} guess count(s): each tested at level "
                              f"{(1 - self.confidence) / max(len(self.grid), 1):.4g}"}


def audit_guesses(scores: np.ndarray, included: np.ndarray, *, delta: float = 0.0, confidence: float = 0.95,
                  guesses: int | None = None) -> AuditBound:
    """Guess the canaries of largest ``|score|`` (in if positive, out if negative), count the correct
    guesses and bound epsilon (:func:`epsilon_lower_bound`).

    Scores must be centred: a canary's two item sets are exchangeable, so without information its
    score is symmetric around 0. A NaN or zero score is abstained on; ties in ``|score|`` are broken
    by canary index (never by the inclusion bits). ``guesses=None`` tries :func:`guess_grid` of the
    scored canaries, Bonferroni-corrected; a given number is tested alone at ``1 - confidence``.

    Args:
        scores: ``[m]``, positive = evidence the canary was included.
        included: ``[m]`` bool, the secret inclusion bits (read only to count correct guesses).
    """
    scores = np.asarray(scores, np.float64)
    included = np.asarray(included, bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError(f"scores and included must be 1-D of one length; found {scores.shape}, {included.shape}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1); found {confidence}")
    m = len(scores)
    idx = np.flatnonzero(np.isfinite(scores) & (scores != 0))
    order = idx[np.lexsort((idx, -np.abs(scores[idx])))]  # most confident first, ties by index
    if guesses is not None and not 1 <= guesses <= len(idx):
        raise ValueError(f"guesses must be in 1..{len(idx)} (the scored canaries); found {guesses}")
    grid = guess_grid(len(idx)) if guesses is None else [int(guesses)]
    alpha = (1 - confidence) / max(len(grid), 1)
    per_r, best = [], {"guesses": 0, "guessed_in": 0, "correct": 0, "epsilon": 0.0}
    for r in grid:
        chosen = order[:r]
        guess_in = scores[chosen] > 0
        v = int((guess_in == included[chosen]).sum())
        eps = epsilon_lower_bound(m=m, r=r, v=v, delta=delta, alpha=alpha)
        row = {"guesses": r, "guessed_in": int(guess_in.sum()), "correct": v, "epsilon": eps}
        per_r.append(row)
        if eps > best["epsilon"] or eps == best["epsilon"] == 0.0:  # with no bound, show the largest r
            best = row
    return AuditBound(best["epsilon"], confidence, delta, m, len(idx), best["guesses"], best["guessed_in"],
                      best["correct"], tuple(grid), tuple(per_r))


def max_detectable(m: int, *, delta: float = 0.0, confidence: float = 0.95, corrected: bool = True) -> float:
    """The largest bound ``m`` canaries can give: every canary guessed and every guess right, at
    :func:`audit_guesses`' correction (``corrected``) or alone."""
    if m < 1:
        return 0.0
    n = len(guess_grid(m)) if corrected else 1
    return epsilon_lower_bound(m=m, r=m, v=m, delta=delta, alpha=(1 - confidence) / n)
