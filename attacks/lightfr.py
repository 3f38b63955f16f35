"""The one-upload attack on LightFR (notes §1.3): code, rated set and ratings from ``Delta D^u``.

The server knows the item codes ``D_t`` it broadcast. A plaintext Agg_grad upload is, per rated
item ``i`` (closed form of Algorithm 1's line, notes §1.3)::

    Delta d^u_i = a_ui b_u + d_i / (2f),   a_ui = r_ui - sim(b_u, d_i)

so ``C_i = Delta d^u_i - d_i/(2f)`` is rank one: ``b~ = sign(C_j)`` for the row of largest norm
gives the private code up to a global sign ``s``, ``a_i = C_i . b~ / f`` and
``r_ui = 1/2 + s (a_i + b~ . d_i / (2f))``. The ids of the upload are the rated set. The global
sign (the ``r <-> 1 - r`` reflection) is resolved by the public prior that most ratings lie above
the public mean rating (``public_info()["rating_mean"]``, a published statistic of the service):
the sign whose ratings' mean is nearer to it. :func:`exact_up_to_reflection` scores without
that prior (the best of the two orientations per user).

An Agg_para upload (locally updated codes ``d'_i``) leaks less: one Gauss-Seidel pass with one
rater drives ``sim(b_u, d'_i)`` towards ``r_ui`` (to ``1/f``), so the attack estimates ``b~`` as the
leading singular vector's signs of the changes ``d'_i - d_i`` and reads ``r ~ sim(b~, d'_i)``.

Against the secure upload the server's view holds only uniformly masked vectors; the attack's
rule applied to them (decode with the public ``frac_bits``, rated where the indicator decodes
to 1) finds nothing: the result is reported, scored against the same random baseline.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from attacks.fedmf import AttackResult, UserInference, score
from attacks.registry import AttackSpec, register_attack
from protocols.lightfr import Upload
from protocols.transport import SERVER, Record
from recmodels import binary_codes as bc

__all__ = ["assess", "code_agreement", "exact_up_to_reflection", "infer", "one_upload_attack", "score", "server_view"]


def server_view(records: Any) -> list[Record]:
    """What the server received or sent."""
    return [r for r in records if r.receiver == SERVER or r.sender == SERVER]


def _model(view: list[Record], rnd: int, f: int) -> np.ndarray | None:
    for r in view:
        if r.sender == SERVER and r.round == rnd and r.kind == "model" and r.payload is not None:
            return bc.unpack(np.asarray(r.payload), f)
    return None


def _global_sign(x: np.ndarray, lo: float, hi: float, prior: float) -> float:
    """The sign whose ratings' mean is nearer the public mean rating ``prior`` (the one global bit)."""
    plus, minus = lo + (0.5 + x) * (hi - lo), lo + (0.5 - x) * (hi - lo)
    return 1.0 if abs(plus.mean() - prior) <= abs(minus.mean() - prior) else -1.0


def _grad_user(up: Upload, d: np.ndarray, f: int, lo: float, hi: float, prior: float) -> tuple[np.ndarray, np.ndarray]:
    di = d[up.items].astype(np.float64)
    c = up.body - di / (2 * f)
    j = int(np.argmax(np.abs(c).sum(1)))
    bt = np.where(c[j] >= 0, 1.0, -1.0)
    a = c @ bt / f
    x = a + di @ bt / (2 * f)
    s = _global_sign(x, lo, hi, prior)
    return s * bt, lo + (0.5 + s * x) * (hi - lo)


def _para_user(up: Upload, d: np.ndarray, f: int, lo: float, hi: float, prior: float) -> tuple[np.ndarray, np.ndarray]:
    new = up.body.astype(np.float64)
    change = new - d[up.items]
    if not change.any():
        bt = np.ones(f)
    else:
        _, _, vt = np.linalg.svd(change, full_matrices=False)
        bt = np.where(vt[0] >= 0, 1.0, -1.0)
    x = new @ bt / (2 * f)
    s = _global_sign(x, lo, hi, prior)
    return s * bt, lo + (0.5 + s * x) * (hi - lo)


def one_upload_attack(view: list[Record], public: dict[str, Any], *, round: int = 0) -> tuple[AttackResult, dict[int, np.ndarray]]:
    """Invert every upload the server received in ``round``; returns the inferences and the codes."""
    f, (lo, hi) = int(public["bits"]), public["rating_range"]
    prior = float(public.get("rating_mean", (lo + hi) / 2))
    d = _model(view, round, f)
    out, codes = [], {}
    plain = masked = opaque = 0
    for rec in view:
        if rec.receiver != SERVER or rec.round != round or rec.kind not in ("update", "lightfr:rated") \
                or rec.payload is None:
            continue
        user = int(rec.sender.split(":")[1])
        if isinstance(rec.payload, (bytes, bytearray)):  # a DPF key share: nothing to invert
            opaque += 1
            out.append(UserInference(user, np.zeros(0, np.int64), None))
            continue
        union = public.get("secure_rows", "all") == "union"
        if union and rec.kind == "update" and not isinstance(rec.payload, Upload):
            continue  # the masked indicator over all items is in the first ("lightfr:rated") sum
        if isinstance(rec.payload, Upload):
            plain += 1
            if d is None:
                out.append(UserInference(user, np.sort(rec.payload.items), None))
                continue
            fn = _para_user if public["server"] == "para" else _grad_user
            if public["server"] == "dcd":  # the first f values of a row are (r - 1/2) b_u
                up = rec.payload
                rows = up.body[:, :f]
                j = int(np.argmax(np.abs(rows).sum(1)))
                bt = np.where(rows[j] >= 0, 1.0, -1.0)
                x = rows @ bt / f
                s = _global_sign(x, lo, hi, prior)
                codes[user], ratings = s * bt, lo + (0.5 + s * x) * (hi - lo)
            else:
                codes[user], ratings = fn(rec.payload, d, f, lo, hi, prior)
            out.append(UserInference(user, np.asarray(rec.payload.items), ratings))
        else:  # a masked vector: apply the same rule to what the server holds
            masked += 1
            y = np.asarray(rec.payload)
            m = int(public["n_items"])
            vals = y.astype(np.int64).astype(np.float64) / float(1 << int(public["frac_bits"]))
            if rec.kind == "update":  # the indicator of the rated items closes the vector
                rated = np.flatnonzero(np.abs(vals[-m:] - 1.0) < 1e-6)
            else:  # a "lightfr:rated" vector: random weights in (0, 1] on the rated items, 0 elsewhere
                rated = np.flatnonzero((vals[:m] > 0) & (vals[:m] <= 1.0))
            out.append(UserInference(user, rated, None))
    if plain:
        status = f"inverted {plain} plaintext uploads of round {round}"
    elif masked:
        status = f"round {round}: {masked} uploads are masked (secure aggregation); nothing to invert"
    elif opaque:
        status = f"round {round}: {opaque} uploads are DPF key shares; nothing to invert"
    else:
        status = f"no uploads in the view for round {round}"
    return AttackResult("lightfr-one-upload", round, status, tuple(out)), codes


def exact_up_to_reflection(result: AttackResult, truth_items: list[np.ndarray], truth_ratings: list[np.ndarray],
                           rating_scale: list[float]) -> float | None:
    """Fraction of correctly identified ratings rounded exactly, each user at its better orientation."""
    scale = np.asarray(sorted(rating_scale), dtype=np.float64)
    lo, hi = scale[0], scale[-1]
    hits = total = 0
    for inf in result.users:
        if inf.ratings is None or len(truth_items[inf.user]) == 0:
            continue
        items = truth_items[inf.user]
        ok = np.isin(inf.rated, items)
        true = truth_ratings[inf.user][np.searchsorted(items, inf.rated[ok])]
        best = 0
        for guess in (inf.ratings[ok], lo + hi - inf.ratings[ok]):
            near = scale[np.abs(np.clip(guess, lo, hi)[:, None] - scale[None, :]).argmin(1)]
            best = max(best, int((near == true).sum()))
        hits, total = hits + best, total + int(ok.sum())
    return None if total == 0 else hits / total


def code_agreement(codes: dict[int, np.ndarray], truth: np.ndarray) -> float | None:
    """Mean fraction of bits recovered, up to the global sign (0.5 = nothing; random ~0.55 at f=64)."""
    if not codes:
        return None
    return float(np.mean([max(np.mean(c == truth[u]), np.mean(-c == truth[u])) for u, c in codes.items()]))


def infer(view: list[Record], public: dict[str, Any]) -> AttackResult:
    """:func:`one_upload_attack` on the first recorded round that holds uploads."""
    from attacks.findings import NotApplicable

    rounds = sorted({r.round for r in view if r.receiver == SERVER and r.payload is not None
                     and r.kind in ("update", "lightfr:rated")})
    if not rounds:
        raise NotApplicable("the view holds no upload payloads")
    with np.errstate(all="ignore"):
        return one_upload_attack(view, public, round=rounds[0])[0]


def assess(result: AttackResult, truth: Any, public: dict[str, Any]) -> list[Any]:
    """Rated set (F1) and ratings (RMSE) of every user whose upload the server saw; masked uploads
    yield the public guess (a fixed set of the public mean size, the public mean rating). The ratings
    finding's ``extra`` holds :func:`exact_up_to_reflection` (``None`` when nothing was inverted)."""
    from attacks.findings import STATUS_PUBLIC, public_items, ratings_finding, set_finding

    n_items = int(public["n_items"])
    lo, hi = (float(x) for x in public["rating_range"])
    scale = [float(x) for x in public.get("rating_scale", (lo, hi))]
    prior = float(public.get("rating_mean", (lo + hi) / 2))
    users = [inf.user for inf in result.users]
    mean_size = float(np.mean([len(truth.items_of(u)) for u in range(truth.n_users)])) if truth.n_users else 1.0
    guess_set = public_items(public, n_items, int(public.get("mean_count", round(mean_size))))
    usable = result.status.startswith("inverted")
    inferred = {inf.user: (inf.rated if usable else guess_set) for inf in result.users}
    ratings = {inf.user: (inf.rated, inf.ratings) for inf in result.users if usable and inf.ratings is not None}
    status = result.status if usable else f"{STATUS_PUBLIC} ({result.status})"
    rounds = (result.round,)
    rmse = ratings_finding(attack=result.attack, role=SERVER, guesses=ratings, truth=truth, users=users,
                           scale=scale, prior=prior, rounds=rounds, status=status)
    refl = exact_up_to_reflection(result, [truth.items_of(u) for u in range(truth.n_users)],
                                  [truth.ratings_of(u) for u in range(truth.n_users)], scale) if usable else None
    return [
        set_finding(attack=result.attack, role=SERVER, target="rated items", inferred=inferred,
                    truth={u: truth.items_of(u) for u in users}, n_candidates=n_items,
                    public_guess={u: guess_set for u in users}, rounds=rounds, status=status),
        replace(rmse, extra={**rmse.extra, "exact_match_up_to_reflection": refl}),
    ]


register_attack(AttackSpec(
    protocol="lightfr", name="lightfr-one-upload", view="server",
    run=lambda view, public, **kw: one_upload_attack(view, public, **kw)[0],
    summary="code up to sign, rated set and ratings from ONE plaintext Agg_grad upload (notes §1.3)",
    infer=infer, assess=assess,
))
