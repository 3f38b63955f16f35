"""Cuckoo placement by insertion with evictions, as one compiled loop (numba).

:meth:`secagg.cuckoo.CuckooLayout.assign` needs one point per bucket, each in one of its three
buckets. Its exact method is a maximum bipartite matching (scipy), which always finds an assignment
when one exists but costs a sparse graph per call (0.25 ms per client at ML-100K's shape, a fifth of a
simulated client's upload). :func:`place` tries the classic cuckoo insertion first: put a point in a
free bucket of its three, else evict the occupant of one of them (cycling through the three) and
re-insert that one, up to a step limit. Any result it returns is a valid assignment (checked by the
caller's tests); when it gives up the caller falls back to the matching, so a placement fails (and
the client sits the round out) exactly when no assignment exists. Which valid assignment a client
uses is invisible to the servers (each bucket's tree hides its point); this module imports nothing
from :mod:`secagg.cuckoo`, which imports it lazily.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["place", "spread"]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def place(h, buckets, max_steps, bucket):  # noqa: ANN001, ANN202
    """Fill ``bucket[p]`` (``int64 [P]``) with a bucket among ``h[p, :]`` (``int64 [P, 3]``) for every
    point, no two points in one bucket of ``buckets``; ``True`` on success, ``False`` after
    ``max_steps`` evictions in all (``bucket`` is then meaningless)."""
    owner = np.full(buckets, -1, np.int64)
    turn = np.zeros(h.shape[0], np.int64)  # which of its buckets a point evicts from next
    steps = 0
    for p in range(h.shape[0]):
        cur = p
        while True:
            done = False
            for i in range(3):
                b = h[cur, i]
                if owner[b] < 0:
                    owner[b] = cur
                    bucket[cur] = b
                    done = True
                    break
            if done:
                break
            steps += 1
            if steps > max_steps:
                return False
            i = turn[cur]
            turn[cur] = (i + 1) % 3
            b = h[cur, i]
            victim = owner[b]
            owner[b] = cur
            bucket[cur] = b
            cur = victim
    return True


@numba.njit(cache=True, nogil=True, boundscheck=False)
def spread(xs, values, table, slot, offsets, max_steps, draw, todo, span, top, alpha, beta):  # noqa: ANN001, ANN202, PLR0913
    """:meth:`secagg.cuckoo.CuckooLayout.spread` of checked points in one pass: the decoys first
    (``alpha[todo[i]] = draw[i] mod span[i]``, each draw accepted when ``<= top[i]``), then each point
    ``xs[p]`` placed by :func:`place` among its buckets ``table[xs[p]]`` at its position there
    (``slot[xs[p], i] - offsets[bucket]``) with its value row in ``beta[bucket]``. ``alpha`` and
    ``beta`` come zeroed. Returns 0 when done, 1 when the insertion gave up (the caller runs the exact
    matching), 2 when a decoy draw was rejected (the caller draws again), 3 when a point lies outside
    the table (nothing is read out of bounds; the caller's general path reports it); after 1, 2 or 3
    ``alpha`` and ``beta`` are meaningless."""
    for p in range(xs.shape[0]):
        if xs[p] < 0 or xs[p] >= table.shape[0]:
            return 3
    for i in range(todo.shape[0]):
        d = draw[i]
        if d > top[i]:
            return 2
        alpha[todo[i]] = np.int64(d % span[i])
    n = xs.shape[0]
    h = np.empty((n, 3), np.int64)
    for p in range(n):
        for i in range(3):
            h[p, i] = table[xs[p], i]
    bucket = np.empty(n, np.int64)
    if not place(h, alpha.shape[0], max_steps, bucket):
        return 1
    for p in range(n):
        b = bucket[p]
        which = 0
        while h[p, which] != b:
            which += 1
        alpha[b] = slot[xs[p], which] - offsets[b]
        for j in range(values.shape[1]):
            beta[b, j] = values[p, j]
    return 0
