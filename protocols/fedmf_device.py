"""FedMF's client half (:class:`protocols.fedmf.FedMF`'s device steps), as a mixin.

What a client does in each exchange of a round (its rated item ids, its update, the re-encryption of the
model under HE, its loss), its refusals, what stays on its device and the model it scores with. The upload
itself (LDP noise, encryption) is :meth:`protocols.fedmf.FedMF._client_upload`. Split out of
:mod:`protocols.fedmf` to keep that module readable; nothing here is meant to be used without it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from protocols.fedmf_he import _ct_arrays, _ct_from
from protocols.guard import RefusedStep
from recmodels.mf import local_updates

__all__ = ["FedMFDevice"]


class FedMFDevice:
    """The client's half of :class:`protocols.fedmf.FedMF` (a mixin: it uses the trainer's state)."""

    # -- one round: the client's half ------------------------------------------------------------
    def device_step(self, kind: str, round_: int, users: np.ndarray, broadcast: Any, per_user: Any) -> dict:
        """Run client step ``kind`` for ``users`` on this trainer's rows (batched; see the module docstring)."""
        tc = time.perf_counter()
        users = np.asarray(users, np.int64)
        missing = [int(u) for u in users if self.lists.counts[u] == 0]
        if missing:
            raise ValueError(f"FedMF client step {kind!r}: no training ratings here for users {missing[:5]}.")
        if kind == "items":
            out = {int(u): {"items": self.lists.items[u, : self.lists.counts[u]].copy()} for u in users}
        elif kind == "train":
            out = self._train_step(int(round_), users, broadcast)
        elif kind == "refresh":
            out = {}
            for u in users.tolist():
                q_next = self._decrypt_model(_ct_from(per_user[u], self.config.variant, self.n_items))
                out[u] = _ct_arrays(self._encrypt_model(q_next))
        elif kind == "loss":
            out = self._loss_step(users, broadcast)
        else:
            raise ValueError(f"FedMF has no client step {kind!r}.")
        self._client_seconds += time.perf_counter() - tc
        return out

    def _received_model(self, broadcast: Any) -> np.ndarray:
        """The plaintext item matrix of a broadcast (an HE client decrypts it)."""
        if self.config.defense in ("paillier", "ckks"):
            q = self._decrypt_model(_ct_from(broadcast, self.config.variant, self.n_items))
            self._q_clients = q
            return q
        q = broadcast["q"]
        if q.shape != (self.n_items, self.dim) or q.dtype != np.float64 or not np.isfinite(q).all():
            raise ValueError(f"the broadcast item matrix must be finite float64 {(self.n_items, self.dim)}.")
        return q

    def _train_step(self, round_: int, users: np.ndarray, broadcast: Any) -> dict:
        cfg = self.config
        q_t = self._received_model(broadcast)
        p_new, delta = local_updates(self.p[users], q_t, self.lists, cfg.mf, users=users)
        self.p[users] = p_new
        self._trained[users] = round_
        out = {}
        for i, u in enumerate(users.tolist()):
            up = self._client_upload(u, delta[i], round_)
            if cfg.defense == "secagg":  # the dense values, masked by the secure sum (ids went in "items")
                if up.items is None:
                    dense = up.body
                else:
                    dense = np.zeros((self.n_items, self.dim))
                    dense[up.items] = up.body
                out[u] = {"vector": dense.ravel()}
                continue
            reply = {} if up.items is None else {"items": up.items}
            if isinstance(up.body, np.ndarray):
                reply["delta"] = up.body
            else:
                reply.update(_ct_arrays(up.body))
            out[u] = reply
        return out

    def _loss_step(self, users: np.ndarray, broadcast: Any) -> dict:
        """Each user's ``[mean squared error, 1, non-finite flag]`` under the broadcast model.

        The client's own mean (not its squared-error sum and rating count): a count would be the
        same in every round, so loss sums over survivor sets that differ in one client would give
        that client's number of ratings (exactly what FedMF's full variant hides)."""
        q = self._received_model(broadcast)
        lists, out = self.lists, {}
        for u in users.tolist():
            k = int(lists.counts[u])
            pred = np.clip(self.p[u] @ q[lists.items[u, :k]].T, *self.scale)
            mse = float(np.mean((pred - lists.ratings[u, :k]) ** 2))
            bad = not math.isfinite(mse)
            out[u] = {("loss" if self.config.defense == "none" else "vector"):
                      np.array([0.0 if bad else mse, 0.0 if bad else 1.0, float(bad)])}
        return out

    # -- what stays on a device, and what a device needs to score ---------------------------------
    def device_check(self, kind: str, round_: int, user: int, broadcast: Any, own: Any, *, secure: bool) -> None:
        """FedMF's own refusal (before the step runs; :mod:`protocols.guard` has the general rules):
        a secure loss is sent only in a round the client trained in. Its loss depends on its own
        ``p_u`` and the broadcast model; without training in between, a server holding the model
        still could ask it in two rounds and get the same vector twice (two sums over cohorts that
        differ in that client would be its loss and its number of ratings)."""
        if kind == "loss" and secure and int(self._trained[int(user)]) != int(round_):
            raise RefusedStep(f"fedmf: the loss of round {int(round_)} is sent only after training in that round")

    def device_requires_secure(self, kind: str) -> bool:
        """Steps whose reply this configuration sends only through secure aggregation: the update
        under ``secagg``, the loss under every defense but ``none`` (a client asked for either in
        plaintext refuses)."""
        if kind == "train":
            return self.config.defense == "secagg"
        return kind == "loss" and self.config.defense != "none"

    def device_state(self, user: int) -> dict[str, np.ndarray]:
        """The client's own state: its user vector ``p_u`` (never sent) and the last round it trained in."""
        return {"p": self.p[int(user)].copy(), "trained": np.array(self._trained[int(user)], np.int64)}

    def load_device_state(self, user: int, state: Any) -> None:
        p = state["p"]
        if not isinstance(p, np.ndarray) or p.shape != (self.dim,) or not np.isfinite(p).all():
            raise ValueError(f"a FedMF client state is a finite float vector of {self.dim}.")
        if set(state) - {"p", "trained"}:
            raise ValueError(f"a FedMF client state holds 'p' and 'trained'; found {sorted(state)}.")
        trained = np.asarray(state.get("trained", np.array(-1)))
        if trained.shape != () or trained.dtype.kind not in "iu":
            raise ValueError("a FedMF client state's 'trained' is one integer round.")
        self.p[int(user)] = p
        self._trained[int(user)] = int(trained)

    def device_model(self) -> dict[str, np.ndarray]:
        """The global arrays a client scores with: ``Q``, or ``Enc(Q)`` as uint8 arrays under HE."""
        return self._model_message()[1]

    def load_device_model(self, model: Any) -> None:
        if self.config.defense in ("paillier", "ckks"):
            self._received_model(model)
        else:
            self.q = self._received_model(model).copy()
