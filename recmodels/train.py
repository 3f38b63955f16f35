"""Centralised training of GMF: the upper bound the federated protocols are compared with."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from recmodels.data import Interactions
from recmodels.models import GMF
from recmodels.sampling import sample_train_negatives

__all__ = ["CentralConfig", "CentralTrainer"]


@dataclass(frozen=True)
class CentralConfig:
    """Hyper-parameters of centralised GMF training (NCF's recipe).

    Attributes:
        dim: embedding size.
        lr: Adam learning rate.
        batch_size: mini-batch size (positives and negatives mixed).
        train_negatives: negatives per positive, re-sampled every epoch.
        weight_decay: L2 penalty (Adam's ``weight_decay``).
        loss: ``"bce"`` (NCF's pointwise log loss over positives and sampled negatives) or ``"bpr"``
            (Rendle et al. 2009: ``-log sigmoid(s_ui - s_uj)`` for each positive ``(u, i)`` and each of
            its ``train_negatives`` sampled items ``j``; the model is plain MF then: GMF's output layer
            stays at ones and its bias cancels, so neither is trained).
    """

    dim: int = 32
    lr: float = 0.001
    batch_size: int = 256
    train_negatives: int = 4
    weight_decay: float = 0.0
    loss: str = "bce"

    def __post_init__(self) -> None:
        if self.dim < 1 or self.batch_size < 1 or self.train_negatives < 0:
            raise ValueError(
                "centralized: dim and batch_size must be >= 1 and train_negatives >= 0; "
                f"found dim={self.dim}, batch_size={self.batch_size}, train_negatives={self.train_negatives}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.weight_decay < 0:
            raise ValueError(f"centralized: lr must be positive and weight_decay >= 0; found {self.lr}, {self.weight_decay}")
        if self.loss not in ("bce", "bpr"):
            raise ValueError(f"centralized: loss must be 'bce' or 'bpr'; found {self.loss!r}")
        if self.loss == "bpr" and self.train_negatives < 1:
            raise ValueError("centralized: loss = 'bpr' needs train_negatives >= 1 (one pair per sampled negative)")


class CentralTrainer:
    """Trains :class:`GMF` on all interactions at once; one :meth:`run_round` is one epoch.

    Args:
        train: training interactions (every row a positive).
        config: hyper-parameters.
        seed: seeds the initialisation, shuffles and negatives.
        exclude: interactions never sampled as negatives besides ``train``'s own (e.g. ratings
            below the positive threshold), with ``train``'s id maps
            (:func:`recmodels.data.align_interactions`).
    """

    def __init__(self, train: Interactions, config: CentralConfig, *, seed: int, exclude: Interactions | None = None):
        self.train, self.config, self.exclude = train, config, exclude
        self.rng = np.random.default_rng(seed)
        self.model = GMF(train.n_users, train.n_items, config.dim, generator=torch.Generator().manual_seed(int(seed)))
        if config.loss == "bpr":  # plain MF: the dot product ranks, h = 1 and b (which cancels) stay fixed
            self.model.h.requires_grad_(False)
            self.model.b.requires_grad_(False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
        self.round = 0

    def run_round(self, progress: Callable[[int], None] | None = None) -> dict[str, float]:
        """One epoch over the positives and freshly sampled negatives; returns the mean loss."""
        if self.config.loss == "bpr":
            return self._bpr_round()
        cfg, tr = self.config, self.train
        users, items = tr.users, tr.items
        labels = np.ones(len(users), np.float32)
        if cfg.train_negatives:
            nu, ni = sample_train_negatives(tr, n_neg=cfg.train_negatives, rng=self.rng, exclude=self.exclude)
            users = np.concatenate([users, nu])
            items = np.concatenate([items, ni])
            labels = np.concatenate([labels, np.zeros(len(nu), np.float32)])
        perm = self.rng.permutation(len(users))
        u_all = torch.as_tensor(users[perm])
        i_all = torch.as_tensor(items[perm])
        y_all = torch.as_tensor(labels[perm])
        total = 0.0
        self.model.train()
        for start in range(0, len(perm), cfg.batch_size):
            sl = slice(start, start + cfg.batch_size)
            logits = self.model(u_all[sl], i_all[sl])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y_all[sl])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total += float(loss.detach()) * len(logits)
        self.round += 1
        return {"loss": total / max(len(perm), 1), "examples": len(perm)}

    def _bpr_round(self) -> dict[str, float]:
        """One BPR epoch: every (positive, sampled negative) pair of the user once, shuffled."""
        cfg, tr = self.config, self.train
        neg_u, neg_i = sample_train_negatives(tr, n_neg=cfg.train_negatives, rng=self.rng, exclude=self.exclude)
        pos_i = np.repeat(tr.items, cfg.train_negatives)  # pair k: (neg_u[k], pos_i[k]) over (neg_u[k], neg_i[k])
        perm = self.rng.permutation(len(neg_u))
        u_all, p_all, n_all = (torch.as_tensor(a[perm]) for a in (neg_u, pos_i, neg_i))
        total = 0.0
        self.model.train()
        for start in range(0, len(perm), cfg.batch_size):
            sl = slice(start, start + cfg.batch_size)
            diff = self.model(u_all[sl], p_all[sl]) - self.model(u_all[sl], n_all[sl])
            loss = -torch.nn.functional.logsigmoid(diff).mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total += float(loss.detach()) * len(diff)
        self.round += 1
        return {"loss": total / max(len(perm), 1), "examples": len(perm)}

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return self.model.score(users, items)

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return self.model.score_all(users)

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.bit_generator.state = state["rng"]
