"""``secagg bench fedavg``: rounds per second of FedAvg-GMF and evaluation time.

Measures, on one dataset and the ``fedavg-gmf`` preset's hyper-parameters: seconds per
federated round (all sampled clients' local training, uploads and aggregation), the sampled
evaluation time and the full-ranking evaluation time, beside one epoch of centralised GMF on
the same data (the plaintext, non-federated baseline).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from experiments import jsonio
from experiments import config as cfgmod
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
    p.add_argument("--json", action="store_true", help="one JSON object on the last line of stdout")
    p.set_defaults(func=_main)


def bench(data: str, rounds: int, threads: int) -> dict:
    import torch

    from experiments.prepare import prepare_data
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
    result = bench(args.data, args.rounds, args.threads)
    print(
        f"{result['clients']} clients x {result['items']} items: {result['seconds_per_round']:.3f} s/round "
        f"({result['rounds_per_second']:.2f} rounds/s, {result['cpu_seconds_per_round']:.3f} CPU-s/round); evaluation sampled {result['eval_sampled_s']:.3f} s, "
        f"full {result['eval_full_s']:.3f} s; centralised epoch {result['centralized_epoch_s']:.3f} s"
    )
    if args.json:
        print(jsonio.dumps(result, sort_keys=True))
    return 0
