"""FedFast (Muhammad et al., KDD 2020): active sampling and active aggregation over FedAvg-GMF.

Parties:
    * one client per user, holding its interactions and its user embedding ``p_u``;
    * the server, holding the item table ``Q``, the output layer ``h`` and the bias ``b``, the
      cluster partition and (plaintext only) a mirror of every user embedding, as in the paper.

Round ``t`` (notes 2.3-2.5; local training is :class:`protocols.fedavg.FedAvgGMF`'s, lazy
optimiser and no weight decay, so a client changes exactly the item rows in its batches, A3):
    1. **ActvSAMP** (``sampling = "active"``): clients are drawn round-robin across the ``clusters``
       k-means clusters, one uniformly random not-yet-drawn client per non-exhausted cluster, clusters
       in a random order, until ``m`` are drawn (notes A1); ``without_replacement`` prefers the
       clients drawn least often so far (A16). ``"uniform"``: FedAvg's uniform draw.
    2. the sampled ("delegate") clients train locally and upload;
    3. **ActvAGG** (``aggregation = "actvagg"``): every item component moves by
       ``sum_k q^k * delta^k / sum_k q^k`` with ``q^k = |delta^k|`` per component (``item_weighting =
       "component"``, as written) or the L1 norm of the client's row change (``"row"``, A4);
       components nobody changed keep their value. The delegates keep their own new ``p_u``; all
       users are re-clustered (``kmeans_iters`` warm-started Lloyd steps on the user embeddings, A9);
       then every subordinate user moves by ``gamma_t`` times the mean ``p_u`` change of the delegates
       of its new cluster, ``gamma_t = exp(-gamma_rate * t)`` (A10; a cluster without delegates is
       skipped). ``h`` and ``b`` are FedAvg-averaged (``n_k`` weights). ``"fedavg"``: FedAvg's
       rule (``item_aggregation``, ``"mean"`` = the paper's Eq. 1) and the delegate keeps its new
       ``p_u`` (``user_update = "copy"``) or gets Eq. 1's diluted ``p_u + n_k/n_sigma * delta``
       (``"average"``, the paper's literal baseline, A6).

The initial partition (round 0) is k-means on profile statistics (A8): ``log(1 + n_k)`` and the mean
and standard deviation of ``log(1 + popularity)`` over the client's items, standardised
(``initial_features = "profile"``), or a random partition (``"random"``). k-means starts from a
random partition (seeded simulation choice); an empty cluster keeps its previous centroid.

Adversary and promise. ``secure_aggregation = "none"``: none beyond data locality. The
honest-but-curious server sees every delegate's plaintext update, hence the set ``I_k`` of items it
trained on (its positives and sampled negatives) with the magnitudes ``|delta|`` (which rank the
positives first: :mod:`attacks.fedfast`), its user embedding, every user's cluster and profile
statistics. ``"secagg"``/``"secagg+"``: every quantity ActvAGG needs is a ratio of linear sums
(notes A7), so the item rule (numerators and denominators), the output layer, the per-cluster
delegate changes and counts, the k-means per-cluster sums and counts, the item popularity and the
feature standardisation all go through :func:`protocols.secure_sum.secure_sum`. The server never
sees an embedding, a profile statistic or a single client's update: it publishes centroids, each
client assigns itself, and the server learns only sums. It still learns (stated limits, tested):
the per-component denominators ``sum_k |delta^k|`` (which components *someone* in the round changed,
and by how much in total), the per-cluster counts (cluster sizes, and how many delegates each
cluster had), the centroids, the per-cluster mean delegate change and the item popularity vector.
Clients learn their own cluster. The k-means sums run over *all* clients every round (every client
must be online for them, like the paper's server-side clustering over all users).

On separate devices: the round is named exchanges (:mod:`protocols.exchange`; :meth:`FedFastGMF.device_round`
and :meth:`FedFastGMF.device_step`), the same code path as in process. Round 0's popularity comes from
the clients (plaintext: their positive item ids; secure: a secure sum of their indicators); the
plaintext server with clusters sends each delegate its ``p_u`` from the mirror and takes the new one
back; secure clients report their cluster after each clustering (ActvSAMP draws from the clusters),
and move or dilute their own ``p_u``. docs/fedfast.md, "On separate devices", lists the exchanges.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from dp.events import NonPrivate
from protocols.base import Release, RoundStats
from protocols.exchange import Exchange, Replies, SecureSum, answer_in_process, run_exchanges
from protocols.fedavg import ClientUpdate, FedAvgConfig, FedAvgGMF, LocalRound
from protocols.guard import RefusedStep
from protocols.registry import Exchanges, ProtocolSpec, register
from protocols.transport import SERVER, InProcessTransport, client
from recmodels.data import Interactions
from recmodels.models import gmf_logits
from recmodels.streams import integers, stream_keys
from secagg.encoding import check_budget

__all__ = [
    "FedFastConfig",
    "FedFastGMF",
    "FedFastUpload",
    "actvagg_sums",
    "actvagg_weights",
    "assign_clusters",
    "cluster_sums",
    "propagate_to_subordinates",
    "round_robin_sample",
    "update_centroids",
]

_SAMPLING = ("active", "uniform")
_AGG = ("actvagg", "fedavg")
_WEIGHTING = ("component", "row")
_USER_UPDATE = ("copy", "average")
_FEATURES = ("profile", "random")
#: the k-means points a client uses (``feature`` of a k-means or assign exchange)
_PROFILE, _USER = 0, 1
#: the purpose of the clients' keyed stream for their start cluster (recmodels.streams)
_STREAM_START = 21


@dataclass(frozen=True)
class FedFastConfig(FedAvgConfig):
    """Hyper-parameters of FedFast: FedAvg-GMF's (``[fedfast]`` keys of the same names) plus these.

    Attributes:
        clusters: ``p``, the number of k-means clusters (paper default 20).
        sampling: ``"active"`` (ActvSAMP) or ``"uniform"`` (FedAvg).
        aggregation: ``"actvagg"`` (ActvAGG) or ``"fedavg"`` (``item_aggregation``'s rule).
        item_weighting: ActvAGG's weights, ``"component"`` (as written) or ``"row"`` (notes A4).
        gamma_rate: subordinate discount ``gamma_t = exp(-gamma_rate * t)`` (paper: 1); 0 keeps
            ``gamma = 1``.
        propagate: move subordinates by their cluster's mean delegate change (ActvAGG only).
        user_update: FedAvg aggregation only: ``"copy"`` the delegate's new ``p_u`` or Eq. 1's
            ``"average"`` (notes A6).
        kmeans_iters: Lloyd iterations per round on the user embeddings (warm-started). With
            secure aggregation at most 1: a client answers each secure step once per round
            (docs/security.md), and successive Lloyd steps over the same points would hand the
            server the points that switched cluster.
        kmeans_init_iters: Lloyd iterations on the initial features at round 0 (at most: they stop
            once the centroids stop changing); ``-1`` (default): 10 in plaintext, 1 with secure
            aggregation (:attr:`init_iters`). With secure aggregation at most 1: the profile
            statistics never change, so a client sums them once per protocol instance.
        min_cluster: a k-means cluster or a cluster's delegates with fewer members are never
            summed (their centroid keeps its value; their subordinates do not move), so no
            released sum or published centroid is one client's point or change (2: a block of two
            reveals each member's point to the other member, not to the server alone).
        kmeans_every: re-cluster in rounds ``t`` with ``t % kmeans_every == 0`` only (1: every round,
            as in the paper; larger values cut the secure variant's all-client sums).
        initial_features: ``"profile"`` statistics or a ``"random"`` partition (notes A8).
        without_replacement: ActvSAMP prefers clients drawn least often so far (notes A16).
    """

    dim: int = 10
    clients_per_round: int = 40
    item_aggregation: str = "mean"
    frac_bits: int = 32
    value_clip: float = 1048576.0
    clusters: int = 20
    sampling: str = "active"
    aggregation: str = "actvagg"
    item_weighting: str = "component"
    gamma_rate: float = 1.0
    propagate: bool = True
    user_update: str = "copy"
    kmeans_iters: int = 1
    kmeans_init_iters: int = -1
    kmeans_every: int = 1
    initial_features: str = "profile"
    without_replacement: bool = False
    min_cluster: int = 2

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as exc:  # name this section's keys, not FedAvg's
            raise ValueError(str(exc).replace("fedavg.", "fedfast.")) from None
        for key, allowed in (("sampling", _SAMPLING), ("aggregation", _AGG), ("item_weighting", _WEIGHTING),
                             ("user_update", _USER_UPDATE), ("initial_features", _FEATURES)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"fedfast.{key} must be one of {allowed}; found {getattr(self, key)!r}")
        if self.clusters < 1:
            raise ValueError(f"fedfast.clusters must be >= 1; found {self.clusters}")
        if type(self.kmeans_every) is not int or self.kmeans_every < 1:
            raise ValueError(f"fedfast.kmeans_every must be an int >= 1; found {self.kmeans_every!r}")
        if self.kmeans_iters < 0 or self.kmeans_init_iters < -1:
            raise ValueError(
                f"fedfast.kmeans_iters must be >= 0 and fedfast.kmeans_init_iters >= 0 (or -1: the default); found "
                f"{self.kmeans_iters}, {self.kmeans_init_iters}")
        if not (self.gamma_rate >= 0 and math.isfinite(self.gamma_rate)):
            raise ValueError(f"fedfast.gamma_rate must be a finite number >= 0; found {self.gamma_rate}")
        if type(self.min_cluster) is not int or self.min_cluster < 1:
            raise ValueError(f"fedfast.min_cluster must be an int >= 1; found {self.min_cluster!r}")
        if self.secure_aggregation != "none":
            if self.min_cluster < 2:
                raise ValueError("fedfast.min_cluster must be >= 2 with secure aggregation: a cluster of one "
                                 f"client's sum is its point; found {self.min_cluster}")
            for key in ("kmeans_iters", "kmeans_init_iters"):
                if getattr(self, key) > 1:
                    raise ValueError(
                        f"fedfast.{key} = {getattr(self, key)} with secure aggregation: set it to 1 (or 0). A client "
                        "answers each secure step once per round, and successive Lloyd steps over the same points "
                        "would hand the server every point that switched cluster (docs/fedfast.md)")

    @property
    def init_iters(self) -> int:
        """The Lloyd steps at round 0: ``kmeans_init_iters``, or by default 10 in plaintext (the
        paper's setting) and 1 with secure aggregation."""
        if self.kmeans_init_iters >= 0:
            return self.kmeans_init_iters
        return 10 if self.secure_aggregation == "none" else 1

    @property
    def clustered(self) -> bool:
        """Whether the run needs clusters (ActvSAMP draws from them, ActvAGG propagates in them)."""
        return self.sampling == "active" or (self.aggregation == "actvagg" and self.propagate)


# -- pure pieces (tested against per-client loops) -------------------------------------------------
def assign_clusters(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid (squared Euclidean; ties to the lowest index; NaN rows never win)."""
    d = ((x[:, None, :] - centroids[None, :, :]) ** 2).sum(-1)
    d[:, np.isnan(centroids).any(1)] = np.inf
    return np.argmin(d, axis=1).astype(np.int64)


def cluster_sums(x: np.ndarray, assign: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sums ``[p, F]`` and counts ``[p]`` of the rows of ``x``."""
    sums = np.zeros((p, x.shape[1]))
    np.add.at(sums, assign, x)
    return sums, np.bincount(assign, minlength=p).astype(np.float64)


def update_centroids(sums: np.ndarray, counts: np.ndarray, prev: np.ndarray | None,
                     min_count: int = 1) -> np.ndarray:
    """Means of clusters with at least ``min_count`` members (and at least one); any other keeps
    ``prev``'s row (NaN if none in this space)."""
    keep = prev if prev is not None and prev.shape == sums.shape else np.full(sums.shape, np.nan)
    live = counts > max(min_count, 1) - 0.5
    out = keep.copy()
    out[live] = sums[live] / counts[live, None]
    return out


def round_robin_sample(assign: np.ndarray, m: int, rng: np.random.Generator,
                       load: np.ndarray | None = None) -> np.ndarray:
    """ActvSAMP (notes A1): indices into ``assign`` of ``m`` clients drawn round-robin over clusters.

    Clusters are visited in a random order; each visit draws one not-yet-drawn member uniformly
    (or, given ``load``, a least-loaded one, random among ties) until ``m`` are drawn, so every
    cluster gets ``floor(m/p)`` or ``ceil(m/p)`` when it is large enough. Clients without a cluster
    (``-1``: none reported, e.g. every client refused the step that assigns them) are drawn as one
    more cluster. Returned sorted.
    """
    n = len(assign)
    assign = np.asarray(assign, np.int64)
    if n and (assign < 0).any():
        assign = np.where(assign < 0, int(assign.max()) + 1 if (assign >= 0).any() else 0, assign)
    p = int(assign.max()) + 1 if n else 0
    cluster_rank = rng.permutation(p)
    shuffle = rng.permutation(n)
    # members grouped by cluster, least-loaded first when asked, random order otherwise (lexsort is stable)
    keys = (assign[shuffle],) if load is None else (load[shuffle], assign[shuffle])
    order = shuffle[np.lexsort(keys)]
    start = np.searchsorted(assign[order], np.arange(p))
    within = np.empty(n, np.int64)
    within[order] = np.arange(n) - start[assign[order]]
    pick = np.lexsort((cluster_rank[assign], within))[:m]
    return np.sort(pick)


def actvagg_weights(dq: torch.Tensor, weighting: str = "component") -> torch.Tensor:
    """``q^k`` of each row of changes: ``|delta|`` per component, or the row's L1 norm (notes A4)."""
    return dq.abs() if weighting == "component" else dq.abs().sum(1, keepdim=True).expand_as(dq)


def actvagg_sums(pair_item: np.ndarray | torch.Tensor, dq: torch.Tensor, n_items: int,
                 weighting: str = "component") -> tuple[torch.Tensor, torch.Tensor]:
    """ActvAGG's item numerator ``sum_k q^k * delta^k`` and denominator ``sum_k q^k``.

    ``dq[r]`` is one client's change of item ``pair_item[r]`` (one row per client and touched item).
    """
    q = actvagg_weights(dq, weighting)
    idx = torch.as_tensor(pair_item)
    num = torch.zeros(n_items, dq.shape[1], dtype=dq.dtype).index_add_(0, idx, q * dq)
    den = torch.zeros(n_items, dq.shape[1], dtype=dq.dtype).index_add_(0, idx, q)
    return num, den


def propagate_to_subordinates(user: torch.Tensor, assign: np.ndarray, delegates: np.ndarray,
                              delta_sum: np.ndarray, delta_count: np.ndarray, gamma: float,
                              min_count: int = 1) -> torch.Tensor:
    """New user table: every non-delegate moves by ``gamma`` x its cluster's mean delegate change.

    ``assign[u]`` is user ``u``'s cluster (-1: not a client), ``delta_sum[c]``/``delta_count[c]``
    the sum and number of delegate changes in cluster ``c``; a cluster with fewer than
    ``min_count`` delegates (or none) is skipped.
    """
    mean = np.zeros_like(delta_sum)
    live = delta_count > max(min_count, 1) - 0.5
    mean[live] = delta_sum[live] / delta_count[live, None]
    sub = np.ones(len(assign), bool)
    sub[delegates] = False
    sub &= assign >= 0
    out = user.clone()
    rows = np.flatnonzero(sub)
    out[torch.as_tensor(rows)] += gamma * torch.as_tensor(mean[assign[rows]], dtype=user.dtype)
    return out


def _check_done(u: int, r: dict) -> bool:
    if r["done"].shape != () or r["done"].dtype != np.bool_ or not bool(r["done"]):
        raise ValueError(f"done must be one bool True; found {r['done']!r}")
    return True


def check_devices(config: FedFastConfig) -> None:
    """Every FedFast configuration separates onto devices (docs/fedfast.md, "On separate devices"):
    this only checks that ``config`` is a :class:`FedFastConfig`."""
    if not isinstance(config, FedFastConfig):
        raise ValueError(f"fedfast on devices needs a FedFastConfig; found {type(config).__name__}")


def _one_hot_blocks(values: np.ndarray, assign: np.ndarray, p: int) -> np.ndarray:
    """Each row ``[x, 1]`` placed in block ``assign[i]`` of a ``p * (F + 1)`` vector (zeros elsewhere)."""
    n, f = values.shape
    out = np.zeros((n, p, f + 1))
    out[np.arange(n), assign, :f] = values
    out[np.arange(n), assign, f] = 1.0
    return out.reshape(n, p * (f + 1))


@dataclass(frozen=True)
class FedFastUpload(ClientUpdate):
    """A plaintext FedFast upload: FedAvg's, plus the delegate's new user embedding when the server
    clusters on it (``None`` otherwise)."""

    user_embedding: np.ndarray | None = None


class FedFastGMF(FedAvgGMF):
    """FedFast over GMF (see the module docstring); FedAvgGMF's local training, batched.

    The round is a sequence of named exchanges (:mod:`protocols.exchange`): :meth:`device_round`
    is the server's half, :meth:`device_step` the clients' (every client at once in process, one
    client on a device); :meth:`run_round` drives the two in one process.
    """

    upload_cls = FedFastUpload

    def __init__(self, train: Interactions, config: FedFastConfig, *, seed: int,
                 transport: InProcessTransport | None = None, exclude: Interactions | None = None):
        super().__init__(train, config, seed=seed, transport=transport, exclude=exclude)
        n = train.n_users
        self.assign = np.full(n, -1, np.int64)  # -1: no cluster yet / not a client
        self.centroids = np.zeros((0, 0))
        self.load = np.zeros(n, np.int64)  # times each client was drawn
        self.kmeans_steps = 0  # Lloyd steps of the last clustering call
        # The clients' state between the exchanges of a round (:meth:`device_state`).
        self._before = self.user.clone()  # p_u before the client's last local training
        self._trained = np.full(n, -1, np.int64)  # the last round the client trained in
        self._weight = np.zeros(n, np.float32)  # its n_k in that round
        self._profile = np.zeros((n, 3))  # its raw profile statistics (round 0)
        #: the last round's clients left out of an exchange: ``(kind, user, reason)``
        self.dropped: list[tuple[str, int, str]] = []
        #: the last round's clusters below ``min_cluster`` (never summed), per kind of sum (plaintext:
        #: the delegate groups whose change did not propagate)
        self.suppressed: dict[str, int] = {}
        if config.secure_aggregation != "none" and config.clustered:  # k-means sums run over all clients
            check_budget(n_summands=len(self._clients), clip=config.value_clip, frac_bits=config.frac_bits)

    @classmethod
    def on_device(cls, train: Interactions, config: FedFastConfig, *, seed: int,
                  transport: InProcessTransport | None = None, exclude: Interactions | None = None) -> FedFastGMF:
        """One client's half on its own device (``train`` holds only its rows).

        Built like the in-process trainer (same seed, so the same initial ``p_u`` and item table),
        without the server's checks of the secure-aggregation budget and of SecAgg+'s cohort size
        (a client alone is a cohort of one; the server half checks them).
        """
        users = np.unique(train.users)
        if len(users) != 1:
            raise ValueError(f"FedFastGMF.on_device builds one client's half; its data holds {len(users)} users")
        self = cls(train, replace(config, secure_aggregation="none"), seed=seed, transport=transport, exclude=exclude)
        self.config = config
        return self

    @property
    def _secure(self) -> bool:
        return self.config.secure_aggregation != "none"

    @property
    def _mirror(self) -> bool:
        """Plaintext with clusters: the server holds every ``p_u`` (the paper's server, notes A5)."""
        return not self._secure and self.config.clustered

    def _spec(self, width: int, kind: str) -> SecureSum:
        cfg = self.config
        return SecureSum(cfg.secure_aggregation, width=width, frac_bits=cfg.frac_bits, value_clip=cfg.value_clip,
                         where="fedfast.value_clip", kind=kind, dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt)

    def _broadcast(self, t: int, kind: str, nbytes: int) -> float:
        """Secure variant: the server sends ``nbytes`` to every client (plaintext needs no message)."""
        if not self._secure:
            return 0.0
        self._send_all(t, kind, nbytes, self._clients)
        return float(nbytes)

    def _note(self, kind: str, got: Replies) -> Replies:
        """Remember who ``got`` left out (for the stats and the tests)."""
        self.dropped.extend((kind, int(u), why) for u, why in got.dropped.items())
        return got

    def _send_all(self, t: int, kind: str, nbytes: int, users) -> None:
        for u in users:
            self.transport.send(SERVER, client(int(u)), t, kind, None, nbytes)

    def _receive(self, t: int, kind: str, values: dict, nbytes, payload=None) -> None:
        """Record the plaintext replies ``values`` (``nbytes(reply)`` each) as received by the server."""
        keep = self.transport.transcript.keep_payloads
        for u, r in values.items():
            self.transport.send(client(int(u)), SERVER, t, kind, payload(r) if keep and payload else None, nbytes(r))

    @property
    def _update_width(self) -> int:
        """The secure update: the sums of the item rule and the output layer, and the loss."""
        n_items, d = self.train.n_items, self.config.dim
        if self.config.aggregation == "actvagg":
            return 2 * n_items * d + d + 3
        return n_items * d + (n_items if self.config.item_aggregation == "touched" else 0) + d + 3

    # -- the statistics a client computes ----------------------------------------------------------------
    def _profile_of(self, users: np.ndarray, pop: np.ndarray) -> np.ndarray:
        """Raw ``[log(1+n_k), mean, std of log(1+popularity)]`` of ``users`` from their own positives
        and the published popularity (notes A8); per client, so batched equals alone."""
        counts = (self._pos_start[users + 1] - self._pos_start[users]).astype(np.float64)
        pos_items = np.concatenate([self._pos_items[self._pos_start[u]: self._pos_start[u + 1]] for u in users])
        slot = np.repeat(np.arange(len(users)), counts.astype(np.int64))
        lp = np.log1p(pop[pos_items])
        mean = np.bincount(slot, lp, len(users)) / counts
        std = np.sqrt(np.maximum(np.bincount(slot, lp**2, len(users)) / counts - mean**2, 0.0))
        return np.stack([np.log1p(counts), mean, std], 1)

    def _profile_features(self, t: int) -> np.ndarray:
        """Every client's raw profile statistics computed centrally (the oracle the tests use; the
        round gets them from the clients)."""
        cl = self._clients
        pos = np.concatenate([self._pos_items[self._pos_start[u]: self._pos_start[u + 1]] for u in cl])
        return self._profile_of(cl, np.bincount(pos, minlength=self.train.n_items).astype(np.float64))

    # -- clustering at the server (plaintext: it holds the points) ------------------------------------
    def _lloyd(self, x: np.ndarray, assign: np.ndarray, iters: int, t: int, users: np.ndarray) -> np.ndarray:
        """Up to ``iters`` Lloyd steps from ``assign`` over the rows ``x`` of ``users``, at the
        plaintext server. Stops early once a step leaves the centroids unchanged (bit for bit):
        the assignment is then a fixed point, so every further step would repeat it, and the result
        equals the one of all ``iters`` steps. A cluster below ``min_cluster`` members keeps its
        centroid (as the secure variant never sums it)."""
        p = self.config.clusters
        self.kmeans_steps = 0
        for _ in range(iters):
            sums = _one_hot_blocks(x, assign, p).sum(0).reshape(p, x.shape[1] + 1)
            prev = self.centroids
            self._count_small("fedfast:kmeans", sums[:, -1])
            self.centroids = update_centroids(sums[:, :-1], np.rint(sums[:, -1]), prev, self.config.min_cluster)
            assign = assign_clusters(x, self.centroids)
            self.kmeans_steps += 1
            if prev.shape == self.centroids.shape and np.array_equal(prev, self.centroids, equal_nan=True):
                break
        self.assign[users] = assign
        return assign

    def _first_centroids(self, sums: np.ndarray, f: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Round 0's first centroids (standardised) and the moments ``mu``, ``sd`` from the
        per-cluster sums ``[p, 2f + 1]`` of ``[x, x^2, 1]`` over each start cluster's members
        (clusters below ``min_cluster`` are zero rows: never summed, left out of the moments too)."""
        cfg = self.config
        counts = np.rint(sums[:, 2 * f])
        live = counts > max(cfg.min_cluster, 1) - 0.5
        n = float(counts[live].sum())
        if n < 1:  # every start cluster was below the minimum: no centroid yet
            return np.full((cfg.clusters, f), np.nan), np.zeros(f), np.ones(f)
        mu = sums[live, :f].sum(0) / n
        sd = np.sqrt(np.maximum(sums[live, f: 2 * f].sum(0) / n - mu**2, 0.0))
        sd = np.where(sd > 1e-12, sd, 1.0)
        cent = update_centroids(sums[:, :f], counts, None, cfg.min_cluster)
        return (cent - mu) / sd, mu, sd

    def _start_clusters(self, users: np.ndarray) -> np.ndarray:
        """Each client's start cluster, drawn by the client itself from its own keyed stream (a
        seeded simulation choice: reproducible, the same alone or batched, never chosen by the
        server)."""
        users = np.asarray(users, np.int64)
        return integers(stream_keys(self.seed, _STREAM_START, users), np.zeros(len(users), np.uint64),
                        self.config.clusters).astype(np.int64)

    def _initial_clusters(self, t: int) -> float:
        """Round 0's partition in one process (the exchanges of :meth:`_initial_exchanges`, answered
        by this trainer's own clients); returns the clustering bytes per client."""
        gen = self._initial_exchanges(t)
        try:
            ex = next(gen)
            while True:
                ex = gen.send(answer_in_process(self, ex, self.device_step, t))
        except StopIteration as stop:
            return float(stop.value)

    def _initial_exchanges(self, t: int):
        """Round 0's partition: k-means on the standardised profile statistics (A8), a generator of
        exchanges returning the clustering bytes per client.

        Every client draws its own start cluster (:meth:`_start_clusters`). The first Lloyd step and
        the standardisation moments share one sum per start cluster: each client sums
        ``[x, x^2, 1]`` of its raw statistics ``x`` with its cluster's members; the mean of
        standardised rows is the standardised mean, so the first centroids follow from the raw
        per-cluster sums, and the moments are the sum of the clusters' (clusters below
        ``min_cluster`` are left out of both).
        """
        cfg, cl = self.config, self._clients
        self.kmeans_steps = 0
        if self._secure:
            return (yield from self._secure_initial(t))
        self.assign[cl] = self._start_clusters(cl)
        if cfg.initial_features == "random" or cfg.init_iters == 0:
            return 0.0
        return (yield from self._plain_initial(t))

    def _plain_initial(self, t: int):
        """Plaintext round 0: the clients send their positive items (the popularity is their sum), get
        the popularity back and send their statistics; the server runs k-means on them."""
        cfg, cl, n_items = self.config, self._clients, self.train.n_items
        got = self._note("fedfast:popularity", (yield Exchange("fedfast:popularity", cl, reply_keys=frozenset({"items"}),
                                                                   validate=self._check_items)))
        self._receive(t, "fedfast:popularity", {u: r["items"] for u, r in got.values.items()},
                      lambda r: 4 * len(r), payload=lambda r: r.copy())
        items = [r["items"] for r in got.values.values()]
        pop = np.bincount(np.concatenate(items) if items else np.zeros(0, np.int64), minlength=n_items)
        pop = pop.astype(np.float64)
        self._send_all(t, "fedfast:popularity", 4 * n_items, cl)
        got = self._note("fedfast:profile", (yield Exchange(
            "fedfast:profile", cl, broadcast={"popularity": pop}, reply_keys=frozenset({"profile"}),
            validate=self._check_profile)))
        self._receive(t, "fedfast:profile", got.values, lambda r: 12, payload=lambda r: r.copy())
        users = np.asarray(list(got.values), np.int64)
        if not len(users):
            return 0.0
        x = np.stack([got.values[u] for u in users.tolist()])
        f, p = x.shape[1], cfg.clusters
        start = self.assign[users]
        sums = np.zeros((p, 2 * f + 1))
        np.add.at(sums, start, np.concatenate([x, x**2, np.ones((len(users), 1))], 1))
        self._count_small("fedfast:kmeans-profile", sums[:, -1])
        self.centroids, mu, sd = self._first_centroids(sums, f)
        x = (x - mu) / sd
        assign = assign_clusters(x, self.centroids)
        steps = 1
        if cfg.init_iters > 1:
            assign = self._lloyd(x, assign, cfg.init_iters - 1, t, users)
            steps += self.kmeans_steps
        self.assign[users] = assign
        self.kmeans_steps = steps
        return 0.0

    def _secure_initial(self, t: int):
        """Secure round 0: every client draws its start cluster and reports it; then the popularity
        (one secure sum over every client), the first Lloyd step with the moments (one secure sum
        per start cluster), and each client assigns itself by the first centroids and reports its
        cluster (ActvSAMP draws from the clusters). One Lloyd step: the profile statistics never
        change, so a client sums them once per protocol instance."""
        cfg, cl, n_items, f = self.config, self._clients, self.train.n_items, 3
        profile = not (cfg.initial_features == "random" or cfg.init_iters == 0)
        start: dict[str, np.ndarray] = {}
        nbytes = 4.0
        if profile:
            got = self._note("fedfast:popularity", (yield Exchange("fedfast:popularity", cl,
                                                                   secure=self._spec(n_items, "fedfast:popularity"))))
            if got.total is None:
                raise RuntimeError(f"fedfast: round 0's popularity sum failed ({got.aborted}); no partition")
            start = {"popularity": np.rint(got.total)}
            nbytes += got.bytes_per_client + self._broadcast(t, "fedfast:popularity", 4 * n_items)
        # each client draws its start cluster (and, given the popularity, computes its statistics)
        got = self._note("fedfast:start", (yield Exchange(
            "fedfast:start", cl, broadcast=start, reply_keys=frozenset({"cluster"}), validate=self._check_cluster)))
        for u, c in got.values.items():
            self.assign[u] = c
        self._receive(t, "fedfast:cluster", got.values, lambda r: 4)
        if not profile:
            return nbytes
        sums, more = yield from self._grouped_sums(t, "fedfast:kmeans-profile", {}, 2 * f + 1, cl)
        nbytes += more
        self.centroids, mu, sd = self._first_centroids(sums, f)
        nbytes += self._broadcast(t, "fedfast:centroids", 4 * self.centroids.size + 8 * 2 * f)
        self.kmeans_steps = 1
        feature = {"feature": np.array(_PROFILE, np.int64), "mu": mu, "sd": sd}
        nbytes += yield from self._assign_exchange(t, {**feature, "centroids": self.centroids})
        return nbytes

    def _count_small(self, kind: str, counts: np.ndarray) -> None:
        """Record how many non-empty clusters of a sum are below ``min_cluster`` (never summed)."""
        counts = np.rint(np.asarray(counts))
        self.suppressed[kind] = int(((counts > 0) & (counts < self.config.min_cluster)).sum())

    def _grouped_sums(self, t: int, kind: str, broadcast: dict, width: int, members: np.ndarray):
        """One secure sum per cluster over ``members`` (routed by the clusters they reported; each
        client checks that the group it is asked to join is its own), clusters below
        ``min_cluster`` members never asked. Returns ``(sums [p, width], bytes per client)``; a
        cluster that was not summed (or whose sum aborted) is a zero row."""
        cfg, p = self.config, self.config.clusters
        members = np.asarray(members, np.int64)
        groups = self.assign[members]
        counts = np.bincount(groups[groups >= 0], minlength=p)
        keep = (groups >= 0) & (counts[np.maximum(groups, 0)] >= cfg.min_cluster)
        self._count_small(kind, counts)
        users = members[keep]
        sums = np.zeros((p, width))
        if not len(users):
            return sums, 0.0
        route = {int(u): int(self.assign[u]) for u in users}
        got = self._note(kind, (yield Exchange(
            kind, users, broadcast=broadcast, per_user={u: {"group": np.array(g, np.int64)} for u, g in route.items()},
            secure=self._spec(width, kind), groups=route)))
        for g, part in got.groups.items():
            if part.total is not None:
                sums[g] = part.total
        return sums, got.bytes_per_client

    def _secure_kmeans(self, t: int):
        """One Lloyd step on the user embeddings through secure aggregation: every client sums
        ``[p_u, 1]`` with the members of the cluster it reported last (one sum per cluster); the
        server publishes the new centroids (a cluster below ``min_cluster`` keeps its own).
        Returns the bytes per client; the clients assign themselves in the exchange that follows."""
        d = self.config.dim
        sums, nbytes = yield from self._grouped_sums(t, "fedfast:kmeans", {"feature": np.array(_USER)}, d + 1,
                                                     self._clients)
        self.centroids = update_centroids(sums[:, :d], np.rint(sums[:, d]), self.centroids, self.config.min_cluster)
        self.kmeans_steps = 1
        return nbytes + self._broadcast(t, "fedfast:centroids", 4 * self.centroids.size)

    def _assign_exchange(self, t: int, broadcast: dict):
        """Every client assigns itself by the broadcast ``centroids`` and reports its cluster.
        Returns the bytes per client."""
        got = self._note("fedfast:assign", (yield Exchange(
            "fedfast:assign", self._clients, broadcast=broadcast, reply_keys=frozenset({"cluster"}),
            validate=self._check_cluster)))
        for u, c in got.values.items():
            self.assign[u] = c
        self._receive(t, "fedfast:cluster", got.values, lambda r: 4)
        return 4.0

    # -- one round -----------------------------------------------------------------------------------
    def run_round(self) -> RoundStats:
        """ActvSAMP, local training (FedAvg's), ActvAGG or FedAvg, re-clustering, propagation: the
        exchanges of :meth:`device_round`, every client played by this trainer."""
        return run_exchanges(self, self.device_step)

    def device_round(self):
        """The server's half of round ``t``: yields the exchanges, returns the round's stats.

        Never reads client data: what it needs from the clients comes back in replies (plaintext)
        or as sums (secure). A client left out of an exchange (silent, malformed reply) is left
        out of that exchange's sums; the round finishes with the others.
        """
        cfg, t = self.config, self.round
        start = time.perf_counter()
        cluster_s, cluster_bytes, steps = 0.0, 0.0, 0
        self.dropped = []
        self.suppressed = {}
        if cfg.clustered and t == 0 and self.assign[self._clients[0]] < 0:
            t0 = time.perf_counter()
            cluster_bytes += yield from self._initial_exchanges(t)
            cluster_s += time.perf_counter() - t0
            steps += self.kmeans_steps
        m = cfg.clients_in_round(len(self._clients))
        if cfg.sampling == "uniform":
            sampled = np.sort(self.rng.choice(self._clients, size=m, replace=False))
        else:
            load = self.load[self._clients] if cfg.without_replacement else None
            sampled = self._clients[round_robin_sample(self.assign[self._clients], m, self.rng, load)]
        self.load[sampled] += 1

        t_train = time.perf_counter()
        got = self._note("train", (yield self._train_exchange(t, sampled)))
        t_train = time.perf_counter() - t_train
        if self._secure:
            delegates, loss, examples, w_sum, upload_bytes = self._secure_aggregate(got)
        else:
            delegates, loss, examples, w_sum, upload_bytes, dP = self._plain_aggregate(t, got)
        if cfg.aggregation == "fedavg" and cfg.user_update == "average" and len(delegates) and not self._mirror:
            # Eq. 1 on p_u (A6) where p_u is the client's: it dilutes its own change by n_k / n_sigma
            self._send_all(t, "fedfast:dilute", 4, delegates)
            self._note("fedfast:dilute", (yield Exchange(
                "fedfast:dilute", delegates, broadcast={"n_sigma": np.array(float(w_sum), np.float32)},
                reply_keys=frozenset({"done"}), validate=_check_done)))

        reclustered = False
        if cfg.clustered and cfg.kmeans_iters and t % cfg.kmeans_every == 0:  # re-cluster on the embeddings (A9)
            t0 = time.perf_counter()
            if self._secure:
                cluster_bytes += yield from self._secure_kmeans(t)
                reclustered = True
            else:
                x = self.user[torch.as_tensor(self._clients)].numpy().astype(np.float64)
                self._lloyd(x, self.assign[self._clients], cfg.kmeans_iters, t, self._clients)
            cluster_s += time.perf_counter() - t0
            steps += self.kmeans_steps
        if reclustered and cfg.sampling == "active" or reclustered and cfg.aggregation == "actvagg" and cfg.propagate:
            # every client assigns itself by the new centroids and reports its cluster (ActvSAMP draws
            # from the clusters; the delegates' changes are summed per new cluster)
            cluster_bytes += yield from self._assign_exchange(t, {"feature": np.array(_USER),
                                                                  "centroids": self.centroids})
        if cfg.aggregation == "actvagg" and cfg.propagate:
            if self._secure:
                nbytes, more = yield from self._secure_propagate(t, delegates)
                upload_bytes += nbytes
                cluster_bytes += more
            else:
                self._plain_propagate(t, delegates, dP)

        self.round += 1
        secure = self._secure
        what = ("delegate updates in plaintext: item changes (I_k and |delta|), output layer, user embeddings, "
                "profile statistics" if not secure else
                f"sums through {cfg.secure_aggregation} (no DP noise): ActvAGG numerators/denominators, output "
                f"layer, per-cluster k-means and delegate-change sums and counts (clusters of at least "
                f"{cfg.min_cluster})")
        total = time.perf_counter() - start
        down = self.model_bytes + (4.0 * cfg.dim if self._mirror else 0.0)  # the model, and p_u from the mirror
        return RoundStats(
            round=t, loss=loss / max(examples, 1), clients=m,
            bytes_per_client=down + upload_bytes,
            # the delegates' local training (one exchange), as a mean per client; the rest is the
            # server's (aggregation, clustering), the secure-aggregation protocol's and the other exchanges'
            seconds={"round": total, "client": t_train / max(m, 1), "server": total - t_train},
            extra={"examples": examples, "cluster_seconds": cluster_s, "cluster_bytes_per_client": cluster_bytes,
                   "kmeans_steps": steps, "dropped": len(self.dropped),
                   "clusters_below_min": dict(self.suppressed),
                   "clusters_used": int(len(np.unique(self.assign[self._clients]))) if cfg.clustered else 0},
            releases=(Release(NonPrivate(), who="clients", what=what, params={"clients": m}),),
        )

    def _train_exchange(self, t: int, sampled: np.ndarray) -> Exchange:
        """The delegates get ``(Q, h, b)`` (and, from the plaintext mirror, their ``p_u``), train
        locally and send their update (plaintext) or its vector (secure)."""
        self._send_all(t, "model", self.model_bytes, sampled)
        bc = {"item": self.item.numpy().copy(), "h": self.h.numpy().copy(), "b": self.b.numpy().copy()}
        if self._secure:
            return Exchange("train", sampled, broadcast=bc, secure=self._spec(self._update_width, "update"))
        keys = {"rows", "item_delta", "h_delta", "b_delta", "weight", "loss"}
        per_user = {}
        if self._mirror:  # the paper's server holds p_u: the delegate gets it and sends the new one back
            per_user = {int(u): {"user": self.user[int(u)].numpy().copy()} for u in sampled}
            self._sent = per_user  # the rows the delegates start from (dP is taken against them)
            self._send_all(t, "fedfast:user", 4 * self.config.dim, sampled)
            keys.add("user")
        return Exchange("train", sampled, broadcast=bc, per_user=per_user, reply_keys=frozenset(keys),
                        validate=self._check_update)

    @staticmethod
    def _weight_of(got: Replies, users: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.array([got.values[int(u)]["weight"] for u in users], np.float32))

    def _plain_aggregate(self, t: int, got: Replies):
        """The plaintext server's update from the delegates' replies (ActvAGG or FedAvg's rule); the
        delegates keep their new ``p_u`` in the mirror. Returns ``(delegates, loss sum, examples,
        n_sigma, upload bytes, dP)``."""
        cfg, d, n_items = self.config, self.config.dim, self.train.n_items
        users = np.asarray(list(got.values), np.int64)
        upload = self.model_bytes + 4.0 + (4.0 * d if cfg.clustered else 0.0)
        if not len(users):
            return users, 0.0, 0, torch.tensor(0.0), upload, None
        reps = [got.values[int(u)] for u in users]
        pair_slot = np.repeat(np.arange(len(users)), [len(r["rows"]) for r in reps])
        pair_item = np.concatenate([r["rows"] for r in reps])
        dQ = torch.as_tensor(np.concatenate([r["item_delta"] for r in reps]).reshape(-1, d))
        dH = torch.as_tensor(np.stack([r["h_delta"] for r in reps]))
        dB = torch.as_tensor(np.stack([r["b_delta"] for r in reps]))
        weight = self._weight_of(got, users)
        P = torch.as_tensor(np.stack([r["user"] for r in reps])) if self._mirror else None
        loss = sum(float(r["loss"]) for r in reps)
        examples = int(sum(int(r["weight"]) for r in reps))
        self._send_updates(t, users, pair_slot, pair_item, dQ, dH, dB, weight, user=P)
        if cfg.aggregation == "fedavg":
            self._apply(*self._plain_sums(torch.as_tensor(pair_slot), torch.as_tensor(pair_item), dQ, dH, dB, weight))
        else:
            num, den = actvagg_sums(pair_item, dQ, n_items, cfg.item_weighting)
            h_num, b_num, w_sum = (dH * weight.unsqueeze(1)).sum(0), (dB * weight).sum(), weight.sum()
            self._apply_actvagg(num, den, h_num, b_num, w_sum, 0.0)
        dP = None
        if self._mirror:
            prev = torch.as_tensor(np.stack([self._sent[int(u)]["user"] for u in users]))
            dP = P - prev
            if cfg.aggregation == "fedavg" and cfg.user_update == "average":  # Eq. 1 on p_u too (A6)
                P = prev + dP * (weight / weight.sum()).unsqueeze(1)
            self.user[torch.as_tensor(users)] = P
        return users, loss, examples, weight.sum(), upload, dP

    def _secure_aggregate(self, got: Replies):
        """The server's update from the decoded sum of the delegates' vectors (nothing if it failed)."""
        cfg, d, n_items = self.config, self.config.dim, self.train.n_items
        if got.total is None:
            return np.zeros(0, np.int64), 0.0, 0, torch.tensor(0.0), got.bytes_per_client
        total, loss = got.total[:-1], float(got.total[-1])
        if cfg.aggregation == "fedavg":
            sums = self._sums_from_total(total)
            self._apply(*sums)
            w_sum = sums[-1]
        else:
            num = torch.as_tensor(total[: n_items * d].reshape(n_items, d), dtype=torch.float32)
            den = torch.as_tensor(total[n_items * d: 2 * n_items * d].reshape(n_items, d), dtype=torch.float32)
            h_num = torch.as_tensor(total[2 * n_items * d: -2], dtype=torch.float32)
            b_num, w_sum = torch.tensor(float(total[-2])), torch.tensor(float(total[-1]))
            self._apply_actvagg(num, den, h_num, b_num, w_sum, 2.0 ** -cfg.frac_bits)
        return got.survivors, loss, int(round(float(total[-1]))), w_sum, got.bytes_per_client

    def _apply_actvagg(self, num, den, h_num, b_num, w_sum, floor: float) -> None:
        """ActvAGG's item rule (components nobody changed keep their value) and FedAvg's output layer."""
        cfg = self.config
        change = torch.where(den > floor, num / den.clamp_min(1e-30), torch.zeros_like(num))
        self.item += cfg.server_lr * change
        self.h += cfg.server_lr * h_num / w_sum
        self.b += cfg.server_lr * b_num / w_sum

    def _plain_propagate(self, t: int, delegates: np.ndarray, dP: torch.Tensor | None) -> None:
        """Subordinates move by ``gamma_t`` x their new cluster's mean delegate change (A9, A10); the
        plaintext server has every ``p_u`` and computes it itself (a cluster with fewer than
        ``min_cluster`` delegates does not move, as in the secure variant)."""
        if dP is None:
            return
        p, d = self.config.clusters, self.config.dim
        gamma = math.exp(-self.config.gamma_rate * t)
        total = _one_hot_blocks(dP.double().numpy(), self.assign[delegates], p).sum(0).reshape(p, d + 1)
        counts = np.rint(total[:, d])
        self._count_small("fedfast:delegate-change", counts)
        self.user = propagate_to_subordinates(self.user, self.assign, delegates, total[:, :d], counts, gamma,
                                              self.config.min_cluster)

    def _secure_propagate(self, t: int, delegates: np.ndarray):
        """Secure: the delegates sum ``[change of p_u, 1]`` per cluster they reported (one sum per
        cluster with at least ``min_cluster`` delegates); the server broadcasts each cluster's mean
        change (zero for the others) and every client that was not a delegate moves its own
        ``p_u``. Returns ``(delegate bytes, all-client bytes)``."""
        p, d = self.config.clusters, self.config.dim
        sums, nbytes = yield from self._grouped_sums(t, "fedfast:delegate-change", {}, d + 1, delegates)
        counts = np.rint(sums[:, d])
        live = counts > max(self.config.min_cluster, 1) - 0.5
        mean = np.zeros((p, d))
        mean[live] = sums[live, :d] / counts[live, None]
        more = self._broadcast(t, "fedfast:cluster-change", 4 * p * d)
        self._note("fedfast:propagate", (yield Exchange(
            "fedfast:propagate", self._clients, broadcast={"change": mean}, reply_keys=frozenset({"done"}),
            validate=_check_done)))
        return nbytes, more + 1.0

    # -- the server's checks of a reply (ValueError: the client is dropped, with the reason) ------------
    def _check_items(self, u: int, r: dict) -> dict:
        items = r["items"]
        if items.dtype != np.int64 or items.ndim != 1 or not len(items):
            raise ValueError(f"items must be a non-empty int64 vector; found {items.dtype} {items.shape}")
        if items.min() < 0 or items.max() >= self.train.n_items or (np.diff(items) < 0).any():
            raise ValueError(f"items must be sorted item ids in 0..{self.train.n_items - 1}")
        return r

    @staticmethod
    def _check_profile(u: int, r: dict) -> np.ndarray:
        x = r["profile"]
        if x.dtype != np.float64 or x.shape != (3,) or not np.isfinite(x).all() or x[0] <= 0 or (x[1:] < 0).any():
            raise ValueError(f"profile must be 3 finite float64 statistics, log(1+n_k) > 0; found {x!r}")
        return x

    def _check_cluster(self, u: int, r: dict) -> int:
        c = r["cluster"]
        if c.dtype != np.int64 or c.shape != () or not (0 <= int(c) < self.config.clusters):
            raise ValueError(f"cluster must be one int64 in 0..{self.config.clusters - 1}; found {c!r}")
        return int(c)

    def _check_update(self, u: int, r: dict) -> dict:
        d, n_items = self.config.dim, self.train.n_items
        rows = r["rows"]
        if rows.dtype != np.int64 or rows.ndim != 1:
            raise ValueError(f"rows must be an int64 vector; found {rows.dtype} {rows.shape}")
        if len(rows) and (rows.min() < 0 or rows.max() >= n_items or (np.diff(rows) <= 0).any()):
            raise ValueError(f"rows must be distinct sorted item ids in 0..{n_items - 1}")
        shapes = {"item_delta": (len(rows), d), "h_delta": (d,), "b_delta": (), "weight": (), "user": (d,)}
        for name, shape in shapes.items():
            if name in r and (r[name].dtype != np.float32 or r[name].shape != shape or not np.isfinite(r[name]).all()):
                raise ValueError(f"{name} must be finite float32 {shape}; found {r[name].dtype} {r[name].shape}")
        if not (float(r["weight"]) >= 1 and float(r["weight"]) == int(r["weight"])):
            raise ValueError(f"weight (n_k) must be a positive whole number; found {float(r['weight'])}")
        loss = r["loss"]
        if loss.dtype != np.float64 or loss.shape != () or not (np.isfinite(loss) and loss >= 0):
            raise ValueError(f"loss must be one finite float64 >= 0; found {loss!r}")
        return r

    # -- the client's half -------------------------------------------------------------------------------
    #: the secure sums a client adds its value to with the members of its own cluster only
    GROUPED_STEPS = frozenset({"fedfast:kmeans-profile", "fedfast:kmeans", "fedfast:delegate-change"})
    #: steps whose value depends on the client's static data only: answered once per protocol instance
    ONCE_PER_INSTANCE = frozenset({"fedfast:start", "fedfast:popularity", "fedfast:kmeans-profile", "fedfast:profile"})

    def device_check(self, kind: str, round_: int, user: int, broadcast, own, *, secure: bool) -> None:
        """FedFast's own refusals (before the step runs; :mod:`protocols.guard` has the general rules):

        * a grouped secure sum (k-means, delegate change) is answered only for the group the client
          is in by its own assignment (``own["group"]`` must equal it): the server routes, it never
          chooses which sum holds a client's point;
        * the delegate change only by a client that trained in this round (a stale change would be
          the same vector in every round it is asked);
        * the k-means step sums the user embedding only (the profile statistics once, at round 0).
        """
        u = int(user)
        if kind in self.GROUPED_STEPS:
            g = own.get("group") if hasattr(own, "get") else None
            g = None if g is None else np.asarray(g)
            if g is None or g.shape != () or g.dtype.kind not in "iu":
                raise RefusedStep(f"fedfast: step {kind!r} needs the group it is summed in (one integer)")
            if int(g) != int(self.assign[u]) or self.assign[u] < 0:
                raise RefusedStep(f"fedfast: step {kind!r} asks this client to sum in group {int(g)}; its own "
                                  f"cluster is {int(self.assign[u])}: refused (the server never chooses the slot)")
        if kind == "fedfast:delegate-change" and int(self._trained[u]) != int(round_):
            raise RefusedStep(f"fedfast: only a client that trained in round {int(round_)} sends its change")
        if kind == "fedfast:kmeans" and int(np.asarray(broadcast.get("feature", -1))) != _USER:
            raise RefusedStep("fedfast: the per-round k-means step sums the user embedding only")

    def device_step(self, kind: str, round_: int, users, broadcast, per_user) -> dict[int, dict[str, np.ndarray]]:
        """Client step ``kind`` for ``users`` (batched in process, one user on a device): reads only
        their rows, the broadcast and their own ``per_user`` arrays; writes only their state.
        The runtimes admit each user first (:func:`protocols.exchange.admit`: the guard's rules and
        :meth:`device_check`); called directly, the same checks run here."""
        self.round = int(round_)
        users = np.asarray(users, np.int64)
        if not np.isin(users, self._clients).all():
            raise ValueError(f"fedfast: users {users[~np.isin(users, self._clients)][:5].tolist()} have no data here")
        p = self.config.clusters
        for u in users.tolist():
            self.device_check(kind, round_, u, broadcast, per_user.get(u, {}), secure=self._secure)
        if kind == "train":
            return self._client_train(users, broadcast, per_user)
        if kind == "fedfast:start":  # the client draws its own start cluster (and computes its statistics)
            self.assign[users] = self._start_clusters(users)
            if "popularity" in broadcast:
                self._profile[users] = self._profile_of(users, self._expect(broadcast, "popularity",
                                                                            (self.train.n_items,)))
            return {int(u): {"cluster": np.array(self.assign[u], np.int64)} for u in users}
        if kind == "fedfast:popularity":
            if self._secure:
                ind = np.zeros((len(users), self.train.n_items))
                for i, u in enumerate(users):
                    ind[i, self._pos_items[self._pos_start[u]: self._pos_start[u + 1]]] = 1.0
                return {int(u): {"vector": ind[i]} for i, u in enumerate(users)}
            return {int(u): {"items": np.sort(self._pos_items[self._pos_start[u]: self._pos_start[u + 1]]).astype(np.int64)}
                    for u in users}
        if kind == "fedfast:profile":
            x = self._profile_of(users, self._expect(broadcast, "popularity", (self.train.n_items,)))
            return {int(u): {"profile": x[i].copy()} for i, u in enumerate(users)}
        if kind == "fedfast:kmeans-profile":  # round 0: the raw statistics and their squares, per start cluster
            x = self._profile[users]
            if not (x[:, 0] > 0).all():  # log(1 + n_k) > 0 once computed (the start step, with the popularity)
                raise ValueError("fedfast: the profile statistics are computed at the start step (with the "
                                 "popularity); this client has none")
            vec = np.concatenate([x, x**2, np.ones((len(users), 1))], 1)
            return {int(u): {"vector": vec[i]} for i, u in enumerate(users)}
        if kind == "fedfast:kmeans":  # the user embedding and a 1, summed with its cluster's members
            x = self.user[torch.as_tensor(users)].numpy().astype(np.float64)
            vec = np.concatenate([x, np.ones((len(users), 1))], 1)
            return {int(u): {"vector": vec[i]} for i, u in enumerate(users)}
        if kind == "fedfast:assign":
            if "centroids" not in broadcast:
                raise ValueError("fedfast: an assign step needs the centroids")
            self._assign_by(users, broadcast)
            return {int(u): {"cluster": np.array(self.assign[u], np.int64)} for u in users}
        if kind == "fedfast:delegate-change":  # the change of p_u and a 1, summed with its cluster's delegates
            dP = (self.user[torch.as_tensor(users)] - self._before[torch.as_tensor(users)]).double().numpy()
            vec = np.concatenate([dP, np.ones((len(users), 1))], 1)
            return {int(u): {"vector": vec[i]} for i, u in enumerate(users)}
        if kind == "fedfast:propagate":  # subordinates move by their cluster's mean delegate change
            mean = self._expect(broadcast, "change", (p, self.config.dim))
            if not np.isfinite(mean).all():
                raise ValueError("fedfast: the cluster changes must be finite")
            gamma = math.exp(-self.config.gamma_rate * self.round)
            rows = users[(self._trained[users] != self.round) & (self.assign[users] >= 0)]
            self.user[torch.as_tensor(rows)] += gamma * torch.as_tensor(mean[self.assign[rows]], dtype=self.user.dtype)
            return {int(u): {"done": np.array(True)} for u in users}
        if kind == "fedfast:dilute":
            n_sigma = float(self._expect(broadcast, "n_sigma", ()))
            if not n_sigma > 0:
                raise ValueError(f"fedfast: n_sigma must be positive; found {n_sigma}")
            idx = torch.as_tensor(users)
            before = self._before[idx]
            w = torch.as_tensor(self._weight[users])
            self.user[idx] = before + (self.user[idx] - before) * (w / torch.tensor(n_sigma)).unsqueeze(1)
            return {int(u): {"done": np.array(True)} for u in users}
        raise ValueError(f"fedfast has no client step {kind!r}")

    @staticmethod
    def _expect(broadcast, name: str, shape: tuple) -> np.ndarray:
        """A broadcast array, checked (the client refuses a malformed message)."""
        if name not in broadcast:
            raise ValueError(f"fedfast: the server's message lacks {name!r}")
        a = np.asarray(broadcast[name])
        if a.shape != shape:
            raise ValueError(f"fedfast: {name!r} has shape {a.shape}; expected {shape}")
        return a

    def _assign_by(self, users: np.ndarray, broadcast) -> np.ndarray:
        """The clients' k-means points (``feature``: standardised profile or ``p_u``), assigned to
        the nearest of the broadcast ``centroids`` if there are any."""
        if "feature" not in broadcast:
            return np.zeros((len(users), 0))
        if int(np.asarray(broadcast["feature"])) == _PROFILE:
            mu, sd = self._expect(broadcast, "mu", (3,)), self._expect(broadcast, "sd", (3,))
            x = (self._profile[users] - mu) / sd
        else:
            x = self.user[torch.as_tensor(users)].numpy().astype(np.float64)
        if "centroids" in broadcast:
            self.assign[users] = assign_clusters(x, self._expect(broadcast, "centroids", (self.config.clusters, x.shape[1])))
        return x

    def _client_train(self, users: np.ndarray, bc, per_user) -> dict[int, dict[str, np.ndarray]]:
        """The delegates' local training (FedAvg-GMF's, batched) and their replies."""
        d, n_items = self.config.dim, self.train.n_items
        self.load_device_model({"item": self._expect(bc, "item", (n_items, d)), "h": self._expect(bc, "h", (d,)),
                                "b": self._expect(bc, "b", ())})
        idx = torch.as_tensor(users)
        if self._mirror:  # the server's copy of p_u
            for u in users.tolist():
                self.user[u] = torch.as_tensor(self._expect(per_user.get(u, {}), "user", (d,)), dtype=torch.float32)
        self._before[idx] = self.user[idx]
        lr_ = self._train(users)
        self._trained[users] = self.round
        self._weight[users] = lr_.weight.numpy()
        self.user[idx] = lr_.P  # the client's (with the mirror: its copy until the server moves it)
        slot_loss = self._slot_loss.numpy()
        if self._secure:
            vec = self._update_vectors(users, lr_, slot_loss)
            return {int(u): {"vector": vec[i]} for i, u in enumerate(users)}
        bounds = np.searchsorted(lr_.pair_slot, np.arange(len(users) + 1))
        out = {}
        for c, u in enumerate(users.tolist()):
            lo, hi = bounds[c], bounds[c + 1]
            out[u] = {"rows": lr_.pair_item[lo:hi].astype(np.int64), "item_delta": lr_.dQ[lo:hi].numpy().copy(),
                      "h_delta": lr_.dH[c].numpy().copy(), "b_delta": lr_.dB[c].numpy().copy(),
                      "weight": lr_.weight[c].numpy().copy(), "loss": np.array(float(slot_loss[c]))}
            if self._mirror:
                out[u]["user"] = lr_.P[c].numpy().copy()
        return out

    def _update_vectors(self, users: np.ndarray, lr_: LocalRound, slot_loss: np.ndarray) -> np.ndarray:
        """Each delegate's secure update: the item rule's sums, the output layer's, and its loss."""
        cfg, n_items, d, m = self.config, self.train.n_items, self.config.dim, len(users)
        pair_slot, pair_item, dQ, weight = lr_.pair_slot, lr_.pair_item, lr_.dQ, lr_.weight
        if cfg.aggregation == "fedavg":
            vec = self._client_vectors(users, pair_slot, pair_item, dQ, lr_.dH, lr_.dB, weight)
            return np.concatenate([vec, slot_loss[:, None]], 1)
        vec = np.zeros((m, self._update_width))
        q = actvagg_weights(dQ.double(), cfg.item_weighting)
        blocks = vec[:, : 2 * n_items * d].reshape(m, 2, n_items, d)
        blocks[pair_slot, 0, pair_item] = (q * dQ.double()).numpy()
        blocks[pair_slot, 1, pair_item] = q.numpy()
        w = weight.double().numpy()
        vec[:, 2 * n_items * d: -3] = lr_.dH.double().numpy() * w[:, None]
        vec[:, -3], vec[:, -2], vec[:, -1] = lr_.dB.double().numpy() * w, w, slot_loss
        return vec

    def _train(self, sampled: np.ndarray) -> LocalRound:
        """FedAvg-GMF's local round of ``sampled`` (:meth:`FedAvgGMF._train_sampled`: without the
        model download, which the server half records)."""
        return self._train_sampled(sampled)

    def _train_locally(self, sampled, epochs, pair_slot, pair_item, pair_of_example, observe=None):
        """FedAvg-GMF's local epochs, also summing each client's loss on its own (``_slot_loss``,
        float64, in its examples' order: the same batched or alone, to float rounding)."""
        slot_loss = torch.zeros(len(sampled), dtype=torch.float64)

        def own_loss(P, Q, H, B, slot, pair, label):  # noqa: ANN001, ANN202, N803
            # the binary cross-entropy of each example, in float64 (softplus(z) - z*y: torch's
            # binary_cross_entropy_with_logits costs ~20 ms a call on this CPU build, whatever the size)
            z = gmf_logits(P[slot], Q[pair], H[slot], B[slot, 0]).double()
            slot_loss.index_add_(0, slot, torch.nn.functional.softplus(z) - z * label.double())
            if observe is not None:
                observe(P, Q, H, B, slot, pair, label)

        out = super()._train_locally(sampled, epochs, pair_slot, pair_item, pair_of_example, observe=own_loss)
        self._slot_loss = slot_loss
        return out

    #: the client steps whose reply is summed through secure aggregation in the secure variant
    SECURE_STEPS = frozenset({"train", "fedfast:popularity", "fedfast:kmeans-profile", "fedfast:kmeans",
                              "fedfast:delegate-change"})

    def device_requires_secure(self, kind: str) -> bool:
        """Whether this configuration answers step ``kind`` only through secure aggregation (a
        client of the secure variant refuses to send its update, item indicator, k-means point or
        embedding change in plaintext)."""
        return self._secure and kind in self.SECURE_STEPS

    def device_state_from_server(self, user: int) -> dict[str, np.ndarray] | None:
        """On the server half: the state to score ``user`` with when the server holds it (plaintext
        with clusters: the mirror's ``p_u``, as the paper's server holds it), else ``None`` (the
        user's own device state is authoritative)."""
        return self.device_state(user) if self._mirror else None

    # -- the client's own state and the global model -------------------------------------------------------
    def device_state(self, user: int) -> dict[str, np.ndarray]:
        """User ``user``'s state on its device: ``p_u`` (in the plaintext variant with clusters the
        server's mirror is authoritative: take this from the server half), its cluster, and what it
        keeps between the exchanges of a round."""
        u = int(user)
        return {"user": self.user[u].numpy().copy(), "before": self._before[u].numpy().copy(),
                "cluster": np.array(self.assign[u], np.int64), "trained": np.array(self._trained[u], np.int64),
                "weight": np.array(self._weight[u], np.float32), "profile": self._profile[u].copy()}

    def load_device_state(self, user: int, state: dict[str, np.ndarray]) -> None:
        u, d = int(user), self.config.dim
        shapes = {"user": (d,), "before": (d,), "cluster": (), "trained": (), "weight": (), "profile": (3,)}
        if set(state) != set(shapes):
            raise ValueError(f"fedfast device state: keys {sorted(state)}; expected {sorted(shapes)}")
        for name, shape in shapes.items():
            if np.asarray(state[name]).shape != shape:
                raise ValueError(f"fedfast device state: {name!r} has shape {np.shape(state[name])}; expected {shape}")
        self.user[u] = torch.as_tensor(np.asarray(state["user"], np.float32))
        self._before[u] = torch.as_tensor(np.asarray(state["before"], np.float32))
        self.assign[u] = int(state["cluster"])
        self._trained[u] = int(state["trained"])
        self._weight[u] = float(state["weight"])
        self._profile[u] = np.asarray(state["profile"], np.float64)

    def device_model(self) -> dict[str, np.ndarray]:
        """The global arrays a client scores with: ``(Q, h, b)``."""
        return {"item": self.item.numpy().copy(), "h": self.h.numpy().copy(), "b": self.b.numpy().copy()}

    def load_device_model(self, model: dict[str, np.ndarray]) -> None:
        d, n_items = self.config.dim, self.train.n_items
        for name, shape in (("item", (n_items, d)), ("h", (d,)), ("b", ())):
            a = np.asarray(model[name])
            if a.shape != shape or a.dtype != np.float32 or not np.isfinite(a).all():
                raise ValueError(f"fedfast model: {name!r} must be finite float32 {shape}; found {a.dtype} {a.shape}")
        self.item = torch.as_tensor(np.array(model["item"]))
        self.h = torch.as_tensor(np.array(model["h"]))
        self.b = torch.as_tensor(np.array(model["b"]))

    # -- public info and checkpoints ---------------------------------------------------------------------
    def public_info(self) -> dict[str, Any]:
        info = super().public_info()
        info["protocol"] = "fedfast"
        info["mean_positives"] = float(self._pos_start[-1] / max(len(self._clients), 1))
        return info

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["clusters"] = {"assign": self.assign.copy(), "centroids": self.centroids.copy(), "load": self.load.copy()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (a key missing from an older checkpoint, e.g. the dpf_* keys, takes its default)
        if {**asdict(type(self.config)()), **state["config"]} != asdict(self.config):
            raise ValueError("checkpoint was written with a different fedfast configuration")
        super().load_state_dict(state)
        c = state["clusters"]
        self.assign = np.asarray(c["assign"], np.int64).copy()
        self.centroids = np.asarray(c["centroids"], np.float64).copy()
        self.load = np.asarray(c["load"], np.int64).copy()


register(ProtocolSpec(
    name="fedfast",
    summary="FedFast over GMF: ActvSAMP (k-means round-robin sampling) and ActvAGG, optionally through SecAgg+",
    build=lambda ctx: FedFastGMF(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport, exclude=ctx.exclude),
    section="fedfast",
    config_cls=FedFastConfig,
    exchanges=Exchanges(
        check=check_devices,
        build_client=lambda ctx: FedFastGMF.on_device(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport,
                                                      exclude=ctx.exclude),
    ),
))
