"""Layering: the HE backends import neither torch nor any layer above ``secagg``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["secagg.he", "secagg.he.ckks"])
def test_he_modules_import_no_torch_and_nothing_above_secagg(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'protocols', 'attacks', 'experiments', 'recmodels', 'dp'})\n"
        "print(','.join(bad))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT, env=env
    )
    assert out.stdout.strip() == ""


def test_public_api_is_declared() -> None:
    import secagg.he
    import secagg.he.ckks

    for mod in (secagg.he, secagg.he.ckks):
        for name in mod.__all__:
            assert hasattr(mod, name), f"{mod.__name__}.{name}"
