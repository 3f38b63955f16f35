"""Cuckoo hashing into buckets: many points per client at the cost of one domain (times three).

A client that touches ``P`` rows of an ``N``-row table could send ``P`` distributed point
functions over the whole domain, but then every server evaluates ``P x N`` leaves per client.
Batch codes from cuckoo hashing (Ishai, Kushilevitz, Ostrovsky, Sahai 2004; Angel, Chen, Laine,
Setty 2018 for PIR; Schoppmann, Gascon, Reichert, Raykova 2019 and Boyle et al. 2019 for
multi-point functions) cut that to ``3 N``:

* **public layout** (:class:`CuckooLayout`): ``m`` buckets; every element ``x`` of ``[0, N)`` is
  placed in three *distinct* buckets ``h_0(x), h_1(x), h_2(x)`` drawn from a public 32-byte seed
  (AES-256-CTR, :func:`secagg.prg.expand`; public randomness, both servers and every client derive
  the same table). Bucket ``j`` holds the elements placed in it, in increasing order of ``x``: its
  *size* ``n_j``, and ``x``'s *position* in it. The sizes add up to exactly ``3 N``.
* **client** (:meth:`CuckooLayout.assign`): puts each of its ``P`` distinct points in one of its
  three buckets, at most one point per bucket, by maximum bipartite matching (the optimal cuckoo
  insertion: it fails only when no assignment exists), then sends one single-point DPF per bucket
  over that bucket's ``n_j`` positions. An empty bucket gets a point of value zero at a position
  drawn from the OS CSPRNG, so every bucket looks the same to a server.
* **server**: evaluates every bucket's DPF on its ``n_j`` positions (``3 N`` leaves in all) and maps
  bucket positions back to elements once per round (:meth:`CuckooLayout.to_domain`): the mapping
  is linear and public, so the servers sum in bucket space over all clients first.

**Failure probability and the number of buckets.** By Hall's theorem an assignment fails exactly
when some ``k`` points have all their ``3k`` choices inside ``k - 1`` buckets, so (union bound)
``P[fail] <= sum_{k>=4} C(P, k) C(m, k-1) (C(k-1, 3) / C(m, 3))^k``. :func:`buckets_for` returns the
smallest ``m`` for which this bound is at most ``2^-failure_bits`` (default 40): e.g. ``m = 230``
for ``P = 100`` (the bound is loose: simulated failures at ``P = 100`` vanish from ``m ~ 130``
on, see docs/dpf.md). A client whose points cannot be placed (probability below the bound) gets a
:class:`CuckooError` and sits the aggregation out; the layout is fixed, so retrying with another
table would tell the servers something about the points.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching
from scipy.special import gammaln

from secagg.errors import SecAggError
from secagg.prg import SEED_BYTES, expand

__all__ = ["CHOICES", "CuckooError", "CuckooLayout", "buckets_for", "failure_bound_log2"]

CHOICES = 3  #: buckets per element
_MAX_DOMAIN = 2**40


class CuckooError(SecAggError):
    """The client's points cannot be placed one per bucket (see the module docstring for how rare)."""


def _log2_comb(n: int, k: int) -> float:
    return float((gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)) / math.log(2))


@functools.lru_cache(maxsize=4096)
def failure_bound_log2(points: int, buckets: int) -> float:
    """``log2`` of the union bound on the probability that ``points`` random points admit no
    one-per-bucket assignment into ``buckets`` buckets with three distinct choices each
    (``-inf`` when no failure is possible)."""
    if type(points) is not int or type(buckets) is not int or points < 0 or buckets < CHOICES:
        raise ValueError(f"need points >= 0 and buckets >= {CHOICES}; found {points!r}, {buckets!r}")
    if points > buckets:
        return 0.0
    terms = []
    for k in range(CHOICES + 1, points + 1):
        if k - 1 > buckets:
            break
        terms.append(_log2_comb(points, k) + _log2_comb(buckets, k - 1)
                     + k * (_log2_comb(k - 1, CHOICES) - _log2_comb(buckets, CHOICES)))
    if not terms:
        return -math.inf
    top = max(terms)
    return min(0.0, top + math.log2(sum(2.0 ** (t - top) for t in terms)))


@functools.lru_cache(maxsize=1024)
def buckets_for(points: int, *, failure_bits: int = 40) -> int:
    """The smallest number of buckets whose failure bound (:func:`failure_bound_log2`) is at most
    ``2^-failure_bits`` for ``points`` points (at least 3, at least ``points``)."""
    if type(points) is not int or points < 1:
        raise ValueError(f"points must be a positive int; found {points!r}")
    if type(failure_bits) is not int or not 1 <= failure_bits <= 128:
        raise ValueError(f"failure_bits must be an int in [1, 128]; found {failure_bits!r}")
    lo = max(CHOICES, points)
    if failure_bound_log2(points, lo) <= -failure_bits:
        return lo
    hi = lo
    while failure_bound_log2(points, hi) > -failure_bits:
        hi *= 2
    while hi - lo > 1:  # the bound decreases in the number of buckets
        mid = (lo + hi) // 2
        if failure_bound_log2(points, mid) <= -failure_bits:
            hi = mid
        else:
            lo = mid
    return hi


@functools.cache
def _fused():  # noqa: ANN202 - the module, or None
    """:mod:`secagg.cuckoo_fused` (the compiled placement), loaded on first use, or ``None`` where numba
    does not import."""
    try:
        from secagg import cuckoo_fused
    except ImportError:
        return None
    return cuckoo_fused


def _insert(h: np.ndarray, buckets: int) -> np.ndarray | None:
    """Cuckoo insertion with evictions (:func:`secagg.cuckoo_fused.place`): a valid bucket per point,
    or ``None`` when it gave up (after ``64 + 16 P`` evictions) or numba does not import; the caller
    then runs the exact matching."""
    fused = _fused()
    if fused is None:
        return None
    bucket = np.empty(h.shape[0], np.int64)
    return bucket if fused.place(np.ascontiguousarray(h, dtype=np.int64), buckets, _steps(h.shape[0]), bucket) else None


def _steps(points: int) -> int:
    """The evictions :func:`secagg.cuckoo_fused.place` may spend on ``points`` points before giving up."""
    return 64 + 16 * points


@dataclass(frozen=True)
class CuckooLayout:
    """The public placement of ``domain`` elements into ``buckets`` buckets, three each.

    Attributes:
        domain: ``N``, the number of rows (elements ``0 .. N-1``).
        buckets: ``m`` (at least 3).
        seed: the public 32-byte seed of the hash functions (both servers and every client use
            the same one; a deployment fixes it, e.g. per protocol instance).
    """

    domain: int
    buckets: int
    seed: bytes = bytes(SEED_BYTES)
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.domain) is not int or not 1 <= self.domain <= _MAX_DOMAIN:
            raise ValueError(f"domain must be an int in [1, 2^40]; found {self.domain!r}")
        if type(self.buckets) is not int or not CHOICES <= self.buckets <= 2**24:
            raise ValueError(f"buckets must be an int in [3, 2^24]; found {self.buckets!r}")
        if not isinstance(self.seed, bytes) or len(self.seed) != SEED_BYTES:
            raise ValueError(f"seed must be {SEED_BYTES} bytes; found {self.seed!r}")

    @classmethod
    def for_points(cls, domain: int, points: int, *, seed: bytes = bytes(SEED_BYTES),
                   failure_bits: int = 40) -> CuckooLayout:
        """The layout with :func:`buckets_for` ``(points)`` buckets."""
        return cls(domain, buckets_for(points, failure_bits=failure_bits), seed)

    # -- the public tables -------------------------------------------------------------------------
    def choices(self, xs: np.ndarray) -> np.ndarray:
        """``int64 [len(xs), 3]``: the three distinct buckets of each element of ``xs``."""
        xs = np.asarray(xs, dtype=np.int64)
        return self._hash_table()[xs]

    def _hash_table(self) -> np.ndarray:
        table = self._tables.get("hash")
        if table is None:
            n, m = self.domain, self.buckets
            r = expand(self.seed, CHOICES * n, label=b"secagg/cuckoo/v1").reshape(n, CHOICES)
            a = (r[:, 0] % np.uint64(m)).astype(np.int64)
            b = (a + 1 + (r[:, 1] % np.uint64(m - 1)).astype(np.int64)) % m
            lo, hi = np.minimum(a, b), np.maximum(a, b)
            c = (r[:, 2] % np.uint64(m - 2)).astype(np.int64)
            c += c >= lo
            c += c >= hi
            table = self._tables["hash"] = np.stack([a, b, c], axis=1)
        return table

    def _slots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sizes [m], offsets [m+1], slot [N, 3])``: ``slot[x, i]`` is the index, in the
        concatenation of all buckets (bucket ``j`` at ``offsets[j]``), of ``x``'s copy in bucket
        ``h_i(x)``."""
        got = self._tables.get("slots")
        if got is None:
            h = self._hash_table()
            flat = h.ravel()  # element-major: (x, i) at 3x + i, so a stable sort keeps x increasing
            order = np.argsort(flat, kind="stable")
            sizes = np.bincount(flat, minlength=self.buckets).astype(np.int64)
            offsets = np.zeros(self.buckets + 1, np.int64)
            np.cumsum(sizes, out=offsets[1:])
            slot = np.empty(flat.size, np.int64)
            slot[order] = np.arange(flat.size, dtype=np.int64)
            got = self._tables["slots"] = (sizes, offsets, slot.reshape(-1, CHOICES))
            self._tables["elements"] = order // CHOICES
        return got

    @property
    def sizes(self) -> np.ndarray:
        """``int64 [m]``: the number of positions of each bucket (they add up to ``3 N``)."""
        return self._slots()[0]

    @property
    def offsets(self) -> np.ndarray:
        """``int64 [m + 1]``: where each bucket starts in the concatenation of all buckets."""
        return self._slots()[1]

    @property
    def depth(self) -> int:
        """Tree depth of every bucket's DPF: ``ceil(log2(max bucket size))``, at least 1 (computed once per
        layout: every received key set is checked against it)."""
        got = self._tables.get("depth")
        if got is None:
            got = self._tables["depth"] = max(1, int(self.sizes.max() - 1).bit_length())
        return got

    @property
    def leaves(self) -> int:
        """Positions a server evaluates per client: the sum of the bucket sizes (``3 N``)."""
        return int(self.offsets[-1])

    # -- client: placing points --------------------------------------------------------------------
    def assign(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Place distinct points one per bucket.

        Args:
            xs: distinct elements of ``[0, N)``, at most ``m``.

        Returns:
            ``(bucket [P], position [P])``: the bucket of each point and its position there.

        Raises:
            CuckooError: no one-per-bucket assignment exists for these points.
            ValueError: points out of range, repeated, or more than the buckets.
        """
        xs = np.asarray(xs, dtype=np.int64)
        if xs.ndim != 1 or (xs.size and (xs.min() < 0 or xs.max() >= self.domain)):
            raise ValueError(f"points must be a 1-D array of elements of [0, {self.domain})")
        if len(np.unique(xs)) != xs.size:
            raise ValueError("points must be distinct")
        return self._assign(xs)

    def _assign(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`assign` of points already checked (``int64``, 1-D, distinct, in the domain)."""
        if xs.size > self.buckets:
            raise CuckooError(f"{xs.size} points cannot be placed into {self.buckets} buckets")
        if xs.size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        h = self.choices(xs)
        bucket = _insert(h, self.buckets)  # cuckoo insertion first (compiled); None: it gave up
        if bucket is None:
            bucket = self._match(xs, h)
        which = np.argmax(h == bucket[:, None], axis=1)
        sizes, offsets, slot = self._slots()
        position = slot[xs, which] - offsets[bucket]
        return bucket, position

    def _match(self, xs: np.ndarray, h: np.ndarray) -> np.ndarray:
        """The exact placement (a maximum bipartite matching): a bucket per point, or CuckooError when
        no one-per-bucket assignment exists."""
        # each point's distinct choices, sorted: the CSR arrays directly (canonical, no COO conversion)
        hs = np.sort(h, axis=1)
        keep = np.ones(hs.shape, bool)
        keep[:, 1:] = hs[:, 1:] != hs[:, :-1]
        indptr = np.zeros(xs.size + 1, np.int32)
        np.cumsum(keep.sum(axis=1), out=indptr[1:])
        graph = csr_matrix((np.ones(int(indptr[-1]), np.int8), hs[keep].astype(np.int32), indptr),
                           shape=(xs.size, self.buckets))
        match = maximum_bipartite_matching(graph, perm_type="column")
        if (match < 0).any():
            raise CuckooError(f"{int((match < 0).sum())} of {xs.size} points found no free bucket (no "
                              f"one-per-bucket assignment exists in this layout)")
        return match.astype(np.int64)

    def spread(self, xs: np.ndarray, values: np.ndarray, *, checked: bool = False,
               words: Callable[[int], np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every bucket's point and value for a client: its points placed by :meth:`assign`, the
        other buckets a zero value at a CSPRNG-drawn position.

        Args:
            xs: the client's distinct points.
            values: ``uint64 [P, d]``, the value of each point.
            checked: the caller already checked ``xs`` as :meth:`assign` does (``int64``, 1-D, distinct,
                in the domain), so it is not checked again.
            words: where the one-pass placement takes its decoys' CSPRNG words: called with a count, it
                returns that many fresh uniform ``uint64`` words, each handed out once (a simulation's
                batch of clients slices one keystream: ``secagg.dpf_run``); default one ``os.urandom`` call.

        Returns:
            ``(alpha int64 [m], beta uint64 [m, d])``.
        """
        values = np.asarray(values)
        if values.dtype != np.uint64 or values.ndim != 2 or values.shape[0] != np.size(xs):
            raise ValueError(f"values must be uint64 [points, d]; found {values.dtype} {values.shape}")
        fused = _fused() if checked and np.size(xs) <= self.buckets else None
        if fused is not None:  # one compiled pass: decoys, insertion, positions, values
            todo, span, top = self._decoy_tables()
            _, offsets, slot = self._slots()
            alpha = np.zeros(self.buckets, np.int64)
            beta = np.zeros((self.buckets, values.shape[1]), np.uint64)
            if words is None:
                draw = np.frombuffer(os.urandom(8 * todo.size), dtype="<u8")
            else:
                draw = words(todo.size)
                if draw.dtype != np.uint64 or draw.shape != (todo.size,) or not draw.flags.c_contiguous:
                    raise ValueError(f"words must give {todo.size} contiguous uint64 words; got {draw.dtype} {draw.shape}")
            if fused.spread(xs, values, self._hash_table(), slot, offsets, _steps(np.size(xs)), draw, todo, span, top,
                            alpha, beta) == 0:
                return alpha, beta
            # the insertion gave up, a decoy draw was rejected (below 2^-40 per bucket) or a point is outside
            # the domain (a caller that said checked wrongly): the general path
        bucket, position = self._assign(xs) if checked else self.assign(xs)
        alpha = self.decoys()
        beta = np.zeros((self.buckets, values.shape[1]), np.uint64)
        alpha[bucket] = position
        beta[bucket] = values
        return alpha, beta

    def decoys(self) -> np.ndarray:
        """A position per bucket drawn from the OS CSPRNG (0 for a bucket of no positions): where
        a bucket without a point puts its zero value."""
        todo, span, top = self._decoy_tables()
        out = np.zeros(self.buckets, np.int64)
        # exactly uniform: accept a 64-bit draw below the largest multiple of the size (rejection is
        # below 2^-40 per bucket), in one CSPRNG call per pass rather than one per bucket
        while todo.size:
            draw = np.frombuffer(os.urandom(8 * todo.size), dtype="<u8").astype(np.uint64)
            ok = draw <= top
            out[todo[ok]] = (draw[ok] % span[ok]).astype(np.int64)
            todo, span, top = todo[~ok], span[~ok], top[~ok]
        return out

    def _decoy_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(buckets with positions, their sizes, the largest accepted draw per bucket)``: public, per
        layout, so a client's decoys cost one CSPRNG call and three passes."""
        got = self._tables.get("decoys")
        if got is None:
            sizes = np.asarray(self.sizes, dtype=np.uint64)
            todo = np.flatnonzero(sizes > 0)
            span = sizes[todo]
            top = np.uint64(2**64 - 1) - ((np.uint64(2**64 - 1) % span) + np.uint64(1)) % span
            got = self._tables["decoys"] = (todo, span, top)
        return got

    # -- server: back to the domain ----------------------------------------------------------------
    def to_domain(self, flat: np.ndarray) -> np.ndarray:
        """Map a bucket-space vector to the domain: ``out[x] = sum_i flat[slot(x, i)]`` (mod 2^64).

        Args:
            flat: ``uint64 [3N, d]``, one row per bucket position (buckets concatenated).

        Returns:
            ``uint64 [N, d]``.
        """
        flat = np.asarray(flat)
        if flat.dtype != np.uint64 or flat.ndim != 2 or flat.shape[0] != self.leaves:
            raise ValueError(f"expected uint64 [{self.leaves}, d]; found {flat.dtype} {flat.shape}")
        slot = self._slots()[2]
        out = np.take(flat, slot[:, 0], axis=0)
        part = np.empty_like(out)
        for i in range(1, CHOICES):
            np.add(out, np.take(flat, slot[:, i], axis=0, out=part), out=out)
        return out

    @property
    def elements(self) -> np.ndarray:
        """``int64 [3N]``: the element at each position of the concatenated buckets."""
        self._slots()
        return self._tables["elements"]

    @property
    def slots(self) -> np.ndarray:
        """``int64 [N, 3]``: the index of each element's three copies in the concatenated buckets."""
        return self._slots()[2]

    def from_domain(self, table: np.ndarray) -> np.ndarray:
        """The rows of a domain table in bucket order (``out[slot(x, i)] = table[x]``), for PIR."""
        table = np.asarray(table)
        if table.shape[:1] != (self.domain,):
            raise ValueError(f"expected a table of {self.domain} rows; found {table.shape}")
        out = np.empty((self.leaves, *table.shape[1:]), dtype=table.dtype)
        slot = self._slots()[2]
        for i in range(CHOICES):
            out[slot[:, i]] = table
        return out
