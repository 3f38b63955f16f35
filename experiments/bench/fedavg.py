"""``secagg bench fedavg``: rounds per second of FedAvg-GMF and evaluation time.

Measures, on one dataset and the ``fedavg-gmf`` preset's hyper-parameters: seconds per
federated round (all sampled clients' local training, uploads and aggregation), the sampled
evaluation time and the full-ranking evaluation time, beside one epoch of centralised GMF on
the same data (the plaintext, non-federated baseline).

With ``--secure none,secagg+,dpf`` it instead runs the same rounds (same seed, same data) once per
listed ``secure_aggregation``, side by side in one process, and reports for each: wall and CPU
seconds per round, bytes per client per round (model download plus the protocol's upload: for
``"dpf"`` the key sets to both servers), the largest difference of the item table from the
plaintext run after the same rounds, and every time as a ratio to the first secure protocol listed
after ``none`` (so a loaded machine slows both sides alike). ``"dpf"`` runs both servers in this one
process, one after the other (deployed, they run in parallel on their own machines).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from experiments import jsonio
from experiments.run import config as cfgmod
from experiments.errors import UserError

__all__ = ["register", "bench"]


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser(
        "fedavg",
        help="rounds per second of FedAvg-GMF and evaluation time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", default="synthetic", help="dataset path, or 'synthetic' (default)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as secagg run)")
    p.add_argument("--secure", default=None,
                   help="comma-separated secure_aggregation values to run side by side (e.g. none,secagg+,dpf)")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line of stdout")
    p.set_defaults(func=_main)


def bench_secure(data: str, rounds: int, threads: int, protocols: list[str]) -> dict:
    """The same ``rounds`` of FedAvg-GMF under each ``secure_aggregation`` in ``protocols`` (see the
    module docstring); the first entry is the reference model (``none`` if listed)."""
    import dataclasses

    import numpy as np
    import torch

    from experiments.run.prepare import prepare_data
    from protocols.fedavg import FedAvgGMF

    torch.set_num_threads(threads)
    preset = {"dpf": "fedavg-gmf-dpf", "secagg+": "fedavg-gmf-secagg"}
    base = cfgmod.merge(cfgmod.load_preset("fedavg-gmf"), {"data": {"source": data}})
    prep = prepare_data(base)
    out: dict = {"data": prep.description["preprocessed"], "clients": int(len(np.unique(prep.split.train.users))),
                 "items": int(prep.split.train.n_items), "rounds": rounds, "threads": threads, "runs": {}}
    items = {}
    for name in protocols:
        config = cfgmod.merge(cfgmod.load_preset(preset.get(name, "fedavg-gmf")), {"data": {"source": data}})
        section = dataclasses.replace(config.section("fedavg"), secure_aggregation=name)
        fed = FedAvgGMF(prep.split.train, section, seed=base.run.seed)
        wall, cpu, nbytes = [], [], []
        for r in range(rounds):
            t, c = time.perf_counter(), time.process_time()
            stats = fed.run_round()
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            nbytes.append(stats.bytes_per_client)
            print(f"{name} round {r + 1}/{rounds}: {wall[-1]:.1f} s", file=sys.stderr)
        items[name] = fed.item.clone()
        out["runs"][name] = {"seconds_per_round": statistics.median(wall), "cpu_seconds_per_round": statistics.median(cpu),
                             "bytes_per_client": statistics.median(nbytes),
                             "upload_bytes_per_client": statistics.median(nbytes) - fed.model_bytes,
                             "config": {k: v for k, v in dataclasses.asdict(section).items()
                                        if k.startswith(("dpf_", "secagg_", "frac", "value_clip"))}}
    ref = protocols[0]
    for name in protocols:
        out["runs"][name]["max_item_diff_from_" + ref] = float((items[name] - items[ref]).abs().max())
    secure = [p for p in protocols if p != "none"]
    if secure:
        first = out["runs"][secure[0]]
        for name in secure[1:]:
            run = out["runs"][name]
            run[f"speedup_vs_{secure[0]}"] = first["seconds_per_round"] / run["seconds_per_round"]
            run[f"cpu_speedup_vs_{secure[0]}"] = first["cpu_seconds_per_round"] / run["cpu_seconds_per_round"]
            run[f"bytes_ratio_vs_{secure[0]}"] = run["bytes_per_client"] / first["bytes_per_client"]
    return out


def bench(data: str, rounds: int, threads: int) -> dict:
    import torch

    from experiments.run.prepare import prepare_data
    from protocols.fedavg import FedAvgGMF
    from recmodels.metrics import evaluate_full, evaluate_sampled
    from recmodels.train import CentralTrainer

    torch.set_num_threads(threads)
    config = cfgmod.merge(cfgmod.load_preset("fedavg-gmf"), {"data": {"source": data}})
    prep = prepare_data(config)
    fed = FedAvgGMF(prep.split.train, config.section("fedavg"), seed=config.run.seed)
    times, cpu = [], []
    for r in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        fed.run_round()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        print(f"round {r + 1}/{rounds}: {times[-1]:.3f} s", file=sys.stderr)
    t = time.perf_counter()
    evaluate_sampled(fed.score, prep.candidates)
    sampled_s = time.perf_counter() - t
    t = time.perf_counter()
    evaluate_full(fed.score_all, prep.split)
    full_s = time.perf_counter() - t
    central = CentralTrainer(prep.split.train, config.section("centralized"), seed=0)
    t = time.perf_counter()
    central.run_round()
    epoch_s = time.perf_counter() - t
    per_round = statistics.median(times)
    return {
        "data": prep.description["preprocessed"],
        "clients": int(prep.split.train.n_users),
        "items": int(prep.split.train.n_items),
        "rounds": rounds,
        "seconds_per_round": per_round,
        "rounds_per_second": 1.0 / per_round,
        # CPU seconds are what a loaded machine inflates least (wall time waits for the CPU).
        "cpu_seconds_per_round": statistics.median(cpu),
        "eval_sampled_s": sampled_s,
        "eval_full_s": full_s,
        "centralized_epoch_s": epoch_s,
        "ratio_round_to_central_epoch": per_round / epoch_s,
        "threads": threads,
    }


def _main(args: argparse.Namespace) -> int:
    for flag, value in (("--rounds", args.rounds), ("--threads", args.threads)):
        if value < 1:  # checked before any work: 0 rounds has no median, torch refuses 0 threads
            raise UserError(f"{flag} must be >= 1; found {value}")
    if args.secure is not None:
        names = [p.strip() for p in args.secure.split(",") if p.strip()]
        allowed = ("none", "secagg", "secagg+", "dpf")
        if not names or any(p not in allowed for p in names) or len(set(names)) != len(names):
            raise UserError(f"--secure takes distinct values among {allowed}; found {args.secure!r}")
        result = bench_secure(args.data, args.rounds, args.threads, names)
        for name, run in result["runs"].items():
            print(f"{name}: {run['seconds_per_round']:.1f} s/round ({run['cpu_seconds_per_round']:.1f} CPU-s), "
                  f"{run['bytes_per_client']:,.0f} B per client per round")
        if args.json:
            print(jsonio.dumps(result, sort_keys=True))
        return 0
    result = bench(args.data, args.rounds, args.threads)
    print(
        f"{result['clients']} clients x {result['items']} items: {result['seconds_per_round']:.3f} s/round "
        f"({result['rounds_per_second']:.2f} rounds/s, {result['cpu_seconds_per_round']:.3f} CPU-s/round); evaluation sampled {result['eval_sampled_s']:.3f} s, "
        f"full {result['eval_full_s']:.3f} s; centralised epoch {result['centralized_epoch_s']:.3f} s"
    )
    if args.json:
        print(jsonio.dumps(result, sort_keys=True))
    return 0
