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

__all__ = ["place"]


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
