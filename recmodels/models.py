"""Payload models: GMF (NCF's generalised matrix factorisation) and non-learned baselines.

GMF (He et al., 2017) scores a user-item pair as

    y_hat(u, i) = sigmoid(h^T (p_u * q_i) + b)

with user embedding ``p_u``, item embedding ``q_i`` (both ``dim``-dimensional), an output
layer ``h`` and a bias ``b``; it is trained with binary cross-entropy on observed positives and
sampled negatives. The parameter layout is kept explicit (user table, item table, output layer)
because the federated protocols split it between parties: user rows stay on their clients,
item rows and the output layer are aggregated by the server.

Every scorer here exposes the two methods the evaluation in :mod:`recmodels.metrics` needs:
``score(users, items)`` for candidate lists and ``score_all(users)`` for full ranking.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from recmodels.data import Interactions

__all__ = ["GMF", "ItemPop", "RandomScorer", "gmf_logits"]


def gmf_logits(p: torch.Tensor, q: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """GMF logits ``(p * q) @ h + b`` for row-aligned ``p`` and ``q`` of shape ``[..., dim]``.

    ``h`` may be ``[dim]`` (shared) or ``[..., dim]`` (one output layer per row, as when many
    clients train their local copies at once); ``b`` broadcasts the same way.
    """
    return ((p * q) * h).sum(-1) + b


class GMF(nn.Module):
    """Generalised matrix factorisation with an explicit (user, item, output) layout.

    Args:
        n_users: number of users (rows of the user table).
        n_items: number of items (rows of the item table).
        dim: embedding size.
        generator: torch generator for the initialisation (``N(0, 0.01^2)`` embeddings, as in
            NCF's reference code; ``h`` initialised to ones so that the model starts as a dot
            product, ``b = 0``).
    """

    def __init__(self, n_users: int, n_items: int, dim: int = 32, *, generator: torch.Generator | None = None):
        super().__init__()
        if n_users < 1 or n_items < 1 or dim < 1:
            raise ValueError(f"GMF needs positive sizes; found n_users={n_users}, n_items={n_items}, dim={dim}")
        self.user = nn.Parameter(torch.randn(n_users, dim, generator=generator) * 0.01)
        self.item = nn.Parameter(torch.randn(n_items, dim, generator=generator) * 0.01)
        self.h = nn.Parameter(torch.ones(dim))
        self.b = nn.Parameter(torch.zeros(()))

    @property
    def dim(self) -> int:
        return int(self.item.shape[1])

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Logits for row-aligned ``users`` and ``items`` (any matching shapes)."""
        return gmf_logits(self.user[users], self.item[items], self.h, self.b)

    @torch.no_grad()
    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Scores ``[b, m]`` of candidate ``items[b, m]`` for ``users[b]``."""
        u = torch.as_tensor(np.asarray(users), dtype=torch.long)
        i = torch.as_tensor(np.asarray(items), dtype=torch.long)
        pu = self.user[u].unsqueeze(1)  # [b, 1, d]
        return gmf_logits(pu, self.item[i], self.h, self.b).numpy()

    @torch.no_grad()
    def score_all(self, users: np.ndarray) -> np.ndarray:
        """Scores ``[b, n_items]`` of every item for ``users[b]``."""
        u = torch.as_tensor(np.asarray(users), dtype=torch.long)
        return ((self.user[u] * self.h) @ self.item.T + self.b).numpy()


class ItemPop:
    """Most-popular baseline: an item's score is its number of training interactions.

    Ties between equally popular items are left as ties, so the evaluation's tie rule (ties
    count against the held-out item) applies; no hidden tie-break flatters the baseline.
    """

    def __init__(self, train: Interactions):
        self.counts = np.bincount(train.items, minlength=train.n_items).astype(np.float64)

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return self.counts[np.asarray(items)]

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return np.broadcast_to(self.counts, (len(users), self.counts.size))


class RandomScorer:
    """Uniformly random scores, fixed per (user, item) by a seed: the chance-level baseline.

    Scores are a SplitMix64 hash of ``(seed, user, item)`` mapped to [0, 1), so they need no
    ``n_users x n_items`` table and are identical between sampled and full ranking. Simulation
    randomness, not a secret.
    """

    def __init__(self, n_users: int, n_items: int, seed: int = 0):
        self.n_items = int(n_items)
        self.seed = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)

    def _hash(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            z = (users.astype(np.uint64) * np.uint64(self.n_items) + items.astype(np.uint64)) ^ self.seed
            z = z + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        items = np.asarray(items)
        return self._hash(np.broadcast_to(np.asarray(users)[:, None], items.shape), items)

    def score_all(self, users: np.ndarray) -> np.ndarray:
        users = np.asarray(users)
        return self._hash(np.repeat(users[:, None], self.n_items, 1), np.arange(self.n_items)[None, :])
