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
kmeans_init_iters = 1
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


def test_attack_json_contract_both_defenses(tmp_path, capsys):
    """The wrapper makes a run (kept in --out) and prints attack_run_dir's findings: plaintext leaks,
    SecAgg+ scores exactly at the stronger baseline (advantage 0), never below it."""
    tiny = ["attack", "fedfast", "--users", "20", "--items", "40", "--rounds", "1", "--clients-per-round", "8",
            "--clusters", "3", "--json"]
    plain_out = _json(capsys, [*tiny, "--out", str(tmp_path / "p")])
    plain = plain_out["attack"]
    keys = {"attack", "role", "target", "metric", "value", "random", "public", "advantage", "interval", "extra"}
    assert set(plain) >= keys and plain["attack"] == "fedfast-ik" and plain["metric"] == "f1"
    assert plain["status"] == "ok" and plain["value"] > 0.9 > plain["random"] and plain["advantage"] > 0.5
    assert 0 <= plain["extra"]["changed_set_f1"] < plain["value"]
    assert (tmp_path / "p" / "attacks.json").is_file() and plain_out["findings"][0] == plain
    masked = _json(capsys, [*tiny, "--defense", "secagg", "--out", str(tmp_path / "s")])["attack"]
    assert masked["status"].startswith("nothing usable") and "changed_set_f1" not in masked["extra"]
    assert masked["advantage"] == 0.0 and masked["value"] == max(masked["random"], masked["public"])


def test_attack_user_errors_exit_2(tmp_path, capsys):
    assert main(["attack", "fedfast", "--rounds", "0", "--out", str(tmp_path / "a")]) == 2
    assert main(["attack", "fedfast", "--clients-per-round", "0", "--users", "10", "--items", "20"]) == 2
    err = capsys.readouterr().err
    assert "--rounds" in err and "--clients-per-round" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists()  # refused before a run directory is made


def _fake_run(path, values):
    path.mkdir()
    lines = [json.dumps({"round": r, "loss": 0.5}) for r in range(1, 3)]
    lines += [json.dumps({"round": r, "HR@10": v, "loss": 0.1}) for r, v in values]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_compare_reports_rounds_to_the_first_runs_best(tmp_path, capsys):
    _fake_run(tmp_path / "fedavg", [(10, 0.3), (20, 0.5), (30, 0.45)])
    _fake_run(tmp_path / "fast", [(10, 0.52), (20, 0.6)])
    _fake_run(tmp_path / "slow", [(10, 0.1), (20, 0.2)])
    png = tmp_path / "c.png"
    out = _json(capsys, ["compare", *(str(tmp_path / n) for n in ("fedavg", "fast", "slow")), "--png", str(png), "--json"])
    assert out["target"] == 0.5 and png.stat().st_size > 0
    got = {r["run"].rsplit("/", 1)[-1]: r for r in out["runs"]}
    assert got["fedavg"]["rounds_to_target"] == 20 and got["fedavg"]["final"] == 0.45
    assert got["fast"]["rounds_to_target"] == 10 and got["fast"]["best_round"] == 20
    assert got["slow"]["rounds_to_target"] is None
    assert main(["compare", str(tmp_path / "fast"), "--metric", "NDCG@10"]) == 2
    assert main(["compare", str(tmp_path / "missing")]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_compare_paired_with_gives_seed_paired_statistics_against_scipy(tmp_path, capsys):
    from scipy import stats

    bases = [[(10, 0.30), (20, 0.50), (30, 0.55)], [(10, 0.40), (20, 0.52), (30, 0.50)], [(10, 0.2), (20, 0.6)]]
    runs = [[(10, 0.56), (20, 0.60), (30, 0.61)], [(10, 0.45), (20, 0.53), (30, 0.54)], [(10, 0.3), (20, 0.5)]]
    for i, (b, r) in enumerate(zip(bases, runs)):
        _fake_run(tmp_path / f"base{i}", b)
        _fake_run(tmp_path / f"run{i}", r)
    argv = ["compare", *(str(tmp_path / f"run{i}") for i in range(3)), "--paired-with",
            *(str(tmp_path / f"base{i}") for i in range(3)), "--png", str(tmp_path / "p.png"), "--json"]
    out = _json(capsys, argv)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert [p["target"] for p in out["pairs"]] == [0.55, 0.52, 0.6]
    assert [p["baseline_rounds"] for p in out["pairs"]] == [30, 20, 20]
    assert [p["rounds"] for p in out["pairs"]] == [10, 20, 20] and [p["reached"] for p in out["pairs"]] == [True, True, False]
    finals, base_finals = [0.61, 0.54, 0.5], [0.55, 0.50, 0.6]
    assert out["final"]["t_test_p"] == pytest.approx(stats.ttest_rel(finals, base_finals).pvalue)
    assert out["final"]["mean_diff"] == pytest.approx((0.06 + 0.04 - 0.1) / 3, abs=1e-12)
    assert out["rounds"]["wins"] == 0 and out["rounds"]["losses"] == 1 and out["rounds"]["ties"] == 2
    assert out["rounds"]["t_test_p"] == pytest.approx(stats.ttest_rel([10, 20, 20], [30, 20, 20]).pvalue)
    assert main(["compare", str(tmp_path / "run0"), "--paired-with", str(tmp_path / "base0"),
                 str(tmp_path / "base1")]) == 2
