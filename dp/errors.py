"""Typed errors of the ``dp`` package (only where a caller can act on them)."""

from __future__ import annotations

__all__ = ["BudgetExceededError", "LedgerError", "NonFiniteInputError", "UnsupportedEventError"]


class UnsupportedEventError(ValueError):
    """An accountant cannot interpret an event (raised before any state changes)."""


class BudgetExceededError(RuntimeError):
    """A round would push the spent privacy budget past the configured budget.

    Attributes:
        epsilon_after: the epsilon the ledger would report after the round.
        budget: the configured ``(epsilon, delta)``.
    """

    def __init__(self, message: str, *, epsilon_after: float, budget: tuple[float, float]) -> None:
        super().__init__(message)
        self.epsilon_after = epsilon_after
        self.budget = budget


class LedgerError(RuntimeError):
    """The privacy ledger was used out of order or its file is not a ledger."""


class NonFiniteInputError(ValueError):
    """A mechanism was given NaN or infinity (clipping and noise need finite values). In a training
    run it means the model diverged before the release: the run loop stops the run on it."""
