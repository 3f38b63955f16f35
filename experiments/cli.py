"""The ``secagg`` console command.

Sub-command groups live in ``experiments/cmd_<name>.py`` modules, each exposing
``register(subparsers)``; they are listed explicitly in :data:`COMMAND_MODULES` (no
import-time discovery). Conventions shared by every command:

* ``--json`` prints exactly one JSON object as the last line of stdout;
* progress bars and logs go to stderr;
* user errors (:class:`experiments.errors.UserError`, or ``ValueError``/``FileNotFoundError`` from a
  lower layer reporting bad input, or :class:`dp.errors.LedgerError` for a damaged or edited
  ``privacy_ledger.sqlite``) print one clear line on stderr and exit 2, without a
  traceback (``SECAGG_DEBUG=1`` re-raises them with the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from dp.errors import LedgerError
from experiments.errors import UserError
from protocols.secure_sum import SecureSumAborted

__all__ = ["COMMAND_MODULES", "UserError", "build_parser", "main"]

#: Modules under ``experiments`` that register sub-commands, in help order.
COMMAND_MODULES: tuple[str, ...] = (
    "cmd_run",
    "cmd_data",
    "cmd_bench",
    "cmd_privacy",
    "cmd_attack",
    "cmd_compare",
    "cmd_flower",  # imports flwr only when a `secagg flower` sub-command runs
)


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered sub-command."""
    parser = argparse.ArgumentParser(
        prog="secagg",
        description="Privacy-preserving federated recommendation: secure aggregation, "
        "differential privacy, homomorphic encryption, and the attacks that check them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"experiments.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``secagg`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        # No sub-command: the main job (fedavg-gmf on the embedded synthetic data).
        argv = ["run"]
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except (UserError, ValueError, FileNotFoundError, LedgerError) as exc:
        if os.environ.get("SECAGG_DEBUG"):
            raise  # a developer asked for the traceback
        print(f"secagg: error: {exc}", file=sys.stderr)
        return 2
    except SecureSumAborted as exc:  # a round's secure sum produced nothing (dropouts, the clients' own minimum)
        if os.environ.get("SECAGG_DEBUG"):
            raise
        print(f"secagg: error: {exc}. No sum was released; the run directory keeps every completed round "
              "(--resume continues). If the clients refused, check [clients] min_survivors against the "
              "clients per round.", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("secagg: interrupted; resume with --resume RUN_DIR", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
