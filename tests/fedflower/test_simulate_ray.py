"""`secagg flower simulate` through Flower's simulation engine (Ray): the run directory reports like
`secagg run`, and the model equals the in-process run with the same seed (to float32 rounding, see
fedflower/adapter.py)."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.cli import main as secagg
from experiments.run.rundir import RunDir

from .conftest import run_in_process_and_simulated

CONFIG = """[data]
synthetic_users = 12
synthetic_items = 200
synthetic_mean_interactions = 12
[eval]
negatives = 20
[fedavg]
dim = 4
clients_per_round = 5
[run]
seed = 2
rounds = 2
eval_every = 0
"""


def test_simulation_reports_like_secagg_run_and_gives_the_in_process_model(tmp_path):
    run_in_process_and_simulated(tmp_path, "fedavg-gmf", CONFIG)
    for name in ("run.json", "config.toml", "metrics.jsonl", "costs.jsonl", "transcript.csv", "privacy_ledger.sqlite",
                 "checkpoint.safetensors", "summary.json", "metrics.png"):
        assert (tmp_path / "sim" / name).is_file(), name
    a = RunDir.open_existing(tmp_path / "sim").load_checkpoint()["trainer"]
    b = RunDir.open_existing(tmp_path / "inproc").load_checkpoint()["trainer"]
    for name in ("item", "h", "b"):
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("sim", "inproc"))
    assert sa["runtime"]["engine"] == "flower simulation (ray)" and sa["runtime"]["nodes"] == 12
    for k, v in sb["metrics"].items():
        assert sa["metrics"][k] == pytest.approx(v, abs=1e-9), k
    assert sa["privacy"]["statement"] == sb["privacy"]["statement"]
    assert (tmp_path / "sim" / "transcript.csv").read_text() == (tmp_path / "inproc" / "transcript.csv").read_text()


def test_flower_commands_fail_in_one_line_without_flower(tmp_path):
    import subprocess
    import sys

    code = ("import sys; sys.modules['flwr'] = None\nimport importlib.util\n"
            "importlib.util.find_spec = lambda name, *a: None if name == 'flwr' else __import__('importlib').machinery.PathFinder.find_spec(name)\n"
            "from experiments.cli import main\nsys.exit(main(['flower', 'simulate', 'fedavg-gmf', '--clients', '10']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == ["secagg: error: Flower is not installed: pip install -e '.[flower]' "
                                                "(the flower extra, flwr[simulation]==1.41.0)"]


@pytest.mark.slow
def test_secure_simulation_gives_the_in_process_secure_model(tmp_path):
    """`fedavg-gmf-secagg` through Ray: our SecAgg+ between virtual nodes, the in-process secure model."""
    run_in_process_and_simulated(tmp_path, "fedavg-gmf-secagg", CONFIG)
    a = RunDir.open_existing(tmp_path / "sim").load_checkpoint()["trainer"]
    b = RunDir.open_existing(tmp_path / "inproc").load_checkpoint()["trainer"]
    for name in ("item", "h", "b"):
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("sim", "inproc"))
    assert sa["privacy"]["statement"] == sb["privacy"]["statement"] and "secagg+" in sa["privacy"]["statement"]
    costs = [json.loads(x) for x in (tmp_path / "sim" / "costs.jsonl").read_text().splitlines()]
    assert all(c["dropped"] == 0 and "aborted" not in c for c in costs)


@pytest.mark.slow
def test_a_simulation_resumes_to_the_uninterrupted_model(tmp_path):
    """`secagg flower simulate --resume RUN_DIR`: one round, then resumed to three, equals three straight."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.replace("rounds = 2", "rounds = 3"))
    common = ["--config", str(cfg), "--cpus", "1", "--quiet"]
    assert secagg(["flower", "simulate", "fedavg-gmf", *common, "--out", str(tmp_path / "straight")]) == 0
    assert secagg(["flower", "simulate", "fedavg-gmf", *common, "--rounds", "1", "--out", str(tmp_path / "cut")]) == 0
    assert (tmp_path / "cut" / "flower-nodes").is_dir()
    assert secagg(["flower", "simulate", "--resume", str(tmp_path / "cut"), "--rounds", "3", "--cpus", "1", "--quiet"]) == 0
    a = RunDir.open_existing(tmp_path / "cut").load_checkpoint()["trainer"]
    b = RunDir.open_existing(tmp_path / "straight").load_checkpoint()["trainer"]
    assert a["round"] == b["round"] == 3
    for name in ("item", "h", "b"):
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    rows = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
