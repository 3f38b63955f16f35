"""NeuMF (He et al., WWW 2017, "Neural Collaborative Filtering"): GMF and an MLP tower fused.

``logit(u, i) = h . [p_u^G * q_i^G ; MLP([p_u^M ; q_i^M])] + b``: separate embeddings for the GMF
part (``user_gmf``, ``item_gmf``) and the MLP part (``user_mlp``, ``item_mlp``), an MLP of ReLU
layers ``layers`` (``w<k>``, ``b<k>``) and the fused output layer ``(h, b)``. Trained with binary
cross-entropy on the positives and ``train_negatives`` uniformly sampled unobserved items per
positive, re-drawn every epoch, by Adam (NCF's recipe; the paper's optional pre-training of the
two towers is left out: both start from random initialisation).

Parameters are a plain dict of tensors so that one client's copy (its user rows and the shared
rest) and the centralised model run the same code (:func:`neumf_logits`, :func:`train_examples`);
:mod:`protocols.ncf_fed` relies on this for "NCF-fed with one client equals centralised NCF".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from recmodels.data import pair_keys

__all__ = ["NCFConfig", "USER_PARAMS", "draw_examples", "init_neumf", "neumf_logits", "train_examples"]

#: The parameters that belong to one user (a client keeps them; everything else is shared).
USER_PARAMS = ("user_gmf", "user_mlp")


@dataclass(frozen=True)
class NCFConfig:
    """Hyper-parameters of NeuMF (NCF's defaults scaled to small data).

    Attributes:
        dim: embedding size of each tower (GMF and MLP).
        layers: widths of the MLP's hidden layers (input ``2 dim``).
        lr: Adam learning rate.
        batch_size: mini-batch size (positives and negatives mixed).
        train_negatives: negatives per positive, re-drawn every epoch.
        weight_decay: L2 penalty (Adam's ``weight_decay``).
        init_std: standard deviation of the embeddings' normal initialisation.
    """

    dim: int = 16
    layers: list[int] = field(default_factory=lambda: [32, 16, 8])
    lr: float = 0.001
    batch_size: int = 256
    train_negatives: int = 4
    weight_decay: float = 0.0
    init_std: float = 0.01

    def __post_init__(self) -> None:
        sec = type(self).__name__.replace("Config", "").lower()
        if type(self.dim) is not int or self.dim < 1:
            raise ValueError(f"{sec}.dim must be an int >= 1; found {self.dim!r}")
        layers = list(self.layers)
        if not layers or not all(type(w) is int and w >= 1 for w in layers):
            raise ValueError(f"{sec}.layers must be a non-empty list of ints >= 1; found {self.layers!r}")
        object.__setattr__(self, "layers", layers)
        if type(self.batch_size) is not int or self.batch_size < 1:
            raise ValueError(f"{sec}.batch_size must be an int >= 1; found {self.batch_size!r}")
        if type(self.train_negatives) is not int or self.train_negatives < 0:
            raise ValueError(f"{sec}.train_negatives must be an int >= 0; found {self.train_negatives!r}")
        for name in ("lr", "weight_decay", "init_std"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{sec}.{name} must be a finite number >= 0; found {v!r}")
        if not self.lr > 0:
            raise ValueError(f"{sec}.lr must be positive; found {self.lr!r}")


def init_neumf(n_users: int, n_items: int, config: NCFConfig, *, seed: int) -> dict[str, torch.Tensor]:
    """Seeded initial parameters: embeddings ``N(0, init_std^2)``, Glorot-uniform layers, zero biases."""
    g = torch.Generator().manual_seed(int(seed))
    d, std = config.dim, config.init_std
    out = {name: torch.randn(n, d, generator=g) * std for name, n in
           (("user_gmf", n_users), ("item_gmf", n_items), ("user_mlp", n_users), ("item_mlp", n_items))}
    fan_in = 2 * d
    for k, width in enumerate(config.layers):
        bound = math.sqrt(6.0 / (fan_in + width))
        out[f"w{k}"] = (torch.rand(width, fan_in, generator=g) * 2 - 1) * bound
        out[f"b{k}"] = torch.zeros(width)
        fan_in = width
    bound = math.sqrt(6.0 / (d + fan_in + 1))
    out["h"] = (torch.rand(d + fan_in, generator=g) * 2 - 1) * bound
    out["b"] = torch.zeros(())
    return out


def neumf_logits(params: dict[str, torch.Tensor], users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Logits of row-aligned ``users``/``items`` (any matching shapes); ``users`` index the user tables."""
    g = params["user_gmf"][users] * params["item_gmf"][items]
    x = torch.cat([params["user_mlp"][users], params["item_mlp"][items]], dim=-1)
    k = 0
    while f"w{k}" in params:
        x = torch.relu(x @ params[f"w{k}"].T + params[f"b{k}"])
        k += 1
    return torch.cat([g, x], dim=-1) @ params["h"] + params["b"]


def _in_sorted(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    if not len(sorted_keys):
        return np.zeros(len(keys), bool)
    pos = np.searchsorted(sorted_keys, keys)
    return (pos < len(sorted_keys)) & (sorted_keys[np.minimum(pos, len(sorted_keys) - 1)] == keys)


def draw_examples(users: np.ndarray, items: np.ndarray, forbidden: np.ndarray, n_items: int, n_neg: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positives ``(users, items)`` then ``n_neg`` negatives per positive, with labels.

    Negatives are uniform over the items whose pair key (:func:`recmodels.data.pair_keys`) with the
    positive's user is not in the sorted ``forbidden`` keys (every training pair and the excluded
    ones), drawn from ``rng`` (simulation randomness) and redrawn until allowed.
    """
    nu = np.repeat(users, n_neg)
    ni = rng.integers(0, n_items, size=nu.size, dtype=np.int64)
    bad = np.flatnonzero(_in_sorted(forbidden, pair_keys(nu, ni, n_items)))
    while bad.size:
        ni[bad] = rng.integers(0, n_items, size=bad.size, dtype=np.int64)
        bad = bad[_in_sorted(forbidden, pair_keys(nu[bad], ni[bad], n_items))]
    labels = np.concatenate([np.ones(len(users), np.float32), np.zeros(nu.size, np.float32)])
    return np.concatenate([users, nu]).astype(np.int64), np.concatenate([items, ni]).astype(np.int64), labels


def train_examples(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, users: np.ndarray,
                   items: np.ndarray, labels: np.ndarray, batch_size: int, rng: np.random.Generator) -> float:
    """One shuffled pass of mini-batch BCE steps over the examples; returns the summed loss."""
    perm = rng.permutation(len(users))
    u, i, y = (torch.as_tensor(a[perm]) for a in (users, items, labels))
    total = 0.0
    for lo in range(0, len(perm), batch_size):
        sl = slice(lo, lo + batch_size)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(neumf_logits(params, u[sl], i[sl]), y[sl])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += float(loss.detach()) * len(y[sl])
    return total
