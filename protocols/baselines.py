"""Non-federated reference points registered beside the protocols: ItemPop, random, centralised GMF.

They have no parties and no transcript (``transport`` is ``None``): ItemPop and random are fixed
scorers with no rounds; centralised GMF trains on all interactions at once, one epoch per round,
and is the upper bound the federated protocols are compared with.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.base import RoundStats
from protocols.registry import BuildContext, ProtocolSpec, register
from recmodels.models import ItemPop, RandomScorer
from recmodels.train import CentralConfig, CentralTrainer

__all__ = ["FixedScorer", "Centralized"]


class FixedScorer:
    """A scorer without training (ItemPop, random) behind the :class:`~protocols.base.Trainer` interface."""

    transport = None

    def __init__(self, scorer: Any, name: str):
        self.scorer, self.name, self.round = scorer, name, 0

    def run_round(self) -> RoundStats:
        raise RuntimeError(f"{self.name} has no training rounds")

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return self.scorer.score(users, items)

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return self.scorer.score_all(users)

    def state_dict(self) -> dict[str, Any]:
        return {"round": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def public_info(self) -> dict[str, Any]:
        return {"protocol": self.name}


class Centralized:
    """Centralised GMF (:class:`recmodels.train.CentralTrainer`); one round is one epoch."""

    transport = None

    def __init__(self, ctx: BuildContext):
        self.trainer = CentralTrainer(ctx.train, ctx.config, seed=ctx.seed, exclude=ctx.exclude)
        self.config = ctx.config

    @property
    def round(self) -> int:
        return self.trainer.round

    def run_round(self) -> RoundStats:
        r = self.trainer.round
        out = self.trainer.run_round()
        return RoundStats(round=r, loss=float(out["loss"]), extra={"examples": int(out["examples"])})

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return self.trainer.score(users, items)

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return self.trainer.score_all(users)

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def public_info(self) -> dict[str, Any]:
        return {"protocol": "centralized", "n_users": self.trainer.train.n_users, "n_items": self.trainer.train.n_items}


register(ProtocolSpec(
    name="itempop",
    summary="most-popular items (no training)",
    build=lambda ctx: FixedScorer(ItemPop(ctx.train), "itempop"),
    federated=False,
    trains=False,
))
register(ProtocolSpec(
    name="random",
    summary="uniformly random scores (chance level)",
    build=lambda ctx: FixedScorer(RandomScorer(ctx.train.n_users, ctx.train.n_items, seed=ctx.seed), "random"),
    federated=False,
    trains=False,
))
register(ProtocolSpec(
    name="centralized",
    summary="GMF trained centrally on all interactions (the upper bound)",
    build=Centralized,
    section="centralized",
    config_cls=CentralConfig,
    federated=False,
))
