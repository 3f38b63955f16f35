"""NeuMF (NCF) trained centrally (``ncf-central``) and federatedly with FedAvg (``ncf-fed``).

``ncf-central``: no parties; one trainer holds every interaction and runs
:mod:`recmodels.neumf`'s recipe, one epoch per round (the upper bound of ``ncf-fed``). No transcript
and no promise.

``ncf-fed`` parties:
    * one client per user, holding its positives and its user embeddings ``(p_u^G, p_u^M)``
      (never sent);
    * the server, holding the shared parameters: both item tables, the MLP and the output layer.

Round ``t``:
    1. the server samples clients (seeded simulation choice) and sends each the shared parameters
       (kind ``"model"``, float32);
    2. each client copies them, adds its own user rows, and trains ``local_epochs`` epochs on its
       positives and freshly drawn negatives with a fresh Adam (clients keep no optimiser state);
    3. each client uploads ``n_k`` (its example count) and the change ``Delta_k`` of every shared
       parameter (kind ``"update"``, dense float32 as on the wire; rows it never touched are zero);
    4. the server sets ``shared <- shared + server_lr sum_k n_k Delta_k / sum_k n_k`` (FedAvg).

Adversary and promise: an honest-but-curious server. With ``secure_aggregation = "none"`` (the
default) nothing beyond data locality: the server sees each client's plaintext update, and the
nonzero rows of its item tables are the items the client trained on (its positives and negatives).
With ``"secagg"``/``"secagg+"`` each client's ``[n_k Delta_k ; n_k]`` goes through
:func:`protocols.secure_sum.secure_sum` (fixed point, pairwise masks) and the server learns only
the sums over the round's clients, from which it computes the same step (up to the fixed-point
quantisation). Every message goes through the run's transport, so the cost report counts it.

Simulation: the clients of a round train one after another in this process, each on its own copy
(exactly what it would compute alone). Each client's shuffles and negatives come from
``numpy.random.default_rng([seed, round, user])``; ``ncf-central`` draws round ``t`` from
``[seed, t, 0]``, so on data of one user (user 0) one round of ``ncf-fed`` with ``local_epochs = 1``
equals one epoch of ``ncf-central`` (tests/protocols/test_ncf_fed.py). Clients run in process only
(no device split for Flower).

Not guarded against a deviating server: with no device split, this baseline's clients have no
step guard (:mod:`protocols.guard`), so a server that asks a secure step twice in a round is
not refused (docs/limitations.md). It is a comparison point, run in process only.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from dp.events import NonPrivate
from protocols.base import Release, RoundStats
from protocols.registry import ProtocolSpec, register
from protocols.sampled_secure import SampledSecureConfig, check_checkpoint_config
from protocols.secure_sum import secure_sum
from protocols.transport import SERVER, InProcessTransport, client
from recmodels.data import Interactions, pair_keys
from recmodels.neumf import USER_PARAMS, NCFConfig, draw_examples, init_neumf, neumf_logits, train_examples

__all__ = ["NCFCentral", "NCFFed", "NCFFedConfig", "NCFUpdate", "forbidden_keys"]



@dataclass(frozen=True)
class NCFFedConfig(NCFConfig, SampledSecureConfig):
    """:class:`recmodels.neumf.NCFConfig` plus FedAvg's settings.

    Attributes:
        client_fraction: fraction of clients sampled per round, in (0, 1].
        clients_per_round: a fixed count instead (0: use ``client_fraction``).
        local_epochs: local passes per round.
        server_lr: scale of the averaged change.
        secure_aggregation: ``"none"``, ``"secagg"`` or ``"secagg+"`` (module docstring).
        frac_bits, value_clip: the secure sum's fixed point and largest ``|n_k Delta|`` accepted.
        secagg_dropout, secagg_corrupt: the fractions SecAgg+ chooses its ``k`` and ``t`` for.
    """

    client_fraction: float = 0.1
    local_epochs: int = 1
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_sampled_secure("ncffed")


@dataclass(frozen=True)
class NCFUpdate:
    """One client's plaintext upload: the change of every shared parameter and ``n_k``."""

    user: int
    delta: dict[str, np.ndarray]
    weight: float


def forbidden_keys(train: Interactions, exclude: Interactions | None) -> np.ndarray:
    """Sorted pair keys never drawn as negatives: every training pair and the excluded ones."""
    keys = [pair_keys(train.users, train.items, train.n_items)]
    if exclude is not None and len(exclude):
        keys.append(pair_keys(exclude.users, exclude.items, train.n_items))
    return np.unique(np.concatenate(keys))


def _scores(params: dict[str, torch.Tensor], users: np.ndarray, items: np.ndarray) -> np.ndarray:
    users, items = np.asarray(users), np.asarray(items)
    u = torch.as_tensor(users).unsqueeze(1).expand(items.shape)
    with torch.no_grad():
        return neumf_logits(params, u, torch.as_tensor(items)).numpy()


class NCFCentral:
    """Centralised NeuMF; one :meth:`run_round` is one epoch (see the module docstring)."""

    transport = None

    def __init__(self, train: Interactions, config: NCFConfig, *, seed: int, exclude: Interactions | None = None):
        self.train, self.config, self.seed = train, config, int(seed)
        self.params = {k: v.requires_grad_() for k, v in init_neumf(train.n_users, train.n_items, config,
                                                                    seed=seed).items()}
        self.optimizer = torch.optim.Adam(list(self.params.values()), lr=config.lr, weight_decay=config.weight_decay)
        self.forbidden = forbidden_keys(train, exclude)
        self.round = 0

    def run_round(self) -> RoundStats:
        cfg, tr = self.config, self.train
        rng = np.random.default_rng([self.seed, self.round, 0])
        users, items, labels = draw_examples(tr.users, tr.items, self.forbidden, tr.n_items, cfg.train_negatives, rng)
        loss = train_examples(self.params, self.optimizer, users, items, labels, cfg.batch_size, rng)
        self.round += 1
        return RoundStats(round=self.round - 1, loss=loss / max(len(users), 1), extra={"examples": int(len(users))})

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return _scores(self.params, users, items)

    def score_all(self, users: np.ndarray) -> np.ndarray:
        users = np.asarray(users)
        return _scores(self.params, users, np.tile(np.arange(self.train.n_items), (len(users), 1)))

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "params": {k: v.detach().clone() for k, v in self.params.items()},
                "optimizer": self.optimizer.state_dict(), "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_checkpoint_config(self.config, state, "ncf-central")
        self.round = int(state["round"])
        with torch.no_grad():
            for k, v in self.params.items():
                v.copy_(state["params"][k])
        self.optimizer.load_state_dict(state["optimizer"])

    def public_info(self) -> dict[str, Any]:
        return {"protocol": "ncf-central", "n_users": self.train.n_users, "n_items": self.train.n_items,
                "config": asdict(self.config)}


class NCFFed:
    """FedAvg over NeuMF (see the module docstring).

    Args:
        train: training interactions (implicit).
        config: hyper-parameters.
        seed: seeds initialisation, client sampling and every client's stream.
        transport: where messages go (default: a fresh in-process transport).
        exclude: pairs never drawn as negatives besides the training pairs.
    """

    def __init__(self, train: Interactions, config: NCFFedConfig, *, seed: int,
                 transport: InProcessTransport | None = None, exclude: Interactions | None = None):
        self.train, self.config, self.seed = train, config, int(seed)
        self.transport = transport or InProcessTransport()
        self.rng = np.random.default_rng(seed)
        params = init_neumf(train.n_users, train.n_items, config, seed=seed)
        self.users = {k: params.pop(k) for k in USER_PARAMS}  # each row on its client
        self.shared = params  # on the server
        self.forbidden = forbidden_keys(train, exclude)
        order = np.argsort(train.users, kind="stable")
        self._rows = order
        self._start = np.concatenate([[0], np.cumsum(np.bincount(train.users, minlength=train.n_users))])
        self._clients = np.flatnonzero(np.diff(self._start) > 0)
        if not len(self._clients):
            raise ValueError("ncf-fed needs at least one user with training interactions")
        self.round = 0
        config.check_secure_budget(len(self._clients))

    @property
    def model_bytes(self) -> int:
        """float32 bytes of the shared parameters (the download, and the dense upload)."""
        return 4 * sum(int(v.numel()) for v in self.shared.values())

    def local_train(self, u: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float, int]:
        """Client ``u``'s local round on a copy of the shared model: ``(new user rows, delta, loss, n_k)``."""
        cfg = self.config
        rows = self._rows[self._start[u]:self._start[u + 1]]
        own = {k: v[u:u + 1].clone().requires_grad_() for k, v in self.users.items()}
        local = {k: v.clone().requires_grad_() for k, v in self.shared.items()}
        params = {**own, **local}
        opt = torch.optim.Adam(list(params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
        rng = np.random.default_rng([self.seed, self.round, u])
        items = self.train.items[rows]
        loss, n = 0.0, 0
        for _ in range(cfg.local_epochs):
            # keys use the user's global index (negatives must avoid its pairs); the table has one row
            uu, ii, yy = draw_examples(np.full(len(rows), u, np.int64), items, self.forbidden, self.train.n_items,
                                       cfg.train_negatives, rng)
            loss += train_examples(params, opt, np.zeros_like(uu), ii, yy, cfg.batch_size, rng)
            n += len(uu)
        delta = {k: (local[k].detach() - self.shared[k]) for k in self.shared}
        return {k: v.detach()[0] for k, v in own.items()}, delta, loss, n

    def run_round(self) -> RoundStats:
        cfg, t = self.config, self.round
        t0 = time.perf_counter()
        m = cfg.clients_in_round(len(self._clients))
        sampled = np.sort(self.rng.choice(self._clients, size=m, replace=False))
        keep = self.transport.transcript.keep_payloads
        for u in sampled:
            self.transport.send(SERVER, client(u), t, "model", None, self.model_bytes)
        sums = {k: torch.zeros_like(v) for k, v in self.shared.items()}
        vectors = [] if cfg.secure_aggregation != "none" else None
        weights = np.zeros(m)
        loss = 0.0
        new_rows: list[dict[str, torch.Tensor]] = []
        for c, u in enumerate(sampled.tolist()):
            rows, delta, lsum, n = self.local_train(u)
            new_rows.append(rows)
            loss += lsum
            weights[c] = n
            if vectors is None:
                for k, d in delta.items():
                    sums[k] += n * d
                payload = NCFUpdate(u, {k: d.numpy().copy() for k, d in delta.items()}, float(n)) if keep else None
                self.transport.send(client(u), SERVER, t, "update", payload, self.model_bytes + 4)
            else:
                vectors.append(np.concatenate([(n * d).reshape(-1).numpy().astype(np.float64) for d in delta.values()]
                                              + [np.array([float(n)])]))
        t_local = time.perf_counter()
        secagg_s = 0.0
        if vectors is None:
            total_w = float(weights.sum())
            upload = self.model_bytes + 4.0
        else:
            res = secure_sum(np.stack(vectors), protocol=cfg.secure_aggregation, frac_bits=cfg.frac_bits,
                             value_clip=cfg.value_clip, round=t, transport=self.transport,
                             senders=[client(u) for u in sampled], where="ncffed.value_clip",
                             dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt)
            secagg_s = float(np.mean(res.client_seconds))
            total, off = res.total, 0
            for k, v in self.shared.items():
                sums[k] = torch.as_tensor(total[off:off + v.numel()].reshape(tuple(v.shape)), dtype=v.dtype)
                off += v.numel()
            total_w = float(round(total[off]))
            upload = float(res.bytes_per_client)
        if total_w > 0:
            for k in self.shared:
                self.shared[k] = self.shared[k] + cfg.server_lr * sums[k] / total_w
        for u, rows in zip(sampled.tolist(), new_rows):
            for k, v in rows.items():
                self.users[k][u] = v
        self.round += 1
        t_end = time.perf_counter()
        what = ("NeuMF shared-parameter updates, each in plaintext" if vectors is None else
                f"the sum of NeuMF shared-parameter updates through {cfg.secure_aggregation} (no DP noise)")
        return RoundStats(
            round=t, loss=loss / max(weights.sum(), 1), clients=m, bytes_per_client=self.model_bytes + upload,
            seconds={"round": t_end - t0, "client": (t_local - t0) / m + secagg_s,
                     "server": max(0.0, t_end - t_local - secagg_s * m)},
            extra={"examples": int(weights.sum())},
            releases=(Release(NonPrivate(), who="clients", what=what, params={"clients": m}),),
        )

    def _params(self) -> dict[str, torch.Tensor]:
        return {**self.users, **self.shared}

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Candidate scores as each client computes them with its own rows and the global model."""
        return _scores(self._params(), users, items)

    def score_all(self, users: np.ndarray) -> np.ndarray:
        users = np.asarray(users)
        return _scores(self._params(), users,
                       np.tile(np.arange(self.train.n_items), (len(users), 1)))

    def public_info(self) -> dict[str, Any]:
        return {"protocol": "ncf-fed", "n_users": self.train.n_users, "n_items": self.train.n_items,
                "clients": int(len(self._clients)), "config": asdict(self.config)}

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "users": {k: v.clone() for k, v in self.users.items()},
                "shared": {k: v.clone() for k, v in self.shared.items()}, "rng": self.rng.bit_generator.state,
                "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_checkpoint_config(self.config, state, "ncf-fed")
        self.round = int(state["round"])
        self.users = {k: state["users"][k].clone() for k in USER_PARAMS}
        self.shared = {k: state["shared"][k].clone() for k in self.shared}
        self.rng.bit_generator.state = state["rng"]


register(ProtocolSpec(
    name="ncf-central",
    summary="NeuMF (GMF + MLP, He et al. 2017) trained centrally on all interactions",
    build=lambda ctx: NCFCentral(ctx.train, ctx.config, seed=ctx.seed, exclude=ctx.exclude),
    section="ncf", config_cls=NCFConfig, federated=False,
))
register(ProtocolSpec(
    name="ncf-fed",
    summary="NeuMF trained with FedAvg: user embeddings on the clients, item tables and MLP averaged by the server",
    build=lambda ctx: NCFFed(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport, exclude=ctx.exclude),
    section="ncffed", config_cls=NCFFedConfig,
))
