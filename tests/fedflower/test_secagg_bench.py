"""``secagg bench flower``: both sides run inside Flower on the same inputs and are correct."""

from __future__ import annotations

import json

from experiments.bench.flower import bench_flower
from experiments.cli import main


def test_side_by_side_json_is_the_last_line_and_both_are_correct(capsys):
    code = main(["bench", "flower", "--clients", "8", "--dim", "40", "--dropout", "0.25", "--k", "4", "--t", "3",
                 "--json"])
    out = capsys.readouterr()
    res = json.loads(out.out.strip().splitlines()[-1])
    assert code == 0
    assert (res["k"], res["t"], res["dropped"]) == (4, 3, 2)
    assert res["flower_correct"] is True and res["ours_correct"] is True and res["ours_exact"] is True
    assert res["ours_max_err"] < 1e-5 < res["flower_max_err"]  # Flower's 2^22-level quantisation is coarser
    for side in ("flower", "ours"):
        assert res[f"{side}_server_s"] > 0 and res[f"{side}_client_s"] > 0 and res[f"{side}_bytes_per_client"] > 40
    assert res["ratio_server"] == res["flower_server_s"] / res["ours_server_s"]
    assert "running flower" in out.err and "running ours" in out.err


def test_one_side_and_user_errors(capsys):
    res = bench_flower(6, 10, 0.0, k=2, t=2, only="ours")
    assert res["ours_correct"] is True and "flower_server_s" not in res and "ratio_server" not in res
    assert main(["bench", "flower", "--clients", "2"]) == 2
    assert main(["bench", "flower", "--clients", "8", "--k", "4", "--t", "9"]) == 2
    err = capsys.readouterr().err
    assert "at least 3" in err and "t < num_shares" in err


def test_flower_floor_counts_flowers_work_and_stays_below_the_measured_run():
    n, dim, k, t = 12, 2000, 6, 4
    res = bench_flower(n, dim, 0.25, k=k, t=t, floor=True)
    counts, unit = res["flower_floor_counts"], res["flower_floor_unit"]
    survivors, dropped = n - 3, 3
    assert res["dropped"] == dropped
    assert counts == {"seed_rebuilds": survivors, "key_rebuilds": dropped, "server_pairwise_masks": dropped * k,
                      "server_private_masks": survivors, "client_splits": 2 * n,
                      "client_pairwise_masks": survivors * k}
    server = (survivors * (unit["combine_seed_s"] + unit["private_mask_s"])
              + dropped * (unit["combine_key_s"] + k * unit["pairwise_mask_s"]))
    assert res["flower_server_floor_s"] == server > 0
    # Rebuilding the serialised private key (hundreds of bytes) costs more than the 32-byte seed.
    assert unit["combine_key_s"] > unit["combine_seed_s"]
    # A floor: everything it counts is part of the measured run, which does more besides.
    assert res["flower_server_floor_s"] <= 1.2 * res["flower_server_s"] + 0.05
    assert res["flower_client_floor_s"] <= 1.2 * res["flower_client_s"] + 0.05
    ours = bench_flower(n, dim, 0.25, k=k, t=t, only="ours", floor=True)
    assert ours["ratio_server_floor"] == ours["flower_server_floor_s"] / ours["ours_server_s"]
    assert "flower_server_s" not in ours
