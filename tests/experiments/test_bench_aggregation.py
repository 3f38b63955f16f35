"""``secagg bench aggregation``: one JSON object last, correct sums, clean errors."""

from __future__ import annotations

import json

import pytest

from experiments.bench_aggregation import bench
from experiments.cli import main

KEYS = {
    "protocol", "clients", "dim", "dropout", "k", "t", "client_s", "server_s", "bytes_per_client",
    "bytes_server", "correct", "prg_bound_s", "plain_s",
}


@pytest.mark.parametrize("protocol", ["plain", "secagg", "secagg+"])
def test_json_is_the_last_line_and_the_sum_is_correct(protocol, capsys):
    code = main(["bench", "aggregation", "--protocol", protocol, "--clients", "8", "--dim", "50",
                 "--dropout", "0.25", "--json"])
    out = capsys.readouterr()
    result = json.loads(out.out.strip().splitlines()[-1])
    assert code == 0
    assert KEYS <= set(result)
    assert result["correct"] is True and result["survivors"] == 6 and result["dropped"] == 2
    assert "running" in out.err  # progress goes to stderr
    if protocol != "plain":
        assert result["masks"] >= 6 and result["prg_bound_s"] > 0
        assert result["bytes_per_client"] > result["plain_bytes_per_client"]


def test_abort_reports_correct_false():
    res = bench("secagg+", 12, 10, 0.5, k=4, t=5)
    assert res["correct"] is False
    assert "fewer than t" in res["abort"] or "lack shares" in res["abort"]


def test_user_errors_exit_2_without_traceback(capsys):
    assert main(["bench", "aggregation", "--clients", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err
    assert main(["bench", "aggregation", "--protocol", "secagg+", "--clients", "4", "--dim", "3",
                 "--flower", "--flower-python", "/nonexistent/python"]) == 2
    assert "flwr" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "aggregation", "--dropout", "1.5"])


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "aggregation", "--help"])
    assert exc.value.code == 0
    assert "--flower" in capsys.readouterr().out


def test_client_masking_only_mode(capsys):
    assert main(["bench", "aggregation", "--protocol", "secagg+", "--clients", "20", "--dim", "1000",
                 "--client-masking-only", "--sample", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["k"] == 10 and res["t"] == 6 and res["sampled"] == 2 and res["client_mask_s"] > 0
    assert main(["bench", "aggregation", "--protocol", "plain", "--client-masking-only"]) == 2


def test_abort_has_no_ratios():
    res = bench("secagg+", 12, 10, 0.5, k=4, t=5)
    assert res["ratio_prg_bound"] is None and res["ratio_crypto_bound"] is None
