"""Two-tower retrieval models over letter-trigram features: DSSM and CLSM, their loss and FedAdam.

* :class:`DSSMTower` (Huang et al. 2013; STTFedRec section 4.1): three fully connected layers
  ``<256, 128, 128>``, tanh after each, dropout after the two hidden layers, N(0, 0.1) init of
  weights and biases. Input: a trigram count vector ``[..., hash_dim]``.
* :class:`CLSMTower` (Shen et al. 2014): a convolution of window 3 over word positions (each word
  a trigram count vector), 300 filters, tanh, max-pooling over positions (300), dropout, and a
  fully connected tanh layer to 128. Input: ``[..., max_words, hash_dim]`` and a word mask.

Both take their dropout masks as an argument (:meth:`masks` draws them from a seeded
``torch.Generator``): the split protocol needs the *same* mask for the forward pass that made an
item embedding and for the backward pass of its gradient (notes G19), and a per-client gradient
under ``torch.func.vmap`` needs explicit randomness. Both also accept unbatched inputs, so
``vmap(grad(...))`` computes one gradient per client in one batched call.

:func:`sampled_softmax_loss` is the paper's Eq. (8): cosine similarities over the ``T`` requested
items, scaled by ``1 / temperature`` (notes G15; 1 is the paper's), softmax, and
``-(1/T) sum_j r_j log p_j``. :class:`FedAdam` is Reddi et al.'s server optimiser applied to a
*gradient*, so the step is ``theta -= lr * m / (sqrt(v) + tau)`` (notes G2: the paper's ``+``
would ascend), without bias correction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

__all__ = [
    "CLSMTower",
    "DSSMTower",
    "FedAdam",
    "TOWERS",
    "dense_rows",
    "make_tower",
    "keyed_dropout_masks",
    "numpy_flat",
    "sampled_softmax_loss",
    "tower_inputs",
]

TOWERS = ("dssm", "clsm")


def _init(module: nn.Module, std: float, generator: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * std)


def _dropout_mask(shape: tuple[int, ...], p: float, generator: torch.Generator) -> torch.Tensor:
    if p == 0:
        return torch.ones(shape)
    return (torch.rand(shape, generator=generator) >= p).float() / (1 - p)


def keyed_dropout_masks(tower: nn.Module, keys: np.ndarray) -> list[torch.Tensor]:
    """A tower's dropout masks (``tower.masks``'s shapes) for ``len(keys)`` rows, row ``i`` drawn from
    stream ``keys[i]`` alone (:mod:`recmodels.streams`): a client's mask is the same alone or batched.

    Entry ``j`` of hidden layer ``l`` uses counter ``sum of the earlier widths + j``; a uniform in
    ``[0, 1)`` is the stream value's top 53 bits, and the mask is ``(uniform >= p) / (1 - p)``.
    """
    from recmodels.streams import uniform_u64

    keys = np.asarray(keys, dtype=np.uint64).reshape(-1)
    p, out, offset = float(tower.dropout), [], 0
    for width in tower.widths[:-1]:
        if p == 0:
            out.append(torch.ones(len(keys), width))
        else:
            u = (uniform_u64(keys[:, None], np.arange(offset, offset + width)[None, :]) >> np.uint64(11)) * 2.0 ** -53
            out.append(torch.as_tensor(u >= p, dtype=torch.float32) / (1 - p))
        offset += width
    return out


class DSSMTower(nn.Module):
    """DSSM tower: ``tanh(W3 drop(tanh(W2 drop(tanh(W1 x)))))`` with widths ``widths``."""

    def __init__(self, in_dim: int, *, widths: tuple[int, ...] = (256, 128, 128), dropout: float = 0.2,
                 init_std: float = 0.1, generator: torch.Generator):
        super().__init__()
        if in_dim < 1 or not widths or min(widths) < 1:
            raise ValueError(f"DSSM needs positive sizes; found in_dim={in_dim}, widths={widths}")
        if not (0 <= dropout < 1):
            raise ValueError(f"dropout must be in [0, 1); found {dropout}")
        dims = (in_dim, *widths)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout, self.widths = dropout, tuple(widths)
        _init(self, init_std, generator)

    @property
    def out_dim(self) -> int:
        return self.widths[-1]

    def masks(self, batch: int, generator: torch.Generator) -> list[torch.Tensor]:
        """Dropout masks for ``batch`` rows (one per hidden layer)."""
        return [_dropout_mask((batch, w), self.dropout, generator) for w in self.widths[:-1]]

    def forward(self, x: torch.Tensor, masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if i < len(self.layers) - 1 and masks is not None:
                h = h * masks[i]
        return h


class CLSMTower(nn.Module):
    """CLSM tower: conv (window ``window``) over words -> tanh -> max-pool -> dropout -> FC tanh."""

    def __init__(self, in_dim: int, *, conv: int = 300, out: int = 128, window: int = 3, dropout: float = 0.2,
                 init_std: float = 0.1, generator: torch.Generator):
        super().__init__()
        if in_dim < 1 or conv < 1 or out < 1 or window < 1 or window % 2 == 0:
            raise ValueError(f"CLSM needs positive sizes and an odd window; found {in_dim}, {conv}, {out}, {window}")
        if not (0 <= dropout < 1):
            raise ValueError(f"dropout must be in [0, 1); found {dropout}")
        self.conv = nn.Conv1d(in_dim, conv, window, padding=window // 2)
        self.fc = nn.Linear(conv, out)
        self.dropout, self.conv_dim, self.widths = dropout, conv, (conv, out)
        _init(self, init_std, generator)

    @property
    def out_dim(self) -> int:
        return int(self.fc.out_features)

    def masks(self, batch: int, generator: torch.Generator) -> list[torch.Tensor]:
        return [_dropout_mask((batch, self.conv_dim), self.dropout, generator)]

    def forward(self, x: torch.Tensor, word_mask: torch.Tensor, masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``x``: ``[..., L, in_dim]``; ``word_mask``: bool ``[..., L]`` (False: padding)."""
        h = torch.tanh(self.conv(x.transpose(-1, -2)))  # [..., conv, L]
        h = h.masked_fill(~word_mask.unsqueeze(-2), -2.0)  # below tanh's range: never the max
        pooled = h.max(-1).values
        pooled = torch.where(pooled < -1.5, torch.zeros_like(pooled), pooled)  # no words at all
        if masks is not None:
            pooled = pooled * masks[0]
        return torch.tanh(self.fc(pooled))


def make_tower(kind: str, hash_dim: int, *, dropout: float, init_std: float, generator: torch.Generator,
               dim: int = 128) -> nn.Module:
    """A ``"dssm"`` (``<256, 128, dim>``) or ``"clsm"`` (conv 300, output ``dim``) tower."""
    if kind == "dssm":
        return DSSMTower(hash_dim, widths=(256, 128, dim), dropout=dropout, init_std=init_std, generator=generator)
    if kind == "clsm":
        return CLSMTower(hash_dim, out=dim, dropout=dropout, init_std=init_std, generator=generator)
    raise ValueError(f"tower must be one of {TOWERS}; found {kind!r}")


def dense_rows(matrix: sp.csr_matrix, rows: np.ndarray, per_row: int = 1) -> torch.Tensor:
    """Dense float32 of entities ``rows``: ``[n, hash_dim]`` or ``[n, per_row, hash_dim]``."""
    rows = np.asarray(rows, dtype=np.int64)
    if per_row == 1:
        return torch.from_numpy(matrix[rows].toarray())
    idx = (rows[:, None] * per_row + np.arange(per_row)).ravel()
    return torch.from_numpy(matrix[idx].toarray()).reshape(len(rows), per_row, -1)


def tower_inputs(kind: str, features: tuple[sp.csr_matrix, np.ndarray | None], rows: np.ndarray,
                 max_words: int) -> tuple[torch.Tensor, ...]:
    """The positional inputs of a tower (before the masks) for entities ``rows``."""
    matrix, lengths = features
    if kind == "dssm":
        return (dense_rows(matrix, rows),)
    x = dense_rows(matrix, rows, max_words)
    word_mask = torch.arange(max_words)[None, :] < torch.as_tensor(lengths[np.asarray(rows)])[:, None]
    return x, word_mask


def sampled_softmax_loss(u: torch.Tensor, items: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0) -> torch.Tensor:
    """Eq. (8): ``-(1/T) sum_j r_j log softmax_j(cos(u, i_j) / temperature)``.

    ``u``: ``[..., d]``; ``items``: ``[..., T, d]``; ``labels``: ``[..., T]`` (1 for a click).
    """
    un = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    vn = items / items.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    sim = (vn * un.unsqueeze(-2)).sum(-1) / temperature
    logp = torch.log_softmax(sim, dim=-1)
    return -(labels * logp).sum(-1) / labels.shape[-1]


class FedAdam:
    """Reddi et al.'s FedAdam on a gradient: ``theta -= lr * m / (sqrt(v) + tau)`` (notes G2).

    ``m`` and ``v`` start at zero and carry no bias correction (as in Reddi et al. and the
    paper's Eq. 13). State: :meth:`state_dict` (tensors only).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], *, lr: float, beta1: float = 0.9, beta2: float = 0.99,
                 tau: float = 1e-3):
        if not (lr > 0 and math.isfinite(lr)) or not (0 <= beta1 < 1) or not (0 <= beta2 < 1) or not tau > 0:
            raise ValueError(f"FedAdam needs lr > 0, betas in [0, 1), tau > 0; found {lr}, {beta1}, {beta2}, {tau}")
        self.lr, self.beta1, self.beta2, self.tau = lr, beta1, beta2, tau
        self.m = {k: torch.zeros_like(p) for k, p in params.items()}
        self.v = {k: torch.zeros_like(p) for k, p in params.items()}

    @torch.no_grad()
    def step(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], lr: float | None = None) -> None:
        """Update ``params`` in place from the averaged gradient ``grads``."""
        eta = self.lr if lr is None else lr
        for k, p in params.items():
            g = grads[k]
            self.m[k].mul_(self.beta1).add_(g, alpha=1 - self.beta1)
            self.v[k].mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            p.sub_(eta * self.m[k] / (self.v[k].sqrt() + self.tau))

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"m": {k: v.clone() for k, v in self.m.items()}, "v": {k: v.clone() for k, v in self.v.items()}}

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        for name in ("m", "v"):
            mine = getattr(self, name)
            if set(state[name]) != set(mine):
                raise ValueError(f"FedAdam state {name!r} has keys {sorted(state[name])}, expected {sorted(mine)}")
            for k in mine:
                mine[k] = state[name][k].clone()


def numpy_flat(grads: Mapping[str, torch.Tensor]) -> np.ndarray:
    """Per-row flattening ``[n, sum of sizes]`` of per-client gradients ``{name: [n, ...]}``."""
    return np.concatenate([g.reshape(g.shape[0], -1).double().numpy() for g in grads.values()], axis=1)
