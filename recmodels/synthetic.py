"""Synthetic interaction data with a learnable latent structure: the embedded default dataset.

Generative model (all draws from ``numpy.random.default_rng(seed)``; simulation randomness,
never secrets):

1. user factors ``P[u] ~ N(0, I_dim)``, item factors ``Q[i] ~ N(0, I_dim)``; the affinity is the
   standardised dot product ``a[u, i] = P[u] . Q[i] / sqrt(dim)`` (unit variance);
2. item popularity: a random permutation assigns Zipf ranks ``r_i = 1..n_items`` and a log
   popularity ``b[i] = -popularity_skew * log(r_i)`` (centred);
3. preference logits ``l[u, i] = signal * a[u, i] + b[i]`` with ``signal = 2.5``
   (:data:`SIGNAL`);
4. each user's number of interactions ``n_u = clip(round(m * exp(N(0, 0.5^2) - 0.125)), 3,
   n_items // 2)`` with ``m = mean_interactions`` (log-normal, mean about ``m``);
5. the ``n_u`` items are drawn **without replacement** with probabilities proportional to
   ``exp(l[u, :])`` (Gumbel top-k trick);
6. explicit ratings 1..5 from the affinity of the chosen pair: cut points at the 10/30/60/85 %
   quantiles of all chosen affinities;
7. timestamps: each user's items in a random order at increasing fake times
   (``1_000_000_000 + 86_400 * u + 60 * position``).

Ranking a user's unseen items by the true logit therefore beats ranking by popularity on the
held-out (latest) item, which is what a GMF should learn (tests check it with the true model).
"""

from __future__ import annotations

import numpy as np

from recmodels.data import Interactions

__all__ = ["SIGNAL", "generate_synthetic", "true_logits"]

#: Weight of the latent affinity in the preference logits (chosen so that the latent signal
#: clearly beats popularity; see tests/recmodels/test_data_synthetic.py).
SIGNAL = 2.5

_BASE_TIME = 1_000_000_000


def _factors(
    rng: np.random.Generator, n_users: int, n_items: int, dim: int, popularity_skew: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p = rng.standard_normal((n_users, dim))
    q = rng.standard_normal((n_items, dim))
    ranks = rng.permutation(n_items) + 1
    bias = -popularity_skew * np.log(ranks)
    return p, q, bias - bias.mean()


def true_logits(
    *,
    n_users: int = 1000,
    n_items: int = 500,
    seed: int = 0,
    dim: int = 8,
    popularity_skew: float = 1.0,
) -> np.ndarray:
    """The generator's preference logits ``[n_users, n_items]`` for the same arguments.

    Useful as an oracle scorer: it is the best possible ranking of unseen items.
    """
    rng = np.random.default_rng(seed)
    p, q, bias = _factors(rng, n_users, n_items, dim, popularity_skew)
    return SIGNAL * (p @ q.T) / np.sqrt(dim) + bias


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}; found {value!r}.")
    return int(value)


def generate_synthetic(
    *,
    n_users: int = 1000,
    n_items: int = 500,
    seed: int = 0,
    dim: int = 8,
    mean_interactions: int = 40,
    popularity_skew: float = 1.0,
) -> Interactions:
    """Generate a deterministic synthetic dataset (see the module docstring for the model).

    Args:
        n_users: number of users (>= 1).
        n_items: number of items (>= 6, so every user can have 3 interactions).
        seed: seed of the numpy generator; the same arguments give the same data.
        dim: latent dimension (>= 1).
        mean_interactions: mean interactions per user (>= 3; capped at ``n_items // 2``).
        popularity_skew: Zipf exponent of item popularity (>= 0; 0 means no popularity bias).

    Returns:
        Explicit-rating interactions (ratings 1..5) with raw ids ``0..n-1`` and ``source``
        ``"synthetic(seed=...,...)"``.
    """
    n_users = _check_int("n_users", n_users, 1)
    n_items = _check_int("n_items", n_items, 6)
    dim = _check_int("dim", dim, 1)
    mean_interactions = _check_int("mean_interactions", mean_interactions, 3)
    seed = _check_int("seed", seed, 0)
    if not np.isfinite(popularity_skew) or popularity_skew < 0:
        raise ValueError(f"popularity_skew must be a finite number >= 0; found {popularity_skew!r}.")
    rng = np.random.default_rng(seed)
    p, q, bias = _factors(rng, n_users, n_items, dim, float(popularity_skew))
    counts = np.rint(mean_interactions * np.exp(rng.normal(-0.125, 0.5, n_users)))
    counts = np.clip(counts, 3, n_items // 2).astype(np.int64)

    users_out, items_out, aff_out = [], [], []
    chunk = max(1, 2_000_000 // n_items)
    for start in range(0, n_users, chunk):
        stop = min(start + chunk, n_users)
        affinity = (p[start:stop] @ q.T) / np.sqrt(dim)
        keys = SIGNAL * affinity + bias + rng.gumbel(size=affinity.shape)
        order = np.argsort(-keys, axis=1)
        take = np.arange(n_items)[None, :] < counts[start:stop, None]
        # Shuffle the chosen items' order so that time order is independent of preference rank.
        rank_keys = np.where(take, rng.random(take.shape), 2.0)
        shuffled = np.take_along_axis(order, np.argsort(rank_keys, axis=1), axis=1)
        rows, cols = np.nonzero(take)
        items = shuffled[rows, cols]
        users_out.append(rows + start)
        items_out.append(items)
        aff_out.append(affinity[rows, items])
    users = np.concatenate(users_out).astype(np.int64)
    items = np.concatenate(items_out).astype(np.int64)
    affinity = np.concatenate(aff_out)
    cuts = np.quantile(affinity, [0.10, 0.30, 0.60, 0.85])
    ratings = (1 + np.searchsorted(cuts, affinity, side="right")).astype(np.float32)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    position = np.arange(users.size) - starts[users]
    timestamps = _BASE_TIME + 86_400 * users + 60 * position
    source = (
        f"synthetic(seed={seed},n_users={n_users},n_items={n_items},dim={dim},"
        f"mean_interactions={mean_interactions},popularity_skew={popularity_skew:g})"
    )
    return Interactions(
        users=users,
        items=items,
        ratings=ratings,
        timestamps=timestamps.astype(np.int64),
        user_ids=np.arange(n_users, dtype=np.int64),
        item_ids=np.arange(n_items, dtype=np.int64),
        source=source,
        check_duplicates=False,
    )
