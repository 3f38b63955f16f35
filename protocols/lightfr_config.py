"""LightFR's configuration (``[lightfr]``), its upload record and the small pure functions around it
(tie jitter, rank metrics, the union phase's random weights). Split from :mod:`protocols.lightfr`,
which re-exports every name here; the protocol itself is documented there and in docs/lightfr.md."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

__all__ = ["BROADCAST", "INITS", "SERVERS", "STATS", "EarlyStop", "LightFRConfig", "Upload", "UpdateError",
           "rank_metrics", "rated_weights", "tie_jitter"]

SERVERS = ("grad", "para", "dcd", "none")
INITS = ("random", "mf")
SECURE = ("none", "secagg+", "secagg", "dpf")
TIES = ("random", "pessimistic")
LAMBDA_SCALES = ("count", "none")
BROADCAST = "clients"
#: What every client reports with its upload (plaintext) or in the first slots of its secure
#: vector, each on the ``2^-frac_bits`` grid in ``[0, 1]``: its squared error summed over its
#: ratings divided by ``M`` (the power of two ``>= m``: a client has at most ``m`` ratings, each
#: error at most 1), its DCD sweeps divided by ``S`` (the power of two ``>= user_sweeps``: exact),
#: and 1 if its DCD converged, else 0 (:meth:`LightFR.report_scales`).
STATS = ("loss_sum_over_M", "sweeps_over_S", "converged")
SECURE_ROWS = ("union", "all")
ITEM_ADD_BACK = ("raters", "sampled")
SWEEPS = ("capped", "fixed-point")
SAMPLING = ("without-replacement", "with-replacement")
EARLY_STOP = ("none", "authors")


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
        secure_aggregation: ``"none"`` (the paper), ``"secagg+"``, ``"secagg"`` or ``"dpf"`` (two
            non-colluding servers, ``server`` and ``server2``, docs/dpf.md: each client sends key
            sets of only its rated items' rows, so neither server learns its rated set nor the
            round's rated union; ``secure_rows`` does not apply).
        dpf_points, dpf_max_parts, dpf_pad_parts: ``"dpf"`` only: rated items per key set, the
            most key sets per client, and whether every client sends ``dpf_max_parts`` of them (else
            each server sees ``ceil(rated / dpf_points)``, the size class of the client's history).
        secure_rows: ``"union"`` (default): a first secure sum of the rated indicators gives the
            per-item rater counts (which the ``"all"`` form reveals anyway), the server publishes the
            union ``U`` of the round's rated items, and the value sum runs over ``U``'s rows only;
            ``"all"``: one dense sum over every item. Same sums, same codes, same server view.
        frac_bits: fixed-point fractional bits of every upload (both forms).
        secagg_dropout, secagg_corrupt: the fractions SecAgg+ chooses k and t for.
        ties: ranking tie rule of ``score`` (``"random"`` or ``"pessimistic"``).
        mf_epochs: epochs of the real-valued MF behind ``init = "mf"``.
        rating_min, rating_max: the public rating scale the ratings are min-max scaled with (a
            rating outside it is clipped to it). Both ``nan`` (the default): the training data's
            smallest and largest rating, which only a party holding every rating can compute, so
            on separate devices both must be set (:func:`device_check`).

    The LightFR authors' code's choices (notes §2.11; every default is the paper's behaviour, and
    the ``lightfr-authors`` preset sets them all; docs/lightfr.md "The authors' code as options"):

    Attributes:
        user_stickiness: the weight of bit ``k``'s own term in the user update. The code computes
            ``b^_uk = sum_i (r'_ui - d_i.b_u) d_ik + 2 lambda |I_u| b_uk`` (``r' = 2f r - f``):
            the residual over the full inner product plus a self term. At 0.5 that is exactly the
            paper's DCD (Eq. 9 adds back bit k's own contribution with this weight), so 0.5, the
            default, is both "the paper" and "the add-back form"; the code's config has 0.6 (a
            bit flips only if that lowers the user's loss by more than ``0.2 |I_u| / f^2``).
            ``|I_u|`` is the user's training ratings (the code also counts its held-out rows).
        item_add_back: ``"raters"`` (the exact item update: bit k's own term added back once per
            rater of the item, ``n_i``) or ``"sampled"`` (the code: ``|U_s| d_ik``, once per
            client the round's sums came from, which the server knows under secure aggregation
            too). With ``server = "grad"`` this is the Jacobi step ``total/f + (|U_s| - n_i)
            d_ik / (2f^2)``; with ``"dcd"`` the Gauss-Seidel item DCD; ``"para"`` has no add-back.
        sweeps: ``"capped"`` (at most ``user_sweeps``/``item_sweeps`` Gauss-Seidel sweeps, stopping
            earlier when no bit changes) or ``"fixed-point"`` (the code: sweep until no bit changes,
            with ``sweep_cap`` as the safety cap; the round reports the sweeps and who converged).
            The item side sweeps only with ``server = "dcd"`` (a Gauss-Seidel pass over an item's
            bits needs ``G_i = sum_u b_u b_u^T``); ``"grad"`` and ``"para"`` take one step a round.
        sweep_cap: the safety cap of ``"fixed-point"``.
        client_sampling: ``"without-replacement"`` (``round(p n)`` distinct clients) or
            ``"with-replacement"`` (the code's ``np.random.choice(users, int(n p))``: a client drawn
            twice runs its local update once and its upload counts twice in the sums, ``|U_s|``
            included). Plaintext only: refused with secure aggregation (a client would have to
            scale its masked input by a multiplicity the server chose).
        early_stop: ``"none"`` or ``"authors"``: after a round whose ``|delta loss|`` is below
            ``early_stop_threshold``, or equals the previous round's ``|delta loss|``, or in which
            no bit changed (every client converged in its first sweep and no item bit moved), the
            later rounds train nothing (they report the stop; the loss is the clients' reports,
            so the rule needs nothing the sums do not reveal).
        early_stop_threshold: the code's ``threshold`` (1e-4).
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
    rating_min: float = math.nan
    rating_max: float = math.nan
    dpf_points: int = 256
    dpf_max_parts: int = 64
    dpf_pad_parts: bool = False
    user_stickiness: float = 0.5
    item_add_back: str = "raters"
    sweeps: str = "capped"
    sweep_cap: int = 1000
    client_sampling: str = "without-replacement"
    early_stop: str = "none"
    early_stop_threshold: float = 1e-4

    def __post_init__(self) -> None:
        for name, allowed in (("server", SERVERS), ("init", INITS), ("secure_aggregation", SECURE),
                              ("ties", TIES), ("lambda_scale", LAMBDA_SCALES),
                              ("secure_rows", SECURE_ROWS), ("item_add_back", ITEM_ADD_BACK), ("sweeps", SWEEPS),
                              ("client_sampling", SAMPLING), ("early_stop", EARLY_STOP)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"lightfr.{name} must be one of {allowed}; found {getattr(self, name)!r}")
        for name, lo in (("bits", 1), ("user_sweeps", 1), ("item_sweeps", 1), ("mf_epochs", 0), ("frac_bits", 1),
                         ("sweep_cap", 1)):
            v = getattr(self, name)
            if type(v) is not int or v < lo:
                raise ValueError(f"lightfr.{name} must be an int >= {lo}; found {v!r}")
        for name in ("dpf_points", "dpf_max_parts"):
            v = getattr(self, name)
            if type(v) is not int or not 1 <= v <= 4096:
                raise ValueError(f"lightfr.{name} must be an int in 1..4096; found {v!r}")
        if not isinstance(self.dpf_pad_parts, bool):
            raise ValueError(f"lightfr.dpf_pad_parts must be true or false; found {self.dpf_pad_parts!r}")
        if self.bits > 4096:
            raise ValueError(f"lightfr.bits must be <= 4096; found {self.bits}")
        if self.frac_bits > 40:
            raise ValueError(f"lightfr.frac_bits must be <= 40 (the fixed-point budget); found {self.frac_bits}")
        if not (isinstance(self.client_fraction, (int, float)) and 0 < self.client_fraction <= 1):
            raise ValueError(f"lightfr.client_fraction must be in (0, 1]; found {self.client_fraction!r}")
        self._check_authors_options()
        for name in ("lambda_user", "lambda_item"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"lightfr.{name} must be a finite number >= 0; found {v!r}")
        if not 0 <= self.secagg_dropout < 1:
            raise ValueError(f"lightfr.secagg_dropout must be in [0, 1); found {self.secagg_dropout!r}")
        if not 0 <= self.secagg_corrupt < 0.5:
            raise ValueError(f"lightfr.secagg_corrupt must be in [0, 0.5); found {self.secagg_corrupt!r}")
        lo, hi = self.rating_min, self.rating_max
        if not all(isinstance(v, (int, float)) for v in (lo, hi)) or math.isnan(lo) != math.isnan(hi):
            raise ValueError(f"lightfr.rating_min and lightfr.rating_max must be numbers, both set or both nan; "
                             f"found {lo!r}, {hi!r}")
        if self.has_rating_scale and not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"lightfr.rating_min must be below lightfr.rating_max (finite); found {lo!r}, {hi!r}")

    def _check_authors_options(self) -> None:
        for name in ("user_stickiness", "early_stop_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"lightfr.{name} must be a finite number >= 0; found {v!r}")
        if self.sweep_cap > 1_000_000:
            raise ValueError(f"lightfr.sweep_cap must be <= 1000000; found {self.sweep_cap}")
        if self.item_add_back == "sampled" and self.server not in ("grad", "dcd"):
            raise ValueError(f"lightfr.item_add_back = 'sampled' weights the item update's add-back term, which only "
                             f"server = 'grad' or 'dcd' has; found server = {self.server!r} (Agg_para's sign votes "
                             "have none): use item_add_back = 'raters'")
        if self.client_sampling == "with-replacement" and self.secure_aggregation != "none":
            raise ValueError(
                f"lightfr.client_sampling = 'with-replacement' cannot run with secure_aggregation = "
                f"{self.secure_aggregation!r}: a client drawn twice counts twice in the sums, so it would have to "
                "scale its masked input by a multiplicity the server chose (and one client cannot hold two seats in "
                "one secure sum); use client_sampling = 'without-replacement' with secure aggregation")

    @property
    def user_sweep_cap(self) -> int:
        """The most DCD sweeps a client runs per round (``sweep_cap`` under ``sweeps = "fixed-point"``)."""
        return self.sweep_cap if self.sweeps == "fixed-point" else self.user_sweeps

    @property
    def item_sweep_cap(self) -> int:
        """The most item DCD sweeps of ``server = "dcd"`` per round."""
        return self.sweep_cap if self.sweeps == "fixed-point" else self.item_sweeps

    @property
    def has_rating_scale(self) -> bool:
        """Whether the public rating scale is configured (else it is the training data's range)."""
        return not math.isnan(self.rating_min)

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
        stats: float64 ``[3]`` (the round's report, :data:`STATS`) or ``None`` (an upload built by
            hand, e.g. in a test of the checks).
    """

    user: int
    round: int
    items: np.ndarray
    body: np.ndarray
    stats: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return 4 * len(self.items) + int(self.body.nbytes) + (0 if self.stats is None else int(self.stats.nbytes))


class EarlyStop:
    """The authors' code's early stop (``early_stop = "authors"``, notes §2.11), on the server.

    After each trained round :meth:`observe` gets its loss (from the clients' reports) and whether no
    bit changed; it stops when ``|delta loss| < threshold``, when ``|delta loss|`` equals the previous
    round's ``|delta loss|`` (the code's test, exact), or when no bit changed. ``stopped`` then holds
    the reason (every later round trains nothing); ``last_loss`` is the last trained round's loss.
    """

    def __init__(self, threshold: float, *, last_loss: float = math.nan, last_delta: float = math.nan,
                 stopped: str = "") -> None:
        self.threshold, self.last_loss, self.last_delta, self.stopped = float(threshold), float(last_loss), \
            float(last_delta), str(stopped)

    def observe(self, round_: int, loss: float, unchanged: bool) -> bool:
        """Record round ``round_`` (0-based); return whether training stops after it."""
        delta = abs(loss - self.last_loss)  # nan in the first round (no previous loss)
        if unchanged:
            self.stopped = f"round {round_ + 1}: no bit changed"
        elif delta < self.threshold:
            self.stopped = f"round {round_ + 1}: |delta loss| = {delta:.3g} < {self.threshold:g}"
        elif delta == self.last_delta:
            self.stopped = f"round {round_ + 1}: |delta loss| = {delta:.3g} equals the previous round's"
        self.last_loss, self.last_delta = float(loss), float(delta)
        return bool(self.stopped)

    def state(self) -> dict[str, float | str]:
        """What a checkpoint keeps (the constructor's keyword arguments)."""
        return {"last_loss": self.last_loss, "last_delta": self.last_delta, "stopped": self.stopped}


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


def rated_weights(k: int, frac_bits: int) -> np.ndarray:
    """``k`` fresh weights from the OS CSPRNG, uniform on the grid ``2^-frac_bits .. 1``: a client's
    rated items in the union phase. Their sum over the round's raters is positive exactly where
    someone rated an item (the union, all the server needs), but it is not the rater count, and
    the vector is never the same twice: an indicator of 1s would be identical in every round, so
    sums over cohorts that differ in one client (in one round or across rounds) would be that
    client's rated set."""
    scale = 1 << frac_bits
    raw = np.frombuffer(os.urandom(8 * k), dtype=np.uint64) if k else np.zeros(0, np.uint64)
    return ((raw % np.uint64(scale)).astype(np.float64) + 1.0) / scale


def _grid(x: np.ndarray, frac_bits: int) -> np.ndarray:
    """Round to the fixed-point grid ``2^-frac_bits`` (done on the device in both forms)."""
    scale = float(1 << frac_bits)
    return np.round(np.asarray(x, dtype=np.float64) * scale) / scale
