"""Homomorphic-encryption backends: Paillier with plaintext packing (gmpy2) and CKKS (TenSEAL).

Key model of both (FedMF's): every client holds the same secret key; the server holds only public
(and, for CKKS, evaluation) keys, adds ciphertexts, and cannot decrypt. Any client can decrypt any
other client's upload: this is the shared-key weakness, documented in ``docs/he.md``.

``secagg.he.ckks`` imports TenSEAL and is therefore not imported here; import it explicitly
(:func:`make_backend` imports it on demand for ``scheme="ckks"``).
"""

from secagg.he.backends import HEClient, HEServer, make_backend
from secagg.he.errors import (
    CiphertextError,
    HEError,
    InsecureKeySizeWarning,
    KeyMismatchError,
    NoSecretKeyError,
    PlaintextOverflowError,
    ShapeMismatchError,
)
from secagg.he.packing import PackedCiphertext, PackingSpec, decrypt_packed, encrypt_packed, sum_packed
from secagg.he.paillier import (
    DEFAULT_KEY_BITS,
    MIN_KEY_BITS,
    ObfuscatorPool,
    PaillierCiphertext,
    PaillierKeyPair,
    PaillierPrivateKey,
    PaillierPublicKey,
    generate_keypair,
)

__all__ = [
    "DEFAULT_KEY_BITS",
    "MIN_KEY_BITS",
    "CiphertextError",
    "HEClient",
    "HEError",
    "HEServer",
    "InsecureKeySizeWarning",
    "KeyMismatchError",
    "NoSecretKeyError",
    "ObfuscatorPool",
    "PackedCiphertext",
    "PackingSpec",
    "PaillierCiphertext",
    "PaillierKeyPair",
    "PaillierPrivateKey",
    "PaillierPublicKey",
    "PlaintextOverflowError",
    "ShapeMismatchError",
    "decrypt_packed",
    "encrypt_packed",
    "generate_keypair",
    "make_backend",
    "sum_packed",
]
