"""An NCF-style MLP scorer for id-based leaves (He et al. 2017's MLP tower, one hidden layer).

``logit(u, i) = h . relu(W [p_u ; q_i] + c) + b`` with user and item embeddings ``p_u, q_i`` of
dimension ``d``, a hidden layer of width ``k`` (``W: [k, 2d]``, ``c: [k]``) and the output layer
``(h, b)``. The hidden activation ``relu(W [p_u ; q_i] + c)`` is the model's "last hidden layer"
(what FEL's over-arch reads, notes §2.4).

Everything here accepts per-row parameters (``W: [..., k, 2d]``) so that many clients, each with
its own copy, are computed in one batch (:class:`protocols.fel_ncf.NcfLeaf`).
"""

from __future__ import annotations

import numpy as np
import torch

from recmodels.streams import integers, stream_keys

__all__ = ["fold_in_ncf", "init_ncf", "ncf_forward"]


def init_ncf(dim: int, hidden: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded initial ``(W [hidden, 2 dim], c [hidden], h [hidden])``: He-uniform ``W``, ``c = 0.01``."""
    g = torch.Generator().manual_seed(int(seed))
    bound = float(np.sqrt(6.0 / (2 * dim)))
    w = (torch.rand(hidden, 2 * dim, generator=g) * 2 - 1) * bound
    h = (torch.rand(hidden, generator=g) * 2 - 1) / float(np.sqrt(hidden))
    return w, torch.full((hidden,), 0.01), h


def ncf_forward(p: torch.Tensor, q: torch.Tensor, w: torch.Tensor, c: torch.Tensor, h: torch.Tensor,
                b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre-activation a, hidden relu(a), logit)`` for row-aligned ``p, q: [..., d]``.

    ``w`` is ``[k, 2d]`` (shared) or ``[..., k, 2d]`` (one per row); ``c``, ``h``: ``[k]`` or
    ``[..., k]``; ``b`` broadcasts against the logits.
    """
    x = torch.cat([p, q], dim=-1)
    a = (w @ x.unsqueeze(-1)).squeeze(-1) + c if w.dim() > 2 else x @ w.T + c
    r = torch.relu(a)
    return a, r, (r * h).sum(-1) + b


@torch.no_grad()
def fold_in_ncf(item: torch.Tensor, w: torch.Tensor, c: torch.Tensor, h: torch.Tensor, b: torch.Tensor,
                pos_start: np.ndarray, pos_items: np.ndarray, users: np.ndarray, *, negatives: int = 4,
                steps: int = 50, lr: float = 0.05, reg: float = 0.01, seed: int = 0) -> torch.Tensor:
    """User vectors fitted to a frozen NCF model from each user's positives, batched over users.

    Minimises, per user, the mean BCE over its positives (label 1) and ``negatives`` items per
    positive (label 0; drawn uniformly from a generator seeded by ``seed``, so deterministic) plus
    ``reg |p|^2``, by ``steps`` full-batch Adam steps from ``p = 0``. Gradients are computed in
    closed form for all users at once (``index_add`` per user); no loop per user. Each user's
    negatives come from its own stream keyed by ``(seed, 17, user)`` (:mod:`recmodels.streams`),
    so a user folded in alone (on its own device, fedflower) draws what it draws in a batch.

    Returns:
        ``[len(users), d]`` float32 (zeros for a user without positives).
    """
    users = np.asarray(users, dtype=np.int64)
    d = item.shape[1]
    counts = pos_start[users + 1] - pos_start[users]
    owner = np.repeat(np.arange(len(users)), counts)
    items = (np.concatenate([pos_items[pos_start[u]:pos_start[u + 1]] for u in users]) if len(users)
             else np.zeros(0, np.int64)).astype(np.int64)
    labels = np.ones(len(items))
    if negatives:
        neg_owner = np.repeat(owner, negatives)  # (grouped by user, in ``users`` order)
        first = np.concatenate([[0], np.cumsum(counts * negatives)])[:-1]
        counter = np.arange(len(neg_owner)) - first[neg_owner]  # the j-th negative of its user
        keys = stream_keys(int(seed), 17, users)
        owner = np.concatenate([owner, neg_owner])
        items = np.concatenate([items, integers(keys[neg_owner], counter, int(item.shape[0]))])
        labels = np.concatenate([labels, np.zeros(len(labels) * negatives)])
    own = torch.as_tensor(owner)
    q = item[torch.as_tensor(items)]
    y = torch.as_tensor(labels, dtype=torch.float32)
    n = torch.bincount(own, minlength=len(users)).float().clamp(min=1)
    wp = w[:, :d]
    p = torch.zeros(len(users), d)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, steps + 1):
        a, _, logit = ncf_forward(p[own], q, w, c, h, b)
        g = ((torch.sigmoid(logit) - y) / n[own]).unsqueeze(-1)
        grad = torch.zeros_like(p).index_add_(0, own, ((g * h) * (a > 0)) @ wp) + 2 * reg * p
        m.mul_(0.9).add_(grad, alpha=0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        p -= lr * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
    p[torch.as_tensor(counts == 0)] = 0.0
    return p
