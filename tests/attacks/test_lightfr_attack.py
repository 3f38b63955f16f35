"""The one-upload attack on LightFR: exact on plaintext Agg_grad, partial on Agg_para, nothing on SecAgg+."""

import json

import numpy as np
import pytest

from attacks.lightfr import code_agreement, exact_up_to_reflection, one_upload_attack, score, server_view
from attacks.registry import get_attack
from experiments.cli import main
from protocols.lightfr import LightFR, LightFRConfig
from protocols.transport import InProcessTransport, Transcript
from recmodels.synthetic import generate_synthetic

DATA = generate_synthetic(n_users=30, n_items=60, dim=4, mean_interactions=8, seed=3)


def _attack(server, secure, bits=32):
    m = LightFR(DATA, LightFRConfig(bits=bits, server=server, secure_aggregation=secure, client_fraction=0.5),
                seed=1, transport=InProcessTransport(Transcript(keep_payloads=True)))
    m.run_round()
    res, codes = one_upload_attack(server_view(m.transport.transcript), m.public_info(), round=0)
    attacked = {inf.user for inf in res.users}
    ti = [m.items[m.users == u] if u in attacked else np.zeros(0, np.int64) for u in range(m.n_users)]
    tr = [m.raw[m.users == u] if u in attacked else np.zeros(0) for u in range(m.n_users)]
    return m, res, codes, score(res, ti, tr, m.n_items, m.public_info()["rating_scale"]), \
        exact_up_to_reflection(res, ti, tr, m.public_info()["rating_scale"])


def test_plaintext_agg_grad_upload_reveals_code_rated_set_and_every_rating():
    m, res, codes, sc, refl = _attack("grad", "none")
    assert sc.users == 15 and sc.f1 == 1.0 and sc.random_f1 < 0.2
    assert refl == 1.0  # every rating exact up to the one global bit per user
    assert code_agreement(codes, m.b) == 1.0  # the private code, up to sign


def test_agg_para_leaks_the_rated_set_and_most_ratings_reported_not_all():
    m, res, codes, sc, refl = _attack("para", "none")
    assert sc.f1 == 1.0
    assert 0.2 < refl <= 1.0 and 0.6 < code_agreement(codes, m.b) <= 1.0


def test_secure_upload_leaves_the_attack_at_or_below_random():
    m, res, codes, sc, refl = _attack("grad", "secagg+", bits=8)
    assert "masked" in res.status and sc.f1 <= sc.random_f1 and refl is None and not codes


def test_registered_and_cli_json(tmp_path, capsys):
    """The wrapper runs one round into --out, attacks the directory and adds the code agreement."""
    assert get_attack("lightfr", "lightfr-one-upload").view == "server"
    assert main(["attack", "lightfr", "--defense", "none", "--users", "30", "--items", "60", "--bits", "16",
                 "--out", str(tmp_path / "r"), "--json"]) == 0
    out = json.loads(capsys.readouterr()[0].splitlines()[-1])
    a = out["attack"]
    assert a["target"] == "rated items" and a["value"] == 1.0 and a["advantage"] == 1.0 > a["random"]
    assert a["extra"]["code_agreement"] == 1.0 > a["extra"]["random_code_agreement"]
    ratings = next(f for f in out["findings"] if f["target"] == "ratings")
    assert ratings["metric"] == "rmse" and ratings["extra"]["exact_match_up_to_reflection"] == 1.0
    assert {"random", "public", "interval", "status"} <= set(a) and (tmp_path / "r" / "attacks.json").is_file()
    assert main(["attack", "lightfr", "--bits", "0"]) == 2


def test_the_dpf_defense_leaves_the_first_server_nothing_to_invert(tmp_path, capsys):
    """`--defense dpf`: the first server holds only DPF key sets; the attack infers nothing and scores
    exactly at the stronger baseline."""
    m, res, codes, sc, refl = _attack("grad", "dpf", bits=8)
    assert "DPF" in res.status and sc.f1 == 0.0 <= sc.random_f1 and refl is None and not codes
    assert main(["attack", "lightfr", "--defense", "dpf", "--users", "30", "--items", "60", "--bits", "8",
                 "--out", str(tmp_path / "r"), "--json"]) == 0
    out = json.loads(capsys.readouterr()[0].splitlines()[-1])
    assert out["cell"] == "dpf" and out["attack"]["users"] > 0 and "DPF" in out["attack"]["status"]
    for f in out["findings"]:
        assert f["advantage"] == 0.0, f
    assert out["attack"]["value"] == max(out["attack"]["random"], out["attack"]["public"])
    assert out["attack"]["extra"]["code_agreement"] is None
