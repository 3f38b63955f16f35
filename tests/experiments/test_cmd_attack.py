"""``secagg attack fedmf``: the JSON contract, the sweep outputs and clean user errors."""

import json

from experiments.cli import main

TINY = ["attack", "fedmf", "--users", "12", "--items", "30", "--factors", "4", "--rounds", "2"]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_json_contract_plaintext(tmp_path, capsys):
    """The wrapper: a run kept in --out, its held-out RMSE, and the run-directory attack's findings."""
    out = _json(capsys, [*TINY, "--out", str(tmp_path / "r"), "--json"])
    a = out["attack"]
    assert isinstance(out["rmse"], float) and out["diverged"] is None
    assert set(a) >= {"attack", "target", "metric", "value", "random", "public", "advantage", "interval", "status"}
    assert a["attack"] == "fedmf-one-round" and a["target"] == "rated items" and a["status"] == "ok"
    assert a["value"] == 1.0 and a["advantage"] == 1.0
    ratings = next(f for f in out["findings"] if f["target"] == "ratings")
    assert ratings["value"] < 0.05 and (tmp_path / "r" / "attacks.json").is_file()


def test_json_contract_ckks_scores_exactly_the_stronger_baseline(tmp_path, capsys):
    out = _json(capsys, [*TINY, "--defense", "ckks", "--out", str(tmp_path / "r"), "--json"])
    assert out["cell"] == "ckks" and out["findings"]
    for f in out["findings"]:
        assert f["status"].startswith("nothing usable") and f["advantage"] == 0.0
    a = out["attack"]
    assert a["value"] == max(a["random"], a["public"])


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


def test_ldp_reports_the_epsilon_composed_over_all_uploads(tmp_path, capsys):
    out = _json(capsys, [*TINY, "--defense", "ldp", "--epsilon", "2", "--out", str(tmp_path / "l"), "--json"])
    p = out["privacy"]
    assert p["uploads"] == 2 and p["epsilon_per_upload"] == 2.0 and out["cell"] == "ldp-eps1"
    # Two pure 2-DP uploads: never more than basic composition, never less than one upload.
    assert 2.0 <= p["epsilon_total"] <= 4.0 + 1e-9
    assert _json(capsys, [*TINY, "--out", str(tmp_path / "n"), "--json"])["privacy"] is None


def test_bad_paillier_key_bits_is_a_user_error(tmp_path, capsys):
    """An invalid --key-bits is the user's input: exit 2 with the backend's reason, no traceback."""
    assert main([*TINY, "--defense", "paillier", "--key-bits", "16", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--key-bits" in err and "1024" in err and "Traceback" not in err


def _seeded_ldp(monkeypatch, seed: int = 7) -> None:
    """Make the LDP noise reproducible (a test source), so that divergence happens at a known round."""
    import functools

    import protocols.fedmf as fedmf_protocol
    from dp.ldp import ldp_laplace
    from dp.rng import DeterministicTestSource

    monkeypatch.setattr(fedmf_protocol, "ldp_laplace",
                        functools.partial(ldp_laplace, _test_source=DeterministicTestSource(seed)))


DIVERGING = ["--rounds", "6", "--ldp-clip", "100", "--epsilon", "1"]  # with seed 7: NaN in round 4


def test_sweep_reports_a_diverged_ldp_model_as_diverged_without_numpy_warnings(tmp_path, capsys, monkeypatch):
    """Issue 9, item 6: the sweep showed status 'ok' and RMSE n/a where the single run said
    'model diverged', and numpy's overflow warnings leaked to stderr."""
    import warnings

    import experiments.cli.cmd_attack as cmd_attack

    _seeded_ldp(monkeypatch)
    monkeypatch.setattr(cmd_attack, "SWEEP_EPSILONS", (1.0,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _json(capsys, [*TINY[:-2], *DIVERGING, "--key-bits", "1024", "--sweep", str(tmp_path), "--json"])
    ldp = [r for r in out["rows"] if r["defense"] == "ldp eps=1"]
    assert len(ldp) == 1 and ldp[0]["model_rmse"] is None
    assert ldp[0]["status"].startswith("model diverged (training stopped in round 4"), ldp[0]["status"]
    assert all(r["status"] != "ok" or r["model_rmse"] is not None for r in out["rows"])
    assert "model diverged" in (tmp_path / "sweep.md").read_text()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]


def test_single_run_and_sweep_agree_on_divergence(tmp_path, capsys, monkeypatch):
    """A diverged single run says so (rmse null) and still attacks the rounds it recorded."""
    import warnings

    _seeded_ldp(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _json(capsys, [*TINY[:-2], *DIVERGING, "--defense", "ldp", "--out", str(tmp_path / "r"), "--json"])
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    assert out["rmse"] is None and out["diverged"] and "round 4" in out["diverged"], out["diverged"]
    assert out["findings"] and 0 in out["attack"]["rounds"]


def test_a_sweep_row_that_fails_early_does_not_end_the_sweep(tmp_path, capsys, monkeypatch):
    """Divergence before round 2 (the attack needs rounds 0 and 1) is one row, not an exit 2."""
    import experiments.cli.cmd_attack as cmd_attack

    _seeded_ldp(monkeypatch)
    monkeypatch.setattr(cmd_attack, "SWEEP_EPSILONS", (1.0,))
    out = _json(capsys, [*TINY[:-2], "--rounds", "3", "--ldp-clip", "1e200", "--key-bits", "1024",
                         "--sweep", str(tmp_path), "--json"])
    ldp = [r for r in out["rows"] if r["defense"] == "ldp eps=1"][0]
    assert ldp["status"].startswith("model diverged, no attack: training failed in round"), ldp["status"]
    assert (tmp_path / "sweep.png").stat().st_size > 0
