"""``secagg bench secure``: a secure preset's round beside its cryptographic bound."""

from __future__ import annotations

import json

import pytest

from experiments.bench.secure import bench, secure_presets
from experiments.cli import main
from experiments.errors import UserError


def test_the_default_presets_are_the_secure_ones() -> None:
    names = secure_presets()
    assert {"fedavg-gmf-secagg", "fedfast-secagg", "lightfr", "fel-dp", "sttfedrec"} <= set(names)
    assert not {"fedavg-gmf", "lightfr-grad", "fedfast", "itempop"} & set(names)


def test_a_small_secure_round_is_priced_against_its_plaintext_twin(capsys) -> None:
    assert main(["bench", "secure", "fedavg-gmf-secagg", "--users", "30", "--items", "40", "--plaintext", "--no-shared-work",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["shape"] == {"synthetic_users": 30, "synthetic_items": 40}
    r = out["presets"]["fedavg-gmf-secagg"]
    row = r["rounds"][0]
    assert row["instances"] >= 1 and all(k.startswith("secagg") for k in row["shapes"])
    # a real device pays less than the simulation of all of them, and the measured work is above the floor
    assert 0 < r["device_bound_s"] < r["simulation_bound_s"]
    assert r["secure_measured_s"] > 0.5 * r["simulation_bound_s"]
    assert r["plain_round_s"] > 0 and r["round_over_bound"] > 0 and r["unshared_round_s"] > 0
    assert set(out["units"]) >= {"aes256_ctr_gbps", "x25519_hkdf_agree_us", "ed25519_verify_us"}


def test_bad_requests_are_refused_in_words() -> None:
    with pytest.raises(UserError, match="unknown preset"):
        bench(["fedavg-gmf-secgg"], "synthetic", 1, False)
    with pytest.raises(UserError, match="synthetic"):
        bench(["fedavg-gmf-secagg"], "data/ratings.csv", 1, False, users=100)
    with pytest.raises(UserError, match="rounds"):
        bench(["fedavg-gmf-secagg"], "synthetic", 0, False)


def test_a_preset_without_a_plaintext_twin_is_still_timed() -> None:
    out = bench(["fel-dp"], "synthetic", 1, True, users=60, items=50)
    r = out["presets"]["fel-dp"]
    assert "plain_round_s" not in r and "secure_aggregation" in r["plain_error"]
    assert r["rounds"][0]["instances"] >= 1 and r["simulation_bound_s"] > 0


def test_lightfrs_second_sum_is_priced_as_an_instance_of_the_rounds_one_setup() -> None:
    out = bench(["lightfr"], "synthetic", 1, True, users=40, items=50, no_reuse=True)
    r = out["presets"]["lightfr"]
    # without the reuse the second sum pays a setup of its own: a higher bound for the same two sums
    assert r["noreuse"]["instances"] == 2 and r["noreuse"]["simulation_bound_s"] > r["simulation_bound_s"]
    shapes = r["rounds"][0]["shapes"]
    assert r["instances"] == 2 and sum(v for k, v in shapes.items() if k.endswith(" reused")) == 1
    assert r["round_cpu_s"] > 0 and r["plain_round_cpu_s"] > 0 and r["round_cpu_over_bound"] > 0
    assert out["units"]["hmac_pair_seed_us"] > 0
