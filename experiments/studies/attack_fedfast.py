"""``secagg attack fedfast``: a FedFast run under a defense, attacked from its directory (``I_k``).

``secagg attack fedfast --defense none|secagg [--data PATH] [--rounds N] [--clients-per-round M]
[--clusters P] [--dim D] [--out DIR] [--json]``

A thin wrapper (:mod:`experiments.studies.attack_wrap`): ``secagg run`` of the ``fedfast`` preset under
the attack matrix's cell for the defense (``none``; ``secagg`` is the matrix's ``secagg+`` cell,
``[fedfast] secure_aggregation = "secagg+"``), with ``--rounds`` -> ``[run] rounds``,
``--clients-per-round`` -> ``[fedfast] clients_per_round``, ``--clusters`` -> ``clusters``, ``--dim`` ->
``dim``, ``--users``/``--items`` -> the synthetic generator's size (default 100 x 200), views
recorded; then ``secagg attack RUN_DIR``. ``--json`` prints one object (last line of stdout):
``findings`` (the common schema of docs/attacks.md), ``attack`` = the ``fedfast-ik`` finding (its
``extra`` holds ``changed_set_f1``, the F1 of guessing all of ``I_k``, on plaintext views),
``run_dir``, ``skipped``. On ``secagg`` the finding sits exactly at the stronger baseline (advantage 0).

The earlier command's ``magnitude_f1`` (the same attack ranking rows by ``|delta|``) is not a
registered finding and is no longer printed; :func:`attacks.fedfast.ik_attack` with
``method="magnitude"`` still computes it (docs/fedfast.md quotes it).
"""

from __future__ import annotations

import argparse
from typing import Any

from experiments import jsonio
from experiments.errors import UserError
from experiments.studies.attack_wrap import add_run_arguments, print_result, run_and_attack

__all__ = ["CELL", "register", "run_attack"]

#: --defense -> the attack matrix's FedFast cell (experiments.studies.attack_matrix.CELLS).
CELL = {"none": "none", "secagg": "secagg+"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg attack fedfast``."""
    p = subparsers.add_parser(
        "fedfast",
        help="interaction inference from the changed item rows I_k against FedFast",
        description="Run FedFast (plaintext or through SecAgg+) with its views recorded, then attack the run "
        "directory as 'secagg attack RUN_DIR' does: each sampled client's training positives inferred from "
        "the server's view of its changed item rows, scored beside a random and a public guess.",
    )
    p.add_argument("--defense", choices=tuple(CELL), default="none",
                   help="none: plaintext FedFast; secagg: [fedfast] secure_aggregation = secagg+")
    add_run_arguments(p, users=100, items=200)
    p.add_argument("--rounds", type=int, default=3, help="[run] rounds, every one attacked (default 3)")
    p.add_argument("--clients-per-round", type=int, default=20,
                   help="[fedfast] clients_per_round: delegates per round (default 20)")
    p.add_argument("--clusters", type=int, default=5, help="[fedfast] clusters: k-means clusters p (default 5)")
    p.add_argument("--dim", type=int, default=10, help="[fedfast] dim: embedding size (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def run_attack(args: argparse.Namespace) -> dict[str, Any]:
    """Run FedFast for ``args.rounds`` rounds under ``args.defense`` and attack every recorded round."""
    if args.clients_per_round < 1:
        raise UserError(f"--clients-per-round must be >= 1; found {args.clients_per_round}.")
    over = {"clients_per_round": args.clients_per_round, "clusters": args.clusters, "dim": args.dim}
    return run_and_attack(args, paper="fedfast", protocol="fedfast", cell=CELL[args.defense], attack="fedfast-ik",
                          overrides=over, items_per_interaction=8, min_users=4, min_items=10)


def _main(args: argparse.Namespace) -> int:
    out = run_attack(args)
    print_result(out, f"FedFast / {out['defense']}")
    if args.json:
        print(jsonio.dumps(out))
    return 0
