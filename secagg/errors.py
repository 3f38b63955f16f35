"""Typed errors of the secure-aggregation layer.

Every failure a caller can act on has its own class; all derive from :class:`SecAggError`.
A failed authenticated decryption always raises the same opaque :class:`AuthenticationError`
(no hint whether the key, the nonce, the associated data or the ciphertext was wrong).
"""

from __future__ import annotations

__all__ = ["AbortError", "AuthenticationError", "BudgetError", "MessageError", "SecAggError"]


class SecAggError(Exception):
    """Base class of every error raised by :mod:`secagg`."""


class AuthenticationError(SecAggError):
    """An AEAD ciphertext or a signature failed verification (deliberately opaque)."""


class MessageError(SecAggError):
    """A malformed, replayed, truncated, wrong-round, wrong-stage or wrong-length message.

    The message names the stage and the reason, e.g.
    ``"stage MASKED_INPUT: replayed message from client 3 (already received)"``.
    The receiving party's state is unchanged when this is raised.
    """


class BudgetError(SecAggError, ValueError):
    """A bit budget is exceeded or a value lies out of the configured range; names the fix."""


class AbortError(SecAggError):
    """A clean protocol abort (e.g. fewer than ``t`` survivors); names the stage and the counts.

    After an abort no result is produced, and no party has revealed more than the protocol
    allows at the stage where it stopped.
    """
