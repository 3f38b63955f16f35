"""FEL's FL over-arch (``over_arch_training = "fl"``): the server's FedSGD steps of a round and the
client's side of each step, as a mixin of :class:`protocols.fel.FelTrainer`.

Each sampled client computes its features on its device (its own leaf's vector, folded-in vectors for
the other leaves; its positives plus negatives from its own keyed stream) and uploads one gradient; the
DP parts (clipping, noise, accounting) are :mod:`protocols.fel_overarch`'s. On Flower the step hook
:meth:`FelOverArchFL._device_step` is bound to the exchange with the cohort's nodes
(:class:`fedflower.grid_trainer.GridTrainer`). Split out of :mod:`protocols.fel` to keep that module
readable; nothing here is meant to be used without it.
"""

from __future__ import annotations

import numpy as np
import torch

from dp.clipping import clip_rows_l2
from dp.events import NonPrivate
from protocols.base import Release
from protocols.fel_overarch import OVER_ARCH_COHORT, client_gradients, over_arch_release
from protocols.transport import SERVER, client
from recmodels.data import pair_keys
from recmodels.ensemble import OverArch
from recmodels.sampling import sample_negatives_keyed
from recmodels.streams import stream_keys

__all__ = ["FelOverArchFL"]


class FelOverArchFL:
    """The FL over-arch's rounds and client steps of :class:`protocols.fel.FelTrainer` (a mixin: it uses the
    trainer's state)."""

    def _over_arch_fl_round(self, t: int) -> tuple[float, tuple[Release, ...], list[str]]:
        """``over_arch_steps`` FedSGD steps of the over-arch over its population (DP-FedSGD under ``dp``).

        Each sampled client computes its features on the device (its own leaf's vector, folded-in
        vectors for the other leaves; its positives plus negatives from its own keyed stream) and
        uploads one gradient (:meth:`over_arch_upload`; the cohort's uploads are gathered by the
        :meth:`_device_step` hook, which runs them here in-process and, on Flower, on the clients'
        nodes). Without DP: the gradient of its summed loss, in plaintext, with its loss sum and
        example count; the server divides the cohort's sum by its example count and steps Adam.
        Under DP: :mod:`protocols.fel_overarch`. The round's ``over_arch_loss`` is the mean over the
        steps of the cohort's loss at the model the step's gradients were taken at. Returns that loss,
        the steps' releases and, in words, the steps the clients refused to unmask (not applied; under
        distributed noise ``simulate_dropout`` drops that fraction of each step's cohort before its
        masked input, from the seeded stream ``(seed, 13, 5, t, step)``).
        """
        cfg, model, dp = self.config, self.over_arch, self._oa_dp
        self._oa_vecs = None  # (the leaves changed: the ensemble's user vectors are recomputed)
        rng = np.random.default_rng([self.seed, 13, 3, t])
        nbytes = 4 * sum(p.numel() for p in model.parameters())
        pop = self.over_arch_population
        losses, m = [], min(cfg.over_arch_clients, len(pop))
        releases: list[Release] = []
        refused: list[str] = []
        node_floor = getattr(getattr(self, "device_policy", None), "min_survivors", 2)
        mode, cohort_label = cfg.over_arch_composition, (OVER_ARCH_COHORT if cfg.over_arch_composition == "parallel"
                                                         else None)
        for step in range(cfg.over_arch_steps):
            cohort = dp.sample(pop, rng) if dp is not None else np.sort(rng.choice(pop, size=m, replace=False))
            for u in cohort:  # the model down
                self.transport.send(SERVER, client(u), t, "over-arch", None, nbytes)
            kept, grads, loss_sums, counts = self._device_step(t, step, np.asarray(cohort, np.int64))
            if dp is None:
                for u in kept:  # one gradient (the sum over the client's examples) up, in plaintext
                    self.transport.send(client(u), SERVER, t, "over-arch-update", None, nbytes + 4)
                flat = torch.as_tensor(grads.sum(0) / max(float(counts.sum()), 1.0), dtype=torch.float32)
                self._adam.step(list(model.parameters()), self._unflatten(flat))
                releases.append(over_arch_release(NonPrivate(), composition=mode, cohort=cohort_label,
                                                  params={"clients": len(kept), "step": step}))
            else:  # (the rows were clipped by each client: over_arch_clip)
                drop = None
                if dp.mode == "distributed" and cfg.simulate_dropout > 0 and len(kept):
                    n_drop = int(round(cfg.simulate_dropout * len(kept)))
                    drop = np.sort(np.random.default_rng([self.seed, 13, 5, t, step]).choice(
                        len(kept), size=n_drop, replace=False))
                total, z_eff, extra = dp.noisy_sum(grads, kept, t=t, transport=self.transport, preclipped=True,
                                                   secagg_dropout=cfg.secagg_dropout, secagg_corrupt=cfg.secagg_corrupt,
                                                   drop=drop, node_floor=node_floor)
                if self._oa_clipped is not None:  # (in-process the simulation knows whose gradient was clipped)
                    extra = {"clipped_fraction": self._oa_clipped, **extra}
                why = extra.pop("refused", None)
                if why is not None:
                    refused.append(f"over-arch round {t} step {step}: {why}")
                else:
                    flat = torch.as_tensor(total / dp.expected, dtype=torch.float32)
                    self._adam.step(list(model.parameters()), self._unflatten(flat))
                params = {"clients": len(cohort), "step": step, "clip": dp.clip, "noise_multiplier": z_eff,
                          "noise": dp.mode, "sampling": dp.sampling, "denominator": dp.expected,
                          "population": dp.population, "q": dp.q, **extra}
                if why is None or "survivors" in extra:  # (a refused step that was unmasked is accounted too)
                    releases.append(over_arch_release(dp.event(z_eff), composition=mode, cohort=cohort_label,
                                                      params=params))
            if counts.sum():
                losses.append(float(loss_sums.sum() / counts.sum()))
        return float(np.mean(losses)) if losses else 0.0, tuple(releases), refused

    def _unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, lo = [], 0
        for p in self.over_arch.parameters():
            out.append(flat[lo:lo + p.numel()].reshape(p.shape))
            lo += p.numel()
        return out

    # -- the over-arch step's client side (on Flower: the node; see fedflower.apps.GridTrainer) ---
    #: what a node is asked to run besides its unit's round (the training request's ``step``)
    device_step_name = "over-arch"

    def _device_step(self, t: int, step: int, cohort: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                            np.ndarray]:
        """The cohort's uploads of over-arch step ``(t, step)``: ``(kept, rows, loss sums, example counts)``.

        In-process every client of ``cohort`` computes its upload here (:meth:`over_arch_upload`,
        batched: each client's row depends only on its own examples). On separate devices this hook
        is bound to the exchange with the cohort's nodes, which returns the clients whose replies
        were valid (``kept``, a subset of ``cohort`` in its order) and their uploads.
        """
        rows, loss, counts = self.over_arch_upload(cohort, t, step, self.over_arch)
        if self._oa_dp is not None:  # each client's own clip (DP-FedSGD), as on its device
            self._oa_clipped = 0.0
            if len(cohort):
                rows, scales = clip_rows_l2(rows, self.config.over_arch_clip)
                self._oa_clipped = float(np.mean(scales < 1))
        return cohort, rows, loss, counts

    def step_clip(self) -> float | None:
        """The L2 bound every client's over-arch upload is clipped to on its device (``None``: no DP)."""
        return float(self.config.over_arch_clip) if self.config.dp != "none" else None

    def step_model(self) -> dict[str, torch.Tensor]:
        """The over-arch's parameters the step's clients compute their gradients at (``{}``: no FL over-arch)."""
        if self.over_arch is None or self.config.over_arch_training != "fl":
            return {}
        return {name: p.detach() for name, p in self.over_arch.named_parameters()}

    def device_step_upload(self, user: int, t: int, step: int, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray,
                                                                                                     float, int]:
        """One client's half of over-arch step ``(t, step)`` on its device (its data only, every leaf's
        global arrays and its own leaf vector installed): its gradient row at the server's over-arch
        ``arrays``, its loss sum and its example count (:meth:`over_arch_upload`)."""
        if self.config.over_arch_training != "fl" or self.config.combiner != "over-arch":
            raise ValueError("this FEL configuration trains no FL over-arch; refusing an over-arch step")
        model = self.load_step_model(arrays)
        rows, loss, counts = self.over_arch_upload(np.array([int(user)], np.int64), int(t), int(step), model)
        if self.config.dp != "none":  # DP-FedSGD: the gradient of its mean loss, clipped here, on the device
            rows, _ = clip_rows_l2(rows, self.config.over_arch_clip)
        return rows[0], float(loss[0]), int(counts[0])

    def install_step_model(self, arrays: dict[str, np.ndarray]) -> None:
        """Install the server's over-arch on the device half (its scoring then uses it, as in-process)."""
        self.over_arch, self._cache = self.load_step_model(arrays), None

    def step_width(self) -> int:
        """Values of one client's over-arch gradient."""
        return int(self.config.n_clusters * (1 + self.config.dim) * self.config.over_arch_hidden
                   + 2 * self.config.over_arch_hidden + 1)

    def load_step_model(self, arrays: dict[str, np.ndarray]) -> OverArch:
        """An over-arch holding ``arrays`` (the server's :meth:`step_model`), each checked against its
        shape and dtype (float32) first; refuses missing or extra names."""
        cfg = self.config
        model = OverArch(cfg.n_clusters * (1 + cfg.dim), cfg.over_arch_hidden, seed=0)
        want = dict(model.named_parameters())
        if set(arrays) != set(want):
            raise ValueError(f"over-arch model names {sorted(arrays)}; expected {sorted(want)}")
        with torch.no_grad():
            for name, p in want.items():
                a = np.asarray(arrays[name])
                if a.dtype != np.float32 or a.shape != tuple(p.shape) or not np.isfinite(a).all():
                    raise ValueError(f"over-arch {name}: {a.dtype} {a.shape}; expected finite float32 "
                                     f"{tuple(p.shape)}")
                p.copy_(torch.from_numpy(np.array(a)))
        return model

    def over_arch_upload(self, who: np.ndarray, t: int, step: int, model: OverArch) -> tuple[np.ndarray, np.ndarray,
                                                                                            np.ndarray]:
        """What each client of ``who`` uploads in over-arch step ``(t, step)``, computed from its own data.

        Its features (:meth:`_features`: its own leaf's vector, folded-in vectors for the other
        leaves) on its positives plus ``over_arch_negatives`` negatives each from its own keyed
        stream (:meth:`_over_arch_examples`), so a client alone computes exactly its row of a
        batch. Returns float64 ``[len(who), width]`` gradients (of the summed loss without DP; of
        the mean loss under DP, unclipped), the loss sums ``[len(who)]`` at ``model`` and the
        example counts ``[len(who)]``.
        """
        who = np.asarray(who, np.int64)
        width = sum(p.numel() for p in model.parameters())
        if len(who) == 0:
            return np.zeros((0, width)), np.zeros(0), np.zeros(0, np.int64)
        if self._oa_vecs is None:
            self._oa_vecs = [self._leaf_users(leaf) for leaf in self.leaves]
        users, items, labels = self._over_arch_examples(who, t, step)
        with torch.no_grad():
            _, z = self._features(self._oa_vecs, torch.as_tensor(users), torch.as_tensor(items))
            y = torch.as_tensor(labels, dtype=torch.float32)
            slot = np.searchsorted(who, users)
            grads = client_gradients(model, z, y, slot, len(who),
                                     reduction="sum" if self.config.dp == "none" else "mean").numpy()
            per_example = torch.nn.functional.binary_cross_entropy_with_logits(model(z), y, reduction="none")
        loss = np.bincount(slot, weights=per_example.double().numpy(), minlength=len(who))
        return grads, loss, np.bincount(slot, minlength=len(who)).astype(np.int64)

    def _over_arch_examples(self, who: np.ndarray, t: int, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``who``'s training positives plus ``over_arch_negatives`` negatives each: users, items, labels.

        The negatives of user ``u`` in over-arch step ``(t, step)`` come from its own keyed stream
        ``(seed, 13, 3, t, step, u)`` (:mod:`recmodels.streams`), never one of its positives or
        excluded pairs: a client computing its upload alone draws what it draws in the batch.
        """
        cfg, n_items = self.config, self.train.n_items
        counts = self._pos_start[who + 1] - self._pos_start[who]
        users = np.repeat(who, counts)
        items = np.concatenate([self._pos_items[self._pos_start[u]:self._pos_start[u + 1]] for u in who])
        items = items.astype(np.int64)
        labels = np.ones(len(items))
        n_neg = cfg.over_arch_negatives
        if n_neg and len(items):
            ex = self.exclude
            excl = (pair_keys(ex.users, ex.items, n_items) if ex is not None and len(ex) else np.zeros(0, np.int64))
            forbidden = np.union1d(pair_keys(users, items, n_items), excl)
            neg_users = np.repeat(who, counts * n_neg)
            first = np.concatenate([[0], np.cumsum(counts * n_neg)])[:-1]
            index = np.arange(len(neg_users)) - np.repeat(first, counts * n_neg)  # the j-th negative of its user
            keys = stream_keys(self.seed, 13, 3, t, step, neg_users)
            neg_items = sample_negatives_keyed(neg_users, keys, index.astype(np.int64), n_items=n_items,
                                               forbidden=forbidden)
            users, items = np.concatenate([users, neg_users]), np.concatenate([items, neg_items])
            labels = np.concatenate([labels, np.zeros(len(neg_items))])
        return users, items, labels
