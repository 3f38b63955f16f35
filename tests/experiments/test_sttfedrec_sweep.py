"""The accuracy sweep driver: one run per point, the preset's own value run once, CSV and PNG written."""

from __future__ import annotations

import csv

from experiments.studies import sttfedrec_sweep


def test_sweep_runs_each_point_once_and_writes_csv_and_png(tmp_path, monkeypatch):
    calls = []

    def fake(preset, data, out, overrides, rounds):
        calls.append((out.name, dict(overrides)))
        v = overrides.get("rho", overrides.get("clients_per_round", 0))
        return {"rounds": rounds, "metrics": {"HR@10": 0.5 + v / 1000, "NDCG@10": 0.3}, "metrics_full": {"HR@10": 0.1},
                "seconds_per_round": 1.0}

    monkeypatch.setattr(sttfedrec_sweep, "run_point", fake)
    code = sttfedrec_sweep.main(["--data", "x", "--out", str(tmp_path), "--rounds", "3", "--rho", "0.5", "0.9",
                                 "--clients", "10", "50"])
    assert code == 0
    names = [c[0] for c in calls]
    assert names == ["rho-0.5", "base", "clients_per_round-10", "base"]  # fl-dssm's rho 0.9 and K 50 are "base"
    assert calls[0][1] == {"rho": 0.5} and calls[1][1] == {}
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [(r["sweep"], float(r["value"])) for r in rows] == [("rho", 0.5), ("rho", 0.9), ("clients_per_round", 10),
                                                               ("clients_per_round", 50)]
    assert (tmp_path / "sweep.png").stat().st_size > 1000
