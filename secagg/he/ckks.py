"""CKKS vector encryption through TenSEAL, with FedMF's shared-key model.

Parties: clients all hold the SAME secret context (generated once, distributed to clients over a
confidential authenticated channel: out of scope here); the server holds a context made public
with TenSEAL's ``make_context_public`` (public key only; no secret key, no Galois or relinearisation
keys, which additions do not need).

Adversary: an honest-but-curious server that sees every ciphertext.

Promise: under RLWE the server learns nothing about the uploads beyond their lengths and counts; it
can add ciphertexts but cannot decrypt (a test shows that a public context refuses to decrypt, and
that serialising the server's context never carries the secret key). Decryption is approximate: a
sum of ``k`` fresh ciphertexts decrypts within :func:`sum_error_bound` of the true sum.

Limits:

* Shared key: any client can decrypt any upload (as with Paillier in FedMF).
* CKKS is malleable and ciphertexts are not authenticated: the server can add any valid encryption
  and nobody notices. The envelope's key fingerprint catches honest mix-ups between keys; a
  ciphertext made under another key but relabelled with our fingerprint decrypts to noise that no
  check here detects.
* Decrypted CKKS values carry key-dependent noise; publishing exact decryptions can leak the secret
  key (Li and Micciancio, 2021). Here only clients, who already hold the key, ever decrypt.

Parameters (:class:`CKKSParams`, defaults as measured in PEERS.md): ring degree ``N = 8192`` (4096
slots per ciphertext), coefficient modulus ``[60, 40, 40, 60]`` bits (200 bits, below SEAL's
128-bit-security limit of 218 for N = 8192), scale ``2^40``. Vectors longer than ``N/2`` are split
into several ciphertexts by this module (not by TenSEAL, which prints a warning on stdout).

Error bound (the derivation is in ``docs/he.md``): a fresh ciphertext decrypts with per-slot error at
most ``(B_clean + N) / 2^scale_bits`` where ``B_clean = 8*sqrt(2)*sigma*N + 6*sigma*sqrt(N) +
16*sigma*sqrt(h*N)`` (Cheon-Kim-Kim-Song 2017, Lemma 1, canonical-embedding bound with
``sigma = 3.2`` and Hamming weight ``h <= N`` for SEAL's ternary secret; the first term is scaled by
``sqrt(4/3)`` because SEAL's ephemeral ``u`` is uniform ternary) and ``N`` bounds the encoding
rounding; errors add under addition, so the sum of ``k`` ciphertexts errs by at most ``k`` times that.
It is a heuristic high-probability bound (6-sigma tails), 90x above the error measured for one
vector and 1000x for a sum of 100 (independent errors grow like sqrt(k), the bound like k).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import tenseal as ts

from secagg.he.errors import (
    CiphertextError,
    HEError,
    KeyMismatchError,
    NoSecretKeyError,
    PlaintextOverflowError,
    ShapeMismatchError,
)
from secagg.he.isolate import probe_context

__all__ = [
    "CKKSCiphertext",
    "CKKSContext",
    "CKKSParams",
    "decrypt_vector",
    "encrypt_vector",
    "sum_error_bound",
    "sum_vectors",
]

#: SEAL's largest total coefficient-modulus size (bits) for 128-bit security, by ring degree.
SEAL_MAX_COEFF_BITS_128 = {1024: 27, 2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881}
_SIGMA = 3.2
_MAGIC = b"CKV1"
_HEADER = struct.Struct(">4s16sIII")  # magic, fingerprint, length, summands, chunks
_CHUNK_LEN = struct.Struct(">I")


@dataclass(frozen=True)
class CKKSParams:
    """CKKS parameters.

    Attributes:
        poly_modulus_degree: Ring degree ``N`` (a power of two in SEAL's table); ``N/2`` slots.
            Default 8192.
        coeff_mod_bit_sizes: Bit sizes of the coefficient-modulus primes; the total must not exceed
            SEAL's 128-bit-security limit for ``N``. Default ``(60, 40, 40, 60)``.
        scale_bits: ``log2`` of the encoding scale. Default 40.
    """

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 60)
    scale_bits: int = 40

    def __post_init__(self) -> None:
        n = self.poly_modulus_degree
        if n not in SEAL_MAX_COEFF_BITS_128:
            raise HEError(
                f"poly_modulus_degree must be one of {sorted(SEAL_MAX_COEFF_BITS_128)}; found {n!r}."
            )
        sizes = tuple(self.coeff_mod_bit_sizes)
        object.__setattr__(self, "coeff_mod_bit_sizes", sizes)
        if len(sizes) < 2 or any(type(b) is not int or not 20 <= b <= 60 for b in sizes):
            raise HEError(
                f"coeff_mod_bit_sizes needs at least two primes of 20..60 bits; found {sizes!r}."
            )
        if sum(sizes) > SEAL_MAX_COEFF_BITS_128[n]:
            raise HEError(
                f"coefficient modulus of {sum(sizes)} bits exceeds the 128-bit-security limit "
                f"{SEAL_MAX_COEFF_BITS_128[n]} for N={n}; use fewer or smaller primes, or a larger N."
            )
        if type(self.scale_bits) is not int or not 20 <= self.scale_bits < sizes[0]:
            raise HEError(
                f"scale_bits must lie in [20, {sizes[0]}) (below the first prime); found {self.scale_bits!r}."
            )

    @property
    def slots(self) -> int:
        """Values per ciphertext: ``N / 2``."""
        return self.poly_modulus_degree // 2

    @property
    def max_abs_value(self) -> float:
        """Largest accepted ``|x|`` per input value: ``2^(first_prime_bits - scale_bits - 1)``.

        Keeps ``x * scale`` below the first prime, so the value survives even a rescale to the
        last level; additions of up to millions of such values stay far below the top modulus.
        """
        return float(2 ** (self.coeff_mod_bit_sizes[0] - self.scale_bits - 1))

    def fresh_error_bound(self) -> float:
        """Per-slot error bound of one fresh encryption (see the module docstring)."""
        n = self.poly_modulus_degree
        # The e*u term is scaled by sqrt(4/3): SEAL draws u uniform ternary (variance 2/3), the lemma
        # assumes ZO(0.5) (variance 1/2). h <= N bounds the secret's Hamming weight.
        b_clean = (
            8 * math.sqrt(2) * math.sqrt(4 / 3) * _SIGMA * n
            + 6 * _SIGMA * math.sqrt(n)
            + 16 * _SIGMA * math.sqrt(n * n)
        )
        return (b_clean + n) / 2.0**self.scale_bits


def sum_error_bound(summands: int, params: CKKSParams | None = None) -> float:
    """Per-slot bound on ``|decrypt(sum of k ciphertexts) - sum of k inputs|``: ``k`` fresh bounds.

    Args:
        summands: Number ``k >= 1`` of fresh ciphertexts summed.
        params: The parameters (defaults if ``None``).
    """
    if type(summands) is not int or summands < 1:
        raise HEError(f"summands must be a positive int; found {summands!r}.")
    return summands * (params or CKKSParams()).fresh_error_bound()


def _public_fingerprint(ctx: ts.Context) -> bytes:
    blob = ctx.serialize(
        save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )
    return hashlib.sha256(b"secagg/he/ckks/v1" + blob).digest()[:16]


class CKKSContext:
    """A TenSEAL CKKS context plus its parameters and public-key fingerprint.

    Build one with :meth:`generate` (clients' secret context) and give the server
    :meth:`public` (or the bytes of :meth:`serialize` with the default ``save_secret_key=False``).
    """

    __slots__ = ("params", "_ctx", "fingerprint")

    def __init__(self, params: CKKSParams, ctx: ts.Context) -> None:
        self.params = params
        self._ctx = ctx
        self.fingerprint = _public_fingerprint(ctx)

    @classmethod
    def generate(cls, params: CKKSParams | None = None) -> CKKSContext:
        """Generate a fresh secret context (SEAL draws keys from its own CSPRNG)."""
        params = params or CKKSParams()
        ctx = ts.context(
            ts.SCHEME_TYPE.CKKS,
            poly_modulus_degree=params.poly_modulus_degree,
            coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
        )
        ctx.global_scale = 2.0**params.scale_bits
        return cls(params, ctx)

    @property
    def is_private(self) -> bool:
        """Whether this context holds the secret key (clients: yes; server: no)."""
        return bool(self._ctx.is_private())

    def public(self) -> CKKSContext:
        """A copy without the secret key (``make_context_public``): what the server gets."""
        ctx = self._ctx.copy()
        ctx.make_context_public()
        return CKKSContext(self.params, ctx)

    def serialize(self, save_secret_key: bool = False) -> bytes:
        """Serialize; the secret key is included ONLY with ``save_secret_key=True``.

        Galois and relinearisation keys are never saved: additions do not need them.
        """
        if save_secret_key and not self.is_private:
            raise NoSecretKeyError("this context holds no secret key to save (it is a public context).")
        blob = self._ctx.serialize(
            save_public_key=True,
            save_secret_key=save_secret_key,
            save_galois_keys=False,
            save_relin_keys=False,
        )
        p = self.params
        head = struct.pack(">4sIIB", b"CKC1", p.poly_modulus_degree, p.scale_bits, len(p.coeff_mod_bit_sizes))
        return head + bytes(p.coeff_mod_bit_sizes) + blob

    @classmethod
    def from_bytes(cls, data: bytes) -> CKKSContext:
        """Load a context serialized by :meth:`serialize`.

        Raises:
            CiphertextError: If the bytes are malformed or disagree with their parameter header.
        """
        if len(data) < 13 or data[:4] != b"CKC1":
            raise CiphertextError("not a serialized CKKS context (bad magic or truncated).")
        _, n, scale_bits, k = struct.unpack(">4sIIB", data[:13])
        sizes = tuple(data[13 : 13 + k])
        try:
            params = CKKSParams(n, sizes, scale_bits)
            body = bytes(data[13 + k :])
            probe_context(body, params.scale_bits)  # crafted bytes can crash TenSEAL: parse in a child first (secagg.he.isolate)
            ctx = ts.context_from(body)
        except (HEError, ValueError, RuntimeError, TypeError) as exc:
            raise CiphertextError(f"cannot load CKKS context: {exc}") from None
        ctx.global_scale = 2.0**params.scale_bits
        return cls(params, ctx)


@dataclass(frozen=True, eq=False)
class CKKSCiphertext:
    """An encrypted real vector: ``ceil(length / slots)`` TenSEAL ciphertexts plus a key binding.

    Attributes:
        fingerprint: Fingerprint of the public key it was encrypted under.
        length: Number of values.
        summands: Number of fresh uploads summed into it (1 when fresh; sets the error bound).
        chunks: The TenSEAL vectors, each of at most ``N/2`` values.
    """

    fingerprint: bytes
    length: int
    summands: int
    chunks: tuple[ts.CKKSVector, ...]

    def error_bound(self, params: CKKSParams) -> float:
        """Per-slot decryption error bound for this ciphertext's summand count."""
        return sum_error_bound(self.summands, params)

    def to_bytes(self) -> bytes:
        """Serialize (envelope header, then length-prefixed TenSEAL ciphertexts; no key material)."""
        parts = [_HEADER.pack(_MAGIC, self.fingerprint, self.length, self.summands, len(self.chunks))]
        for chunk in self.chunks:
            blob = chunk.serialize()
            parts.append(_CHUNK_LEN.pack(len(blob)) + blob)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes, context: CKKSContext, *, length: int | None = None) -> CKKSCiphertext:
        """Parse and validate an encrypted vector for ``context`` (the server's or a client's).

        Raises:
            CiphertextError: Malformed, truncated or padded bytes, or chunks that TenSEAL rejects.
            KeyMismatchError: Bound to another key.
            ShapeMismatchError: Chunk sizes disagree with the header, or another length than expected.
        """
        if len(data) < _HEADER.size:
            raise CiphertextError(f"CKKS vector truncated: {len(data)} bytes < header {_HEADER.size}.")
        magic, fp, n_values, summands, n_chunks = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise CiphertextError(f"not a CKKS vector: magic {magic!r}, expected {_MAGIC!r}.")
        if fp != context.fingerprint:
            raise KeyMismatchError(
                f"CKKS vector is bound to key {fp.hex()}, not to {context.fingerprint.hex()}."
            )
        if length is not None and n_values != length:
            raise ShapeMismatchError(f"CKKS vector has length {n_values}; expected {length}.")
        slots = context.params.slots
        if n_chunks != -(-n_values // slots) or summands < 1:
            raise CiphertextError(
                f"CKKS vector header is inconsistent: {n_chunks} chunks for length {n_values} "
                f"({slots} slots each), {summands} summands."
            )
        pos, chunks = _HEADER.size, []
        for i in range(n_chunks):
            if pos + _CHUNK_LEN.size > len(data):
                raise CiphertextError(f"CKKS vector truncated in chunk {i}.")
            (size,) = _CHUNK_LEN.unpack_from(data, pos)
            pos += _CHUNK_LEN.size
            if pos + size > len(data):
                raise CiphertextError(f"CKKS vector truncated in chunk {i}.")
            try:
                chunk = ts.ckks_vector_from(context._ctx, bytes(data[pos : pos + size]))
            except (ValueError, RuntimeError, TypeError) as exc:
                raise CiphertextError(f"CKKS chunk {i} does not parse: {exc}") from None
            want = min(slots, n_values - i * slots)
            if chunk.size() != want:
                raise ShapeMismatchError(f"CKKS chunk {i} holds {chunk.size()} values; expected {want}.")
            chunks.append(chunk)
            pos += size
        if pos != len(data):
            raise CiphertextError(f"CKKS vector has {len(data) - pos} trailing bytes (padded or spliced).")
        return cls(fp, n_values, summands, tuple(chunks))


def encrypt_vector(values: np.ndarray | Sequence[float], context: CKKSContext) -> CKKSCiphertext:
    """Encrypt a real vector (any shape is flattened, C order) under ``context``'s public key.

    Raises:
        PlaintextOverflowError: If a value is non-finite or above ``params.max_abs_value``.
    """
    arr = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)):
        raise PlaintextOverflowError("cannot encrypt non-finite values with CKKS; clip or drop them first.")
    limit = context.params.max_abs_value
    if arr.size and np.max(np.abs(arr)) > limit:
        idx = int(np.argmax(np.abs(arr)))
        raise PlaintextOverflowError(
            f"value {arr[idx]!r} at index {idx} exceeds the CKKS input bound {limit:g}; clip the values "
            "or lower scale_bits."
        )
    slots = context.params.slots
    chunks = tuple(ts.ckks_vector(context._ctx, arr[i : i + slots].tolist()) for i in range(0, arr.size, slots))
    return CKKSCiphertext(context.fingerprint, int(arr.size), 1, chunks)


def sum_vectors(vectors: Iterable[CKKSCiphertext], context: CKKSContext) -> CKKSCiphertext:
    """Homomorphically add encrypted vectors (the server's operation; a public context suffices).

    Every vector is checked before anything is added.

    Raises:
        KeyMismatchError: A vector bound to another key than ``context``'s.
        ShapeMismatchError: Different lengths.
        HEError: No vectors.
    """
    vectors = list(vectors)
    if not vectors:
        raise HEError("sum_vectors needs at least one vector.")
    for v in vectors:
        if v.fingerprint != context.fingerprint:
            raise KeyMismatchError(
                f"CKKS vector is bound to key {v.fingerprint.hex()}, not to {context.fingerprint.hex()}."
            )
        if v.length != vectors[0].length:
            raise ShapeMismatchError(
                f"cannot add encrypted vectors of lengths {vectors[0].length} and {v.length}."
            )
        if len(v.chunks) != -(-v.length // context.params.slots):
            raise ShapeMismatchError(
                f"CKKS vector of length {v.length} holds {len(v.chunks)} chunks; expected "
                f"{-(-v.length // context.params.slots)}."
            )
    if len(vectors) == 1:
        acc = list(vectors[0].chunks)
    else:
        # ``a + b`` makes fresh ciphertexts (inputs are never mutated); later sums add in place.
        # (``CKKSVector.copy`` costs ~1000x an addition, so it is avoided.)
        acc = [a + b for a, b in zip(vectors[0].chunks, vectors[1].chunks)]
        for v in vectors[2:]:
            for a, b in zip(acc, v.chunks):
                a.add_(b)
    total = sum(v.summands for v in vectors)
    return CKKSCiphertext(context.fingerprint, vectors[0].length, total, tuple(acc))


def decrypt_vector(ciphertext: CKKSCiphertext, context: CKKSContext) -> np.ndarray:
    """Decrypt with the secret context (clients only).

    Raises:
        NoSecretKeyError: ``context`` is public (the server's).
        KeyMismatchError: Bound to another key.
    """
    if not context.is_private:
        raise NoSecretKeyError(
            "this CKKS context holds no secret key (a server context cannot decrypt); decrypt on a client."
        )
    if ciphertext.fingerprint != context.fingerprint:
        raise KeyMismatchError(
            f"CKKS vector is bound to key {ciphertext.fingerprint.hex()}, not to {context.fingerprint.hex()}."
        )
    if not ciphertext.chunks:
        return np.zeros(0, dtype=np.float64)
    secret = context._ctx.secret_key()
    try:
        # Pass the key explicitly: chunks parsed under the server's (public) context stay linked to it.
        parts = [np.asarray(c.decrypt(secret), dtype=np.float64) for c in ciphertext.chunks]
    except (ValueError, RuntimeError, TypeError) as exc:
        raise CiphertextError(f"CKKS decryption failed: {exc}") from None
    out = np.concatenate(parts)
    if out.size != ciphertext.length:
        raise ShapeMismatchError(f"decrypted {out.size} values; the vector claims {ciphertext.length}.")
    return out
