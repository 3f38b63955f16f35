"""Centralised DSSM / CLSM: the upper bound of STTFedRec's Table 2 (no parties, no transcript).

One "round" is one epoch: every user contributes ``ceil(|history| / n_pos)`` requests (the same
``T``-item requests, loss and temperature as the federated protocols, fresh non-clicked ids each
epoch), shuffled into mini-batches of ``batch_size`` requests; both towers take an Adam-style step
(:class:`recmodels.twotower.FedAdam`: no bias correction, the same update the federated servers
apply) per mini-batch. Same features (:func:`protocols.twotower_data.build_features`).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from protocols.base import RoundStats
from protocols.registry import ProtocolSpec, register
from protocols.twotower_data import TwoTowerConfig, build_features, positive_lists, sample_requests
from recmodels.data import Interactions
from recmodels.twotower import FedAdam, make_tower, sampled_softmax_loss, tower_inputs

__all__ = ["CentralTwoTower"]


class CentralTwoTower:
    """Centralised two-tower trainer (see the module docstring)."""

    def __init__(self, train: Interactions, config: TwoTowerConfig, *, seed: int, source: str = "synthetic",
                 exclude: Interactions | None = None):
        self.config, self.transport = config, None
        self.data = build_features(train, source, config, exclude)
        self.n_users, self.n_items = train.n_users, train.n_items
        self.rng = np.random.default_rng(seed)
        g = torch.Generator().manual_seed(int(seed))
        kw = dict(dropout=config.dropout, init_std=config.init_std, generator=g, dim=config.dim)
        self.user_tower = make_tower(config.tower, config.user_in_dim, **kw)
        self.item_tower = make_tower(config.tower, config.hash_dim, **kw)
        self.dropout_gen = torch.Generator().manual_seed(int(seed) + 1)
        self.params = {f"u.{k}": v.detach().clone() for k, v in self.user_tower.named_parameters()}
        self.params.update({f"v.{k}": v.detach().clone() for k, v in self.item_tower.named_parameters()})
        if config.item_id_embedding:  # as in protocols.sttfedrec: zero-initialised id vectors
            self.params["v.item_id"] = torch.zeros(train.n_items, config.dim)
        self.opt = FedAdam(self.params, lr=config.lr, beta1=config.beta1, beta2=config.beta2, tau=config.tau)
        self.pos_items, self.pos_start = positive_lists(self.data.train)
        self.round = 0
        self._cache: tuple[int, torch.Tensor] | None = None

    def _part(self, prefix: str) -> dict[str, torch.Tensor]:
        return {k[2:]: v for k, v in self.params.items() if k.startswith(prefix)}

    def _item_forward(self, pv: dict[str, torch.Tensor], rows: np.ndarray, masks) -> torch.Tensor:
        out = functional_call(self.item_tower, {k: v for k, v in pv.items() if k != "item_id"},
                              (*self._inputs("item", rows), masks))
        if "item_id" in pv:
            out = out + pv["item_id"][torch.as_tensor(np.asarray(rows, dtype=np.int64))]
        return out

    def _inputs(self, which: str, rows: np.ndarray):
        d, cfg = self.data, self.config
        x, lens = (d.user_x, d.user_len) if which == "user" else (d.item_x, d.item_len)
        return tower_inputs(cfg.tower, (x, lens), rows, cfg.max_words)

    def run_round(self) -> RoundStats:
        cfg, t0 = self.config, time.perf_counter()
        counts = np.diff(self.pos_start)
        reqs = np.repeat(np.arange(self.n_users), np.ceil(counts / cfg.n_pos).astype(np.int64))
        reqs = self.rng.permutation(reqs)
        total, n = 0.0, 0
        for lo in range(0, len(reqs), cfg.batch_size):
            users = np.sort(reqs[lo:lo + cfg.batch_size])
            ids, labels = sample_requests(users, self.pos_items, self.pos_start, cfg.n_pos, cfg.n_neg,
                                          self.data.never_negative, self.rng)
            union, inv = np.unique(ids, return_inverse=True)
            params = {k: v.clone().requires_grad_(True) for k, v in self.params.items()}
            pu = {k[2:]: v for k, v in params.items() if k.startswith("u.")}
            pv = {k[2:]: v for k, v in params.items() if k.startswith("v.")}
            ux = self._inputs("user", users)
            if self.data.user_rule == "history" or self.data.click_bag is not None:  # the request's clicks left out
                hist_x = None
                if self.data.user_rule == "history":
                    hist_x = self._inputs("item", union)[0][torch.as_tensor(inv.reshape(ids.shape))]
                ux = (self.data.request_user_x(users, labels, hist_x, ids),)
            u = functional_call(self.user_tower, pu, (*ux, self.user_tower.masks(len(users), self.dropout_gen)))
            v = self._item_forward(pv, union, self.item_tower.masks(len(union), self.dropout_gen))
            loss = sampled_softmax_loss(u, v[torch.as_tensor(inv.reshape(ids.shape))], torch.as_tensor(labels),
                                        cfg.temperature)
            grads = torch.autograd.grad(loss.mean(), list(params.values()))
            self.opt.step(self.params, dict(zip(params, grads)), lr=cfg.lr_at(self.round))
            total += float(loss.detach().sum())
            n += len(users)
        self.round += 1
        self._cache = None
        return RoundStats(round=self.round - 1, loss=total / max(n, 1), seconds={"round": time.perf_counter() - t0},
                          extra={"requests": n})

    @torch.no_grad()
    def _items(self) -> torch.Tensor:
        if self._cache is None or self._cache[0] != self.round:
            pv = self._part("v.")
            out = [self._item_forward(pv, np.arange(lo, min(lo + 1024, self.n_items)), None)
                   for lo in range(0, self.n_items, 1024)]
            e = torch.cat(out)
            self._cache = (self.round, e / e.norm(dim=1, keepdim=True).clamp_min(1e-12))
        return self._cache[1]

    @torch.no_grad()
    def _users(self, users: np.ndarray) -> torch.Tensor:
        u = functional_call(self.user_tower, self._part("u."), (*self._inputs("user", np.asarray(users)), None))
        return u / u.norm(dim=1, keepdim=True).clamp_min(1e-12)

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return (self._items()[torch.as_tensor(np.asarray(items))] * self._users(users).unsqueeze(1)).sum(-1).numpy()

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return (self._users(users) @ self._items().T).numpy()

    def public_info(self) -> dict[str, Any]:
        return {"protocol": "centralized-twotower", "n_users": self.n_users, "n_items": self.n_items,
                "config": asdict(self.config)}

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "params": {k: v.clone() for k, v in self.params.items()},
                "opt": self.opt.state_dict(), "rng": self.rng.bit_generator.state,
                "dropout_gen": self.dropout_gen.get_state(), "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["config"] != asdict(self.config):
            raise ValueError("checkpoint was written with a different sttfedrec configuration")
        if set(state["params"]) != set(self.params):
            raise ValueError("checkpoint towers do not match the configured towers")
        self.round = int(state["round"])
        self.params = {k: v.clone() for k, v in state["params"].items()}
        self.opt.load_state_dict(state["opt"])
        self.rng.bit_generator.state = state["rng"]
        self.dropout_gen.set_state(state["dropout_gen"])
        self._cache = None


register(ProtocolSpec(
    name="centralized-twotower",
    summary="centralised DSSM/CLSM two-tower model (STTFedRec's upper bound)",
    build=lambda ctx: CentralTwoTower(ctx.train, ctx.config, seed=ctx.seed, source=ctx.source, exclude=ctx.exclude),
    section="sttfedrec", config_cls=TwoTowerConfig, federated=False,
))
