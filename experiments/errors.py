"""Errors the ``secagg`` command reports to the user as one line (exit code 2), and Ctrl-C during a run."""

from __future__ import annotations

from pathlib import Path

__all__ = ["RunInterrupted", "UserError"]


class UserError(Exception):
    """An error caused by the user's input or environment; printed without a traceback."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C while a run directory was being written; ``run_dir`` is what ``--resume`` continues.

    Attributes:
        run_dir: the run directory (every completed round is in it; the checkpoint holds the last).
    """

    def __init__(self, run_dir: Path):
        super().__init__(str(run_dir))
        self.run_dir = Path(run_dir)
