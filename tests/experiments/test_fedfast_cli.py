"""``secagg run`` with the FedFast presets and ``secagg attack fedfast``: JSON contracts, resume, errors."""

from __future__ import annotations

import json

import pytest

from experiments.cli import main

TINY = """
[run]
rounds = {rounds}
eval_every = 1
[data]
synthetic_users = 40
synthetic_items = 60
synthetic_mean_interactions = 8
[eval]
negatives = 20
full_ranking = false
[fedfast]
dim = 6
clients_per_round = 6
clusters = 3
kmeans_init_iters = 2
"""


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("preset", ["fedfast", "fedfast-sampling-only", "fedfast-aggregation-only", "fedfast-fedavg",
                                    "fedfast-secagg"])
def test_presets_run(tmp_path, capsys, preset):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY.format(rounds=2))
    out = _json(capsys, ["run", preset, "--config", str(cfg), "--out", str(tmp_path / "r"), "--json", "--quiet"])
    assert out["preset"] == preset and 0 <= out["metrics"]["HR@10"] <= 1


def test_resume_continues_to_the_same_result(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY.format(rounds=3))
    whole = _json(capsys, ["run", "fedfast", "--config", str(cfg), "--out", str(tmp_path / "w"), "--json", "--quiet"])
    assert main(["run", "fedfast", "--config", str(cfg), "--rounds", "1", "--out", str(tmp_path / "p"), "--quiet"]) == 0
    capsys.readouterr()
    resumed = _json(capsys, ["run", "--resume", str(tmp_path / "p"), "--rounds", "3", "--json", "--quiet"])
    assert resumed["metrics"] == whole["metrics"]


def test_attack_json_contract_both_defenses(capsys):
    tiny = ["attack", "fedfast", "--users", "20", "--items", "40", "--rounds", "1", "--clients-per-round", "8",
            "--clusters", "3", "--json"]
    plain = _json(capsys, tiny)["attack"]
    assert set(plain) >= {"f1", "precision", "recall", "random_f1", "status", "changed_set_f1", "magnitude_f1"}
    assert plain["status"] == "ok" and plain["f1"] > 0.9 > plain["random_f1"]
    masked = _json(capsys, [*tiny, "--defense", "secagg"])["attack"]
    assert "masked" in masked["status"] and masked["changed_set_f1"] is None


def test_attack_user_errors_exit_2(capsys):
    assert main(["attack", "fedfast", "--rounds", "0"]) == 2
    assert main(["attack", "fedfast", "--clients-per-round", "0", "--users", "10", "--items", "20"]) == 2
    err = capsys.readouterr().err
    assert "--rounds" in err and "--clients-per-round" in err and "Traceback" not in err
