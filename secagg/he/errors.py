"""Typed errors of the homomorphic-encryption backends.

All derive from :class:`secagg.errors.SecAggError`; those a protocol treats as a bad message also
derive from :class:`secagg.errors.MessageError`, and plaintext range failures from
:class:`secagg.errors.BudgetError` (a ``ValueError``).
"""

from __future__ import annotations

from secagg.errors import BudgetError, MessageError, SecAggError

__all__ = [
    "CiphertextError",
    "HEError",
    "InsecureKeySizeWarning",
    "KeyMismatchError",
    "NoSecretKeyError",
    "PlaintextOverflowError",
    "ShapeMismatchError",
]


class HEError(SecAggError):
    """Base class of every error raised by :mod:`secagg.he` (also bad parameters)."""


class KeyMismatchError(HEError, MessageError):
    """A ciphertext is bound to another key than the one used to add, decrypt or parse it."""


class CiphertextError(HEError, MessageError):
    """A ciphertext is malformed, truncated, out of range or detectably tampered with."""


class ShapeMismatchError(HEError, MessageError):
    """Encrypted vectors of different lengths or packing layouts were combined or parsed."""


class PlaintextOverflowError(HEError, BudgetError):
    """A value does not fit its plaintext slot, or a sum would exceed the declared headroom.

    Raised BEFORE encryption or addition, so an overflowing value is never folded into a sum.
    """


class NoSecretKeyError(HEError):
    """Decryption was attempted with a context or key that holds no secret key (the server's)."""


class InsecureKeySizeWarning(UserWarning):
    """A key below the recommended size was generated (allowed only to reproduce a paper)."""
