"""Explicit-rating matrix factorisation, the payload of FedMF (Chai et al. 2020).

The model predicts ``r_ui ~ p_u . q_i``. In the federated setting the user vectors ``P`` stay on
their clients and the item matrix ``Q`` lives on the server; this module holds only the maths
(numpy, no federated logic, no crypto), batched over users so that a round of ``n`` clients is a
handful of vectorised operations.

Local update rules (FedMF's reference code, ``user_update``), with learning rate ``lr``,
regularisers ``reg_user`` and ``reg_item``, and the error ``e = r - p . q``:

* ``"sequential"`` (FedMF's item-by-item update; the default): the client walks its rated items
  in ascending item index; for each item ``i``
  ``p <- p - lr (-2 e q_i + 2 reg_user p)`` and then the item gradient is taken at the *updated*
  ``p``: ``g_i = lr (-2 e p + 2 reg_item q_i)``;
* ``"batch"``: every item gradient at the same ``p``: ``g_i = lr (-2 e_i p + 2 reg_item q_i)``, then
  one user step ``p <- p - lr (sum_i -2 e_i q_i + 2 reg_user p)``.

The server applies ``Q <- Q - sum_u g_u`` (FedMF's rule). Everything here uses the *update*
``delta = -g`` so that the server simply adds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from recmodels.data import Interactions

__all__ = ["MFConfig", "RatingLists", "init_factors", "local_updates", "mae", "predict", "rating_lists", "rmse"]

_MODES = ("sequential", "batch")


@dataclass(frozen=True)
class MFConfig:
    """Hyper-parameters of explicit MF.

    Attributes:
        dim: number of latent factors (default 16).
        lr: learning rate (default 0.005).
        reg_user: L2 regulariser of user vectors (default 1e-4, FedMF's).
        reg_item: L2 regulariser of item vectors (default 1e-4, FedMF's).
        init_mean: initial prediction ``p . q`` (factors start at ``sqrt(init_mean / dim)``).
        init_std: standard deviation of the initial noise added to every factor.
        user_update: ``"sequential"`` (FedMF) or ``"batch"`` (see the module docstring).
    """

    dim: int = 16
    lr: float = 0.005
    reg_user: float = 1e-4
    reg_item: float = 1e-4
    init_mean: float = 3.0
    init_std: float = 0.3
    user_update: str = "sequential"

    def __post_init__(self) -> None:
        if type(self.dim) is not int or self.dim < 1:
            raise ValueError(f"MFConfig.dim must be an int >= 1; found {self.dim!r}.")
        for name in ("lr", "reg_user", "reg_item", "init_mean", "init_std"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"MFConfig.{name} must be a finite number >= 0; found {v!r}.")
        if not self.lr > 0:
            raise ValueError(f"MFConfig.lr must be positive; found {self.lr!r}.")
        if self.user_update not in _MODES:
            raise ValueError(f"MFConfig.user_update must be one of {_MODES}; found {self.user_update!r}.")


@dataclass(frozen=True, eq=False)
class RatingLists:
    """Each user's ratings as padded rows, items in ascending index order.

    Attributes:
        items: int64 ``[n_users, L]``, rated item indices, ``-1`` padding at the end.
        ratings: float64 ``[n_users, L]``, the ratings (0 in padding).
        counts: int64 ``[n_users]``, number of ratings per user.
        n_items: number of items.
    """

    items: np.ndarray
    ratings: np.ndarray
    counts: np.ndarray
    n_items: int

    @property
    def mask(self) -> np.ndarray:
        """bool ``[n_users, L]``: True on real entries."""
        return self.items >= 0

    def rated_sets(self) -> list[np.ndarray]:
        """Per user, the sorted array of rated items."""
        return [row[:c] for row, c in zip(self.items, self.counts)]


def rating_lists(data: Interactions) -> RatingLists:
    """Group ``data`` by user into :class:`RatingLists` (vectorised)."""
    order = np.lexsort((data.items, data.users))
    users, items, ratings = data.users[order], data.items[order], data.ratings[order].astype(np.float64)
    counts = np.bincount(users, minlength=data.n_users).astype(np.int64)
    width = int(counts.max()) if counts.size else 0
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    pos = np.arange(len(users)) - starts[users]
    out_i = np.full((data.n_users, width), -1, dtype=np.int64)
    out_r = np.zeros((data.n_users, width))
    out_i[users, pos] = items
    out_r[users, pos] = ratings
    return RatingLists(out_i, out_r, counts, data.n_items)


def init_factors(n_users: int, n_items: int, config: MFConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Initial ``(P, Q)``: ``sqrt(init_mean/dim) + N(0, init_std^2)`` per factor (simulation randomness)."""
    base = math.sqrt(config.init_mean / config.dim)
    p = base + config.init_std * rng.standard_normal((n_users, config.dim))
    q = base + config.init_std * rng.standard_normal((n_items, config.dim))
    return p, q


def local_updates(
    p: np.ndarray, q: np.ndarray, lists: RatingLists, config: MFConfig, users: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One local pass of every listed user, batched over users.

    Args:
        p: ``[n, dim]`` user vectors of the ``users`` (not modified).
        q: ``[n_items, dim]`` the item matrix the clients received.
        lists: rating lists of all users.
        config: hyper-parameters (``user_update`` picks the rule).
        users: which rows of ``lists`` the rows of ``p`` belong to (default: all, in order).

    Returns:
        ``(p_new, delta)``: the updated user vectors and the item updates ``delta = -g``,
        ``[n, L, dim]`` aligned with ``lists.items[users]`` (zeros in padding).
    """
    users = np.arange(lists.items.shape[0]) if users is None else np.asarray(users)
    items, ratings = lists.items[users], lists.ratings[users]
    mask = items >= 0
    lr, ru, ri = config.lr, config.reg_user, config.reg_item
    p = np.array(p, dtype=np.float64, copy=True)
    qs = q[np.where(mask, items, 0)]  # [n, L, d]
    delta = np.zeros_like(qs)
    if config.user_update == "batch":
        e = np.where(mask, ratings - np.einsum("nd,nld->nl", p, qs), 0.0)
        delta = np.where(mask[..., None], lr * (2 * e[..., None] * p[:, None, :] - 2 * ri * qs), 0.0)
        step = 2 * np.einsum("nl,nld->nd", e, qs) - 2 * ru * p
        return p + lr * step, delta
    for k in range(items.shape[1]):
        m = mask[:, k]
        qk = qs[:, k]
        e = ratings[:, k] - np.einsum("nd,nd->n", p, qk)
        p_new = p - lr * (-2 * e[:, None] * qk + 2 * ru * p)
        p = np.where(m[:, None], p_new, p)
        delta[:, k] = np.where(m[:, None], lr * (2 * e[:, None] * p - 2 * ri * qk), 0.0)
    return p, delta


def predict(p: np.ndarray, q: np.ndarray, users: np.ndarray, items: np.ndarray, *, clip: tuple[float, float] | None = None) -> np.ndarray:
    """Predicted ratings ``p_u . q_i`` for pairs, optionally clipped to the rating scale."""
    out = np.einsum("nd,nd->n", p[users], q[items])
    return np.clip(out, *clip) if clip is not None else out


def rmse(pred: np.ndarray, truth: np.ndarray) -> float:
    """Root mean squared error ``sqrt(mean((pred - truth)^2))`` (lower is better)."""
    return float(np.sqrt(np.mean((np.asarray(pred) - np.asarray(truth)) ** 2)))


def mae(pred: np.ndarray, truth: np.ndarray) -> float:
    """Mean absolute error ``mean(|pred - truth|)`` (lower is better)."""
    return float(np.mean(np.abs(np.asarray(pred) - np.asarray(truth))))
