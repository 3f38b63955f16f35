"""FEL's leaf trainer: FedAvg-GMF on one cluster, with optional DP-FedAvg (notes §2.2, §2.5, §8.1-8.3).

A leaf is :class:`protocols.fedavg.FedAvgGMF` restricted to its cluster's clients (local training
is FedAvg's, unchanged); only the aggregation step differs when DP is on:

1. every sampled client's update ``(dQ, dh, db)`` (unweighted) is clipped to L2 norm ``clip``;
2. the clipped updates are summed, plus Gaussian noise of standard deviation ``z * clip``:
   * ``central``: the aggregator adds ``N(0, (z clip)^2)`` (CSPRNG float noise) to the sum, which
     is plaintext or comes out of SecAgg/SecAgg+ (a trusted aggregator, e.g. a TEE: notes §8.3);
   * ``distributed``: each client adds discrete Gaussian noise on the fixed-point grid
     (:func:`dp.discrete.discrete_gaussian_noise`) before masking, sized so that the noise of the
     *honest* survivors alone reaches the target: of ``S = ceil((1 - dropout_margin) m)``
     survivors, up to ``C = floor(secagg_corrupt m)`` may collude with the server (SecAgg's threat
     model) and subtract their own shares, so each share is ``z Delta / sqrt(S - C)`` and a
     configuration with ``S - C < 1`` is refused. The sum goes through SecAgg/SecAgg+
     (:func:`protocols.secure_sum.secure_sum`), so no party ever sees a sum with less noise. A
     release over ``n`` survivors is accounted with ``z_eff = sqrt(n - C) sigma / Delta``, the noise
     left once the colluders' shares are removed (collusion bound: at most ``C`` of a round's
     clients, ``m`` the planned cohort, the number SecAgg+'s parameters are chosen for). The L2
     sensitivity on the grid is ``clip 2^f + sqrt(width)/2`` (nearest rounding of each
     coordinate); the value clip budgets ``noise_tail`` standard deviations.
     If more clients drop than the margin, the round is refused (``on_excess_dropout="refuse"``)
     or accounted with the noise that actually survived (``"reaccount"``): never silently
     under-noised. The refusal happens *inside* the secure aggregation: every client puts its
     own floor (:meth:`FelLeaf.survivor_floor`, computed by the client from its configuration
     and its leaf's public size, never a survivor count the server sends) into the sum's
     survivor check, so a survivor set below it is never signed and never unmasked; the round
     is then not applied, its stats say so (``extra["refused"]``) and it releases nothing.
3. the server applies ``server_lr * noisy_sum / m`` with the fixed denominator ``m`` (the
   expected cohort size), so the update's sensitivity does not depend on who took part.

Sampling readings (notes §8.2), both labelled in every release's params: ``"fixed"`` (FedAvg's
fixed-size cohort; every round is accounted as an unamplified Gaussian release, sequential within
the leaf) or ``"poisson"`` (each client joins w.p. ``q = m / N_c``; the sampled-Gaussian accountant).
Every release carries ``cohort="leaf:<c>"`` so the ledger composes leaves in parallel. Poisson
amplification protects against observers of the released models, not against the server that
ran the round (it knows the cohort); docs/fel.md.

What the server releases per leaf and round is in the transcript as one ``"leaf-model"`` record
(``server -> leaf:<c>``, 0 bytes: the bytes are the per-client ``"model"`` downloads), whose
payload, when the transcript keeps it, is a :class:`LeafModel`: the leaf's flat model
``item | h | b`` before and after the round's update. That is the DP-protected output;
:mod:`attacks.fel` tests it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dp.clipping import clip_rows_l2
from dp.discrete import discrete_gaussian_noise
from dp.events import DpEvent, Gaussian, NonPrivate, PoissonSampled
from dp.mechanisms import gaussian_noise
from protocols.base import Release
from protocols.fedavg import FedAvgConfig, FedAvgGMF
from protocols.secure_sum import SecureSumAborted, secure_sum
from protocols.transport import SERVER, Record, client
from recmodels.ensemble import fold_in

__all__ = ["LEAF_MODEL_KIND", "DpSettings", "FelLeaf", "LeafModel", "colluders"]

#: Transcript kind of the per-round leaf release (see the module docstring).
LEAF_MODEL_KIND = "leaf-model"


@dataclass(frozen=True)
class LeafModel:
    """A leaf's released model around one round: flat float32 ``item (n_items x dim) | h | b``.

    Attributes:
        leaf: the cluster index.
        round: the round whose update turned ``before`` into ``after``.
        before: the model the round's cohort downloaded.
        after: the model after the server applied the round's (noisy) aggregate.
    """

    leaf: int
    round: int
    before: np.ndarray
    after: np.ndarray


def colluders(corrupt: float, m: int) -> int:
    """The collusion bound of a cohort of ``m`` planned clients: ``floor(corrupt m)`` (as
    :mod:`secagg.params` counts it), the clients whose noise shares the server may know."""
    return math.floor(corrupt * m + 1e-9)


class DpSettings:
    """The DP knobs of one leaf (validated by :class:`protocols.fel.FelConfig`)."""

    def __init__(self, *, mode: str, clip: float, noise_multiplier: float, sampling: str,
                 dropout_margin: float, simulate_dropout: float, on_excess_dropout: str, noise_tail: float,
                 corrupt: float) -> None:
        self.mode, self.clip, self.z, self.sampling = mode, clip, noise_multiplier, sampling
        self.dropout_margin, self.simulate_dropout = dropout_margin, simulate_dropout
        self.on_excess_dropout, self.noise_tail = on_excess_dropout, noise_tail
        #: the fraction of a round's clients that may collude with the server (``secagg_corrupt``)
        self.corrupt = corrupt


class FelLeaf(FedAvgGMF):
    """One cluster's leaf: FedAvg-GMF on ``clients`` with its releases labelled ``leaf:<index>``.

    Args:
        index: the cluster index (the ledger cohort is ``"leaf:<index>"``).
        dp: DP-FedAvg settings, or ``None`` for FedAvg's own aggregation (no DP).
        population: the leaf's client pool size when it is not ``len(clients)`` (a client's half
            on its own device: :meth:`protocols.fel.FelTrainer.on_device`); it fixes ``m`` and
            hence the client's noise share.
        (the rest as :class:`protocols.fedavg.FedAvgGMF`.)
    """

    def __init__(self, train, config: FedAvgConfig, *, index: int, dp: DpSettings | None, seed: int,
                 transport, exclude, clients: np.ndarray, population: int | None = None) -> None:  # noqa: ANN001
        super().__init__(train, config, seed=seed, transport=transport, exclude=exclude, clients=clients)
        self.index, self.dp = index, dp
        self.width = train.n_items * config.dim + config.dim + 1 + self.extra_width(config.dim)
        # (``population``: the leaf's public pool size, given by a client's half on its own device,
        # whose pool is itself; the in-process leaf's pool is its cluster)
        pool = len(self._clients) if population is None else int(population)
        self.expected = config.clients_in_round(pool)  # the fixed denominator m
        self.q = self.expected / max(pool, 1)
        if dp is not None and dp.mode == "distributed":
            self.min_survivors = max(1, math.ceil((1 - dp.dropout_margin) * self.expected))
            self.colluders = colluders(dp.corrupt, self.expected)
            self.honest_survivors = self.min_survivors - self.colluders
            if self.honest_survivors < 1:
                raise ValueError(
                    f"fel.secagg_corrupt={dp.corrupt:g} and fel.dropout_margin={dp.dropout_margin:g} guarantee no "
                    f"honest survivor in leaf {index}: of its {self.expected} clients per round {self.min_survivors} "
                    f"must survive, and up to {self.colluders} may collude with the server and remove their noise "
                    "shares; lower one of them, or sample more clients per round")
            self.sens_grid = dp.clip * 2.0**config.frac_bits + math.sqrt(self.width) / 2
            self.sigma_client = dp.z * (self.sens_grid / 2.0**config.frac_bits) / math.sqrt(self.honest_survivors)
            need = dp.clip + dp.noise_tail * self.sigma_client
            if config.value_clip < need:
                raise ValueError(
                    f"fel.value_clip={config.value_clip:g} cannot hold a clipped update plus {dp.noise_tail:g} noise "
                    f"standard deviations ({need:.4g}) for leaf {index}; raise fel.value_clip")
        else:
            self.min_survivors, self.colluders, self.honest_survivors, self.sigma_client = 0, 0, 0, 0.0
        self._presampled: np.ndarray | None = None
        self._clip_scales: np.ndarray | None = None  # the last round's per-client clip factors, where known

    @classmethod
    def extra_width(cls, dim: int) -> int:
        """Parameters a subclass's update carries after ``dQ | dh | db`` (0 for GMF)."""
        return 0

    def forward_hidden(self, p: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last hidden layer p * q_i * h, logit)`` of user vectors ``p`` with ``items`` (GMF)."""
        hidden = p * self.item[items] * self.h
        return hidden, hidden.sum(-1) + self.b

    def fold_in_users(self, pos_start: np.ndarray, pos_items: np.ndarray, users: np.ndarray) -> torch.Tensor:
        """Vectors for ``users`` outside the cluster, fitted to this frozen leaf (:func:`recmodels.ensemble.fold_in`)."""
        return fold_in(self.item * self.h, pos_start, pos_items, users)

    @property
    def cohort(self) -> str:
        return f"leaf:{self.index}"

    def _sample_clients(self) -> np.ndarray:
        if self._presampled is not None:
            out, self._presampled = self._presampled, None
            return out
        if self.dp is not None and self.dp.sampling == "poisson":
            return self._clients[self.rng.random(len(self._clients)) < self.q]
        return super()._sample_clients()

    def flat_model(self) -> np.ndarray:
        """The leaf's server-side model as one float32 vector ``item | h | b``."""
        return np.concatenate([self.item.numpy().ravel(), self.h.numpy(), self.b.numpy().reshape(1)])

    def _keeps_release(self, t: int) -> bool:
        keep = self.transport.transcript.keep_payloads
        probe = Record(SERVER, self.cohort, t, LEAF_MODEL_KIND, 0, None)
        return bool(keep(probe) if callable(keep) else keep)

    def run_round(self):  # noqa: ANN201
        t = self.round
        before = self.flat_model() if self._keeps_release(t) else None
        stats = self._run_round()
        payload = None if before is None else LeafModel(self.index, t, before, self.flat_model())
        self.transport.send(SERVER, self.cohort, t, LEAF_MODEL_KIND, payload, 0)
        return stats

    def _run_round(self):  # noqa: ANN202
        if self.dp is not None and self.dp.sampling == "poisson":
            self._presampled = self._sample_clients()
            if self._presampled.size == 0:  # nobody sampled: the noise alone is still released
                self._presampled = None
                return self._empty_round()
        stats = super().run_round()
        rel = tuple(Release(r.event, who=r.who, what=f"leaf {self.index}: {r.what}", cohort=self.cohort,
                            params={**r.params, "leaf": self.index}) for r in stats.releases)
        return type(stats)(round=stats.round, loss=stats.loss, clients=stats.clients,
                           bytes_per_client=stats.bytes_per_client, seconds=stats.seconds,
                           extra=stats.extra, releases=rel)

    def _empty_round(self):  # noqa: ANN202
        from protocols.base import RoundStats

        t = self.round
        empty = np.zeros((0, self.width))
        total = empty.sum(0)
        if self.dp.z > 0:  # the server adds the noise (it knows the cohort is empty anyway)
            total = total + gaussian_noise(self.width, self.dp.z * self.dp.clip)
        self._apply_dp(total)
        self.round += 1
        z = self.dp.z
        rel = Release(self._event(z), who="server", what=f"leaf {self.index}: empty Poisson cohort, noise only",
                      cohort=self.cohort, params={"clients": 0, "leaf": self.index, "sampling": "poisson"})
        return RoundStats(round=t, loss=0.0, clients=0, releases=(rel,))

    # -- DP-FedAvg aggregation ----------------------------------------------------------------
    def client_vectors(self, sampled, pair_slot, pair_item, dQ, dH, dB) -> np.ndarray:  # noqa: ANN001
        """Each client's unweighted update ``dQ | dh | db`` as one dense row."""
        n_items, d, m = self.train.n_items, self.config.dim, len(sampled)
        out = np.zeros((m, n_items * d + d + 1))
        out[:, : n_items * d].reshape(m, n_items, d)[pair_slot, pair_item] = dQ.numpy()
        out[:, n_items * d : n_items * d + d] = dH.numpy()
        out[:, -1] = dB.numpy()
        return out

    def _event(self, z: float) -> DpEvent:
        if z <= 0:
            return NonPrivate()
        if self.dp.sampling == "poisson":
            return PoissonSampled(self.q, Gaussian(z))
        return Gaussian(z)

    def _aggregate(self, t, sampled, pair_slot, pair_item, dQ, dH, dB, weight):  # noqa: ANN001
        if self.dp is None:
            return super()._aggregate(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight)
        cfg, dp, m = self.config, self.dp, len(sampled)
        clipped, self._clip_scales = self.clip_rows(self.client_vectors(sampled, pair_slot, pair_item, dQ, dH, dB))
        total, upload, z_eff, extra = self._noisy_sum(t, sampled, clipped)
        refused = extra.pop("refused", None)
        if total is not None:
            self._apply_dp(total)
        label = ("fixed-size cohort, unamplified Gaussian per round" if dp.sampling == "fixed"
                 else "Poisson sampling, sampled Gaussian")
        params = {"clients": m, "clip": dp.clip, "noise_multiplier": z_eff, "noise": dp.mode,
                  "sampling": dp.sampling, "sampling_reading": label, "denominator": self.expected,
                  "population": int(len(self._clients)), "q": self.q, **extra}
        what = f"the clipped sum with {dp.mode} Gaussian noise (DP-FedAvg)"
        if self._clip_scales is not None:  # (None: the clients clipped on their devices, the server cannot know)
            extra["clipped_fraction"] = float(np.mean(self._clip_scales < 1)) if m else 0.0
        if refused is not None:  # not applied; released only if the server nevertheless decoded the sum
            extra["refused"] = refused
            if "survivors" not in params:
                return upload, (), extra
            what += ", decoded below the clients' floor and not applied"
        return upload, (Release(self._event(z_eff), who="clients", what=what, params=params),), extra

    # -- each client's own step (in-process for the whole cohort at once; on Flower on its device) --
    def clip_rows(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row (one client's unweighted ``dQ | dh | db``, :meth:`client_vectors`) clipped to
        L2 norm ``clip``: ``(clipped rows, scale factors)``."""
        return clip_rows_l2(vectors, self.dp.clip)

    def noise_share(self, clipped: np.ndarray) -> np.ndarray:
        """Under ``distributed`` noise with ``z > 0``: each row plus that client's discrete Gaussian
        share (standard deviation ``sigma_client`` on the ``2^-frac_bits`` grid, from the CSPRNG),
        added before masking; otherwise the rows unchanged."""
        dp, f = self.dp, self.config.frac_bits
        if dp.mode != "distributed" or dp.z <= 0:
            return clipped
        return clipped + discrete_gaussian_noise(clipped.shape, self.sigma_client, f).astype(np.float64) / 2.0**f

    def survivor_floor(self) -> int:
        """The fewest survivors this leaf's clients help unmask (each client's own floor, computed by
        the client from its configuration and its leaf's public size; never a survivor count the
        server sends. On Flower that configuration and size are the ones the node pinned, from its
        operator's ``protocol-config`` or the first run record it answered: docs/flower.md).

        Under distributed noise (``z > 0``) with ``on_excess_dropout = "refuse"``: ``min_survivors``,
        the survivors its noise share was sized for, so a sum with fewer shares is never unmasked;
        with ``"reaccount"``: ``colluders + 1`` (a sum whose every share the colluders could remove
        would release nothing private); at least SecAgg's own 2 (a sum of one client is its input).
        In process it goes to the simulated clients (:func:`protocols.secure_sum.secure_sum`'s
        ``min_survivors``); on Flower beside the client's vector (``"min_survivors"``,
        :func:`fedflower.secagg_mod.vector_floor`).
        """
        dp = self.dp
        if dp is None or dp.mode != "distributed" or dp.z <= 0:
            return 2
        if dp.on_excess_dropout == "refuse":
            return max(2, self.min_survivors)
        return max(2, self.colluders + 1)  # reaccount: never a sum without an honest client's share

    def device_inputs(self, vectors: np.ndarray) -> np.ndarray:
        """What a client masks under DP through secure aggregation: its :meth:`clip_rows`, then its
        :meth:`noise_share`. The Flower client half calls this on its own row
        (:func:`fedflower.adapter.client_secure_vector`); in-process the same two steps run in
        :meth:`_aggregate` and :meth:`_dp_secure_sum` on the cohort's rows."""
        return self.noise_share(self.clip_rows(vectors)[0])

    # -- the server's side ---------------------------------------------------------------------
    def _noisy_sum(self, t: int, sampled: np.ndarray, clipped: np.ndarray):
        """The round's noisy sum of the ``clipped`` rows: ``(total, upload bytes, effective z, release extras)``.

        ``total`` is ``None`` for a refused round (``extras["refused"]`` says why): nothing was unmasked,
        or (devices that did not enforce their floor) a sum below it was, which is then accounted
        (``extras`` has ``survivors``) but not applied.
        """
        cfg, dp = self.config, self.dp
        if dp.mode == "central":
            if cfg.secure_aggregation == "none" or len(sampled) == 0:
                total, upload = clipped.sum(0), 4.0 * self.width
                for u in sampled:
                    self.transport.send(client(u), "server", t, "update", None, 4 * self.width)
            else:
                total, upload, _ = self._dp_secure_sum(t, sampled, clipped, np.zeros(0, dtype=np.int64))
            if dp.z > 0:
                total = total + gaussian_noise(self.width, dp.z * dp.clip)
            return total, upload, dp.z, {}
        # distributed: discrete Gaussian on the grid, added by each client before masking
        f = cfg.frac_bits
        dropped = np.zeros(0, dtype=np.int64)
        if dp.simulate_dropout > 0 and len(sampled):
            n_drop = int(round(dp.simulate_dropout * len(sampled)))
            dropped = np.sort(self.rng.choice(len(sampled), size=n_drop, replace=False))
        floor = self.survivor_floor()
        try:
            total, upload, n_surv = self._dp_secure_sum(t, sampled, clipped, dropped)
        except SecureSumAborted as exc:  # the clients refused to unmask (their floor), or too many dropped
            return None, 0.0, 0.0, {"refused": (
                f"leaf {self.index} round {t}: {exc}; no sum was unmasked (the clients' floor: {floor} survivors, "
                f"the {self.min_survivors} the distributed noise was sized for under fel.dropout_margin="
                f"{dp.dropout_margin:g} and fel.on_excess_dropout = {dp.on_excess_dropout!r}); the round was not "
                "applied. Raise fel.dropout_margin or set fel.on_excess_dropout = \"reaccount\"")}
        honest = max(n_surv - self.colluders, 0)  # the colluders' shares are known to the server
        z_eff = math.sqrt(honest) * self.sigma_client * 2.0**f / self.sens_grid if dp.z > 0 else 0.0
        extra = {"survivors": n_surv, "dropped": len(sampled) - n_surv, "colluders": self.colluders,
                 "honest_survivors": honest, "sigma_client": self.sigma_client}
        if dp.z > 0 and n_surv < self.min_survivors and dp.on_excess_dropout == "refuse":
            # The clients' floor should have kept this sum masked (devices that do not enforce it): the
            # server holds it decoded, so it is released with the noise it holds, and not applied.
            extra["refused"] = (f"leaf {self.index} round {t}: {n_surv} of {len(sampled)} clients survived, below "
                                f"the {self.min_survivors} the distributed noise was sized for, yet the sum was "
                                "unmasked (the clients did not enforce their floor): accounted, not applied")
            return None, upload, z_eff, extra
        return total, upload, z_eff, extra

    def _dp_secure_sum(self, t: int, sampled: np.ndarray, clipped: np.ndarray, dropped: np.ndarray):
        """The ``clipped`` rows, each with its client's :meth:`noise_share`, summed through
        SecAgg/SecAgg+: ``(decoded sum over the survivors, upload bytes per client, survivors)``;
        the rows ``dropped`` drop before their masked input. Every client refuses to unmask a sum
        below ``max(survivor_floor(), its operator's min_survivors)``: then nothing is decoded and
        :class:`~protocols.secure_sum.SecureSumAborted` says how many masked inputs arrived. The
        Flower adapter binds this hook to the devices' secure sum (each device computed its own
        :meth:`device_inputs` and put its floor beside it)."""
        cfg = self.config
        node = getattr(getattr(self, "device_policy", None), "min_survivors", 2)  # (each client's operator's floor)
        try:
            res = secure_sum(self.noise_share(clipped), protocol=cfg.secure_aggregation, frac_bits=cfg.frac_bits,
                             value_clip=cfg.value_clip, round=t, transport=self.transport,
                             senders=[client(u) for u in sampled], where="fel.value_clip",
                             dropouts={"masked_input": frozenset(int(i) for i in dropped)} if dropped.size else None,
                             dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt,
                             min_survivors=max(self.survivor_floor(), node))
        except SecureSumAborted as exc:
            raise SecureSumAborted(f"{len(sampled) - len(dropped)} of {len(sampled)} clients stayed until their "
                                   f"masked input; {exc}") from None
        return res.total, res.bytes_per_client, len(res.survivors)

    def _apply_dp(self, total: np.ndarray) -> None:
        n_items, d, lr = self.train.n_items, self.config.dim, self.config.server_lr
        scale = lr / max(self.expected, 1)
        t = torch.as_tensor(total, dtype=torch.float32)
        self.item += scale * t[: n_items * d].reshape(n_items, d)
        self.h += scale * t[n_items * d : n_items * d + d]
        self.b += scale * t[-1]

    def dp_info(self) -> dict[str, Any]:
        """Public DP parameters of this leaf (for public_info and reports)."""
        return {"leaf": self.index, "clients": int(len(self._clients)), "denominator": self.expected, "q": self.q,
                "min_survivors": self.min_survivors, "colluders": self.colluders,
                "honest_survivors": self.honest_survivors, "survivor_floor": self.survivor_floor() if self.dp else 2,
                "sigma_client": self.sigma_client}
