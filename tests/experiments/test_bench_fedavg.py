"""``secagg bench fedavg``: bad counts are user errors (exit 2, one line), not tracebacks."""

import pytest

from experiments.cli import main


@pytest.mark.parametrize("flag", ["--rounds", "--threads"])
def test_non_positive_counts_exit_2_naming_the_flag(flag, capsys):
    assert main(["bench", "fedavg", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_secure_lists_are_checked_and_run_side_by_side(capsys, monkeypatch):
    import json

    assert main(["bench", "fedavg", "--secure", "none,paillier"]) == 2
    assert "--secure" in capsys.readouterr().err
    from experiments.bench import fedavg as bench_fedavg

    seen = {}

    def fake(data, rounds, threads, protocols):  # the runs themselves are measured in docs/dpf.md
        seen["protocols"] = protocols
        return {"runs": {p: {"seconds_per_round": 1.0, "cpu_seconds_per_round": 1.0, "bytes_per_client": 1.0}
                         for p in protocols}}

    monkeypatch.setattr(bench_fedavg, "bench_secure", fake)
    assert main(["bench", "fedavg", "--secure", "none,secagg+,dpf", "--json"]) == 0
    assert seen["protocols"] == ["none", "secagg+", "dpf"]
    assert set(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]) == {"none", "secagg+", "dpf"}
