"""``secagg run``: summary contract, reproducibility, resume after a kill, and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.cli import main

TINY = """
[run]
rounds = {rounds}
eval_every = 2
[data]
synthetic_users = 60
synthetic_items = 120
synthetic_mean_interactions = 12
[eval]
negatives = 20
[fedavg]
dim = 8
"""


def tiny_config(tmp_path: Path, rounds: int = 4, extra: str = "") -> Path:
    path = tmp_path / f"tiny-{rounds}.toml"
    path.write_text(TINY.format(rounds=rounds) + extra)
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_writes_the_run_directory_and_json_summary(tmp_path, capsys):
    out_dir = tmp_path / "run"
    code, out, _ = run_cli(capsys, "run", "--config", str(tiny_config(tmp_path)), "--out", str(out_dir), "--json", "--quiet")
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    for key in ("metrics", "metrics_full", "seed", "versions", "bytes_per_client_per_round", "seconds", "evaluation"):
        assert key in summary
    assert set(summary["metrics"]) >= {"HR@10", "NDCG@10", "Precision@10", "Recall@10", "MRR", "AUC"}
    assert 0.0 <= summary["metrics"]["NDCG@10"] <= summary["metrics"]["HR@10"] <= 1.0
    n_items = int(summary["data"]["preprocessed"].split(" items")[0].split()[-1])
    assert summary["bytes_per_client_per_round"] == 2 * 4 * (n_items * 8 + 8 + 1) + 4  # float32 model down + update up
    assert "ties count against" in summary["evaluation"]["ties"]
    assert summary["data"]["positives"] == "every rating"
    for name in ("run.json", "config.toml", "metrics.jsonl", "costs.jsonl", "checkpoint.safetensors", "privacy_ledger.sqlite", "summary.json", "metrics.png"):
        assert (out_dir / name).is_file(), name
    assert (out_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out_dir / "summary.json").read_text())["metrics"] == summary["metrics"]
    assert len((out_dir / "costs.jsonl").read_text().splitlines()) == 4
    rows = (out_dir / "transcript.csv").read_text().splitlines()
    assert rows[0] == "round,party,sent_bytes,received_bytes"
    server_rows = [r.split(",") for r in rows[1:] if r.split(",")[1] == "server"]
    assert [int(r[0]) for r in server_rows] == [0, 1, 2, 3]
    clients = [r for r in rows[1:] if r.split(",")[1].startswith("client:") and r.startswith("0,")]
    assert len(clients) == 60  # every client took part in round 0 (client_fraction 1.0)
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".")]  # no temporary leftovers


def test_same_seed_same_metrics_and_other_seed_differs(tmp_path, capsys):
    cfg = str(tiny_config(tmp_path))
    results = []
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        code, out, _ = run_cli(capsys, "run", "--config", cfg, "--seed", seed, "--out", str(tmp_path / name), "--json", "--quiet")
        assert code == 0
        results.append(json.loads(out.splitlines()[-1]))
    assert results[0]["metrics"] == results[1]["metrics"]
    assert results[0]["metrics_full"] == results[1]["metrics_full"]
    assert results[0]["metrics"] != results[2]["metrics"]


@pytest.mark.parametrize("preset", ["itempop", "random", "centralized-gmf", "fedavg-gmf-secagg"])
def test_presets_run(tmp_path, capsys, preset):
    cfg = tiny_config(tmp_path, rounds=2)
    code, out, _ = run_cli(capsys, "run", preset, "--config", str(cfg), "--out", str(tmp_path / preset), "--json", "--quiet")
    assert code == 0
    summary = json.loads(out.splitlines()[-1])
    assert summary["preset"] == preset
    assert 0 <= summary["metrics"]["HR@10"] <= 1


def test_resume_continues_to_the_same_result(tmp_path, capsys):
    cfg = str(tiny_config(tmp_path, rounds=4))
    code, out, _ = run_cli(capsys, "run", "--config", cfg, "--out", str(tmp_path / "full"), "--json", "--quiet")
    full = json.loads(out.splitlines()[-1])
    code, _, _ = run_cli(capsys, "run", "--config", cfg, "--rounds", "2", "--out", str(tmp_path / "part"), "--quiet")
    assert code == 0
    code, out, _ = run_cli(capsys, "run", "--resume", str(tmp_path / "part"), "--rounds", "4", "--json", "--quiet")
    assert code == 0
    resumed = json.loads(out.splitlines()[-1])
    assert resumed["metrics"] == full["metrics"]
    assert resumed["metrics_full"] == full["metrics_full"]
    rows = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    code, _, err = run_cli(capsys, "run", "--resume", str(tmp_path / "part"), "--rounds", "3", "--quiet")
    assert code == 2 and "already completed 4 rounds" in err
    assert "rounds = 4" in (tmp_path / "part" / "config.toml").read_text()  # the refused resume changed nothing


def test_resume_after_kill_loses_nothing(tmp_path, capsys):
    """Kill a real ``secagg run`` process mid-run, resume it, and get the uninterrupted result."""
    cfg = str(tiny_config(tmp_path, rounds=300))
    out_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "run", "--config", cfg, "--out", str(out_dir), "--quiet"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        costs = out_dir / "costs.jsonl"
        if costs.exists() and len(costs.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len((out_dir / "costs.jsonl").read_text().splitlines())
    assert 5 <= done < 300, "the run finished before it could be killed"
    assert not (out_dir / "summary.json").exists()
    code, out, _ = run_cli(capsys, "run", "--resume", str(out_dir), "--json", "--quiet")
    assert code == 0
    resumed = json.loads(out.splitlines()[-1])
    code, out, _ = run_cli(capsys, "run", "--config", cfg, "--out", str(tmp_path / "whole"), "--json", "--quiet")
    whole = json.loads(out.splitlines()[-1])
    assert resumed["metrics"] == whole["metrics"]
    assert len((out_dir / "costs.jsonl").read_text().splitlines()) == 300
    assert (out_dir / "transcript.csv").read_text() == (tmp_path / "whole" / "transcript.csv").read_text()


@pytest.mark.parametrize(
    "extra, message",
    [
        ("[fedavg]\nlrr = 0.1\n", "unknown key 'fedavg.lrr'"),
        ("[nonsense]\nx = 1\n", "unknown section [nonsense]"),
        ("[fedavg]\nlr = -1.0\n", "fedavg.lr"),
        ("[run]\nseed = \"zero\"\n", "run.seed"),
        ("[data]\nmin_user_interactions = 1\n", "data.min_user_interactions"),
    ],
)
def test_bad_config_is_refused_naming_the_key(tmp_path, capsys, extra, message):
    path = tmp_path / "bad.toml"
    path.write_text(extra)
    out_dir = tmp_path / "never"
    code, _, err = run_cli(capsys, "run", "--config", str(path), "--out", str(out_dir))
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert not out_dir.exists()


def test_bad_data_fails_cleanly_and_writes_nothing(tmp_path, capsys):
    out_dir = tmp_path / "never"
    code, _, err = run_cli(capsys, "run", "--data", str(tmp_path / "missing" / "ratings.csv"), "--out", str(out_dir))
    assert code == 2 and "missing" in err and not out_dir.exists()
    bad = tmp_path / "ratings.csv"
    bad.write_text("userId,movieId,rating,timestamp\n1,10,4.0,100\n1,11,nan,101\n")
    code, _, err = run_cli(capsys, "run", "--data", str(bad), "--out", str(out_dir))
    assert code == 2 and "ratings.csv" in err and ":3" in err and not out_dir.exists()


def test_existing_run_dir_is_refused(tmp_path, capsys):
    out_dir = tmp_path / "busy"
    out_dir.mkdir()
    (out_dir / "something").write_text("x")
    code, _, err = run_cli(capsys, "run", "--config", str(tiny_config(tmp_path)), "--out", str(out_dir))
    assert code == 2 and "not empty" in err and "--resume" in err


def test_unknown_preset_lists_the_presets(tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", "fedsgd", "--out", str(tmp_path / "x"))
    assert code == 2 and "fedavg-gmf" in err and "itempop" in err


def test_help_on_every_command():
    for argv in (["--help"], ["run", "--help"], ["data", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0


@pytest.mark.realdata
def test_itempop_on_movielens_small_matches_the_reference(ml_latest_small, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "run", "itempop", "--data", str(ml_latest_small), "--out", str(tmp_path / "pop"), "--json", "--quiet")
    summary = json.loads(out.splitlines()[-1])
    assert 0.57 <= summary["metrics"]["HR@10"] <= 0.66  # reference: 0.60
    assert summary["evaluation"]["users_evaluated"] == 610


@pytest.mark.slow
def test_default_job_learns_beyond_popularity(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "run", "--out", str(tmp_path / "default"), "--json", "--quiet")
    fed = json.loads(out.splitlines()[-1])
    code, out, _ = run_cli(capsys, "run", "itempop", "--out", str(tmp_path / "pop"), "--json", "--quiet")
    pop = json.loads(out.splitlines()[-1])
    assert fed["metrics"]["HR@10"] > pop["metrics"]["HR@10"] + 0.15


@pytest.mark.realdata
def test_movielens_small_reaches_the_reference_accuracy(ml_latest_small, tmp_path, capsys):
    res = {}
    for preset in ("itempop", "centralized-gmf", "fedavg-gmf"):
        code, out, _ = run_cli(capsys, "run", preset, "--data", str(ml_latest_small), "--out", str(tmp_path / preset), "--json", "--quiet")
        res[preset] = json.loads(out.splitlines()[-1])["metrics"]["HR@10"]
    assert res["centralized-gmf"] >= 0.70  # reference GMF ~0.75 (610 users: +-0.018 standard error)
    assert res["fedavg-gmf"] >= res["centralized-gmf"] - 0.06
    assert res["fedavg-gmf"] > res["itempop"] + 0.05


def test_the_clients_minimum_from_the_clients_section_reaches_the_secure_sums(tmp_path, capsys):
    """[clients] min_survivors is the simulated clients' own setting: above the round's cohort, every
    client refuses the secure sum and the run stops in words (exit 2), releasing nothing."""
    from experiments.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\nrounds = 1\n[data]\nsynthetic_users = 30\nsynthetic_items = 40\n[eval]\nnegatives = 10\n"
                   "full_ranking = false\n[clients]\nmin_survivors = 50\n")
    code = main(["run", "fedavg-gmf-secagg", "--config", str(cfg), "--out", str(tmp_path / "r"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "No sum was released" in err and "min_survivors" in err
    with pytest.raises(ValueError, match=r"\[clients\]: min_survivors must be an int >= 2"):
        from experiments.run.config import ClientsSection

        ClientsSection(min_survivors=1)


def test_a_run_freezes_its_long_lived_heap_once_after_the_first_round_and_releases_it(tmp_path, capsys, monkeypatch):
    """``secagg run`` takes the setup's objects out of the cyclic GC's full scans after its first round
    (``settle_heap``; a full scan of them cost 0.17-0.2 s every few rounds at ML-100K's shape) and
    unfreezes them when training ends, before evaluation: the metrics are those of an unfrozen run."""
    import gc

    from experiments.run import training

    calls = []
    real = training.settle_heap

    def spy() -> None:
        calls.append(len(calls))
        real()
        assert gc.get_freeze_count() > 0

    monkeypatch.setattr(training, "settle_heap", spy)
    code, out, _ = run_cli(capsys, "run", "--config", str(tiny_config(tmp_path, rounds=3)), "--out", str(tmp_path / "a"),
                           "--json", "--quiet")
    assert code == 0 and calls == [0] and gc.get_freeze_count() == 0
    monkeypatch.setattr(training, "settle_heap", lambda: None)
    code, out2, _ = run_cli(capsys, "run", "--config", str(tiny_config(tmp_path, rounds=3)), "--out", str(tmp_path / "b"),
                            "--json", "--quiet")
    assert json.loads(out.strip().splitlines()[-1])["metrics"] == json.loads(out2.strip().splitlines()[-1])["metrics"]
