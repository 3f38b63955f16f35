"""FedCL's server-side pieces: clustering the cached LDP embeddings, picking semi-hard negatives,
and the per-user privacy report of the embedding uploads.

* :func:`cluster_centroids`: Ward (``scipy.cluster.hierarchy.linkage(method="ward")`` cut into
  ``C`` clusters, the paper's choice), k-means (``scipy.cluster.vq.kmeans2``, the scalable
  option, notes 8.1 option b and 8.16) or none; every embedding is replaced by its cluster's
  element-wise mean. Ward needs the ``n(n-1)/2`` condensed distance matrix (float64), so it is
  refused above :data:`WARD_MAX_POINTS` with an error that names ``fedcl.clustering = "kmeans"``.
* :func:`hard_candidates` / :func:`sample_semi_hard`: the top ``R%`` of items by dot product with a
  centroid (Eq. 1's relevance, notes 8.5; ties broken by item id), then ``T`` drawn uniformly
  without replacement, independently per client (notes 2.5); or the ``T`` globally hardest (the
  paper's Fig. 3 ablation).
* :func:`per_user_report`: ``ProtocolSpec.privacy_report`` for FedCL: every ledger entry with cohort
  ``"user:<u>"`` and a Laplace event is one LDP upload by user ``u``; each user's uploads compose
  sequentially (basic composition, and the tightest of pure/RDP/PLD at ``delta``).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.cluster.vq import kmeans2

from dp.events import Laplace
from dp.ldp import ldp_repeated_uploads

__all__ = ["CLUSTERINGS", "WARD_MAX_POINTS", "cluster_centroids", "hard_candidates", "per_user_report",
           "sample_semi_hard"]

CLUSTERINGS = ("ward", "kmeans", "none")
#: Above this many cached embeddings Ward's peak memory passes ~3 GB: the condensed float64
#: distance matrix (n(n-1)/2 * 8 bytes) times the measured 1.13 (docs/fedcl.md, cluster-cost).
WARD_MAX_POINTS = 25_000


def cluster_centroids(x: np.ndarray, n_clusters: int, method: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Cluster the rows of ``x`` and return ``(centroid of each row's cluster [n, d], labels [n])``.

    ``method="none"`` returns ``x`` itself (every row its own cluster). Fewer rows than clusters
    put every row in its own cluster.
    """
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if method not in CLUSTERINGS:
        raise ValueError(f"fedcl.clustering must be one of {CLUSTERINGS}; found {method!r}")
    if method == "none" or n <= n_clusters:
        return x.copy(), np.arange(n)
    if method == "ward":
        if n > WARD_MAX_POINTS:
            raise ValueError(
                f"Ward clustering of {n} cached embeddings needs about {1.13 * n * (n - 1) * 4 / 1e9:.1f} GB (its "
                f"distance matrix; limit {WARD_MAX_POINTS} points); set fedcl.clustering = \"kmeans\""
            )
        labels = fcluster(linkage(x, method="ward"), t=n_clusters, criterion="maxclust") - 1
    else:
        _, labels = kmeans2(x, n_clusters, minit="++", seed=rng)
    labels = np.unique(labels, return_inverse=True)[1]
    k = labels.max() + 1
    sums = np.zeros((k, x.shape[1]))
    np.add.at(sums, labels, x)
    cent = sums / np.bincount(labels, minlength=k)[:, None]
    return cent[labels], labels


def hard_candidates(centroids: np.ndarray, item: np.ndarray, percent: float) -> np.ndarray:
    """Item ids of the top ``percent``% by ``centroid . item`` per row: ``[m, ceil(percent/100 n)]``.

    Ordered by descending score; equal scores by ascending item id (a stable sort).
    """
    n_items = item.shape[0]
    k = max(1, math.ceil(percent / 100.0 * n_items - 1e-9))
    scores = np.asarray(centroids, np.float64) @ np.asarray(item, np.float64).T
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def sample_semi_hard(candidates: np.ndarray, t: int, mode: str, rng: np.random.Generator) -> np.ndarray:
    """``t`` negatives per row of ``candidates``: uniform without replacement (``"sample"``) or the
    first ``t`` (``"hardest"``). Fewer candidates than ``t`` returns them all."""
    m, k = candidates.shape
    t = min(t, k)
    if mode == "hardest":
        return candidates[:, :t].copy()
    pick = np.argsort(rng.random((m, k)), axis=1)[:, :t]
    return np.take_along_axis(candidates, pick, axis=1)


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"max": float(a.max()), "median": float(np.median(a)), "min": float(a.min()), "mean": float(a.mean())}


def per_user_report(ledger: Any, delta: float) -> dict[str, Any]:
    """The ``per_user`` key of ``secagg privacy report`` for a FedCL run (see the module docstring).

    The model updates of a FedCL run carry no DP (the ledger's total epsilon is infinite because of
    them); ``per_user`` covers the LDP embedding uploads, which are the paper's only DP promise.
    """
    uploads: dict[str, Counter] = {}
    for e in ledger.entries():
        if e.cohort and e.cohort.startswith("user:") and isinstance(e.event, Laplace):
            uploads.setdefault(e.cohort, Counter())[e.event.noise_multiplier] += 1
    if not uploads:
        return {"per_user": {"users": 0, "note": "no LDP embedding uploads in this run"}}
    cache: dict[tuple, tuple[float, float, str]] = {}
    basic, best, counts, accountants = [], [], [], Counter()
    for cnt in uploads.values():
        key = tuple(sorted(cnt.items()))
        if key not in cache:
            eps_basic = sum(n / m for m, n in key)
            if len(key) == 1:
                m, n = key[0]
                rep = ldp_repeated_uploads(Laplace(m), n, delta=delta)
                cache[key] = (eps_basic, min(rep.epsilon, eps_basic), rep.accountant)
            else:  # several per-upload epsilons: basic composition only
                cache[key] = (eps_basic, eps_basic, "pure")
        b, e, acc = cache[key]
        basic.append(b), best.append(e), counts.append(sum(cnt.values()))
        accountants[acc] += 1
    per_upload = sorted({1.0 / m for cnt in uploads.values() for m in cnt})
    return {"per_user": {
        "users": len(uploads),
        "uploads": _stats(counts),
        "epsilon_per_upload": per_upload,
        "epsilon_basic": _stats(basic),
        "epsilon": _stats(best),
        "delta": delta,
        "accountant": accountants.most_common(1)[0][0],
        "scope": "LDP user-embedding uploads only (replace-one, per user); the model updates carry no DP",
    }}
