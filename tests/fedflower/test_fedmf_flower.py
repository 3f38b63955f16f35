"""FedMF end to end on a loopback Flower grid (the lead's exchange apps), against ``secagg run``.

There is no FedMF preset yet, so the run is the ``fedavg-gmf`` preset with ``run.protocol =
"fedmf"`` (its ``[data]`` and ``[eval]`` sections, rating split, RMSE/MAE). Plaintext FedMF on
Flower gives the in-process model bit for bit and the same transcript byte for byte; the held-out
metrics come from each node scoring its own ratings.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from experiments import config as cfgmod
from experiments.flower_run import execute_on_grid, prepare_for_flower, write_run_partitions
from experiments.rundir import RunDir
from experiments.training import RunRequest
from fedflower.apps import make_client_app
from fedflower.loopback import LoopbackGrid

logging.getLogger("flwr").setLevel(logging.ERROR)

SMALL = """
[data]
synthetic_users = 12
synthetic_items = 60
synthetic_mean_interactions = 8
[run]
protocol = "fedmf"
rounds = 2
eval_every = 1
[fedmf]
rating_scale = [1.0, 5.0]
[fedmf.mf]
dim = 4
"""


def _flower(preset: str, config: Path, out: Path, parts: Path) -> dict:
    cfg = cfgmod.load_config_file(config, base=cfgmod.load_preset(preset))
    prep = prepare_for_flower(cfg, None)
    meta = write_run_partitions(cfg, prep, parts)
    grid = LoopbackGrid(make_client_app(parts), [6000 + 3 * i for i in range(meta.clients)])
    req = RunRequest(preset=preset, config=cfg, out=out, quiet=True)
    return execute_on_grid(req, prep, meta, grid, timeout=60, assign=True, runtime={"engine": "loopback"})


def test_plaintext_fedmf_on_flower_is_the_in_process_run(tmp_path):
    from experiments.cli import main as secagg

    config = tmp_path / "small.toml"
    config.write_text(SMALL)
    assert secagg(["run", "fedavg-gmf", "--config", str(config), "--out", str(tmp_path / "inproc"), "--quiet"]) == 0
    _flower("fedavg-gmf", config, tmp_path / "flower", tmp_path / "parts")
    a, b = (RunDir.open_existing(tmp_path / d).load_checkpoint()["trainer"] for d in ("flower", "inproc"))
    assert a["round"] == b["round"] == 2
    np.testing.assert_array_equal(np.asarray(a["q"]), np.asarray(b["q"]))  # p stays on the nodes
    costs = [[json.loads(x) for x in (tmp_path / d / "costs.jsonl").read_text().splitlines()] for d in ("flower", "inproc")]
    assert [(r["clients"], r["bytes_per_client"]) for r in costs[0]] == [(r["clients"], r["bytes_per_client"])
                                                                         for r in costs[1]]
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("flower", "inproc"))
    for k, v in sb["metrics"].items():  # each node scores its own held-out ratings
        assert abs(sa["metrics"][k] - v) <= 1e-6 * max(1.0, abs(v)), k
    assert (tmp_path / "flower" / "transcript.csv").read_text() == (tmp_path / "inproc" / "transcript.csv").read_text()
