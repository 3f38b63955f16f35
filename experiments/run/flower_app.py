"""The deployment ServerApp (``experiments.run.flower_app:server_app``; the app in ``flower-app/``).

``flwr run flower-app CONNECTION --run-config "preset='fedavg-gmf' partition-dir='DIR' out='RUN_DIR'"``
submits it to a SuperLink; it runs ``secagg run``'s loop (run directory, ledger, metrics,
summary) with the clients on the SuperNodes, each started with
``--node-config "partition-id=I partition-dir='DIR'"`` on partitions written by
``secagg flower partition`` (docs/flower.md). Run config keys (``[tool.flwr.app.config]``):
``preset``, ``config`` (a TOML file overriding the preset, or ""), ``partition-dir``, ``out`` (the
run directory), ``seed`` and ``rounds`` (-1: the preset's), ``timeout`` (seconds per round),
``resume`` (a run directory to continue from its checkpoint, or ""; every SuperNode must have been
started with a ``state-dir`` in its node config, where it keeps its user state between runs).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from experiments.run import config as cfgmod
from experiments.errors import UserError
from experiments.run.flower_run import check_protocol, execute_on_grid
from experiments.run.prepare import prepare_data
from experiments.run.rundir import RunDir
from experiments.run.training import RunRequest
from fedflower.adapter import partition_meta

__all__ = ["server_app"]

server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    resume = str(rc.get("resume", "")) or None
    if resume:  # the run's own saved config; only rounds may change (as secagg run --resume)
        rd = RunDir.open_existing(Path(resume))
        config = cfgmod.load_config_file(rd.file("config.toml"))
        preset = str(rd.read_json("run.json").get("preset", "custom"))
    else:
        preset = str(rc.get("preset", "fedavg-gmf"))
        config = cfgmod.load_preset(preset)
        if str(rc.get("config", "")):
            config = cfgmod.load_config_file(str(rc["config"]), base=config)
    over: dict = {}
    if int(rc.get("seed", -1)) >= 0 and not resume:
        over.setdefault("run", {})["seed"] = int(rc["seed"])
    if int(rc.get("rounds", -1)) >= 0:
        over.setdefault("run", {})["rounds"] = int(rc["rounds"])
    config = cfgmod.merge(config, over) if over else config
    check_protocol(config)
    meta = partition_meta(str(rc["partition-dir"]))
    prep = prepare_data(config)
    train = prep.split.train
    if (meta.n_users, meta.n_items) != (train.n_users, train.n_items) or meta.clients != len(set(train.users.tolist())):
        raise UserError(f"the partitions in {rc['partition-dir']} were written for another configuration "
                        f"({meta.n_users} users, {meta.n_items} items); rewrite them with secagg flower partition")
    out = str(rc.get("out", "")) or None
    req = RunRequest(preset=preset, config=config, out=None if resume or not out else Path(out),
                     resume=Path(resume) if resume else None, quiet=True)
    execute_on_grid(req, prep, meta, grid, timeout=float(rc.get("timeout", 600.0)), assign=False,
                    runtime={"engine": "flower deployment (SuperLink + SuperNodes)", "flwr": metadata.version("flwr")})
