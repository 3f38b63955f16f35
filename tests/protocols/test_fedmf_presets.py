"""The ``fedmf`` presets converge: plaintext on ml-latest-small (slow, real data), and each secure
defense follows the plaintext model at the presets' hyper-parameters (so it converges where
plaintext does); FedMF's own rate diverges on MovieLens and the run loop stops it."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from experiments.run import config as cfgmod
from experiments.cli import main
from protocols.fedmf import FedMF
from recmodels.synthetic import generate_synthetic

SECURE = ["fedmf-secagg", "fedmf-paillier", "fedmf-ckks"]


def test_every_defense_has_a_preset_at_the_converging_rate():
    names = [p for p in cfgmod.PRESETS if p.startswith("fedmf")]
    assert set(names) >= {"fedmf", *SECURE, "fedmf-ldp"}
    for name in names:
        c = cfgmod.load_preset(name)
        assert c.run.protocol == "fedmf"
        assert c.protocol_config.mf.lr == 0.0005, name
    assert {cfgmod.load_preset(n).protocol_config.defense for n in names} == {"none", "secagg", "paillier", "ckks", "ldp"}


@pytest.mark.parametrize("preset", SECURE)
def test_secure_presets_follow_the_plaintext_model(preset):
    data = generate_synthetic(n_users=10, n_items=16, dim=3, mean_interactions=6, seed=4)
    plain_cfg = cfgmod.load_preset("fedmf").protocol_config
    cfg = cfgmod.load_preset(preset).protocol_config
    if cfg.defense == "paillier":
        cfg = dataclasses.replace(cfg, key_bits=1024)  # the sum is the same at any key size; 1024 is faster
    plain, secure = FedMF(data, plain_cfg, seed=0), FedMF(data, cfg, seed=0)
    losses = []
    for _ in range(3):
        a, b = plain.run_round(), secure.run_round()
        losses.append(b.loss)
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
    np.testing.assert_allclose(secure.item_matrix, plain.item_matrix, atol=1e-5)
    assert losses[-1] < losses[0]


def _run(tmp_path, capsys, preset, ratings, rounds, name, extra=""):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f'[run]\nrounds = {rounds}\neval_every = {rounds}\n[data]\nsource = "{ratings}"\n{extra}')
    code = main(["run", preset, "--config", str(cfg), "--out", str(tmp_path / name), "--quiet", "--json"])
    out = capsys.readouterr()
    return code, out


@pytest.mark.slow
def test_fedmf_preset_converges_on_ml_latest_small_where_fedmf_rate_diverges(tmp_path, capsys, ml_latest_small):
    code, out = _run(tmp_path, capsys, "fedmf", ml_latest_small, 10, "ok")
    assert code == 0, out.err
    s = json.loads(out.out.strip().splitlines()[-1])
    assert math.isfinite(s["metrics"]["RMSE"]) and s["metrics"]["RMSE"] < 1.05  # global mean: about 1.04
    rows = [json.loads(x) for x in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    code, out = _run(tmp_path, capsys, "fedmf", ml_latest_small, 8, "bad", "[fedmf.mf]\nlr = 0.005\n")
    assert code == 3 and "training diverged" in out.err
