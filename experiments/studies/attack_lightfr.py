"""``secagg attack lightfr``: a one-round LightFR run under a defense, attacked from its directory.

``secagg attack lightfr --defense none|para|secagg|dpf [--data PATH] [--bits F] [--fraction P]
[--out DIR] [--json]``

A thin wrapper (:mod:`experiments.studies.attack_wrap`): ``secagg run`` of one round of the attack
matrix's LightFR cell for the defense, views recorded, then ``secagg attack RUN_DIR``. ``none``: the
``lightfr-grad`` preset (the paper's plaintext Agg_grad upload, the matrix's ``none`` cell); ``para``: the
same with ``[lightfr] server = "para"`` (plaintext sign-vote codes); ``secagg``: the matrix's ``secagg+``
cell (Agg_grad uploads through SecAgg+); ``dpf``: its ``dpf`` cell (the ``lightfr-dpf`` preset: rows
summed by two non-colluding servers, the first server's view attacked). ``--bits`` -> ``[lightfr]
bits``, ``--fraction`` -> ``client_fraction``, ``--users``/``--items`` -> the synthetic generator's
size (default 100 x 200). One round: the attack reads one upload per client (notes section 1.3).

``--json`` prints one object (last line of stdout): ``findings`` in the common schema (rated items,
F1; ratings, RMSE, whose ``extra`` holds ``exact_match_up_to_reflection``), ``attack`` = the rated-items
finding, whose ``extra`` adds ``code_agreement`` and ``random_code_agreement``: the fraction of code
bits the attack recovers up to sign, scored against the run's checkpointed user codes (private
state read for scoring only, as the training data is; ``null`` when nothing was inverted).
On ``secagg`` and ``dpf`` the findings sit exactly at the stronger baseline (advantage 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError
from experiments.studies.attack_wrap import add_run_arguments, print_result, run_and_attack

__all__ = ["DEFENSES", "register", "run_attack"]

#: --defense -> (the attack matrix's LightFR cell, further [lightfr] keys).
DEFENSES: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}), "para": ("none", {"server": "para"}), "secagg": ("secagg+", {}), "dpf": ("dpf", {})}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lightfr",
        help="one-upload rating leak against LightFR under a defense",
        description="Run LightFR for one round with its views recorded, then attack the run directory as "
        "'secagg attack RUN_DIR' does: invert the uploads the server received (notes section 1.3), score "
        "rated set and ratings beside a random and a public guess, and the code bits against the run's codes.",
    )
    p.add_argument("--defense", choices=tuple(DEFENSES), default="none",
                   help="none: Agg_grad; para: [lightfr] server = para; secagg: secure_aggregation = secagg+; "
                   "dpf: the lightfr-dpf preset")
    add_run_arguments(p, users=100, items=200)
    p.add_argument("--bits", type=int, default=64, help="[lightfr] bits: code length f (default 64)")
    p.add_argument("--fraction", type=float, default=0.6,
                   help="[lightfr] client_fraction: clients per round p (default 0.6)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def _code_agreement(run_dir: Path, seed: int) -> dict[str, float | None]:
    """Code bits recovered up to sign (and a random code's), against the run's checkpointed codes."""
    import numpy as np

    from attacks.lightfr import code_agreement, one_upload_attack
    from experiments.run.rundir import RunDir
    from experiments.run.views import load_views

    views = load_views(run_dir)
    with np.errstate(all="ignore"):
        _, codes = one_upload_attack(views.view("server"), views.last_public(), round=views.rounds[0])
    state = RunDir.open_existing(run_dir).load_checkpoint() or {}
    b = np.asarray(state["trainer"]["b"]) if "trainer" in state else None
    if b is None or not codes:
        return {"code_agreement": None, "random_code_agreement": None}
    rng = np.random.default_rng([seed, 99])
    rand = {u: np.where(rng.random(b.shape[1]) < 0.5, -1.0, 1.0) for u in codes}
    return {"code_agreement": code_agreement(codes, b), "random_code_agreement": code_agreement(rand, b)}


def run_attack(args: argparse.Namespace) -> dict[str, Any]:
    """One round under ``args.defense``, attacked from its run directory; a JSON-ready dict."""
    if not 1 <= args.bits <= 4096:
        raise UserError(f"--bits must be in 1..4096; found {args.bits}.")
    if not 0 < args.fraction <= 1:
        raise UserError(f"--fraction must be in (0, 1]; found {args.fraction}.")
    cell, keys = DEFENSES[args.defense]
    args.rounds = 1
    out = run_and_attack(args, paper="lightfr", protocol="lightfr", cell=cell, attack="lightfr-one-upload",
                         overrides={**keys, "bits": args.bits, "client_fraction": args.fraction})
    if out["attack"] is not None:
        out["attack"]["extra"].update(_code_agreement(Path(out["run_dir"]), args.seed))
    return out


def _main(args: argparse.Namespace) -> int:
    out = run_attack(args)
    print_result(out, f"LightFR / {args.defense}")
    if args.json:
        print(jsonio.dumps(out))
    return 0
