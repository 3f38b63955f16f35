"""Disjoint client clusters from public attributes only (FEL notes §2.1, §8.10, §8.11).

Every function returns one cluster index per user (``int64 [n_users]``), so a user belongs to
exactly one cluster by construction. The inputs are public: the raw user id (hashing), the
demographics of ``u.user``/``users.dat`` (:mod:`recmodels.side`), or features built from them for
k-means. Nothing here sees ratings, so no cluster assignment can leak a label (notes §8.10).
:func:`from_members` turns explicit member lists into an assignment and refuses overlaps.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

import numpy as np

from recmodels.side import UserDemographics

__all__ = ["ATTRIBUTES", "attribute_clusters", "check_sizes", "demographic_features", "from_members",
           "hash_clusters", "kmeans_clusters"]

#: Demographic attributes clustering may use (each public under FEL's label-only privacy).
ATTRIBUTES = ("age_band", "gender", "occupation", "zip_region")


def _check_k(n_clusters: int) -> None:
    if isinstance(n_clusters, bool) or not isinstance(n_clusters, int) or n_clusters < 1:
        raise ValueError(f"n_clusters must be an int >= 1; found {n_clusters!r}")


def hash_clusters(user_ids: Sequence[object], n_clusters: int, *, salt: str = "fel") -> np.ndarray:
    """``sha256(salt | raw id) mod n_clusters`` per user: FEL's "simple hashing" (notes §8.11)."""
    _check_k(n_clusters)
    out = np.empty(len(user_ids), dtype=np.int64)
    for i, uid in enumerate(user_ids):
        digest = hashlib.sha256(f"{salt}|{uid}".encode()).digest()
        out[i] = int.from_bytes(digest[:8], "little") % n_clusters
    return out


def _attribute_values(demo: UserDemographics, attribute: str) -> list[str]:
    if attribute not in ATTRIBUTES:
        raise ValueError(f"attribute must be one of {ATTRIBUTES}; found {attribute!r}")
    if attribute == "age_band":
        return [str(b) if b >= 0 else "" for b in demo.age_band()]
    if attribute == "zip_region":
        return demo.zip_region()
    return list(getattr(demo, attribute))


def attribute_clusters(demo: UserDemographics, attribute: str, n_clusters: int) -> np.ndarray:
    """One cluster per value of ``attribute``; the rarest values (and unknowns) share the last one.

    Values are ranked by frequency (ties by value); the ``n_clusters - 1`` most frequent get their
    own cluster, every other value (and ``""``, unknown) goes to cluster ``n_clusters - 1``. With
    fewer values than clusters, the surplus clusters are empty (:func:`check_sizes` refuses them).
    """
    _check_k(n_clusters)
    values = _attribute_values(demo, attribute)
    counts = Counter(v for v in values if v)
    ranked = [v for v, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    own = {v: i for i, v in enumerate(ranked[: n_clusters - 1])} if len(ranked) > n_clusters else {
        v: i for i, v in enumerate(ranked)}
    other = n_clusters - 1
    return np.array([own.get(v, other) for v in values], dtype=np.int64)


def demographic_features(demo: UserDemographics) -> np.ndarray:
    """One-hot age band, gender, occupation and zip region per user (float ``[n_users, f]``)."""
    blocks = []
    for attr in ATTRIBUTES:
        values = _attribute_values(demo, attr)
        levels = sorted(set(values))
        index = {v: i for i, v in enumerate(levels)}
        block = np.zeros((len(values), len(levels)))
        block[np.arange(len(values)), [index[v] for v in values]] = 1.0
        blocks.append(block)
    return np.concatenate(blocks, axis=1)


def kmeans_clusters(features: np.ndarray, n_clusters: int, *, seed: int) -> np.ndarray:
    """k-means (k-means++ init, :func:`scipy.cluster.vq.kmeans2`) over public per-user features."""
    from scipy.cluster.vq import kmeans2

    _check_k(n_clusters)
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < n_clusters:
        raise ValueError(f"k-means needs [n_users >= n_clusters, f] features; found {x.shape} for {n_clusters}")
    _, labels = kmeans2(x, n_clusters, minit="++", seed=np.random.default_rng(seed))
    return labels.astype(np.int64)


def from_members(members: Sequence[Sequence[int]], n_users: int) -> np.ndarray:
    """An assignment from explicit cluster member lists; overlaps and unassigned users are refused."""
    out = np.full(n_users, -1, dtype=np.int64)
    for c, m in enumerate(members):
        idx = np.asarray(m, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n_users):
            raise ValueError(f"cluster {c} names a user outside 0..{n_users - 1}")
        clash = idx[out[idx] >= 0]
        if clash.size or np.unique(idx).size != idx.size:
            user = int(clash[0]) if clash.size else int(idx[0])
            raise ValueError(f"clusters overlap: user {user} is in cluster {c} and another; FEL's parallel "
                             "composition needs disjoint clusters")
        out[idx] = c
    if np.any(out < 0):
        raise ValueError(f"{int((out < 0).sum())} users are in no cluster; every client needs exactly one")
    return out


def check_sizes(assign: np.ndarray, n_clusters: int, clients: np.ndarray, min_clients: int, where: str) -> np.ndarray:
    """Members with training data per cluster; refuses a cluster below ``min_clients`` (names ``where``)."""
    sizes = np.bincount(assign[clients], minlength=n_clusters)
    small = np.flatnonzero(sizes < min_clients)
    if small.size:
        raise ValueError(
            f"cluster {int(small[0])} has {int(sizes[small[0]])} clients, below {where}={min_clients}; "
            f"use fewer clusters or lower {where} (sizes: {sizes.tolist()})")
    return sizes
