"""``secagg attack fedmf``: a FedMF run under a defense, attacked from its directory; or a sweep.

``secagg attack fedmf --defense {none,paillier,ckks,secagg,ldp} [--variant full|part]
[--epsilon E] [--data PATH] [--out DIR] [--json] [--sweep OUT_DIR]``

Single run: a thin wrapper (:mod:`experiments.studies.attack_wrap`): ``secagg run`` of FedMF under the
attack matrix's cell for the defense (``ldp`` is its LDP cell with ``[fedmf] epsilon = E``), with
``--variant``, ``--key-bits``, ``--ldp-clip`` -> their ``[fedmf]`` keys, ``--factors`` and
``--user-update`` -> ``[fedmf.mf] dim`` and ``user_update``, ``--rounds`` -> ``[run] rounds`` and
``--users``/``--items`` -> the synthetic size (default 100 x 200), views recorded; then ``secagg
attack RUN_DIR``. ``--json`` prints one object (last line of stdout): the model's held-out ``rmse``
and ``mae`` (the run's final evaluation, on its 80/20 split; ``null`` if it diverged, ``diverged``
says why), ``findings`` in the common schema (rated items, F1; ratings, RMSE), ``attack`` = the rated-items
finding of ``fedmf-one-round`` (``--user-update sequential``) or ``fedmf-two-round`` (``batch``),
``privacy`` (LDP: the epsilon composed over the uploads). Secure defenses score exactly the
stronger baseline (advantage 0).

``--sweep OUT_DIR`` keeps its own training: it runs every defense (LDP at several epsilons) as rows of
one table, a setting whose model fails before round 2 being a row rather than the end, which the
run loop (one configuration, exit on divergence) does not express; it writes ``sweep.csv``,
``sweep.md`` and ``sweep.png``.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import sys
import time
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.studies.attack_data import load_attack_data
from experiments.errors import UserError
from experiments.studies.attack_wrap import add_run_arguments

__all__ = ["TrainingFailed", "register", "run_attack"]

SWEEP_EPSILONS = (1.0, 10.0, 100.0, 1000.0)

#: Modules under ``experiments.studies`` that add one ``secagg attack <protocol>`` sub-command each
#: (``register(subparsers)``), listed explicitly; ``fedmf`` is defined in this module.
PROTOCOL_ATTACK_COMMANDS: tuple[str, ...] = (
    "attack_lightfr",
    "attack_fedcl",
    "attack_sttfedrec",
    "attack_fedfast",
    "attack_fel",
    "attack_rundir",  # every registered attack on a run directory's views (plugins too): secagg attack RUN_DIR
    "attack_matrix",  # every protocol x defense x attack: secagg attack matrix
)


class TrainingFailed(UserError):
    """Training diverged before the attack's rounds were complete (a sweep records it as a row)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``attack`` and its ``fedmf`` sub-command."""
    attack = subparsers.add_parser(
        "attack", help="run an attack on a protocol's transcript",
        description="Attacks on what a protocol's adversary sees. 'secagg attack <protocol>' runs a paper's study "
        "(train under a defense, attack, score beside random guessing); 'secagg attack RUN_DIR' runs every registered attack "
        "that applies, a plugin's too, on what a run's servers saw (its recorded views, or a replay) and writes "
        "RUN_DIR/attacks.json (docs/attacks.md).")
    sub = attack.add_subparsers(dest="attack_target", metavar="TARGET")
    p = sub.add_parser(
        "fedmf",
        help="gradient inversion against FedMF under a defense",
        description="Train FedMF with a defense, run the gradient-inversion attack on the server's view, "
        "report attack scores beside random guessing and the model's held-out RMSE.",
    )
    p.add_argument("--defense", choices=("none", "paillier", "ckks", "secagg", "ldp"), default="none")
    p.add_argument("--variant", choices=("full", "part"), default="full")
    p.add_argument("--epsilon", type=float, default=1.0, help="LDP epsilon per upload (--defense ldp; default 1)")
    p.add_argument("--ldp-clip", type=float, default=1.0, help="L1 clip of one upload before Laplace noise (default 1)")
    add_run_arguments(p, users=100, items=200)
    p.add_argument("--factors", type=int, default=16, help="latent factors (default 16)")
    p.add_argument("--rounds", type=int, default=8, help="training rounds (default 8)")
    p.add_argument("--user-update", choices=("sequential", "batch"), default="sequential",
                   help="FedMF's item-by-item update (one-round attack) or batch (two-round attack)")
    p.add_argument("--key-bits", type=int, default=2048, help="Paillier key bits (default 2048; 1024 warns)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--sweep", type=Path, default=None, metavar="OUT_DIR",
                   help="run all defenses (LDP at several epsilons); write CSV, Markdown and PNG")
    p.set_defaults(func=_main)
    for name in PROTOCOL_ATTACK_COMMANDS:
        importlib.import_module(f"experiments.studies.{name}").register(sub)
    attack.set_defaults(func=lambda args: (attack.print_help(sys.stderr), 2)[1])


def _load(args: argparse.Namespace) -> Any:
    if args.factors < 1:
        raise UserError(f"--factors is too small: {args.factors}.")
    return load_attack_data(args, dim=args.factors)


#: delta at which the LDP uploads' composed epsilon is reported.
LDP_DELTA = 1e-5


def run_attack(args: argparse.Namespace, data: Any, defense: str, epsilon: float) -> dict[str, Any]:
    """Train FedMF under ``defense`` and attack round 0 of the server's view; a JSON-ready dict."""
    import numpy as np

    from attacks.fedmf import get_attack, score, server_view
    from protocols.fedmf import FedMF, FedMFConfig
    from protocols.transport import SERVER, InProcessTransport, Transcript
    from recmodels.mf import MFConfig
    from recmodels.splits import ratio_split
    from secagg.he.errors import HEError

    if args.rounds < 2:
        raise UserError(f"--rounds must be >= 2 (the two-round attack needs rounds 0 and 1); found {args.rounds}.")
    split = ratio_split(data, test_ratio=0.2, seed=args.seed)
    cfg = FedMFConfig(
        mf=MFConfig(dim=args.factors, user_update=args.user_update), variant=args.variant, defense=defense,
        rounds=args.rounds, key_bits=args.key_bits, epsilon=epsilon, ldp_clip=args.ldp_clip,
    )
    keep = lambda r: r.round <= 1 and (r.receiver == SERVER or r.sender == SERVER)  # noqa: E731
    try:
        model = FedMF(split.train, cfg, seed=args.seed, transport=InProcessTransport(Transcript(keep_payloads=keep)))
    except HEError as exc:  # bad HE parameters (e.g. a Paillier key size) are the user's input
        raise UserError(f"--defense {defense} --key-bits {args.key_bits}: {exc}") from exc
    t0 = time.perf_counter()
    stats, diverged = [], None
    try:
        # A diverging model (LDP noise at small epsilon) overflows on its way to the ValueError
        # below: that is reported as "model diverged", not as numpy warnings on stderr.
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
            for _ in range(cfg.rounds):
                stats.append(model.run_round())
                print(f"round {stats[-1].round}: {stats[-1].seconds['round']:.2f} s", file=sys.stderr)
    except ValueError as exc:  # e.g. LDP noise at small epsilon blows the model up
        if model.round < 2:
            raise TrainingFailed(f"training failed in round {model.round}: {exc}") from exc
        diverged = f"training stopped in round {model.round}: {exc}"
    train_s = time.perf_counter() - t0
    name = "fedmf-one-round" if args.user_update == "sequential" else "fedmf-two-round"
    pub = model.public_info()
    with np.errstate(all="ignore"):  # the attack inverts noisy, possibly huge updates
        result = get_attack(name)(server_view(model.transport.transcript), pub, round=0)
        lists = model.lists
        sc = score(result, lists.rated_sets(), [lists.ratings[u, :c] for u, c in enumerate(lists.counts)],
                   model.n_items, pub["rating_scale"])
        metrics = model.evaluate(split.test)
    if not diverged and not (np.isfinite(metrics["rmse"]) and np.isfinite(metrics["mae"])):
        diverged = f"the model's held-out RMSE is not finite after {model.round} rounds"
    if diverged:
        metrics = {"rmse": None, "mae": None}  # null in JSON: the model diverged
    privacy = None
    if defense == "ldp":
        # Every user uploads once per completed round: sequential composition of those releases.
        from dp.events import Laplace
        from dp.ldp import ldp_repeated_uploads

        report = ldp_repeated_uploads(Laplace.from_epsilon(epsilon), model.round, delta=LDP_DELTA)
        privacy = {
            "epsilon_per_upload": epsilon, "uploads": model.round, "delta": LDP_DELTA,
            "epsilon_total": report.epsilon, "accountant": report.accountant,
        }
    return {
        "diverged": diverged,
        "defense": defense, "variant": args.variant, "epsilon": epsilon if defense == "ldp" else None,
        "privacy": privacy,
        "rmse": metrics["rmse"], "mae": metrics["mae"], "attack_name": name,
        "attack": sc.to_dict(),
        "data": data.source, "users": model.n_users, "items": model.n_items, "factors": args.factors,
        "rounds": args.rounds, "train_seconds": train_s,
        "seconds_per_user_iteration": float(np.mean([s.seconds["client"] for s in stats])) if stats else None,
        "split": split.protocol["kind"],
    }


#: --defense -> the attack matrix's FedMF cell (experiments.studies.attack_matrix.CELLS); ldp's epsilon
#: and every HE key size come from the command's options.
CELL = {"none": "none", "secagg": "secagg", "paillier": "paillier", "ckks": "ckks", "ldp": "ldp-eps1"}


def run_wrapped(args: argparse.Namespace) -> dict[str, Any]:
    """One FedMF run under ``args.defense`` (a cell of the attack matrix, the options as config keys),
    views recorded, attacked from its directory; a JSON-ready dict (docs/attacks.md)."""
    from experiments.studies.attack_wrap import run_and_attack
    from secagg.he.errors import HEError

    if args.rounds < 2:
        raise UserError(f"--rounds must be >= 2 (the two-round attack needs rounds 0 and 1); found {args.rounds}.")
    if args.factors < 1:
        raise UserError(f"--factors is too small: {args.factors}.")
    if args.data is not None and not args.data.exists():
        raise UserError(f"--data {args.data}: no such file or folder")
    over: dict[str, Any] = {"variant": args.variant, "key_bits": args.key_bits, "ldp_clip": args.ldp_clip,
                            "mf": {"dim": args.factors, "user_update": args.user_update}}
    if args.defense == "ldp":
        over["epsilon"] = args.epsilon
    name = "fedmf-one-round" if args.user_update == "sequential" else "fedmf-two-round"
    try:
        out = run_and_attack(args, paper="fedmf", protocol="fedmf", cell=CELL[args.defense], attack=name,
                             overrides=over, dim=args.factors)
    except HEError as exc:  # bad HE parameters (e.g. a Paillier key size) are the user's input
        raise UserError(f"--defense {args.defense} --key-bits {args.key_bits}: {exc}") from None
    m = out.get("metrics") or {}
    out.update(variant=args.variant, epsilon=args.epsilon if args.defense == "ldp" else None,
               rmse=None if out["diverged"] else m.get("RMSE"), mae=None if out["diverged"] else m.get("MAE"))
    out["privacy"] = None
    if args.defense == "ldp":
        from dp.events import Laplace
        from dp.ldp import ldp_repeated_uploads

        rep = ldp_repeated_uploads(Laplace.from_epsilon(args.epsilon), args.rounds, delta=LDP_DELTA)
        out["privacy"] = {"epsilon_per_upload": args.epsilon, "uploads": args.rounds, "delta": LDP_DELTA,
                          "epsilon_total": rep.epsilon, "accountant": rep.accountant}
    return out


def _main(args: argparse.Namespace) -> int:
    if args.sweep is not None:
        return _sweep(args, _load(args))
    from experiments.studies.attack_wrap import print_result

    out = run_wrapped(args)
    if out["rmse"] is None:
        print(f"FedMF {out['variant']} / {out['defense']}: model diverged ({out['diverged']})")
    else:
        print(f"FedMF {out['variant']} / {out['defense']}: model RMSE {out['rmse']:.4f} MAE {out['mae']:.4f}")
    print_result(out, f"FedMF {out['variant']} / {out['defense']}")
    if args.json:
        print(jsonio.dumps(out))
    return 0


def _sweep(args: argparse.Namespace, data: Any) -> int:
    out_dir: Path = args.sweep
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [(d, args.epsilon) for d in ("none", "paillier", "ckks", "secagg")] + [("ldp", e) for e in SWEEP_EPSILONS]
    rows = []
    for defense, eps in runs:
        print(f"sweep: {defense} {eps if defense == 'ldp' else ''}", file=sys.stderr)
        label = defense if defense != "ldp" else f"ldp eps={eps:g}"
        try:
            r = run_attack(args, data, defense, eps)
        except TrainingFailed as exc:  # one setting's failure is a row of the table, not the end of it
            rows.append({
                "defense": label, "variant": args.variant, "attack_f1": None, "random_f1": None, "rating_rmse": None,
                "random_rating_rmse": None, "model_rmse": None, "model_mae": None,
                "status": f"model diverged, no attack: {exc}", "train_seconds": None, "epsilon_total": None,
            })
            continue
        a = r["attack"]
        status = a["status"] if not r["diverged"] else f"model diverged ({r['diverged']}); attack on round 0: {a['status']}"
        rows.append({
            "defense": label, "variant": r["variant"],
            "attack_f1": a["f1"], "random_f1": a["random_f1"], "rating_rmse": a["rating_rmse"],
            "random_rating_rmse": a["random_rating_rmse"], "model_rmse": r["rmse"], "model_mae": r["mae"],
            "status": status, "train_seconds": r["train_seconds"],
            "epsilon_total": r["privacy"]["epsilon_total"] if r["privacy"] else None,
        })
    with open(out_dir / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    fmt = lambda v: "n/a" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| defense | attack F1 | random F1 | rating RMSE | random rating RMSE | model RMSE | "
             f"epsilon over all rounds (delta {LDP_DELTA:g}) | status |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['defense']} | {fmt(r['attack_f1'])} | {fmt(r['random_f1'])} | {fmt(r['rating_rmse'])} | "
              f"{fmt(r['random_rating_rmse'])} | {fmt(r['model_rmse'])} | {fmt(r['epsilon_total'])} | {r['status']} |"
              for r in rows]
    (out_dir / "sweep.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out_dir / "sweep.png")
    print("\n".join(lines))
    if args.json:
        print(jsonio.dumps({"rows": rows, "out_dir": str(out_dir)}))
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["defense"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    nan = lambda v: np.nan if v is None else v  # noqa: E731
    ax.bar(x - 0.3, [nan(r["attack_f1"]) for r in rows], 0.2, label="attack F1")
    ax.bar(x - 0.1, [nan(r["random_f1"]) for r in rows], 0.2, label="random F1")
    ax.bar(x + 0.1, [nan(r["rating_rmse"]) for r in rows], 0.2, label="attack rating RMSE")
    ax.bar(x + 0.3, [nan(r["model_rmse"]) for r in rows], 0.2, label="model RMSE (held out)")
    ax.set_xticks(x, names, rotation=20)
    ax.set_title("FedMF: gradient inversion vs defense (privacy and utility)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
