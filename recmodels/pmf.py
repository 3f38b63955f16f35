"""Probabilistic matrix factorisation (Salakhutdinov and Mnih, NIPS 2007), trained by SGD.

PMF models a rating as ``r_ui ~ N(p_u . q_i, sigma^2)`` with zero-mean spherical Gaussian priors
``p_u ~ N(0, sigma_U^2 I)``, ``q_i ~ N(0, sigma_V^2 I)``. Maximising the posterior is minimising

    sum_(u,i rated) (r_ui - p_u . q_i)^2 + reg_user |P|^2 + reg_item |Q|^2,

``reg_user = sigma^2 / sigma_U^2``, ``reg_item = sigma^2 / sigma_V^2``: the priors are the weight
decay. We minimise it by stochastic gradient descent, one rating at a time (the paper used
mini-batch gradient descent with momentum; SGD reaches the same objective's minima), with the
update of Funk-style SGD that scikit-surprise's ``SVD(biased=False)`` runs (the test oracle):

    e = r_ui - p_u . q_i;  p_u += lr (e q_i - reg p_u);  q_i += lr (e p_u_old - reg q_i).

``center = true`` (the default) predicts ``mu + p_u . q_i`` with the training mean ``mu`` (PMF on
mean-centred ratings). ``biased = true`` adds the global mean and user/item biases (``r ~ mu + b_u + b_i + p_u . q_i``,
surprise's default ``SVD``); PMF proper is ``biased = false``. The paper's logistic squashing of
ratings into [0, 1] is left out (predictions are clipped to the training ratings' range instead).

Everything here is numpy on one machine (no parties); :mod:`protocols.central_rating` registers it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ORDERS", "PMFConfig", "RatingModel", "check_positive", "epoch_order", "pmf_epoch"]

#: How an epoch orders the training ratings: ``"shuffle"`` (a fresh seeded permutation per epoch,
#: the usual SGD) or ``"user"`` (grouped by user in the training data's order, as surprise does).
ORDERS = ("shuffle", "user")


def check_positive(section: str, **values: float) -> None:
    """Refuse a non-finite or negative hyper-parameter, naming ``section.key``."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{section}.{name} must be a finite number >= 0; found {v!r}")


@dataclass(frozen=True)
class PMFConfig:
    """Hyper-parameters of PMF (surprise's ``SVD`` defaults where they exist).

    Attributes:
        dim: latent factors.
        lr: SGD learning rate.
        reg_user, reg_item: the Gaussian priors as weight decay (``sigma^2 / sigma_U^2`` and
            ``sigma^2 / sigma_V^2``).
        init_std: factors start as ``N(0, init_std^2)``.
        center: predict ``mu + p_u . q_i``, ``mu`` the training ratings' mean (PMF on mean-centred
            ratings, the usual stand-in for the paper's rescaling to [0, 1]; default ``true``).
        biased: add the global mean and learned user/item biases (not PMF proper; default ``false``).
        reg_bias: weight decay of the biases (``biased`` only).
        order: :data:`ORDERS`.
    """

    dim: int = 20
    lr: float = 0.005
    reg_user: float = 0.02
    reg_item: float = 0.02
    init_std: float = 0.1
    center: bool = True
    biased: bool = False
    reg_bias: float = 0.02
    order: str = "shuffle"

    def __post_init__(self) -> None:
        if type(self.dim) is not int or self.dim < 1:
            raise ValueError(f"pmf.dim must be an int >= 1; found {self.dim!r}")
        check_positive("pmf", lr=self.lr, reg_user=self.reg_user, reg_item=self.reg_item, init_std=self.init_std,
                       reg_bias=self.reg_bias)
        if not self.lr > 0:
            raise ValueError(f"pmf.lr must be positive; found {self.lr!r}")
        for name in ("center", "biased"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"pmf.{name} must be true or false; found {getattr(self, name)!r}")
        if self.order not in ORDERS:
            raise ValueError(f"pmf.order must be one of {ORDERS}; found {self.order!r}")


@dataclass
class RatingModel:
    """``r_ui ~ mu + b_u + b_i + p_u . (q_i)`` (PMF: ``mu = b = 0``); float64 numpy arrays."""

    p: np.ndarray
    q: np.ndarray
    bu: np.ndarray
    bi: np.ndarray
    mu: float

    @classmethod
    def init(cls, n_users: int, n_items: int, dim: int, init_std: float, mu: float,
             rng: np.random.Generator) -> RatingModel:
        p = rng.normal(0.0, init_std, (n_users, dim))
        q = rng.normal(0.0, init_std, (n_items, dim))
        return cls(p, q, np.zeros(n_users), np.zeros(n_items), float(mu))

    def predict(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        users, items = np.asarray(users), np.asarray(items)
        return self.mu + self.bu[users] + self.bi[items] + np.einsum("nd,nd->n", self.p[users], self.q[items])


def epoch_order(users: np.ndarray, order: str, rng: np.random.Generator) -> np.ndarray:
    """The row order of one epoch (see :data:`ORDERS`)."""
    if order == "shuffle":
        return rng.permutation(len(users))
    return np.argsort(users, kind="stable")


def pmf_epoch(model: RatingModel, users: np.ndarray, items: np.ndarray, ratings: np.ndarray, order: np.ndarray,
              config: PMFConfig) -> float:
    """One SGD pass over the rows in ``order`` (in place); returns the mean squared error seen.

    The error of each rating is taken before its own update (the usual SGD training loss).
    """
    p, q, bu, bi = model.p, model.q, model.bu, model.bi
    lr, ru, ri, rb = config.lr, config.reg_user, config.reg_item, config.reg_bias
    mu = model.mu
    biased = config.biased
    total = 0.0
    for k in order.tolist():
        u, i = int(users[k]), int(items[k])
        pu, qi = p[u], q[i]
        err = float(ratings[k]) - (mu + bu[u] + bi[i] + float(pu @ qi))
        total += err * err
        if biased:
            bu[u] += lr * (err - rb * bu[u])
            bi[i] += lr * (err - rb * bi[i])
        pu_old = pu.copy()
        pu += lr * (err * qi - ru * pu)
        qi += lr * (err * pu_old - ri * qi)
    return total / max(len(order), 1)
