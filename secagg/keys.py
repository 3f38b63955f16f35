"""Key agreement: X25519 (RFC 7748) followed by HKDF-SHA256 (RFC 5869).

``KeyPair.agree(peer, info=...)`` returns a 32-byte key
``HKDF-SHA256(ikm = X25519(sk, peer), salt = None, info = b"secagg/ka/v1" || info)``. Both
parties must pass the same ``info`` (bind the protocol instance, the round and the purpose into it).
A peer key that yields the all-zero shared secret (a low-order point) is refused.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from secagg.errors import MessageError
from secagg import simshare

__all__ = ["KEY_BYTES", "KeyPair", "hkdf_sha256"]

KEY_BYTES = 32
_KA_DOMAIN = b"secagg/ka/v1"


def hkdf_sha256(ikm: bytes, *, info: bytes, salt: bytes | None = None, length: int = KEY_BYTES) -> bytes:
    """HKDF-SHA256 (RFC 5869) of ``ikm``: extract with ``salt`` then expand with ``info``.

    Written over :func:`hmac.digest` (OpenSSL's HMAC-SHA256 in C): the server runs one per
    dropped-survivor pair, and this is several times faster than building a ``cryptography`` HKDF
    object each time. Checked against RFC 5869 and against ``cryptography``'s HKDF in the tests.
    """
    if not 0 < length <= 255 * 32:
        raise ValueError(f"HKDF-SHA256 output length must be in [1, 8160]; found {length}.")
    prk = hmac.digest(salt if salt else bytes(32), ikm, "sha256")
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.digest(prk, block + info + bytes([counter]), "sha256")
        out += block
        counter += 1
    return out[:length]


@dataclass(frozen=True, eq=False)
class KeyPair:
    """An X25519 key pair.

    Attributes:
        private: the ``cryptography`` private key object (never serialised by default).
        public_bytes: the 32-byte raw public key.
    """

    private: X25519PrivateKey
    public_bytes: bytes

    def __repr__(self) -> str:
        return f"KeyPair(public={self.public_bytes.hex()[:16]}...)"

    @classmethod
    def generate(cls) -> KeyPair:
        """A fresh key pair from the OS CSPRNG."""
        return cls._from_private(X25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> KeyPair:
        """Rebuild a key pair from its 32 raw private bytes (known-answer tests, Shamir recovery)."""
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != KEY_BYTES:
            raise ValueError(f"an X25519 private key is {KEY_BYTES} bytes; found {len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__}.")
        return cls._from_private(X25519PrivateKey.from_private_bytes(bytes(raw)))

    @classmethod
    def _from_private(cls, sk: X25519PrivateKey) -> KeyPair:
        return cls(sk, sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    def private_bytes(self) -> bytes:
        """The 32 raw private bytes (hazardous: only for secret sharing the key)."""
        return self.private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def exchange(self, peer_public: bytes) -> bytes:
        """The raw X25519 shared secret with ``peer_public`` (use :meth:`agree` instead)."""
        if not isinstance(peer_public, (bytes, bytearray)) or len(peer_public) != KEY_BYTES:
            raise MessageError(
                f"key agreement: a public key is {KEY_BYTES} bytes; found "
                f"{len(peer_public) if isinstance(peer_public, (bytes, bytearray)) else type(peer_public).__name__}."
            )
        try:
            return self.private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
        except ValueError as exc:  # all-zero shared secret: low-order point
            raise MessageError("key agreement: peer public key is a low-order point; refused.") from exc

    def agree(self, peer_public: bytes, *, info: bytes, shared: bool = True) -> bytes:
        """A 32-byte symmetric key shared with the owner of ``peer_public``.

        Inside :func:`secagg.simshare.shared_work` (simulations only) the pair's key is computed once
        for both ends; ``shared=False`` always computes it (the server's own agreements)."""
        memo = simshare.active() if shared else None
        if memo is None or not isinstance(peer_public, (bytes, bytearray)) or len(peer_public) != KEY_BYTES:
            return hkdf_sha256(self.exchange(peer_public), info=_KA_DOMAIN + info)
        return memo.agree(self.public_bytes, peer_public, info,
                          lambda: hkdf_sha256(self.exchange(peer_public), info=_KA_DOMAIN + info))
