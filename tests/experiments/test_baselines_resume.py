"""The baselines of docs/baselines.md resume to exactly the uninterrupted run (checkpoints hold all their state)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from experiments.cli import main

TINY = """
[run]
rounds = 3
[data]
synthetic_users = 30
synthetic_items = 60
synthetic_mean_interactions = 8
[eval]
negatives = 10
"""


def _run(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("preset", ["pmf", "svdpp", "ncf-central", "ncf-fed", "fcf", "metamf"])
def test_resume_equals_the_uninterrupted_run(preset: str, tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    full = _run(capsys, "run", preset, "--config", str(cfg), "--out", str(tmp_path / "full"), "--json", "--quiet")
    _run(capsys, "run", preset, "--config", str(cfg), "--rounds", "1", "--out", str(tmp_path / "part"), "--json",
         "--quiet")
    resumed = _run(capsys, "run", "--resume", str(tmp_path / "part"), "--rounds", "3", "--json", "--quiet")
    assert resumed["metrics"] == full["metrics"]


def test_fedrec_resume_keeps_its_secret_filled_sets(tmp_path: Path, capsys) -> None:
    """FedRec's filled sets come from the CSPRNG (two fresh runs differ), so a resume must restore them:
    two resumes of one checkpoint agree exactly."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    _run(capsys, "run", "fedrec", "--config", str(cfg), "--rounds", "1", "--out", str(tmp_path / "a"), "--json",
         "--quiet")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a = _run(capsys, "run", "--resume", str(tmp_path / "a"), "--rounds", "3", "--json", "--quiet")
    b = _run(capsys, "run", "--resume", str(tmp_path / "b"), "--rounds", "3", "--json", "--quiet")
    assert a["metrics"] == b["metrics"] and set(a["metrics"]) >= {"RMSE", "MAE"}
