"""FedRec (Lin, Liang, Pan and Ming 2020, "FedRec: Federated Recommendation with Explicit
Feedback"): federated rating MF in which every client also uploads item gradients for unrated
items filled with virtual ratings, to hide which items it rated.

Parties:
    * one client per user, holding its ratings, its user vector ``p_u`` (never sent) and a fixed
      set ``I'_u`` of ``round(rho |I_u|)`` items it did not rate, drawn once from the CSPRNG
      (:mod:`dp.rng`; re-drawing them every round would let the server intersect the uploads);
    * the server, holding the item matrix ``Q``.

Model: ``r_ui ~ p_u . q_i`` (factors start at ``sqrt(init_mean / dim) + N(0, init_std^2)``, as
FedMF's), predictions clipped to the rating scale.

Round ``t`` (every sampled client, one local step on the model it received):
    1. the server sends ``Q`` (kind ``"model"``, float32);
    2. the client fills each ``i`` in ``I'_u`` with a virtual rating ``r'_ui``: its own average
       rating (``filling = "average"``, the paper's user-average strategy) or, with ``"hybrid"``,
       the average for the first ``hybrid_rounds`` rounds and its own prediction ``p_u . q_i``
       (clipped) after that (the paper's hybrid filling);
    3. the client computes, at its current ``p_u``, the item gradients
       ``g_i = -(r_ui - p_u . q_i) p_u + reg q_i`` for every ``i`` in ``I_u`` (real ratings) and in
       ``I'_u`` (virtual ones), and uploads them as one list of rows sorted by item id with the
       ids in the clear (kind ``"update"``); its user vector moves on its real ratings only, by the
       mean gradient: ``p_u -= lr (mean_(i in I_u) -(r_ui - p_u . q_i) q_i + reg p_u)``;
    4. the server steps ``q_i -= lr G_i`` with ``G_i`` the mean of the round's uploaded rows for
       ``i`` (``aggregation = "mean"``, the default; the server counts the uploads of each id) or
       their sum (``"sum"``, the literal rule, which diverges on MovieLens at any learning rate that
       trains in reasonable time: a popular item sums hundreds of gradients, as FedMF's does).

Adversary and promise: an honest-but-curious server. With ``secure_aggregation = "none"`` (the
default) the server sees every upload in plaintext: the row ids are ``I_u`` and ``I'_u`` mixed and
sorted, so by their count and position it cannot tell which rows were rated (it learns
``|I_u| + |I'_u|``, hence ``|I_u|`` given the public ``rho``). The filled items are fixed across
rounds, so intersecting rounds reveals nothing more. What is *not* hidden (stated, not fixed
here): the gradient values; a server that also knows the model can test which rows are consistent
with ``r'_ui`` (with ``"average"`` every filled row of a client carries the same virtual rating,
which FedMF-style inversion can exploit), and the virtual ratings bias the model (the paper's
accuracy cost). With ``"secagg"``/``"secagg+"`` each client's dense ``[n_items x dim]`` gradient
(and its loss terms) goes through :func:`protocols.secure_sum.secure_sum`: the server learns only
the sums over the round's clients, not even the rows. Every message goes through the run's
transport, so bytes are counted.

``fedrec-rank`` is the same protocol evaluated as LightFR evaluates it: leave-one-out, each client
ranking the held-out item among the sampled candidates by its predicted rating.

Simulation: the sampled clients are computed together on flat arrays (one row per rating or filled
item), exactly what each computes alone. Client sampling is seeded simulation randomness; the
filled sets are not (they must be unpredictable to the server) and are saved in checkpoints, so a
resumed run continues exactly but two fresh runs with one seed differ in them.

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
from dp.rng import RandomSource, resolve_source, uint64s
from protocols.base import Release, RoundStats
from protocols.registry import ProtocolSpec, register_with_rank
from protocols.sampled_secure import SampledSecureConfig, check_checkpoint_config
from protocols.secure_sum import secure_sum
from protocols.transport import SERVER, InProcessTransport, client
from recmodels.data import Interactions
from recmodels.mf import mae, rmse

__all__ = ["FILLINGS", "FedRec", "FedRecConfig", "FedRecUpload", "draw_filled"]

FILLINGS = ("average", "hybrid")


@dataclass(frozen=True)
class FedRecConfig(SampledSecureConfig):
    """Hyper-parameters of FedRec.

    Attributes:
        dim: latent factors.
        lr: learning rate of the client's user step and of the server's item step.
        reg: L2 regulariser of both factor sets.
        init_mean, init_std: factors start at ``sqrt(init_mean / dim) + N(0, init_std^2)``.
        aggregation: ``"mean"`` (each item row moves by the mean of its uploaded gradients) or ``"sum"``.
        rho: filled unrated items per rated item (``round(rho |I_u|)``, at most the unrated count).
        filling: ``"average"`` or ``"hybrid"`` (module docstring).
        hybrid_rounds: rounds of average filling before ``"hybrid"`` switches to predictions.
        client_fraction, clients_per_round: the clients sampled per round.
        secure_aggregation, frac_bits, value_clip, secagg_dropout, secagg_corrupt: as FedAvg's.
    """

    dim: int = 16
    lr: float = 0.05
    reg: float = 0.01
    aggregation: str = "mean"
    init_mean: float = 3.5
    init_std: float = 0.1
    rho: float = 1.0
    filling: str = "hybrid"
    hybrid_rounds: int = 10

    def __post_init__(self) -> None:
        if type(self.dim) is not int or self.dim < 1:
            raise ValueError(f"fedrec.dim must be an int >= 1; found {self.dim!r}")
        for name in ("lr", "reg", "init_mean", "init_std", "rho"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"fedrec.{name} must be a finite number >= 0; found {v!r}")
        if not self.lr > 0:
            raise ValueError(f"fedrec.lr must be positive; found {self.lr!r}")
        if self.aggregation not in ("mean", "sum"):
            raise ValueError(f"fedrec.aggregation must be 'mean' or 'sum'; found {self.aggregation!r}")
        if self.filling not in FILLINGS:
            raise ValueError(f"fedrec.filling must be one of {FILLINGS}; found {self.filling!r}")
        if type(self.hybrid_rounds) is not int or self.hybrid_rounds < 0:
            raise ValueError(f"fedrec.hybrid_rounds must be an int >= 0; found {self.hybrid_rounds!r}")
        self.check_sampled_secure("fedrec")


@dataclass(frozen=True)
class FedRecUpload:
    """One client's plaintext upload as the server receives it: sorted item ids and their gradient rows."""

    user: int
    items: np.ndarray
    gradients: np.ndarray

    @property
    def nbytes(self) -> int:
        return 4 * len(self.items) + 4 * int(self.gradients.size)


def draw_filled(rated: np.ndarray, n_items: int, count: int, source: RandomSource) -> np.ndarray:
    """``count`` distinct items outside ``rated``, uniformly from the CSPRNG ``source`` (sorted).

    Every unrated item gets a random 64-bit key and the ``count`` smallest keys win: a uniform
    subset (ties have probability about ``n^2 / 2^64``; they are broken by item id).
    """
    unrated = np.setdiff1d(np.arange(n_items), rated)
    count = min(int(count), len(unrated))
    if count <= 0:
        return np.zeros(0, np.int64)
    keys = uint64s(len(unrated), source)
    return np.sort(unrated[np.argsort(keys, kind="stable")[:count]]).astype(np.int64)


class FedRec:
    """FedRec simulation (see the module docstring).

    Args:
        train: training ratings (explicit).
        config: hyper-parameters.
        seed: seeds initialisation and client sampling (not the filled sets).
        transport: where messages go (default: a fresh in-process transport).
        _test_source: a deterministic randomness source for the filled sets (tests only).
    """

    def __init__(self, train: Interactions, config: FedRecConfig, *, seed: int,
                 transport: InProcessTransport | None = None, _test_source: RandomSource | None = None):
        if not len(train):
            raise ValueError("fedrec needs training ratings; found none")
        self.train, self.config = train, config
        self.transport = transport or InProcessTransport()
        self.rng = np.random.default_rng(seed)
        base = math.sqrt(config.init_mean / config.dim)
        self.p = base + config.init_std * self.rng.standard_normal((train.n_users, config.dim))
        self.q = base + config.init_std * self.rng.standard_normal((train.n_items, config.dim))
        self.scale = (float(train.ratings.min()), float(train.ratings.max()))
        order = np.lexsort((train.items, train.users))
        self.ru, self.ri = train.users[order].astype(np.int64), train.items[order].astype(np.int64)
        self.rr = train.ratings[order].astype(np.float64)
        counts = np.bincount(self.ru, minlength=train.n_users)
        self._start = np.concatenate([[0], np.cumsum(counts)])
        self._clients = np.flatnonzero(counts > 0)
        self.mean = np.bincount(self.ru, weights=self.rr, minlength=train.n_users) / np.maximum(counts, 1)
        source = resolve_source(_test_source)
        filled = [draw_filled(self.ri[self._start[u]:self._start[u + 1]], train.n_items,
                              int(round(config.rho * counts[u])), source) for u in range(train.n_users)]
        self.fu = np.repeat(np.arange(train.n_users), [len(f) for f in filled]).astype(np.int64)
        self.fi = np.concatenate(filled).astype(np.int64) if filled else np.zeros(0, np.int64)
        self.round = 0
        config.check_secure_budget(len(self._clients))

    @property
    def model_bytes(self) -> int:
        return 4 * self.train.n_items * self.config.dim

    def virtual_ratings(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Each filled row's virtual rating under the configured filling at the current round."""
        cfg = self.config
        if cfg.filling == "hybrid" and self.round >= cfg.hybrid_rounds:
            return np.clip(np.einsum("nd,nd->n", self.p[users], self.q[items]), *self.scale)
        return self.mean[users]

    def run_round(self) -> RoundStats:
        cfg, t = self.config, self.round
        t0 = time.perf_counter()
        m = cfg.clients_in_round(len(self._clients))
        sampled = np.sort(self.rng.choice(self._clients, size=m, replace=False))
        for u in sampled:
            self.transport.send(SERVER, client(u), t, "model", None, self.model_bytes)
        on = np.zeros(self.train.n_users, bool)
        on[sampled] = True
        real, fill = np.flatnonzero(on[self.ru]), np.flatnonzero(on[self.fu])
        ru, ri, rr = self.ru[real], self.ri[real], self.rr[real]
        fu, fi = self.fu[fill], self.fi[fill]
        e = rr - np.einsum("nd,nd->n", self.p[ru], self.q[ri])
        ef = self.virtual_ratings(fu, fi) - np.einsum("nd,nd->n", self.p[fu], self.q[fi])
        users = np.concatenate([ru, fu])
        items = np.concatenate([ri, fi])
        grads = -np.concatenate([e, ef])[:, None] * self.p[users] + cfg.reg * self.q[items]
        slot = np.searchsorted(sampled, ru)
        n_real = np.bincount(slot, minlength=m).astype(np.float64)
        gp = np.zeros((m, cfg.dim))
        np.add.at(gp, slot, -e[:, None] * self.q[ri])
        gp = gp / np.maximum(n_real, 1.0)[:, None] + cfg.reg * self.p[sampled]
        sse = np.bincount(slot, weights=e * e, minlength=m)
        secagg_s = 0.0
        if cfg.secure_aggregation == "none":
            total = np.zeros_like(self.q)
            np.add.at(total, items, grads)
            uploads = np.bincount(items, minlength=self.train.n_items).astype(np.float64)
            self._send_uploads(t, sampled, users, items, grads)
            loss_sum, loss_n = float(sse.sum()), float(n_real.sum())
            upload = float(sum(4 * (1 + cfg.dim) * k for k in np.bincount(np.searchsorted(sampled, users),
                                                                            minlength=m))) / m
        else:
            width = self.q.size + self.train.n_items + 2  # gradients, upload counts per item, loss terms
            vectors = np.zeros((m, width))
            flat = np.searchsorted(sampled, users) * width
            cols = items[:, None] * cfg.dim + np.arange(cfg.dim)[None, :]
            np.add.at(vectors.reshape(-1), (flat[:, None] + cols).reshape(-1), grads.reshape(-1))
            np.add.at(vectors.reshape(-1), flat + self.q.size + items, 1.0)
            vectors[:, -2], vectors[:, -1] = sse, n_real
            res = secure_sum(vectors, protocol=cfg.secure_aggregation, frac_bits=cfg.frac_bits,
                             value_clip=cfg.value_clip, round=t, transport=self.transport,
                             senders=[client(u) for u in sampled], where="fedrec.value_clip",
                             dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt)
            secagg_s = float(np.mean(res.client_seconds))
            total = res.total[:self.q.size].reshape(self.q.shape)
            uploads = np.round(res.total[self.q.size:-2])
            loss_sum, loss_n = float(res.total[-2]), float(round(res.total[-1]))
            upload = float(res.bytes_per_client)
        t_local = time.perf_counter()
        self.p[sampled] -= cfg.lr * gp  # on the clients
        if cfg.aggregation == "mean":
            total = total / np.maximum(uploads, 1.0)[:, None]
        self.q -= cfg.lr * total
        self.round += 1
        t_end = time.perf_counter()
        what = ("FedRec item gradients of rated and filled items, each in plaintext with their ids"
                if cfg.secure_aggregation == "none" else
                f"the sum of FedRec item gradients through {cfg.secure_aggregation} (no DP noise)")
        return RoundStats(
            round=t, loss=loss_sum / max(loss_n, 1.0), clients=m, bytes_per_client=self.model_bytes + upload,
            seconds={"round": t_end - t0, "client": (t_local - t0) / m + secagg_s, "server": t_end - t_local},
            extra={"filled_rows": int(len(fi)), "rated_rows": int(len(ri))},
            releases=(Release(NonPrivate(), who="clients", what=what, params={"clients": m}),),
        )

    def _send_uploads(self, t: int, sampled: np.ndarray, users: np.ndarray, items: np.ndarray,
                      grads: np.ndarray) -> None:
        keep = self.transport.transcript.keep_payloads
        order = np.lexsort((items, users))  # per client, rated and filled rows mixed in item order
        users, items, grads = users[order], items[order], grads[order]
        bounds = np.searchsorted(users, np.append(sampled, self.train.n_users))
        for c, u in enumerate(sampled.tolist()):
            lo, hi = bounds[c], bounds[c + 1]
            up = FedRecUpload(u, items[lo:hi].copy(), grads[lo:hi].astype(np.float32))
            self.transport.send(client(u), SERVER, t, "update", up if keep else None, up.nbytes)

    def filled(self, u: int) -> np.ndarray:
        """Client ``u``'s filled items (its private state)."""
        return self.fi[self.fu == u]

    def predict(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return np.clip(np.einsum("nd,nd->n", self.p[np.asarray(users)], self.q[np.asarray(items)]), *self.scale)

    def evaluate(self, test: Interactions) -> dict[str, float]:
        """RMSE and MAE of the clipped predictions on held-out ratings (each client predicts its own)."""
        pred = self.predict(test.users, test.items)
        return {"rmse": rmse(pred, test.ratings), "mae": mae(pred, test.ratings)}

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return np.einsum("bd,bkd->bk", self.p[np.asarray(users)], self.q[np.asarray(items)])

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return self.p[np.asarray(users)] @ self.q.T

    def public_info(self) -> dict[str, Any]:
        return {"protocol": "fedrec", "n_users": self.train.n_users, "n_items": self.train.n_items,
                "clients": int(len(self._clients)), "config": asdict(self.config)}

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "p": self.p.copy(), "q": self.q.copy(), "fu": self.fu.copy(),
                "fi": self.fi.copy(), "rng": self.rng.bit_generator.state, "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_checkpoint_config(self.config, state, "fedrec")
        self.round = int(state["round"])
        self.p, self.q = np.array(state["p"], np.float64, copy=True), np.array(state["q"], np.float64, copy=True)
        self.fu, self.fi = np.array(state["fu"], np.int64, copy=True), np.array(state["fi"], np.int64, copy=True)
        self.rng.bit_generator.state = state["rng"]


register_with_rank(ProtocolSpec(
    name="fedrec",
    summary="FedRec (Lin et al. 2020): federated rating MF; clients also upload gradients of sampled unrated items "
            "filled with virtual ratings",
    build=lambda ctx: FedRec(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport),
    section="fedrec", config_cls=FedRecConfig, task="rating", keeps_ratings=True,
), "FedRec trained on explicit ratings, ranked by predicted rating (leave-one-out, LightFR's protocol)")
