"""``secagg bench dpf``: a small run prints every reported figure, exact, with the PRG bound and the
dense SecAgg+ comparison; bad arguments are user errors."""

from __future__ import annotations

import json

import pytest

from experiments.bench.dpf import bench
from experiments.cli import main
from secagg.dpf import KeySet


def test_a_small_run_reports_exact_sums_bytes_seconds_and_bounds(capsys):
    assert main(["bench", "dpf", "--items", "3000", "--dim", "4", "--points", "5", "--clients", "3",
                 "--secagg-dim", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["exact"] is True and out["check"] is True
    assert out["upload_bytes_per_client_per_server"] == out["key_bytes"] + 56  # the message header (with part, parts)
    assert out["key_bytes"] == KeySet.size(depth=out["depth"], points=out["buckets"], width=4)
    assert out["leaves"] == 3 * 3000
    assert out["prg_bound_s_per_client"] > 0 and out["server_s_per_client"]["max"] > 0
    assert out["server_over_prg_bound"] == pytest.approx(out["server_s_per_client"]["max"]
                                                         / out["prg_bound_s_per_client"])
    d = out["secagg_plus"]
    assert d["mask_bytes_per_neighbour"] == d["masked_upload_bytes_per_client"] == 8 * 3000 * 4
    assert d["scaled_from_dim"] == 512 and d["exact_at_that_dim"] is True
    assert out["targets"]["upload_met"] is True


def test_without_the_check_the_keys_are_smaller_and_the_sum_still_exact():
    a = bench(2000, 2, 3, 2, check=True, secagg_dim=64)
    b = bench(2000, 2, 3, 2, check=False, secagg_dim=64)
    assert a["exact"] and b["exact"]
    assert a["key_bytes"] - b["key_bytes"] == 64 * a["buckets"]
    assert b["prg_bytes_per_client_per_server"] < a["prg_bytes_per_client_per_server"]


def test_impossible_arguments_are_refused_in_words(capsys):
    assert main(["bench", "dpf", "--items", "10", "--points", "20"]) == 2
    assert "--points (20) cannot exceed --items (10)" in capsys.readouterr().err
    assert main(["bench", "dpf", "--items", "100", "--points", "2", "--clients", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_the_cpu_time_bound_is_reported_beside_the_wall_clock_one():
    out = bench(3000, 4, 5, 3, secagg_dim=64)
    assert out["aes128_ecb_gbps_cpu"] > 0 and out["prg_bound_cpu_s_per_client"] > 0
    assert out["evaluate_cpu_over_prg_bound_cpu"] == pytest.approx(
        out["evaluate_cpu_s_per_client"] / out["prg_bound_cpu_s_per_client"])
    by = out["evaluate_cpu_s_per_client_by_server"]
    assert max(by["A"], by["B"]) == pytest.approx(out["evaluate_cpu_s_per_client"])
    assert out["targets"]["evaluate_cpu_met"] == (out["evaluate_cpu_s_per_client"] <= 0.5)
