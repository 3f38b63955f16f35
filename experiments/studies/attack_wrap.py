"""What every converted ``secagg attack <paper>`` command does: make a run, attack its directory.

A per-paper command (``secagg attack fedfast``, ``lightfr``, ...) is a thin wrapper over two ordinary
commands:

1. ``secagg run``: the protocol's preset under the chosen defense, taken from the attack matrix's
   :data:`experiments.studies.attack_matrix.CELLS` (one mapping of defense -> configuration for the
   matrix and the per-paper commands), with the command's options mapped onto configuration keys
   (:func:`experiments.studies.attack_matrix.cell_config`), views recorded every round, no evaluation;
2. ``secagg attack RUN_DIR``: :func:`experiments.studies.attack_rundir.attack_run_dir` on that run,
   which writes ``RUN_DIR/attacks.json``.

The run directory is kept (there is no ``--keep``: a run is the evidence of its findings, and
``secagg attack RUN_DIR`` can attack it again): ``--out DIR``, or by default a fresh folder
``runs/attack-<paper>-<defense>-<time>`` whose name is printed to stderr. Delete it when done.

The result (``--json``: one object on the last stdout line) holds the run's ``findings`` in the
common schema of :mod:`attacks.findings` (``attack``, ``role``, ``target``, ``metric``, ``value``,
``random``, ``public``, ``advantage``, ``interval``, ..., paper-specific figures under ``extra``),
``skipped``, and ``attack``: the command's main finding (the first finding of its paper's attack).
On a secure defense that finding's value is the stronger baseline and its advantage exactly 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from experiments.errors import UserError
from experiments.studies.attack_data import add_data_arguments

__all__ = ["add_run_arguments", "print_result", "run_and_attack"]


def add_run_arguments(p: argparse.ArgumentParser, *, users: int, items: int) -> None:
    """``--data``, ``--users``, ``--items``, ``--seed`` (as before) and ``--out``."""
    add_data_arguments(p, users=users, items=items)
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="run directory to create and keep (default: a fresh runs/attack-<paper>-<defense>-<time>, "
                   "printed to stderr); secagg attack DIR attacks it again")


def _fresh(paper: str, defense: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"attack-{paper}-{defense}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path("runs") / f"attack-{paper}-{defense}-{stamp}-{n}"
    return path


def run_and_attack(args: argparse.Namespace, *, paper: str, protocol: str, cell: str, attack: str,
                   overrides: dict[str, Any] | None = None, dim: int = 8, items_per_interaction: int = 4,
                   min_users: int = 2, min_items: int = 6) -> dict[str, Any]:
    """Run ``protocol`` under the matrix cell ``cell`` for ``args.rounds`` rounds and attack it.

    Args:
        args: the command's options (``data``, ``users``, ``items``, ``seed``, ``rounds``, ``out``,
            ``defense`` where the command has one; else the cell names the run).
        paper: the command's name (the default run folder's).
        attack: the registered attack whose first finding is the result's ``attack``.
        overrides: keys of the protocol's configuration section from the command's options.
        dim, items_per_interaction: the synthetic generator's latent size and density (as before:
            about ``clip(items // items_per_interaction, 3, 20)`` interactions per user).
    """
    from experiments.errors import TrainingDiverged
    from experiments.run.training import RunRequest, execute
    from experiments.studies.attack_matrix import cell_config
    from experiments.studies.attack_rundir import attack_run_dir

    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1; found {args.rounds}.")
    synthetic = None
    if args.data is None:
        if args.users < min_users or args.items < min_items:
            raise UserError(f"--users must be >= {min_users} and --items >= {min_items}; "
                            f"found {args.users}, {args.items}.")
        synthetic = {"synthetic_users": args.users, "synthetic_items": args.items, "synthetic_dim": dim,
                     "synthetic_mean_interactions": max(3, min(20, args.items // items_per_interaction))}
    elif not Path(args.data).exists():
        raise UserError(f"--data {args.data}: no such file or folder")
    try:
        config = cell_config(protocol, cell, data=None if args.data is None else str(args.data), rounds=args.rounds,
                             seed=args.seed, synthetic=synthetic, overrides=overrides)
    except ValueError as exc:  # a key's check: name the option
        raise UserError(str(exc).replace(f"{protocol}.", "--").replace("_", "-")) from None
    defense = getattr(args, "defense", None) or cell  # FedCL's command names an epsilon, not a defense
    out = args.out if args.out is not None else _fresh(paper, defense)
    label = cell if defense == cell else f"{defense} (matrix cell {cell} with the command's keys)"
    print(f"{paper}: run {protocol} / {label} in {out}", file=sys.stderr)
    t0 = time.perf_counter()
    diverged = None
    import numpy as np

    try:
        # a diverging model (FedMF's LDP at a small epsilon) is reported as diverged, not as numpy warnings
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
            summary = execute(RunRequest(preset=f"attack-{paper}-{cell}", config=config, out=out, quiet=True))
    except TrainingDiverged as exc:  # the run directory stays valid: attack the rounds it recorded
        diverged = str(exc)
        print(f"{paper}: {diverged}", file=sys.stderr)
        path = Path(out) / "summary.json"
        summary = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    train_s = time.perf_counter() - t0
    res = attack_run_dir(out)
    main = next((f for f in res["findings"] if f["attack"] == attack), None)
    desc = summary.get("data") or {}
    return {"paper": paper, "protocol": protocol, "defense": defense, "cell": cell, "run_dir": str(out),
            "data": "synthetic" if args.data is None else str(args.data),
            "data_description": desc.get("preprocessed"), "rounds": args.rounds, "seed": args.seed,
            "views": summary.get("views"), "bytes_per_client_per_round": summary.get("bytes_per_client_per_round"),
            "train_seconds": train_s, "diverged": diverged, "metrics": summary.get("metrics"), "source": res["source"],
            "attack_name": attack, "attack": main, "findings": res["findings"], "skipped": res["skipped"]}


def _fmt(x: Any) -> str:
    return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def print_result(out: dict[str, Any], title: str) -> None:
    """The findings as a table on stdout (the shape of ``secagg attack RUN_DIR``'s), extras indented."""
    print(f"{title}: {len(out['findings'])} finding(s) from the {out['source']} of {out['run_dir']}, "
          f"rounds 0..{out['rounds'] - 1}")
    print(f"{'attack':<24}{'target':<22}{'metric':<10}{'value':>8}{'random':>8}{'public':>8}{'advantage':>11}"
          "  95% interval of the advantage")
    for f in out["findings"]:
        iv = f["advantage_interval"]
        print(f"{f['attack']:<24}{f['target']:<22}{f['metric']:<10}{_fmt(f['value']):>8}{_fmt(f['random']):>8}"
              f"{_fmt(f['public']):>8}{_fmt(f['advantage']):>11}  "
              f"{'-' if iv is None else f'[{iv[0]:.3f}, {iv[1]:.3f}]'}  {f['status']}")
        for k, v in sorted(f.get("extra", {}).items()):
            print(f"    {k}: {_fmt(v)}")
    for s in out["skipped"]:
        print(f"skipped {s['attack']}: {s['reason']}")
