"""``secagg run``: train and evaluate one configuration into a run directory.

With no arguments it runs the ``fedavg-gmf`` preset on the embedded synthetic data.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from experiments import config as cfgmod
from experiments.errors import UserError
from experiments.rundir import RunDir, default_run_dir
from protocols.fedavg import FedAvgGMF
from protocols.transport import InProcessTransport, Transcript
from recmodels.data import Interactions, binarize, filter_min_interactions
from recmodels.loaders import load_interactions
from recmodels.metrics import evaluate_full, evaluate_sampled
from recmodels.models import ItemPop, RandomScorer
from recmodels.sampling import EvalCandidates, sample_eval_candidates
from recmodels.splits import Split, leave_one_out
from recmodels.synthetic import generate_synthetic
from recmodels.train import CentralTrainer

__all__ = ["register", "run", "prepare_data", "Prepared"]

DEFAULT_PRESET = "fedavg-gmf"
TIE_RULE = "ties count against the held-out item (rank = 1 + #candidates scoring >= it)"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train and evaluate a preset or config into a run directory",
        description=(
            "Train and evaluate one configuration. With no preset it runs 'fedavg-gmf' on the embedded "
            f"synthetic data. Presets: {', '.join(cfgmod.PRESETS)}. Writes config.toml, metrics.jsonl, "
            "costs.jsonl, transcript.csv, checkpoint.pt, summary.json and metrics.png into the run directory."
        ),
    )
    p.add_argument("preset", nargs="?", help=f"preset name (default {DEFAULT_PRESET}): {', '.join(cfgmod.PRESETS)}")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file overriding the preset's keys")
    p.add_argument("--data", metavar="PATH", help="MovieLens u.data / ratings.dat / ratings.csv (file or folder) or CSV")
    p.add_argument("--format", metavar="FMT", help="data format when it cannot be inferred: ml-100k, ml-1m, ml-csv, csv")
    p.add_argument("--rounds", type=int, metavar="N", help="rounds (federated) or epochs (centralised)")
    p.add_argument("--seed", type=int, metavar="S", help="seed of every simulation choice")
    p.add_argument("--eval-negatives", type=int, metavar="N", help="sampled negatives per held-out item (default 99)")
    p.add_argument("--out", metavar="DIR", help="run directory (default runs/<preset>-<UTC timestamp>)")
    p.add_argument("--resume", metavar="DIR", help="continue an interrupted run from its last checkpoint")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads (default 1: the simulation's many small ops lose more to thread "
        "hand-offs than they gain; measured 0.47 vs 3.7 CPU-s per FedAvg round on a loaded 2-core machine)",
    )
    p.set_defaults(func=_main)


def _resolve(args: argparse.Namespace) -> tuple[str, cfgmod.RunConfig]:
    if args.resume:
        if args.preset or args.config or args.data or args.format or args.seed is not None or args.eval_negatives is not None or args.out:
            raise UserError("--resume continues a run with its saved config; only --rounds may be changed")
        rd = RunDir.open_existing(Path(args.resume))
        config = cfgmod.load_config_file(rd.file("config.toml"))
        preset = json.loads(rd.file("run.json").read_text())["preset"] if rd.file("run.json").exists() else "custom"
    else:
        preset = args.preset or DEFAULT_PRESET
        config = cfgmod.load_preset(preset)
        if args.config:
            config = cfgmod.load_config_file(args.config, base=config)
    overrides: dict[str, dict[str, Any]] = {}
    if args.data:
        overrides.setdefault("data", {})["source"] = args.data
    if args.format:
        overrides.setdefault("data", {})["format"] = args.format
    if args.rounds is not None:
        overrides.setdefault("run", {})["rounds"] = args.rounds
    if args.seed is not None:
        overrides.setdefault("run", {})["seed"] = args.seed
    if args.eval_negatives is not None:
        overrides.setdefault("eval", {})["negatives"] = args.eval_negatives
    config = cfgmod.merge(config, overrides)
    if not args.resume and config.data.source != "synthetic":
        # config.toml must name the data wherever --resume is later run from, not relative to today's cwd
        config = cfgmod.merge(config, {"data": {"source": str(Path(config.data.source).expanduser().resolve())}})
    return preset, config


@dataclass
class Prepared:
    """Data after preprocessing, the split and the sampled evaluation candidates."""

    data: Interactions
    split: Split
    candidates: EvalCandidates
    description: dict[str, Any]


def prepare_data(config: cfgmod.RunConfig) -> Prepared:
    """Load (or generate), preprocess, split and sample evaluation candidates, all seeded."""
    d, seed = config.data, config.run.seed
    if d.source == "synthetic":
        raw = generate_synthetic(
            n_users=d.synthetic_users,
            n_items=d.synthetic_items,
            seed=seed,
            dim=d.synthetic_dim,
            mean_interactions=d.synthetic_mean_interactions,
        )
    else:
        raw = load_interactions(d.source, fmt=d.format or None)
    threshold = None if math.isnan(d.threshold) else d.threshold
    data = binarize(raw, threshold=threshold)
    data = filter_min_interactions(data, min_user=d.min_user_interactions, min_item=d.min_item_interactions)
    if len(data) == 0 or data.n_users == 0:
        raise ValueError(
            f"no interactions left in {raw.source} after preprocessing (threshold={threshold}, "
            f"min_user_interactions={d.min_user_interactions}, min_item_interactions={d.min_item_interactions})"
        )
    split = leave_one_out(data, seed=seed, validation=config.split.validation)
    candidates = sample_eval_candidates(
        split, n_negatives=config.eval.negatives, rng=np.random.default_rng([seed, 1])
    )
    description = {
        "source": raw.source,
        "raw": raw.describe(),
        "preprocessed": data.describe(),
        "positives": "every rating" if threshold is None else f"rating >= {threshold}",
        "min_user_interactions": d.min_user_interactions,
        "min_item_interactions": d.min_item_interactions,
    }
    return Prepared(data, split, candidates, description)


def _evaluation_protocol(config: cfgmod.RunConfig, prep: Prepared) -> dict[str, Any]:
    return {
        "split": prep.split.protocol,
        "sampled": f"held-out item + {config.eval.negatives} sampled items the user never interacted with",
        "full": "held-out item ranked among all items not in the user's training data"
        + (" (validation item excluded)" if config.split.validation else ""),
        "ks": list(config.eval.ks),
        "ties": TIE_RULE,
        "users_evaluated": int(len(prep.candidates.users)),
    }


def _build(config: cfgmod.RunConfig, prep: Prepared):
    protocol, seed, train = config.run.protocol, config.run.seed, prep.split.train
    if protocol == "itempop":
        return ItemPop(train)
    if protocol == "random":
        return RandomScorer(train.n_users, train.n_items, seed=seed)
    if protocol == "centralized":
        return CentralTrainer(train, config.centralized, seed=seed)
    if protocol == "fedavg":
        return FedAvgGMF(train, config.fedavg, seed=seed, transport=InProcessTransport(Transcript()))
    raise AssertionError(protocol)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__}
    try:
        out["secagg-fedrec"] = metadata.version("secagg-fedrec")
    except metadata.PackageNotFoundError:  # running from a source tree without installation
        out["secagg-fedrec"] = "source"
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Execute ``secagg run`` and return the summary (also written to summary.json)."""
    preset, config = _resolve(args)
    if args.threads < 1:
        raise UserError(f"--threads must be >= 1; found {args.threads}")
    torch.set_num_threads(args.threads)
    prep = prepare_data(config)  # bad input fails here, before anything is written
    trainer = _build(config, prep)
    ks = tuple(config.eval.ks)

    history: list[dict[str, Any]] = []
    costs: list[dict[str, Any]] = []
    parties: list[str] = []  # transcript.csv rows: bytes per party per round
    elapsed = 0.0
    rounds = config.run.rounds if hasattr(trainer, "run_round") else 0
    if args.resume:
        rd = RunDir.open_existing(Path(args.resume))
        state = rd.load_checkpoint()
        if state is not None:
            trainer.load_state_dict(state["trainer"])
            history, costs, elapsed = state["history"], state["costs"], state["seconds"]
            parties = state.get("parties", [])
        if getattr(trainer, "round", 0) > rounds:  # checked before config.toml is rewritten
            raise UserError(
                f"{rd.path} already completed {trainer.round} rounds; --rounds {rounds} would not undo them "
                f"(resume with --rounds >= {trainer.round})"
            )
    else:
        rd = RunDir.create(Path(args.out) if args.out else default_run_dir(preset))
        rd.write_json("run.json", {"preset": preset})
    rd.write_text("config.toml", cfgmod.to_toml(config))
    start_round = getattr(trainer, "round", 0)

    def eval_sampled() -> dict[str, float]:
        return evaluate_sampled(trainer.score, prep.candidates, ks=ks)

    def checkpoint() -> None:
        rd.write_jsonl("metrics.jsonl", history)
        rd.write_jsonl("costs.jsonl", costs)
        if parties:
            rd.write_text("transcript.csv", "round,party,sent_bytes,received_bytes\n" + "".join(parties))
        if hasattr(trainer, "state_dict"):
            rd.save_checkpoint(
                {"trainer": trainer.state_dict(), "history": history, "costs": costs, "parties": parties, "seconds": elapsed}
            )

    t0 = time.perf_counter() - elapsed
    bar = tqdm(total=rounds, initial=start_round, desc=f"{preset}", unit="round", file=sys.stderr, disable=args.quiet or rounds == 0)
    for r in range(start_round, rounds):
        stats = trainer.run_round()
        row = {"round": r + 1, "loss": round(float(stats["loss"] if isinstance(stats, dict) else stats.loss), 6)}
        if isinstance(trainer, FedAvgGMF):
            transcript = trainer.transport.transcript
            costs.append(transcript.round_summary(r))
            parties.extend(
                f"{r},{party},{b['sent']},{b['received']}\n" for party, b in sorted(transcript.bytes_by_party(r).items())
            )
            transcript.drop_before(r + 1)
        if config.run.eval_every and ((r + 1) % config.run.eval_every == 0 or r + 1 == rounds):
            row.update(eval_sampled())
        row["seconds"] = round(time.perf_counter() - t0, 3)
        history.append(row)
        elapsed = time.perf_counter() - t0
        if (r + 1) % config.run.checkpoint_every == 0 or r + 1 == rounds:
            checkpoint()
        bar.set_postfix({k: f"{v:.3f}" for k, v in row.items() if k in ("loss", "HR@10", "NDCG@10")})
        bar.update(1)
    bar.close()

    train_seconds = time.perf_counter() - t0
    te = time.perf_counter()
    metrics = eval_sampled()
    sampled_s = time.perf_counter() - te
    metrics_full: dict[str, float] | None = None
    full_s = 0.0
    if config.eval.full_ranking:
        te = time.perf_counter()
        metrics_full = evaluate_full(trainer.score_all, prep.split, ks=ks)
        full_s = time.perf_counter() - te
    if rounds == 0 or not history or "HR@10" not in history[-1]:
        history.append({"round": rounds, **metrics, "seconds": round(train_seconds, 3)})
    elapsed = time.perf_counter() - t0
    checkpoint()

    bytes_pc = float(np.mean([c["bytes_per_client"] for c in costs])) if costs else 0.0
    summary = {
        "preset": preset,
        "protocol": config.run.protocol,
        "rounds": rounds,
        "seed": config.run.seed,
        "metrics": metrics,
        "metrics_full": metrics_full,
        "evaluation": _evaluation_protocol(config, prep),
        "data": prep.description,
        "bytes_per_client_per_round": bytes_pc,
        "seconds": round(elapsed, 3),
        "seconds_per_round": round(train_seconds / max(rounds, 1), 4) if rounds else 0.0,
        "eval_seconds": {"sampled": round(sampled_s, 3), "full": round(full_s, 3)},
        "privacy": {"dp_noise": False, "reproducible_from_seed": True, "epsilon": None},
        "versions": _versions(),
        "run_dir": str(rd.path),
    }
    rd.write_json("summary.json", summary)
    _plot(rd, history, preset)
    return summary


def _plot(rd: RunDir, history: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [h for h in history if "HR@10" in h]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("HR@10", "NDCG@10"):
        ax.plot([h["round"] for h in rows], [h[key] for h in rows], marker="o", label=key)
    ax.set_xlabel("round")
    ax.set_ylabel("sampled metric")
    ax.set_title(title)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = rd.file(".metrics.png.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    tmp.replace(rd.file("metrics.png"))


def _format_metrics(name: str, m: dict[str, float] | None) -> str:
    if not m:
        return ""
    keys = [k for k in ("HR@10", "NDCG@10", "Precision@10", "Recall@10", "MRR", "AUC") if k in m]
    return f"{name:<8}" + "  ".join(f"{k} {m[k]:.4f}" for k in keys)


def _main(args: argparse.Namespace) -> int:
    summary = run(args)
    ev = summary["evaluation"]
    print(f"data      {summary['data']['preprocessed']} (positives: {summary['data']['positives']})", file=sys.stderr)
    print(f"protocol  {ev['split'].get('kind', ev['split'])}; {ev['sampled']}; {ev['ties']}", file=sys.stderr)
    print(_format_metrics("sampled", summary["metrics"]))
    if summary["metrics_full"]:
        print(_format_metrics("full", summary["metrics_full"]))
    print(f"seconds {summary['seconds']:.1f}  bytes/client/round {summary['bytes_per_client_per_round']:.0f}  run dir {summary['run_dir']}")
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0
