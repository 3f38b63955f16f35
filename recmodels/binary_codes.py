"""Binary-code matrix factorisation (LightFR, Zhang et al. TOIS 2023): packed codes and DCD.

Codes are vectors in ``{-1,+1}^f``. Stored packed: bit ``k`` of a code is 1 for ``+1`` and 0 for
``-1``, 64 bits per ``uint64`` word, ``ceil(f/64)`` words per code, padding bits 0 (so they never
count in an XOR). Scores (notes §2.2, Eq. 4)::

    sim(b, d) = 1/2 + b.d / (2f) = 1 - H(b, d) / f,   H = popcount(b XOR d),   b.d = f - 2H

Loss of one user ``u`` (notes §2.4; the within-code balance form of Eqs. 8-9, §9.2)::

    L_u(b) = sum_{i in I_u} (r_ui - sim(b, d_i))^2 + lam * (1^T b)^2

with ratings scaled to ``[0, 1]`` (§9.1). The discrete coordinate descent (DCD) bit update is
``b_k <- sign(F(b*_k, b_k))`` with (Eq. 9, vectorised with ``s_i = b.d_i``)::

    b*_k = sum_i (1/f) (r_ui - 1/2 - (s_i - b_k d_ik) / (2f)) d_ik - 2 lam sum_{k' != k} b_k'

which is the exact minimiser of ``L_u`` over bit ``k`` (``L(b_k=+1) - L(b_k=-1) = -2 b*_k``;
tested). ``F(x, y) = x if x != 0 else y`` keeps a bit whose two values tie. Sweeps over
``k = 1..f`` (Gauss-Seidel, ``s`` refreshed after every flip) repeat until no bit changes or
``max_sweeps``; each flip strictly lowers the loss, so the sweep terminates.

The item side is symmetric: :func:`item_gradients` is the client's upload of Agg_grad (Eq. 12,
closed form ``(r - sim) b_k + d_ik / (2f)``, notes §1.3), :func:`item_sufficient_stats` the
per-item sums ``a_i = sum_u (r_ui - 1/2) b_u``, ``G_i = sum_u b_u b_u^T``, ``n_i`` from which
:func:`item_dcd` runs the exact item DCD (notes §9.4 option B).

Everything is batched over users / items; nothing here is security code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "CodeError",
    "DcdResult",
    "check_codes",
    "dcd_users",
    "hamming",
    "inner",
    "item_dcd",
    "item_gradients",
    "item_loss",
    "item_sufficient_stats",
    "local_item_codes",
    "median_quantise",
    "pack",
    "pair_stats",
    "random_codes",
    "scale_ratings",
    "top_k",
    "unpack",
    "user_loss",
    "words",
]


class CodeError(ValueError):
    """A code array is not in ``{-1,+1}``, has the wrong length, or a packed code has stray bits."""


def words(f: int) -> int:
    """uint64 words per packed code of ``f`` bits."""
    return (int(f) + 63) // 64


def check_codes(codes: np.ndarray, f: int | None = None, what: str = "codes") -> np.ndarray:
    """Return ``codes`` as int8 after checking every value is -1 or +1 (and the length ``f``)."""
    arr = np.asarray(codes)
    if arr.ndim < 1 or arr.shape[-1] < 1:
        raise CodeError(f"{what} must have a last axis of code bits; found shape {arr.shape}")
    if f is not None and arr.shape[-1] != f:
        raise CodeError(f"{what} must have {f} bits per code; found {arr.shape[-1]}")
    if arr.dtype.kind not in "iuf" or not np.all((arr == 1) | (arr == -1)):
        bad = arr[~((arr == 1) | (arr == -1))].ravel()[:1] if arr.dtype.kind in "iuf" else arr.dtype
        raise CodeError(f"{what} must hold only -1 and +1; found {bad!r}")
    return arr.astype(np.int8)


def pack(codes: np.ndarray) -> np.ndarray:
    """Pack ``{-1,+1}`` codes ``[..., f]`` into uint64 ``[..., words(f)]`` (bit k of word k//64)."""
    c = check_codes(codes)
    f = c.shape[-1]
    bits = np.zeros(c.shape[:-1] + (words(f) * 64,), dtype=np.uint8)
    bits[..., :f] = c > 0
    by = np.packbits(bits, axis=-1, bitorder="little")  # 8 bytes per word, little-endian bit order
    return np.ascontiguousarray(by).view("<u8").astype(np.uint64)


def unpack(packed: np.ndarray, f: int) -> np.ndarray:
    """Inverse of :func:`pack`: int8 ``{-1,+1}`` ``[..., f]``; stray padding bits are refused."""
    p = np.asarray(packed)
    if p.dtype != np.uint64 or p.ndim < 1 or p.shape[-1] != words(f):
        raise CodeError(f"packed codes must be uint64 [..., {words(f)}] for f={f}; found {p.dtype} {p.shape}")
    by = np.ascontiguousarray(p.astype("<u8")).view(np.uint8)
    bits = np.unpackbits(by, axis=-1, bitorder="little")
    if np.any(bits[..., f:]):
        raise CodeError(f"packed codes have bits set beyond f={f} (padding must be 0)")
    return (bits[..., :f].astype(np.int8) * 2 - 1).astype(np.int8)


def hamming(b_packed: np.ndarray, d_packed: np.ndarray) -> np.ndarray:
    """Hamming distances ``[..., m]`` between packed codes ``b [..., w]`` and items ``d [m, w]``."""
    x = np.bitwise_xor(np.asarray(b_packed)[..., None, :], np.asarray(d_packed))
    return np.bitwise_count(x).sum(axis=-1, dtype=np.int32)


def inner(b_packed: np.ndarray, d_packed: np.ndarray, f: int) -> np.ndarray:
    """``b.d = f - 2 H(b, d)`` for packed codes (int32)."""
    return np.int32(f) - 2 * hamming(b_packed, d_packed)


def top_k(b_packed: np.ndarray, d_packed: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` items nearest to one packed user code (smallest Hamming distance), best first.

    Ties at equal distance are returned in item order (stable); ranking evaluation breaks ties
    separately (see :mod:`protocols.lightfr`).
    """
    h = hamming(b_packed, d_packed)
    k = min(int(k), h.shape[-1])
    part = np.argpartition(h, k - 1, axis=-1)[..., :k]
    order = np.argsort(np.take_along_axis(h, part, -1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, -1)


def scale_ratings(r: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Min-max scale ratings to ``[0, 1]`` (notes §9.1); ``hi == lo`` maps everything to 1."""
    r = np.asarray(r, dtype=np.float64)
    if not hi >= lo:
        raise ValueError(f"rating range must have hi >= lo; found lo={lo}, hi={hi}")
    if hi == lo:
        return np.ones_like(r)
    return (r - lo) / (hi - lo)


def random_codes(n: int, f: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` i.i.d. uniform ``{-1,+1}^f`` codes (the authors' initialisation; simulation randomness)."""
    return (rng.integers(0, 2, size=(n, f), dtype=np.int8) * 2 - 1).astype(np.int8)


def median_quantise(x: np.ndarray) -> np.ndarray:
    """Binarise real features at each dimension's median (LightFR_init, notes §2.8, §9.9): ``+1`` above."""
    x = np.asarray(x, dtype=np.float64)
    return np.where(x > np.median(x, axis=0, keepdims=True), 1, -1).astype(np.int8)


def user_loss(b: np.ndarray, d: np.ndarray, users: np.ndarray, items: np.ndarray, r: np.ndarray, lam: float | np.ndarray) -> np.ndarray:
    """``L_u`` of every user: codes ``b [n, f]``, item codes ``d [m, f]``, rated pairs ``(users, items, r)``."""
    n, f = b.shape
    s = _pair_inner(b, d, users, items)
    e = np.asarray(r, dtype=np.float64) - 0.5 - s / (2 * f)
    lam_u = np.broadcast_to(np.asarray(lam, dtype=np.float64), (n,))
    return np.bincount(users, weights=e**2, minlength=n) + lam_u * b.astype(np.float64).sum(axis=1) ** 2


def _pair_inner(b: np.ndarray, d: np.ndarray, users: np.ndarray, items: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """``b_u . d_i`` for every pair, in chunks (float64, exact small integers)."""
    out = np.empty(len(users), dtype=np.float64)
    for s0 in range(0, len(users), chunk):
        u, i = users[s0 : s0 + chunk], items[s0 : s0 + chunk]
        out[s0 : s0 + chunk] = np.einsum("pf,pf->p", b[u].astype(np.float32), d[i].astype(np.float32))
    return out


@dataclass(frozen=True)
class DcdResult:
    """Codes after a DCD run, the sweeps each row took, and whether it stopped by convergence."""

    codes: np.ndarray
    sweeps: np.ndarray
    converged: np.ndarray


def _check_pairs(users: np.ndarray, items: np.ndarray, r: np.ndarray, n: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    users, items = np.asarray(users, dtype=np.int64), np.asarray(items, dtype=np.int64)
    r = np.asarray(r, dtype=np.float64)
    if not (users.shape == items.shape == r.shape) or users.ndim != 1:
        raise ValueError(f"users, items and ratings must be equal-length 1-D arrays; found {users.shape}, {items.shape}, {r.shape}")
    if len(users) and (users.min() < 0 or users.max() >= n or items.min() < 0 or items.max() >= m):
        raise ValueError(f"pair indices out of range (users 0..{n - 1}, items 0..{m - 1})")
    return users, items, r


def dcd_users(
    b: np.ndarray, d: np.ndarray, users: np.ndarray, items: np.ndarray, r: np.ndarray, *,
    lam: float | np.ndarray, max_sweeps: int, active: np.ndarray | None = None, stickiness: float = 0.5,
) -> DcdResult:
    """Bit-wise DCD of every user code at once (Eqs. 9-10), to convergence or ``max_sweeps``.

    ``stickiness`` (the LightFR authors' code's ``lambdaa``, notes §2.11) is the weight of bit
    ``k``'s own term: the code computes ``b^_k = sum_i (r'_i - d_i.b) d_ik + 2 stickiness |I_u| b_k``
    with ``r' = 2f r - f``, which is ``2f^2`` times ``b*_k + (2 stickiness - 1) |I_u| b_k / (2f^2)``.
    At 0.5 (the default) that is the exact DCD above (the "add back bit k" form); above 0.5 a bit
    flips only when the flip lowers ``L_u`` by more than ``(2 stickiness - 1) |I_u| / f^2`` (so the
    sweep still terminates, at a code no single flip improves by more than that); below 0.5 a flip
    may raise the loss and the sweep may cycle until ``max_sweeps``.

    Args:
        b: ``{-1,+1}`` ``[n, f]`` current user codes.
        d: ``{-1,+1}`` ``[m, f]`` item codes (fixed).
        users, items, r: the rated pairs (flat) and their ratings scaled to ``[0, 1]``.
        lam: balance weight, scalar or ``[n]`` (e.g. scaled by ``|I_u|``).
        max_sweeps: at most this many passes over the ``f`` bits.
        active: bool ``[n]``, the users to update (default: all); the others are returned unchanged.
    """
    bb = check_codes(b, what="user codes").astype(np.float64).copy()
    dd = check_codes(d, f=bb.shape[1], what="item codes")
    n, f = bb.shape
    users, items, r = _check_pairs(users, items, r, n, dd.shape[0])
    dp = dd[items].astype(np.float64)  # [P, f]
    s = _pair_inner(bb, dd, users, items)
    lam_u = np.broadcast_to(np.asarray(lam, dtype=np.float64), (n,))
    # the self term beyond the exact DCD's add-back (none at stickiness 0.5: the DCD unchanged)
    sticky = None if stickiness == 0.5 else (2 * float(stickiness) - 1) * np.bincount(users, minlength=n) / (2 * f * f)
    act = np.ones(n, dtype=bool) if active is None else np.asarray(active, dtype=bool).copy()
    sweeps = np.zeros(n, dtype=np.int64)
    for _ in range(int(max_sweeps)):
        if not act.any():
            break
        sweeps += act
        changed = np.zeros(n, dtype=bool)
        total = bb.sum(axis=1)
        for k in range(f):
            dk, bk = dp[:, k], bb[:, k]
            resid = r - 0.5 - (s - bk[users] * dk) / (2 * f)
            star = np.bincount(users, weights=resid * dk, minlength=n) / f - 2 * lam_u * (total - bk)
            if sticky is not None:
                star = star + sticky * bk
            new = np.where(star > 0, 1.0, np.where(star < 0, -1.0, bk))
            flip = act & (new != bk)
            if flip.any():
                delta = np.where(flip, new - bk, 0.0)
                s += delta[users] * dk
                total += delta
                bb[:, k] = np.where(flip, new, bk)
                changed |= flip
        act &= changed
    return DcdResult(bb.astype(np.int8), sweeps, ~act)


def item_gradients(b: np.ndarray, d: np.ndarray, users: np.ndarray, items: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Agg_grad's upload per rated pair, ``[P, f]`` (Eq. 12, Algorithm 1)::

        Delta d^u_ik = (r_ui - 1/2 - (s_ui - b_uk d_ik) / (2f)) b_uk,   s_ui = b_u . d_i
    """
    f = b.shape[-1]
    bp = b[users].astype(np.float64)
    dp = d[items].astype(np.float64)
    s = np.einsum("pf,pf->p", bp, dp)
    return (np.asarray(r, dtype=np.float64)[:, None] - 0.5 - (s[:, None] - bp * dp) / (2 * f)) * bp


def item_sufficient_stats(
    b: np.ndarray, users: np.ndarray, items: np.ndarray, r: np.ndarray, m: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-pair contributions summed per item: ``a [m, f] = sum_u (r_ui - 1/2) b_u``,
    ``G [m, f, f] = sum_u b_u b_u^T`` and ``n [m]`` (the raters)."""
    a_p, g_p = pair_stats(b, users, r)
    f = b.shape[-1]
    a = np.zeros((m, f))
    np.add.at(a, items, a_p)
    g = np.zeros((m, f * f))
    np.add.at(g, items, g_p)
    return a, g.reshape(m, f, f), np.bincount(items, minlength=m).astype(np.float64)


def pair_stats(b: np.ndarray, users: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One pair's contribution to the item statistics: ``(r - 1/2) b_u [P, f]`` and ``b_u b_u^T [P, f*f]``."""
    bp = b[users].astype(np.float64)
    f = bp.shape[1]
    return (np.asarray(r, dtype=np.float64) - 0.5)[:, None] * bp, (bp[:, :, None] * bp[:, None, :]).reshape(-1, f * f)


def item_dcd(
    d: np.ndarray, a: np.ndarray, g: np.ndarray, cnt: np.ndarray, *, lam: float | np.ndarray, max_sweeps: int,
    add_back: float | np.ndarray | None = None,
) -> DcdResult:
    """Exact item DCD from sufficient statistics, every item at once (notes §9.4 option B).

    Minimises ``sum_{u in U_i} (r_ui - sim(b_u, d_i))^2 + lam_i (1^T d_i)^2`` bit by bit:
    ``d*_ik = a_ik/f - ((G_i d_i)_k - n_i d_ik)/(2 f^2) - 2 lam_i sum_{k' != k} d_ik'``.
    Items with ``n_i = 0`` do not move. ``add_back`` (default ``n_i``, the exact DCD) replaces
    ``n_i`` in the add-back term: the LightFR authors' code adds back ``|U_s| d_ik``, the number of
    the round's sampled clients (notes §2.11), which makes an item's bit flip only when the flip
    lowers its loss by more than ``(|U_s| - n_i) / f^2``.
    """
    dd = check_codes(d, what="item codes").astype(np.float64).copy()
    m, f = dd.shape
    lam_i = np.broadcast_to(np.asarray(lam, dtype=np.float64), (m,))
    gd = np.einsum("mkj,mj->mk", g, dd)
    back = np.asarray(cnt, dtype=np.float64) if add_back is None else np.broadcast_to(
        np.asarray(add_back, dtype=np.float64), (m,))
    act = np.asarray(cnt) > 0
    sweeps = np.zeros(m, dtype=np.int64)
    for _ in range(int(max_sweeps)):
        if not act.any():
            break
        sweeps += act
        changed = np.zeros(m, dtype=bool)
        total = dd.sum(axis=1)
        for k in range(f):
            dk = dd[:, k]
            star = a[:, k] / f - (gd[:, k] - back * dk) / (2 * f * f) - 2 * lam_i * (total - dk)
            new = np.where(star > 0, 1.0, np.where(star < 0, -1.0, dk))
            flip = act & (new != dk)
            if flip.any():
                delta = np.where(flip, new - dk, 0.0)
                gd += delta[:, None] * g[:, :, k]
                total += delta
                dd[:, k] = np.where(flip, new, dk)
                changed |= flip
        act &= changed
    return DcdResult(dd.astype(np.int8), sweeps, ~act)


def item_loss(d: np.ndarray, b: np.ndarray, users: np.ndarray, items: np.ndarray, r: np.ndarray, lam: float | np.ndarray) -> np.ndarray:
    """``sum_{u in U_i} (r_ui - sim)^2 + lam_i (1^T d_i)^2`` per item ``[m]``."""
    m, f = d.shape
    s = _pair_inner(b, d, users, items)
    e = np.asarray(r, dtype=np.float64) - 0.5 - s / (2 * f)
    lam_i = np.broadcast_to(np.asarray(lam, dtype=np.float64), (m,))
    return np.bincount(items, weights=e**2, minlength=m) + lam_i * d.astype(np.float64).sum(axis=1) ** 2


def local_item_codes(b: np.ndarray, d: np.ndarray, users: np.ndarray, items: np.ndarray, r: np.ndarray, *, lam: float) -> np.ndarray:
    """Agg_para's local item update (Eq. 11 with the one rater): one Gauss-Seidel bit pass per pair.

    Returns ``[P, f]``, the code of item ``items[p]`` as client ``users[p]`` updated it
    (notes §9.7: one pass, the balance term included).
    """
    f = b.shape[-1]
    bp = b[users].astype(np.float64)
    dd = d[items].astype(np.float64).copy()
    s = np.einsum("pf,pf->p", bp, dd)
    total = dd.sum(axis=1)
    r = np.asarray(r, dtype=np.float64)
    for k in range(f):
        bk, dk = bp[:, k], dd[:, k]
        star = (r - 0.5 - (s - bk * dk) / (2 * f)) * bk / f - 2 * lam * (total - dk)
        new = np.where(star > 0, 1.0, np.where(star < 0, -1.0, dk))
        delta = new - dk
        s += delta * bk
        total += delta
        dd[:, k] = new
    return dd.astype(np.int8)
