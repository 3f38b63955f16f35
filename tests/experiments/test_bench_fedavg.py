"""``secagg bench fedavg``: bad counts are user errors (exit 2, one line), not tracebacks."""

import pytest

from experiments.cli import main


@pytest.mark.parametrize("flag", ["--rounds", "--threads"])
def test_non_positive_counts_exit_2_naming_the_flag(flag, capsys):
    assert main(["bench", "fedavg", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
