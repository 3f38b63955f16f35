"""Errors the ``secagg`` command reports to the user as one line (exit code 2), and Ctrl-C during a run."""

from __future__ import annotations

from pathlib import Path

__all__ = ["RunInterrupted", "TrainingDiverged", "UserError"]


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


class TrainingDiverged(UserError):
    """A round ended with a non-finite training loss and a non-finite model: the run stopped (exit code 3).

    The run directory stays valid: the round's ledger, cost and metrics rows are written (its loss as
    ``null``), the checkpoint keeps the last round checkpointed before it, and ``summary.json`` says
    why the run stopped (``stopped``, ``diverged``).

    Attributes:
        run_dir: the run directory.
        round: the 1-based round whose loss was not finite.
        checkpoint_round: the round the checkpoint holds (0: none).
    """

    def __init__(self, message: str, run_dir: Path, round: int, checkpoint_round: int):
        super().__init__(message)
        self.run_dir, self.round, self.checkpoint_round = Path(run_dir), round, checkpoint_round
