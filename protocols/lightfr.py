"""LightFR (Zhang et al., TOIS 2023): federated binary-code MF by discrete coordinate descent.

Parties:
    * one client per user, holding its ratings and its code ``b_u in {-1,+1}^f`` (never sent);
    * the server, holding the item codes ``D in {-1,+1}^{m x f}`` (public: broadcast packed).

Round ``t`` (notes §2.7, Algorithm 1):
    1. the server samples ``round(p n)`` clients (seeded simulation choice) and sends them ``D``
       packed (kind ``"model"``, ``m * ceil(f/64) * 8`` bytes);
    2. each sampled client runs bit-wise DCD on ``b_u`` to convergence (at most
       ``user_sweeps`` sweeps; :func:`recmodels.binary_codes.dcd_users`);
    3. each client uploads (kind ``"update"``) with a three-value report (:data:`STATS`: its
       squared error after the DCD, its sweeps, whether it converged), by ``server``:
       ``"grad"`` (Agg_grad, Eq. 16, the paper's default): ``Delta d^u_ik`` for its rated items
       and a rated-item indicator; ``"para"`` (Agg_para, Eq. 17): its locally updated codes of
       its rated items (a sign vote); ``"dcd"`` (notes §9.4 option B): per rated item
       ``(r - 1/2) b_u``, ``b_u b_u^T`` and 1, the sufficient statistics of the exact item DCD;
    4. the server validates every upload (round, sender, replay, ids, shape, values; codes in
       ``{-1,+1}``; a bad one is dropped with its reason, :attr:`LightFR.dropped`), sums the
       others, and updates only items with at least one
       rater this round (§9.4): ``"grad"``: ``d_ik <- sign(F(sum/f - 2 lam_i sum_{k'!=k} d_ik', d_ik))``
       (Jacobi); ``"para"``: ``d_ik <- sign(F(sum of votes, d_ik))``; ``"dcd"``: the exact
       Gauss-Seidel item DCD to convergence (``item_sweeps``). ``"none"``: no training (the
       ``lightfr-init`` and ``lightfr-random`` ablations).

The authors' public code differs from the paper in five places, each a ``[lightfr]`` option that is
off by default (:class:`LightFRConfig`, docs/lightfr.md "The authors' code as options"): the
user update's stickiness (``user_stickiness``; 0.5 is the paper's DCD), the item update's add-back
per sampled client (``item_add_back = "sampled"``), sweeps to a fixed point (``sweeps``), client
sampling with replacement (``client_sampling``; plaintext only) and the code's early stop
(``early_stop``). The ``lightfr-authors`` preset sets them all.

Every server update needs only sums. With ``secure_aggregation`` set, each client's upload is a
dense, zero-padded vector (the report, the values over the round's rated union or ALL items, the
rated indicator) summed through secure aggregation (SecAgg+ by default). Uploads are put on the
fixed-point grid ``2^-frac_bits`` on the device in both forms, so the decoded secure sum equals
the plaintext float sum exactly and the codes are bit-identical (tested).

The round is a sequence of exchanges (:mod:`protocols.exchange`): :meth:`LightFR.device_round` is
the server half, :meth:`LightFR.device_step` the client half, and ``run_round`` drives both in one
process, so the same code runs with every client on its own device (docs/lightfr.md, "On separate
devices"; :func:`device_check` refuses what cannot be separated). The server half reads no
ratings: the round's loss comes back in the clients' reports.

Adversary and promise:
    * ``secure_aggregation = "none"`` (the paper): honest-but-curious server. **No promise**: one
      ``"grad"`` upload reveals the user's rated set, its code up to sign and every rating
      (notes §1.3; :mod:`attacks.lightfr`); ``"para"`` reveals the rated set and sign votes.
    * ``"secagg+"``/``"secagg"``: honest-but-curious server, up to ``secagg_corrupt`` of a
      round's clients colluding with it. Promise: the server learns per item only the sum over
      the round's raters and the number of raters (and ``D``, public anyway). Stated limits: an
      item rated by exactly one sampled client in a round reveals that client's contribution
      for the item (not who it is); no DP noise, so the ledger records unprotected releases.
    * Never protected: ``D`` and everything derived from it (every client gets it).

Evaluation: the ranking score of ``(u, i)`` is ``b_u . d_i`` (same order as Hamming similarity,
§2.9) plus a tie-breaker: ``ties = "random"`` (default, notes §9.10) adds a keyed pseudo-random
jitter in ``[0, 0.5)`` per (user, item); ``"pessimistic"`` adds nothing (the framework's rule:
ties count against the held-out item); :func:`rank_metrics` also gives the authors' optimistic rule.

Simulation: clients are batched (numpy); the client-side work is identical to per-client work
(tested: a cohort's step equals each member's step alone on its own device).
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Mapping
from typing import Any

import numpy as np

from dp.events import NonPrivate
from protocols.base import Release, RoundStats
from protocols.exchange import Exchange, Replies, SecureSum, run_exchanges
from protocols.lightfr_config import (  # split out; re-exported here
    BROADCAST, INITS, SERVERS, STATS, EarlyStop, LightFRConfig, Upload, UpdateError, _grid, rank_metrics, rated_weights,
    tie_jitter,
)
from protocols.registry import Exchanges, ProtocolSpec, register
from protocols.secure_sum import SERVER2
from protocols.transport import SERVER, InProcessTransport, Transcript, client
from recmodels import binary_codes as bc
from recmodels.data import Interactions
from recmodels.mf import MFConfig, init_factors, local_updates, rating_lists

__all__ = [
    "BROADCAST",
    "INITS",
    "SERVERS",
    "LightFR",
    "LightFRConfig",
    "STATS",
    "Upload",
    "UpdateError",
    "device_check",
    "rank_metrics",
    "tie_jitter",
]

class LightFR:
    """LightFR simulation (see the module docstring).

    Args:
        train: training ratings (explicit; scaled to ``[0, 1]`` by the training range).
        config: the ``[lightfr]`` section.
        seed: seeds initialisation, client sampling and the tie jitter (simulation randomness;
            secure aggregation draws its keys and masks from the CSPRNG).
        transport: where messages go (default: keeps what the server received or sent).
    """

    #: the round's ``seconds["client"]`` already holds the clients' secure-aggregation work
    #: (``experiments.run.training`` adds it only to protocols whose figure leaves it out)
    client_seconds_include_secure = True

    def __init__(self, train: Interactions, config: LightFRConfig, *, seed: int,
                 transport: InProcessTransport | None = None):
        self.train, self.config, self.seed = train, config, int(seed)
        self.transport = transport or InProcessTransport(
            Transcript(keep_payloads=lambda r: r.receiver == SERVER or r.sender == SERVER))
        self.n_users, self.n_items, self.f = train.n_users, train.n_items, config.bits
        if self.n_users < 1 or len(train) == 0:
            raise ValueError("LightFR needs at least one training rating")
        if config.has_rating_scale:  # public (required on separate devices)
            self.lo, self.hi = float(config.rating_min), float(config.rating_max)
        else:  # the training data's range (in process only: reads every rating)
            self.lo, self.hi = float(train.ratings.min()), float(train.ratings.max())
        order = np.lexsort((train.items, train.users))
        self.users = train.users[order].astype(np.int64)
        self.items = train.items[order].astype(np.int64)
        self.raw = train.ratings[order].astype(np.float64)
        self.r = _grid(np.clip(bc.scale_ratings(self.raw, self.lo, self.hi), 0, 1), config.frac_bits)
        self.counts = np.bincount(self.users, minlength=self.n_users)
        self.starts = np.concatenate(([0], np.cumsum(self.counts)[:-1]))
        self.rng = np.random.default_rng([self.seed, 0x11F])
        self.round = 0
        self._pending: dict[int, Upload] = {}  # client side: a secure upload between its two phases
        self.dropped: dict[int, str] = {}  # server side: the last round's clients left out, and why
        self.early = EarlyStop(config.early_stop_threshold)  # server side (early_stop = "authors")
        self._item_sweeps: np.ndarray | None = None  # server = "dcd": the last item DCD's sweeps per moved item
        if config.init == "mf":
            self.b, self.d = self._mf_codes()
        else:
            self.b = bc.random_codes(self.n_users, self.f, self.rng)
            self.d = bc.random_codes(self.n_items, self.f, self.rng)
        if config.secure_aggregation != "none" and self.n_users < 2:
            raise ValueError("secure aggregation needs >= 2 clients per sum; found 1 user")

    # -- initialisation --------------------------------------------------------------------------
    def _mf_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """Median-quantised real-valued MF features (LightFR_init; MF trained centrally, notes §2.8)."""
        scaled = Interactions(self.users, self.items, self.r.astype(np.float32), np.zeros(len(self.users), np.int64),
                              self.train.user_ids, self.train.item_ids, check_duplicates=False)
        lists = rating_lists(scaled)
        mf = MFConfig(dim=self.f, lr=0.05, reg_user=0.01, reg_item=0.01, init_mean=0.5, init_std=0.1)
        p, q = init_factors(self.n_users, self.n_items, mf, self.rng)
        for _ in range(self.config.mf_epochs):
            p, delta = local_updates(p, q, lists, mf)
            upd = np.zeros_like(q)
            mask = lists.items >= 0
            np.add.at(upd, lists.items[mask], delta[mask])
            q = q + upd / np.maximum(np.bincount(lists.items[mask], minlength=self.n_items), 1)[:, None]
        return bc.median_quantise(p), bc.median_quantise(q)

    # -- helpers ---------------------------------------------------------------------------------
    def _pairs(self, users: np.ndarray) -> np.ndarray:
        """Indices (into the flat pair arrays) of every rating of ``users``."""
        c = self.counts[users]
        if c.sum() == 0:
            return np.zeros(0, dtype=np.int64)
        first = np.repeat(self.starts[users] - np.concatenate(([0], np.cumsum(c)[:-1])), c)
        return first + np.arange(int(c.sum()))

    def _lam(self, base: float, counts: np.ndarray) -> np.ndarray:
        c = np.asarray(counts, dtype=np.float64)
        return base * c / self.f**2 if self.config.lambda_scale == "count" else np.full(c.shape, float(base))

    def sample_clients(self) -> np.ndarray:
        """This round's clients: ``max(1, round(p n))`` without replacement (seeded), or under
        ``client_sampling = "with-replacement"`` the authors' code's ``max(1, int(p n))`` draws with
        replacement (sorted; a client drawn twice is listed twice)."""
        if self.config.client_sampling == "with-replacement":
            n = max(1, int(self.config.client_fraction * self.n_users))
            return np.sort(self.rng.choice(self.n_users, size=n, replace=True))
        n = max(1, int(round(self.config.client_fraction * self.n_users)))
        return np.sort(self.rng.choice(self.n_users, size=n, replace=False))

    @property
    def packed_items(self) -> np.ndarray:
        return bc.pack(self.d)

    # -- one round: the server half (exchanges) and the client half ------------------------------
    def run_round(self) -> RoundStats:
        """Sample, broadcast, local DCD, upload, validate, aggregate, update.

        One code path with the device runs: :meth:`device_round` drives the round and this trainer
        plays every sampled client through :meth:`device_step` (:func:`protocols.exchange.run_exchanges`).
        ``server = "none"`` trains nothing and is in process only.
        """
        if self.config.server == "none":
            return self._untrained_round()
        spent = 0.0

        def step(*args: Any) -> Any:  # the clients' local work, timed (a device times its own)
            nonlocal spent
            t = time.perf_counter()
            out = self.device_step(*args)
            spent += time.perf_counter() - t
            return out

        stats = run_exchanges(self, step)
        stats.seconds["client"] += spent / max(stats.clients, 1)
        return stats

    def _untrained_round(self) -> RoundStats:
        """``server = "none"``: nothing trains; the loss is over every user's ratings (in process only)."""
        t0, t = time.perf_counter(), self.round
        self.round += 1
        return RoundStats(round=t, loss=self.train_loss(), clients=0,
                          seconds={"round": time.perf_counter() - t0, "client": 0.0, "server": 0.0},
                          extra={"trained": False})

    def _secure(self, width: int, kind: str) -> SecureSum:
        cfg = self.config
        two = {} if cfg.secure_aggregation != "dpf" else {
            "row_width": self._width() + 1, "points": cfg.dpf_points, "receiver2": SERVER2,
            "max_parts": cfg.dpf_max_parts, "pad_parts": cfg.dpf_pad_parts}
        # SecAgg/SecAgg+: the round's sums (the union, then the values over it) are instances of one key
        # setup (secagg.reuse): the second pays no public-key setup of its own
        return SecureSum(cfg.secure_aggregation, width=width, frac_bits=cfg.frac_bits, value_clip=cfg.value_clip,
                         where="lightfr.value_clip", kind=kind, dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt,
                         setup="lightfr-round", **two)

    def device_round(self) -> Generator[Exchange, Replies, RoundStats]:
        """The server half of a round (:mod:`protocols.exchange`); it reads no client data.

        The exchanges, by ``secure_aggregation`` and ``secure_rows`` (cohort: the sampled clients):

        * ``"none"``: ``"train"``: down the packed ``D``; up in plaintext ``items``, ``body`` and
          ``stats`` (:data:`STATS`), each reply checked by :meth:`validate` (a bad one is dropped);
        * secure, ``"union"``: ``"train_rated"``: down the packed ``D``; up, summed securely, fresh
          random positive weights on the rated items over all ``m`` items (:func:`rated_weights`:
          the sum's support is the union); then ``"union_update"`` (the first sum's
          survivors): down the union ``U``; up, summed securely, ``stats``, the values over ``U``'s
          rows and their indicator;
        * secure, ``"all"``: ``"train_dense"``: down the packed ``D``; up, summed securely, ``stats``,
          the values over all items and the indicator.

        The round's loss is the mean squared error of the answering clients on their own ratings
        after their local DCD, against the ``D`` they received (``M sum(stats[0]) / raters``); the
        raters come from the sums (plaintext: the uploads' item counts).
        """
        cfg, t = self.config, self.round
        if cfg.server == "none":
            raise ValueError("lightfr.server = 'none' has no exchanges (device_check refuses it on devices)")
        t0 = time.perf_counter()
        if self.early.stopped:  # early_stop = "authors": nothing trains after the stop
            self.round += 1
            self.dropped = {}
            return RoundStats(round=t, loss=self.early.last_loss, clients=0,
                              seconds={"round": time.perf_counter() - t0, "client": 0.0, "server": 0.0},
                              extra={"trained": False, "early_stopped": self.early.stopped})
        # with replacement a client drawn c times takes part once and its upload counts c times
        sel, mult = np.unique(self.sample_clients(), return_counts=True)
        weight = dict(zip(sel.tolist(), mult.tolist()))
        model = self.packed_items
        for u in sel:
            self.transport.send(SERVER, client(int(u)), t, "model", model, int(model.nbytes))
        down = {"d": model}
        w, m, k = self._width(), self.n_items, len(STATS)
        busy = time.perf_counter() - t0  # the server's own work between exchanges
        dropped: dict[int, str] = {}
        sec = {"bytes": 0.0, "client": 0.0, "server": 0.0}

        def secure_reply(got: Replies) -> None:
            dropped.update(got.dropped)
            sec["bytes"] += got.bytes_per_client
            sec["client"] += got.client_seconds
            sec["server"] += got.server_seconds

        aborted = None
        if cfg.secure_aggregation == "none":
            allowed = set(sel.tolist())
            got = yield Exchange("train", sel, broadcast=down, reply_keys=frozenset({"items", "body", "stats"}),
                                 validate=lambda u, reply: self._plain_upload(u, reply, allowed))
            ts = time.perf_counter()
            dropped.update(got.dropped)
            uploads: list[Upload] = list(got.values.values())
            for up in uploads:
                self.transport.send(client(up.user), SERVER, t, "update", up, up.nbytes)
            total, cnt = self.aggregate(uploads, weight)
            stats = np.sum([weight[up.user] * up.stats for up in uploads], axis=0) if uploads else np.zeros(k)
            answered = len(uploads)
            sampled = sum(weight[up.user] for up in uploads)  # |U_s| (with its repeats)
            up_bytes = float(np.mean([up.nbytes for up in uploads])) if uploads else 0.0
        else:
            rows = None
            dpf = cfg.secure_aggregation == "dpf"
            tail = -(-k // (w + 1))  # "dpf": rows after the items holding the stats
            ex = Exchange("train_dense", sel, broadcast=down, secure=self._secure(
                (m + tail) * (w + 1) if dpf else k + m * (w + 1), "update"))
            if cfg.secure_rows == "union" and not dpf:  # phase 1: the union U (a sum of random positive weights)
                got = yield Exchange("train_rated", sel, broadcast=down, secure=self._secure(m, "lightfr:rated"))
                ts = time.perf_counter()
                secure_reply(got)
                aborted = got.aborted
                if got.total is not None:
                    rows = np.flatnonzero(got.total > 0)  # (random positive weights: only the union is learnt)
                    for u in got.survivors:  # the server publishes U (4 bytes per item id)
                        self.transport.send(SERVER, client(int(u)), t, "lightfr:union", None, 4 * len(rows))
                    ex = Exchange("union_update", got.survivors, broadcast={"union": rows},
                                  secure=self._secure(k + len(rows) * (w + 1), "update"))
                busy += time.perf_counter() - ts
            if aborted is None:
                got = yield ex
                secure_reply(got)
                aborted = got.aborted
            ts = time.perf_counter()
            total, cnt, stats = np.zeros((m, w)), np.zeros(m), np.zeros(k)
            answered = 0
            if aborted is None:
                assert got.total is not None
                nr = m if rows is None else len(rows)
                at = slice(None) if rows is None else rows
                if dpf:  # rows: [values | indicator] per item, then a tail row holding the stats
                    table = got.total.reshape(m + tail, w + 1)
                    stats, total, cnt = table[m:].reshape(-1)[:k].copy(), table[:m, :w].copy(), np.round(table[:m, w])
                else:
                    stats = got.total[:k]
                    total[at] = got.total[k: k + nr * w].reshape(nr, w)
                    cnt[at] = np.round(got.total[k + nr * w:])
                answered = len(got.survivors)
            sampled = answered  # (no repeats: with-replacement sampling is plaintext only)
            up_bytes = sec["bytes"]
        before, self._item_sweeps = self.d, None
        if aborted is None:
            self.d = self.server_update(total, cnt, sampled=sampled)
        flipped = int((self.d != before).sum())
        self.round += 1
        self.dropped = dict(dropped)
        busy += time.perf_counter() - ts
        raters = float(cnt.sum())
        big_m, big_s = self.report_scales()
        extra: dict[str, Any] = {
            "bytes_up_per_client": up_bytes, "bytes_down_per_client": float(model.nbytes),
            "user_sweeps_mean": big_s * float(stats[1]) / sampled if sampled else math.nan,
            "users_converged": float(stats[2]) / sampled if sampled else math.nan,
            "items_moved": int((cnt > 0).sum()), "item_bits_flipped": flipped, "clients_answered": answered,
            "clients_dropped": len(dropped), "clients_repeated": int((mult > 1).sum())}
        if cfg.server == "dcd" and self._item_sweeps is not None and len(self._item_sweeps):
            extra["item_sweeps_max"] = int(self._item_sweeps.max())
        if aborted is not None:
            extra["aborted"] = aborted
        loss = big_m * float(stats[0]) / raters if raters else math.nan
        if cfg.early_stop == "authors" and aborted is None and sampled:
            # no bit changed anywhere: every client's DCD converged in its first sweep, no item bit flipped
            still = (flipped == 0 and abs(big_s * float(stats[1]) - sampled) < 0.5
                     and abs(float(stats[2]) - sampled) < 0.5)
            if self.early.observe(t, loss, still):
                extra["early_stopped"] = self.early.stopped
        return RoundStats(
            round=t, loss=loss, clients=int(mult.sum()),
            bytes_per_client=up_bytes + float(model.nbytes),
            seconds={"round": time.perf_counter() - t0, "client": sec["client"], "server": busy + sec["server"]},
            extra=extra, releases=(self._release(),),
        )

    def report_scales(self) -> tuple[int, int]:
        """``(M, S)``: the powers of two the first two :data:`STATS` are divided by (public)."""
        return 1 << (self.n_items - 1).bit_length(), 1 << (self.config.user_sweep_cap - 1).bit_length()

    def _plain_upload(self, user: int, reply: dict[str, np.ndarray], allowed: set[int]) -> Upload:
        """A plaintext reply as an :class:`Upload`, checked by :meth:`validate` (``UpdateError`` drops it)."""
        up = Upload(int(user), self.round, reply["items"], reply["body"], reply["stats"])
        self.validate(up, set(), allowed)
        return up

    def device_step(self, kind: str, round_: int, users: np.ndarray, broadcast: Mapping[str, np.ndarray],
                    per_user: Mapping[int, Mapping[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
        """The client half: every user in ``users`` runs step ``kind`` on this trainer's rows.

        ``"train"``, ``"train_rated"``, ``"train_dense"``: check the received ``D``, run the local
        DCD on ``b_u`` (kept on the device) and reply with the upload (plaintext), the rated
        indicator (the upload waits on the device for ``"union_update"``) or the dense vector
        (``"dpf"``: only its touched rows, ``rows``/``row_values``); ``"union_update"``: the waiting
        upload over the published union's rows. A sampled user without training ratings has nothing
        to upload and does not reply.
        """
        users = np.asarray(users, dtype=np.int64)
        if kind == "union_update":
            rows = self._received_union(broadcast)
            out: dict[int, dict[str, np.ndarray]] = {}
            for u in users.tolist():
                up = self._pending.pop(u, None)
                if up is not None and up.round == round_:
                    out[u] = {"vector": self._dense(up, rows)}
            return out
        if kind not in ("train", "train_rated", "train_dense"):
            raise ValueError(f"LightFR has no client step {kind!r}")
        ups = self._local_round(users, round_, self._received_codes(broadcast))
        if kind == "train":
            return {u: {"items": up.items, "body": up.body, "stats": up.stats} for u, up in ups.items()}
        if kind == "train_rated":
            self._pending.update(ups)
            out = {}
            for u, up in ups.items():
                vec = np.zeros(self.n_items)
                vec[up.items] = rated_weights(len(up.items), self.config.frac_bits)
                out[u] = {"vector": vec}
            return out
        if self.config.secure_aggregation == "dpf":
            return {u: self._table_rows(up) for u, up in ups.items()}
        return {u: {"vector": self._dense(up, None)} for u, up in ups.items()}

    def device_requires_secure(self, kind: str) -> bool:
        """With ``secure_aggregation`` set every step's reply goes only through secure aggregation:
        a client asked for any step in plaintext refuses (a plaintext ``"train"`` would reveal its upload)."""
        return self.config.secure_aggregation != "none"

    def _local_round(self, users: np.ndarray, round_: int, d: np.ndarray) -> dict[int, Upload]:
        """Local DCD of ``users``' codes against ``d`` and their uploads (batched; per user alone the same)."""
        cfg, f = self.config, self.f
        pidx = self._pairs(users)
        us, it, r = self.users[pidx], self.items[pidx], self.r[pidx]
        active = np.zeros(self.n_users, dtype=bool)
        active[users] = True
        res = bc.dcd_users(self.b, d, us, it, r, lam=self._lam(cfg.lambda_user, self.counts),
                           max_sweeps=cfg.user_sweep_cap, active=active, stickiness=cfg.user_stickiness)
        self.b[users] = res.codes[users]
        body = self._client_bodies(self.b, us, it, r, d)
        err = r - 0.5 - bc._pair_inner(self.b, d, us, it) / (2 * f)
        loss = np.bincount(us, weights=err**2, minlength=self.n_users)
        offs = np.concatenate(([0], np.cumsum(self.counts[users])))
        big_m, big_s = self.report_scales()
        out = {}
        for j, u in enumerate(users.tolist()):
            if self.counts[u] == 0:
                continue
            stats = np.array([loss[u] / big_m, res.sweeps[u] / big_s, float(res.converged[u])])
            out[u] = Upload(u, int(round_), it[offs[j]:offs[j + 1]], body[offs[j]:offs[j + 1]],
                            _grid(stats, cfg.frac_bits))
        return out

    def _received_codes(self, message: Mapping[str, np.ndarray]) -> np.ndarray:
        """The item codes ``D`` a client received (packed), checked before use."""
        packed, shape = message.get("d"), (self.n_items, bc.words(self.f))
        if not isinstance(packed, np.ndarray) or packed.shape != shape or packed.dtype != np.uint64:
            raise UpdateError(f"the server's item codes must be uint64 {list(shape)}; found "
                              f"{getattr(packed, 'dtype', type(packed).__name__)} {getattr(packed, 'shape', '')}")
        try:
            return bc.unpack(packed, self.f)
        except bc.CodeError as exc:
            raise UpdateError(f"the server's item codes are malformed: {exc}") from None

    def _received_union(self, message: Mapping[str, np.ndarray]) -> np.ndarray:
        """The published union ``U`` (ascending item ids), checked before use."""
        rows = message.get("union")
        if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype.kind not in "iu" \
                or (len(rows) and (rows.min() < 0 or rows.max() >= self.n_items)) or np.any(np.diff(rows) <= 0):
            raise UpdateError(f"the published union must be ascending item ids in 0..{self.n_items - 1}")
        return rows.astype(np.int64)

    def _dense(self, up: Upload, rows: np.ndarray | None) -> np.ndarray:
        """A client's secure vector: ``stats``, then its values over ``rows`` (all items if ``None``;
        zero where it rated nothing), then its rated indicator over ``rows``."""
        k, w = len(STATS), self._width()
        if rows is None:
            nr, at = self.n_items, up.items
        else:
            nr, at = len(rows), np.searchsorted(rows, up.items)
            if np.any(at >= nr) or np.any(rows[np.minimum(at, max(nr - 1, 0))] != up.items):
                raise UpdateError(f"client {up.user}: rated items outside the published union of the round")
        vec = np.zeros(k + nr * (w + 1))
        vec[:k] = up.stats
        vec[k: k + nr * w].reshape(nr, w)[at] = up.body
        vec[k + nr * w + at] = 1.0
        return vec

    def _table_rows(self, up: Upload) -> dict[str, np.ndarray]:
        """``"dpf"``: a client's reply as the rows it touches in the table of ``m + tail`` rows of ``w + 1``:
        the rows of its rated items (its values and a 1), then the tail rows holding its ``stats``; every
        other row is zero and never sent (the DPF sum carries only nonzero rows), so no dense
        ``(m + tail) x (w + 1)`` vector is built (366 of them were 1.9 GB on ml-latest-small)."""
        k, w, m = len(STATS), self._width(), self.n_items
        tail = -(-k // (w + 1))
        vals = np.zeros((len(up.items) + tail, w + 1))
        vals[: len(up.items), :w] = up.body
        vals[: len(up.items), w] = 1.0
        vals[len(up.items):].reshape(-1)[:k] = up.stats
        rows = np.concatenate([np.asarray(up.items, np.int64), np.arange(m, m + tail, dtype=np.int64)])
        return {"rows": rows, "row_values": vals}

    def device_state(self, user: int) -> dict[str, np.ndarray]:
        """User ``user``'s state on its device: its code ``b_u`` (and a secure upload between phases)."""
        u = int(user)
        out = {"b": self.b[u].copy()}
        up = self._pending.get(u)
        if up is not None:
            out.update(pending_round=np.array(up.round, np.int64), pending_items=up.items.copy(),
                       pending_body=up.body.copy(), pending_stats=up.stats.copy())
        return out

    def load_device_state(self, user: int, state: Mapping[str, np.ndarray]) -> None:
        u = int(user)
        pending = {"pending_round", "pending_items", "pending_body", "pending_stats"}
        if set(state) not in ({"b"}, {"b"} | pending):
            raise ValueError(f"client {u}'s state must hold 'b' (and the pending upload); found {sorted(state)}")
        b = bc.check_codes(np.asarray(state["b"]), f=self.f, what=f"client {u}'s code")
        if b.shape != (self.f,):
            raise ValueError(f"client {u}'s code must be one code of {self.f} bits; found shape {b.shape}")
        self.b[u] = b
        self._pending.pop(u, None)
        if "pending_round" in state:
            self._pending[u] = Upload(u, int(state["pending_round"]), np.asarray(state["pending_items"], np.int64),
                                      np.asarray(state["pending_body"]), np.asarray(state["pending_stats"], np.float64))

    def device_model(self) -> dict[str, np.ndarray]:
        """What a client needs to score: the packed item codes."""
        return {"d": self.packed_items}

    def load_device_model(self, model: Mapping[str, np.ndarray]) -> None:
        self.d = self._received_codes(model)

    def _client_bodies(self, b: np.ndarray, users: np.ndarray, items: np.ndarray, r: np.ndarray,
                       d: np.ndarray | None = None) -> np.ndarray:
        """The per-pair upload bodies against the item codes ``d`` a client holds (default: ``self.d``)."""
        cfg = self.config
        d = self.d if d is None else d
        if cfg.server == "grad":
            return _grid(bc.item_gradients(b, d, users, items, r), cfg.frac_bits)
        if cfg.server == "para":
            return bc.local_item_codes(b, d, users, items, r, lam=float(self._lam(cfg.lambda_item, 1)))
        a_p, g_p = bc.pair_stats(b, users, r)
        return np.concatenate([_grid(a_p, cfg.frac_bits), g_p], axis=1)

    def _release(self) -> Release:
        cfg = self.config
        if cfg.secure_aggregation == "none":
            what = {"grad": "each sampled user's real-valued item update (reveals its ratings and code: notes §1.3)",
                    "para": "each sampled user's locally updated codes of its rated items",
                    "dcd": "each sampled user's per-item sufficient statistics (reveals its code and ratings)"}[cfg.server]
        else:
            what = f"per-item sums over the round's raters ({cfg.secure_aggregation}, no DP noise)"
        return Release(NonPrivate(), who="clients", what=what)

    # -- the server --------------------------------------------------------------------------------
    def _width(self) -> int:
        f = self.f
        return f + f * f if self.config.server == "dcd" else f

    def validate(self, up: Upload, seen: set[int], allowed: set[int] | None = None) -> None:
        """Refuse a malformed upload with :class:`UpdateError` (nothing changes)."""
        if not isinstance(up, Upload):
            raise UpdateError(f"expected an Upload; found {type(up).__name__}")
        if type(up.round) is not int or up.round != self.round:
            raise UpdateError(f"upload for round {up.round!r} refused: the server is in round {self.round}")
        if type(up.user) is not int or not 0 <= up.user < self.n_users or (allowed is not None and up.user not in allowed):
            raise UpdateError(f"upload from client {up.user!r}, which was not sampled in round {self.round}")
        if up.user in seen:
            raise UpdateError(f"second upload from client {up.user} in round {self.round} (replay) refused")
        ids = up.items
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) == 0:
            raise UpdateError(f"client {up.user}: item ids must be a non-empty 1-D int array; found {ids!r}")
        if ids.min() < 0 or ids.max() >= self.n_items:
            bad = int(ids.max() if ids.max() >= self.n_items else ids.min())
            raise UpdateError(f"client {up.user}: update for unknown item {bad} (items are 0..{self.n_items - 1})")
        if np.any(np.diff(ids) <= 0):
            raise UpdateError(f"client {up.user}: item ids must be unique and ascending")
        body, shape = up.body, (len(ids), self._width())
        if not isinstance(body, np.ndarray) or body.shape != shape:
            raise UpdateError(f"client {up.user}: expected an update of shape {shape}; found "
                              f"{getattr(body, 'shape', type(body).__name__)} (wrong code length?)")
        if self.config.server == "para":
            try:
                bc.check_codes(body, f=self.f, what=f"client {up.user}'s item codes")
            except bc.CodeError as exc:
                raise UpdateError(str(exc)) from None
        else:
            if body.dtype != np.float64 or not np.isfinite(body).all():
                raise UpdateError(f"client {up.user}: expected finite float64 values; found {body.dtype}")
            big = float(np.abs(body).max())
            if big > self.config.value_clip:
                raise UpdateError(f"client {up.user}: value {big:.3g} exceeds the bound {self.config.value_clip}")
        st = up.stats
        if st is not None and (not isinstance(st, np.ndarray) or st.shape != (len(STATS),) or st.dtype != np.float64
                               or not np.isfinite(st).all() or st.min() < 0 or st.max() > 1):
            raise UpdateError(f"client {up.user}: the round's report {STATS} must be {len(STATS)} float64 values "
                              f"in [0, 1]; found {getattr(st, 'dtype', type(st).__name__)} {getattr(st, 'shape', '')}")

    def validate_all(self, uploads: list[Upload], allowed: set[int] | None = None) -> None:
        seen: set[int] = set()
        for up in uploads:
            self.validate(up, seen, allowed)
            seen.add(up.user)

    def aggregate(self, uploads: list[Upload],
                  weight: Mapping[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Validate EVERY upload, then return ``(sum [m, width], raters [m])``; ``weight[user]`` (default
        1) is how often the client was drawn (``client_sampling = "with-replacement"``): its upload
        counts that often, as in the authors' code's sums over the drawn multiset."""
        self.validate_all(uploads)
        total = np.zeros((self.n_items, self._width()))
        cnt = np.zeros(self.n_items)
        for up in uploads:
            c = 1 if weight is None else weight[up.user]
            total[up.items] += up.body if c == 1 else c * up.body
            cnt[up.items] += c
        return total, cnt

    def server_update(self, total: np.ndarray, cnt: np.ndarray, *, sampled: float | None = None) -> np.ndarray:
        """New item codes from the round's sums (the same for the plaintext and the secure form).

        ``sampled`` is ``|U_s|``, the number of clients the sums came from (needed by
        ``item_add_back = "sampled"``, which adds bit k's own term back ``|U_s|`` times instead of once
        per rater: ``+ (|U_s| - n_i) d_ik / (2f^2)`` on Agg_grad's step, the DCD's add-back for ``"dcd"``).
        """
        cfg, f, d = self.config, self.f, self.d
        moved = cnt > 0
        lam = self._lam(cfg.lambda_item, cnt)
        extra_back = None
        if cfg.item_add_back == "sampled":
            if sampled is None:
                raise ValueError("lightfr.item_add_back = 'sampled' needs the round's number of clients (sampled=)")
            extra_back = float(sampled) - cnt  # beyond the raters' own add-back
        if cfg.server == "grad":
            df = d.astype(np.float64)
            star = total / f - 2 * lam[:, None] * (df.sum(1, keepdims=True) - df)
            if extra_back is not None:
                star = star + extra_back[:, None] * df / (2 * f * f)
        elif cfg.server == "para":
            star = total
        else:
            idx = np.flatnonzero(moved)
            new = d.copy()
            self._item_sweeps = np.zeros(0, np.int64)
            if len(idx):
                a, g = total[idx, :f], total[idx, f:].reshape(len(idx), f, f)
                res = bc.item_dcd(d[idx], a, g, cnt[idx], lam=lam[idx], max_sweeps=cfg.item_sweep_cap,
                                  add_back=None if extra_back is None else float(sampled))
                new[idx], self._item_sweeps = res.codes, res.sweeps
            return new
        new = np.where(star > 0, 1, np.where(star < 0, -1, d)).astype(np.int8)
        return np.where(moved[:, None], new, d).astype(np.int8)

    # -- evaluation and cold start -----------------------------------------------------------------
    def train_loss(self) -> float:
        """Mean ``(r - sim)^2`` over the training ratings (scaled)."""
        s = bc._pair_inner(self.b, self.d, self.users, self.items)
        return float(np.mean((self.r - 0.5 - s / (2 * self.f)) ** 2))

    def raw_scores(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """``b_u . d_i`` (integers as float), each client on its own device."""
        users, items = np.asarray(users), np.asarray(items)
        return np.einsum("bf,bkf->bk", self.b[users].astype(np.float32), self.d[items].astype(np.float32)).astype(np.float64)

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        users, items = np.asarray(users), np.asarray(items)
        s = self.raw_scores(users, items)
        if self.config.ties == "random":
            s = s + tie_jitter(np.broadcast_to(users[:, None], items.shape), items, self.seed)
        return s

    def score_all(self, users: np.ndarray) -> np.ndarray:
        users = np.asarray(users)
        s = bc.inner(bc.pack(self.b[users]), self.packed_items, self.f).astype(np.float64)
        if self.config.ties == "random":
            s = s + tie_jitter(users[:, None], np.arange(self.n_items)[None, :], self.seed)
        return s

    def cold_start_code(self, items: np.ndarray, ratings: np.ndarray, seed: int = 0) -> np.ndarray:
        """A new user's code from a few ratings (Eq. 19: DCD on the device, no balance term, §2.10).

        Nothing else changes: the new user is not added to the model.
        """
        items = np.asarray(items, dtype=np.int64)
        if len(items) == 0 or items.min() < 0 or items.max() >= self.n_items:
            raise UpdateError(f"cold start needs known item ids in 0..{self.n_items - 1}; found {items!r}")
        r = _grid(np.clip(bc.scale_ratings(ratings, self.lo, self.hi), 0, 1), self.config.frac_bits)
        b0 = bc.random_codes(1, self.f, np.random.default_rng(seed))
        res = bc.dcd_users(b0, self.d, np.zeros(len(items), np.int64), items, r, lam=0.0, max_sweeps=1000)
        return res.codes[0]

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "b": self.b.copy(), "d": self.d.copy(), "early_stop": self.early.state(),
                "rng": self.rng.bit_generator.state, "config": {"bits": self.f, "server": self.config.server}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        b = bc.check_codes(np.asarray(state["b"]), f=self.f, what="checkpoint user codes")
        d = bc.check_codes(np.asarray(state["d"]), f=self.f, what="checkpoint item codes")
        if b.shape != self.b.shape or d.shape != self.d.shape:
            raise ValueError(f"checkpoint codes {b.shape}, {d.shape} do not match this LightFR run")
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        self.round, self.b, self.d, self.rng = int(state["round"]), b, d, rng
        self.early = EarlyStop(self.config.early_stop_threshold, **state.get("early_stop", {}))

    def public_info(self) -> dict[str, Any]:
        """What the server knows besides the transcript."""
        c = self.config
        return {"n_users": self.n_users, "n_items": self.n_items, "bits": self.f, "server": c.server,
                "secure_aggregation": c.secure_aggregation, "rating_range": [self.lo, self.hi],
                "rating_scale": sorted({float(x) for x in np.unique(self.raw)}),
                "rating_mean": float(self.raw.mean()),  # a published statistic: the attack's sign prior
                "lambda_item": c.lambda_item, "lambda_user": c.lambda_user, "lambda_scale": c.lambda_scale,
                "frac_bits": c.frac_bits, "client_fraction": c.client_fraction, "secure_rows": c.secure_rows,
                "user_stickiness": c.user_stickiness, "item_add_back": c.item_add_back, "sweeps": c.sweeps,
                "client_sampling": c.client_sampling, "early_stop": c.early_stop}

    def cost_report(self) -> dict[str, Any]:
        """Storage of the model as the client holds it: packed, and one byte per bit (notes §9.12)."""
        m, f = self.n_items, self.f
        return {"storage_bytes_packed": (m + 1) * bc.words(f) * 8, "storage_bytes_one_byte_per_bit": (m + 1) * f,
                "storage_bytes_float32_mf_same_dim": (m + 1) * f * 4}


def device_check(config: LightFRConfig) -> None:
    """Refuse, in words, a configuration whose server and clients cannot run on separate devices."""
    if config.init == "mf":
        raise ValueError("lightfr.init = 'mf' pre-trains a real-valued MF centrally on every user's ratings "
                         "(LightFR_init, notes §2.8); no party on separate devices holds them. Use init = 'random' "
                         "(a federated MF pre-training is not implemented)")
    if config.server == "none":
        raise ValueError("lightfr.server = 'none' trains nothing: its rounds have no exchanges and its loss is "
                         "computed on the server from every user's ratings; run the ablation in process")
    if not config.has_rating_scale:
        raise ValueError("set lightfr.rating_min and lightfr.rating_max (the public rating scale, e.g. 0.5 and 5 "
                         "for MovieLens) to run on separate devices: by default they are the training data's "
                         "smallest and largest rating, which a server holding no ratings cannot compute and each "
                         "client would compute from its own ratings only")


register(ProtocolSpec(
    name="lightfr",
    summary="LightFR: federated binary-code MF by discrete coordinate descent (Agg_grad/Agg_para/exact DCD)",
    build=lambda ctx: LightFR(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport),
    section="lightfr",
    config_cls=LightFRConfig,
    task="ranking",
    keeps_ratings=True,
    exchanges=Exchanges(check=device_check),
))
