"""Authenticated encryption for relayed messages: AES-256-GCM with a random 96-bit nonce.

A sealed blob is ``nonce (12 bytes) || ciphertext || tag (16 bytes)``; it is exactly
``len(plaintext) + OVERHEAD`` bytes. The associated data binds the protocol instance, the round,
the sender, the receiver and the kind of message, so a blob replayed into another round, another
instance, to another receiver or as another kind fails to open. Every failure to open raises the
same opaque :class:`~secagg.errors.AuthenticationError`.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from secagg.errors import AuthenticationError

__all__ = ["NONCE_BYTES", "OVERHEAD", "TAG_BYTES", "associated_data", "open_sealed", "seal"]

NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES
_AAD_MAGIC = b"secagg/aad/v1"


def associated_data(*, instance: bytes, round: int, sender: int, receiver: int, kind: str) -> bytes:  # noqa: A002
    """Canonical, injective encoding of the context a ciphertext is bound to."""
    kind_b = kind.encode("utf-8")
    if len(instance) > 255 or len(kind_b) > 255:
        raise ValueError(f"instance and kind must be at most 255 bytes; found {len(instance)}, {len(kind_b)}.")
    for name, val in (("round", round), ("sender", sender), ("receiver", receiver)):
        if type(val) is not int or not 0 <= val < 2**32:
            raise ValueError(f"{name} must be an int in [0, 2^32); found {val!r}.")
    return (
        _AAD_MAGIC
        + bytes([len(instance)]) + bytes(instance)
        + struct.pack(">III", round, sender, receiver)
        + bytes([len(kind_b)]) + kind_b
    )


def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
        raise ValueError(f"an AES-256-GCM key is 32 bytes; found {len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__}.")


def _buffer(data: bytes | memoryview) -> bytes | memoryview:
    """``data`` as AES-GCM input without copying it when it already is bytes or a contiguous view.

    The chain authenticates a whole ``8 * dim``-byte upload as associated data: ``bytes(view)``
    would allocate and copy it once more per seal/open.
    """
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.c_contiguous and data.format == "B"):
        return data
    return bytes(data)


def seal(key: bytes, plaintext: bytes, *, aad: bytes) -> bytes:
    """Encrypt and authenticate ``plaintext`` under ``key`` with a fresh random nonce."""
    return _seal_with_nonce(key, os.urandom(NONCE_BYTES), plaintext, aad=aad)


def _seal_with_nonce(key: bytes, nonce: bytes, plaintext: bytes, *, aad: bytes) -> bytes:
    """Known-answer core of :func:`seal` (explicit nonce; never reuse a nonce under one key)."""
    _check_key(key)
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes; found {len(nonce)}.")
    return bytes(nonce) + AESGCM(bytes(key)).encrypt(bytes(nonce), bytes(plaintext), _buffer(aad))


def open_sealed(key: bytes, blob: bytes, *, aad: bytes) -> bytes:
    """Decrypt a blob from :func:`seal`.

    Raises:
        AuthenticationError: wrong key, wrong associated data, truncated or tampered blob.
    """
    _check_key(key)
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < OVERHEAD:
        raise AuthenticationError("authenticated decryption failed")
    try:
        return AESGCM(bytes(key)).decrypt(bytes(blob[:NONCE_BYTES]), bytes(blob[NONCE_BYTES:]), _buffer(aad))
    except InvalidTag:
        raise AuthenticationError("authenticated decryption failed") from None
