"""``secagg flower``: run a preset on Flower (optional extra: ``pip install -e '.[flower]'``).

* ``secagg flower simulate PRESET --clients N [--rounds R] [--json]``: Flower's simulation engine
  (Ray backend), one virtual SuperNode per user, reporting like ``secagg run`` (run directory,
  metrics, costs, ledger, summary.json with a ``runtime`` section); ``--resume RUN_DIR`` continues a
  killed simulation;
* ``secagg flower partition PRESET --out DIR``: write each client's partition file for a real
  deployment (one SuperNode per ``partition-id``; docs/flower.md has the commands).

Flower is imported only when a sub-command runs, so ``secagg`` works without it; without it, the
sub-commands fail with one line (exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "flower", help="run a preset on Flower: simulation engine or a SuperLink deployment",
        description="Run a preset as Flower apps, each client a SuperNode holding only its own data (needs the "
        "flower extra: pip install -e '.[flower]'). Every protocol whose parties separate onto devices runs: "
        "FedAvg-GMF (plaintext, SecAgg, SecAgg+), FEL (GMF or NCF leaves; per-leaf secure aggregation and DP; the "
        "FL over-arch), and LightFR, FedMF, FedCL, FedFast, STTFedRec and FL-DSSM/CLSM as named exchanges (their "
        "secure steps through SecAgg, SecAgg+ or the chain inside Flower). A configuration that does not separate is "
        "refused in words before anything starts. 'simulate' runs Flower's simulation engine (Ray) into a run "
        "directory like secagg run, resumable with --resume; 'partition' writes the per-client files of a "
        "SuperLink/SuperNode deployment. See docs/flower.md.")
    sub = p.add_subparsers(dest="flower_command", metavar="COMMAND")
    sim = sub.add_parser("simulate", help="a preset through Flower's simulation engine (Ray), one virtual node per user",
                         description="Run a preset through Flower's simulation engine (Ray backend) with one virtual "
                         "SuperNode per user; reports like `secagg run` (run directory, metrics, costs, ledger).")
    _common(sim)
    sim.add_argument("--clients", type=int, metavar="N",
                     help="virtual clients: the synthetic dataset's users (data.synthetic_users); with --data, the "
                     "data's users (then --clients must be omitted)")
    sim.add_argument("--rounds", type=int, metavar="R", help="rounds")
    sim.add_argument("--clients-per-round", type=int, metavar="M", help="clients_per_round of the preset's section (FEL: per leaf)")
    sim.add_argument("--eval-users", type=int, metavar="K",
                     help="evaluate (sampled metrics) on K seeded users only, no full ranking (each evaluated user "
                     "is one more Flower message); default: every user, as secagg run")
    sim.add_argument("--cpus", type=int, default=2, metavar="C", help="Ray CPUs, i.e. clients training at once (default 2)")
    sim.add_argument("--timeout", type=float, default=900.0, metavar="S",
                     help="seconds a round waits for its replies; later ones are dropped (default 900)")
    sim.add_argument("--out", metavar="DIR", help="run directory (default runs/<preset>-<UTC timestamp>)")
    sim.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a killed simulation from its checkpoint (each virtual node continues from its "
                     "own store in RUN_DIR/flower-nodes); only --rounds may be given with it")
    sim.add_argument("--record-views", action="store_true",
                     help="keep what the server received in RUN_DIR/views, as secagg run --record-views "
                     "(run.record_views; docs/attacks.md)")
    sim.add_argument("--record-every", type=int, metavar="N",
                     help="with --record-views: record every N-th round and the last (run.record_every)")
    sim.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.set_defaults(func=_simulate)
    part = sub.add_parser("partition", help="write one partition file per client for a deployment",
                          description="Prepare a preset's data as `secagg run` does and write one file per user "
                          "(client-NNNNNNN.npz, the user's own positives and excluded items) plus meta.json into DIR.")
    _common(part)
    part.add_argument("--clients", type=int, metavar="N", help="the synthetic dataset's users (data.synthetic_users)")
    part.add_argument("--out", metavar="DIR", required=True, help="directory for the partition files")
    part.add_argument("--json", action="store_true", help="print what was written as one JSON object")
    part.set_defaults(func=_partition)
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", nargs="?", help="preset name (e.g. fedavg-gmf, fedavg-gmf-secagg, fel-dp, lightfr, fedmf; "
                   "secagg run --help lists them; one whose configuration does not separate onto devices is refused)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file overriding the preset's keys")
    p.add_argument("--data", metavar="PATH", help="MovieLens file or folder, or CSV (default: the preset's data)")
    p.add_argument("--seed", type=int, metavar="S", help="seed of every simulation choice")
    p.add_argument("--eval-negatives", type=int, metavar="N", help="sampled negatives per held-out item (default 99)")


def _need_flower() -> None:
    if importlib.util.find_spec("flwr") is None:
        raise UserError("Flower is not installed: pip install -e '.[flower]' (the flower extra, flwr[simulation]==1.41.0)")


def _config(args: argparse.Namespace):
    from experiments.cli import cmd_run

    resume = getattr(args, "resume", None)
    if resume and (args.clients is not None or getattr(args, "clients_per_round", None) is not None
                   or getattr(args, "out", None)):
        raise UserError("--resume continues a run with its saved config; only --rounds (and the evaluation's "
                        "--eval-users, give the original one) may be given")
    if not resume and not args.preset:
        raise UserError("give a preset (e.g. fedavg-gmf) or --resume RUN_DIR")
    ns = argparse.Namespace(resume=resume, preset=args.preset, config=args.config, data=args.data, format=None,
                            columns=None, sep=None, rounds=getattr(args, "rounds", None), seed=args.seed,
                            eval_negatives=args.eval_negatives, out=None,
                            record_views=getattr(args, "record_views", False),
                            record_every=getattr(args, "record_every", None))
    preset, config = cmd_run._resolve(ns)
    from experiments.run import config as cfgmod

    over: dict[str, dict[str, Any]] = {}
    if args.clients is not None:
        if args.clients < 2:
            raise UserError(f"--clients must be >= 2; found {args.clients}")
        if config.data.source != "synthetic":
            raise UserError("--clients sets the synthetic dataset's users; with --data the clients are the data's users")
        over["data"] = {"synthetic_users": args.clients}
    if getattr(args, "clients_per_round", None) is not None:
        if args.clients_per_round < 1:
            raise UserError(f"--clients-per-round must be >= 1; found {args.clients_per_round}")
        if not hasattr(config.protocol_config, "clients_per_round"):
            raise UserError(f"protocol {config.run.protocol!r} has no clients_per_round: set its cohort in "
                            f"[{config.spec.section}] of a --config file instead")
        over[config.spec.section] = {"clients_per_round": args.clients_per_round}
    return preset, cfgmod.merge(config, over) if over else config


def _simulate(args: argparse.Namespace) -> int:
    _need_flower()
    if args.cpus < 1 or args.timeout <= 0:
        raise UserError(f"--cpus must be >= 1 and --timeout > 0; found {args.cpus}, {args.timeout}")
    preset, config = _config(args)
    import torch

    from experiments.run.flower_run import simulate_run
    from experiments.run.training import RunRequest

    torch.set_num_threads(1)
    summary = simulate_run(RunRequest(preset=preset, config=config, out=Path(args.out) if args.out else None,
                                      resume=Path(args.resume) if args.resume else None, quiet=args.quiet),
                           cpus=args.cpus, timeout=args.timeout, eval_users=args.eval_users)
    m = summary.get("metrics") or summary.get("metrics_full") or {}
    shown = "  ".join(f"{k} {v:.4f}" for k, v in m.items() if k.startswith(("HR@10", "NDCG@10")))
    rt = summary["runtime"]
    print(f"flower    {rt['engine']}, {rt['nodes']} virtual nodes, {rt['cpus']} CPUs; flwr {rt['flwr']}")
    print(f"metrics   {shown}")
    print(f"privacy   {summary['privacy']['statement']}")
    print(f"seconds {summary['seconds']:.1f}  per round {summary['seconds_per_round']:.2f}  run dir {summary['run_dir']}")
    if args.json:
        print(jsonio.dumps(summary, sort_keys=True))
    return 0


def _partition(args: argparse.Namespace) -> int:
    preset, config = _config(args)
    from experiments.run.flower_run import check_protocol
    from experiments.run.prepare import prepare_data

    check_protocol(config)
    from experiments.run.flower_run import write_run_partitions  # no flwr import: partitions are plain numpy files

    prep = prepare_data(config)
    meta = write_run_partitions(config, prep, args.out)
    out = {"preset": preset, "out": str(Path(args.out).resolve()), "clients": meta.clients, "n_users": meta.n_users,
           "n_items": meta.n_items, **({} if meta.units is None else {"units": len(set(meta.units) - {-1})})}
    print(f"wrote {meta.clients} partitions ({meta.n_users} users, {meta.n_items} items) to {out['out']}", file=sys.stderr)
    if args.json:
        print(jsonio.dumps(out, sort_keys=True))
    return 0
