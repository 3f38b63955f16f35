"""Centralised rating baselines registered beside the protocols: PMF and SVD++ (LightFR's baselines).

Parties: none. One trainer holds every training rating (the setting federated rating protocols
such as FedMF and FedRec give up for privacy); there is no transcript (``transport`` is ``None``)
and no promise: these are accuracy references, not privacy mechanisms. One round is one SGD epoch
over the training ratings; evaluation is RMSE/MAE on the held-out 20% of each user's ratings
(predictions clipped to the training ratings' range, as FedMF's are).

* ``pmf``: :mod:`recmodels.pmf` (Salakhutdinov and Mnih 2007; Gaussian priors as weight decay).
* ``svdpp``: :mod:`recmodels.svdpp` (Koren 2008; the implicit-feedback term of the rated set).

``pmf-rank`` and ``svdpp-rank`` train the same models on the same explicit ratings but are evaluated
as LightFR evaluates them: leave-one-out, the held-out item ranked by predicted rating among the
sampled candidates (HR@K, NDCG@K).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from protocols.base import RoundStats
from protocols.registry import BuildContext, ProtocolSpec, register_with_rank
from recmodels.data import Interactions
from recmodels.mf import mae, rmse
from recmodels.pmf import PMFConfig, RatingModel, epoch_order, pmf_epoch
from recmodels.svdpp import SVDppConfig, SVDppModel, svdpp_epoch, svdpp_order

__all__ = ["CentralRating"]


class CentralRating:
    """PMF or SVD++ on all training ratings; one :meth:`run_round` is one epoch.

    Args:
        train: the training ratings (explicit).
        config: a :class:`~recmodels.pmf.PMFConfig` or :class:`~recmodels.svdpp.SVDppConfig`.
        seed: seeds the initialisation and the epochs' shuffles (simulation randomness).
    """

    transport = None

    def __init__(self, train: Interactions, config: PMFConfig | SVDppConfig, *, seed: int):
        if not len(train):
            raise ValueError("a rating baseline needs training ratings; found none")
        self.train, self.config = train, config
        self.name = "svdpp" if isinstance(config, SVDppConfig) else "pmf"  # the model (the protocol may add -rank)
        self.rng = np.random.default_rng(seed)
        self.ratings = train.ratings.astype(np.float64)
        self.scale = (float(self.ratings.min()), float(self.ratings.max()))
        mu = float(self.ratings.mean())
        if self.name == "svdpp":
            self.model: RatingModel = SVDppModel.init_svdpp(train.n_users, train.n_items, config.dim, config.init_std,
                                                            mu, train.users, train.items, self.rng)
        else:
            self.model = RatingModel.init(train.n_users, train.n_items, config.dim, config.init_std,
                                          mu if config.biased or config.center else 0.0, self.rng)
        self.round = 0

    def run_round(self) -> RoundStats:
        order = (svdpp_order if self.name == "svdpp" else epoch_order)(self.train.users, self.config.order, self.rng)
        step = svdpp_epoch if self.name == "svdpp" else pmf_epoch
        mse = step(self.model, self.train.users, self.train.items, self.ratings, order, self.config)  # type: ignore[arg-type]
        self.round += 1
        return RoundStats(round=self.round - 1, loss=mse, extra={"examples": int(len(order)),
                                                                 "train_rmse": float(np.sqrt(mse))})

    def predict(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Predicted ratings clipped to the training ratings' range."""
        return np.clip(self.model.predict(users, items), *self.scale)

    def evaluate(self, test: Interactions) -> dict[str, float]:
        """RMSE and MAE of the clipped predictions on held-out ratings."""
        pred = self.predict(test.users, test.items)
        return {"rmse": rmse(pred, test.ratings), "mae": mae(pred, test.ratings)}

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Predicted ratings (unclipped) for ``users [B]`` x ``items [B, C]``."""
        users, items = np.asarray(users), np.asarray(items)
        rows = np.repeat(users, items.shape[1])
        return self.model.predict(rows, items.reshape(-1)).reshape(items.shape)

    def score_all(self, users: np.ndarray) -> np.ndarray:
        users = np.asarray(users)
        m = self.model
        vec = m.user_vectors(users) if isinstance(m, SVDppModel) else m.p[users]
        return m.mu + m.bu[users][:, None] + m.bi[None, :] + vec @ m.q.T

    def state_dict(self) -> dict[str, Any]:
        m = self.model
        out: dict[str, Any] = {"round": self.round, "p": m.p.copy(), "q": m.q.copy(), "bu": m.bu.copy(),
                               "bi": m.bi.copy(), "mu": m.mu, "rng": self.rng.bit_generator.state,
                               "config": asdict(self.config)}
        if isinstance(m, SVDppModel):
            out["y"] = m.y.copy()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if {**asdict(type(self.config)()), **state["config"]} != asdict(self.config):
            raise ValueError(f"checkpoint was written with a different {self.name} configuration")
        m = self.model
        self.round = int(state["round"])
        for name in ("p", "q", "bu", "bi") + (("y",) if isinstance(m, SVDppModel) else ()):
            setattr(m, name, np.array(state[name], dtype=np.float64, copy=True))
        m.mu = float(state["mu"])
        self.rng.bit_generator.state = state["rng"]

    def public_info(self) -> dict[str, Any]:
        return {"protocol": self.name, "n_users": self.train.n_users, "n_items": self.train.n_items,
                "config": asdict(self.config)}


def _build(ctx: BuildContext) -> CentralRating:
    return CentralRating(ctx.train, ctx.config, seed=ctx.seed)


register_with_rank(ProtocolSpec(
    name="pmf",
    summary="probabilistic matrix factorisation trained centrally by SGD (rating task; Gaussian priors as weight decay)",
    build=_build, section="pmf", config_cls=PMFConfig, federated=False, task="rating", keeps_ratings=True,
), "PMF trained centrally on explicit ratings, ranked by predicted rating (leave-one-out, LightFR's protocol)")
register_with_rank(ProtocolSpec(
    name="svdpp",
    summary="SVD++ trained centrally by SGD: biased MF plus the implicit feedback of the rated set (rating task)",
    build=_build, section="svdpp", config_cls=SVDppConfig, federated=False, task="rating", keeps_ratings=True,
), "SVD++ trained centrally on explicit ratings, ranked by predicted rating (leave-one-out, LightFR's protocol)")
