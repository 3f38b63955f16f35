"""LightFR (Zhang et al., TOIS 2023): federated binary-code MF by discrete coordinate descent.

Parties:
    * one client per user, holding its ratings and its code ``b_u in {-1,+1}^f`` (never sent);
    * the server, holding the item codes ``D in {-1,+1}^{m x f}`` (public: broadcast packed).

Round ``t`` (notes §2.7, Algorithm 1):
    1. the server samples ``round(p n)`` clients (seeded simulation choice) and sends them ``D``
       packed (kind ``"model"``, ``m * ceil(f/64) * 8`` bytes);
    2. each sampled client runs bit-wise DCD on ``b_u`` to convergence (at most
       ``user_sweeps`` sweeps; :func:`recmodels.binary_codes.dcd_users`);
    3. each client uploads (kind ``"update"``), by ``server``:
       ``"grad"`` (Agg_grad, Eq. 16, the paper's default): ``Delta d^u_ik`` for its rated items
       and a rated-item indicator; ``"para"`` (Agg_para, Eq. 17): its locally updated codes of
       its rated items (a sign vote); ``"dcd"`` (notes §9.4 option B): per rated item
       ``(r - 1/2) b_u``, ``b_u b_u^T`` and 1, the sufficient statistics of the exact item DCD;
    4. the server validates every upload (round, sender, replay, ids, shape, values; codes in
       ``{-1,+1}``) before changing anything, sums them, and updates only items with at least one
       rater this round (§9.4): ``"grad"``: ``d_ik <- sign(F(sum/f - 2 lam_i sum_{k'!=k} d_ik', d_ik))``
       (Jacobi); ``"para"``: ``d_ik <- sign(F(sum of votes, d_ik))``; ``"dcd"``: the exact
       Gauss-Seidel item DCD to convergence (``item_sweeps``). ``"none"``: no training (the
       ``lightfr-init`` and ``lightfr-random`` ablations).

Every server update needs only sums. With ``secure_aggregation`` set, each client's upload is a
dense, zero-padded vector over ALL items (values and the rated indicator) summed through
:func:`protocols.secure_sum.secure_sum` (SecAgg+ by default). Uploads are put on the fixed-point
grid ``2^-frac_bits`` on the device in both forms, so the decoded secure sum equals the plaintext
float sum exactly and the codes are bit-identical (tested).

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

Simulation: clients are batched (numpy); the client-side work is identical to per-client work.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dp.events import NonPrivate
from protocols.base import Release, RoundStats
from protocols.registry import ProtocolSpec, register
from protocols.secure_sum import secure_sum
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
    "Upload",
    "UpdateError",
    "rank_metrics",
    "tie_jitter",
]

SERVERS = ("grad", "para", "dcd", "none")
INITS = ("random", "mf")
SECURE = ("none", "secagg+", "secagg")
TIES = ("random", "pessimistic")
LAMBDA_SCALES = ("count", "none")
BROADCAST = "clients"
#: Most values (clients x columns) summed by one secure-aggregation instance (memory bound: a few
#: float64/uint64 arrays of this size live at once; each instance pays the key agreement again).
SECURE_CHUNK = 1 << 24
SECURE_ROWS = ("union", "all")


class UpdateError(ValueError):
    """A client upload was refused (round, sender, replay, item ids, shape, values or codes)."""


@dataclass(frozen=True)
class LightFRConfig:
    """``[lightfr]``: LightFR's options (notes §9 for every choice the paper leaves open).

    Attributes:
        bits: code length f (64, the paper's).
        server: ``"grad"`` (Agg_grad), ``"para"`` (Agg_para), ``"dcd"`` (exact server DCD from
            sufficient statistics) or ``"none"`` (no training).
        init: ``"random"`` (i.i.d. uniform codes, the authors') or ``"mf"`` (median-quantised MF
            features, LightFR_init).
        client_fraction: p, the fraction of clients per round (0.6).
        user_sweeps: at most this many DCD sweeps over a user's bits per round (convergence stops earlier).
        item_sweeps: the same for the server's item DCD (``server = "dcd"``).
        lambda_user, lambda_item: balance weights (within-code form, §9.2).
        lambda_scale: ``"count"`` multiplies lambda by ``|I_u|/f^2`` (``n_i/f^2`` for items, the
            raters of the round) so that the balance term has the data term's scale (§9.3: the data
            term of a bit is at most ``n/f``, the balance term up to ``2 lambda f``); ``"none"`` uses it raw (the paper's
            reading, which collapses the codes at the paper's lambda: docs/lightfr.md).
        secure_aggregation: ``"none"`` (the paper), ``"secagg+"`` or ``"secagg"``.
        secure_rows: ``"union"`` (default): a first secure sum of the rated indicators gives the
            per-item rater counts (which the ``"all"`` form reveals anyway), the server publishes the
            union ``U`` of the round's rated items, and the value sum runs over ``U``'s rows only;
            ``"all"``: one dense sum over every item. Same sums, same codes, same server view.
        frac_bits: fixed-point fractional bits of every upload (both forms).
        secagg_dropout, secagg_corrupt: the fractions SecAgg+ chooses k and t for.
        ties: ranking tie rule of ``score`` (``"random"`` or ``"pessimistic"``).
        mf_epochs: epochs of the real-valued MF behind ``init = "mf"``.
    """

    bits: int = 64
    server: str = "grad"
    init: str = "random"
    client_fraction: float = 0.6
    user_sweeps: int = 10
    item_sweeps: int = 10
    lambda_user: float = 0.0
    lambda_item: float = 0.0
    lambda_scale: str = "count"
    secure_aggregation: str = "none"
    secure_rows: str = "union"
    frac_bits: int = 24
    secagg_dropout: float = 0.1
    secagg_corrupt: float = 0.05
    ties: str = "random"
    mf_epochs: int = 20

    def __post_init__(self) -> None:
        for name, allowed in (("server", SERVERS), ("init", INITS), ("secure_aggregation", SECURE),
                              ("ties", TIES), ("lambda_scale", LAMBDA_SCALES),
                              ("secure_rows", SECURE_ROWS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"lightfr.{name} must be one of {allowed}; found {getattr(self, name)!r}")
        for name, lo in (("bits", 1), ("user_sweeps", 1), ("item_sweeps", 1), ("mf_epochs", 0), ("frac_bits", 1)):
            v = getattr(self, name)
            if type(v) is not int or v < lo:
                raise ValueError(f"lightfr.{name} must be an int >= {lo}; found {v!r}")
        if self.bits > 4096:
            raise ValueError(f"lightfr.bits must be <= 4096; found {self.bits}")
        if self.frac_bits > 40:
            raise ValueError(f"lightfr.frac_bits must be <= 40 (the fixed-point budget); found {self.frac_bits}")
        if not (isinstance(self.client_fraction, (int, float)) and 0 < self.client_fraction <= 1):
            raise ValueError(f"lightfr.client_fraction must be in (0, 1]; found {self.client_fraction!r}")
        for name in ("lambda_user", "lambda_item"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"lightfr.{name} must be a finite number >= 0; found {v!r}")
        if not 0 <= self.secagg_dropout < 1:
            raise ValueError(f"lightfr.secagg_dropout must be in [0, 1); found {self.secagg_dropout!r}")
        if not 0 <= self.secagg_corrupt < 0.5:
            raise ValueError(f"lightfr.secagg_corrupt must be in [0, 0.5); found {self.secagg_corrupt!r}")

    @property
    def value_clip(self) -> float:
        """Largest ``|value|`` of an upload: ``|r - sim| + 1/(2f) <= 1.5`` (grad), 1 otherwise."""
        return 2.0 if self.server == "grad" else 1.0


@dataclass(frozen=True)
class Upload:
    """One client's plaintext upload as the server receives it.

    Attributes:
        user: the sender's user index.
        round: the round it belongs to.
        items: int64 sorted rated item ids (in the clear in the plaintext form).
        body: float64 ``[k, f]`` (grad), int8 ``[k, f]`` codes (para) or float64 ``[k, f + f*f]``
            (dcd: ``(r - 1/2) b_u`` then ``b_u b_u^T`` flattened).
    """

    user: int
    round: int
    items: np.ndarray
    body: np.ndarray

    @property
    def nbytes(self) -> int:
        return 4 * len(self.items) + int(self.body.nbytes)


def tie_jitter(users: np.ndarray, items: np.ndarray, seed: int) -> np.ndarray:
    """Keyed pseudo-random jitter in ``[0, 0.5)`` per (user, item) (splitmix64; simulation only)."""
    with np.errstate(over="ignore"):
        x = (np.asarray(users, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             ^ np.asarray(items, dtype=np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
             ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 0.5


def rank_metrics(scores: np.ndarray, k: int = 10, seed: int = 0) -> dict[str, float]:
    """HR@k and NDCG@k of column 0 among each row's candidates under three tie rules.

    ``scores`` are the raw (integer-valued) scores ``b_u . d_i``; returns ``HR@k``/``NDCG@k``
    (random ties, uniformly among equal scores, in expectation), ``..._optimistic`` (ties in the
    held-out item's favour: the authors' code) and ``..._pessimistic`` (against it).
    """
    s = np.asarray(scores, dtype=np.float64)
    above = (s[:, 1:] > s[:, :1]).sum(1)
    tied = (s[:, 1:] == s[:, :1]).sum(1)
    out: dict[str, float] = {}
    for name, ranks in (("optimistic", [above + 1]), ("pessimistic", [above + tied + 1]),
                        ("random", [above + 1 + j for j in range(int(tied.max(initial=0)) + 1)])):
        hr = np.zeros(len(s))
        nd = np.zeros(len(s))
        if name == "random":  # expectation over the tied positions, each with probability 1/(tied+1)
            for j, r in enumerate(ranks):
                w = np.where(j <= tied, 1.0 / (tied + 1), 0.0)
                hit = r <= k
                hr += w * hit
                nd += w * hit / np.log2(r + 1)
        else:
            r = ranks[0]
            hr, nd = (r <= k).astype(float), (r <= k) / np.log2(r + 1)
        suffix = "" if name == "random" else f"_{name}"
        out[f"HR@{k}{suffix}"] = float(hr.mean())
        out[f"NDCG@{k}{suffix}"] = float(nd.mean())
    return out


def _grid(x: np.ndarray, frac_bits: int) -> np.ndarray:
    """Round to the fixed-point grid ``2^-frac_bits`` (done on the device in both forms)."""
    scale = float(1 << frac_bits)
    return np.round(np.asarray(x, dtype=np.float64) * scale) / scale


class LightFR:
    """LightFR simulation (see the module docstring).

    Args:
        train: training ratings (explicit; scaled to ``[0, 1]`` by the training range).
        config: the ``[lightfr]`` section.
        seed: seeds initialisation, client sampling and the tie jitter (simulation randomness;
            secure aggregation draws its keys and masks from the CSPRNG).
        transport: where messages go (default: keeps what the server received or sent).
    """

    def __init__(self, train: Interactions, config: LightFRConfig, *, seed: int,
                 transport: InProcessTransport | None = None):
        self.train, self.config, self.seed = train, config, int(seed)
        self.transport = transport or InProcessTransport(
            Transcript(keep_payloads=lambda r: r.receiver == SERVER or r.sender == SERVER))
        self.n_users, self.n_items, self.f = train.n_users, train.n_items, config.bits
        if self.n_users < 1 or len(train) == 0:
            raise ValueError("LightFR needs at least one training rating")
        self.lo, self.hi = float(train.ratings.min()), float(train.ratings.max())
        order = np.lexsort((train.items, train.users))
        self.users = train.users[order].astype(np.int64)
        self.items = train.items[order].astype(np.int64)
        self.raw = train.ratings[order].astype(np.float64)
        self.r = _grid(bc.scale_ratings(self.raw, self.lo, self.hi), config.frac_bits)
        self.counts = np.bincount(self.users, minlength=self.n_users)
        self.starts = np.concatenate(([0], np.cumsum(self.counts)[:-1]))
        self.rng = np.random.default_rng([self.seed, 0x11F])
        self.round = 0
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
        """This round's clients: ``max(1, round(p n))`` without replacement (seeded)."""
        n = max(1, int(round(self.config.client_fraction * self.n_users)))
        return np.sort(self.rng.choice(self.n_users, size=n, replace=False))

    @property
    def packed_items(self) -> np.ndarray:
        return bc.pack(self.d)

    # -- one round -------------------------------------------------------------------------------
    def run_round(self) -> RoundStats:
        """Sample, broadcast, local DCD, upload, validate, aggregate, update."""
        t0 = time.perf_counter()
        cfg, t = self.config, self.round
        if cfg.server == "none":
            self.round += 1
            return RoundStats(round=t, loss=self.train_loss(), clients=0,
                              seconds={"round": time.perf_counter() - t0, "client": 0.0, "server": 0.0},
                              extra={"trained": False})
        sel = self.sample_clients()
        model = self.packed_items
        for u in sel:
            self.transport.send(SERVER, client(u), t, "model", model, int(model.nbytes))
        tc = time.perf_counter()
        pidx = self._pairs(sel)
        users, items, r = self.users[pidx], self.items[pidx], self.r[pidx]
        active = np.zeros(self.n_users, dtype=bool)
        active[sel] = True
        res = bc.dcd_users(self.b, self.d, users, items, r, lam=self._lam(cfg.lambda_user, self.counts),
                           max_sweeps=cfg.user_sweeps, active=active)
        b_new = res.codes
        body = self._client_bodies(b_new, users, items, r)
        offs = np.concatenate(([0], np.cumsum(self.counts[sel])))
        uploads = [Upload(int(u), t, items[offs[j]:offs[j + 1]], body[offs[j]:offs[j + 1]])
                   for j, u in enumerate(sel) if self.counts[u] > 0]
        client_s = (time.perf_counter() - tc) / len(sel)
        ts = time.perf_counter()
        if cfg.secure_aggregation == "none":
            for up in uploads:
                self.transport.send(client(up.user), SERVER, t, "update", up, up.nbytes)
            total, cnt = self.aggregate(uploads)
            up_bytes = float(np.mean([up.nbytes for up in uploads]))
            sa_client_s = 0.0
        else:
            self.validate_all(uploads)
            total, cnt, up_bytes, sa_client_s = self._secure_total(uploads)
        new_d = self.server_update(total, cnt)
        server_s = time.perf_counter() - ts
        self.b, self.d = b_new, new_d
        self.round += 1
        return RoundStats(
            round=t, loss=self.train_loss(), clients=len(sel),
            bytes_per_client=up_bytes + float(model.nbytes),
            seconds={"round": time.perf_counter() - t0, "client": client_s + sa_client_s, "server": server_s},
            extra={"bytes_up_per_client": up_bytes, "bytes_down_per_client": float(model.nbytes),
                   "user_sweeps_mean": float(res.sweeps[sel].mean()),
                   "users_converged": float(res.converged[sel].mean()),
                   "items_moved": int((cnt > 0).sum())},
            releases=(self._release(),),
        )

    def _client_bodies(self, b: np.ndarray, users: np.ndarray, items: np.ndarray, r: np.ndarray) -> np.ndarray:
        cfg = self.config
        if cfg.server == "grad":
            return _grid(bc.item_gradients(b, self.d, users, items, r), cfg.frac_bits)
        if cfg.server == "para":
            return bc.local_item_codes(b, self.d, users, items, r, lam=float(self._lam(cfg.lambda_item, 1)))
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

    def validate_all(self, uploads: list[Upload], allowed: set[int] | None = None) -> None:
        seen: set[int] = set()
        for up in uploads:
            self.validate(up, seen, allowed)
            seen.add(up.user)

    def aggregate(self, uploads: list[Upload]) -> tuple[np.ndarray, np.ndarray]:
        """Validate EVERY upload, then return ``(sum [m, width], raters [m])``."""
        self.validate_all(uploads)
        total = np.zeros((self.n_items, self._width()))
        cnt = np.zeros(self.n_items)
        for up in uploads:
            total[up.items] += up.body
            cnt[up.items] += 1
        return total, cnt

    def dense_vectors(self, uploads: list[Upload], lo: int = 0, hi: int | None = None,
                      rows: np.ndarray | None = None) -> np.ndarray:
        """Columns ``lo:hi`` of each client's zero-padded dense upload over ``rows`` (default: all
        items; length ``len(rows) * width + len(rows)``: the values of every row's item, zero where
        unrated, then the rated indicator). Every uploaded item must be in ``rows``."""
        w, m = self._width(), self.n_items
        where = np.arange(m) if rows is None else np.full(m, -1)
        if rows is not None:
            where[rows] = np.arange(len(rows))
        nr = m if rows is None else len(rows)
        hi = nr * w + nr if hi is None else hi
        out = np.zeros((len(uploads), hi - lo))
        for j, up in enumerate(uploads):
            at = where[up.items]
            if (at < 0).any():
                raise UpdateError(f"client {up.user}: rated items outside the published union of the round")
            pos = np.concatenate([(at[:, None] * w + np.arange(w)[None, :]).ravel(), nr * w + at])
            vals = np.concatenate([up.body.astype(np.float64).ravel(), np.ones(len(at))])
            keep = (pos >= lo) & (pos < hi)
            out[j, pos[keep] - lo] = vals[keep]
        return out

    def _chunked_sum(self, uploads: list[Upload], dim: int, kind: str,
                     columns: Any) -> tuple[np.ndarray, float, float]:
        """``columns(lo, hi)`` of every client summed through secure aggregation, in chunks of at most
        ``SECURE_CHUNK`` client-values (one protocol instance each); the sum, bytes and seconds per client."""
        cfg = self.config
        step = max(1, SECURE_CHUNK // max(len(uploads), 1))
        total = np.empty(dim)
        nbytes = secs = 0.0
        for lo in range(0, dim, step):
            hi = min(dim, lo + step)
            res = secure_sum(
                columns(lo, hi), protocol=cfg.secure_aggregation, frac_bits=cfg.frac_bits,
                value_clip=cfg.value_clip, round=self.round, transport=self.transport, kind=kind,
                senders=[client(up.user) for up in uploads], where="lightfr.value_clip",
                dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt,
            )
            total[lo:hi] = res.total
            nbytes += float(res.bytes_per_client)
            secs += float(np.mean(res.client_seconds))
        return total, nbytes, secs

    def _secure_total(self, uploads: list[Upload]) -> tuple[np.ndarray, np.ndarray, float, float]:
        """The sums through secure aggregation (``secure_rows``: over the round's union or all items)."""
        w, m = self._width(), self.n_items
        up_bytes = client_s = 0.0
        rows = None
        if self.config.secure_rows == "union":  # phase 1: the rater counts, hence the union U
            def rated(lo: int, hi: int) -> np.ndarray:
                out = np.zeros((len(uploads), hi - lo))
                for j, up in enumerate(uploads):
                    it = up.items[(up.items >= lo) & (up.items < hi)]
                    out[j, it - lo] = 1.0
                return out
            counts, up_bytes, client_s = self._chunked_sum(uploads, m, "lightfr:rated", rated)
            rows = np.flatnonzero(np.round(counts) > 0)
            for up in uploads:  # the server publishes U (4 bytes per item id)
                self.transport.send(SERVER, client(up.user), self.round, "lightfr:union", None, 4 * len(rows))
        nr = m if rows is None else len(rows)
        total, nbytes, secs = self._chunked_sum(uploads, nr * w + nr, "update",
                                                lambda lo, hi: self.dense_vectors(uploads, lo, hi, rows))
        vals, cnt = np.zeros((m, w)), np.zeros(m)
        at = slice(None) if rows is None else rows
        vals[at] = total[: nr * w].reshape(nr, w)
        cnt[at] = np.round(total[nr * w:])
        return vals, cnt, up_bytes + nbytes, client_s + secs

    def server_update(self, total: np.ndarray, cnt: np.ndarray) -> np.ndarray:
        """New item codes from the round's sums (the same for the plaintext and the secure form)."""
        cfg, f, d = self.config, self.f, self.d
        moved = cnt > 0
        lam = self._lam(cfg.lambda_item, cnt)
        if cfg.server == "grad":
            df = d.astype(np.float64)
            star = total / f - 2 * lam[:, None] * (df.sum(1, keepdims=True) - df)
        elif cfg.server == "para":
            star = total
        else:
            idx = np.flatnonzero(moved)
            new = d.copy()
            if len(idx):
                a, g = total[idx, :f], total[idx, f:].reshape(len(idx), f, f)
                new[idx] = bc.item_dcd(d[idx], a, g, cnt[idx], lam=lam[idx], max_sweeps=cfg.item_sweeps).codes
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
        return {"round": self.round, "b": self.b.copy(), "d": self.d.copy(),
                "rng": self.rng.bit_generator.state, "config": {"bits": self.f, "server": self.config.server}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        b = bc.check_codes(np.asarray(state["b"]), f=self.f, what="checkpoint user codes")
        d = bc.check_codes(np.asarray(state["d"]), f=self.f, what="checkpoint item codes")
        if b.shape != self.b.shape or d.shape != self.d.shape:
            raise ValueError(f"checkpoint codes {b.shape}, {d.shape} do not match this LightFR run")
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        self.round, self.b, self.d, self.rng = int(state["round"]), b, d, rng

    def public_info(self) -> dict[str, Any]:
        """What the server knows besides the transcript."""
        c = self.config
        return {"n_users": self.n_users, "n_items": self.n_items, "bits": self.f, "server": c.server,
                "secure_aggregation": c.secure_aggregation, "rating_range": [self.lo, self.hi],
                "rating_scale": sorted({float(x) for x in np.unique(self.raw)}),
                "rating_mean": float(self.raw.mean()),  # a published statistic: the attack's sign prior
                "lambda_item": c.lambda_item, "lambda_user": c.lambda_user, "lambda_scale": c.lambda_scale,
                "frac_bits": c.frac_bits, "client_fraction": c.client_fraction, "secure_rows": c.secure_rows}

    def cost_report(self) -> dict[str, Any]:
        """Storage of the model as the client holds it: packed, and one byte per bit (notes §9.12)."""
        m, f = self.n_items, self.f
        return {"storage_bytes_packed": (m + 1) * bc.words(f) * 8, "storage_bytes_one_byte_per_bit": (m + 1) * f,
                "storage_bytes_float32_mf_same_dim": (m + 1) * f * 4}


register(ProtocolSpec(
    name="lightfr",
    summary="LightFR: federated binary-code MF by discrete coordinate descent (Agg_grad/Agg_para/exact DCD)",
    build=lambda ctx: LightFR(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport),
    section="lightfr",
    config_cls=LightFRConfig,
    task="ranking",
    keeps_ratings=True,
))
