"""Flower's simulation engine (Ray backend) around a server function and the adapter's ClientApp.

:func:`simulate` starts ``N`` virtual SuperNodes (partition ``i`` on node ``i``) whose
ClientApp runs in Ray actors, and runs ``server_main(grid)`` as the ServerApp's main in a thread
of this process (so the caller's run loop, run directory and ledger are used unchanged). Each
node's ``Context`` (where a client keeps its user state between rounds) lives in this process
for the whole run.

Resources: Ray is started (by us, with retries: its raylet must register within a fixed 30 s,
which a loaded machine can miss) with ``cpus`` CPUs and each ClientApp call takes one, so at most
``cpus`` clients train at once; Ray's object store is capped at ``object_store_mb`` (Ray's
default takes 30% of RAM, too much on a shared machine). Ray workers inherit ``OMP_NUM_THREADS``
= 1 (one torch thread per actor, as ``secagg run --threads 1``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from fedflower.apps import make_client_app

__all__ = ["simulate"]

#: Ray gives its raylet a fixed 30 s to register; on a loaded machine that can fail, so we retry.
RAY_START_ATTEMPTS = 5


def _start_ray(init_args: dict[str, Any]) -> None:
    """Start Ray before Flower does (Flower reuses a running Ray), retrying a slow raylet start."""
    import sys

    import ray

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join([*sys.path, *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    os.environ["PYTHONPATH"] = pythonpath  # the actors import this package as the driver does
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init_args)
            return
        except Exception:  # noqa: BLE001 - Ray raises a bare Exception when its raylet starts too slowly
            ray.shutdown()
            if attempt == RAY_START_ATTEMPTS:
                raise


def simulate(server_main: Callable[[Grid], Any], *, partition_dir: str | Path, nodes: int, cpus: int = 2,
             object_store_mb: int = 256, verbose: bool = False, state_dir: str | Path | None = None) -> Any:
    """Run ``server_main(grid)`` against ``nodes`` virtual clients; returns what it returned.

    ``state_dir``: where each virtual node keeps its own store of its user state (resume).

    Raises whatever ``server_main`` raised (after the engine has shut down).
    """
    if nodes < 1:
        raise ValueError(f"--clients must be >= 1; found {nodes}")
    if cpus < 1:
        raise ValueError(f"--cpus must be >= 1; found {cpus}")
    result: dict[str, Any] = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        result["value"] = server_main(grid)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    backend = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": int(cpus), "num_gpus": 0, "object_store_memory": int(object_store_mb) * 2**20,
                      "include_dashboard": False, "logging_level": logging.WARNING if not verbose else logging.INFO,
                      "log_to_driver": bool(verbose)},
    }
    _start_ray(backend["init_args"])
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    if not verbose:
        flwr_log.setLevel(logging.ERROR)
    try:
        run_simulation(server_app=app, client_app=make_client_app(partition_dir, state_dir=state_dir),
                       num_supernodes=int(nodes),
                       backend_config=backend)
    finally:
        flwr_log.setLevel(level)
    return result.get("value")
