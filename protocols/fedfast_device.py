"""FedFast's client half (:class:`protocols.fedfast.FedFastGMF`'s device steps), as a mixin.

What one client (or every client at once, in process) does in each named exchange of a FedFast round:
its refusals (:meth:`FedFastDevice.device_check`), its step (:meth:`FedFastDevice.device_step`) and the
update vector it sums in the secure variant. Split out of :mod:`protocols.fedfast` to keep that module
readable; :class:`protocols.fedfast.FedFastGMF` is the only class meant to use it, and every name here
stays importable from :mod:`protocols.fedfast`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from protocols.fedavg import LocalRound
from protocols.fedfast_cluster import _PROFILE, _USER, actvagg_weights, assign_clusters
from protocols.guard import RefusedStep

__all__ = ["FedFastDevice"]


class FedFastDevice:
    """The client's half of :class:`protocols.fedfast.FedFastGMF` (a mixin: it uses the trainer's state)."""

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
