"""``secagg run --data RELATIVE`` must stay resumable from another working directory."""

import json

import numpy as np

from experiments.cli import main


def test_relative_data_path_resumes_from_another_directory(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = [f"{u},{i},{rng.integers(1, 6)},{100 * u + k}" for u in range(30) for k, i in enumerate(rng.choice(60, 8, replace=False))]
    (work / "data" / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "\n".join(rows) + "\n")
    (work / "tiny.toml").write_text("[run]\nrounds = 1\n[eval]\nnegatives = 10\n[fedavg]\ndim = 4\n")
    monkeypatch.chdir(work)
    assert main(["run", "--config", "tiny.toml", "--data", "data", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    monkeypatch.chdir(tmp_path)  # e.g. resuming from the home directory
    capsys.readouterr()
    code = main(["run", "--resume", str(tmp_path / "run"), "--rounds", "2", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["rounds"] == 2
