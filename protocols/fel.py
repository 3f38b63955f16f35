"""FEL: federated ensemble of leaf models on disjoint client clusters (Hejazinia et al. 2022).

Parties:
    * one client per user, holding its interactions (the private labels) and, per leaf, its user
      embedding; a fraction ``opt_in_fraction`` of users opt in to share their labels with the server;
    * the server, which clusters the clients on public attributes only, runs one FedAvg per cluster
      (a *leaf*), and combines the leaves (mean / median / max of their probabilities, or an
      over-arch MLP trained on the opt-in users with the leaves frozen).

Round ``t``: every leaf runs one FedAvg round on its own cluster (the leaves are interleaved, each
with its own cohort, model and SecAgg session). Opt-in users never train a leaf (notes §8.5).

Adversary and promise: an honest-but-curious server. Without DP nothing beyond data locality and,
with ``secure_aggregation``, FedAvg's promise per leaf (the server learns only each leaf's sum).
With ``dp = "central"`` or ``"distributed"`` each leaf is DP-FedAvg (:mod:`protocols.fel_leaf`):
every released leaf model is ``(epsilon_c, delta)``-DP at the user level, and because the clusters
are disjoint (a user is in exactly one leaf, by construction: :mod:`recmodels.clusters`) the
ensemble is ``(max_c epsilon_c, delta)``-DP (parallel composition; FEL Theorem 2). The over-arch
trained on opt-in users costs the leaves' users nothing (notes §2.6); trained by FL under DP
(:mod:`protocols.fel_overarch`) it adds its own ``epsilon_o``: sequentially for the leaves' users
(``over_arch_composition = "sequential"``) or in parallel when it trains on held-out users only. Limits: the cluster
assignment, the cluster sizes and everything derived from public features are public; the
opt-in users' labels are disclosed to the server (they consented); with ``"central"`` noise the
aggregator is trusted to add it (a TEE); Poisson amplification does not hold against the server
that chose the cohort.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch

from protocols.fedavg import FedAvgConfig
from protocols.fel_leaf import DpSettings, FelLeaf
from protocols.fel_ncf import NcfLeaf
from protocols.fel_overarch import OVER_ARCH_COHORT, OverArchDp
from protocols.fel_overarch_fl import FelOverArchFL
from protocols.registry import DeviceSplit, ProtocolSpec, register
from protocols.base import RoundStats
from recmodels import clusters as clmod
from recmodels.ensemble import COMBINERS, OverArch, ServerAdam, combine, train_over_arch
from recmodels.sampling import sample_train_negatives

__all__ = ["FelConfig", "FelTrainer", "check_device_split", "fel_privacy_report"]

_CLUSTERING = ("hash", "attribute", "kmeans")
_DP = ("none", "central", "distributed")


@dataclass(frozen=True)
class FelConfig(FedAvgConfig):
    """The ``[fel]`` section: every ``[fedavg]`` key (the leaves' FedAvg; ``dim`` defaults to 16), and:

    Attributes:
        clustering: ``"hash"`` (sha256 of the raw user id), ``"attribute"`` (one demographic
            attribute) or ``"kmeans"`` (over one-hot demographics); public inputs only.
        n_clusters: number of leaves (1: the FL baseline).
        leaves: ``"clusters"`` (FEL: leaf ``c`` trains on cluster ``c`` only) or ``"bag"`` (the control
            of issue 25: ``n_clusters`` unclustered models, each leaf trained on every non-opt-in
            user, differing only by their seeds (initialisation and cohorts), combined exactly as
            FEL's leaves; no DP, in process only: a user in every leaf composes its leaves'
            releases sequentially, which the per-leaf accounting does not do).
        attribute: for ``"attribute"``: ``age_band``, ``gender``, ``occupation`` or ``zip_region``.
        hash_salt: salt of the hash clustering.
        min_clients: a cluster with fewer training clients is refused before training.
        combiner: ``"over-arch"``, ``"mean"``, ``"median"`` or ``"max"``.
        opt_in_fraction: users who share their labels (excluded from the leaves; train the over-arch).
        over_arch_hidden, over_arch_epochs, over_arch_lr, over_arch_negatives: the over-arch MLP.
        over_arch_training: ``"opt-in"`` (refitted centrally on the opt-in users, leaves frozen) or
            ``"fl"`` (FedSGD over the leaves' clients: ``over_arch_steps`` steps per round after the
            leaves' round, ``over_arch_clients`` clients each, server-side Adam; DP-FedSGD under
            ``dp``: :mod:`protocols.fel_overarch`).
        over_arch_clients, over_arch_steps: the FL over-arch's cohort size and steps per round.
        leaf_model: ``"gmf"`` (FedAvg-GMF leaves) or ``"ncf"`` (NCF-style MLP leaves, one hidden
            layer of width ``dim``: :mod:`protocols.fel_ncf`).
        over_arch_composition: ``"sequential"`` (the FL over-arch trains on the leaves' own users)
            or ``"parallel"`` (on ``over_arch_holdout`` held-out users who train no leaf).
        over_arch_holdout: fraction of the non-opt-in users held out of the leaves (parallel only).
        over_arch_clip: per-client L2 clip of the over-arch gradient (under ``dp``).
        over_arch_noise_multiplier: its ``z`` (``calibration = "noise"``).
        over_arch_target_epsilon: its own epsilon after ``dp_rounds * over_arch_steps`` steps
            (``calibration = "epsilon"``); the total composes it with the leaves per the mode.
        dp: ``"none"``, ``"central"`` or ``"distributed"`` (DP-FedAvg per leaf).
        clip: per-client L2 clip of the leaf update.
        noise_multiplier: ``z`` (``calibration = "noise"``); 0 clips without noise (not private).
        calibration: ``"noise"`` (fixed ``z``) or ``"epsilon"`` (``z`` per leaf so that its epsilon
            after ``dp_rounds`` rounds is at most ``target_epsilon``).
        target_epsilon, delta: the calibration target (delta is also the report's default).
        dp_rounds: rounds the calibration plans for; more rounds are refused in ``"epsilon"`` mode.
        max_noise_multiplier: a target needing more noise than this is refused before training.
        sampling: ``"fixed"`` (fixed-size cohort, no amplification) or ``"poisson"`` (sampled Gaussian).
        dropout_margin: fraction of a round's clients that may drop with the distributed noise
            still meeting the target.
        simulate_dropout: fraction of each round's clients (and, for the FL over-arch, of each step's)
            dropped before their masked input (distributed noise; tests, figures).
        on_excess_dropout: when more drop than the margin: ``"refuse"`` (the clients refuse to unmask
            the sum, inside the secure aggregation; the round is not applied and releases nothing) or
            ``"reaccount"`` (applied, and accounted with the noise that survived).
        noise_tail: noise standard deviations budgeted in ``value_clip`` (distributed noise).
    """

    clustering: str = "hash"
    n_clusters: int = 4
    leaves: str = "clusters"
    attribute: str = "age_band"
    hash_salt: str = "fel"
    min_clients: int = 5
    combiner: str = "over-arch"
    opt_in_fraction: float = 0.1
    over_arch_hidden: int = 32
    over_arch_epochs: int = 3
    over_arch_lr: float = 0.01
    over_arch_negatives: int = 4
    over_arch_training: str = "opt-in"
    over_arch_clients: int = 50
    over_arch_steps: int = 1
    over_arch_composition: str = "sequential"
    over_arch_holdout: float = 0.0
    over_arch_clip: float = 1.0
    over_arch_noise_multiplier: float = 1.0
    over_arch_target_epsilon: float = 1.0
    leaf_model: str = "gmf"
    dim: int = 16
    dp: str = "none"
    clip: float = 1.0
    noise_multiplier: float = 1.0
    calibration: str = "noise"
    target_epsilon: float = 4.0
    delta: float = 1e-5
    dp_rounds: int = 20
    max_noise_multiplier: float = 100.0
    sampling: str = "fixed"
    dropout_margin: float = 0.1
    simulate_dropout: float = 0.0
    on_excess_dropout: str = "refuse"
    noise_tail: float = 12.0

    def __post_init__(self) -> None:
        def bad(key: str, want: str) -> ValueError:
            return ValueError(f"fel.{key} must be {want}; found {getattr(self, key)!r}")

        for key, allowed in (("clustering", _CLUSTERING), ("dp", _DP), ("calibration", ("noise", "epsilon")),
                             ("sampling", ("fixed", "poisson")), ("on_excess_dropout", ("refuse", "reaccount")),
                             ("combiner", ("over-arch",) + COMBINERS), ("attribute", clmod.ATTRIBUTES),
                             ("over_arch_training", ("opt-in", "fl")),
                             ("over_arch_composition", ("sequential", "parallel")), ("leaf_model", ("gmf", "ncf")),
                             ("leaves", ("clusters", "bag"))):
            if getattr(self, key) not in allowed:
                raise bad(key, f"one of {allowed}")
        for key in ("n_clusters", "min_clients", "over_arch_hidden", "over_arch_epochs", "dp_rounds",
                    "over_arch_clients", "over_arch_steps"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise bad(key, "an int >= 1")
        if self.over_arch_negatives < 0:
            raise bad("over_arch_negatives", ">= 0")
        for key in ("opt_in_fraction", "dropout_margin", "simulate_dropout", "over_arch_holdout"):
            if not (0 <= getattr(self, key) < 1):
                raise bad(key, "in [0, 1)")
        for key in ("clip", "over_arch_lr", "target_epsilon", "max_noise_multiplier", "noise_tail", "over_arch_clip",
                    "over_arch_target_epsilon"):
            if not (getattr(self, key) > 0 and math.isfinite(getattr(self, key))):
                raise bad(key, "positive and finite")
        for key in ("noise_multiplier", "over_arch_noise_multiplier"):
            if not (getattr(self, key) >= 0 and math.isfinite(getattr(self, key))):
                raise bad(key, ">= 0 and finite")
        if not (0 < self.delta < 1):
            raise bad("delta", "in (0, 1)")
        if self.combiner == "over-arch" and self.over_arch_training == "opt-in" and self.opt_in_fraction == 0:
            raise ValueError("fel.combiner = \"over-arch\" trains on opt-in users: set fel.opt_in_fraction > 0, "
                             "fel.over_arch_training = \"fl\", or use a fixed combiner (mean, median, max)")
        if self.over_arch_training == "fl" and self.combiner != "over-arch":
            raise ValueError(f"fel.over_arch_training = \"fl\" trains the over-arch; fel.combiner is {self.combiner!r}: "
                             "set fel.combiner = \"over-arch\"")
        if self.over_arch_composition == "parallel" and self.over_arch_training != "fl":
            raise ValueError("fel.over_arch_composition = \"parallel\" trains the over-arch by FL on held-out users: "
                             "set fel.over_arch_training = \"fl\" (the opt-in over-arch costs the leaves nothing)")
        if self.over_arch_composition == "parallel" and self.over_arch_holdout == 0:
            raise ValueError("fel.over_arch_composition = \"parallel\" needs users disjoint from the leaves': set "
                             "fel.over_arch_holdout > 0 (the fraction of users held out of the leaves), or use "
                             "\"sequential\" (the over-arch trains on the leaves' own users)")
        if self.over_arch_holdout > 0 and self.over_arch_composition != "parallel":
            raise ValueError(f"fel.over_arch_holdout={self.over_arch_holdout:g} holds users out for the parallel "
                             "over-arch: set fel.over_arch_composition = \"parallel\" or fel.over_arch_holdout = 0")
        if self.leaves == "bag" and self.dp != "none":
            raise ValueError(f"fel.leaves = \"bag\" trains every leaf on every user, so a user's releases in the "
                             f"{self.n_clusters} leaves compose sequentially, not in parallel as FEL's disjoint "
                             f"leaves do; the per-leaf DP accounting does not cover it: set fel.dp = \"none\" (the "
                             "bag is an accuracy control) or fel.leaves = \"clusters\"")
        if self.dp == "distributed" and self.secure_aggregation == "none":
            raise ValueError("fel.dp = \"distributed\" needs fel.secure_aggregation = \"secagg\" or \"secagg+\": "
                             "without it every client's lightly-noised update is in the clear")
        if (self.dp == "distributed" and self.secure_aggregation in ("secagg", "secagg+")
                and self.simulate_dropout > self.secagg_dropout):
            raise ValueError(f"fel.simulate_dropout = {self.simulate_dropout:g} exceeds fel.secagg_dropout = "
                             f"{self.secagg_dropout:g}: the clients refuse to sign a survivor set missing more clients "
                             "than secure aggregation planned for, so every round would abort; raise "
                             "fel.secagg_dropout to at least fel.simulate_dropout")
        try:
            super().__post_init__()
        except ValueError as exc:
            raise ValueError(str(exc).replace("fedavg.", "fel.")) from None

    def leaf_config(self) -> FedAvgConfig:
        """The FedAvg configuration every leaf trains with."""
        return FedAvgConfig(**{f.name: getattr(self, f.name) for f in fields(FedAvgConfig)})


def _calibrate(cfg: FelConfig, q: float, *, over_arch: bool = False) -> float:
    """Noise multiplier meeting the target after the planned releases (RDP).

    A leaf: ``target_epsilon`` after ``dp_rounds`` rounds. The FL over-arch (``over_arch``):
    ``over_arch_target_epsilon`` after ``dp_rounds * over_arch_steps`` steps.
    """
    from dp.calibration import calibrate_gaussian_noise_multiplier

    key, target = ("over_arch_target_epsilon", cfg.over_arch_target_epsilon) if over_arch \
        else ("target_epsilon", cfg.target_epsilon)
    steps = cfg.dp_rounds * (cfg.over_arch_steps if over_arch else 1)
    qq = q if cfg.sampling == "poisson" else 1.0  # fixed: every round a full (unamplified) Gaussian
    z = calibrate_gaussian_noise_multiplier(target_epsilon=target, delta=cfg.delta, q=qq,
                                            steps=steps, sampling="poisson", use_pld=False)
    if z > cfg.max_noise_multiplier:
        raise ValueError(f"fel.{key}={target:g} over {steps} {'over-arch steps' if over_arch else 'rounds'} "
                         f"(fel.dp_rounds={cfg.dp_rounds}) needs a noise multiplier of {z:.4g}, above "
                         f"fel.max_noise_multiplier={cfg.max_noise_multiplier:g}; raise the target, plan fewer "
                         "rounds or steps, or raise the cap")
    return z


def _leaf_dp(config: FelConfig, population: int) -> DpSettings:
    """The DP settings of a leaf whose client pool has ``population`` clients (its ``z`` calibrated
    to the leaf's ``q`` under ``calibration = "epsilon"``): the in-process leaves' and, from the
    public size of its leaf, a client's half on its own device (:meth:`FelTrainer.on_device`)."""
    q = config.leaf_config().clients_in_round(population) / population
    z = _calibrate(config, q) if config.calibration == "epsilon" else config.noise_multiplier
    return DpSettings(mode=config.dp, clip=config.clip, noise_multiplier=z, sampling=config.sampling,
                      dropout_margin=config.dropout_margin, simulate_dropout=config.simulate_dropout,
                      on_excess_dropout=config.on_excess_dropout, noise_tail=config.noise_tail,
                      corrupt=config.secagg_corrupt)


class FelTrainer(FelOverArchFL):
    """FEL over GMF or NCF leaves (see the module docstring)."""

    def __init__(self, train, config: FelConfig, *, seed: int, transport, exclude=None, source: str = "synthetic",  # noqa: ANN001
                 assignment: np.ndarray | None = None) -> None:
        self.train, self.config, self.seed, self.transport, self.exclude = train, config, int(seed), transport, exclude
        self.round = 0
        order = np.argsort(train.users, kind="stable")
        self._pos_items = train.items[order].astype(np.int64)
        self._pos_start = np.concatenate([[0], np.cumsum(np.bincount(train.users, minlength=train.n_users))])
        with_data = np.flatnonzero(np.diff(self._pos_start) > 0)
        self.assignment = assignment if assignment is not None else self._cluster(source)
        if self.assignment.shape != (train.n_users,) or self.assignment.min() < 0 \
                or self.assignment.max() >= config.n_clusters:
            raise ValueError(f"cluster assignment must give every one of {train.n_users} users one cluster in "
                             f"0..{config.n_clusters - 1}")
        pick = np.random.default_rng([self.seed, 13, 1])  # opt-in users: a seeded simulation choice
        n_opt = int(round(config.opt_in_fraction * len(with_data)))
        self.opt_in = np.sort(pick.choice(with_data, size=n_opt, replace=False)) if n_opt else np.zeros(0, np.int64)
        fl_clients = np.setdiff1d(with_data, self.opt_in)
        self.held_out = np.zeros(0, np.int64)  # parallel FL over-arch: users who train no leaf
        if config.over_arch_composition == "parallel":
            n_held = int(round(config.over_arch_holdout * len(fl_clients)))
            if n_held < config.min_clients:
                raise ValueError(f"fel.over_arch_holdout={config.over_arch_holdout:g} holds out {n_held} of "
                                 f"{len(fl_clients)} users, below fel.min_clients={config.min_clients}: the parallel "
                                 "over-arch cannot be trained on them; raise fel.over_arch_holdout")
            held = np.random.default_rng([self.seed, 13, 4]).choice(fl_clients, size=n_held, replace=False)
            self.held_out = np.sort(held)
            fl_clients = np.setdiff1d(fl_clients, self.held_out)
        if config.leaves == "bag":  # every leaf on every user (the unclustered control)
            if len(fl_clients) < config.min_clients:
                raise ValueError(f"fel.leaves = \"bag\" has {len(fl_clients)} training clients, below "
                                 f"fel.min_clients={config.min_clients}")
        else:
            clmod.check_sizes(self.assignment, config.n_clusters, fl_clients, config.min_clients, "fel.min_clients")
        leaf_cfg = config.leaf_config()
        self.leaves: list[FelLeaf] = []
        self.noise_multipliers: list[float] = []
        for c in range(config.n_clusters):
            members = fl_clients if config.leaves == "bag" else fl_clients[self.assignment[fl_clients] == c]
            dp = None
            if config.dp != "none":
                dp = _leaf_dp(config, len(members))
                self.noise_multipliers.append(dp.z)
            leaf_cls = NcfLeaf if config.leaf_model == "ncf" else FelLeaf
            self.leaves.append(leaf_cls(train, leaf_cfg, index=c, dp=dp, seed=self.seed * 1009 + c, transport=transport,
                                       exclude=exclude, clients=members))
        self._cache: tuple[int, dict[str, Any]] | None = None
        self._oa_vecs: list[torch.Tensor] | None = None
        self._oa_clipped: float | None = None
        self.fl_clients = fl_clients
        self.over_arch: OverArch | None = None
        self._oa_dp: OverArchDp | None = None
        if config.over_arch_training == "fl":  # trained by FedSGD across rounds; its state is checkpointed
            self.over_arch = OverArch(config.n_clusters * (1 + config.dim), config.over_arch_hidden, seed=self.seed * 7)
            self._adam = ServerAdam(list(self.over_arch.parameters()), config.over_arch_lr)
            self.over_arch_population = self.held_out if config.over_arch_composition == "parallel" else fl_clients
            if config.dp != "none":
                n_pop = len(self.over_arch_population)
                m = min(config.over_arch_clients, n_pop)
                z = (_calibrate(config, m / n_pop, over_arch=True) if config.calibration == "epsilon"
                     else config.over_arch_noise_multiplier)
                self._oa_dp = OverArchDp(
                    mode=config.dp, clip=config.over_arch_clip, z=z, sampling=config.sampling, population=n_pop,
                    expected=m, width=sum(p.numel() for p in self.over_arch.parameters()), frac_bits=config.frac_bits,
                    value_clip=config.value_clip, secure=config.secure_aggregation,
                    dropout_margin=config.dropout_margin, on_excess_dropout=config.on_excess_dropout,
                    noise_tail=config.noise_tail, corrupt=config.secagg_corrupt,
                    cohort=OVER_ARCH_COHORT if config.over_arch_composition == "parallel" else None)
                self._oa_dp.check_budget(secagg_dropout=config.secagg_dropout, secagg_corrupt=config.secagg_corrupt)

    def _cluster(self, source: str) -> np.ndarray:
        cfg, ids = self.config, self.train.user_ids
        if cfg.clustering == "hash":
            return clmod.hash_clusters(list(ids), cfg.n_clusters, salt=cfg.hash_salt)
        from recmodels.side import load_user_demographics

        demo = load_user_demographics(source, ids) if source != "synthetic" else None
        if demo is None:
            raise ValueError(f"fel.clustering = {cfg.clustering!r} needs user demographics (u.user or users.dat "
                             f"beside the data); {source} has none: use fel.clustering = \"hash\"")
        if cfg.clustering == "attribute":
            return clmod.attribute_clusters(demo, cfg.attribute, cfg.n_clusters)
        return clmod.kmeans_clusters(clmod.demographic_features(demo), cfg.n_clusters, seed=self.seed)

    # -- training ------------------------------------------------------------------------------
    def run_round(self) -> RoundStats:
        """One FedAvg round of every leaf (interleaved); releases are labelled per leaf.

        ``extra["refused"]`` lists, in words, every leaf round and over-arch step of this round whose
        clients refused to unmask their sum (distributed noise with fewer survivors than it was sized
        for, :meth:`protocols.fel_leaf.FelLeaf.survivor_floor`): those were not applied and released
        nothing; the others were.
        """
        cfg = self.config
        if cfg.dp != "none" and cfg.calibration == "epsilon" and self.round >= cfg.dp_rounds:
            raise ValueError(f"fel.dp_rounds={cfg.dp_rounds} rounds were calibrated for fel.target_epsilon="
                             f"{cfg.target_epsilon:g}; another round would exceed it. Raise fel.dp_rounds")
        t0 = time.perf_counter()
        stats, secs = [], []
        for leaf in self.leaves:
            s0 = time.perf_counter()
            stats.append(leaf.run_round())
            secs.append(time.perf_counter() - s0)
        clients = sum(s.clients for s in stats)
        loss = sum(s.loss * s.clients for s in stats) / max(clients, 1)
        t = self.round
        # a unit the clients refused (distributed noise, fewer survivors than it was sized for): not applied
        extra: dict[str, Any] = {"refused": [s.extra["refused"] for s in stats if "refused" in s.extra]}
        if self.over_arch is not None:
            o0 = time.perf_counter()
            extra["over_arch_loss"], over_rel, over_refused = self._over_arch_fl_round(t)
            extra["refused"] += over_refused
            stats.append(RoundStats(round=t, loss=0.0, clients=0, releases=over_rel))
            extra["over_arch_seconds"] = time.perf_counter() - o0
        self.round += 1
        return RoundStats(
            round=t, loss=float(loss), clients=clients,
            bytes_per_client=float(sum(s.bytes_per_client * s.clients for s in stats) / max(clients, 1)),
            seconds={"round": time.perf_counter() - t0, "client": 0.0, "server": 0.0},
            extra={"leaf_clients": [s.clients for s in stats[:len(secs)]], "leaf_seconds": secs,
                   "leaf_loss": [s.loss for s in stats[:len(secs)]], **extra},
            releases=tuple(r for s in stats for r in s.releases),
        )

    @property
    def device_policy(self):  # noqa: ANN201
        """The simulated clients' own :class:`protocols.guard.DevicePolicy` (``[clients]``), or ``None``."""
        return getattr(self, "_device_policy", None)

    @device_policy.setter
    def device_policy(self, policy) -> None:  # noqa: ANN001
        # every leaf's clients are the run's clients: their floor reaches each leaf's secure sums
        self._device_policy = policy
        for leaf in self.leaves:
            leaf.device_policy = policy

    # -- parties on separate devices (protocols.registry.DeviceSplit) --------------------------
    def round_units(self) -> list[FelLeaf]:
        """The round's units: the leaves, each one FedAvg round on its own cluster, in the order
        :meth:`run_round` runs them."""
        return list(self.leaves)

    def unit_of_users(self) -> np.ndarray:
        """Per dense user, the leaf it trains in (its public cluster); ``-1`` for the users who
        train no leaf (opt-in, held out, or without training data)."""
        out = np.full(self.train.n_users, -1, np.int64)
        out[self.fl_clients] = self.assignment[self.fl_clients]
        return out

    @classmethod
    def on_device(cls, train, config: FelConfig, *, seed: int, transport, exclude=None,  # noqa: ANN001
                  unit: int, unit_clients: int | None = None) -> FelTrainer:
        """One client's half of FEL on its own device: ``train`` holds only its own rows.

        Every leaf is built on the client's data with the run's seed (so its initialisation and
        streams are the in-process leaf's); the client's pool in leaf ``unit`` (its public
        cluster; ``-1``: it trains no leaf) is itself, every other leaf's is empty. Once each
        leaf's global arrays (``global_arrays()``: ``item, h, b``, and an NCF leaf's MLP) and the
        client's own vector are installed, :meth:`score` scores exactly as the in-process ensemble
        does for this user: its own leaf's vector, and for the other leaves a vector folded in
        from its own positives.

        Under DP, ``unit_clients`` (the public size of the client's leaf, which fixes the cohort
        size ``m`` and, calibrated, ``z``) gives the client's leaf the in-process leaf's DP
        settings, so that through secure aggregation the client clips its update and, under
        distributed noise, adds its own noise share before masking (:meth:`FelLeaf.device_inputs`).
        Without it (scoring, or central DP in plaintext, where the server clips and adds the noise)
        the leaf has none. The leaves train without secure aggregation: the client's half of the
        secure sum is :func:`fedflower.secagg_mod.secagg_mod`. Refused configurations:
        :func:`check_device_split`.
        """
        check_device_split(config)
        users = np.unique(train.users)
        if len(users) != 1:
            raise ValueError(f"FelTrainer.on_device builds one client's half; its data holds {len(users)} users")
        if not (-1 <= int(unit) < config.n_clusters):
            raise ValueError(f"unit must be a leaf in 0..{config.n_clusters - 1} or -1; found {unit}")
        if unit_clients is not None and (isinstance(unit_clients, bool) or int(unit_clients) < 1):
            raise ValueError(f"unit_clients must be the size of the client's leaf (>= 1); found {unit_clients!r}")
        self = cls.__new__(cls)
        self.train, self.config, self.seed, self.transport, self.exclude = train, config, int(seed), transport, exclude
        self.round = 0
        order = np.argsort(train.users, kind="stable")
        self._pos_items = train.items[order].astype(np.int64)
        self._pos_start = np.concatenate([[0], np.cumsum(np.bincount(train.users, minlength=train.n_users))])
        self.assignment = None  # the clustering is the server's; the client knows only its own leaf
        self.opt_in = self.held_out = np.zeros(0, np.int64)
        self.fl_clients = users if unit >= 0 else np.zeros(0, np.int64)
        leaf_cls = NcfLeaf if config.leaf_model == "ncf" else FelLeaf
        leaf_cfg = dataclasses.replace(config.leaf_config(), secure_aggregation="none")
        own_dp = _leaf_dp(config, int(unit_clients)) if config.dp != "none" and unit_clients is not None else None
        self.leaves = [leaf_cls(train, leaf_cfg, index=c, dp=own_dp if c == unit else None, seed=self.seed * 1009 + c,
                                transport=transport, exclude=exclude,
                                clients=users if c == unit else np.zeros(0, np.int64),
                                **({"population": int(unit_clients)} if c == unit and own_dp is not None else {}))
                       for c in range(config.n_clusters)]
        self.noise_multipliers, self.over_arch, self._oa_dp, self._cache, self._oa_vecs = [], None, None, None, None
        self._oa_clipped = None
        return self

    # -- the ensemble --------------------------------------------------------------------------
    def _leaf_users(self, leaf: FelLeaf) -> torch.Tensor:
        """Every user's vector in ``leaf``: trained for members, fitted by fold-in for the others."""
        p = leaf.user.clone()
        others = np.setdiff1d(np.flatnonzero(np.diff(self._pos_start) > 0), leaf._clients)
        if others.size:
            p[torch.as_tensor(others)] = leaf.fold_in_users(self._pos_start, self._pos_items, others)
        return p

    def _ensemble(self) -> dict[str, Any]:
        if self._cache is not None and self._cache[0] == self.round:
            return self._cache[1]
        ens: dict[str, Any] = {"users": [self._leaf_users(leaf) for leaf in self.leaves]}
        if self.over_arch is not None:
            ens["over_arch"] = self.over_arch
        elif self.config.combiner == "over-arch":
            ens["over_arch"] = self._train_over_arch(ens["users"])
        self._cache = (self.round, ens)
        return ens

    def _features(self, users_vecs: list[torch.Tensor], users: torch.Tensor, items: torch.Tensor):
        """Leaf probabilities ``[C, ...]`` and the over-arch input ``[..., C (1 + d)]``."""
        probs, parts = [], []
        for leaf, p in zip(self.leaves, users_vecs):
            hidden, logit = leaf.forward_hidden(p[users], items)
            pr = torch.sigmoid(logit)
            probs.append(pr)
            parts += [pr.unsqueeze(-1), hidden]
        return torch.stack(probs), torch.cat(parts, dim=-1)

    # (the FL over-arch's steps and their client side: protocols.fel_overarch_fl)
    def _examples(self, who: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``who``'s training positives plus ``over_arch_negatives`` sampled negatives each: users, items, labels
        (the opt-in over-arch, fitted by the server on the opt-in users' shared labels)."""
        cfg = self.config
        counts = self._pos_start[who + 1] - self._pos_start[who]
        users = np.repeat(who, counts)
        items = np.concatenate([self._pos_items[self._pos_start[u]:self._pos_start[u + 1]] for u in who])
        labels = np.ones(len(items))
        if cfg.over_arch_negatives:
            from recmodels.data import Interactions

            sub = Interactions(users=users, items=items, ratings=np.ones(len(items), np.float32),
                               timestamps=np.zeros(len(items), np.int64), user_ids=self.train.user_ids,
                               item_ids=self.train.item_ids, check_duplicates=False)
            nu, ni = sample_train_negatives(sub, n_neg=cfg.over_arch_negatives, rng=rng, exclude=self.exclude)
            users, items = np.concatenate([users, nu]), np.concatenate([items, ni])
            labels = np.concatenate([labels, np.zeros(len(ni))])
        return users, items, labels

    def _train_over_arch(self, users_vecs: list[torch.Tensor]) -> OverArch:
        cfg = self.config
        rng = np.random.default_rng([self.seed, 13, 2, self.round])
        users, items, labels = self._examples(self.opt_in, rng)
        with torch.no_grad():
            _, z = self._features(users_vecs, torch.as_tensor(users), torch.as_tensor(items))
        model = OverArch(z.shape[-1], cfg.over_arch_hidden, seed=self.seed * 7 + self.round)
        with torch.enable_grad():  # scoring runs under no_grad
            train_over_arch(model, z, torch.as_tensor(labels, dtype=torch.float32), epochs=cfg.over_arch_epochs,
                            lr=cfg.over_arch_lr, batch_size=256, seed=self.seed * 11 + self.round)
        return model

    @torch.no_grad()
    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Ensemble scores (probabilities for the fixed combiners, the over-arch's logit otherwise)."""
        ens = self._ensemble()
        u = torch.as_tensor(np.asarray(users))
        it = torch.as_tensor(np.asarray(items))
        if it.ndim == u.ndim + 1:
            u = u.unsqueeze(-1).expand_as(it)
        probs, z = self._features(ens["users"], u, it)
        if self.config.combiner == "over-arch":
            return ens["over_arch"](z).numpy()
        return combine(probs.numpy(), self.config.combiner)

    @torch.no_grad()
    def score_all(self, users: np.ndarray) -> np.ndarray:
        users = np.asarray(users)
        items = torch.arange(self.train.n_items)
        out = []
        for lo in range(0, len(users), 16):
            chunk = torch.as_tensor(users[lo:lo + 16])
            out.append(self.score(chunk.unsqueeze(1).expand(-1, len(items)).numpy(),
                                  items.expand(len(chunk), -1).numpy()))
        return np.concatenate(out) if out else np.zeros((0, self.train.n_items))

    # -- public info and checkpoints -----------------------------------------------------------
    def public_info(self) -> dict[str, Any]:
        return {"protocol": "fel", "n_users": self.train.n_users, "n_items": self.train.n_items,
                "assignment": self.assignment.tolist(), "opt_in": self.opt_in.tolist(),
                "leaves": [leaf.dp_info() for leaf in self.leaves], "noise_multipliers": self.noise_multipliers,
                "held_out": self.held_out.tolist(), "over_arch_dp": self._oa_dp.info() if self._oa_dp else None,
                "config": asdict(self.config)}

    def state_dict(self) -> dict[str, Any]:
        out = {"round": self.round, "config": asdict(self.config), "assignment": self.assignment.copy(),
               "leaves": [leaf.state_dict() for leaf in self.leaves]}
        if self.over_arch is not None:
            out["over_arch"] = {k: v.clone() for k, v in self.over_arch.state_dict().items()}
            out["over_arch_adam"] = self._adam.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (a key missing from an older checkpoint, e.g. the dpf_* keys, takes its default)
        if {**asdict(type(self.config)()), **state["config"]} != asdict(self.config):
            raise ValueError("checkpoint was written with a different fel configuration")
        if not np.array_equal(np.asarray(state["assignment"]), self.assignment):
            raise ValueError("checkpoint was written with a different cluster assignment")
        for leaf, s in zip(self.leaves, state["leaves"]):
            leaf.load_state_dict(s)
        if self.over_arch is not None:
            self.over_arch.load_state_dict(state["over_arch"])
            self._adam.load_state_dict(state["over_arch_adam"])
        self.round = int(state["round"])
        self._cache = None


def check_device_split(config: FelConfig) -> None:
    """Refuse, in words, an FEL configuration whose parties cannot run on separate devices as units.

    The leaves are FedAvg rounds (sample -> local round -> aggregate), with DP-FedAvg's client step
    (clip, and the distributed noise share) on the device before masking; the FL over-arch without
    DP or under central DP in plaintext is one more exchange per FedSGD step (each client's
    gradient, computed and, under DP, clipped on its device: :meth:`FelTrainer.over_arch_upload`;
    the central noise is the server's). What is not: the opt-in over-arch (fitted on the opt-in
    users' labels, which only an in-process server holds), the FL over-arch under distributed DP
    or next to secure leaves (not implemented on devices), and ``simulate_dropout`` (the in-process simulation's
    dropouts: on devices dropouts are real).
    """
    why = []
    if config.leaves == "bag":
        why.append("fel.leaves = \"bag\" (every client trains every leaf; the device split runs each client in "
                   "the one leaf of its public cluster): run the bag in process")
    if config.combiner == "over-arch" and config.over_arch_training != "fl":
        why.append("fel.combiner = \"over-arch\" with fel.over_arch_training = \"opt-in\" (the over-arch is refitted "
                   "by the server on the opt-in users' labels, which the server holds only in-process): use "
                   "fel.over_arch_training = \"fl\", or the mean, median or max combiner")
    elif config.combiner == "over-arch" and config.dp == "distributed":
        why.append("fel.over_arch_training = \"fl\" with fel.dp = \"distributed\" (the over-arch's DP-FedSGD step "
                   "through secure aggregation, with the devices' noise shares, does not run on devices yet): use "
                   "fel.dp = \"central\" with fel.secure_aggregation = \"none\", or a mean, median or max combiner")
    elif config.combiner == "over-arch" and config.secure_aggregation != "none":
        why.append("fel.over_arch_training = \"fl\" with secure leaves (fel.secure_aggregation = "
                   f"{config.secure_aggregation!r}; the over-arch step through secure aggregation, or in plaintext "
                   "next to secure leaves, does not run on devices yet): use fel.secure_aggregation = \"none\", or a "
                   "mean, median or max combiner")
    if config.dp == "distributed" and config.simulate_dropout > 0:
        why.append(f"fel.simulate_dropout = {config.simulate_dropout:g} (the in-process simulation's dropouts; on "
                   "devices a client drops by not answering): set it to 0")
    if why:
        raise ValueError("this FEL configuration cannot run with its clients on separate devices: " + "; ".join(why))


def fel_privacy_report(ledger, delta: float) -> dict[str, Any]:  # noqa: ANN001
    """FEL's keys for ``secagg privacy report --json``: per-leaf epsilon, the over-arch's, and their composition.

    ``per_leaf[c].epsilon`` and ``over_arch.epsilon`` are each part alone (RDP over its own
    releases). ``epsilon`` is what the worst-off user spent: every user is in exactly one ledger
    cohort (``leaf:<c>``, or ``over-arch`` in parallel mode) and also in every release without a
    cohort (the sequential FL over-arch), so it is the max over cohorts of the cohort's releases
    composed with the common ones (:meth:`dp.ledger.PrivacyLedger.spent_by_cohort`): opt-in
    ``max_c eps_c``; sequential ``max_c eps(leaf_c + over-arch)``; parallel
    ``max(max_c eps_c, eps_over-arch)``.

    Under distributed noise every release was accounted with the noise of its honest survivors
    (:mod:`protocols.fel_leaf`): ``per_leaf[c].colluders`` is the collusion bound the leaf's
    releases assumed, and ``noise_assumption`` states it in words.
    """
    from dp.accountant import RdpAccountant

    entries = ledger.entries()
    clients: dict[str, int] = {}
    bound: dict[str, int] = {}  # the collusion bound each leaf's distributed noise was accounted with
    alone: dict[str, RdpAccountant] = {}
    over_events, over_mode = [], None
    for e in entries:
        if e.params.get("over_arch") == "fl":
            over_events.append(e.event)
            over_mode = e.params.get("composition", "sequential")
        elif e.cohort and e.cohort.startswith("leaf:"):
            clients[e.cohort] = max(clients.get(e.cohort, 0), int(e.params.get("population", e.params.get("clients", 0))))
            if "colluders" in e.params:
                bound[e.cohort] = max(bound.get(e.cohort, 0), int(e.params["colluders"]))
            alone.setdefault(e.cohort, RdpAccountant()).compose(e.event)

    def eps(acc: RdpAccountant) -> float:
        return float(acc.get_epsilon(delta))

    per_leaf = [{"cluster": int(c.split(":")[1]), "clients": clients.get(c, 0), "epsilon": eps(acc),
                 **({"colluders": bound[c]} if c in bound else {})} for c, acc in alone.items()]
    per_leaf.sort(key=lambda d: d["cluster"])
    by_cohort = ledger.spent_by_cohort(delta)
    worst = max(by_cohort.values(), key=lambda r: r.epsilon) if by_cohort else ledger.spent(delta, use_pld=False)
    total, accountant = worst.epsilon, worst.accountant
    if over_mode is None:
        over = {"mode": "opt-in", "epsilon": 0.0}
    else:
        acc = RdpAccountant()
        for ev in over_events:
            acc.compose(ev)
        over = {"mode": over_mode, "epsilon": eps(acc), "releases": len(over_events)}
    out = {"epsilon": total, "delta": delta, "per_leaf": per_leaf, "composition": "parallel",
           "over_arch": over, "accountant": accountant}
    distributed = [e for e in entries if e.params.get("noise") == "distributed"]
    if any("colluders" not in e.params for e in distributed):  # (a ledger written before the collusion bound)
        out["noise_assumption"] = (
            "distributed noise accounted counting every survivor's share, the colluders' included (releases "
            "recorded before the collusion bound): against clients colluding with the server the honest noise is "
            "smaller than accounted")
    elif distributed:
        out["noise_assumption"] = (
            "distributed noise is accounted for the honest survivors only: each release's survivors minus up to "
            "floor(secagg_corrupt x m) clients (m the planned cohort; per_leaf 'colluders') that may collude with "
            "the server and remove their own noise shares")
    return out


register(ProtocolSpec(
    name="fel",
    summary="FEL: one FedAvg-GMF leaf per disjoint public-attribute cluster, ensembled on the server; DP-FedAvg per leaf",
    build=lambda ctx: FelTrainer(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport, exclude=ctx.exclude,
                                 source=ctx.source),
    section="fel",
    config_cls=FelConfig,
    privacy_report=fel_privacy_report,
    split=DeviceSplit(
        build_client=lambda ctx, unit, unit_clients=None: FelTrainer.on_device(
            ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport, exclude=ctx.exclude, unit=unit,
            unit_clients=unit_clients),
        check=lambda config: check_device_split(config),
    ),
))
