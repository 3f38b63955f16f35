"""Ranking metrics with one relevant (held-out) item per user, sampled and full protocols.

Rank rule (ties count against the target): among the valid candidates of a user, the 1-based
rank of the held-out item ``t`` with score ``s_t`` is

    rank = 1 + #{valid candidates j != t : s_j >= s_t}

so a model that scores everything equally gets the worst rank ``n_candidates``.

Metrics, averaged over evaluated users (all higher-is-better, all in [0, 1]):

============== ================================================================
``HR@K``       ``1[rank <= K]``
``NDCG@K``     ``1[rank <= K] / log2(rank + 1)`` (ideal DCG is 1 with one relevant item)
``Precision@K`` ``HR@K / K``
``Recall@K``   ``HR@K`` (one relevant item)
``MRR``        ``1 / rank``
``AUC``        ``(n_candidates - rank) / (n_candidates - 1)``: the share of negatives
               scored strictly below the target
============== ================================================================

Protocols: :func:`evaluate_sampled` ranks the target among its sampled candidates (see
:func:`recmodels.sampling.sample_eval_candidates`) or the candidates a paper's files list
(:mod:`recmodels.splitfiles`); :func:`evaluate_full` ranks it among all items not in the user's
training data (and not its validation item).

Tie rules (:data:`TIE_RULES`). The rule above is ``pessimistic``, the framework's: a model that
scores the target like its rivals gains nothing. Binary codes (LightFR) take only ``f + 1`` score
values, so ties are common and the rule moves the figures a lot. :func:`evaluate_sampled_by_rule`
and :func:`evaluate_full_by_rule` report the same metrics under three rules, from one scoring pass:

``pessimistic``  ``rank = 1 + greater + tied`` (``greater``/``tied``: valid rivals scoring above / equal)
``optimistic``   ``rank = 1 + greater``: ties in the target's favour, what ``pandas.rank(method="first")``
                 gives when the target is listed first (LightFR's and most authors' code)
``random``       the expectation when the target's rank is uniform over ``1 + greater .. 1 + greater + tied``
                 (exact, no sampling: :func:`metrics_from_rank_range`)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from recmodels.sampling import EvalCandidates, user_item_csr
from recmodels.splits import Split

__all__ = [
    "METRIC_INFO",
    "TIE_RULES",
    "evaluate_full",
    "evaluate_full_by_rule",
    "evaluate_sampled",
    "evaluate_sampled_by_rule",
    "metrics_by_tie_rule",
    "metrics_from_rank_range",
    "metrics_from_ranks",
    "rank_of_target",
    "rank_range",
]

#: The tie rules every evaluation reports (module docstring); the first is the framework's.
TIE_RULES: tuple[str, ...] = ("pessimistic", "optimistic", "random")

#: Formula of each metric family (K replaced by the cut-off); all are higher-is-better.
METRIC_INFO: dict[str, str] = {
    "HR@K": "mean 1[rank <= K]",
    "NDCG@K": "mean 1[rank <= K] / log2(rank + 1)",
    "Precision@K": "mean 1[rank <= K] / K",
    "Recall@K": "mean 1[rank <= K] (one relevant item)",
    "MRR": "mean 1 / rank",
    "AUC": "mean (n_candidates - rank) / (n_candidates - 1)",
}


def _check_ks(ks: Iterable[int]) -> tuple[int, ...]:
    out = tuple(ks)
    for k in out:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"every cut-off K must be a positive int; found {k!r} in ks={out}.")
    return out


def rank_of_target(
    scores: np.ndarray,
    target_col: np.ndarray | int = 0,
    valid_mask: np.ndarray | None = None,
) -> np.ndarray:
    """1-based rank of the target column among valid entries; ties count against the target.

    ``rank[b] = 1 + #{j != target_col[b] : valid_mask[b, j] and scores[b, j] >= scores[b, target]}``.

    Args:
        scores: float ``[b, m]``.
        target_col: int or int ``[b]``, the target's column in each row.
        valid_mask: bool ``[b, m]`` of entries that compete (default: all). The target's own
            entry is always treated as the target, whatever its mask value.

    Returns:
        int64 ``[b]`` ranks in ``1..m``.

    Raises:
        ValueError: on shape mismatch, a target column out of range, or NaN scores among the
            valid entries.
    """
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D [users, candidates]; found shape {scores.shape}.")
    b, m = scores.shape
    rows = np.arange(b)
    target = np.broadcast_to(np.asarray(target_col, dtype=np.int64), (b,))
    if b and (target.min() < 0 or target.max() >= m):
        raise ValueError(f"target_col must lie in 0..{m - 1}; found {target.min()}..{target.max()}.")
    if valid_mask is not None:
        valid_mask = np.asarray(valid_mask, dtype=bool)
        if valid_mask.shape != scores.shape:
            raise ValueError(
                f"valid_mask shape {valid_mask.shape} differs from scores shape {scores.shape}."
            )
    nan = np.isnan(scores)
    if valid_mask is not None:
        nan = nan & valid_mask
        nan[rows, target] = np.isnan(scores[rows, target])
    if nan.any():
        r = int(np.flatnonzero(nan.any(axis=1))[0])
        raise ValueError(
            f"scores contain NaN (first in row {r}); the model diverged or produced invalid output."
        )
    target_scores = scores[rows, target]
    beats = scores >= target_scores[:, None]
    if valid_mask is not None:
        beats &= valid_mask
    beats[rows, target] = False
    return 1 + beats.sum(axis=1, dtype=np.int64)


def rank_range(
    scores: np.ndarray,
    target_col: np.ndarray | int = 0,
    valid_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The target's best and worst 1-based rank: ``(1 + greater, 1 + greater + tied)``.

    ``greater``/``tied`` count the valid entries other than the target that score strictly above /
    exactly like it. The worst rank is :func:`rank_of_target`'s (the pessimistic rule), the best the
    optimistic rule's; they differ only where the target ties. Arguments and errors as
    :func:`rank_of_target`.
    """
    worst = rank_of_target(scores, target_col, valid_mask)
    scores = np.asarray(scores)
    b = scores.shape[0]
    rows = np.arange(b)
    target = np.broadcast_to(np.asarray(target_col, dtype=np.int64), (b,))
    above = scores > scores[rows, target][:, None]
    if valid_mask is not None:
        above &= np.asarray(valid_mask, dtype=bool)
    above[rows, target] = False
    return 1 + above.sum(axis=1, dtype=np.int64), worst


def metrics_from_ranks(
    ranks: np.ndarray, n_candidates: np.ndarray | int, ks: Iterable[int] = (5, 10, 20)
) -> dict[str, float]:
    """Average HR@K, NDCG@K, Precision@K, Recall@K, MRR and AUC over users.

    Args:
        ranks: int ``[n]``, 1-based ranks of the held-out items.
        n_candidates: int or int ``[n]``, number of candidates of each user (target included),
            at least 1. A user whose only candidate is the held-out item (it has interacted
            with every other item) counts in every metric but AUC, which is undefined for it.
        ks: cut-offs K.

    Returns:
        ``{"HR@5": ..., "NDCG@5": ..., "Precision@5": ..., "Recall@5": ..., ..., "MRR": ...,
        "AUC": ...}`` as Python floats (NaN for every metric when ``ranks`` is empty; AUC is NaN
        when no user has two candidates).

    Raises:
        ValueError: for ranks outside ``1..n_candidates`` or no candidate.
    """
    ks = _check_ks(ks)
    ranks = np.asarray(ranks, dtype=np.int64).reshape(-1)
    n_cand = np.broadcast_to(np.asarray(n_candidates, dtype=np.int64), ranks.shape)
    if ranks.size:
        if n_cand.min() < 1:
            raise ValueError(f"every user needs at least its held-out item as a candidate; found {int(n_cand.min())}.")
        if ranks.min() < 1 or np.any(ranks > n_cand):
            raise ValueError(
                f"ranks must lie in 1..n_candidates; found {int(ranks.min())}..{int(ranks.max())}."
            )
    out: dict[str, float] = {}
    empty = ranks.size == 0

    def mean(x: np.ndarray) -> float:
        return float("nan") if empty else float(np.mean(x))

    for k in ks:
        hit = ranks <= k
        hr = mean(hit)
        out[f"HR@{k}"] = hr
        out[f"NDCG@{k}"] = mean(np.where(hit, 1.0 / np.log2(ranks + 1.0), 0.0))
        out[f"Precision@{k}"] = hr / k
        out[f"Recall@{k}"] = hr
    out["MRR"] = mean(1.0 / ranks)
    two = n_cand >= 2
    out["AUC"] = float(np.mean((n_cand[two] - ranks[two]) / (n_cand[two] - 1))) if two.any() else float("nan")
    return out


def metrics_from_rank_range(
    best: np.ndarray, worst: np.ndarray, n_candidates: np.ndarray | int, ks: Iterable[int] = (5, 10, 20)
) -> dict[str, float]:
    """The metrics of :func:`metrics_from_ranks` in expectation when each user's rank is uniform on
    ``best..worst`` (the ``random`` tie rule: the target and its ``worst - best`` tied rivals in a
    random order). Exact, from prefix sums: with ``n = worst - best + 1``,

    * ``E[1[rank <= K]] = clip(min(worst, K) - best + 1, 0, n) / n``;
    * ``E[NDCG@K] = sum_{r=best}^{min(worst, K)} 1/log2(r + 1) / n``;
    * ``E[1/rank] = (H(worst) - H(best - 1)) / n`` (harmonic numbers);
    * ``E[AUC] = (n_candidates - (best + worst)/2) / (n_candidates - 1)``.

    With ``best == worst`` it equals :func:`metrics_from_ranks` (up to rounding).

    Raises:
        ValueError: ``best > worst``, or ranks outside ``1..n_candidates``.
    """
    ks = _check_ks(ks)
    best = np.asarray(best, dtype=np.int64).reshape(-1)
    worst = np.asarray(worst, dtype=np.int64).reshape(-1)
    if best.shape != worst.shape or (best.size and np.any(best > worst)):
        raise ValueError("best and worst ranks must have one entry per user with best <= worst.")
    n_cand = np.broadcast_to(np.asarray(n_candidates, dtype=np.int64), best.shape)
    if best.size and (best.min() < 1 or np.any(worst > n_cand)):
        raise ValueError(f"ranks must lie in 1..n_candidates; found {int(best.min())}..{int(worst.max())}.")
    if best.size == 0:
        return metrics_from_ranks(best, n_cand, ks)
    top = int(worst.max())
    r = np.arange(1, top + 1, dtype=np.float64)
    ndcg_prefix = np.concatenate(([0.0], np.cumsum(1.0 / np.log2(r + 1.0))))  # [q] = sum_{r<=q}
    harmonic = np.concatenate(([0.0], np.cumsum(1.0 / r)))
    n = (worst - best + 1).astype(np.float64)
    out: dict[str, float] = {}
    for k in ks:
        upper = np.minimum(worst, k)
        inside = np.clip(upper - best + 1, 0, None)
        hr = float(np.mean(inside / n))
        out[f"HR@{k}"] = hr
        gain = np.where(inside > 0, ndcg_prefix[np.maximum(upper, 0)] - ndcg_prefix[best - 1], 0.0)
        out[f"NDCG@{k}"] = float(np.mean(gain / n))
        out[f"Precision@{k}"] = hr / k
        out[f"Recall@{k}"] = hr
    out["MRR"] = float(np.mean((harmonic[worst] - harmonic[best - 1]) / n))
    two = n_cand >= 2
    mean_rank = (best + worst) / 2.0
    out["AUC"] = float(np.mean((n_cand[two] - mean_rank[two]) / (n_cand[two] - 1))) if two.any() else float("nan")
    return out


def metrics_by_tie_rule(
    best: np.ndarray, worst: np.ndarray, n_candidates: np.ndarray | int, ks: Iterable[int] = (5, 10, 20)
) -> dict[str, dict[str, float]]:
    """``{rule: metrics}`` for each of :data:`TIE_RULES` from the best and worst ranks (:func:`rank_range`)."""
    return {
        "pessimistic": metrics_from_ranks(worst, n_candidates, ks),
        "optimistic": metrics_from_ranks(best, n_candidates, ks),
        "random": metrics_from_rank_range(best, worst, n_candidates, ks),
    }


def _scores_array(result: Any, shape: tuple[int, int], who: str) -> np.ndarray:
    if hasattr(result, "detach"):  # a torch tensor, without importing torch here
        result = result.detach().cpu().numpy()
    arr = np.asarray(result)
    if arr.dtype.kind != "f":  # keep float32 as is: a full-catalogue batch can be large
        arr = arr.astype(np.float64)
    if arr.shape != shape:
        raise ValueError(f"{who} returned shape {arr.shape}; expected {shape}.")
    return arr


def _check_batch(batch_users: int) -> int:
    if isinstance(batch_users, bool) or not isinstance(batch_users, (int, np.integer)) or batch_users < 1:
        raise ValueError(f"batch_users must be a positive int; found {batch_users!r}.")
    return int(batch_users)


def evaluate_sampled(
    score_fn: Callable[[np.ndarray, np.ndarray], Any],
    candidates: EvalCandidates,
    ks: Iterable[int] = (5, 10, 20),
    batch_users: int = 4096,
) -> dict[str, float]:
    """Metrics of the sampled protocol: rank the held-out item among its candidates.

    Args:
        score_fn: ``score_fn(users int64[b], items int64[b, m]) -> float [b, m]`` (numpy or a
            torch tensor).
        candidates: from :func:`recmodels.sampling.sample_eval_candidates` (column 0 = target),
            or a paper's candidate lists (entries with ``candidates.valid`` False do not compete).
        ks: cut-offs K.
        batch_users: users scored per call.

    Returns:
        The metrics of :func:`metrics_from_ranks` (the pessimistic tie rule) with
        ``n_candidates`` the number of competing candidates (``1 + n_negatives`` when sampled).
    """
    return evaluate_sampled_by_rule(score_fn, candidates, ks, batch_users)["pessimistic"]


def evaluate_sampled_by_rule(
    score_fn: Callable[[np.ndarray, np.ndarray], Any],
    candidates: EvalCandidates,
    ks: Iterable[int] = (5, 10, 20),
    batch_users: int = 4096,
) -> dict[str, dict[str, float]]:
    """:func:`evaluate_sampled` under every tie rule: ``{"pessimistic": ..., "optimistic": ..., "random": ...}``."""
    ks = _check_ks(ks)
    batch_users = _check_batch(batch_users)
    n, m = candidates.items.shape
    best = np.empty(n, dtype=np.int64)
    worst = np.empty(n, dtype=np.int64)
    for start in range(0, n, batch_users):
        stop = min(start + batch_users, n)
        users = candidates.users[start:stop]
        items = candidates.items[start:stop]
        mask = None if candidates.valid is None else candidates.valid[start:stop]
        scores = _scores_array(score_fn(users, items), (stop - start, m), "score_fn")
        best[start:stop], worst[start:stop] = rank_range(scores, 0, mask)
    return metrics_by_tie_rule(best, worst, candidates.n_candidates(), ks)


def evaluate_full(
    score_matrix_fn: Callable[[np.ndarray], Any],
    split: Split,
    ks: Iterable[int] = (5, 10, 20),
    batch_users: int = 1024,
) -> dict[str, float]:
    """Metrics of the full-ranking protocol.

    The held-out item of each user competes with every item that is not in the user's
    training data and is not the user's validation item; ``n_candidates`` is that number plus
    one (the target).

    Args:
        score_matrix_fn: ``score_matrix_fn(users int64[b]) -> float [b, n_items]``.
        split: the leave-one-out split (users with ``test_items < 0`` are skipped).
        ks: cut-offs K.
        batch_users: users scored per call.

    Returns:
        The metrics of :func:`metrics_from_ranks` (the pessimistic tie rule).
    """
    return evaluate_full_by_rule(score_matrix_fn, split, ks, batch_users)["pessimistic"]


def evaluate_full_by_rule(
    score_matrix_fn: Callable[[np.ndarray], Any],
    split: Split,
    ks: Iterable[int] = (5, 10, 20),
    batch_users: int = 1024,
    target: str = "test",
) -> dict[str, dict[str, float]]:
    """:func:`evaluate_full` under every tie rule.

    With ``target="valid"`` the validation item of each user is ranked instead, among every item
    not in the user's training data and not its test item (the model-selection figure).
    """
    ks = _check_ks(ks)
    batch_users = _check_batch(batch_users)
    if target not in ("test", "valid"):
        raise ValueError(f"target must be 'test' or 'valid'; found {target!r}.")
    if target == "valid" and split.valid_items is None:
        raise ValueError("target='valid' needs a split with validation items.")
    targets, others = (split.test_items, split.valid_items) if target == "test" else (split.valid_items, split.test_items)
    train = split.train
    n_items = train.n_items
    csr = user_item_csr(train)
    users_all = np.flatnonzero(targets >= 0).astype(np.int64)
    best = np.empty(users_all.size, dtype=np.int64)
    worst = np.empty(users_all.size, dtype=np.int64)
    n_cand = np.empty(users_all.size, dtype=np.int64)
    for start in range(0, users_all.size, batch_users):
        users = users_all[start : start + batch_users]
        b = users.size
        rows = np.arange(b)
        scores = _scores_array(score_matrix_fn(users), (b, n_items), "score_matrix_fn")
        valid = ~csr[users].toarray()
        if others is not None:
            oi = others[users]
            has = oi >= 0
            valid[rows[has], oi[has]] = False
        target_items = targets[users]
        valid[rows, target_items] = True
        best[start : start + b], worst[start : start + b] = rank_range(scores, target_items, valid)
        n_cand[start : start + b] = valid.sum(axis=1)
    return metrics_by_tie_rule(best, worst, n_cand, ks)
