"""FedCL's client half (:class:`protocols.fedcl.FedCL`'s device steps), as a mixin.

What a client does in each exchange of a round (its LDP embedding upload, its local training and
gradient), its refusals (the upload policy, enforced from its own record), and what stays on its device.
The losses themselves are :meth:`protocols.fedcl.FedCL.client_losses`. Split out of :mod:`protocols.fedcl`
to keep that module readable; nothing here is meant to be used without it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dp.ldp import ldp_laplace
from protocols.guard import RefusedStep, device_guard

__all__ = ["FedCLDevice"]


class FedCLDevice:
    """The client's half of :class:`protocols.fedcl.FedCL` (a mixin: it uses the trainer's state)."""

    # -- one round: the client's steps ----------------------------------------------------------
    def device_step(self, kind: str, round_: int, users: np.ndarray, broadcast: Mapping[str, np.ndarray],
                    per_user: Mapping[int, Mapping[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
        """The client's half (protocols.exchange): ``users`` on this trainer's own data."""
        users = np.asarray(users, np.int64)
        if kind == "embedding":
            guard = device_guard(self)
            unpaid = [u for u in users.tolist() if guard.ldp_round(u) != int(round_)]
            if unpaid:  # the charge comes first: no code path computes an upload its client has not counted
                raise ValueError(f"fedcl: the embedding uploads of users {unpaid[:5]} in round {int(round_)} were not "
                                 "admitted (and charged) by their guard; admit them first (protocols.exchange.admit)")
            self.load_device_model(broadcast)
            cfg = self.config
            with torch.no_grad():
                emb = self.user_embeddings(users).double().numpy()
            out = {}
            for u, e in zip(users.tolist(), emb):
                rel = ldp_laplace(e, clip_bound=cfg.clip, epsilon=cfg.epsilon, _test_source=self._source_for(u))
                out[u] = {"embedding": np.asarray(rel.values, np.float64)}
            return out
        if kind == "train":
            plain = self.config.secure_aggregation == "none"
            grads, losses, dropped = self._train(kind, round_, users, broadcast, per_user, summed=False,
                                                 extra=0 if plain else 2)
            if plain:
                return {u: {"gradient": grads[c], "loss": np.array(float(losses[c])),
                            "semi_hard_dropped": np.array(int(dropped[c]), np.int64)}
                        for c, u in enumerate(users.tolist())}
            vec = grads  # [gradient, loss, dropped]: the two columns were left for them (no concatenated copy)
            vec[:, -2], vec[:, -1] = losses, dropped
            return {u: {"vector": vec[c]} for c, u in enumerate(users.tolist())}
        raise ValueError(f"fedcl has no client step {kind!r}")

    def _train(self, kind: str, t: int, users: np.ndarray, broadcast: Mapping[str, np.ndarray],
               per_user: Mapping[int, Mapping[str, np.ndarray]], *, summed: bool, extra: int = 0
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step 4 for ``users``: ``(gradients float64 [m, n + extra] or their sum [n], losses [m], dropped [m])``
        (``extra`` zero columns for the caller, per client only);
        the ``"id"`` encoder's private rows take their local Adam step here."""
        cfg = self.config
        self.load_device_model(broadcast)
        neg = kept = None
        dropped = np.zeros(len(users), np.int64)
        if cfg.semi_hard:
            neg, kept, dropped = self._client_negatives(users, per_user)
        losses, rows, w = self.client_losses(users, neg, kept, per_client=not summed, t=t)
        if summed:
            g = torch.autograd.grad(losses.sum(), self.params + ([rows] if rows is not None else []))
            g_rows = g[-1] if rows is not None else None
            out = torch.cat([x.reshape(-1) for x in g[: len(self.params)]]).double().numpy()
        else:
            out, g_rows = self.client_gradients(losses, rows, w, extra=extra)
        if g_rows is not None:  # the private user rows: local Adam, never uploaded
            self._local_user_step(users, g_rows)
        return out, losses.detach().double().numpy(), dropped

    def device_ldp_epsilon(self, kind: str) -> float:
        """The local-DP epsilon one answer of step ``kind`` spends (:mod:`protocols.guard`, rule 6): the
        embedding upload's ``epsilon`` (the epsilon this client's own configuration adds noise for)."""
        return float(self.config.epsilon) if kind == "embedding" else 0.0

    def device_check(self, kind: str, round_: int, user: int, broadcast: Mapping[str, np.ndarray],
                     own: Mapping[str, np.ndarray], *, secure: bool) -> None:
        """FedCL's own refusals (before the step runs; the guard charges the upload and refuses it
        beyond the operator's ``ldp_epsilon_budget``). An embedding upload is refused:

        * by a client whose configuration uploads none (``semi_hard = 0``);
        * a second time in one round (each repeat is a fresh noisy copy: k of them average to the
          embedding with error ``1/sqrt(k)`` of one upload's);
        * before ``upload_every`` rounds have passed since the client's last upload;
        * past ``user_budget`` (basic composition over the client's own count).

        These are the configuration's own upload policy (the server half's ``_due``), enforced from
        the client's record. An honest server meets them only after an upload it asked for was lost
        on the way (the client counted it, the server did not). With both budgets the smaller holds.
        """
        if kind != "embedding":
            return
        cfg, t, guard = self.config, int(round_), device_guard(self)
        if not cfg.semi_hard:
            raise RefusedStep("fedcl: this configuration uploads no embedding (semi_hard = 0); refused")
        last = guard.ldp_round(user)
        if last == t:
            raise RefusedStep(f"fedcl: this client already uploaded its embedding in round {t}; a second noisy copy "
                              "is refused")
        if last >= 0 and t - last < cfg.upload_every:
            raise RefusedStep(f"fedcl: this client uploaded its embedding in round {last}; with fedcl.upload_every = "
                              f"{cfg.upload_every} the next is due in round {last + cfg.upload_every}; refused")
        spent = guard.ldp_spent(user)
        if cfg.user_budget and spent + cfg.epsilon > cfg.user_budget * (1 + 1e-12):
            raise RefusedStep(f"fedcl: an upload of epsilon {cfg.epsilon:g} would bring this client's spent epsilon "
                              f"from {spent:g} over fedcl.user_budget {cfg.user_budget:g}; refused")

    # -- the global model and the client's own state (protocols.exchange) -------------------------
    def device_requires_secure(self, kind: str) -> bool:
        """A client configured for secure aggregation sends its gradient (``"train"``) only through it;
        the embedding upload is plaintext by design (Laplace-noised on the device)."""
        return kind == "train" and self.config.secure_aggregation != "none"

    def device_model(self) -> dict[str, np.ndarray]:
        """The shared parameters a client needs (the ``"model"`` message): copies, by name."""
        w = self.model.shared_weights()
        return {k: w[k].detach().numpy().copy() for k in self._names()}

    def load_device_model(self, model: Mapping[str, np.ndarray]) -> None:
        """Install the server's shared parameters (checked: names, shapes, dtype, finite)."""
        w = self.model.shared_weights()
        names = self._names()
        if set(model) != set(names):
            raise ValueError(f"fedcl model: expected arrays {sorted(names)}; found {sorted(model)}")
        for k in names:
            a = np.asarray(model[k])
            if a.shape != tuple(w[k].shape) or a.dtype != np.float32 or not np.isfinite(a).all():
                raise ValueError(f"fedcl model: {k!r} must be finite float32 {tuple(w[k].shape)}; found {a.dtype} {a.shape}")
        with torch.no_grad():
            for k in names:
                w[k].copy_(torch.from_numpy(np.asarray(model[k])))

    def device_state(self, user: int) -> dict[str, np.ndarray]:
        """What stays on ``user``'s device: the ``"id"`` encoder's private row and its Adam state."""
        if self.config.encoder != "id":
            return {}
        u = int(user)
        return {"user": self.user[u].numpy().copy(), "m": self.user_m[u].numpy().copy(),
                "v": self.user_v[u].numpy().copy(), "steps": np.array(float(self.user_steps[u]), np.float32)}

    def load_device_state(self, user: int, state: Mapping[str, np.ndarray]) -> None:
        if self.config.encoder != "id":
            if state:
                raise ValueError(f"fedcl {self.config.encoder!r} clients keep no state; found {sorted(state)}")
            return
        u = int(user)
        self.user[u] = torch.as_tensor(state["user"])
        self.user_m[u], self.user_v[u] = torch.as_tensor(state["m"]), torch.as_tensor(state["v"])
        self.user_steps[u] = float(state["steps"])
