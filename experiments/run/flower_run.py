"""``secagg run``'s loop on Flower: the same run directory, ledger and report, clients on Flower nodes.

Imported only by ``experiments/cli/cmd_flower.py`` (lazily) and by the deployment ServerApp
(``experiments.run.flower_app``), never by ``experiments.cli``: Flower is an optional extra.

The harness (this module) is the experimenter, not a protocol party: like ``secagg run`` it
prepares the data (to write each client's partition, and to evaluate), then hands the protocol's
*server* only the census (who takes part, :func:`fedflower.adapter.build_server_trainer`). Each
client trains on its own partition on its Flower node. Evaluation asks each evaluated user's node
to score its candidates with its own user state (the scores come back to the harness, exactly
what ``secagg run`` evaluates in-process).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.run import config as cfgmod
from experiments.errors import UserError
from experiments.run.prepare import Prepared, prepare_data
from experiments.run.rundir import default_run_dir
from experiments.run.training import RunRequest, _loop, _open
from fedflower.adapter import (
    PartitionMeta,
    build_server_trainer,
    check_runs_on_flower,
    public_units,
    write_partitions,
)
from fedflower.apps import GridTrainer
from protocols.transport import InProcessTransport, Transcript

__all__ = ["NODE_STATE_DIR", "check_protocol", "execute_on_grid", "prepare_for_flower", "simulate_run",
           "write_run_partitions"]

#: In simulation, the virtual nodes' own stores of their user state (what lets a run resume) are
#: kept in this folder of the run directory: the harness hosts every virtual node's disk.
NODE_STATE_DIR = "flower-nodes"


def check_protocol(config: cfgmod.RunConfig) -> None:
    """Refuse a protocol the adapter cannot run, in words, before anything starts."""
    spec = config.spec
    if config.audit.canaries:
        raise UserError("audit.canaries: the audit's canary users are planted by 'secagg run' in process only, not on "
                        "Flower yet (docs/audit.md); set audit.canaries = 0 here")
    try:
        check_runs_on_flower(spec, config.protocol_config)
    except ValueError as exc:
        raise UserError(f"{exc} (see docs/flower.md)") from None
    if spec.exchanges is not None:  # the protocol's own check said which of its settings separate
        return
    if config.protocol_config.secure_aggregation not in ("none", "secagg", "secagg+"):
        raise UserError(
            f"{spec.section}.secure_aggregation = {config.protocol_config.secure_aggregation!r} does not run on Flower "
            "yet; use 'secagg+' (preset fedavg-gmf-secagg), 'secagg' or 'none' (see docs/flower.md)"
        )


def write_run_partitions(config: cfgmod.RunConfig, prep: Prepared, directory: str | Path) -> PartitionMeta:
    """Each client's partition file; for a protocol made of units (FEL), with each client's public unit."""
    train = prep.split.train
    units = public_units(config.spec, config.protocol_config, config.run.seed, train, config.data.source)
    return write_partitions(train, prep.exclude, directory, units=units)


def prepare_for_flower(config: cfgmod.RunConfig, eval_users: int | None) -> Prepared:
    """``prepare_data``, with the sampled evaluation limited to ``eval_users`` seeded users if given."""
    prep = prepare_data(config)
    if eval_users is not None and prep.candidates is not None and eval_users < len(prep.candidates):
        if eval_users < 1:
            raise UserError(f"--eval-users must be >= 1; found {eval_users}")
        pick = np.sort(np.random.default_rng([config.run.seed, 15]).choice(len(prep.candidates), eval_users, replace=False))
        prep = dataclasses.replace(prep, candidates=prep.candidates.take(pick))
    return prep


def execute_on_grid(req: RunRequest, prep: Prepared, meta: PartitionMeta, grid: Any, *, timeout: float,
                    assign: bool, runtime: dict[str, Any], resumable: bool = False) -> dict[str, Any]:
    """The run loop of ``secagg run`` with a :class:`fedflower.apps.GridTrainer` as the trainer."""
    cfg = req.config
    server = build_server_trainer(cfg.spec, cfg.protocol_config, cfg.run.seed, meta,
                                  transport=InProcessTransport(Transcript()), user_ids=prep.split.train.user_ids,
                                  item_ids=prep.split.train.item_ids,
                                  source=cfg.data.source)
    t0 = time.perf_counter()
    trainer = GridTrainer(grid, server, protocol=cfg.run.protocol, seed=cfg.run.seed, meta=meta,
                          timeout=timeout, assign=assign, resumable=resumable, source=cfg.data.source)
    runtime = {**runtime, "nodes": len(trainer.node_of), "connect_seconds": round(time.perf_counter() - t0, 3)}
    rd, run_id, elapsed = _open(req, prep, trainer)
    try:
        summary = _loop(req, rd, prep, trainer, run_id, elapsed)
        summary["runtime"] = runtime
        rd.write_json("summary.json", summary)
        return summary
    finally:
        rd.unlock()


def simulate_run(req: RunRequest, *, cpus: int, timeout: float, eval_users: int | None,
                 partition_dir: Path | None = None, object_store_mb: int = 256) -> dict[str, Any]:
    """``secagg flower simulate``: partitions, then Flower's simulation engine, then the summary."""
    from importlib import metadata

    from fedflower.simulate import simulate

    cfg = req.config
    check_protocol(cfg)
    if req.resume is None and req.out is None:  # fixed now: the virtual nodes' stores live inside it
        req = dataclasses.replace(req, out=default_run_dir(req.preset))
    state_dir = Path(req.resume or req.out) / NODE_STATE_DIR
    if eval_users is not None:
        cfg = cfgmod.merge(cfg, {"eval": {"full_ranking": False}}) if cfg.eval.negatives else cfg
        req = dataclasses.replace(req, config=cfg)
    prep = prepare_for_flower(cfg, eval_users)
    tmp = None
    if partition_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="secagg-flower-parts-"))
        partition_dir = tmp
    try:
        t0 = time.perf_counter()
        meta = write_run_partitions(cfg, prep, partition_dir)
        runtime = {"engine": "flower simulation (ray)", "flwr": metadata.version("flwr"), "cpus": cpus,
                   "timeout": timeout, "partition_seconds": round(time.perf_counter() - t0, 3),
                   "eval_users": None if prep.candidates is None else len(prep.candidates)}
        return simulate(
            lambda grid: execute_on_grid(req, prep, meta, grid, timeout=timeout, assign=True, runtime=runtime,
                                         resumable=True),
            partition_dir=partition_dir, nodes=meta.clients, cpus=cpus, object_store_mb=object_store_mb,
            state_dir=state_dir,
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
