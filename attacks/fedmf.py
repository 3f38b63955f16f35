"""Gradient inversion against FedMF: rated sets and ratings from what the server saw.

Adversary: the honest-but-curious FedMF server. Input: the server's view only (every record the
server received or sent, from :func:`server_view`) plus public protocol parameters
(:meth:`protocols.fedmf.FedMF.public_info`: learning rate, regularisers, update rule, rating
scale, the mean number of ratings per user, the fixed-point layout). Ground truth is used only by
:func:`score`.

Two attacks (registry :data:`ATTACKS`):

* ``"fedmf-one-round"``: the closed form for FedMF's item-by-item user update. With
  ``h_i = (delta_i + 2 lr reg_item q_i) / (2 lr) = e_i p'_i`` and
  ``p'_i = c p'_j + 2 lr e_i q_i`` (``c = 1 - 2 lr reg_user``, ``j`` the previous item),
  ``h_i = a h_j + b q_i`` with ``a = c e_i / e_j`` and ``b = 2 lr e_i^2``: a 2-unknown least
  squares per consecutive pair gives ``|e_i|``, the sign chain and then every rating
  ``r_i = e_i + p'_j . q_i`` (the first one through ``p_0 = (p'_0 - 2 lr e_0 q_0) / c``), up to the
  global sign ``r <-> -r``, resolved by ``r > 0``. Items are processed in ascending index (the
  protocol's public convention).
* ``"fedmf-two-round"``: FedMF's attack from two consecutive rounds for the batch update
  (papers/lightfr.md 1.1, multi-item version): all ``h_j^t = e_j p^t`` are parallel; with
  ``rho_j = e_j / e_1`` and ``w = sum_j rho_j q_j^t``, ``p^{t+1} = c h_1 / s + 2 lr s w`` is
  parallel to any ``h^{t+1}``, a linear least squares in ``(s^2, kappa s)``.

Rated set: the part variant's ids when present; else the rows with a non-zero update ("fake
zeros" are exact zeros); when (almost) every row is non-zero (noise, masks), the ``mean_count``
rows of largest norm. What each view allows: plaintext -> both; LDP -> both, degraded by noise;
secure aggregation -> the masked ring elements decode to uniform noise (random-level, measured);
HE -> no usable plaintext (full), or the rated ids only (part).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocols.fedmf import BROADCAST, Upload
from attacks.registry import AttackSpec, register_attack
from protocols.transport import SERVER, Record, Transcript

__all__ = [
    "ATTACKS",
    "AttackResult",
    "AttackScore",
    "UserInference",
    "assess",
    "get_attack",
    "infer_one_round",
    "infer_two_round",
    "one_round_attack",
    "score",
    "server_view",
    "two_round_attack",
]

STATUS_OK = "ok"
STATUS_CIPHER = "no usable plaintext: the server's view holds only ciphertexts"
STATUS_CIPHER_PART = "no usable plaintext values (ciphertexts); rated set read from the part variant's item ids"
STATUS_MASKED = "ok on masked values: per-client uploads are masked by secure aggregation"


@dataclass(frozen=True)
class UserInference:
    """What the attack infers about one user.

    Attributes:
        user: the user index (the sender of the uploads).
        rated: int64 sorted inferred rated items.
        ratings: float64 inferred ratings of ``rated`` (``None`` if the view gave no values).
    """

    user: int
    rated: np.ndarray
    ratings: np.ndarray | None


@dataclass(frozen=True)
class AttackResult:
    """The attack's output: one :class:`UserInference` per attacked user, and a status."""

    attack: str
    round: int
    status: str
    users: tuple[UserInference, ...]


@dataclass(frozen=True)
class AttackScore:
    """Scores against ground truth, each beside the random-guess baseline.

    Precision/recall/F1 are macro-averaged over users (0 for a user with nothing inferred);
    rating RMSE and exact-match rate are over correctly inferred (user, item) pairs (``None`` if
    there are none). Random baselines: a uniformly random set of the true size (expected
    precision = recall = F1 = ``|T_u| / n_items``), a uniformly random rating from the scale.
    """

    status: str
    precision: float
    recall: float
    f1: float
    rating_rmse: float | None
    exact_match: float | None
    random_precision: float
    random_recall: float
    random_f1: float
    random_rating_rmse: float
    random_exact_match: float
    users: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dict(self.__dict__)


def server_view(transcript: Transcript | Iterable[Record]) -> list[Record]:
    """Everything the server received or sent (its view), in order."""
    return [r for r in transcript if r.receiver == SERVER or r.sender == SERVER]


def _round_data(view: list[Record], rnd: int, public: dict[str, Any]) -> tuple[Any, dict[int, Upload]]:
    model = None
    uploads: dict[int, Upload] = {}
    masked: dict[int, np.ndarray] = {}
    ids: dict[int, np.ndarray] = {}
    for r in view:
        if r.round != rnd:
            continue
        if r.sender == SERVER and r.receiver == BROADCAST and r.kind == "model":
            model = r.payload
        elif r.receiver == SERVER and r.kind == "update" and isinstance(r.payload, Upload):
            uploads[r.payload.user] = r.payload
        elif r.receiver == SERVER and r.kind == "update" and isinstance(r.payload, np.ndarray):
            masked[_user_of(r.sender)] = r.payload  # a secure sum's masked vector, as the server received it
        elif r.receiver == SERVER and r.kind == "items" and isinstance(r.payload, np.ndarray):
            ids[_user_of(r.sender)] = r.payload  # "part" under secure aggregation: the rated ids in the clear
    for u, y in masked.items():
        uploads[u] = Upload(u, rnd, ids.get(u), y)
    if not uploads:
        raise ValueError(f"the view holds no update payloads for round {rnd}; keep the server's payloads.")
    return model, uploads


def _user_of(sender: str) -> int:
    """The user index of a client party name (``protocols.transport.client``)."""
    return int(sender.split(":", 1)[1])


def _values(up: Upload, public: dict[str, Any]) -> np.ndarray | None:
    body = up.body
    if isinstance(body, np.ndarray) and body.dtype == np.uint64:  # masked ring elements
        return body.view(np.int64).astype(np.float64).reshape(-1, public["dim"]) / 2.0 ** public["frac_bits"]
    if isinstance(body, np.ndarray):
        return body.astype(np.float64)
    return None


def _rated(up: Upload, vals: np.ndarray | None, public: dict[str, Any]) -> np.ndarray:
    if up.items is not None:
        return np.asarray(up.items, dtype=np.int64)
    if vals is None:
        return np.zeros(0, dtype=np.int64)
    norms = np.linalg.norm(vals, axis=1)
    nz = np.flatnonzero(norms > 0)
    if len(nz) < 0.9 * len(norms):
        return nz
    k = max(1, int(round(public["mean_count"])))
    return np.sort(np.argsort(-norms)[:k])


def _full_rows(up: Upload, vals: np.ndarray, rated: np.ndarray, n_items: int) -> np.ndarray:
    """The update rows of ``rated`` items (a dense body is indexed; a part body is already them)."""
    if up.items is None or vals.shape[0] == n_items:
        return vals[rated]
    return vals


def _resolve_sign(r: np.ndarray) -> np.ndarray:
    finite = r[np.isfinite(r)]
    return -r if finite.size and finite.mean() < 0 else r


def _sequential_ratings(h: np.ndarray, q: np.ndarray, lr: float, c: float, mid: float) -> np.ndarray:
    k = len(h)
    if k < 2:
        return np.full(k, mid)
    hj, qi = h[:-1], q[1:]
    # normal equations of h_i = a h_j + b q_i, batched over the k-1 pairs
    g11 = np.einsum("nd,nd->n", hj, hj)
    g12 = np.einsum("nd,nd->n", hj, qi)
    g22 = np.einsum("nd,nd->n", qi, qi)
    y1 = np.einsum("nd,nd->n", hj, h[1:])
    y2 = np.einsum("nd,nd->n", qi, h[1:])
    det = g11 * g22 - g12**2
    det = np.where(np.abs(det) < 1e-300, 1e-300, det)
    a = (g22 * y1 - g12 * y2) / det
    b = (g11 * y2 - g12 * y1) / det
    mag = np.sqrt(np.maximum(b, 0.0) / (2 * lr))
    a_safe = np.where(a == 0, 1e-300, a)
    e0 = c * mag[0] / abs(a_safe[0])
    signs = np.concatenate(([1.0], np.cumprod(np.sign(a_safe))))
    e = signs * np.concatenate(([e0], mag))
    e = np.where(e == 0, 1e-300, e)
    p_after = h / e[:, None]
    r = np.empty(k)
    r[1:] = e[1:] + np.einsum("nd,nd->n", p_after[:-1], q[1:])
    p0 = (p_after[0] - 2 * lr * e[0] * q[0]) / c
    r[0] = e[0] + p0 @ q[0]
    return _resolve_sign(r)


def _public_consts(public: dict[str, Any]) -> tuple[float, float, float, float]:
    lr, ru, ri = float(public["lr"]), float(public["reg_user"]), float(public["reg_item"])
    scale = public["rating_scale"]
    return lr, 1 - 2 * lr * ru, ri, (min(scale) + max(scale)) / 2


def _status(model: Any, any_values: bool, any_masked: bool, any_ids: bool) -> str:
    if not any_values:
        return STATUS_CIPHER_PART if any_ids else STATUS_CIPHER
    if not isinstance(model, np.ndarray):
        return STATUS_CIPHER
    return STATUS_MASKED if any_masked else STATUS_OK


def one_round_attack(view: list[Record], public: dict[str, Any], *, round: int = 0) -> AttackResult:
    """Closed-form inversion of one round of item-by-item updates (see the module docstring)."""
    model, uploads = _round_data(view, round, public)
    lr, c, ri, mid = _public_consts(public)
    q = model if isinstance(model, np.ndarray) else None
    out, any_vals, any_masked, any_ids = [], False, False, False
    for u in sorted(uploads):
        up = uploads[u]
        vals = _values(up, public)
        any_vals |= vals is not None
        any_masked |= isinstance(up.body, np.ndarray) and up.body.dtype == np.uint64
        any_ids |= up.items is not None
        rated = _rated(up, vals, public)
        ratings = None
        if vals is not None and q is not None and len(rated):
            rows = _full_rows(up, vals, rated, public["n_items"])
            h = (rows + 2 * lr * ri * q[rated]) / (2 * lr)
            with np.errstate(all="ignore"):
                ratings = _sequential_ratings(h, q[rated], lr, c, mid)
        out.append(UserInference(u, rated, ratings))
    return AttackResult("fedmf-one-round", round, _status(model, any_vals, any_masked, any_ids), tuple(out))


def two_round_attack(view: list[Record], public: dict[str, Any], *, round: int = 0) -> AttackResult:
    """FedMF's two-consecutive-round inversion for batch user updates (see the module docstring)."""
    model, up_t = _round_data(view, round, public)
    _, up_t1 = _round_data(view, round + 1, public)
    lr, c, ri, mid = _public_consts(public)
    q = model if isinstance(model, np.ndarray) else None
    out, any_vals, any_masked, any_ids = [], False, False, False
    for u in sorted(up_t):
        a, b = up_t[u], up_t1.get(u)
        va = _values(a, public)
        vb = _values(b, public) if b is not None else None
        any_vals |= va is not None
        any_masked |= isinstance(a.body, np.ndarray) and a.body.dtype == np.uint64
        any_ids |= a.items is not None
        rated = _rated(a, va, public)
        ratings = None
        if va is not None and vb is not None and q is not None and len(rated):
            h = (_full_rows(a, va, rated, public["n_items"]) + 2 * lr * ri * q[rated]) / (2 * lr)
            rated_b = _rated(b, vb, public)
            hb = _full_rows(b, vb, rated_b, public["n_items"])
            with np.errstate(all="ignore"):
                ratings = _two_round_ratings(h, q[rated], hb, lr, c)
        out.append(UserInference(u, rated, ratings))
    return AttackResult("fedmf-two-round", round, _status(model, any_vals, any_masked, any_ids), tuple(out))


def _two_round_ratings(h: np.ndarray, q: np.ndarray, hb: np.ndarray, lr: float, c: float) -> np.ndarray:
    one = int(np.argmax(np.linalg.norm(h, axis=1)))
    h1 = h[one]
    rho = h @ h1 / max(h1 @ h1, 1e-300)
    w = rho @ q
    v = hb[int(np.argmax(np.linalg.norm(hb, axis=1)))] if len(hb) else np.zeros_like(h1)
    design = np.stack([-2 * lr * w, v], axis=1)
    (x, _), *_ = np.linalg.lstsq(design, c * h1, rcond=None)
    s = np.sqrt(max(x, 1e-300))
    p = h1 / s
    return _resolve_sign(rho * s + q @ p)


#: name -> attack(view, public, round=...) -> AttackResult
ATTACKS: dict[str, Callable[..., AttackResult]] = {
    "fedmf-one-round": one_round_attack,
    "fedmf-two-round": two_round_attack,
}




def get_attack(name: str) -> Callable[..., AttackResult]:
    """Look an attack up by name in :data:`ATTACKS`."""
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; choose one of {sorted(ATTACKS)}.")
    return ATTACKS[name]


def score(result: AttackResult, truth_items: list[np.ndarray], truth_ratings: list[np.ndarray], n_items: int, rating_scale: list[float]) -> AttackScore:
    """Score ``result`` against each user's true rated items and ratings (training data)."""
    scale = np.asarray(sorted(rating_scale), dtype=np.float64)
    prec, rec, f1, errs, exact, rand = [], [], [], [], [], []
    by_user = {inf.user: inf for inf in result.users}
    for u, (items, ratings) in enumerate(zip(truth_items, truth_ratings)):
        if len(items) == 0:
            continue
        rand.append(len(items) / n_items)
        inf = by_user.get(u)
        if inf is None or len(inf.rated) == 0:
            prec.append(0.0), rec.append(0.0), f1.append(0.0)
            continue
        hit = np.isin(inf.rated, items)
        tp = int(hit.sum())
        p, r = tp / len(inf.rated), tp / len(items)
        prec.append(p), rec.append(r), f1.append(0.0 if tp == 0 else 2 * p * r / (p + r))
        if inf.ratings is not None and tp:
            guess = np.clip(np.nan_to_num(inf.ratings[hit], nan=scale.mean()), scale[0], scale[-1])
            true = ratings[np.searchsorted(items, inf.rated[hit])]
            errs.append(guess - true)
            nearest = scale[np.abs(guess[:, None] - scale[None, :]).argmin(axis=1)]
            exact.append(nearest == true)
    all_true = np.concatenate([np.asarray(r, dtype=np.float64) for r in truth_ratings])
    rand_rmse = float(np.sqrt(np.mean((scale[None, :] - all_true[:, None]) ** 2)))
    err = np.concatenate(errs) if errs else None
    return AttackScore(
        status=result.status,
        precision=float(np.mean(prec)),
        recall=float(np.mean(rec)),
        f1=float(np.mean(f1)),
        rating_rmse=None if err is None else float(np.sqrt(np.mean(err**2))),
        exact_match=None if err is None else float(np.mean(np.concatenate(exact))),
        random_precision=float(np.mean(rand)),
        random_recall=float(np.mean(rand)),
        random_f1=float(np.mean(rand)),
        random_rating_rmse=rand_rmse,
        random_exact_match=1.0 / len(scale),
        users=len(f1),
    )


# -- on a recorded view: inference, then scoring against the run's training data ----------------------


def _update_rounds(view: list[Record]) -> list[int]:
    return sorted({r.round for r in view if r.receiver == SERVER and r.kind == "update" and r.payload is not None})


def infer_one_round(view: list[Record], public: dict[str, Any]) -> AttackResult:
    """:func:`one_round_attack` on the first round of ``view`` that holds uploads (sequential updates only)."""
    from attacks.findings import NotApplicable

    if public.get("user_update") != "sequential":
        raise NotApplicable("the one-round inversion needs FedMF's item-by-item (sequential) user update; "
                            f"this run used {public.get('user_update')!r} (fedmf-two-round applies)")
    rounds = _update_rounds(view)
    if not rounds:
        raise NotApplicable("the view holds no upload payloads")
    with np.errstate(all="ignore"):
        return one_round_attack(view, public, round=rounds[0])


def infer_two_round(view: list[Record], public: dict[str, Any]) -> AttackResult:
    """:func:`two_round_attack` on the first two consecutive recorded rounds (batch updates only)."""
    from attacks.findings import NotApplicable

    if public.get("user_update") != "batch":
        raise NotApplicable("the two-round inversion is for FedMF's batch user update; this run used "
                            f"{public.get('user_update')!r} (fedmf-one-round applies)")
    rounds = _update_rounds(view)
    pairs = [r for r in rounds if r + 1 in rounds]
    if not pairs:
        raise NotApplicable(f"needs two consecutive recorded rounds; recorded {rounds} (record_every = 1)")
    with np.errstate(all="ignore"):
        return two_round_attack(view, public, round=pairs[0])


def assess(result: AttackResult, truth: Any, public: dict[str, Any]) -> list[Any]:
    """Rated set (F1) and ratings (RMSE) of every attacked user, beside the random and public guesses.

    A view with no usable values (masked, or ciphertexts) yields the public guess: the ``mean_count``
    items a guesser without uploads picks and the middle of the rating scale (the part variant's
    item ids in the clear are still read)."""
    from attacks.findings import STATUS_PUBLIC, public_items, ratings_finding, set_finding

    n_items = int(public["n_items"])
    scale = [float(x) for x in public["rating_scale"]]
    prior = float(public.get("rating_mean", (min(scale) + max(scale)) / 2))
    guess_set = public_items(public, n_items, int(round(public["mean_count"])))
    rounds = (result.round,) if result.attack == "fedmf-one-round" else (result.round, result.round + 1)
    unusable = result.status in (STATUS_MASKED, STATUS_CIPHER)
    inferred, ratings = {}, {}
    for inf in result.users:
        if unusable:
            inferred[inf.user] = guess_set
        else:
            inferred[inf.user] = inf.rated
            if inf.ratings is not None:
                ratings[inf.user] = (inf.rated, inf.ratings)
    status = STATUS_PUBLIC if unusable else result.status
    users = [inf.user for inf in result.users]
    sets = set_finding(attack=result.attack, role=SERVER, target="rated items", inferred=inferred,
                       truth={u: truth.items_of(u) for u in users}, n_candidates=n_items,
                       public_guess={u: guess_set for u in users}, rounds=rounds, status=status)
    rates = ratings_finding(attack=result.attack, role=SERVER, guesses=ratings, truth=truth, users=users,
                            scale=scale, prior=prior, rounds=rounds, status=status)
    return [sets, rates]



for _name, _fn, _infer, _summary in (
    ("fedmf-one-round", one_round_attack, infer_one_round,
     "closed-form ratings from one round of FedMF's item-by-item update"),
    ("fedmf-two-round", two_round_attack, infer_two_round, "ratings from two consecutive rounds of the batch update"),
):
    register_attack(AttackSpec(protocol="fedmf", name=_name, view=SERVER, run=_fn, summary=_summary,
                               infer=_infer, assess=assess))
