"""Shamir t-of-n secret sharing of byte strings over the prime field GF(p), p = 2^31 - 1.

A secret of ``m`` bytes is cut into ``L = ceil(m / 3)`` limbs of 3 bytes (24 bits < p); each limb
is shared with its own independent random polynomial of degree ``t - 1``, so any ``t - 1`` shares
are jointly uniform (perfect secrecy does not depend on the field size, only ``n < p``). Share
``x`` (an int in ``[1, p)``) is ``f(x)`` for every limb.

Everything is vectorised with numpy ``uint64`` arithmetic: products of two field elements are
below 2^62, so Horner evaluation and Lagrange interpolation never overflow. Splitting ``S``
secrets for ``N`` holders costs ``O(t * N * S * L)`` word operations; combining a batch of ``B``
secrets costs ``O(B * t^2)`` for the Lagrange weights plus ``O(B * t * L)``. Flower's pycryptodome
GF(2^128) Shamir, by contrast, does pure-Python polynomial work per 16-byte chunk.

Wire format of one share (``share_bytes``): ``len(secret)`` as 2 bytes big-endian, then ``L``
little-endian ``uint32`` limbs. Coefficients come from ``os.urandom`` with rejection sampling
(exactly uniform in GF(p)). :func:`_split_with_coefficients` is the deterministic core.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np

__all__ = [
    "PRIME",
    "combine",
    "combine_batch",
    "decode_share",
    "encode_share",
    "lagrange_at_zero",
    "limbs_to_bytes",
    "share_size",
    "split_many",
    "split_secret",
]

PRIME = 2**31 - 1
_P = np.uint64(PRIME)
_LIMB = 3


def share_size(secret_len: int) -> int:
    """Bytes of one encoded share of a ``secret_len``-byte secret."""
    return 2 + 4 * -(-secret_len // _LIMB)


def _to_limbs(secrets: Sequence[bytes]) -> np.ndarray:
    m = len(secrets[0])
    if any(len(s) != m for s in secrets):
        raise ValueError(f"all secrets in one batch must have the same length; found {sorted({len(s) for s in secrets})}.")
    n_limbs = -(-m // _LIMB)
    raw = np.zeros((len(secrets), n_limbs * _LIMB), dtype=np.uint8)
    raw[:, :m] = np.frombuffer(b"".join(bytes(s) for s in secrets), dtype=np.uint8).reshape(len(secrets), m)
    r = raw.reshape(len(secrets), n_limbs, _LIMB).astype(np.uint64)
    return r[..., 0] | (r[..., 1] << np.uint64(8)) | (r[..., 2] << np.uint64(16))


def limbs_to_bytes(limbs: np.ndarray, m: int) -> bytes:
    """Bytes of a secret from its limb values (inverse of the 3-byte limb split)."""
    v = np.asarray(limbs, dtype=np.uint64)
    if np.any(v >= np.uint64(1 << 24)):
        raise ValueError("Shamir combine: reconstructed limb out of range (inconsistent or corrupted shares).")
    out = np.stack([(v >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(_LIMB)], axis=-1).astype(np.uint8)
    return out.reshape(-1).tobytes()[:m]


def _random_field(shape: tuple[int, ...]) -> np.ndarray:
    """Uniform elements of GF(p) from os.urandom (31-bit words, rejecting the single value p)."""
    size = int(np.prod(shape))
    out = np.frombuffer(os.urandom(4 * size), dtype=np.uint32).astype(np.uint64) & np.uint64(PRIME)
    bad = out == _P
    while bad.any():
        out[bad] = np.frombuffer(os.urandom(4 * int(bad.sum())), dtype=np.uint32).astype(np.uint64) & np.uint64(PRIME)
        bad = out == _P
    return out.reshape(shape)


def _check_params(t: int, xs: Sequence[int]) -> np.ndarray:
    if type(t) is not int or t < 1:
        raise ValueError(f"threshold t must be an int >= 1; found {t!r}.")
    x = np.asarray(list(xs), dtype=np.int64)
    if x.size < t:
        raise ValueError(f"threshold t = {t} exceeds the number of shares n = {x.size}; lower t or add holders.")
    if x.size and (x.min() < 1 or x.max() >= PRIME or np.unique(x).size != x.size):
        raise ValueError(f"share points must be distinct ints in [1, {PRIME}); found {list(xs)[:8]}...")
    return x.astype(np.uint64)


def split_many(secrets: Sequence[bytes], *, t: int, xs: Sequence[int]) -> np.ndarray:
    """Share several equal-length secrets at once.

    Args:
        secrets: ``S`` byte strings of equal length ``m``.
        t: threshold (any ``t`` shares reconstruct, ``t - 1`` reveal nothing).
        xs: the ``N`` distinct evaluation points (holders), ints in ``[1, p)``.

    Returns:
        ``uint64`` array of shape ``(N, S, L)``: limb values of each holder's share of each secret.
    """
    xs = list(xs)
    _check_params(t, xs)  # before drawing (t - 1) * S * L random words: a huge t must not exhaust memory
    limbs = _to_limbs(secrets)
    coeffs = _random_field((t - 1,) + limbs.shape)
    return _split_with_coefficients(limbs, coeffs, t=t, xs=xs)


def _split_with_coefficients(limbs: np.ndarray, coeffs: np.ndarray, *, t: int, xs: Sequence[int]) -> np.ndarray:
    """Deterministic core: ``f(x) = limbs + sum_k coeffs[k-1] x^k`` by Horner's rule."""
    x = _check_params(t, xs)[:, None, None]
    acc = np.zeros((x.shape[0],) + limbs.shape, dtype=np.uint64)
    for k in range(t - 2, -1, -1):
        acc = (acc * x + coeffs[k]) % _P
    return (acc * x + limbs) % _P


def encode_share(secret_len: int, limbs: np.ndarray) -> bytes:
    """Wire form of one share (see the module docstring)."""
    return struct.pack(">H", secret_len) + np.asarray(limbs, dtype="<u4").tobytes()


def decode_share(blob: bytes) -> tuple[int, np.ndarray]:
    """Inverse of :func:`encode_share`: ``(secret_len, limbs)``; validates the length."""
    if len(blob) < 2:
        raise ValueError(f"a Shamir share is at least 2 bytes; found {len(blob)}.")
    (m,) = struct.unpack(">H", blob[:2])
    if len(blob) != share_size(m):
        raise ValueError(f"a share of a {m}-byte secret is {share_size(m)} bytes; found {len(blob)}.")
    limbs = np.frombuffer(blob[2:], dtype="<u4").astype(np.uint64)
    if np.any(limbs >= _P):
        raise ValueError("a Shamir share limb is not a field element (>= p).")
    return m, limbs


def split_secret(secret: bytes, *, t: int, n: int) -> list[tuple[int, bytes]]:
    """Split ``secret`` into ``n`` shares at points ``1..n``, any ``t`` of which reconstruct it."""
    if type(n) is not int or n < 1 or n >= PRIME:
        raise ValueError(f"n must be an int in [1, {PRIME}); found {n!r}.")
    if len(secret) >= 2**16:
        raise ValueError(f"secrets are at most 65535 bytes; found {len(secret)}.")
    vals = split_many([secret], t=t, xs=range(1, n + 1))
    return [(i + 1, encode_share(len(secret), vals[i, 0])) for i in range(n)]


def _inv(a: np.ndarray) -> np.ndarray:
    """Vectorised inverse in GF(p) by Fermat: a^(p-2)."""
    result = np.ones_like(a)
    base = a % _P
    e = PRIME - 2
    while e:
        if e & 1:
            result = (result * base) % _P
        base = (base * base) % _P
        e >>= 1
    return result


def lagrange_at_zero(xs: np.ndarray) -> np.ndarray:
    """Lagrange weights ``w[b, j] = prod_{m != j} x_m / (x_m - x_j)`` mod p for each row of ``xs``."""
    x = np.asarray(xs, dtype=np.uint64) % _P
    batch, t = x.shape
    num = np.ones((batch, t), dtype=np.uint64)
    den = np.ones((batch, t), dtype=np.uint64)
    for m in range(t):
        xm = x[:, m : m + 1]
        diff = (xm + _P - x) % _P  # x_m - x_j
        diff[:, m] = 1
        factor = np.broadcast_to(xm, (batch, t)).copy()
        factor[:, m] = 1
        num = (num * factor) % _P
        den = (den * diff) % _P
    if np.any(den == 0):
        raise ValueError("Shamir combine: share points must be distinct.")
    return (num * _inv(den)) % _P


def combine_batch(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Reconstruct ``B`` secrets at once.

    Args:
        xs: ``(B, t)`` share points (distinct within a row).
        ys: ``(B, t, L)`` limb values of those shares.

    Returns:
        ``(B, L)`` limb values of the secrets.
    """
    x = np.asarray(xs, dtype=np.uint64)
    uniq, inverse = np.unique(x, axis=0, return_inverse=True)  # shared point sets: one weight row
    w = lagrange_at_zero(uniq)[inverse.reshape(-1)]
    return ((w[:, :, None] * (np.asarray(ys, dtype=np.uint64) % _P)) % _P).sum(axis=1) % _P


def combine(shares: Sequence[tuple[int, bytes]], *, t: int) -> bytes:
    """Reconstruct a secret from at least ``t`` shares (the first ``t`` distinct points are used).

    Raises:
        ValueError: fewer than ``t`` distinct shares, or inconsistent/malformed shares.
    """
    if type(t) is not int or t < 1:
        raise ValueError(f"threshold t must be an int >= 1; found {t!r}.")
    seen: dict[int, bytes] = {}
    for x, blob in shares:
        if type(x) is not int or not 1 <= x < PRIME:
            raise ValueError(f"share point must be an int in [1, {PRIME}); found {x!r}.")
        seen.setdefault(x, blob)
    if len(seen) < t:
        raise ValueError(f"need at least t = {t} distinct shares to reconstruct; found {len(seen)}.")
    pts = sorted(seen)[:t]
    decoded = [decode_share(seen[x]) for x in pts]
    lens = {m for m, _ in decoded}
    if len(lens) != 1:
        raise ValueError(f"shares of secrets of different lengths mixed: {sorted(lens)}.")
    limbs = combine_batch(np.array([pts], dtype=np.uint64), np.stack([v for _, v in decoded])[None])
    return limbs_to_bytes(limbs[0], lens.pop())
