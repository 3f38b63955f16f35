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
:func:`recmodels.sampling.sample_eval_candidates`); :func:`evaluate_full` ranks it among all
items not in the user's training data (and not its validation item).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from recmodels.sampling import EvalCandidates, user_item_csr
from recmodels.splits import Split

__all__ = [
    "METRIC_INFO",
    "evaluate_full",
    "evaluate_sampled",
    "metrics_from_ranks",
    "rank_of_target",
]

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
        candidates: from :func:`recmodels.sampling.sample_eval_candidates` (column 0 = target).
        ks: cut-offs K.
        batch_users: users scored per call.

    Returns:
        The metrics of :func:`metrics_from_ranks` with ``n_candidates = 1 + n_negatives``.
    """
    ks = _check_ks(ks)
    batch_users = _check_batch(batch_users)
    n, m = candidates.items.shape
    ranks = np.empty(n, dtype=np.int64)
    for start in range(0, n, batch_users):
        stop = min(start + batch_users, n)
        users = candidates.users[start:stop]
        items = candidates.items[start:stop]
        scores = _scores_array(score_fn(users, items), (stop - start, m), "score_fn")
        ranks[start:stop] = rank_of_target(scores, 0)
    return metrics_from_ranks(ranks, m, ks)


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
        The metrics of :func:`metrics_from_ranks`.
    """
    ks = _check_ks(ks)
    batch_users = _check_batch(batch_users)
    train = split.train
    n_items = train.n_items
    csr = user_item_csr(train)
    users_all = split.test_users.astype(np.int64)
    ranks = np.empty(users_all.size, dtype=np.int64)
    n_cand = np.empty(users_all.size, dtype=np.int64)
    for start in range(0, users_all.size, batch_users):
        users = users_all[start : start + batch_users]
        b = users.size
        rows = np.arange(b)
        scores = _scores_array(score_matrix_fn(users), (b, n_items), "score_matrix_fn")
        valid = ~csr[users].toarray()
        if split.valid_items is not None:
            vi = split.valid_items[users]
            has = vi >= 0
            valid[rows[has], vi[has]] = False
        target = split.test_items[users]
        valid[rows, target] = True
        ranks[start : start + b] = rank_of_target(scores, target, valid)
        n_cand[start : start + b] = valid.sum(axis=1)
    return metrics_from_ranks(ranks, n_cand, ks)
