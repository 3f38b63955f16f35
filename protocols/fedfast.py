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
from protocols.fedavg import ClientUpdate, FedAvgConfig, FedAvgGMF
from protocols.registry import ProtocolSpec, register
from protocols.secure_sum import secure_sum
from protocols.transport import SERVER, InProcessTransport, client
from recmodels.data import Interactions
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
        kmeans_iters: Lloyd iterations per round on the user embeddings (warm-started).
        kmeans_init_iters: Lloyd iterations on the initial features at round 0 (at most: they stop
            once the centroids stop changing).
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
    kmeans_init_iters: int = 10
    kmeans_every: int = 1
    initial_features: str = "profile"
    without_replacement: bool = False

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
        if self.kmeans_iters < 0 or self.kmeans_init_iters < 0:
            raise ValueError(
                f"fedfast.kmeans_iters and fedfast.kmeans_init_iters must be >= 0; found "
                f"{self.kmeans_iters}, {self.kmeans_init_iters}")
        if not (self.gamma_rate >= 0 and math.isfinite(self.gamma_rate)):
            raise ValueError(f"fedfast.gamma_rate must be a finite number >= 0; found {self.gamma_rate}")

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


def update_centroids(sums: np.ndarray, counts: np.ndarray, prev: np.ndarray | None) -> np.ndarray:
    """Means of non-empty clusters; an empty one keeps ``prev``'s row (NaN if none in this space)."""
    keep = prev if prev is not None and prev.shape == sums.shape else np.full(sums.shape, np.nan)
    live = counts > 0.5
    out = keep.copy()
    out[live] = sums[live] / counts[live, None]
    return out


def round_robin_sample(assign: np.ndarray, m: int, rng: np.random.Generator,
                       load: np.ndarray | None = None) -> np.ndarray:
    """ActvSAMP (notes A1): indices into ``assign`` of ``m`` clients drawn round-robin over clusters.

    Clusters are visited in a random order; each visit draws one not-yet-drawn member uniformly
    (or, given ``load``, a least-loaded one, random among ties) until ``m`` are drawn, so every
    cluster gets ``floor(m/p)`` or ``ceil(m/p)`` when it is large enough. Returned sorted.
    """
    n = len(assign)
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
                              delta_sum: np.ndarray, delta_count: np.ndarray, gamma: float) -> torch.Tensor:
    """New user table: every non-delegate moves by ``gamma`` x its cluster's mean delegate change.

    ``assign[u]`` is user ``u``'s cluster (-1: not a client), ``delta_sum[c]``/``delta_count[c]``
    the sum and number of delegate changes in cluster ``c``; a cluster without delegates is skipped.
    """
    mean = np.zeros_like(delta_sum)
    live = delta_count > 0.5
    mean[live] = delta_sum[live] / delta_count[live, None]
    sub = np.ones(len(assign), bool)
    sub[delegates] = False
    sub &= assign >= 0
    out = user.clone()
    rows = np.flatnonzero(sub)
    out[torch.as_tensor(rows)] += gamma * torch.as_tensor(mean[assign[rows]], dtype=user.dtype)
    return out


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
    """FedFast over GMF (see the module docstring); FedAvgGMF's local training, batched."""

    upload_cls = FedFastUpload

    def __init__(self, train: Interactions, config: FedFastConfig, *, seed: int,
                 transport: InProcessTransport | None = None, exclude: Interactions | None = None):
        super().__init__(train, config, seed=seed, transport=transport, exclude=exclude)
        self.assign = np.full(train.n_users, -1, np.int64)  # -1: no cluster yet / not a client
        self.centroids = np.zeros((0, 0))
        self.load = np.zeros(train.n_users, np.int64)  # times each client was drawn
        self.kmeans_steps = 0  # Lloyd steps of the last clustering call
        if config.secure_aggregation != "none" and config.clustered:  # k-means sums run over all clients
            check_budget(n_summands=len(self._clients), clip=config.value_clip, frac_bits=config.frac_bits)

    # -- sums: plaintext at the server, or through secure aggregation ----------------------------------
    def _sum(self, vectors: np.ndarray, users: np.ndarray, t: int, kind: str) -> tuple[np.ndarray, float]:
        """Column sums of ``vectors`` (row i from client ``users[i]``) and the bytes per client.

        Plaintext: the server computes them from what it holds (the embedding mirror, the profile
        statistics): no message. Secure: through :func:`secure_sum`, recorded as ``kind``.
        """
        cfg = self.config
        if cfg.secure_aggregation == "none":
            return vectors.sum(0), 0.0
        res = secure_sum(
            vectors, protocol=cfg.secure_aggregation, frac_bits=cfg.frac_bits, value_clip=cfg.value_clip,
            round=t, transport=self.transport, senders=[client(u) for u in users], kind=kind,
            where="fedfast.value_clip", dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt,
        )
        return res.total, res.bytes_per_client

    def _broadcast(self, t: int, kind: str, nbytes: int) -> float:
        """Secure variant: the server sends ``nbytes`` to every client (plaintext needs no message)."""
        if self.config.secure_aggregation == "none":
            return 0.0
        for u in self._clients:
            self.transport.send(SERVER, client(u), t, kind, None, nbytes)
        return float(nbytes)

    # -- clustering ---------------------------------------------------------------------------------
    def _profile_features(self, t: int) -> np.ndarray:
        """Raw ``[log(1+n_k), mean, std of log(1+popularity)]`` per client (notes A8); standardised
        by :meth:`_initial_clusters` with moments summed in the first Lloyd step."""
        cl = self._clients
        counts = (self._pos_start[cl + 1] - self._pos_start[cl]).astype(np.float64)
        pos_items = np.concatenate([self._pos_items[self._pos_start[u]: self._pos_start[u + 1]] for u in cl])
        slot = np.repeat(np.arange(len(cl)), counts.astype(np.int64))
        if self.config.secure_aggregation == "none":
            pop = np.bincount(pos_items, minlength=self.train.n_items).astype(np.float64)
        else:  # the clients' item indicators, summed securely
            ind = np.zeros((len(cl), self.train.n_items))
            ind[slot, pos_items] = 1.0
            pop, _ = self._sum(ind, cl, t, "fedfast:popularity")
            pop = np.rint(pop)
        lp = np.log1p(pop[pos_items])
        mean = np.bincount(slot, lp, len(cl)) / counts
        std = np.sqrt(np.maximum(np.bincount(slot, lp**2, len(cl)) / counts - mean**2, 0.0))
        x = np.stack([np.log1p(counts), mean, std], 1)
        if self.config.secure_aggregation == "none":  # the paper's server receives the statistics
            keep = self.transport.transcript.keep_payloads
            for i, u in enumerate(cl):
                self.transport.send(client(u), SERVER, t, "fedfast:profile", x[i].copy() if keep else None, 12)
        return x

    def _lloyd(self, x: np.ndarray, assign: np.ndarray, iters: int, t: int) -> tuple[np.ndarray, float]:
        """Up to ``iters`` Lloyd steps from ``assign`` over the clients' rows ``x``; returns the
        assignment and the bytes per client. Stops early once a step leaves the centroids unchanged
        (bit for bit): the assignment is then a fixed point, so every further step would repeat it,
        and the result equals the one of all ``iters`` steps. The server sees this from the
        centroids it publishes anyway, so the stop reveals nothing more."""
        p, total_bytes = self.config.clusters, 0.0
        self.kmeans_steps = 0
        for _ in range(iters):
            sums, nbytes = self._sum(_one_hot_blocks(x, assign, p), self._clients, t, "fedfast:kmeans")
            sums = sums.reshape(p, x.shape[1] + 1)
            prev = self.centroids
            self.centroids = update_centroids(sums[:, :-1], np.rint(sums[:, -1]), prev)
            nbytes += self._broadcast(t, "fedfast:centroids", 4 * self.centroids.size)
            assign = assign_clusters(x, self.centroids)  # each client, from the published centroids
            total_bytes += nbytes
            self.kmeans_steps += 1
            if prev.shape == self.centroids.shape and np.array_equal(prev, self.centroids, equal_nan=True):
                break
        self.assign[self._clients] = assign
        return assign, total_bytes

    def _initial_clusters(self, t: int) -> float:
        """Round 0's partition: k-means on the standardised profile statistics (A8).

        The first Lloyd step and the standardisation moments share one sum: each client adds its raw
        statistics ``x`` into its (random) start cluster's block, and ``[x, x^2, 1]`` beside them; the
        mean of standardised rows is the standardised mean, so the first centroids follow from the raw
        per-cluster sums (one secure sum fewer than summing the moments on their own).
        """
        cfg = self.config
        start = self.rng.integers(cfg.clusters, size=len(self._clients))
        self.kmeans_steps = 0
        if cfg.initial_features == "random" or cfg.kmeans_init_iters == 0:
            self.assign[self._clients] = start
            return 0.0
        cl, p = self._clients, cfg.clusters
        x = self._profile_features(t)
        f = x.shape[1]
        vec = np.concatenate([_one_hot_blocks(x, start, p), x, x**2, np.ones((len(cl), 1))], 1)
        sums, nbytes = self._sum(vec, cl, t, "fedfast:kmeans")
        moments = sums[p * (f + 1):]
        mu = moments[:f] / moments[2 * f]
        sd = np.sqrt(np.maximum(moments[f: 2 * f] / moments[2 * f] - mu**2, 0.0))
        sd = np.where(sd > 1e-12, sd, 1.0)
        blocks = sums[: p * (f + 1)].reshape(p, f + 1)
        self.centroids = (update_centroids(blocks[:, :-1], np.rint(blocks[:, -1]), None) - mu) / sd
        nbytes += self._broadcast(t, "fedfast:centroids", 4 * self.centroids.size + 8 * 2 * f)
        x = (x - mu) / sd  # each client standardises its own statistics with the published moments
        assign = assign_clusters(x, self.centroids)
        steps = 1
        if cfg.kmeans_init_iters > 1:
            assign, more = self._lloyd(x, assign, cfg.kmeans_init_iters - 1, t)
            nbytes += more
            steps += self.kmeans_steps
        self.assign[cl] = assign
        self.kmeans_steps = steps
        return nbytes

    # -- one round -----------------------------------------------------------------------------------
    def run_round(self) -> RoundStats:
        """ActvSAMP, local training (FedAvg's), ActvAGG or FedAvg, re-clustering, propagation."""
        cfg, t = self.config, self.round
        start = time.perf_counter()
        cluster_s, cluster_bytes, steps = 0.0, 0.0, 0
        if cfg.clustered and t == 0 and self.assign[self._clients[0]] < 0:
            t0 = time.perf_counter()
            cluster_bytes += self._initial_clusters(t)
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
        lr_ = self._local_round(sampled)
        t_train = time.perf_counter() - t_train
        P, dQ, dH, dB, weight = lr_.P, lr_.dQ, lr_.dH, lr_.dB, lr_.weight
        pair_slot, pair_item, loss, examples = lr_.pair_slot, lr_.pair_item, lr_.loss, lr_.examples
        dP = P - self.user[torch.as_tensor(sampled)]
        upload_bytes = self._aggregate(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight, P)

        if cfg.aggregation == "fedavg" and cfg.user_update == "average":  # Eq. 1 on p_u too (A6)
            P = self.user[torch.as_tensor(sampled)] + dP * (weight / weight.sum()).unsqueeze(1)
        self.user[torch.as_tensor(sampled)] = P
        if cfg.clustered and cfg.kmeans_iters and t % cfg.kmeans_every == 0:  # re-cluster on the embeddings, delegates already copied (A9)
            t0 = time.perf_counter()
            x = self.user[torch.as_tensor(self._clients)].numpy().astype(np.float64)
            cluster_bytes += self._lloyd(x, self.assign[self._clients], cfg.kmeans_iters, t)[1]
            cluster_s += time.perf_counter() - t0
            steps += self.kmeans_steps
        if cfg.aggregation == "actvagg" and cfg.propagate:
            upload_bytes += self._propagate(t, sampled, dP)

        self.round += 1
        secure = cfg.secure_aggregation != "none"
        what = ("delegate updates in plaintext: item changes (I_k and |delta|), output layer, user embeddings, "
                "profile statistics" if not secure else
                f"sums through {cfg.secure_aggregation} (no DP noise): ActvAGG numerators/denominators, output "
                "layer, per-cluster k-means and delegate-change sums and counts")
        total = time.perf_counter() - start
        return RoundStats(
            round=t, loss=loss / max(examples, 1), clients=m,
            bytes_per_client=self.model_bytes + upload_bytes,
            # the batched local training of all m clients, as a mean per client; the rest is the server's
            # (aggregation, clustering) and the secure-aggregation protocol's
            seconds={"round": total, "client": t_train / max(m, 1), "server": total - t_train},
            extra={"examples": examples, "cluster_seconds": cluster_s, "cluster_bytes_per_client": cluster_bytes,
                   "kmeans_steps": steps,
                   "clusters_used": int(len(np.unique(self.assign[self._clients]))) if cfg.clustered else 0},
            releases=(Release(NonPrivate(), who="clients", what=what, params={"clients": m}),),
        )

    def _aggregate(self, t, sampled, pair_slot, pair_item, dQ, dH, dB, weight, P) -> float:
        """Update ``(Q, h, b)`` from the delegates' changes; returns the upload bytes per delegate."""
        cfg = self.config
        plain = cfg.secure_aggregation == "none"
        if plain:  # the paper's server also receives p_u when it clusters on it
            self._send_updates(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight,
                               user=P if cfg.clustered else None)
            upload = self.model_bytes + 4.0 + (4.0 * cfg.dim if cfg.clustered else 0.0)
        if cfg.aggregation == "fedavg":
            if plain:
                sums = self._plain_sums(torch.as_tensor(pair_slot), torch.as_tensor(pair_item), dQ, dH, dB, weight)
            else:
                sums, upload = self._secure_sums(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight)
            self._apply(*sums)
            return upload
        n_items, d = self.train.n_items, cfg.dim
        if plain:
            num, den = actvagg_sums(pair_item, dQ, n_items, cfg.item_weighting)
            h_num, b_num, w_sum = (dH * weight.unsqueeze(1)).sum(0), (dB * weight).sum(), weight.sum()
            floor = 0.0
        else:
            vec = np.zeros((len(sampled), 2 * n_items * d + d + 2))
            q = actvagg_weights(dQ.double(), cfg.item_weighting)
            blocks = vec[:, : 2 * n_items * d].reshape(len(sampled), 2, n_items, d)
            blocks[pair_slot, 0, pair_item] = (q * dQ.double()).numpy()
            blocks[pair_slot, 1, pair_item] = q.numpy()
            w = weight.double().numpy()
            vec[:, 2 * n_items * d: -2] = dH.double().numpy() * w[:, None]
            vec[:, -2], vec[:, -1] = dB.double().numpy() * w, w
            total, upload = self._sum(vec, sampled, t, "update")
            num = torch.as_tensor(total[: n_items * d].reshape(n_items, d), dtype=torch.float32)
            den = torch.as_tensor(total[n_items * d: 2 * n_items * d].reshape(n_items, d), dtype=torch.float32)
            h_num = torch.as_tensor(total[2 * n_items * d: -2], dtype=torch.float32)
            b_num, w_sum = torch.tensor(float(total[-2])), torch.tensor(float(total[-1]))
            floor = 2.0 ** -cfg.frac_bits
        change = torch.where(den > floor, num / den.clamp_min(1e-30), torch.zeros_like(num))
        self.item += cfg.server_lr * change
        self.h += cfg.server_lr * h_num / w_sum
        self.b += cfg.server_lr * b_num / w_sum
        return upload

    def _propagate(self, t: int, sampled: np.ndarray, dP: torch.Tensor) -> float:
        """Subordinates move by ``gamma_t`` x their new cluster's mean delegate change (A9, A10)."""
        cfg, p, d = self.config, self.config.clusters, self.config.dim
        gamma = math.exp(-cfg.gamma_rate * t)
        blocks = _one_hot_blocks(dP.double().numpy(), self.assign[sampled], p)
        if cfg.secure_aggregation == "none":  # the server has every p_u: it computes this itself
            total, nbytes = blocks.sum(0), 0.0
        else:
            total, nbytes = self._sum(blocks, sampled, t, "fedfast:delegate-change")
            nbytes += self._broadcast(t, "fedfast:cluster-change", 4 * p * d)
        total = total.reshape(p, d + 1)
        self.user = propagate_to_subordinates(self.user, self.assign, sampled, total[:, :d],
                                              np.rint(total[:, d]), gamma)
        return nbytes

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
        if state["config"] != asdict(self.config):
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
))
