"""``secagg run`` with the FedCL presets: the per-user privacy report, and resume of the noise-free
Fed baseline equal to the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.cli import main

TINY = """
[run]
rounds = {rounds}
eval_every = 2
[data]
synthetic_users = 50
synthetic_items = 100
synthetic_mean_interactions = 10
[eval]
negatives = 20
[fedcl]
dim = 8
max_len = 8
clients_per_round = 8
clusters = 4
secure_aggregation = "{secure}"
{extra}
"""


def cfg(tmp_path: Path, rounds: int, secure: str = "secagg+", extra: str = "") -> Path:
    p = tmp_path / f"c{rounds}{secure}{len(extra)}.toml"
    p.write_text(TINY.format(rounds=rounds, secure=secure, extra=extra))
    return p


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_fedcl_run_and_per_user_privacy_report(tmp_path, capsys):
    assert main(["run", "fedcl", "--config", str(cfg(tmp_path, 3)), "--out", str(tmp_path / "r"), "--json", "--quiet"]) == 0
    summary = last_json(capsys)
    assert summary["metrics_full"]["HR@10"] >= 0
    assert main(["privacy", "report", str(tmp_path / "r"), "--json"]) == 0
    rep = last_json(capsys)
    per = rep["per_user"]
    assert per["users"] == 50 and per["uploads"]["min"] == 1 and per["epsilon_per_upload"] == [4.0]
    assert per["epsilon_basic"]["max"] == 4.0 * per["uploads"]["max"] and per["accountant"] in ("pure", "rdp", "pld")
    assert rep["epsilon"] == "inf"  # the model updates carry no DP, and the report says so
    # beside the ledger's: what the clients counted themselves (the checkpoint of an in-process run)
    mine = rep["clients_ldp"]
    assert mine["clients"] == mine["ledger"] and mine["ledger"]["max"] == per["epsilon_basic"]["max"]
    assert mine["ledger"]["median"] == per["epsilon_basic"]["median"] and mine["ledger"]["users"] == 50
    assert mine["users_counted_more_than_the_ledger"] == mine["users_counted_less_than_the_ledger"] == 0
    assert "last checkpoint" in mine["source"] and "before it computes" in mine["note"]
    assert main(["privacy", "report", str(tmp_path / "r")]) == 0
    text = capsys.readouterr().out
    assert f"the clients' own count: median epsilon {mine['clients']['median']:.6g}, max {mine['clients']['max']:.6g}" in text
    assert "every user's own count equals the ledger's" in text and "where they may differ" in text


def test_a_resumed_run_keeps_the_clients_counts_and_their_operators_budget(tmp_path, capsys):
    """``[clients] ldp_epsilon_budget = 8`` with every client in every round: two uploads at epsilon 4,
    then the clients refuse. The checkpoint carries their counts, so a resumed run does not reset
    them: after four rounds (two of them resumed) no user has more than two uploads in the ledger,
    the refusals are in costs.jsonl, and the clients' count equals the ledger's."""
    config = cfg(tmp_path, 2, "none", "[clients]\nldp_epsilon_budget = 8.0")
    config.write_text(config.read_text().replace("clients_per_round = 8", "clients_per_round = 50"))
    assert main(["run", "fedcl", "--config", str(config), "--out", str(tmp_path / "r"), "--json", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(tmp_path / "r"), "--rounds", "4", "--json", "--quiet"]) == 0
    capsys.readouterr()
    costs = [json.loads(x) for x in (tmp_path / "r" / "costs.jsonl").read_text().splitlines()]
    assert [c["uploads"] for c in costs] == [50, 50, 0, 0]
    assert [c["dropped_clients"] for c in costs[2:]] == [50, 50]
    assert main(["privacy", "report", str(tmp_path / "r"), "--json"]) == 0
    rep = last_json(capsys)
    assert rep["per_user"]["uploads"]["max"] == 2 and rep["per_user"]["epsilon_basic"]["max"] == 8.0
    assert rep["clients_ldp"]["clients"] == rep["clients_ldp"]["ledger"] == {"users": 50, "median": 8.0, "max": 8.0}


def test_fed_baseline_resume_equals_the_uninterrupted_run(tmp_path, capsys):
    extra = "semi_hard = 0\nin_batch = false"
    assert main(["run", "fed-local-negatives", "--config", str(cfg(tmp_path, 4, "none", extra)), "--out",
                 str(tmp_path / "whole"), "--json", "--quiet"]) == 0
    whole = last_json(capsys)
    assert main(["run", "fed-local-negatives", "--config", str(cfg(tmp_path, 2, "none", extra)), "--out",
                 str(tmp_path / "part"), "--json", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(tmp_path / "part"), "--rounds", "4", "--json", "--quiet"]) == 0
    resumed = last_json(capsys)
    assert resumed["metrics_full"] == whole["metrics_full"] and resumed["metrics"] == whole["metrics"]


FEDCL_PRESETS = ["fedcl", "fedcl-ncf", "fed-local-negatives", "centralized-gru", "fedcl-no-semihard", "fedcl-no-inbatch",
                 "fedcl-no-local", "fedcl-no-cluster", "fedcl-kmeans", "fedcl-hardest", "centralized-sasrec", "fedcl-sasrec",
                 "fed-logq"]


def test_every_fedcl_preset_runs_a_round(tmp_path, capsys):
    small = TINY.format(rounds=1, secure="none", extra="").replace("eval_every = 2", "eval_every = 1")
    small = small.replace('secure_aggregation = "none"\n', "")  # keep each preset's own secure aggregation
    (tmp_path / "tiny.toml").write_text(small)
    for preset in FEDCL_PRESETS:
        code = main(["run", preset, "--config", str(tmp_path / "tiny.toml"), "--out", str(tmp_path / preset), "--json", "--quiet"])
        summary = last_json(capsys)
        assert code == 0 and summary["preset"] == preset and summary["metrics_full"]["HR@10"] >= 0
