"""Issue 25 item 2: a validation split, its metrics at every evaluation, and the test metrics at the
best validation round reported beside the final round's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from experiments.cli import main
from experiments.run.config import RunConfig, merge
from experiments.run.prepare import prepare_data
from experiments.run.training import best_validation

TINY = """
[run]
rounds = 6
eval_every = 1
[data]
synthetic_users = 60
synthetic_items = 120
synthetic_mean_interactions = 12
[split]
validation = {validation}
[eval]
negatives = {negatives}
[fedavg]
dim = 8
"""


def run(tmp_path: Path, capsys, validation: str = "true", negatives: int = 20) -> tuple[dict, list[dict], str]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.format(validation=validation, negatives=negatives))
    out = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--out", str(out), "--quiet", "--json"]) == 0
    stdout = capsys.readouterr().out
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads(stdout.strip().splitlines()[-1]), rows, stdout


def test_best_validation_round_and_its_test_metrics_beside_the_final(tmp_path, capsys):
    s, rows, stdout = run(tmp_path, capsys)
    assert all("valid_HR@10" in r and "HR@10" in r for r in rows)
    best = s["best_validation"]
    top = max(r["valid_HR@10"] for r in rows)
    first = next(r for r in rows if r["valid_HR@10"] == top)
    assert best["round"] == first["round"]
    assert best["metrics"]["HR@10"] == first["HR@10"] and best["valid"]["HR@10"] == top
    assert not any(k.startswith("valid_") for k in best["metrics"])
    assert s["metrics"]["HR@10"] == rows[-1]["HR@10"] and s["metrics_valid"]["HR@10"] == rows[-1]["valid_HR@10"]
    assert not any(k.startswith("valid_") for k in s["metrics"])
    assert "ranked among 20 other sampled items" in s["evaluation"]["validation"]
    assert f"best    round {best['round']} by validation" in stdout


def test_without_validation_nothing_changes(tmp_path, capsys):
    s, rows, _ = run(tmp_path, capsys, validation="false")
    assert s["best_validation"] is None and s["metrics_valid"] is None
    assert not any(k.startswith("valid_") for r in rows for k in r)
    assert s["evaluation"]["validation"].startswith("off")


def test_full_ranking_validation_when_nothing_is_sampled(tmp_path, capsys):
    s, rows, _ = run(tmp_path, capsys, negatives=0)
    assert s["best_validation"] is not None and "valid_HR@10" in rows[0]
    assert "among all items" in s["evaluation"]["validation"]


def test_validation_candidates_are_drawn_apart_from_the_test_ones():
    c = merge(RunConfig(), {"split": {"validation": True}, "eval": {"negatives": 15},
                            "data": {"synthetic_users": 50, "synthetic_items": 100, "synthetic_mean_interactions": 10}})
    prep = prepare_data(c)
    vc, tc, split = prep.valid_candidates, prep.candidates, prep.split
    assert vc.items[:, 0].tolist() == split.valid_items[vc.users].tolist()
    for row, u in enumerate(vc.users):
        assert split.test_items[u] not in vc.items[row, 1:]
    assert not np.array_equal(vc.items[:, 1:], tc.items[:, 1:])


def test_best_validation_rules():
    rows = [{"round": 1, "HR@10": 0.1, "valid_HR@10": 0.5}, {"round": 2, "HR@10": 0.2, "valid_HR@10": 0.7},
            {"round": 3, "HR@10": 0.3, "valid_HR@10": 0.7}, {"round": 4, "HR@10": 0.9, "valid_HR@10": float("nan")},
            {"round": 5, "loss": 1.0}]
    b = best_validation(rows, "HR@10")
    assert b["round"] == 2 and b["metrics"] == {"HR@10": 0.2} and "3 evaluated rounds" in b["selected_by"]
    r = best_validation([{"round": 1, "RMSE": 1.0, "valid_RMSE": 0.9}, {"round": 2, "RMSE": 2.0, "valid_RMSE": 1.2}], "RMSE")
    assert r["round"] == 1 and "lowest" in r["selected_by"]
    assert best_validation([{"round": 1, "HR@10": 0.3}], "HR@10") is None
    assert math.isfinite(b["valid"]["HR@10"])


def test_explicit_validation_file_candidates_are_used(tmp_path):
    folder = tmp_path / "ft"
    folder.mkdir()
    head = "user_id,item_id,ratings\n"
    (folder / "x_train.csv").write_text(head + "".join(f"{u},{i},0.8\n" for u in range(5) for i in range(u, u + 4)))
    (folder / "x_test.csv").write_text(head + "".join(f"{u},{u + 5},3\n{u},9,0\n{u},10,0\n" for u in range(5)))
    (folder / "x_val.csv").write_text(head + "".join(f"{u},{u + 4},3\n{u},11,0\n" for u in range(5)))
    prep = prepare_data(merge(RunConfig(), {"run": {"protocol": "itempop", "rounds": 0}, "data": {"source": str(folder)}}))
    assert prep.valid_candidates.source.endswith("x_val.csv") and prep.valid_candidates.items.shape == (5, 2)


@pytest.mark.parametrize("validation", ["true"])
def test_resume_keeps_the_validation_rows(tmp_path, capsys, validation):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.format(validation=validation, negatives=10).replace("rounds = 6", "rounds = 3"))
    out = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--out", str(out), "--quiet"]) == 0
    assert main(["run", "--resume", str(out), "--rounds", "5", "--quiet", "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5] and all("valid_HR@10" in r for r in rows)
    assert 1 <= s["best_validation"]["round"] <= 5
