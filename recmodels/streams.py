"""Per-party random streams for simulation choices: the same draws alone or batched.

A federated simulation trains many clients at once, but each client's random choices
(negatives, shuffles) must not depend on which other clients share its batch: otherwise a
client that runs alone (on its own device, in Flower) draws differently from the same client in
the in-process simulation, and the two runs give different models. A shared
``numpy.random.Generator`` cannot provide that (a draw's position in the stream depends on every
draw before it), so these draws come from a keyed, counter-based source instead:

* :func:`stream_keys` derives one 64-bit key per party from a path such as
  ``(seed, round, user)``;
* :func:`uniform_u64` maps ``(key, counter)`` to a 64-bit value; the value of entry ``i`` of a
  party's stream depends on nothing but its key and ``i``, so a batch of parties draws exactly
  what each party would draw alone, in one vectorised call.

The mixing function is SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014; the generator behind Java's ``SplittableRandom``
and the seeding of numpy's and xoshiro's generators), applied to ``key XOR mix(counter)``. It
passes BigCrush as a generator; it is *not* a cryptographic PRF. These draws are simulation
choices only (like every other seeded draw in :mod:`recmodels`): never keys, masks, shares or
DP noise, which come from the OS CSPRNG.
"""

from __future__ import annotations

import numpy as np

__all__ = ["stream_keys", "uniform_u64", "integers", "shuffle_keys"]

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise on uint64 (wrapping arithmetic)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _u64(value: int | np.ndarray) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"stream key parts must be integers; found dtype {arr.dtype}")
    if arr.dtype.kind == "u":
        return arr.astype(np.uint64)
    return arr.astype(np.int64).view(np.uint64)  # two's complement: -1 -> 2**64 - 1


def stream_keys(*path: int | np.ndarray) -> np.ndarray:
    """One 64-bit key per party from a path of integers (scalars broadcast against arrays).

    ``stream_keys(seed, round, users)`` gives every user its own stream for that round; keys of
    different paths are unrelated (each part is mixed in turn).
    """
    key = np.asarray(_mix(np.asarray(_GAMMA)), dtype=np.uint64)
    for part in path:
        with np.errstate(over="ignore"):
            key = _mix(key ^ _mix(_u64(part) + _GAMMA))
    return np.asarray(key, dtype=np.uint64)


def uniform_u64(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Entry ``counters`` of the streams ``keys`` (arrays broadcast), as uint64."""
    with np.errstate(over="ignore"):
        return _mix(np.asarray(keys, dtype=np.uint64) ^ _mix(_u64(counters) * _GAMMA + _GAMMA))


def integers(keys: np.ndarray, counters: np.ndarray, high: int) -> np.ndarray:
    """Uniform int64 in ``[0, high)`` (modulo reduction: bias below ``high / 2**64``)."""
    if high < 1:
        raise ValueError(f"high must be >= 1; found {high}")
    return (uniform_u64(keys, counters) % np.uint64(high)).astype(np.int64)


def shuffle_keys(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Sort keys: ordering a party's entries by these gives a uniformly random permutation.

    Ties (probability about ``n**2 / 2**65``) are broken by the caller's stable sort, so the
    order stays deterministic.
    """
    return uniform_u64(keys, counters)
