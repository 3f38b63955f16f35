"""A non-finite training loss stops any protocol's run in the shared loop: a clear message, exit code 3,
and a run directory that stays valid (inspectable, and resumable up to its checkpoint)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.cli import main
from experiments.run.training import _has_non_finite

FEDMF = """
[run]
protocol = "fedmf"
rounds = 6
eval_every = 1
[data]
synthetic_users = 40
synthetic_items = 60
synthetic_mean_interactions = 15
[fedmf.mf]
lr = {lr}
dim = 4
"""

FEDAVG = """
[run]
rounds = 3
eval_every = 1
[data]
synthetic_users = 40
synthetic_items = 80
synthetic_mean_interactions = 10
[eval]
negatives = 10
[fedavg]
dim = 4
lr = {lr}
"""


def run(tmp_path: Path, capsys, text: str, out: str) -> tuple[int, str, Path]:
    cfg = tmp_path / f"{out}.toml"
    cfg.write_text(text)
    code = main(["run", "--config", str(cfg), "--out", str(tmp_path / out), "--quiet"])
    return code, capsys.readouterr().err, tmp_path / out


def test_fedmf_divergence_stops_with_exit_3_and_a_valid_run_directory(tmp_path, capsys):
    code, err, rd = run(tmp_path, capsys, FEDMF.format(lr=0.2), "mf")
    assert code == 3
    assert "training diverged; the run stopped" in err and "fedmf.mf.lr" in err
    rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] is None and math.isfinite(rows[0]["loss"])
    summary = json.loads((rd / "summary.json").read_text())
    bad = summary["diverged"]["round"]
    assert bad == rows[-1]["round"] and summary["metrics"] is None and "diverged" in summary["stopped"]
    ck = summary["diverged"]["checkpoint_round"]
    assert ck == bad - 1 >= 1, "the example must diverge after a good round to test the resume"
    # the directory resumes up to its checkpoint and gives a summary of the last good model
    assert main(["run", "--resume", str(rd), "--rounds", str(ck), "--quiet"]) == 0
    capsys.readouterr()
    done = json.loads((rd / "summary.json").read_text())
    assert done["rounds"] == ck and done["stopped"] is None and math.isfinite(done["metrics"]["RMSE"])
    assert [json.loads(x)["round"] for x in (rd / "metrics.jsonl").read_text().splitlines()] == list(range(1, ck + 1))


def test_fedmf_ldp_divergence_inside_the_round_stops_the_same_way(tmp_path, capsys):
    # the client's own update overflows before its LDP clip: the round raises, the loop stops the run
    text = FEDMF.format(lr=0.5) + '[fedmf]\ndefense = "ldp"\n'
    code, err, rd = run(tmp_path, capsys, text, "ldp")
    assert code == 3, err
    assert "was not finite (clip_l1" in err and "training diverged" in err
    rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] is None
    assert json.loads((rd / "summary.json").read_text())["diverged"]["round"] == rows[-1]["round"]


def test_a_finite_value_error_is_not_taken_for_divergence(tmp_path, capsys, monkeypatch):
    from protocols import fedmf

    def broken(self):
        raise ValueError("a bug, not a divergence")

    monkeypatch.setattr(fedmf.FedMF, "run_round", broken)
    code, err, _ = run(tmp_path, capsys, FEDMF.format(lr=0.005), "bug")
    assert code == 2 and "a bug, not a divergence" in err


def test_fedmf_at_a_small_rate_is_not_stopped(tmp_path, capsys):
    code, err, rd = run(tmp_path, capsys, FEDMF.format(lr=0.005), "ok")
    assert code == 0, err
    assert json.loads((rd / "summary.json").read_text())["stopped"] is None


def test_fedavg_divergence_stops_the_same_way(tmp_path, capsys):
    code, err, rd = run(tmp_path, capsys, FEDAVG.format(lr=1e30), "fa")
    assert code == 3
    assert "the lr key of [fedavg]" in err and "no round was checkpointed" in err
    assert json.loads((rd / "summary.json").read_text())["diverged"]["round"] == 1
    assert (rd / "run.json").is_file() and (rd / "privacy_ledger.sqlite").is_file()


@pytest.mark.parametrize(
    ("state", "bad"),
    [
        ({"p": np.ones(3), "round": 2}, False),
        ({"p": np.array([1.0, np.nan])}, True),
        ({"nested": [{"q": np.array([[np.inf]])}]}, True),
        ({"t": torch.tensor([1.0, float("nan")])}, True),
        ({"t": torch.tensor([1, 2])}, False),
        ({"ids": np.array([1, 2]), "x": 3.0}, False),
        ({"x": float("-inf")}, True),
        ({"text": "nan"}, False),
    ],
)
def test_non_finite_state_detection(state, bad):
    assert _has_non_finite(state) is bad
