"""MetaMF (Lin, Ren, Chen, Ren, Ma and de Rijke 2020, "Meta Matrix Factorization for Federated Rating
Predictions"), as a federated baseline: a meta network on the server generates each client's private item
embeddings and rating network; clients return the meta network's gradients.

Parties:
    * one client per user, holding its ratings and its user embedding ``e_u`` (``[user_dim]``, never
      sent) with its own Adam moments;
    * the server, holding the meta network (:mod:`recmodels.metamf`): the collaborative memory (keys and
      memory), one hypernetwork per generated rating-network layer, and the item generator ``P = L g + l``,
      ``Q = R g + r``, ``E_u = P Q`` (low rank ``item_rank``).

Round ``t`` (every sampled client, one gradient on its whole local data):
    1. the server sends the meta network (kind ``"model"``, float32; every item's slice, so that the
       download does not name the client's items);
    2. the client computes ``c_u`` from ``e_u``, generates its rating network and the rows of ``E_u`` of
       its rated items, predicts, and takes the gradient of its mean squared error
       ``(1 / |I_u|) sum_(i in I_u) (r_ui - r^_ui)^2`` with respect to the meta network and ``e_u``;
    3. it uploads the meta network's gradient (kind ``"update"``): the item generator's slices
       ``L[i], l[i]`` for its rated items only, with the ids in the clear and sorted (the other slices'
       gradients are zero), every other parameter's gradient dense, and its loss sum; it moves ``e_u`` by
       one Adam step of ``user_lr`` on its own gradient;
    4. the server averages the gradients over the round's clients, adds ``reg`` times the parameters
       (L2) and takes one Adam step of ``lr``.

Adversary and promise: an honest-but-curious server. With ``secure_aggregation = "none"`` (the default)
the server sees each client's gradient in plaintext, which **reveals the user's rated items** (the ids of
the uploaded slices) **and carries its ratings**: the slice of item ``i`` is proportional to the
prediction error on ``i``, and the dense gradients are functions of ``e_u`` and the errors; nothing here
hides them (no filling, no noise). MetaMF's own point is the small model on the device, not privacy
(LightFR's Table 1 marks it "no privacy enhancement"). With ``"secagg"``/``"secagg+"`` each client's
dense gradient (every item's slice, zeros included, plus the loss terms) goes through
:func:`protocols.secure_sum.secure_sum`: the server learns only the round's sums. That vector is the
meta network's size (``(item_rank x (gen_hidden + 1)) x n_items`` plus the rest), so secure rounds are
much heavier than plaintext ones. Every message goes through the run's transport.

What differs from the paper (docs/baselines.md lists the decisions): the user embeddings live on the
clients (the paper keeps them in the server's meta network, which LightFR criticises) so the client,
not the server, runs the meta network and uploads its gradient; rows of ``E_u`` are generated only for
the items the client scores (identical numbers, tested); the last layer's output starts at
``init_bias``; the sizes are small (LightFR's ``L = 2``, ``h = 8``, ``s = 8``, the rest ours).

``metamf-rank`` is the same protocol evaluated as LightFR evaluates it: leave-one-out, each client
ranking the held-out item among the sampled candidates by its predicted rating.

Simulation (torch, float64, in this process): when the transcript keeps payloads, or under secure
aggregation, the sampled clients are computed one after another, each exactly as it would alone; otherwise
one pass computes the sum of their gradients (:func:`summed_gradients`, the same numbers, tested) and each
upload is recorded with its exact size. Client sampling and initialisation are seeded simulation randomness
(a real client would draw its ``e_u`` itself).

Not guarded against a deviating server: with no device split, this baseline's clients have no step guard
(:mod:`protocols.guard`), so a server that asks a secure step twice in a round is not refused
(docs/limitations.md). It is a comparison point, run in process only.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from dp.events import NonPrivate
from protocols.base import Release, RoundStats
from protocols.registry import ProtocolSpec, register_with_rank
from protocols.sampled_secure import SampledSecureConfig, check_checkpoint_config
from protocols.secure_sum import secure_sum
from protocols.transport import SERVER, InProcessTransport, client
from recmodels.data import Interactions
from recmodels.metamf import SPARSE, init_params, item_rows, param_shapes, predict
from recmodels.mf import mae, rmse

__all__ = ["MetaMF", "MetaMFConfig", "MetaMFUpload", "client_gradient", "summed_gradients"]

_SIZES = ("user_dim", "memory_slots", "memory_dim", "gen_hidden", "item_dim", "item_rank", "rp_hidden", "rp_layers")
_BETAS, _EPS = (0.9, 0.999), 1e-8


@dataclass(frozen=True)
class MetaMFConfig(SampledSecureConfig):
    """Hyper-parameters of MetaMF.

    Attributes:
        user_dim: size of each client's user embedding ``e_u``.
        memory_slots: keys (and memory rows) of the collaborative memory.
        memory_dim: size of the collaborative vector ``c_u``.
        gen_hidden: hidden units of each generator (rating-network layers and item embeddings).
        item_dim: size ``s`` of the generated item embeddings (LightFR: 8).
        item_rank: rank of the item-embedding decomposition ``E_u = P Q`` (the authors' code: 8).
        rp_hidden: hidden units ``h`` of the generated rating network (LightFR: 8).
        rp_layers: generated layers of the rating network, ``item_dim -> rp_hidden -> ... -> 1`` (LightFR's ``L = 2``).
        lr: the server's Adam learning rate on the averaged gradient.
        user_lr: each client's Adam learning rate on its own ``e_u``.
        reg: L2 coefficient added to the server's averaged gradient (``reg * theta``).
        init_bias: the starting constant of the output's bias generator (about the mean rating; public).
        client_fraction, clients_per_round: the clients sampled per round.
        secure_aggregation, frac_bits, value_clip, secagg_dropout, secagg_corrupt: as FedAvg's.
    """

    user_dim: int = 32
    memory_slots: int = 16
    memory_dim: int = 32
    gen_hidden: int = 8
    item_dim: int = 8
    item_rank: int = 8
    rp_hidden: int = 8
    rp_layers: int = 2
    lr: float = 0.005
    user_lr: float = 0.01
    reg: float = 0.01
    init_bias: float = 3.5

    def __post_init__(self) -> None:
        for name in _SIZES:
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"metamf.{name} must be an int >= 1; found {v!r}")
        for name in ("lr", "user_lr", "reg", "init_bias"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"metamf.{name} must be a finite number; found {v!r}")
        if not (self.lr > 0 and self.user_lr >= 0 and self.reg >= 0):
            raise ValueError(f"metamf.lr must be positive and metamf.user_lr, metamf.reg >= 0; found lr={self.lr!r}, "
                             f"user_lr={self.user_lr!r}, reg={self.reg!r}")
        self.check_sampled_secure("metamf")

    def shapes(self, n_items: int) -> dict[str, tuple[int, ...]]:
        return param_shapes(n_items, **{k: getattr(self, k) for k in _SIZES})


@dataclass(frozen=True)
class MetaMFUpload:
    """One client's plaintext upload: its rated items (sorted), their item-generator slices' gradients
    (``[n, item_rank * (gen_hidden + 1)]``: ``L[i]`` flattened, then ``l[i]``), every dense parameter's
    gradient flattened in the model's order, and its loss sum."""

    user: int
    items: np.ndarray
    item_rows: np.ndarray
    dense: np.ndarray
    loss: float

    @property
    def nbytes(self) -> int:
        return 4 * (len(self.items) + int(self.item_rows.size) + int(self.dense.size) + 1)


def client_gradient(params: dict[str, torch.Tensor], e: torch.Tensor, items: np.ndarray, ratings: np.ndarray
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One client's step 2: gradients of its mean squared error on ``(items, ratings)``.

    Returns:
        ``(dense, left_w, left_b, e_grad, loss_sum)``: the dense parameters' gradients by name, the gradients of
        the item generator's slices of ``items`` (in the order given), of ``e`` (``[user_dim]``), and the
        sum of squared errors.
    """
    idx = torch.as_tensor(np.asarray(items, np.int64))
    dense = {k: v.detach().requires_grad_() for k, v in params.items() if k not in SPARSE}
    lw, lb = (t.detach().clone().requires_grad_() for t in item_rows(params, idx))
    eu = e.detach().clone().reshape(1, -1).requires_grad_()
    pred = predict(dense, eu, lw, lb, torch.zeros(len(idx), dtype=torch.int64))
    err2 = (pred - torch.as_tensor(np.asarray(ratings, np.float64))) ** 2
    grads = torch.autograd.grad(err2.mean(), [*dense.values(), lw, lb, eu])
    return (dict(zip(dense, grads[:len(dense)])), grads[-3], grads[-2], grads[-1][0], float(err2.detach().sum()))


def summed_gradients(params: dict[str, torch.Tensor], e: torch.Tensor, items: np.ndarray, ratings: np.ndarray,
                     owner: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor, float]:
    """The sum over clients of :func:`client_gradient`, in one pass: ``owner[j]`` is the row of ``e``
    (``[b, user_dim]``) whose client rated ``items[j]``; each client's squared errors are divided by its
    own rating count, so the total's gradient is the sum of the clients' gradients (each client's ``e_u``
    and loss enter no other client's term).

    Returns:
        ``(grads, e_grads, loss_sum)``: every parameter's summed gradient (the item slices scattered to
        their rows), each client's ``e_u`` gradient (``[b, user_dim]``) and the total of squared errors.
    """
    leaf = {k: v.detach().requires_grad_() for k, v in params.items()}
    eb = e.detach().clone().requires_grad_()
    own = torch.as_tensor(np.asarray(owner, np.int64))
    lw, lb = item_rows(leaf, torch.as_tensor(np.asarray(items, np.int64)))
    err2 = (predict(leaf, eb, lw, lb, own) - torch.as_tensor(np.asarray(ratings, np.float64))) ** 2
    counts = torch.bincount(own, minlength=len(e)).to(torch.float64)
    grads = torch.autograd.grad((err2 / counts[own]).sum(), [*leaf.values(), eb])
    return dict(zip(leaf, grads[:-1])), grads[-1], float(err2.detach().sum())


class MetaMF:
    """MetaMF simulation (see the module docstring).

    Args:
        train: training ratings (explicit).
        config: hyper-parameters.
        seed: seeds initialisation and client sampling.
        transport: where messages go (default: a fresh in-process transport).
    """

    def __init__(self, train: Interactions, config: MetaMFConfig, *, seed: int,
                 transport: InProcessTransport | None = None):
        if not len(train):
            raise ValueError("metamf needs training ratings; found none")
        self.train, self.config = train, config
        self.transport = transport or InProcessTransport()
        self.rng = np.random.default_rng(seed)
        gen = torch.Generator().manual_seed(int(seed))
        self.params = init_params(config.shapes(train.n_items), init_bias=config.init_bias, generator=gen)
        # each client's own draw in a real run; N(0, 1 / user_dim), so e_u . k starts at unit variance
        self.e = torch.randn((train.n_users, config.user_dim), generator=gen, dtype=torch.float64)
        self.e /= math.sqrt(config.user_dim)
        self.e_m, self.e_v = torch.zeros_like(self.e), torch.zeros_like(self.e)
        self.e_steps = np.zeros(train.n_users, np.int64)
        self.m = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.steps = 0
        self.scale = (float(train.ratings.min()), float(train.ratings.max()))
        order = np.lexsort((train.items, train.users))
        self.ri, self.rr = train.items[order].astype(np.int64), train.ratings[order].astype(np.float64)
        counts = np.bincount(train.users, minlength=train.n_users)
        self._start = np.concatenate([[0], np.cumsum(counts)])
        self._clients = np.flatnonzero(counts > 0)
        self.round = 0
        config.check_secure_budget(len(self._clients))

    @property
    def model_bytes(self) -> int:
        """float32 bytes of the whole meta network (the download)."""
        return 4 * sum(int(v.numel()) for v in self.params.values())

    def rated(self, u: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self._start[u], self._start[u + 1]
        return self.ri[lo:hi], self.rr[lo:hi]

    def _flat(self, dense: dict[str, torch.Tensor], lw: torch.Tensor, lb: torch.Tensor, items: np.ndarray
              ) -> np.ndarray:
        """A client's gradient as one dense vector in the model's order (every item's slice; zeros off ``items``)."""
        parts = []
        for k, v in self.params.items():
            if k in SPARSE:
                full = torch.zeros_like(v)
                full[torch.as_tensor(items)] = lw if k == SPARSE[0] else lb
                parts.append(full.reshape(-1))
            else:
                parts.append(dense[k].reshape(-1))
        return torch.cat(parts).numpy()

    def run_round(self) -> RoundStats:
        cfg, t = self.config, self.round
        t0 = time.perf_counter()
        m = cfg.clients_in_round(len(self._clients))
        sampled = np.sort(self.rng.choice(self._clients, size=m, replace=False))
        for u in sampled:
            self.transport.send(SERVER, client(u), t, "model", None, self.model_bytes)
        if cfg.secure_aggregation != "none":
            part = self._secure_round(t, sampled)
        elif self.transport.transcript.keep_payloads:
            part = self._plaintext_round(t, sampled)
        else:  # nobody keeps the uploads' values: one pass computes their sum
            part = self._batched_round(t, sampled)
        total, e_grads, loss_sum, loss_n, upload, secagg_s = part
        t_local = time.perf_counter()
        self._client_steps(sampled, e_grads)  # on the clients
        self._server_step({k: g / m for k, g in total.items()})
        self.round += 1
        t_end = time.perf_counter()
        what = ("MetaMF meta-network gradients, each in plaintext with the rated items' ids"
                if cfg.secure_aggregation == "none" else
                f"the sum of MetaMF meta-network gradients through {cfg.secure_aggregation} (no DP noise)")
        return RoundStats(
            round=t, loss=loss_sum / max(loss_n, 1.0), clients=m, bytes_per_client=self.model_bytes + upload / m,
            seconds={"round": t_end - t0, "client": (t_local - t0) / m + secagg_s,
                     "server": max(0.0, t_end - t_local)},
            extra={"rated_rows": int(loss_n)},
            releases=(Release(NonPrivate(), who="clients", what=what, params={"clients": m}),),
        )

    # Each of the three returns (summed gradients by name, the clients' e_u gradients [m, user_dim],
    # loss sum, rating count, upload bytes of all clients, mean secure-sum seconds per client).

    def _plaintext_round(self, t: int, sampled: np.ndarray) -> tuple:
        """Every client computes and sends its :class:`MetaMFUpload` alone; the server adds them."""
        total = {k: torch.zeros_like(v) for k, v in self.params.items()}
        e_grads, loss_sum, loss_n, upload = [], 0.0, 0.0, 0.0
        for u in sampled.tolist():
            items, ratings = self.rated(u)
            dense, lw, lb, ge, sse = client_gradient(self.params, self.e[u], items, ratings)
            e_grads.append(ge)
            rows = torch.cat([lw.reshape(len(items), -1), lb], 1).numpy().astype(np.float32)
            flat = torch.cat([g.reshape(-1) for g in dense.values()]).numpy().astype(np.float32)
            up = MetaMFUpload(u, items.copy(), rows, flat, sse)
            self.transport.send(client(u), SERVER, t, "update", up, up.nbytes)
            for k, g in dense.items():  # the server's side
                total[k] += g
            total[SPARSE[0]].index_add_(0, torch.as_tensor(items), lw)
            total[SPARSE[1]].index_add_(0, torch.as_tensor(items), lb)
            loss_sum, loss_n, upload = loss_sum + sse, loss_n + len(items), upload + up.nbytes
        return total, torch.stack(e_grads), loss_sum, loss_n, upload, 0.0

    def _batched_round(self, t: int, sampled: np.ndarray) -> tuple:
        """The plaintext round without kept payloads: the summed gradient by :func:`summed_gradients`, each
        upload sent with its exact size (its values are the per-client terms of that sum)."""
        lo, hi = self._start[sampled], self._start[sampled + 1]
        rows = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
        owner = np.repeat(np.arange(len(sampled)), hi - lo)
        total, e_grads, sse = summed_gradients(self.params, self.e[torch.as_tensor(sampled)], self.ri[rows],
                                               self.rr[rows], owner)
        dense = sum(int(v.numel()) for k, v in self.params.items() if k not in SPARSE)
        width = self.config.item_rank * (self.config.gen_hidden + 1)
        upload = 0.0
        for u, n in zip(sampled.tolist(), (hi - lo).tolist()):
            nbytes = 4 * (n + n * width + dense + 1)  # MetaMFUpload.nbytes
            upload += nbytes
            self.transport.send(client(u), SERVER, t, "update", None, nbytes)
        return total, e_grads, sse, float(len(rows)), upload, 0.0

    def _secure_round(self, t: int, sampled: np.ndarray) -> tuple:
        """Every client's dense gradient (and loss terms) through the secure sum; the server gets the sums."""
        cfg = self.config
        vectors = np.zeros((len(sampled), sum(int(v.numel()) for v in self.params.values()) + 2))
        e_grads = []
        for c, u in enumerate(sampled.tolist()):
            items, ratings = self.rated(u)
            dense, lw, lb, ge, sse = client_gradient(self.params, self.e[u], items, ratings)
            e_grads.append(ge)
            vectors[c, :-2] = self._flat(dense, lw, lb, items)
            vectors[c, -2:] = sse, len(items)
        res = secure_sum(vectors, protocol=cfg.secure_aggregation, frac_bits=cfg.frac_bits, value_clip=cfg.value_clip,
                         round=t, transport=self.transport, senders=[client(u) for u in sampled],
                         where="metamf.value_clip", dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt)
        total, off = {}, 0
        for k, v in self.params.items():
            total[k] = torch.as_tensor(res.total[off:off + v.numel()]).reshape(v.shape).clone()
            off += v.numel()
        return (total, torch.stack(e_grads), float(res.total[-2]), float(round(res.total[-1])),
                float(res.bytes_per_client) * len(sampled), float(np.mean(res.client_seconds)))

    def _client_steps(self, users: np.ndarray, grads: torch.Tensor) -> None:
        """Each listed client's Adam step on its own ``e_u`` (its moments and step count stay on it)."""
        if not self.config.user_lr:
            return
        idx = torch.as_tensor(users)
        self.e_steps[users] += 1
        steps = torch.as_tensor(self.e_steps[users], dtype=torch.float64)[:, None]
        b1, b2 = _BETAS
        self.e_m[idx] = b1 * self.e_m[idx] + (1 - b1) * grads
        self.e_v[idx] = b2 * self.e_v[idx] + (1 - b2) * grads * grads
        mhat, vhat = self.e_m[idx] / (1 - b1**steps), self.e_v[idx] / (1 - b2**steps)
        self.e[idx] = self.e[idx] - self.config.user_lr * mhat / (vhat.sqrt() + _EPS)

    def _server_step(self, grads: dict[str, torch.Tensor]) -> None:
        """One Adam step (torch's defaults) of ``lr`` on the averaged gradient plus ``reg * theta``."""
        cfg = self.config
        self.steps += 1
        b1, b2 = _BETAS
        for k, p in self.params.items():
            g = grads[k] + cfg.reg * p if cfg.reg else grads[k]
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            mhat, vhat = self.m[k] / (1 - b1**self.steps), self.v[k] / (1 - b2**self.steps)
            self.params[k] = p - cfg.lr * mhat / (vhat.sqrt() + _EPS)

    def score(self, users: np.ndarray, items: np.ndarray, *, chunk: int = 65536) -> np.ndarray:
        """Each client's predicted ratings ``[b, k]`` of ``items[b]`` with its generated model (unclipped)."""
        users, items = np.asarray(users, np.int64), np.asarray(items, np.int64)
        out = np.zeros(items.shape)
        step = max(1, chunk // max(items.shape[1], 1))
        with torch.no_grad():
            for lo in range(0, len(users), step):
                idx = torch.as_tensor(items[lo:lo + step])
                lw, lb = item_rows(self.params, idx.reshape(-1))
                owner = torch.arange(len(idx)).repeat_interleave(idx.shape[1])
                e = self.e[torch.as_tensor(users[lo:lo + step])]
                out[lo:lo + step] = predict(self.params, e, lw, lb, owner).reshape(idx.shape).numpy()
        return out

    def score_all(self, users: np.ndarray) -> np.ndarray:
        users = np.asarray(users, np.int64)
        return self.score(users, np.tile(np.arange(self.train.n_items), (len(users), 1)))

    def predict(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Clipped predictions for ``(users[j], items[j])`` pairs (each client predicts its own)."""
        users, items = np.asarray(users, np.int64), np.asarray(items, np.int64)
        uniq, owner = np.unique(users, return_inverse=True)
        with torch.no_grad():
            lw, lb = item_rows(self.params, torch.as_tensor(items))
            out = predict(self.params, self.e[torch.as_tensor(uniq)], lw, lb, torch.as_tensor(owner)).numpy()
        return np.clip(out, *self.scale)

    def evaluate(self, test: Interactions) -> dict[str, float]:
        """RMSE and MAE of the clipped predictions on held-out ratings."""
        pred = self.predict(test.users, test.items)
        return {"rmse": rmse(pred, test.ratings), "mae": mae(pred, test.ratings)}

    def public_info(self) -> dict[str, Any]:
        return {"protocol": "metamf", "n_users": self.train.n_users, "n_items": self.train.n_items,
                "clients": int(len(self._clients)), "meta_parameters": self.model_bytes // 4,
                "config": asdict(self.config)}

    def state_dict(self) -> dict[str, Any]:
        clone = lambda d: {k: v.clone() for k, v in d.items()}  # noqa: E731
        return {"round": self.round, "steps": self.steps, "params": clone(self.params), "m": clone(self.m),
                "v": clone(self.v), "e": self.e.clone(), "e_m": self.e_m.clone(), "e_v": self.e_v.clone(),
                "e_steps": self.e_steps.copy(), "rng": self.rng.bit_generator.state, "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_checkpoint_config(self.config, state, "metamf")
        for part in ("params", "m", "v"):
            if set(state[part]) != set(self.params) or any(
                    tuple(state[part][k].shape) != tuple(v.shape) for k, v in self.params.items()):
                raise ValueError(f"metamf checkpoint: {part} do not match this model's parameters")
        self.round, self.steps = int(state["round"]), int(state["steps"])
        self.params = {k: state["params"][k].clone().to(torch.float64) for k in self.params}
        self.m = {k: state["m"][k].clone().to(torch.float64) for k in self.params}
        self.v = {k: state["v"][k].clone().to(torch.float64) for k in self.params}
        self.e, self.e_m, self.e_v = (state[k].clone().to(torch.float64) for k in ("e", "e_m", "e_v"))
        self.e_steps = np.array(state["e_steps"], np.int64, copy=True)
        self.rng.bit_generator.state = state["rng"]


register_with_rank(ProtocolSpec(
    name="metamf",
    summary="MetaMF (Lin et al. 2020): a server-side meta network generates each client's item embeddings and "
            "rating MLP; clients keep their user embeddings and upload meta-network gradients",
    build=lambda ctx: MetaMF(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport),
    section="metamf", config_cls=MetaMFConfig, task="rating", keeps_ratings=True,
), "MetaMF trained on explicit ratings, ranked by predicted rating (leave-one-out, LightFR's protocol)")
