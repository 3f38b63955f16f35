"""AES-128 on the CPU's AES instructions, inside compiled loops (numba and LLVM's AES-NI intrinsics).

The DPF's PRG and check hash are fixed-key AES-128 in MMO mode, and the servers' check MAC is
AES-128 keyed by their shared challenge (:mod:`secagg.dpf`). Through ``cryptography`` each AES call
is one pass over a buffer in memory, and everything the DPF does with the output (feed-forward,
corrections, sums, the MAC's chaining) is another pass, plus Python between the calls: at ML-100K's
shape that doubled a server's evaluation over its AES work. No library exposes AES rounds to
compiled code, so :mod:`secagg.aesni_kernels` emits them: ``aes8`` and ``mmo8`` are numba intrinsics that
encrypt eight independent blocks (a whole pipeline: AES-NI's latency is about four times its
issue interval) with ``aesenc``/``aesenclast``, so a loop can keep the outputs in cache and feed them
straight into the next step. It is the real AES (FIPS-197), with the same bytes as OpenSSL's:
``tests/secagg/test_aesni.py`` checks it against ``cryptography`` on random keys and blocks and
against FIPS-197's key-expansion vector.

The key schedule (:func:`round_keys`) runs on the same instructions (``SubWord`` is ``aesenclast``
of the word broadcast to the four columns, where ``ShiftRows`` is the identity), so a secret key
(the challenge) is expanded without table lookups.

**Where it runs.** x86-64 CPUs with AES-NI, detected through llvmlite (:func:`available`). Elsewhere
(e.g. ARM) nothing here is compiled and the DPF keeps its ``cryptography`` path: the same words.
Setting ``SECAGG_AESNI=0`` in the environment turns it off on any machine (read once per process, at the first use).
"""

from __future__ import annotations

import functools
import os
import platform

import numpy as np

__all__ = ["KEY_WORDS", "available", "ecb", "kernels", "round_keys"]

KEY_WORDS = 22  #: uint64 words of one expanded AES-128 key (11 round keys)


@functools.cache
def available() -> bool:
    """Whether this process can run the AES-NI loops: an x86-64 CPU with the AES instructions, numba
    importable, and ``SECAGG_AESNI`` not set to ``0``."""
    if os.environ.get("SECAGG_AESNI", "1") == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        import llvmlite.binding as ll
        import numba  # noqa: F401 - the loops need it
    except ImportError:
        return False
    try:
        return bool(ll.get_host_cpu_features().get("aes", False))
    except RuntimeError:  # llvmlite could not read the host's features
        return False


@functools.cache
def kernels():  # noqa: ANN202 - the module
    """:mod:`secagg.aesni_kernels` (the intrinsics and loops), imported only where :func:`available`:
    LLVM cannot lower the AES intrinsics for a CPU without them."""
    if not available():
        raise RuntimeError("AES-NI is not available here (see secagg.aesni.available)")
    from secagg import aesni_kernels
    return aesni_kernels


def round_keys(key: bytes) -> np.ndarray:
    """The 11 round keys of the AES-128 key ``key`` (16 bytes): ``uint64 [22]`` in memory order."""
    if not isinstance(key, bytes | bytearray) or len(key) != 16:
        raise ValueError("an AES-128 key is 16 bytes")
    out = np.empty(KEY_WORDS, np.uint64)
    kernels().expand_key(np.frombuffer(bytes(key), np.uint64).copy(), out)
    return out


def ecb(x: np.ndarray, rk: np.ndarray, *, mmo: bool = False) -> np.ndarray:
    """``AES(x)`` (``AES(x) XOR x`` with ``mmo``) of ``uint64 [n, 2]`` blocks under round keys ``rk``."""
    x = np.ascontiguousarray(x, dtype=np.uint64)
    if x.ndim != 2 or x.shape[1] != 2:
        raise ValueError("blocks must be uint64 [n, 2]")
    if np.asarray(rk).shape != (KEY_WORDS,):
        raise ValueError(f"round keys must be uint64 [{KEY_WORDS}] (round_keys)")
    out = np.empty_like(x)
    kernels().ecb(x.reshape(-1), np.ascontiguousarray(rk, dtype=np.uint64), out.reshape(-1), mmo)
    return out
