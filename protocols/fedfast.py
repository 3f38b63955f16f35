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
from protocols.exchange import Exchange, Replies, SecureSum, run_exchanges
from protocols.fedavg import ClientUpdate, FedAvgConfig, FedAvgGMF, LocalRound
from protocols.fedfast_cluster import (  # noqa: F401  (re-exported: they were defined here)
    _PROFILE,
    _STREAM_START,
    _USER,
    FedFastClustering,
    _check_done,
    _one_hot_blocks,
    actvagg_sums,
    actvagg_weights,
    assign_clusters,
    cluster_sums,
    propagate_to_subordinates,
    round_robin_sample,
    update_centroids,
)
from protocols.fedfast_device import FedFastDevice
from protocols.registry import Exchanges, ProtocolSpec, register
from protocols.transport import SERVER, InProcessTransport, client
from recmodels.data import Interactions
from recmodels.models import gmf_logits
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


def check_devices(config: FedFastConfig) -> None:
    """Every FedFast configuration separates onto devices (docs/fedfast.md, "On separate devices"):
    this only checks that ``config`` is a :class:`FedFastConfig`."""
    if not isinstance(config, FedFastConfig):
        raise ValueError(f"fedfast on devices needs a FedFastConfig; found {type(config).__name__}")


@dataclass(frozen=True)
class FedFastUpload(ClientUpdate):
    """A plaintext FedFast upload: FedAvg's, plus the delegate's new user embedding when the server
    clusters on it (``None`` otherwise)."""

    user_embedding: np.ndarray | None = None


class FedFastGMF(FedFastClustering, FedFastDevice, FedAvgGMF):
    """FedFast over GMF (see the module docstring); FedAvgGMF's local training, batched.

    The round is a sequence of named exchanges (:mod:`protocols.exchange`): :meth:`device_round`
    is the server's half, :meth:`device_step` the clients' (every client at once in process, one
    client on a device); :meth:`run_round` drives the two in one process.
    """

    #: its ``seconds["client"]`` is the local training alone: the run loop adds the secure steps
    client_seconds_include_secure = False

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

    # -- local training (the clustering exchanges: protocols.fedfast_cluster; the client's steps:
    # protocols.fedfast_device) ----------------------------------------------------------------------------
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
