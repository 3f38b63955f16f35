"""Scores of inferred item sets against the truth, each beside the random-guess baseline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["SetScore", "score_sets"]


@dataclass(frozen=True)
class SetScore:
    """Macro-averaged precision, recall and F1 over users, and the random baseline.

    A user with nothing inferred scores 0. The baseline is a uniformly random set of the true
    set's size drawn from ``n_candidates`` items: its expected precision = recall = F1 =
    ``|T_u| / n_candidates``, averaged over users.
    """

    precision: float
    recall: float
    f1: float
    random_precision: float
    random_recall: float
    random_f1: float
    users: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score_sets(
    inferred: Mapping[int, np.ndarray],
    truth: Mapping[int, np.ndarray] | Sequence[np.ndarray],
    n_candidates: int,
) -> SetScore:
    """Score ``inferred[u]`` (item ids) against ``truth[u]`` for every user with a non-empty truth.

    Args:
        inferred: user -> inferred item ids (missing users count as nothing inferred).
        truth: user -> true item ids (a sequence is indexed by user).
        n_candidates: the number of items a random guesser draws from.
    """
    if n_candidates < 1:
        raise ValueError(f"n_candidates must be >= 1; found {n_candidates}")
    items = truth.items() if isinstance(truth, Mapping) else enumerate(truth)
    prec, rec, f1, rand = [], [], [], []
    for u, true in items:
        true = np.unique(np.asarray(true, dtype=np.int64))
        if len(true) == 0:
            continue
        rand.append(min(len(true) / n_candidates, 1.0))
        guess = np.unique(np.asarray(inferred.get(u, ()), dtype=np.int64))
        if len(guess) == 0:
            prec.append(0.0), rec.append(0.0), f1.append(0.0)
            continue
        tp = int(np.isin(guess, true).sum())
        p, r = tp / len(guess), tp / len(true)
        prec.append(p), rec.append(r), f1.append(0.0 if tp == 0 else 2 * p * r / (p + r))
    if not f1:
        raise ValueError("no user has a non-empty true set to score against")
    return SetScore(float(np.mean(prec)), float(np.mean(rec)), float(np.mean(f1)),
                    float(np.mean(rand)), float(np.mean(rand)), float(np.mean(rand)), len(f1))
