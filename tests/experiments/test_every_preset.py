"""Every preset runs a round on tiny synthetic data, and its run directory gives a privacy report.

Guards the registry contract for every protocol that lands (issue 9, item 3: the report works on
every run directory): a preset whose protocol cannot build, run, checkpoint or account one round
fails here by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.run import config as cfgmod
from experiments.cli import main

TINY = """
[run]
rounds = 1
[data]
synthetic_users = 30
synthetic_items = 60
synthetic_mean_interactions = 8
[eval]
negatives = 10
"""


@pytest.mark.parametrize("preset", cfgmod.PRESETS)
def test_preset_runs_a_round_and_reports_its_privacy(preset: str, tmp_path: Path, capsys) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    run = tmp_path / "run"
    assert main(["run", preset, "--config", str(config), "--out", str(run), "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    trains = cfgmod.load_preset(preset).spec.trains  # fixed baselines (ItemPop, random) have no rounds
    assert summary["preset"] == preset and (run / "checkpoint.safetensors").exists() == trains
    assert main(["privacy", "report", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "epsilon" in report and report["delta"] > 0
