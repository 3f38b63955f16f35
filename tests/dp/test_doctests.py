"""The examples in the ``dp`` docstrings run and give what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", ["dp.rdp", "dp.accountant", "dp.calibration", "dp.ledger"])
def test_docstring_examples(module: str) -> None:
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_dp_core_imports_no_torch_or_sibling_packages() -> None:
    import subprocess
    import sys

    code = (
        "import sys, dp, dp.ledger; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'secagg', 'recmodels', 'protocols', 'attacks')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
