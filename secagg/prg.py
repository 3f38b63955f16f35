"""Pseudo-random generator: a 32-byte seed expanded to ``uint64`` vectors with AES-256-CTR.

The keystream of AES-256 in counter mode (OpenSSL through ``cryptography``) is read as
little-endian ``uint64`` words. A ``label`` domain-separates expansions of the same seed: the
initial counter block is ``SHA-256(b"secagg/prg/v1" || label)[:8] || 0^8`` so distinct labels
start 2^64 blocks apart (no keystream overlap for any vector shorter than 2^67 bytes).

:func:`_keystream` is the known-answer core (explicit 16-byte initial counter block), checked
against NIST SP 800-38A F.5.5.
"""

from __future__ import annotations

import hashlib
import os
import threading

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["SEED_BYTES", "accumulate", "expand", "expand_into", "random_words"]

SEED_BYTES = 32
_DOMAIN = b"secagg/prg/v1"
_URANDOM_MAX = 4096  #: bytes: :func:`random_words` draws up to this many from os.urandom, more through AES-256-CTR


def _counter_block(label: bytes) -> bytes:
    return hashlib.sha256(_DOMAIN + label).digest()[:8] + bytes(8)


def _check_seed(seed: bytes) -> None:
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_BYTES:
        found = len(seed) if isinstance(seed, (bytes, bytearray)) else type(seed).__name__
        raise ValueError(f"PRG seed must be {SEED_BYTES} bytes; found {found}.")


def _keystream(key: bytes, counter_block: bytes, nbytes: int) -> bytes:
    """Raw AES-256-CTR keystream (encryption of zeros) from an explicit initial counter block."""
    enc = Cipher(algorithms.AES(bytes(key)), modes.CTR(counter_block)).encryptor()
    return enc.update(bytes(nbytes)) + enc.finalize()


def expand(seed: bytes, n: int, *, label: bytes = b"") -> np.ndarray:
    """Expand a 32-byte seed into ``n`` pseudo-random ``uint64`` values.

    Args:
        seed: 32 secret bytes (from a CSPRNG or a key agreement).
        n: number of ``uint64`` words, ``>= 0``.
        label: public domain-separation label (e.g. ``b"self"``); distinct labels give independent
            streams.

    Returns:
        A fresh writable ``uint64`` array of shape ``(n,)``.
    """
    out = np.empty(int(n), dtype=np.uint64)
    expand_into(seed, out, label=label, add=False)
    return out


def random_words(n: int, *, label: bytes = b"") -> np.ndarray:
    """``n`` fresh uniform ``uint64`` words from the CSPRNG (a fresh writable array).

    Up to 512 words are ``os.urandom``'s; more are the AES-256-CTR keystream (:func:`expand`) of a fresh
    32-byte ``os.urandom`` seed used for that draw alone (a block-cipher DRBG), because ``getrandom``
    delivers about 0.2 GB/s here, a tenth of what AES-NI gives. ``label`` only names the draw's use.
    """
    n = int(n)
    if 8 * n <= _URANDOM_MAX:
        return np.frombuffer(os.urandom(8 * n), dtype=np.uint64).copy()
    return expand(os.urandom(SEED_BYTES), n, label=label)


def expand_into(
    seed: bytes, out: np.ndarray, *, label: bytes = b"", add: bool = True, negate: bool = False
) -> None:
    """Expand ``seed`` and add (or subtract, or write) it into ``out`` in place.

    No allocation proportional to ``out``: accumulating streams the keystream block by block
    through a reusable per-thread scratch buffer (see :func:`accumulate`); overwriting writes the
    keystream directly into ``out``.

    Args:
        seed: 32 secret bytes.
        out: contiguous 1-D ``uint64`` array.
        label: domain-separation label.
        add: if False, overwrite ``out`` with the stream; else accumulate (mod 2^64).
        negate: subtract instead of add (only with ``add=True``).
    """
    _check_seed(seed)
    if out.dtype != np.uint64 or out.ndim != 1 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous 1-D uint64 array; found {out.dtype} {out.shape}.")
    if add:
        accumulate(out, [(seed, label, negate)])
        return
    # Overwrite: AES-CTR writes the keystream straight into ``out``'s memory. ``update_into``
    # needs one AES block of slack after the data, so all but the last two words go in place
    # and the tail goes through the small per-thread scratch buffer.
    enc = Cipher(algorithms.AES(bytes(seed)), modes.CTR(_counter_block(label))).encryptor()
    n = out.size
    head = max(0, n - 2)
    if head:
        enc.update_into(_zeros(8 * head), memoryview(out).cast("B"))
    if n - head:
        buf, raw = _scratch(2)
        enc.update_into(bytes(8 * (n - head)), raw)
        out[head:] = buf[: n - head]


_LOCAL = threading.local()


def _scratch(words: int) -> tuple[np.ndarray, memoryview]:
    """A per-thread reusable ``uint64`` buffer of at least ``words + 2`` words and its byte view.

    ``update_into`` needs room for one extra AES block in its output buffer, hence the 2 words.
    Reusing it avoids allocating (and page-faulting in) a fresh keystream buffer on every call.
    """
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.size < words + 2:
        buf = _LOCAL.buf = np.empty(words + 2, dtype=np.uint64)
        _LOCAL.raw = memoryview(buf).cast("B")
    return buf, _LOCAL.raw


_ZERO_CACHE: dict[int, bytes] = {}


def _zeros(nbytes: int) -> bytes:
    """A cached all-zero plaintext (the keystream is the encryption of zeros)."""
    z = _ZERO_CACHE.get(nbytes)
    if z is None:
        if len(_ZERO_CACHE) > 8:
            _ZERO_CACHE.clear()
        z = _ZERO_CACHE[nbytes] = bytes(nbytes)
    return z


def accumulate(
    out: np.ndarray, masks: list[tuple[bytes, bytes, bool]], *, block_words: int = 16384
) -> None:
    """Add (or subtract) many expansions into ``out`` in place, cache-blocked.

    Equivalent to ``expand_into(seed, out, label=label, negate=negate)`` for each
    ``(seed, label, negate)`` in ``masks``, but walks ``out`` in blocks of ``block_words`` words
    and streams every mask's keystream block by block (one live AES-CTR context per mask), so the
    accumulator block and the keystream block stay in cache: the cost is the AES keystream plus
    in-cache adds, instead of one full pass over memory per mask.
    """
    if out.dtype != np.uint64 or out.ndim != 1 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous 1-D uint64 array; found {out.dtype} {out.shape}.")
    if not masks:
        return
    plus, minus = [], []
    for seed, label, negate in masks:
        _check_seed(seed)
        enc = Cipher(algorithms.AES(bytes(seed)), modes.CTR(_counter_block(label))).encryptor()
        (minus if negate else plus).append(enc)
    n = out.size
    block = max(2, int(block_words))  # an even number of words keeps blocks on AES-block boundaries
    block -= block % 2
    buf, raw = _scratch(block)
    zeros = _zeros(8 * block)
    for start in range(0, n, block):
        stop = min(start + block, n)
        width = stop - start
        acc = out[start:stop]
        view = buf[:width]
        z = zeros if width == block else bytes(8 * width)
        for enc in plus:
            enc.update_into(z, raw)
            np.add(acc, view, out=acc)
        for enc in minus:
            enc.update_into(z, raw)
            np.subtract(acc, view, out=acc)
