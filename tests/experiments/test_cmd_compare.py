"""``secagg compare`` (issue 28, item 2): each metric's direction, a default metric per task, no
diverging run that "reaches" a target, a warning when the runs saw different data, errors that name
only the metrics in the file, and single-point curves drawn visibly.

Most run directories here are written by hand (``metrics.jsonl`` and ``run.json`` as ``secagg run``
writes them), so each case states its curves; one test compares real runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.cli.cmd_compare import compare_runs, curves_figure, default_metric, direction

CONFIG = {
    "run": {"protocol": "fedmf", "seed": 0, "rounds": 3},
    "data": {"source": "synthetic", "synthetic_users": 30, "synthetic_items": 60, "synthetic_dim": 8,
             "synthetic_mean_interactions": 8, "threshold": None, "format": "", "sep": "", "columns": {},
             "min_user_interactions": 2, "min_item_interactions": 0},
    "split": {"validation": False},
    "eval": {"negatives": 99, "ks": [5, 10, 20], "full_ranking": True},
}


def write_run(path: Path, rows: list[dict], *, config: dict | None = None, data_files: dict | None = None) -> Path:
    path.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)  # json.dumps: NaN as a bare token, like old files
    (path / "metrics.jsonl").write_text(text)
    (path / "run.json").write_text(json.dumps({"config": config or CONFIG, "data_files": data_files or {},
                                               "run_id": path.name}))
    return path


def rmse_rows(values: list[float | None]) -> list[dict]:
    return [{"round": r, "loss": 0.5, "RMSE": v, "MAE": v} for r, v in enumerate(values, start=1)]


def hr_rows(values: list[float | None], k: int = 10) -> list[dict]:
    return [{"round": r, "loss": 0.5, f"HR@{k}": v, f"NDCG@{k}": v} for r, v in enumerate(values, start=1)]


def test_directions() -> None:
    assert [direction(m) for m in ("RMSE", "MAE", "loss")] == ["lower"] * 3
    assert [direction(m) for m in ("HR@10", "NDCG@5", "AUC", "MRR", "Precision@20", "Recall@10")] == ["higher"] * 6
    assert direction("my-metric", "lower") == "lower"


def test_lower_is_better_for_rmse(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a", rmse_rows([1.2, 1.0, 0.9]))
    b = write_run(tmp_path / "b", rmse_rows([1.1, 0.85, 0.95]))
    res = compare_runs([a, b], "RMSE")
    assert res["better"] == "lower" and res["target"] == 0.9  # a's best is its minimum, not its maximum 1.2
    ra, rb = res["runs"]
    assert (ra["best"], ra["best_round"], ra["rounds_to_target"]) == (0.9, 3, 3)
    assert (rb["best"], rb["best_round"], rb["rounds_to_target"]) == (0.85, 2, 2)
    assert main(["compare", str(a), str(b), "--metric", "RMSE"]) == 0
    out = capsys.readouterr().out
    assert "lower is better" in out and "<= 0.9000" in out


def test_a_diverging_run_never_reaches_the_target(tmp_path: Path, capsys) -> None:
    good = write_run(tmp_path / "good", rmse_rows([1.0, 0.8]))
    growing = write_run(tmp_path / "growing", rmse_rows([1.2, 3.0, 40.0]))  # gets worse: never reaches 0.8
    exploded = write_run(tmp_path / "nan", rmse_rows([1.1, math.nan, 2.0]))  # NaN at round 2
    res = compare_runs([good, growing, exploded], "RMSE")
    rows = {Path(r["run"]).name: r for r in res["runs"]}
    assert rows["growing"]["rounds_to_target"] is None and rows["growing"]["best"] == 1.2
    assert rows["nan"]["rounds_to_target"] is None and rows["nan"]["diverged_at"] == 2
    assert rows["nan"]["final"] is None and rows["nan"]["best"] == 1.1  # only what came before the divergence
    assert main(["compare", str(good), str(growing), str(exploded), "--metric", "RMSE"]) == 0
    table = capsys.readouterr().out
    nan_line = next(line for line in table.splitlines() if line.startswith("| nan |"))
    assert "diverged at round 2" in nan_line and "never" in nan_line
    # higher is better: a run whose HR turns null diverged too, and does not reach
    a = write_run(tmp_path / "hr-a", hr_rows([0.3, 0.5]))
    b = write_run(tmp_path / "hr-b", hr_rows([0.4, None, 0.9]))
    rb = compare_runs([a, b])["runs"][1]
    assert rb["diverged_at"] == 2 and rb["rounds_to_target"] is None


def test_default_metric_follows_the_task(tmp_path: Path, capsys) -> None:
    rating = write_run(tmp_path / "rating", rmse_rows([1.0, 0.9]))
    ranking = write_run(tmp_path / "ranking", hr_rows([0.3, 0.4]))
    other_k = write_run(tmp_path / "k5", hr_rows([0.3, 0.4], k=5) + [{"round": 3, "HR@20": 0.7}])
    assert default_metric([rating]) == "RMSE" and compare_runs([rating])["metric"] == "RMSE"
    assert default_metric([ranking]) == "HR@10"
    assert default_metric([other_k]) == "HR@5"  # the cut-off nearest 10 the run evaluated
    assert main(["compare", str(rating), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["metric"] == "RMSE"


def test_a_real_rating_run_compares_by_rmse(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "fedmf.toml"
    cfg.write_text('[run]\nprotocol = "fedmf"\nrounds = 2\neval_every = 1\n[data]\nsynthetic_users = 30\n'
                   "synthetic_items = 60\nsynthetic_mean_interactions = 8\n")
    run = tmp_path / "fedmf"
    assert main(["run", "--config", str(cfg), "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["compare", str(run), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert res["metric"] == "RMSE" and res["better"] == "lower"
    assert res["runs"][0]["best"] == min(v for _, v in res["curves"][str(run)])


def test_errors_suggest_only_the_metrics_in_the_file(tmp_path: Path, capsys) -> None:
    rating = write_run(tmp_path / "rating", rmse_rows([1.0, 0.9]))
    assert main(["compare", str(rating), "--metric", "HR@10"]) == 2
    err = capsys.readouterr().err
    assert "its metrics: loss, RMSE, MAE (" in err and "NDCG" not in err and "e.g. HR@10" not in err
    assert main(["compare", str(rating), "--metric", "rmse"]) == 2
    assert "did you mean 'RMSE'?" in capsys.readouterr().err
    custom = write_run(tmp_path / "custom", [{"round": 1, "coverage": 0.2}, {"round": 2, "coverage": 0.1}])
    assert main(["compare", str(custom), "--metric", "coverage"]) == 2
    assert "--better" in capsys.readouterr().err
    assert main(["compare", str(custom), "--metric", "coverage", "--better", "lower", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["runs"][0]["best"] == 0.1


def test_runs_on_different_data_are_flagged(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a", hr_rows([0.3, 0.4]))
    same = write_run(tmp_path / "same", hr_rows([0.2, 0.5]))
    bigger = dict(CONFIG, data={**CONFIG["data"], "synthetic_users": 60})
    other = write_run(tmp_path / "other", hr_rows([0.2, 0.5]), config=bigger)
    reseeded = write_run(tmp_path / "seed", hr_rows([0.2, 0.5]), config=dict(CONFIG, run={**CONFIG["run"], "seed": 7}))
    evaluated = write_run(tmp_path / "eval", hr_rows([0.2, 0.5]), config=dict(CONFIG, eval={**CONFIG["eval"], "negatives": 49}))
    assert compare_runs([a, same])["warnings"] == []
    warnings = compare_runs([a, other, reseeded, evaluated])["warnings"]
    assert len(warnings) == 3
    assert "other was made on different data" in warnings[0] and "data.synthetic_users 30 vs 60" in warnings[0]
    assert "seed was made on different data" in warnings[1] and "run.seed" in warnings[1]
    assert "different evaluation protocol" in warnings[2] and "eval.negatives 99 vs 49" in warnings[2]
    files = dict(CONFIG, data={**CONFIG["data"], "source": "/d/ratings.csv"})
    f1 = write_run(tmp_path / "f1", hr_rows([0.3]), config=files, data_files={"/d/ratings.csv": "aa"})
    f2 = write_run(tmp_path / "f2", hr_rows([0.3]), config=files, data_files={"/e/ratings.csv": "bb"})
    moved = write_run(tmp_path / "moved", hr_rows([0.3]), config=files, data_files={"/x/ratings.csv": "aa"})
    assert compare_runs([f1, moved])["warnings"] == []  # the same file elsewhere is the same data
    assert "data files (SHA-256)" in compare_runs([f1, f2])["warnings"][0]
    assert main(["compare", str(a), str(other)]) == 0
    assert "warning: " in capsys.readouterr().err


def test_single_point_runs_are_drawn_visibly(tmp_path: Path, capsys) -> None:
    one = write_run(tmp_path / "one", hr_rows([0.4]))
    many = write_run(tmp_path / "many", hr_rows([0.1, 0.2, 0.3]))
    fig = curves_figure(compare_runs([one, many]))
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    single = lines["one"]
    assert len(single.get_xdata()) == 1
    assert single.get_marker() not in (None, "None", "", " ") and single.get_markersize() >= 5
    assert lines["many"].get_marker() not in (None, "None", "", " ")
    png = tmp_path / "curves.png"
    assert main(["compare", str(one), str(many), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("values, better, target, reached", [
    ([0.5, 0.7], "higher", 0.7, 2), ([0.5, 0.7], "higher", 0.4, 1), ([0.5, 0.7], "higher", 0.8, None),
    ([0.9, 0.7], "lower", 0.7, 2), ([0.9, 0.7], "lower", 0.95, 1), ([0.9, 0.7], "lower", 0.6, None),
])
def test_target_is_reached_in_the_metrics_direction(tmp_path: Path, values, better, target, reached) -> None:
    run = write_run(tmp_path / "r", [{"round": r, "score": v} for r, v in enumerate(values, start=1)])
    assert compare_runs([run], "score", target=target, better=better)["runs"][0]["rounds_to_target"] == reached
