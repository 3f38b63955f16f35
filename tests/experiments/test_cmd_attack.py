"""``secagg attack fedmf``: the JSON contract, the sweep outputs and clean user errors."""

import json

from experiments.cli import main

TINY = ["attack", "fedmf", "--users", "12", "--items", "30", "--factors", "4", "--rounds", "2"]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_json_contract_plaintext(capsys):
    out = _json(capsys, [*TINY, "--json"])
    a = out["attack"]
    assert isinstance(out["rmse"], float)
    assert set(a) >= {"f1", "precision", "recall", "rating_rmse", "random_f1", "status"}
    assert a["status"] == "ok" and a["f1"] == 1.0 and a["rating_rmse"] < 0.05


def test_json_contract_ckks_full_has_numeric_f1(capsys):
    out = _json(capsys, [*TINY, "--defense", "ckks", "--json"])
    assert out["attack"]["f1"] == 0.0 and "no usable plaintext" in out["attack"]["status"]


def test_sweep_writes_table_and_png(tmp_path, capsys):
    assert main([*TINY, "--key-bits", "2048", "--sweep", str(tmp_path)]) == 0
    for name in ("sweep.csv", "sweep.md", "sweep.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "ldp eps=1" in (tmp_path / "sweep.md").read_text()


def test_user_errors_exit_2_without_traceback(capsys):
    assert main([*TINY[:-2], "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "--rounds" in err and "Traceback" not in err
    assert main(["attack", "fedmf", "--data", "/nonexistent/ratings.csv"]) == 2


def test_ldp_reports_the_epsilon_composed_over_all_uploads(capsys):
    out = _json(capsys, [*TINY, "--defense", "ldp", "--epsilon", "2", "--json"])
    p = out["privacy"]
    assert p["uploads"] == 2 and p["epsilon_per_upload"] == 2.0
    # Two pure 2-DP uploads: never more than basic composition, never less than one upload.
    assert 2.0 <= p["epsilon_total"] <= 4.0 + 1e-9
    assert _json(capsys, [*TINY, "--json"])["privacy"] is None


def test_bad_paillier_key_bits_is_a_user_error(capsys):
    """An invalid --key-bits is the user's input: exit 2 with the backend's reason, no traceback."""
    assert main([*TINY, "--defense", "paillier", "--key-bits", "16"]) == 2
    err = capsys.readouterr().err
    assert "--key-bits" in err and "1024" in err and "Traceback" not in err
