"""One byte-level interface over both HE backends, for protocols that choose the defense by config.

Parties: :class:`HEClient` (holds the shared secret key: encrypts uploads, decrypts sums) and
:class:`HEServer` (built from the PUBLIC serialisation only: it validates and adds ciphertexts and
has no way to decrypt). Everything that crosses the client-server boundary is ``bytes``, so a
transport can record it as the receiver saw it.

Adversary and promise: those of :mod:`secagg.he.paillier` / :mod:`secagg.he.packing` (exact sums on
a fixed-point grid) and :mod:`secagg.he.ckks` (approximate sums within
:func:`secagg.he.ckks.sum_error_bound`). The server learns lengths and counts only.

Bad input: :meth:`HEServer.add` parses and validates EVERY upload (key binding, layout, length,
value ranges) before adding any, so one malformed, foreign-key, truncated or wrong-length upload
raises a typed :class:`~secagg.errors.SecAggError` and never reaches the sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from secagg.he.errors import HEError
from secagg.he.packing import PackedCiphertext, PackingSpec, decrypt_packed, encrypt_packed, sum_packed
from secagg.he.paillier import DEFAULT_KEY_BITS, PaillierPrivateKey, PaillierPublicKey, generate_keypair

__all__ = ["HEClient", "HEServer", "make_backend"]

Scheme = Literal["paillier", "ckks"]


@dataclass(frozen=True, eq=False)
class HEServer:
    """The server's side: public material only; validates and adds encrypted uploads."""

    scheme: Scheme
    public_bytes: bytes = field(repr=False)

    def encrypt(self, values: np.ndarray | Sequence[float]) -> bytes:
        """Encrypt a real vector (flattened) with the PUBLIC key only (no way to decrypt it back).

        Paillier takes the public-key path of :func:`encrypt_packed` (about 4x slower than a key
        holder's CRT path); CKKS encrypts under the public context.
        """
        if self.scheme == "paillier":
            pk, spec = _paillier_public(self.public_bytes)
            return encrypt_packed(values, pk, spec).to_bytes(pk)
        from secagg.he.ckks import encrypt_vector

        return encrypt_vector(values, _ckks_context(self.public_bytes)).to_bytes()

    def add(self, uploads: Sequence[bytes], length: int) -> bytes:
        """Validate every upload, then return the encrypted sum.

        Args:
            uploads: Serialized encrypted vectors (at least one).
            length: The number of values each upload must hold.

        Raises:
            KeyMismatchError, CiphertextError, ShapeMismatchError, PlaintextOverflowError, HEError:
                On the first bad upload (nothing is added).
        """
        if not uploads:
            raise HEError("HEServer.add needs at least one upload.")
        if self.scheme == "paillier":
            pk, spec = _paillier_public(self.public_bytes)
            parsed = [PackedCiphertext.from_bytes(u, pk, spec=spec, length=length) for u in uploads]
            return sum_packed(parsed, pk).to_bytes(pk)
        from secagg.he.ckks import CKKSCiphertext, sum_vectors

        ctx = _ckks_context(self.public_bytes)
        parsed_c = [CKKSCiphertext.from_bytes(u, ctx, length=length) for u in uploads]
        return sum_vectors(parsed_c, ctx).to_bytes()


@dataclass(frozen=True, eq=False)
class HEClient:
    """A client's side: holds the shared secret key (FedMF's model)."""

    scheme: Scheme
    secret_bytes: bytes = field(repr=False)
    public_bytes: bytes = field(repr=False)

    def encrypt(self, values: np.ndarray | Sequence[float]) -> bytes:
        """Encrypt a real vector (flattened) and serialize it for the server."""
        if self.scheme == "paillier":
            sk, spec = _paillier_secret(self.secret_bytes, self.public_bytes)
            return encrypt_packed(values, sk, spec).to_bytes(sk.public_key)
        from secagg.he.ckks import encrypt_vector

        return encrypt_vector(values, _ckks_context(self.secret_bytes)).to_bytes()

    def decrypt(self, blob: bytes, length: int) -> np.ndarray:
        """Parse, validate and decrypt an encrypted vector (a single upload or a sum)."""
        if self.scheme == "paillier":
            sk, spec = _paillier_secret(self.secret_bytes, self.public_bytes)
            ct = PackedCiphertext.from_bytes(blob, sk.public_key, spec=spec, length=length)
            return decrypt_packed(ct, sk)
        from secagg.he.ckks import CKKSCiphertext, decrypt_vector

        ctx = _ckks_context(self.secret_bytes)
        return decrypt_vector(CKKSCiphertext.from_bytes(blob, ctx, length=length), ctx)

    def server(self) -> HEServer:
        """The server's side, built from the public serialisation only."""
        return HEServer(self.scheme, self.public_bytes)


# -- (de)serialisation of the key material, cached so that repeated calls stay cheap ---------------

_SPEC_BYTES = 12


def _spec_to_bytes(spec: PackingSpec) -> bytes:
    return (
        spec.value_bits.to_bytes(2, "big")
        + spec.frac_bits.to_bytes(2, "big")
        + spec.max_summands.to_bytes(6, "big")
        + spec.guard_bits.to_bytes(2, "big")
    )


def _spec_from_bytes(data: bytes) -> PackingSpec:
    return PackingSpec(
        int.from_bytes(data[0:2], "big"),
        int.from_bytes(data[2:4], "big"),
        int.from_bytes(data[4:10], "big"),
        int.from_bytes(data[10:12], "big"),
    )


_CACHE: dict[tuple[str, bytes], object] = {}


def _cached(kind: str, data: bytes, build):  # type: ignore[no-untyped-def]
    key = (kind, data)
    if key not in _CACHE:
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[key] = build()
    return _CACHE[key]


def _paillier_public(public_bytes: bytes) -> tuple[PaillierPublicKey, PackingSpec]:
    def build() -> tuple[PaillierPublicKey, PackingSpec]:
        return PaillierPublicKey.from_bytes(public_bytes[_SPEC_BYTES:]), _spec_from_bytes(public_bytes)

    return _cached("paillier-public", public_bytes, build)  # type: ignore[return-value]


def _paillier_secret(secret_bytes: bytes, public_bytes: bytes) -> tuple[PaillierPrivateKey, PackingSpec]:
    def build() -> tuple[PaillierPrivateKey, PackingSpec]:
        sk = PaillierPrivateKey.from_secret_bytes(secret_bytes)
        pk, spec = _paillier_public(public_bytes)
        if sk.public_key != pk:
            raise HEError("client secret key does not match the public key it was given.")
        return sk, spec

    return _cached("paillier-secret", secret_bytes + public_bytes, build)  # type: ignore[return-value]


def _ckks_context(data: bytes):  # type: ignore[no-untyped-def]
    from secagg.he.ckks import CKKSContext

    return _cached("ckks", data, lambda: CKKSContext.from_bytes(data))


def make_backend(
    scheme: Scheme,
    *,
    key_bits: int = DEFAULT_KEY_BITS,
    spec: PackingSpec | None = None,
    ckks_params: object | None = None,
) -> HEClient:
    """Generate fresh shared key material and return the clients' side (``.server()`` for the server).

    Args:
        scheme: ``"paillier"`` (packed, exact on the fixed-point grid) or ``"ckks"`` (approximate).
        key_bits: Paillier modulus bits (1024 warns; see :func:`generate_keypair`).
        spec: Paillier packing layout (default :class:`PackingSpec()`).
        ckks_params: A :class:`secagg.he.ckks.CKKSParams` (defaults if ``None``).

    Raises:
        HEError: Unknown scheme or invalid parameters.
    """
    if scheme == "paillier":
        spec = spec or PackingSpec()
        kp = generate_keypair(key_bits)  # warns (InsecureKeySizeWarning) below 2048 bits
        spec.slots_for(kp.public_key)
        public = _spec_to_bytes(spec) + kp.serialize()
        return HEClient("paillier", kp.serialize(save_secret_key=True), public)
    if scheme == "ckks":
        from secagg.he.ckks import CKKSContext

        ctx = CKKSContext.generate(ckks_params)  # type: ignore[arg-type]
        return HEClient("ckks", ctx.serialize(save_secret_key=True), ctx.serialize())
    raise HEError(f"unknown HE scheme {scheme!r}; choose 'paillier' or 'ckks'.")
