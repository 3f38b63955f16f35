"""Neighbour graphs for pairwise-mask aggregation, and the abort probability of SecAgg+.

SecAgg (Bonawitz et al. 2017) masks every pair of clients: the complete graph. SecAgg+ (Bell et
al. 2020) masks only along a random k-regular graph, here a Harary-style circulant graph on a
uniformly random permutation of the clients (each client is joined to the ``k/2`` clients on each
side of it in the shuffled ring), drawn with the OS CSPRNG. ``k`` must be even and ``< n - 1``;
``k >= n - 1`` gives the complete graph.

Every client shares its two secrets (self-mask seed and mask key) t-of-(k+1) among its holders:
its ``k`` neighbours and itself. The server can unmask iff every surviving client has at least
``t`` responding holders (itself included) and every dropped client at least ``t`` responding
neighbours. :func:`abort_probability` computes the per-client failure probability exactly under
independent dropouts and the union bound over clients.
"""

from __future__ import annotations

import math
import secrets

import numpy as np
from scipy.stats import binom

__all__ = [
    "Graph",
    "abort_probability",
    "complete_graph",
    "default_k",
    "default_t",
    "random_regular_graph",
    "simulate_abort_rate",
]

Graph = tuple[tuple[int, ...], ...]  #: ``graph[u]`` = sorted neighbours of client ``u`` (never ``u``)


def default_k(n: int) -> int:
    """Bell et al.'s asymptotic degree ``2 * ceil(log2 n)``, capped at ``n - 1``.

    Not the default any more: it aborts at 30% dropout; :func:`secagg.params.choose` picks ``k``
    and ``t`` from the planned dropout and corruption instead.
    """
    if n < 2:
        raise ValueError(f"need at least 2 clients; found n = {n}.")
    return min(2 * math.ceil(math.log2(n)), n - 1)


def default_t(k: int) -> int:
    """The threshold ``ceil(k / 2) + 1`` (out of ``k + 1`` holders) that went with :func:`default_k`."""
    return math.ceil(k / 2) + 1


def complete_graph(n: int) -> Graph:
    """Every client is every other client's neighbour (SecAgg)."""
    return tuple(tuple(v for v in range(n) if v != u) for u in range(n))


def random_regular_graph(n: int, k: int) -> Graph:
    """A random k-regular circulant graph on a CSPRNG-shuffled ring (complete if ``k >= n - 1``)."""
    if type(n) is not int or n < 2:
        raise ValueError(f"need at least 2 clients; found n = {n!r}.")
    if type(k) is not int or k < 1:
        raise ValueError(f"degree k must be a positive int; found {k!r}.")
    if k >= n - 1:
        return complete_graph(n)
    if k % 2:
        raise ValueError(f"degree k must be even (k/2 neighbours on each side of the ring); found k = {k}: use {k + 1}.")
    order = list(range(n))
    secrets.SystemRandom().shuffle(order)  # os.urandom-backed shuffle
    pos = {u: i for i, u in enumerate(order)}
    half = k // 2
    return tuple(
        tuple(sorted(order[(pos[u] + d) % n] for d in list(range(1, half + 1)) + list(range(-half, 0))))
        for u in range(n)
    )


def abort_probability(n: int, k: int, t: int, dropout: float) -> float:
    """Union-bound probability that SecAgg+ aborts when each client drops independently.

    A client drops with probability ``dropout`` after sharing its keys (the expensive case). A
    surviving client fails when fewer than ``t - 1`` of its ``k`` neighbours respond; a dropped
    one when fewer than ``t`` do. Returns ``min(1, n * P(one client fails))``; exact per client.
    """
    q = 1.0 - dropout
    p_fail = q * binom.cdf(t - 2, k, q) + dropout * binom.cdf(t - 1, k, q)
    return float(min(1.0, n * p_fail))


def simulate_abort_rate(n: int, k: int, t: int, dropout: float, *, trials: int, seed: int = 0) -> float:
    """Monte-Carlo abort rate over random graphs and dropout sets (a simulation, not crypto).

    Uses a seeded numpy Generator: # CSPRNG-OK (simulated dropouts and graph positions only).
    """
    rng = np.random.default_rng(seed)  # CSPRNG-OK: simulation of dropouts, no secret is drawn
    kk = min(k, n - 1)
    half = kk // 2
    aborts = 0
    offsets = np.r_[np.arange(1, half + 1), -np.arange(1, half + 1)] if kk < n - 1 else None
    for _ in range(trials):
        alive = rng.random(n) >= dropout
        if offsets is None:
            alive_nbrs = alive.sum() - alive
        else:
            alive_nbrs = sum(np.roll(alive, int(o)) for o in offsets)  # ring positions are exchangeable
        need = np.where(alive, t - 1, t)
        aborts += bool(np.any(alive_nbrs < need))
    return aborts / trials
