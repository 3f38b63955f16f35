"""The ``secagg`` console command.

Sub-command groups live in ``experiments/cli/cmd_<name>.py`` modules, each exposing
``register(subparsers)``; they are listed explicitly in :data:`COMMAND_MODULES` (no
import-time discovery). Conventions shared by every command:

* ``--json`` prints exactly one JSON object as the last line of stdout;
* progress bars and logs go to stderr;
* user errors (:class:`experiments.errors.UserError`, or ``ValueError``/``FileNotFoundError`` from a
  lower layer reporting bad input, or :class:`dp.errors.LedgerError` for a damaged or edited
  ``privacy_ledger.sqlite``) print one clear line on stderr and exit 2, without a
  traceback (``SECAGG_DEBUG=1`` re-raises them with the traceback); a run whose training
  diverged (:class:`experiments.errors.TrainingDiverged`) prints one line and exits 3;
* ``--plugin MODULE`` (before or after the sub-command, repeatable) imports a module that registers
  protocols or attacks before the command runs; installed packages register theirs through entry
  points (docs/plugins.md).

Help and user errors answer at once: building the parser imports no protocol, torch or scipy (each
command module imports what it runs inside the function that runs it; a test checks
``sys.modules`` after ``secagg --help``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from experiments.errors import TrainingDiverged, UserError

__all__ = ["COMMAND_MODULES", "UserError", "build_parser", "main"]

#: Modules under ``experiments.cli`` that register sub-commands, in help order.
COMMAND_MODULES: tuple[str, ...] = (
    "cmd_run",
    "cmd_data",
    "cmd_bench",
    "cmd_privacy",
    "cmd_attack",
    "cmd_audit",
    "cmd_compare",
    "cmd_reproduce",
    "cmd_flower",  # imports flwr only when a `secagg flower` sub-command runs
)


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered sub-command."""
    parser = argparse.ArgumentParser(
        prog="secagg",
        description="Privacy-preserving federated recommendation: secure aggregation, "
        "differential privacy, homomorphic encryption, and the attacks that check them.",
    )
    parser.add_argument("--plugin", action="append", default=None, metavar="MODULE", dest="plugins_first",
                        help="import MODULE before the command: it registers protocols or attacks (repeatable; "
                        "also accepted after the command; docs/plugins.md)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"experiments.cli.{name}")
        module.register(sub)
    return parser


def _loaded(module: str, name: str) -> tuple[type, ...]:
    """``(module.name,)`` if ``module`` is imported already, else ``()``: an exception class of a module
    nobody imported cannot have been raised, so the handlers below need not import it (dp.errors and
    protocols.secure_sum pull in scipy)."""
    mod = sys.modules.get(module)
    return (getattr(mod, name),) if mod is not None else ()


def _import_plugins(args: argparse.Namespace) -> None:
    """Import every ``--plugin`` module (given before or after the sub-command), in order."""
    modules = list(dict.fromkeys([*(getattr(args, "plugins_first", None) or ()), *(getattr(args, "plugins", None) or ())]))
    args.plugins = modules
    if modules:
        from protocols.registry import import_plugin

        for module in modules:
            import_plugin(module)


def _resume_hint(args: argparse.Namespace, run_dir: object) -> str:
    if getattr(args, "command", None) == "flower":
        return f"secagg flower simulate --resume {run_dir}"
    return f"secagg run --resume {run_dir}"


def _attack_run_dir_alias(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``secagg attack RUN_DIR ...`` is ``secagg attack run-dir RUN_DIR ...``: after ``attack``, a first
    argument that is no attack target and no option names a run directory."""
    i = 0
    while i < len(argv) and argv[i].startswith("--plugin"):
        i += 1 if "=" in argv[i] else 2
    if i + 1 >= len(argv) or argv[i] != "attack" or argv[i + 1].startswith("-"):
        return argv
    targets: set[str] = set()
    for action in parser._subparsers._group_actions if parser._subparsers else ():  # the top-level commands
        attack = getattr(action, "choices", {}).get("attack")
        for sub in getattr(attack, "_subparsers", None)._group_actions if attack and attack._subparsers else ():
            targets |= set(getattr(sub, "choices", None) or ())
    if argv[i + 1] in targets:
        return argv
    return argv[: i + 1] + ["run-dir"] + argv[i + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``secagg`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        # No sub-command: the main job (fedavg-gmf on the embedded synthetic data).
        argv = ["run"]
    args = parser.parse_args(_attack_run_dir_alias(parser, argv))
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        _import_plugins(args)
        return int(func(args) or 0)
    except TrainingDiverged as exc:  # the run directory is valid; a distinct code for scripts
        if os.environ.get("SECAGG_DEBUG"):
            raise
        print(f"secagg: error: {exc}", file=sys.stderr)
        return 3
    except (UserError, ValueError, FileNotFoundError, *_loaded("dp.errors", "LedgerError")) as exc:
        if os.environ.get("SECAGG_DEBUG"):
            raise  # a developer asked for the traceback
        print(f"secagg: error: {exc}", file=sys.stderr)
        return 2
    except _loaded("protocols.secure_sum", "SecureSumAborted") as exc:  # a secure sum produced nothing
        if os.environ.get("SECAGG_DEBUG"):
            raise
        print(f"secagg: error: {exc}. No sum was released; the run directory keeps every completed round "
              "(--resume continues). If the clients refused, check [clients] min_survivors against the "
              "clients per round.", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        run_dir = getattr(exc, "run_dir", None)
        if run_dir is not None:
            print(f"secagg: interrupted; {run_dir} keeps every completed round: continue with "
                  f"{_resume_hint(args, run_dir)}", file=sys.stderr)
        else:
            print("secagg: interrupted", file=sys.stderr)
        return 130

