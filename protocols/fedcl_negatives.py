"""FedCL's negatives: each client's local pool and picks from its own keyed streams, the server's
semi-hard negatives from the clustered LDP embeddings (:mod:`protocols.fedcl_server`), and the client's
check of the ones it receives; as a mixin of :class:`protocols.fedcl.FedCL`.

Split out of :mod:`protocols.fedcl` to keep that module readable; nothing here is meant to be used
without it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from protocols.fedcl_server import cluster_centroids, hard_candidates, sample_semi_hard
from protocols.transport import SERVER, client
from recmodels.data import pair_keys
from recmodels.streams import integers, stream_keys

__all__ = ["FedCLNegatives"]

#: Purposes of the clients' keyed streams (recmodels.streams): stream_keys(seed, purpose, ...).
_STREAM_POOL, _STREAM_PICKS, _STREAM_DROPOUT = 15, 16, 17


def _in_sorted(keys: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``np.isin(keys, table)`` for a sorted unique ``table`` by binary search (no re-sort per round)."""
    if not table.size:
        return np.zeros(np.shape(keys), dtype=bool)
    idx = np.minimum(np.searchsorted(table, keys), table.size - 1)
    return table[idx] == keys


class FedCLNegatives:
    """Where :class:`protocols.fedcl.FedCL`'s negatives come from (a mixin: it uses the trainer's state)."""

    def _keyed_pools(self) -> np.ndarray:
        """``[n_users, local_pool]`` items each client stores as local negatives (never its own),
        each row from its user's keyed stream: entry ``j`` is drawn with counters ``j``,
        ``j + local_pool``, ... until it is not one of the user's own items, so a client on its
        own data draws the row it has in process."""
        n_users, n_items, k = self.train.n_users, self.train.n_items, self.config.local_pool
        users = np.repeat(np.arange(n_users), k).reshape(n_users, k)
        keys = stream_keys(self.seed, _STREAM_POOL, users)
        ctr = np.broadcast_to(np.arange(k), (n_users, k)).copy()
        pool = integers(keys, ctr, n_items)
        bad = _in_sorted(pair_keys(users, pool, n_items), self._own)
        while bad.any():
            ctr[bad] += k
            pool[bad] = integers(keys[bad], ctr[bad], n_items)
            bad = _in_sorted(pair_keys(users, pool, n_items), self._own)
        return pool

    def _local_pools(self, rng: np.random.Generator) -> np.ndarray:
        """``[n_users, local_pool]`` items each client stores as local negatives (never its own)."""
        n_users, n_items, k = self.train.n_users, self.train.n_items, self.config.local_pool
        pool = rng.integers(0, n_items, size=(n_users, k), dtype=np.int64)
        users = np.repeat(np.arange(n_users), k).reshape(n_users, k)
        bad = np.isin(pair_keys(users, pool, n_items), self._own)
        while bad.any():
            pool[bad] = rng.integers(0, n_items, size=int(bad.sum()), dtype=np.int64)
            bad = np.isin(pair_keys(users, pool, n_items), self._own)
        return pool

    def _negatives(self, t: int, sampled: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
        """Step 3 at the server: each sampled client's semi-hard negatives (``[T]``; none, ``[0]``,
        for a client without a cached embedding), recorded as sent."""
        cfg = self.config
        cached = np.flatnonzero(self.has_cache)
        cent = np.zeros((self.train.n_users, cfg.dim))
        cent[cached] = cluster_centroids(self.cache[cached], cfg.clusters, cfg.clustering, self.rng)[0]
        item = self.model.item.detach().double().numpy()
        neg = sample_semi_hard(hard_candidates(cent[sampled], item, cfg.hard_percent), cfg.semi_hard,
                               cfg.semi_hard_mode, self.rng)
        keep = self.transport.transcript.keep_payloads
        out = {}
        for c, u in enumerate(sampled.tolist()):
            mine = neg[c].copy() if self.has_cache[u] else np.zeros(0, np.int64)  # no cache: no semi-hard
            self.transport.send(SERVER, client(u), t, "negatives", mine.copy() if keep else None, 4 * len(mine))
            out[u] = {"negatives": mine}
        return out

    def _client_negatives(self, users: np.ndarray, per_user: Mapping[int, Mapping[str, np.ndarray]]
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The client's side of step 3: ``(negatives [m, T], kept [m, T], dropped [m])``.

        Each client drops received negatives in its own history (notes 8.6); ``dropped`` counts
        them. A client that received none (``[0]``) gets an all-masked row (the same loss as no
        semi-hard negatives: masked logits add exactly zero to the softmax)."""
        n_items = self.train.n_items
        rows = []
        for u in users.tolist():
            got = per_user.get(u, {}).get("negatives")
            if got is None:
                raise ValueError(f"user {u}: the train step needs its semi-hard negatives")
            got = np.asarray(got)
            if got.ndim != 1 or got.dtype.kind not in "iu" or (got.size and (got.min() < 0 or got.max() >= n_items)):
                raise ValueError(f"user {u}: semi-hard negatives must be item ids in [0, {n_items}); found "
                                 f"{got.dtype} {got.shape}")
            rows.append(got.astype(np.int64))
        width = max((len(r) for r in rows), default=0)
        neg = np.zeros((len(users), width), np.int64)
        sent = np.zeros((len(users), width), bool)
        for c, r in enumerate(rows):
            if len(r) not in (0, width):
                raise ValueError(f"user {users[c]}: {len(r)} semi-hard negatives where the others have {width}")
            neg[c, : len(r)], sent[c, : len(r)] = r, True
        own = _in_sorted(pair_keys(np.broadcast_to(users[:, None], neg.shape), neg, n_items), self._own) & sent
        return neg, sent & ~own, own.sum(1)

    def _local_picks(self, users: np.ndarray, t: int, positions: int) -> np.ndarray:
        """Each client's local negatives of round ``t``: ``[m, positions, local_negatives]`` indices
        into its pool, from its own keyed stream (recmodels.streams), so a client alone draws what
        it draws in a cohort."""
        keys = stream_keys(self.seed, _STREAM_PICKS, t, np.asarray(users, np.int64))[:, None, None]
        k = self.config.local_negatives
        return integers(keys, np.arange(positions * k).reshape(1, positions, k), self.config.local_pool)
