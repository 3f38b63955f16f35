"""FCF (Ammad-ud-din et al. 2019, "Federated Collaborative Filtering for Privacy-Preserving
Personalized Recommendation System"): implicit-feedback ALS with the item factors learned by
federated gradients.

Model (Hu, Koren and Volinsky's implicit CF): preference ``p_ui = 1`` if ``u`` interacted with
``i`` (else 0), confidence ``c_ui = 1 + alpha r_ui`` (``r_ui`` the interaction's value, 1 for
binarised data), cost ``J = sum_(u,i) c_ui (p_ui - x_u . y_i)^2 + reg (sum |x_u|^2 + sum |y_i|^2)``.

Parties:
    * one client per user, holding its interactions and its factor ``x_u`` (never sent);
    * the server, holding the item factors ``Y`` (``[n_items, dim]``).

Round ``t`` (paper's Algorithm 1):
    1. the server sends ``Y`` to the sampled clients (kind ``"model"``, float32);
    2. each client solves its factor in closed form (the ALS step, paper Eq. 5):
       ``x_u = (Y^T C^u Y + reg I)^-1 Y^T C^u p(u)``, computed as
       ``Y^T Y + alpha sum_(i rated) r_ui y_i y_i^T`` (only its rated rows differ from 1);
    3. each client uploads ``f(u, i) = c_ui (p_ui - x_u . y_i) x_u`` for **every** item (paper Eq. 7;
       dense ``[n_items, dim]``, kind ``"update"``) and its cost term (one number);
    4. the server forms ``dJ/dy_i = -2 sum_u f(u, i) + 2 reg y_i`` (Eq. 8) and takes one step of
       ``optimizer`` (``"adam"``: the paper's adaptive learning rate; ``"sgd"``: ``y_i -= lr dJ/dy_i``).

Evaluation scores ``x_u . y_i`` with each client's factor re-solved against the latest ``Y`` (a
client can do so on its device at any time).

Adversary and promise: an honest-but-curious server. With ``secure_aggregation = "none"`` (the
default) nothing beyond data locality: every upload is in plaintext and, as the paper does not
address, ``f(u, i)`` differs between rated and unrated items (``c_ui`` and ``p_ui`` enter it), so
the server can read a client's interactions from one upload. With ``"secagg"``/``"secagg+"`` the
uploads (and cost terms) go through :func:`protocols.secure_sum.secure_sum`: the server learns
only their sums over the round's clients. Every message goes through the run's transport.

Simulation: the sampled clients are computed one after another in this process, each exactly as
it would alone (one ``[dim, dim]`` system, one dense upload). Client sampling is seeded
simulation randomness. In process only (no device split for Flower).

Not guarded against a deviating server: with no device split, this baseline's clients have no
step guard (:mod:`protocols.guard`), so a server that asks a secure step twice in a round is
not refused (docs/limitations.md). It is a comparison point, run in process only.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dp.events import NonPrivate
from protocols.base import Release, RoundStats
from protocols.registry import ProtocolSpec, register
from protocols.sampled_secure import SampledSecureConfig, check_checkpoint_config
from protocols.secure_sum import secure_sum
from protocols.transport import SERVER, InProcessTransport, client
from recmodels.data import Interactions

__all__ = ["FCF", "FCFConfig", "FCFUpdate", "client_gradient", "solve_user"]

_OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class FCFConfig(SampledSecureConfig):
    """Hyper-parameters of FCF.

    Attributes:
        dim: latent factors.
        alpha: confidence scale (``c_ui = 1 + alpha r_ui``).
        reg: L2 regulariser ``reg`` of both factor sets.
        lr: the server's learning rate.
        optimizer: ``"adam"`` (default; the paper's adaptive learning rate) or ``"sgd"``.
        init_std: ``Y`` starts as ``N(0, init_std^2)``.
        client_fraction, clients_per_round: the clients sampled per round.
        secure_aggregation, frac_bits, value_clip, secagg_dropout, secagg_corrupt: as FedAvg's.
    """

    dim: int = 20
    alpha: float = 4.0
    reg: float = 1.0
    lr: float = 0.05
    optimizer: str = "adam"
    init_std: float = 0.1

    def __post_init__(self) -> None:
        if type(self.dim) is not int or self.dim < 1:
            raise ValueError(f"fcf.dim must be an int >= 1; found {self.dim!r}")
        for name in ("alpha", "reg", "lr", "init_std"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"fcf.{name} must be a finite number >= 0; found {v!r}")
        if not (self.lr > 0 and self.reg > 0):
            raise ValueError(f"fcf.lr and fcf.reg must be positive; found {self.lr!r}, {self.reg!r}")
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"fcf.optimizer must be one of {_OPTIMIZERS}; found {self.optimizer!r}")
        self.check_sampled_secure("fcf")


@dataclass(frozen=True)
class FCFUpdate:
    """One client's plaintext upload: ``f(u, i)`` for every item and its cost term."""

    user: int
    gradient: np.ndarray
    cost: float


def solve_user(y: np.ndarray, yty: np.ndarray, items: np.ndarray, values: np.ndarray, alpha: float,
               reg: float) -> np.ndarray:
    """The ALS step of one client: ``(Y^T C Y + reg I)^-1 Y^T C p`` from its rated ``items``."""
    yr = y[items]
    a = yty + alpha * (yr.T * values) @ yr + reg * np.eye(y.shape[1])
    b = ((1.0 + alpha * values)[:, None] * yr).sum(0)
    return np.linalg.solve(a, b)


def client_gradient(y: np.ndarray, x: np.ndarray, items: np.ndarray, values: np.ndarray,
                    alpha: float) -> tuple[np.ndarray, float]:
    """One client's dense upload ``f(u, i) = c_ui (p_ui - x . y_i) x`` and its cost term
    ``sum_i c_ui (p_ui - x . y_i)^2`` (every item; ``p = 1``, ``c = 1 + alpha r`` on ``items``)."""
    p = np.zeros(len(y))
    c = np.ones(len(y))
    p[items] = 1.0
    c[items] = 1.0 + alpha * values
    e = p - y @ x
    return (c * e)[:, None] * x[None, :], float((c * e * e).sum())


class FCF:
    """FCF simulation (see the module docstring).

    Args:
        train: training interactions (implicit; ``ratings`` are the ``r_ui`` of the confidence).
        config: hyper-parameters.
        seed: seeds ``Y``'s initialisation and client sampling.
        transport: where messages go (default: a fresh in-process transport).
    """

    def __init__(self, train: Interactions, config: FCFConfig, *, seed: int,
                 transport: InProcessTransport | None = None):
        self.train, self.config = train, config
        self.transport = transport or InProcessTransport()
        self.rng = np.random.default_rng(seed)
        self.y = self.rng.normal(0.0, config.init_std, (train.n_items, config.dim))
        self.m = np.zeros_like(self.y)
        self.v = np.zeros_like(self.y)
        self.steps = 0
        order = np.lexsort((train.items, train.users))
        self._items = train.items[order].astype(np.int64)
        self._values = train.ratings[order].astype(np.float64)
        self._start = np.concatenate([[0], np.cumsum(np.bincount(train.users, minlength=train.n_users))])
        self._clients = np.flatnonzero(np.diff(self._start) > 0)
        if not len(self._clients):
            raise ValueError("fcf needs at least one user with training interactions")
        self.round = 0
        self._x: np.ndarray | None = None  # factors solved against the current Y (evaluation cache)
        config.check_secure_budget(len(self._clients))

    def rated(self, u: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self._start[u], self._start[u + 1]
        return self._items[lo:hi], self._values[lo:hi]

    def solve(self, users: np.ndarray) -> np.ndarray:
        """Each listed client's ALS step against the current ``Y`` (zeros for a client without data)."""
        cfg = self.config
        yty = self.y.T @ self.y
        out = np.zeros((len(users), cfg.dim))
        for k, u in enumerate(np.asarray(users).tolist()):
            items, values = self.rated(u)
            if len(items):
                out[k] = solve_user(self.y, yty, items, values, cfg.alpha, cfg.reg)
        return out

    @property
    def model_bytes(self) -> int:
        return 4 * self.train.n_items * self.config.dim

    def run_round(self) -> RoundStats:
        cfg, t = self.config, self.round
        t0 = time.perf_counter()
        m = cfg.clients_in_round(len(self._clients))
        sampled = np.sort(self.rng.choice(self._clients, size=m, replace=False))
        for u in sampled:
            self.transport.send(SERVER, client(u), t, "model", None, self.model_bytes)
        x = self.solve(sampled)
        keep = self.transport.transcript.keep_payloads
        secagg_s = 0.0
        if cfg.secure_aggregation == "none":
            total, cost = np.zeros_like(self.y), 0.0
            for k, u in enumerate(sampled.tolist()):
                items, values = self.rated(u)
                grad, c = client_gradient(self.y, x[k], items, values, cfg.alpha)
                total += grad
                cost += c
                self.transport.send(client(u), SERVER, t, "update", FCFUpdate(u, grad, c) if keep else None,
                                    self.model_bytes + 4)
            upload = float(self.model_bytes + 4)
        else:
            vectors = np.zeros((m, self.y.size + 1))
            for k, u in enumerate(sampled.tolist()):
                items, values = self.rated(u)
                grad, c = client_gradient(self.y, x[k], items, values, cfg.alpha)
                vectors[k, :-1], vectors[k, -1] = grad.reshape(-1), c
            res = secure_sum(vectors, protocol=cfg.secure_aggregation, frac_bits=cfg.frac_bits,
                             value_clip=cfg.value_clip, round=t, transport=self.transport,
                             senders=[client(u) for u in sampled], where="fcf.value_clip",
                             dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt)
            secagg_s = float(np.mean(res.client_seconds))
            total, cost = res.total[:-1].reshape(self.y.shape), float(res.total[-1])
            upload = float(res.bytes_per_client)
        t_local = time.perf_counter()
        self.step(-2.0 * total + 2.0 * cfg.reg * self.y)
        self._x = None
        self.round += 1
        t_end = time.perf_counter()
        what = ("FCF item-factor gradients, each in plaintext" if cfg.secure_aggregation == "none" else
                f"the sum of FCF item-factor gradients through {cfg.secure_aggregation} (no DP noise)")
        return RoundStats(
            round=t, loss=cost / max(m * self.train.n_items, 1), clients=m,
            bytes_per_client=self.model_bytes + upload,
            seconds={"round": t_end - t0, "client": (t_local - t0) / m + secagg_s,
                     "server": max(0.0, t_end - t_local)},
            extra={"cost": cost},
            releases=(Release(NonPrivate(), who="clients", what=what, params={"clients": m}),),
        )

    def step(self, grad: np.ndarray) -> None:
        """One server step on ``dJ/dY`` (Adam with torch's defaults, or SGD)."""
        cfg = self.config
        if cfg.optimizer == "sgd":
            self.y = self.y - cfg.lr * grad
            return
        self.steps += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        self.m = b1 * self.m + (1 - b1) * grad
        self.v = b2 * self.v + (1 - b2) * grad * grad
        mhat = self.m / (1 - b1**self.steps)
        vhat = self.v / (1 - b2**self.steps)
        self.y = self.y - cfg.lr * mhat / (np.sqrt(vhat) + eps)

    def _factors(self) -> np.ndarray:
        if self._x is None:
            self._x = self.solve(np.arange(self.train.n_users))
        return self._x

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """``x_u . y_i``, each client with its factor solved against the latest ``Y``."""
        x = self._factors()[np.asarray(users)]
        return np.einsum("bd,bkd->bk", x, self.y[np.asarray(items)])

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return self._factors()[np.asarray(users)] @ self.y.T

    def public_info(self) -> dict[str, Any]:
        return {"protocol": "fcf", "n_users": self.train.n_users, "n_items": self.train.n_items,
                "clients": int(len(self._clients)), "config": asdict(self.config)}

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "y": self.y.copy(), "m": self.m.copy(), "v": self.v.copy(), "steps": self.steps,
                "rng": self.rng.bit_generator.state, "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_checkpoint_config(self.config, state, "fcf")
        self.round, self.steps = int(state["round"]), int(state["steps"])
        self.y, self.m, self.v = (np.array(state[k], np.float64, copy=True) for k in ("y", "m", "v"))
        self.rng.bit_generator.state = state["rng"]
        self._x = None


register(ProtocolSpec(
    name="fcf",
    summary="federated collaborative filtering (Ammad-ud-din et al. 2019): local ALS user factors, server-side "
            "item-factor gradient steps",
    build=lambda ctx: FCF(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport),
    section="fcf", config_cls=FCFConfig,
))
