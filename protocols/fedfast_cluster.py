"""FedFast's clusters: the pure k-means, ActvSAMP and ActvAGG pieces, and the server's clustering exchanges.

The functions are FedFast's arithmetic (tested against per-client loops); :class:`FedFastClustering` is the
part of :class:`protocols.fedfast.FedFastGMF` that builds and maintains the partition: round 0's k-means on
the clients' profile statistics, the per-round k-means on the user embeddings, plaintext or through one
secure sum per cluster. Split out of :mod:`protocols.fedfast` to keep that module readable; every name here
stays importable from :mod:`protocols.fedfast`.
"""

from __future__ import annotations

import numpy as np
import torch

from protocols.exchange import Exchange, answer_in_process
from recmodels.streams import integers, stream_keys

__all__ = [
    "FedFastClustering",
    "actvagg_sums",
    "actvagg_weights",
    "assign_clusters",
    "cluster_sums",
    "propagate_to_subordinates",
    "round_robin_sample",
    "update_centroids",
]

#: the k-means points a client uses (``feature`` of a k-means or assign exchange)
_PROFILE, _USER = 0, 1
#: the purpose of the clients' keyed stream for their start cluster (recmodels.streams)
_STREAM_START = 21


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


def _one_hot_blocks(values: np.ndarray, assign: np.ndarray, p: int) -> np.ndarray:
    """Each row ``[x, 1]`` placed in block ``assign[i]`` of a ``p * (F + 1)`` vector (zeros elsewhere)."""
    n, f = values.shape
    out = np.zeros((n, p, f + 1))
    out[np.arange(n), assign, :f] = values
    out[np.arange(n), assign, f] = 1.0
    return out.reshape(n, p * (f + 1))


class FedFastClustering:
    """The server's clustering exchanges of :class:`protocols.fedfast.FedFastGMF` (a mixin: it uses the
    trainer's state), and the profile statistics the clients cluster on."""

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
