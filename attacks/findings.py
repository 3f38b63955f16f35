"""One result shape for every attack on a run: value, two baselines, advantage, interval.

``secagg attack RUN_DIR`` runs each applicable attack on the run's recorded views and writes one
:class:`Finding` per (attack, inferred target) to ``attacks.json``:

``attack``, ``role`` (whose view), ``target`` (what is inferred: ``"rated items"``, ``"ratings"``,
``"training positives"``, ...), ``metric`` and ``higher_is_better``, ``value`` (the attack's score),
``random`` (a uniformly random guess, its expected score), ``public`` (the best guess that reads no
upload: the public popularity or mean rating where ``public_info()`` publishes one, else a fixed
data-independent guess; its realised score), ``advantage`` (the value normalised between the stronger
baseline, 0, and a perfect inference, 1), ``interval`` (95% interval of ``value``: a bootstrap over
the attacked users, or Clopper-Pearson), ``advantage_interval`` (the same interval normalised),
``rounds`` (the protocol rounds whose views the attack read), ``status`` and ``extra``.

The advantage (:func:`normalised_advantage`), with ``b`` the stronger baseline::

    higher is better:  (value - b) / (1 - b)        (b = max(random, public))
    lower is better:   (b - value) / b              (b = min(random, public); perfect = 0)

An attack that finds nothing usable in its view (masked ring elements, ciphertexts) falls back to
a baseline (its status starts with :data:`STATUS_PUBLIC`): its value is the stronger of the two
baselines (per user, the public guess's realised score or the random guess's expected one,
whichever is better over the attacked users), so its advantage is exactly 0 by construction, never
below the baselines because it read noise.

Ground truth (:class:`Truth`: the run's training interactions) is used only here, to score; the
inference functions of :mod:`attacks.registry` see views and ``public_info()`` only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "STATUS_PUBLIC",
    "Finding",
    "NotApplicable",
    "Truth",
    "bootstrap_interval",
    "clopper_pearson",
    "normalised_advantage",
    "public_items",
    "ratings_finding",
    "set_finding",
]

STATUS_PUBLIC = "nothing usable in the view (masked or encrypted): the attack outputs the stronger baseline"
#: Bootstrap resamples of the intervals.
BOOTSTRAP = 1000


class NotApplicable(ValueError):
    """Raised by an attack's ``infer`` when the view cannot hold what it needs (the reason says why):
    ``secagg attack RUN_DIR`` lists it under ``skipped`` instead of scoring it."""


@dataclass(frozen=True)
class Truth:
    """The ground truth an attack is scored against: the run's training interactions (dense ids).

    Attributes:
        users, items: int64 ``[n]`` one row per training interaction.
        ratings: float ``[n]``.
        n_users, n_items: sizes.
    """

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    n_users: int
    n_items: int
    _by_user: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_interactions(cls, data: Any) -> Truth:
        return cls(np.asarray(data.users, np.int64), np.asarray(data.items, np.int64),
                   np.asarray(data.ratings, np.float64), int(data.n_users), int(data.n_items))

    def rows(self, user: int) -> np.ndarray:
        """The interaction rows of ``user``, sorted by item."""
        if not self._by_user:
            order = np.lexsort((self.items, self.users))
            bounds = np.searchsorted(self.users[order], np.arange(self.n_users + 1))
            for u in range(self.n_users):
                self._by_user[u] = order[bounds[u]:bounds[u + 1]]
        return self._by_user.get(int(user), np.zeros(0, np.int64))

    def items_of(self, user: int) -> np.ndarray:
        return self.items[self.rows(user)]

    def ratings_of(self, user: int) -> np.ndarray:
        return self.ratings[self.rows(user)]

    def popularity(self) -> np.ndarray:
        return np.bincount(self.items, minlength=self.n_items)


@dataclass(frozen=True)
class Finding:
    """One row of ``attacks.json`` (see the module docstring)."""

    attack: str
    role: str
    target: str
    metric: str
    higher_is_better: bool
    value: float | None
    random: float | None
    public: float | None
    advantage: float | None
    interval: tuple[float, float] | None
    advantage_interval: tuple[float, float] | None
    rounds: tuple[int, ...]
    status: str
    users: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["interval"] = None if self.interval is None else list(self.interval)
        out["advantage_interval"] = None if self.advantage_interval is None else list(self.advantage_interval)
        out["rounds"] = list(self.rounds)
        out["extra"] = dict(self.extra)
        return out


def normalised_advantage(value: float, random: float, public: float, *, higher_is_better: bool,
                         perfect: float | None = None) -> float:
    """``value`` between the stronger baseline (0) and a perfect inference (1); see the module docstring.

    Args:
        perfect: the metric's perfect value (default 1 if higher is better, else 0).
    """
    if higher_is_better:
        best = 1.0 if perfect is None else perfect
        base = max(random, public)
        return 0.0 if best - base <= 1e-12 else (value - base) / (best - base)
    best = 0.0 if perfect is None else perfect
    base = min(random, public)
    return 0.0 if base - best <= 1e-12 else (base - value) / (base - best)


def bootstrap_interval(per_unit: Sequence[float] | np.ndarray, *, statistic: Any = np.mean, level: float = 0.95,
                       resamples: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over units (users), seeded (a simulation choice)."""
    x = np.asarray(per_unit, np.float64)
    if len(x) == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(resamples, len(x)))
    stats = np.array([statistic(x[i]) for i in idx]) if statistic is not np.mean else x[idx].mean(axis=1)
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact two-sided interval of a binomial proportion ``k / n``."""
    from scipy import stats

    if n <= 0:
        return (0.0, 1.0)
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def public_items(public: Mapping[str, Any], n_items: int, k: int) -> np.ndarray:
    """The ``k`` items a guesser that reads no upload picks: the most popular by the public
    popularity (``public_info()["item_popularity_public"]``) where published, else a fixed
    data-independent set (seeded by the catalogue size only)."""
    k = max(0, min(int(k), n_items))
    pop = public.get("item_popularity_public") if isinstance(public, Mapping) else None
    if isinstance(pop, (list, tuple, np.ndarray)) and len(pop) == n_items:  # (STTFedRec publishes a flag there)
        return np.sort(np.argsort(-np.asarray(pop, np.float64), kind="stable")[:k]).astype(np.int64)
    rng = np.random.default_rng([n_items, 2024])
    return np.sort(rng.permutation(n_items)[:k]).astype(np.int64)


def _f1(guess: np.ndarray, true: np.ndarray) -> tuple[float, float, float]:
    guess, true = np.unique(guess), np.unique(true)
    if len(guess) == 0 or len(true) == 0:
        return 0.0, 0.0, 0.0
    tp = int(np.isin(guess, true).sum())
    p, r = tp / len(guess), tp / len(true)
    return p, r, (0.0 if tp == 0 else 2 * p * r / (p + r))


def _finish(value: float, random: float, public: float, interval: tuple[float, float], higher: bool,
            perfect: float | None = None) -> tuple[float, tuple[float, float]]:
    adv = normalised_advantage(value, random, public, higher_is_better=higher, perfect=perfect)
    a, b = (normalised_advantage(v, random, public, higher_is_better=higher, perfect=perfect) for v in interval)
    return adv, (min(a, b), max(a, b))


def set_finding(*, attack: str, role: str, target: str, inferred: Mapping[int, np.ndarray],
                truth: Mapping[int, np.ndarray], n_candidates: int, public_guess: Mapping[int, np.ndarray],
                rounds: Sequence[int], status: str, metric: str = "f1", extra: Mapping[str, Any] | None = None,
                seed: int = 0) -> Finding:
    """Macro F1 (or ``metric="precision"``) of ``inferred[u]`` against ``truth[u]`` over the users with a
    non-empty truth; random = a uniformly random set of the true size (expected ``|T_u| / n``).

    A user the attack infers nothing about (an empty or missing set) gets the public guess: an
    attack abstains rather than scoring an empty guess at 0 (the count is ``extra["abstained"]``)."""
    pick = {"precision": 0, "recall": 1, "f1": 2}[metric]
    fallback = status.startswith(STATUS_PUBLIC)
    users = [u for u, t in truth.items() if len(np.unique(t)) > 0]
    att, pub, rnd, prec, rec = [], [], [], [], []
    abstained = 0
    for u in users:
        t = np.asarray(truth[u], np.int64)
        guess = np.asarray(inferred.get(u, ()), np.int64)
        if len(guess) == 0:
            guess, abstained = np.asarray(public_guess.get(u, ()), np.int64), abstained + 1
        s = _f1(guess, t)
        att.append(s[pick]), prec.append(s[0]), rec.append(s[1])
        pub.append(_f1(np.asarray(public_guess.get(u, ()), np.int64), t)[pick])
        rnd.append(min(len(np.unique(t)) / max(n_candidates, 1), 1.0))
    if not users:
        return Finding(attack, role, target, metric, True, None, None, None, None, None, None, tuple(rounds),
                       f"{status}; no attacked user has a true set to score against", 0, dict(extra or {}))
    if users and abstained == len(users) and not fallback:  # it inferred nothing about anyone
        fallback, status = True, f"{STATUS_PUBLIC} (it inferred nothing; {status})"
    if fallback:  # nothing usable in the view: the attack outputs the stronger baseline
        att = list(pub if np.mean(pub) >= np.mean(rnd) else rnd)
    value, random, public = float(np.mean(att)), float(np.mean(rnd)), float(np.mean(pub))
    interval = bootstrap_interval(att, seed=seed)
    adv, adv_iv = _finish(value, random, public, interval, True)
    more = {"precision": float(np.mean(prec)), "recall": float(np.mean(rec)), "abstained": abstained, **(extra or {})}
    return Finding(attack, role, target, metric, True, value, random, public, adv, interval, adv_iv,
                   tuple(rounds), status, len(users), more)


def ratings_finding(*, attack: str, role: str, guesses: Mapping[int, tuple[np.ndarray, np.ndarray]],
                    truth: Truth, users: Sequence[int], scale: Sequence[float], prior: float,
                    rounds: Sequence[int], status: str, seed: int = 0) -> Finding:
    """RMSE of the inferred ratings over every true (user, item) pair of the attacked ``users``.

    ``guesses[u] = (items, ratings)``; a true pair the attack did not rate is guessed at ``prior``
    (the public mean rating), so an attack that infers nothing scores exactly the public guess.
    Random: a uniformly random value of the rating ``scale`` (its expected RMSE).
    """
    scale_arr = np.asarray(sorted(scale), np.float64)
    lo, hi = float(scale_arr[0]), float(scale_arr[-1])
    per_user_sq, per_user_pub, per_user_n, rand_sq = [], [], [], []
    for u in users:
        items, true = truth.items_of(u), truth.ratings_of(u)
        if len(items) == 0:
            continue
        guess = np.full(len(items), prior, np.float64)
        got = guesses.get(u)
        if got is not None and got[1] is not None and len(got[0]):
            g_items, g_vals = np.asarray(got[0], np.int64), np.asarray(got[1], np.float64)
            pos = np.searchsorted(items, g_items)
            ok = (pos < len(items)) & (items[np.minimum(pos, len(items) - 1)] == g_items) & np.isfinite(g_vals)
            guess[pos[ok]] = np.clip(g_vals[ok], lo, hi)
        per_user_sq.append(float(((guess - true) ** 2).sum()))
        per_user_pub.append(float(((prior - true) ** 2).sum()))
        per_user_n.append(len(items))
        rand_sq.append(float(((scale_arr[None, :] - true[:, None]) ** 2).mean(1).sum()))
    if not per_user_n:
        return Finding(attack, role, "ratings", "rmse", False, None, None, None, None, None, None, tuple(rounds),
                       f"{status}; no attacked user has ratings to score against")
    fallback = status.startswith(STATUS_PUBLIC)
    if fallback:  # nothing usable in the view: the stronger baseline's errors
        per_user_sq = per_user_pub if sum(per_user_pub) <= sum(rand_sq) else rand_sq
    sq, n = np.asarray(per_user_sq), np.asarray(per_user_n, np.float64)
    public = float(math.sqrt(sum(per_user_pub) / n.sum()))
    random = float(math.sqrt(sum(rand_sq) / n.sum()))
    # the baseline's own figure when falling back: summed in another order, the RMSE could differ in
    # its last bit and put the advantage a rounding error below 0
    value = min(public, random) if fallback else float(math.sqrt(sq.sum() / n.sum()))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(n), size=(BOOTSTRAP, len(n)))
    boot = np.sqrt(sq[idx].sum(1) / n[idx].sum(1))
    interval = (float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975)))
    adv, adv_iv = _finish(value, random, public, interval, False)
    return Finding(attack, role, "ratings", "rmse", False, value, random, public, adv, interval, adv_iv,
                   tuple(rounds), status, len(per_user_n), {"prior": prior})
