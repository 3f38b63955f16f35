"""``secagg bench he`` on a tiny shape: one JSON object last on stdout, sane fields, clean errors."""

from __future__ import annotations

import json

import pytest

from experiments.cli import main


def _last_json(out: str) -> dict:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    return json.loads(lines[-1])


def test_bench_all_backends_tiny_shape(capsys) -> None:
    code = main(["bench", "he", "--backend", "all", "--items", "2", "--dim", "5", "--repeats", "1", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    summary = _last_json(captured.out)
    assert summary["values"] == 10 and summary["key_bits"] == 1024
    assert set(summary["results"]) == {"paillier", "phe", "ckks"}
    for name, result in summary["results"].items():
        assert result["iteration_s"] == pytest.approx(
            result["encrypt_s"] + result["add_s"] + result["decrypt_s"]
        ), name
        assert result["upload_bytes"] > 0
    # Correctness travels with the timing: each backend decrypted the true sum.
    assert summary["results"]["paillier"]["max_abs_error"] <= 2 * 2.0**-25
    assert summary["results"]["phe"]["max_abs_error"] < 1e-9
    assert summary["results"]["ckks"]["max_abs_error"] <= summary["results"]["ckks"]["error_bound"]
    assert summary["results"]["paillier"]["ciphertexts"] == 1
    assert 0 < summary["results"]["paillier"]["encrypt_online_with_pool_s"]
    assert 0 < summary["results"]["paillier"]["pool_offline_s"]
    assert summary["results"]["phe"]["ciphertexts"] == 10
    assert summary["paillier_speedup_vs_phe"] > 0 and summary["ckks_to_paillier_ratio"] > 0
    assert "[bench he]" in captured.err and "[bench he]" not in captured.out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--items", "0"], "--items must be at least 1"),
        (["--key-bits", "512"], "--key-bits must be"),
        (["--value-bits", "70"], "value_bits"),
    ],
)
def test_bench_bad_arguments_exit_2_with_one_line(capsys, argv, message) -> None:
    code = main(["bench", "he", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err


def test_bench_help_works(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "he", "--help"])
    assert exc.value.code == 0
    assert "FedMF iteration" in capsys.readouterr().out
