"""FEL's NCF-style MLP leaf: FedAvg of :mod:`recmodels.ncf` on one cluster (``fel.leaf_model = "ncf"``).

Parties, adversary and promise are the GMF leaf's (:mod:`protocols.fel_leaf`): the user embedding
``p_u`` stays on its client; the server holds the item table ``Q`` and the MLP (``W``, ``c``, and
the output layer ``h``, ``b``, of width ``k = dim``); every sampled client trains locally and
uploads the change of ``(Q, h, b, W, c)``. Without DP the server applies the ``n_k``-weighted
FedAvg aggregate (items per ``item_aggregation``; ``h, b, W, c`` weighted by ``n_k``), from the
plaintext uploads or through SecAgg/SecAgg+ (it then learns only the sum; fixed-point
quantisation only). Under DP the leaf is :class:`protocols.fel_leaf.FelLeaf`'s DP-FedAvg on the
unweighted update ``dQ | dh | db | dW | dc`` (clip, noise, fixed denominator), unchanged.

Simulation: all sampled clients train at once. Every client owns its user row, its own copy of
each item row it touches and its own copy of ``(W, c, h, b)`` (tensors ``[m, ...]``); the
forward pass gathers each example's client's weights and the gradients (in closed form) are
accumulated per client with ``index_add_``, so the batch equals each client training alone (the
same lazy Adam as GMF's local training, the same per-client streams for negatives and shuffles).
There is no Python loop per client.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from protocols.base import Release
from protocols.fedavg import _LazyAdam
from protocols.fel_leaf import FelLeaf
from protocols.transport import SERVER, client
from dp.events import NonPrivate
from recmodels.ncf import fold_in_ncf, init_ncf, ncf_forward

__all__ = ["NcfLeaf"]


class NcfLeaf(FelLeaf):
    """One cluster's NCF-MLP leaf (see the module docstring); arguments as :class:`FelLeaf`."""

    def __init__(self, train, config, **kw) -> None:  # noqa: ANN001
        super().__init__(train, config, **kw)
        d = config.dim
        self.W, self.c, self.h = init_ncf(d, d, seed=self.seed * 31 + 7)
        self.W = self.W.reshape(-1)  # [k * 2d], k = d
        self._deltas: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def extra_width(cls, dim: int) -> int:
        return dim * 2 * dim + dim

    @property
    def model_bytes(self) -> int:
        d = self.config.dim
        return 4 * (self.train.n_items * d + d + 1 + self.extra_width(d))

    def _mats(self) -> torch.Tensor:
        d = self.config.dim
        return self.W.reshape(d, 2 * d)

    # -- local training (batched over the sampled clients) -------------------------------------
    def _train_locally(self, sampled, epochs, pair_slot, pair_item, pair_of_example):  # noqa: ANN001, ANN202
        cfg, m = self.config, len(sampled)
        P = self.user[torch.as_tensor(sampled)].clone()
        Q = self.item[torch.as_tensor(pair_item)].clone()
        H = self.h.expand(m, -1).clone()
        B = self.b.expand(m).clone().unsqueeze(1)
        W = self.W.expand(m, -1).clone()
        C = self.c.expand(m, -1).clone()
        opts = [_LazyAdam(x, cfg.lr, cfg.optimizer, sparse=x is P or x is Q) for x in (P, Q, H, B, W, C)]
        client_steps = torch.zeros(m, dtype=torch.float32)
        pair_slot_t = torch.as_tensor(pair_slot)
        total_loss, total_examples = self._minibatches(
            sampled, epochs, pair_of_example,
            lambda slot, pair, label: self._ncf_step(P, Q, H, B, W, C, opts, slot, pair, label, client_steps,
                                                     pair_slot_t),
        )
        self._deltas = (W - self.W, C - self.c)
        return P, Q, H, B, total_loss, total_examples

    def _ncf_step(self, P, Q, H, B, W, C, opts, slot, pair, label, client_steps, pair_slot) -> float:  # noqa: ANN001
        """One local mini-batch step of every active client (closed-form NCF gradients per client)."""
        m, d = P.shape
        p, q = P[slot], Q[pair]
        w = W[slot].reshape(-1, d, 2 * d)
        a, r, logits = ncf_forward(p, q, w, C[slot], H[slot], B[slot, 0])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label, reduction="none")
        n_in_batch = torch.zeros(m).index_add_(0, slot, torch.ones_like(label))
        active = torch.nonzero(n_in_batch).squeeze(1)
        client_steps[active] += 1
        g = ((torch.sigmoid(logits) - label) / n_in_batch[slot]).unsqueeze(1)
        delta = g * H[slot] * (a > 0)  # d loss / d pre-activation, [e, k]
        gx = (delta.unsqueeze(1) @ w).squeeze(1)  # d loss / d [p ; q]
        x = torch.cat([p, q], dim=-1)
        g_w = (delta.unsqueeze(2) * x.unsqueeze(1)).reshape(len(slot), -1)
        for opt, grad in ((opts[0], gx[:, :d]), (opts[2], g * r), (opts[3], g), (opts[4], g_w), (opts[5], delta)):
            acc = torch.zeros(m, grad.shape[1]).index_add_(0, slot, grad)
            opt.step(active, acc[active], client_steps[active])
        uniq, inv = torch.unique(pair, return_inverse=True)
        acc = torch.zeros(len(uniq), d).index_add_(0, inv, gx[:, d:])
        opts[1].step(uniq, acc, client_steps[pair_slot[uniq]])
        return float(loss.sum())

    # -- aggregation ---------------------------------------------------------------------------
    def client_vectors(self, sampled, pair_slot, pair_item, dQ, dH, dB) -> np.ndarray:  # noqa: ANN001
        """Each client's unweighted update ``dQ | dh | db | dW | dc`` (DP-FedAvg's rows)."""
        dW, dC = self._deltas
        return np.concatenate([super().client_vectors(sampled, pair_slot, pair_item, dQ, dH, dB),
                               dW.numpy(), dC.numpy()], axis=1)

    def _apply_dp(self, total: np.ndarray) -> None:
        k = self.extra_width(self.config.dim)
        super()._apply_dp(total[:-k])
        scale = self.config.server_lr / max(self.expected, 1)
        self._apply_extra(torch.as_tensor(total[-k:], dtype=torch.float32) * scale)

    def _apply_extra(self, change: torch.Tensor) -> None:
        nw = self.W.numel()
        self.W = self.W + change[:nw]
        self.c = self.c + change[nw:]

    def _extra_columns(self, weight: np.ndarray) -> np.ndarray:
        """After GMF's layout (:meth:`FedAvgGMF._client_rows`), each client's ``n_k dW | n_k dc``; the
        column sums are the round's sums (plaintext, or the secure sum)."""
        dW, dC = self._deltas
        w = np.asarray(weight, dtype=np.float64)[:, None]
        return np.concatenate([dW.numpy() * w, dC.numpy() * w], axis=1)

    def client_vector_width(self) -> int:
        return super().client_vector_width() + self.extra_width(self.config.dim)

    def _sums_from_total(self, total: np.ndarray):  # noqa: ANN202
        """GMF's sums from the summed rows, then the summed ``n_k dW | n_k dc`` (float32)."""
        k = self.extra_width(self.config.dim)
        return (*super()._sums_from_total(total[:-k]), torch.as_tensor(total[-k:], dtype=torch.float32))

    def _aggregate(self, t, sampled, pair_slot, pair_item, dQ, dH, dB, weight):  # noqa: ANN001, ANN202
        if self.dp is not None:
            return super()._aggregate(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight)
        cfg, m = self.config, len(sampled)
        if cfg.secure_aggregation == "none":
            for u in sampled:  # each client's dense update, in plaintext
                self.transport.send(client(u), SERVER, t, "update", None, self.model_bytes + 4)
            sums = self._sums_from_total(self._client_vectors(sampled, pair_slot, pair_item, dQ, dH, dB, weight).sum(0))
            upload = self.model_bytes + 4.0
        else:  # (FedAvg's secure sum of the rows above; the Flower adapter binds it to the devices' sum)
            sums, upload = self._secure_sums(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight)
        self._apply_sums(*sums)
        what = "item/MLP updates, each in plaintext" if cfg.secure_aggregation == "none" else (
            f"the sum of item/MLP updates through {cfg.secure_aggregation} (no DP noise)")
        return upload, (Release(NonPrivate(), who="clients", what=what, params={"clients": m}),), {}

    def _apply_sums(self, item_num, touched, h_num, b_num, w_sum, extra) -> None:  # noqa: ANN001
        """FedAvg's server update from the round's sums (:meth:`_sums_from_total`): GMF's, then the MLP's."""
        self._apply(item_num, touched, h_num, b_num, w_sum)
        self._apply_extra(self.config.server_lr * extra / w_sum)

    # -- the parties' arrays on separate devices (fedflower) -----------------------------------
    def global_arrays(self) -> dict[str, torch.Tensor]:
        """GMF's ``item``, ``h``, ``b``, then the MLP: ``W`` (flat ``[dim * 2 dim]``) and ``c``."""
        return {**super().global_arrays(), "W": self.W, "c": self.c}

    def load_global_arrays(self, arrays: dict[str, torch.Tensor]) -> None:
        super().load_global_arrays(arrays)
        self.W, self.c = arrays["W"].clone(), arrays["c"].clone()

    def upload_fields(self) -> dict[str, tuple[int, ...]]:
        """The MLP's change, unweighted: ``W_delta`` (``dim * 2 dim``) and ``c_delta`` (``dim``)."""
        d = self.config.dim
        return {"W_delta": (d * 2 * d,), "c_delta": (d,)}

    def local_fields(self) -> dict[str, torch.Tensor]:
        dW, dC = self._deltas
        return {"W_delta": dW, "c_delta": dC}

    def load_local_fields(self, fields: dict[str, torch.Tensor]) -> None:
        if set(fields) != set(self.upload_fields()):
            raise ValueError(f"NCF leaf fields {sorted(fields)}; expected {sorted(self.upload_fields())}")
        self._deltas = (fields["W_delta"], fields["c_delta"])

    # -- the model as the ensemble and the checkpoints see it ----------------------------------
    def forward_hidden(self, p: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last hidden layer, logit)`` of users ``p`` (vectors) with ``items``."""
        _, r, logit = ncf_forward(p, self.item[items], self._mats(), self.c, self.h, self.b)
        return r, logit

    def fold_in_users(self, pos_start: np.ndarray, pos_items: np.ndarray, users: np.ndarray) -> torch.Tensor:
        return fold_in_ncf(self.item, self._mats(), self.c, self.h, self.b, pos_start, pos_items, users,
                           seed=self.seed)

    @torch.no_grad()
    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        u = torch.as_tensor(np.asarray(users))
        it = torch.as_tensor(np.asarray(items))
        if it.ndim == u.ndim + 1:
            u = u.unsqueeze(-1).expand_as(it)
        return self.forward_hidden(self.user[u], it)[1].numpy()

    @torch.no_grad()
    def score_all(self, users: np.ndarray) -> np.ndarray:
        users = np.asarray(users)
        items = np.arange(self.train.n_items)
        return self.score(users, np.broadcast_to(items, (len(users), len(items))))

    def flat_model(self) -> np.ndarray:
        return np.concatenate([super().flat_model(), self.W.numpy(), self.c.numpy()])

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ncf_W": self.W.clone(), "ncf_c": self.c.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.W, self.c = state["ncf_W"].clone(), state["ncf_c"].clone()
