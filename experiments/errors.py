"""Errors the ``secagg`` command reports to the user as one line (exit code 2)."""

__all__ = ["UserError"]


class UserError(Exception):
    """An error caused by the user's input or environment; printed without a traceback."""
