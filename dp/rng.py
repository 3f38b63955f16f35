"""Randomness sources for DP noise.

Every public sampler in :mod:`dp` draws from :class:`SystemRandomSource` (``os.urandom``, the
operating system's CSPRNG). Tests that need reproducible noise pass a
:class:`DeterministicTestSource` (ChaCha20 keystream of a 32-byte seed, via ``cryptography``)
through the explicit keyword ``_test_source``; nothing else in the package creates one, and the
default path always uses the CSPRNG. numpy's and Python's ``random`` are never used for noise.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = [
    "DeterministicTestSource",
    "RandomSource",
    "SystemRandomSource",
    "resolve_source",
    "uniform_below",
    "uniform_open01",
    "uint64s",
]


@runtime_checkable
class RandomSource(Protocol):
    """Anything that returns uniformly random bytes."""

    def random_bytes(self, n: int) -> bytes:
        """Return ``n`` uniformly random bytes."""
        ...


_BULK = 4096  # requests of at least this many bytes use a freshly keyed AES-256-CTR keystream
_CHUNK = 1 << 20  # keystream bytes per update_into call (the zero input is one shared chunk)
_ZEROS = memoryview(bytes(_CHUNK))


def _keystream_into(enc, out: memoryview) -> None:  # noqa: ANN001
    """Write ``enc``'s keystream over ``out`` (encrypting zeros straight into it, a chunk at a time:
    no allocation, about 7x the throughput of ``enc.update(bytes(n))`` here)."""
    n = len(out)
    for off in range(0, n, _CHUNK):
        end = min(off + _CHUNK, n)
        enc.update_into(_ZEROS[: end - off], out[off:end])


class SystemRandomSource:
    """The operating system CSPRNG. The only source used by default.

    Requests below 4 KiB are ``os.urandom`` bytes. Larger requests (vectorised samplers ask for
    megabytes) are the AES-256-CTR keystream under a fresh 256-bit key and 128-bit initial counter
    drawn from ``os.urandom`` for that request alone: a standard block-cipher DRBG (the construction
    of NIST's CTR_DRBG without its derivation function), through OpenSSL's AES-NI, several times
    faster than the ``getrandom`` syscall for bulk bytes. No state is kept between requests, so a
    forked process never repeats its parent's stream. :meth:`fill` writes the same kind of stream
    straight into a caller's buffer (:func:`uint64s` uses it).
    """

    deterministic = False

    def random_bytes(self, n: int) -> bytes:
        """Return ``n`` CSPRNG bytes."""
        if n < _BULK:
            return os.urandom(n)
        out = bytearray(n)
        self.fill(memoryview(out))
        return bytes(out)

    def fill(self, out: memoryview) -> None:
        """Overwrite the writable byte buffer ``out`` with CSPRNG bytes."""
        n = len(out)
        if n < _BULK:
            out[:] = os.urandom(n)
            return
        seed = os.urandom(48)
        _keystream_into(Cipher(algorithms.AES(seed[:32]), modes.CTR(seed[32:])).encryptor(), out)


class DeterministicTestSource:
    """TEST-ONLY reproducible source: the ChaCha20 keystream of a 32-byte seed.

    It is cryptographically strong but reproducible, which is exactly why it must never be used
    for real noise: anyone who knows the seed knows the noise. Samplers accept it only through
    their ``_test_source`` keyword.

    Args:
        seed: 32 bytes, or an int that is encoded as 32 little-endian bytes.
    """

    deterministic = True

    def __init__(self, seed: bytes | int) -> None:
        if isinstance(seed, int) and not isinstance(seed, bool):
            if seed < 0 or seed >= 1 << 256:
                raise ValueError(f"seed must be in [0, 2^256). Found {seed}.")
            seed = seed.to_bytes(32, "little")
        if not isinstance(seed, bytes) or len(seed) != 32:
            raise ValueError(f"seed must be 32 bytes or an int. Found {seed!r}.")
        cipher = Cipher(algorithms.ChaCha20(seed, b"\x00" * 16), mode=None)
        self._enc = cipher.encryptor()

    def random_bytes(self, n: int) -> bytes:
        """Return the next ``n`` keystream bytes."""
        return self._enc.update(b"\x00" * n)

    def fill(self, out: memoryview) -> None:
        """Overwrite ``out`` with the next ``len(out)`` keystream bytes (the bytes :meth:`random_bytes`
        would have returned)."""
        _keystream_into(self._enc, out)


_SYSTEM = SystemRandomSource()


def resolve_source(test_source: RandomSource | None) -> RandomSource:
    """Return the CSPRNG unless a test explicitly injected a source."""
    if test_source is None:
        return _SYSTEM
    if not isinstance(test_source, RandomSource):
        raise TypeError(f"_test_source must provide random_bytes(n). Found {type(test_source).__name__}.")
    return test_source


def uint64s(n: int, source: RandomSource) -> np.ndarray:
    """``n`` independent uniform 64-bit integers as a ``uint64`` array."""
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    fill = getattr(source, "fill", None)
    if fill is None:  # any RandomSource: its bytes, copied into a writable array
        return np.frombuffer(source.random_bytes(8 * n), dtype=np.uint64).copy()
    out = np.empty(n, dtype=np.uint64)
    fill(memoryview(out).cast("B"))
    return out


def uniform_open01(n: int, source: RandomSource) -> np.ndarray:
    """``n`` floats uniform on the 2^52-point grid ``(k + 1/2) / 2^52``, ``k`` the top 52 random bits.

    Every grid point is a double and every step is exact (``k + 1/2 < 2^52`` needs 53 significant
    bits), so the result lies in ``[2^-53, 1 - 2^-53]``: never 0, never 1, and never exactly 1/2.
    The grid is symmetric (``1 - u`` is on it too), so ``u - 1/2`` is exact and never 0 and Laplace
    noise is finite and exactly antisymmetric. (A 53-bit ``k`` would not work: ``k + 1/2`` is not
    a double above ``2^52``, and rounding reached exactly 1.0 and 0.5.)
    """
    k = uint64s(n, source) >> np.uint64(12)
    return (k.astype(np.float64) + 0.5) * 2.0**-52


def uniform_below(m: np.ndarray, source: RandomSource) -> np.ndarray:
    """Exactly uniform integers in ``[0, m_i)`` for each ``m_i`` (vectorised rejection sampling).

    Args:
        m: positive integers below 2^63 (any integer dtype or Python ints).
        source: the randomness source.

    Returns:
        ``int64`` array, same shape as ``m``.
    """
    m = np.asarray(m, dtype=np.int64)
    if m.size and (m.min() < 1):
        raise ValueError(f"uniform_below needs m >= 1. Found {int(m.min())}.")
    flat = m.reshape(-1)
    out = np.empty(flat.shape, dtype=np.int64)
    # bit mask covering m - 1: rejection probability < 1/2 per draw.
    bits = np.zeros(flat.shape, dtype=np.int64)
    v = flat - 1
    while np.any(v > 0):
        bits += (v > 0)
        v = v >> 1
    mask = ((np.ones_like(bits, dtype=np.uint64) << bits.astype(np.uint64)) - np.uint64(1))
    todo = np.arange(flat.size)
    while todo.size:
        r = (uint64s(todo.size, source) & mask[todo]).astype(np.int64)
        ok = r < flat[todo]
        out[todo[ok]] = r[ok]
        todo = todo[~ok]
    return out.reshape(m.shape)
