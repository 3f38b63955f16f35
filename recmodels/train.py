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
    """

    dim: int = 32
    lr: float = 0.001
    batch_size: int = 256
    train_negatives: int = 4
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.dim < 1 or self.batch_size < 1 or self.train_negatives < 0:
            raise ValueError(
                "centralized: dim and batch_size must be >= 1 and train_negatives >= 0; "
                f"found dim={self.dim}, batch_size={self.batch_size}, train_negatives={self.train_negatives}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.weight_decay < 0:
            raise ValueError(f"centralized: lr must be positive and weight_decay >= 0; found {self.lr}, {self.weight_decay}")


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
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.round = 0

    def run_round(self, progress: Callable[[int], None] | None = None) -> dict[str, float]:
        """One epoch over the positives and freshly sampled negatives; returns the mean loss."""
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
